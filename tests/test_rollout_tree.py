"""The causal prefix tree: insert, lookup fallback, the P90 window, rebuild, JSON, merge, cursors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.core.errors import LibraError
from libra.rollout.base import Bucket, FinishedTrajectory, PayloadSize, Status, ToolState
from libra.rollout.cmlfq import PaperCMLFQRouter
from libra.rollout.tree import CausalTree, Cursor, Node, TrajectoryLog, remaining_lengths

S = ToolState("search", PayloadSize.SMALL, Status.SUCCESS)
F = ToolState("search", PayloadSize.SMALL, Status.FAILURE)
L = ToolState("fetch", PayloadSize.LARGE, Status.SUCCESS)
NEW = ToolState("never-seen", PayloadSize.MEDIUM, Status.TIMEOUT)


def finished(path, contexts, final, prompt="p", tid="t", step=0):
    return FinishedTrajectory(tid, prompt, step, tuple(path), tuple(contexts), final)


def test_remaining_length_at_each_turn():
    t = finished([S, L], [100, 300, 900], 1000)
    assert remaining_lengths(t) == [900, 700, 100]


def test_insert_records_remaining_length_along_the_path():
    tree = CausalTree()
    tree.insert_finished(finished([S, L], [100, 300, 900], 1000))
    root = tree.root
    assert (root.count, root.mean) == (1, 900)
    assert root.child(S).mean == 700
    assert root.child(S).child(L).mean == 100
    # the prompt's own tree records the same
    assert tree.prompts["p"].child(S).child(L).mean == 100


def test_lookup_takes_the_deepest_match_and_falls_back_to_the_parent():
    tree = CausalTree(per_prompt=False)
    tree.insert_finished(finished([S, L], [100, 300, 900], 1000))
    m = tree.lookup("p", (S, L))
    assert (m.depth, m.node.mean) == (2, 100)
    # an unseen state stops the walk: the parent answers
    m = tree.lookup("p", (S, NEW))
    assert (m.depth, m.node.mean) == (1, 700)
    m = tree.lookup("p", (NEW, S))
    assert m.depth == 0


def test_lookup_prefers_the_prompt_tree_and_respects_min_samples():
    tree = CausalTree()
    tree.insert_finished(finished([S], [100, 200], 5000, prompt="a", tid="1"))
    tree.insert_finished(finished([S], [100, 200], 400, prompt="b", tid="2"))
    m = tree.lookup("a", (S,))
    assert m.per_prompt and m.node.mean == 4800
    # min_samples 2: only the global node (2 samples) qualifies at depth 1
    m = tree.lookup("a", (S,), min_samples=2)
    assert not m.per_prompt and m.depth == 1 and m.node.mean == (4800 + 200) / 2


def test_cold_start_lookup_is_none():
    assert CausalTree().lookup("p", (S, F)) is None
    assert CausalTree().exact("p", (S,)) == (None, None)


def test_p90_over_a_bounded_window():
    node = Node()
    for x in range(1, 301):  # 1..300 with a window of 200: keeps 101..300
        node.add(x, window=200)
    assert node.count == 300
    assert len(node.samples) == 200
    assert node.mean == pytest.approx(sum(range(101, 301)) / 200)
    assert node.p90 == 280  # nearest rank: the 180th of 101..300
    node.add(10_000, window=200)
    assert node.p90 == 281 and node.samples[0] == 102


def test_max_depth_bounds_the_tree():
    tree = CausalTree(max_depth=2)
    tree.insert_finished(finished([S, S, S, S], [1, 2, 3, 4, 5], 10))
    assert tree.node_count() == 2 * 3  # global and prompt roots, each with 2 levels
    assert tree.lookup("p", (S, S, S, S)).depth == 2


def test_rebuild_every_k_steps_from_the_last_n():
    router = PaperCMLFQRouter([Bucket("s", 1, 100), Bucket("l", 2, 1000)], rebuild_every=2, history=2)
    router.on_finish(finished([F], [10, 20], 900, tid="old"))
    router.on_finish(finished([S], [10, 20], 50, tid="a"))
    router.on_finish(finished([S], [10, 20], 60, tid="b"))
    router.on_step_end(0)
    assert router.tree.lookup("p", (F,)).depth == 1  # not rebuilt yet: K = 2
    router.on_step_end(1)
    # rebuilt from the last 2 trajectories: the failure path is gone, the rest is intact
    assert router.tree.lookup("p", (F,)).depth == 0
    assert router.tree.root.count == 2 and router.tree.lookup("p", (S,)).node.mean == 35


def test_save_and_load_round_trip(tmp_path):
    tree = CausalTree(window=50)
    tree.insert_finished(finished([S, L], [100, 300, 900], 1000, prompt="a"))
    tree.insert_finished(finished([S, F], [100, 200, 700], 3000, prompt="b", tid="2"))
    tree.insert_finished(finished([ToolState("odd|name", PayloadSize.LARGE, Status.TIMEOUT)], [5, 6], 9))
    path = tmp_path / "tree.json"
    tree.save(path)
    back = CausalTree.load(path)
    assert back.to_dict() == tree.to_dict()
    assert back.window == 50
    assert back.lookup("b", (S, F)).node.mean == 2300
    assert back.lookup("x", (ToolState("odd|name", PayloadSize.LARGE, Status.TIMEOUT),)).depth == 1


def test_deep_paths_serialise_without_recursion_limits(tmp_path):
    tree = CausalTree(max_depth=5000, per_prompt=False)
    path = [S] * 3000
    tree.insert_finished(finished(path, list(range(1, 3002)), 5000))
    tree.save(tmp_path / "deep.json")
    assert CausalTree.load(tmp_path / "deep.json").node_count() == 3001


@pytest.mark.parametrize(
    "text", ["not json", "[]", json.dumps({"format": "other"}), json.dumps({"format": "libra.causal-tree/1"})]
)
def test_loading_a_malformed_file_is_a_typed_error(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(LibraError, match="causal tree"):
        CausalTree.load(p)
    with pytest.raises(LibraError):
        CausalTree.load(tmp_path / "missing.json")


def test_merge_pools_two_workers():
    a, b = CausalTree(window=4), CausalTree(window=4)
    a.insert_finished(finished([S], [10, 20], 100, prompt="x"))
    b.insert_finished(finished([S], [10, 20], 300, prompt="x", tid="2"))
    b.insert_finished(finished([L], [10, 20], 50, prompt="y", tid="3"))
    a.merge(b)
    assert a.root.count == 3
    assert a.lookup("x", (S,)).node.mean == (80 + 280) / 2
    assert a.lookup("y", (L,)).per_prompt
    assert a.node_count() == 1 + 2 + 2 + 2  # global root + 2 children; prompts x and y


def test_merge_keeps_the_window_bounded_and_recent_from_both():
    a, b = CausalTree(window=4), CausalTree(window=4)
    for x in (1, 2, 3, 4):
        a.root.add(x, 4)
    for x in (11, 12, 13, 14):
        b.root.add(x, 4)
    a.merge(b)
    assert len(a.root.samples) == 4 and a.root.count == 8
    assert set(a.root.samples) == {4, 13, 3, 14} or set(a.root.samples) == {3, 4, 13, 14}


def test_trajectory_log_is_bounded():
    log = TrajectoryLog(3)
    for i in range(10):
        log.add(finished([S], [1, 2], 10 + i, tid=str(i)))
    assert len(log) == 3


states = st.sampled_from([S, F, L, NEW])


@settings(max_examples=60, deadline=None)
@given(
    inserted=st.lists(st.lists(states, max_size=6), min_size=1, max_size=8),
    query=st.lists(states, max_size=8),
    inserts_between=st.lists(st.lists(states, max_size=6), max_size=3),
)
def test_cursor_walk_equals_a_full_walk(inserted, query, inserts_between):
    """The incremental walk a router keeps per trajectory finds exactly what a fresh walk finds,
    even when other trajectories finish (and add nodes) between its turns."""
    tree = CausalTree()
    for i, path in enumerate(inserted):
        tree.insert_finished(finished(path, list(range(1, len(path) + 2)), 100, tid=str(i)))
    cursor = Cursor()
    for k in range(len(query) + 1):
        if k < len(inserts_between):
            p = inserts_between[k]
            tree.insert_finished(finished(p, list(range(1, len(p) + 2)), 100, tid=f"x{k}"))
        got = cursor.advance(tree, tree.root, query[:k])
        assert got == tree.walk(tree.root, query[:k])

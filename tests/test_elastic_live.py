"""The live elastic join with real processes and a real gloo group (`libra.runtime.elastic`).

Every run here is checked against one run of the same core without any joiner: with the loss
divided by the step's global token count, a run in which hybrid replicas join, count, leave, hang,
send duplicates or die must end with the same parameters (to float rounding, 1e-6), and the core
replicas must be bitwise equal after every step. That one comparison is what "no gradient counted
twice or lost" means, so each fault test asserts it, whatever the fault did to the join's timing.
"""

from __future__ import annotations

import pytest
import torch

from libra.planner import JoinState
from libra.runtime.elastic import ElasticRuntimeConfig, KillPoint
from libra.runtime.elastic.local import JoinSpec, RunResult, RunSpec, run_local

pytestmark = pytest.mark.timeout(600)

# Paced (results unchanged): a join's messages and injected delays land within the run however
# loaded the machine is.
BASE = RunSpec(core=2, slots=2, steps=16, batch=8, min_len=8, max_len=40, step_min_s=0.2)
TOL = 1e-6


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> RunResult:
    res = run_local(BASE, tmp_path_factory.mktemp("reference"))
    assert [p.returncode for p in res.core] == [0, 0]
    return res


def run(tmp_path, joins: list[JoinSpec], **runtime) -> RunResult:
    spec = BASE.model_copy(update={"joins": joins, "runtime": ElasticRuntimeConfig(**runtime)})
    return run_local(spec, tmp_path)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def last_status(res: RunResult) -> dict:
    return res.core[0].steps[-1]["elastic"]


def check_invariants(res: RunResult, reference: RunResult) -> None:
    """The core finished every step, its replicas agree bitwise, and nothing was lost or doubled."""
    assert [p.returncode for p in res.core] == [0, 0]
    assert [len(p.steps) for p in res.core] == [BASE.steps, BASE.steps]
    h0, h1 = res.core[0].hashes(), res.core[1].hashes()
    assert h0 == h1 and len(h0) == BASE.steps
    for j in res.joiners:  # a joiner agrees bitwise with the core after every step it applied
        assert all(h == h0[s] for s, h in j.hashes().items() if s >= 0), f"joiner {j.index} diverged"
    assert max_diff(res.final, reference.final) <= TOL


def states_seen(res: RunResult, slot: int) -> set[str]:
    return {row["elastic"]["states"][slot] for row in res.core[0].steps}


def test_two_replicas_join_count_and_one_leaves_exactly(tmp_path, reference):
    res = run(tmp_path, [JoinSpec(slot=0, at_step=1, release_after=3), JoinSpec(slot=1, at_step=2)])
    check_invariants(res, reference)
    # Each joiner applied every step from its snapshot on, and was ACTIVE for some of them.
    assert [j.outcome for j in res.joiners] == ["released", "rolled back"]  # slot 1: the core ended
    assert all(len(j.hashes()) >= 4 for j in res.joiners)
    assert max(row["elastic"]["hybrid_active"] for row in res.core[0].steps) == 2
    end = last_status(res)
    assert (end["joins"], end["releases"], end["rollbacks"]) == (2, 1, 0)
    assert end["states"] == ["ROLLOUT", "ACTIVE"]
    for slot in (0, 1):  # states are sampled at step ends: a short one may fall between two
        seen = states_seen(res, slot)
        assert "ACTIVE" in seen and seen <= {s.name for s in JoinState}
    # Each change of the members bumps the epoch once. Two activations and one release are two or
    # three changes: two joiners that activate at the same step boundary change it once (how far
    # apart they activate depends on the machine's pace, not on the protocol).
    members = [tuple(row["elastic"]["active"]) for row in res.core[0].steps]
    changes = [b for a, b in zip([()] + members, members, strict=False) if a != b]
    assert changes[-1] == (1,) and (0, 1) in changes
    assert end["epoch"] == len(changes) and len(changes) in (2, 3)
    assert [row["elastic"]["epoch"] for row in res.core[0].steps] == sorted(
        row["elastic"]["epoch"] for row in res.core[0].steps
    )


@pytest.mark.parametrize("point", list(KillPoint))
def test_sigkill_of_the_joiner_in_each_state_rolls_it_back(tmp_path, reference, point):
    release = 2 if point == KillPoint.RELEASING else None
    res = run(tmp_path, [JoinSpec(slot=1, at_step=1, kill_at=point, kill_after=2, release_after=release)])
    check_invariants(res, reference)
    assert res.joiners[0].returncode == -9  # a real SIGKILL
    end = last_status(res)
    assert end["rollbacks"] == 1 and end["hybrid_active"] == 0
    assert end["states"] == ["ROLLOUT", "ROLLOUT"]  # the slot went back to rollout
    if point in (KillPoint.ACTIVE, KillPoint.RELEASING):
        assert end["joins"] == 1  # it counted, then died: the partner computed what it owed
    elif point == KillPoint.ACKED:
        # Killed right after acknowledging: the core commits it or sees it die first; either way
        # the rollback follows and the exactness check above holds.
        assert end["joins"] in (0, 1)
    else:
        assert end["joins"] == 0


def test_duplicated_messages_are_counted_once(tmp_path, reference):
    dup = ["RESTORED", "ZERO", "ACK", "GRAD"]
    res = run(tmp_path, [JoinSpec(slot=0, at_step=1, duplicate=dup, release_after=3)])
    check_invariants(res, reference)
    end = last_status(res)
    assert (end["joins"], end["releases"], end["rollbacks"]) == (1, 1, 0)
    assert end["rejected"] >= 1 + 3  # the second RESTORED and ACK, and each active step's second GRAD


def test_gradients_later_than_the_timeout_are_computed_by_the_partner(tmp_path, reference):
    """An ACTIVE joiner hangs past `grad_timeout_s`: its partner computes its samples, rolls it
    back, and the late gradients are refused."""
    late = JoinSpec(slot=0, at_step=1, delay_s={"GRAD": 3.0}, delay_times=2)
    res = run(tmp_path, [late], grad_timeout_s=0.5)
    check_invariants(res, reference)
    end = last_status(res)
    assert (end["joins"], end["rollbacks"]) == (1, 1)
    assert res.joiners[0].outcome == "rolled back"


@pytest.mark.parametrize("kind", ["ACK", "ZERO", "RESTORED"])
def test_delayed_join_messages_never_hold_the_core(tmp_path, reference, kind):
    """A delayed acknowledgement, zero or restore notice: the core goes on; the join either
    completes later (late messages refused) or is rolled back, and nothing is counted wrongly."""
    res = run(tmp_path, [JoinSpec(slot=1, at_step=1, delay_s={kind: 1.5})], fetch_timeout_s=1.0)
    check_invariants(res, reference)
    end = last_status(res)
    assert end["joins"] + end["rollbacks"] >= 1
    assert (end["rollbacks"] == 1) == (end["states"][1] == "ROLLOUT")
    assert end["states"][1] in ("ROLLOUT", "ACTIVE", "ZERO_SYNC", "ACTIVATING")


def test_a_joiner_for_a_busy_slot_is_turned_away(tmp_path, reference):
    res = run(tmp_path, [JoinSpec(slot=0, at_step=1), JoinSpec(slot=0, at_step=4)])
    check_invariants(res, reference)
    assert res.joiners[1].outcome == "rolled back" and len(res.joiners[1].hashes()) == 0
    end = last_status(res)
    assert end["joins"] == 1 and end["rejected"] >= 1


def test_join_states_are_the_planner_state_machine():
    assert [s.name for s in JoinState][:6] == [
        "ROLLOUT", "REQUESTED", "FETCHING_STATE", "ZERO_SYNC", "ACTIVATING", "ACTIVE",
    ]  # fmt: skip

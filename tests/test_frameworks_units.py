"""The pieces behind the framework integrations, without processes: the prefix index (affinity
without a session key), vLLM's packed-buffer rule, min_tokens, the one-server merge of a broadcast's
answers, and the token count of /inference/v1/generate answers."""

from __future__ import annotations

import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.runtime.engine.constraints import END
from libra.runtime.engine.sequence import SeqEvent, TextOutput
from libra.runtime.engine.weight_sync import TensorSpec, nbytes, packed_chunks
from libra.runtime.gateway.affinity import PrefixIndex, continuations, prompt_units
from libra.runtime.gateway.control import OPS, one_server
from libra.runtime.gateway.upstream import tokens_usage

tokens = st.lists(st.integers(0, 271), min_size=1, max_size=200)


@settings(max_examples=60)
@given(prompt=tokens, response=tokens, more=tokens, block=st.integers(1, 16))
def test_a_turn_that_extends_a_recorded_one_finds_its_instance(prompt, response, more, block):
    idx = PrefixIndex(block=block)
    idx.record(tuple(prompt + response), "a")
    assert idx.lookup(tuple(prompt + response + more)) == "a"  # the next turn
    assert idx.lookup(tuple(prompt + response)) is None  # not strictly longer: a repeat, not a next turn


@settings(max_examples=60)
@given(prompt=tokens, r1=tokens, r2=tokens, more=tokens, block=st.integers(1, 16))
def test_grpo_siblings_do_not_follow_each_other_and_the_longest_record_wins(prompt, r1, r2, more, block):
    idx = PrefixIndex(block=block)
    idx.record(tuple(prompt + r1), "a")
    idx.record(tuple(prompt + r2), "b")
    assert idx.lookup(tuple(prompt)) is None  # a sibling's first turn (same prompt) starts fresh
    if r1[: len(r2)] != r2 and r2[: len(r1)] != r1:  # responses that diverge: each finds its own
        assert idx.lookup(tuple(prompt + r1 + more)) == "a"
        assert idx.lookup(tuple(prompt + r2 + more)) == "b"
    idx.record(tuple(prompt + r1 + more), "c")  # a later turn of a's trajectory, moved
    assert idx.lookup(tuple(prompt + r1 + more + [1])) == "c"


def test_the_index_is_bounded_and_text_never_matches_tokens():
    idx = PrefixIndex(block=4, capacity=3)
    for i in range(10):
        idx.record(tuple(range(i, i + 9)), f"i{i}")
    assert len(idx) == 3 and idx.lookup(tuple(range(0, 12))) is None  # the oldest went first
    assert idx.lookup(tuple(range(9, 21))) == "i9"
    idx.record("hello world", "t")
    assert idx.lookup("hello world, again") == "t" and idx.lookup(tuple(b"hello world, again")) is None


def test_what_a_request_and_its_answer_are_as_sequences():
    assert prompt_units("generate", {"input_ids": [1, 2]}, None) == (1, 2)
    assert prompt_units("generate", {"input_ids": [[1], [2]]}, None) is None  # a batch is not followed
    assert prompt_units("completions", {"prompt": "ab"}, None) == "ab"
    assert prompt_units("tokens", {"token_ids": [3]}, None) == (3,)
    assert continuations("generate", (1, 2), {"output_ids": [5], "text": "x"}) == [(1, 2, 5)]
    assert continuations("tokens", (3,), {"choices": [{"token_ids": [4]}, {"token_ids": [5, 6]}]}) == [(3, 4), (3, 5, 6)]  # fmt: skip
    assert continuations("completions", "ab", {"choices": [{"text": "c"}]}) == ["abc"]
    # a chat's next turn resends the assistant's reply: the rendering of both must agree
    call = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    msgs = [{"role": "user", "content": "hi"}]
    first = prompt_units("chat", {}, msgs)
    (recorded,) = continuations("chat", first, {"choices": [{"message": reply}]})
    resent = {k: v for k, v in reply.items() if v is not None}  # the openai client drops content=None
    nxt = prompt_units("chat", {}, [*msgs, resent, {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    assert nxt.startswith(recorded) and len(nxt) > len(recorded)


@settings(max_examples=60)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=30), buffer=st.integers(1, 200))
def test_packed_chunks_cut_where_vllms_producer_does(sizes, buffer):
    specs = [TensorSpec(f"t{i}", torch.float32, (n,)) for i, n in enumerate(sizes)]
    chunks = packed_chunks(specs, buffer)
    assert [s for c in chunks for s in c] == specs  # every tensor once, in order
    for c in chunks[:-1]:  # a buffer closes right after the tensor that takes it past the size
        assert sum(nbytes(s) for s in c) > buffer >= sum(nbytes(s) for s in c[:-1])
    assert sum(nbytes(s) for s in chunks[-1][:-1]) <= buffer


@settings(max_examples=60)
@given(n=st.integers(1, 12), stop=st.integers(0x20, 0x7E))
def test_min_tokens_masks_the_end_and_stop_tokens_until_reached(n, stop):
    out = TextOutput(stops=(chr(stop),), stop_ids=frozenset({stop}), min_tokens=n)
    for i in range(n):
        allowed = out.constraint.allowed(100)
        assert END not in allowed and stop not in allowed
        tok = min(allowed)  # any allowed token: nothing may end the text yet
        assert out.feed(tok, SeqEvent(0)) is None, i
    assert END in out.constraint.allowed(100) and stop in out.constraint.allowed(100)
    assert out.feed(END, SeqEvent(0)) == "stop"


def test_a_broadcast_answers_as_one_server_would():
    answers = {"e0": {"success": True, "weight_version": "3"}, "e1": {"success": True, "weight_version": "3"}}
    assert one_server(OPS["get_weight_version"], answers, True)["weight_version"] == "3"
    answers["e1"]["weight_version"] = "2"
    assert one_server(OPS["get_weight_version"], answers, True)["weight_version"] is None  # they disagree
    assert one_server(OPS["pause_generation"], {"e0": {"success": True}, "e1": {"success": False}}, False)["success"] is False  # fmt: skip
    sleeping = {"e0": {"is_sleeping": True}, "e1": {"is_sleeping": False}}
    assert one_server(OPS["is_sleeping"], sleeping, True)["is_sleeping"] is False
    rpc = {"e0": {"results": [None]}, "e1": {"results": [1]}}
    assert one_server(OPS["collective_rpc"], rpc, True)["results"] == [None, 1]


def test_tokens_usage_counts_the_choices_token_ids_without_decoding():
    body = json.dumps({"choices": [{"token_ids": [1, 2, 3]}, {"token_ids": [4]}, {"token_ids": []}]}).encode()
    assert tokens_usage(body, 7) == {"prompt_tokens": 7, "completion_tokens": 4}
    assert tokens_usage(b'{"choices": []}', None) == {"completion_tokens": 0}

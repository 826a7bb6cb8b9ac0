"""The built-in engine's pure parts: tokenizer, template, constraints, stop strings, the paged
allocator and the batching scheduler, the tool-call rule and the config. No model, no HTTP."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra.core.config import build
from libra.core.errors import ConfigError
from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.constraints import END, ToolCallGrammar, Utf8Text
from libra.runtime.engine.kv_cache import BlockAllocator
from libra.runtime.engine.protocol import ChatRequest, tool_mode
from libra.runtime.engine.scheduler import Scheduler
from libra.runtime.engine.sequence import (
    FinishReason,
    SamplingParams,
    SeqEvent,
    SeqStatus,
    Sequence,
    TextOutput,
    ToolOutput,
)
from libra.runtime.engine.tokenizer import (
    NUM_BYTES,
    ChatMessage,
    Special,
    ToolCallText,
    decode,
    encode,
    render,
    render_chat,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- tokenizer and template ------------------------------------------------------------------------


@given(st.text())
def test_bytes_round_trip(text):
    ids = encode(text)
    assert all(0 <= i < NUM_BYTES for i in ids)
    assert decode(ids) == text


@given(st.text(), st.text())
def test_content_can_never_forge_a_special_token(system, user):
    ids = render_chat([ChatMessage("system", system), ChatMessage("user", user)])
    specials = [i for i in ids if i >= NUM_BYTES]
    assert specials == [
        Special.BOS,
        Special.SYSTEM,
        Special.END,
        Special.USER,
        Special.END,
        Special.ASSISTANT,
    ]


def test_template_renders_tool_calls_and_results():
    msgs = [
        ChatMessage("user", "weather?"),
        ChatMessage("assistant", "", (ToolCallText("get_weather", '{"city": "Oslo"}'),)),
        ChatMessage("tool", "rain", tool_call_id="call_1"),
    ]
    text = render(render_chat(msgs, tools=[{"type": "function", "function": {"name": "get_weather"}}]))
    assert text == (
        '<|bos|><|tools|>[{"type":"function","function":{"name":"get_weather"}}]<|end|>'
        "<|user|>weather?<|end|>"
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|end|>'
        "<|tool|>call_1\nrain<|end|><|assistant|>"
    )


# ---- constraints ---------------------------------------------------------------------------------


def walk(constraint, budget: int, data, until_done: bool = True) -> list[int]:
    """Take any allowed token at each step (chosen by hypothesis), like a sampler would."""
    out: list[int] = []
    while budget > 0 and not constraint.done:
        allowed = sorted(constraint.allowed(budget))
        assert allowed, "a constraint must always allow something"
        tok = data.draw(st.sampled_from(allowed))
        constraint.advance(tok)
        out.append(tok)
        budget -= 1
    return out


@FAST
@given(st.data(), st.integers(1, 40), st.booleans())
def test_text_is_always_valid_utf8_even_when_cut_by_the_budget(data, budget, allow_end):
    toks = walk(Utf8Text(allow_end), budget, data)
    body = bytes(t for t in toks if t != END)
    assert END not in toks[:-1]
    assert allow_end or len(toks) == budget, "ignore_eos text runs to the budget"
    body.decode("utf-8")  # strict: raises on any invalid or truncated character
    assert all(b >= 0x20 or b in (9, 10, 13) for b in body)


SCHEMA = st.recursive(
    st.sampled_from(
        [
            {"type": "string"},
            {"type": "integer"},
            {"type": "number"},
            {"type": "boolean"},
            {"type": "null"},
            {"enum": ["a", "ab", 3, True]},
            {"type": ["string", "null"]},
            {},
        ]
    ),
    lambda inner: st.one_of(
        st.builds(lambda it: {"type": "array", "items": it}, inner),
        st.dictionaries(st.text(min_size=1, max_size=6), inner, max_size=3).map(
            lambda props: {"type": "object", "properties": props}
        ),
    ),
    max_leaves=6,
)
TOOLS = st.dictionaries(
    st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
    st.dictionaries(st.text(min_size=1, max_size=8), SCHEMA, max_size=4).map(
        lambda props: {"type": "object", "properties": props}
    ),
    min_size=1,
    max_size=4,
)


def conforms(value, schema) -> bool:
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "array": lambda v: isinstance(v, list) and all(conforms(x, schema["items"]) for x in v),
        "object": lambda v: (
            isinstance(v, dict) and all(conforms(v[k], s) for k, s in schema.get("properties", {}).items())
        ),
    }
    return checks.get(kind, lambda v: isinstance(v, str))(value)


@FAST
@given(st.data(), TOOLS)
def test_tool_grammar_always_yields_a_parseable_call_for_a_declared_tool(data, tools):
    g = ToolCallGrammar(tools)
    toks = walk(g, 10_000, data)
    assert g.done and toks[0] == Special.TOOL_CALL and toks[-1] == Special.TOOL_CALL_END
    call = json.loads(bytes(toks[1:-1]).decode())
    assert call["name"] in tools and call["name"] == g.name
    assert set(call["arguments"]) == set(tools[call["name"]]["properties"])
    assert conforms(call["arguments"], tools[call["name"]])


@FAST
@given(st.data(), TOOLS, st.integers(0, 60))
def test_tool_grammar_fits_any_budget_that_holds_its_shortest_form(data, tools, slack):
    g = ToolCallGrammar(tools)
    budget = g.min_left() + slack
    toks = walk(g, budget, data)
    assert g.done, "the call must complete within a budget that holds its shortest form"
    assert len(toks) <= budget


def test_tool_output_streams_arguments_after_announcing_the_name():
    out = ToolOutput({"calc": {"type": "object", "properties": {"x": {"type": "integer"}}}}, call_id="call_1")
    evs = []
    for tok in [Special.TOOL_CALL, *b'{"name": "calc", "arguments": {"x": 42}}', Special.TOOL_CALL_END]:
        ev = SeqEvent(0)
        evs.append((ev, out.feed(tok, ev)))
    announced = [i for i, (ev, _) in enumerate(evs) if ev.tool_call]
    first_arg = next(i for i, (ev, _) in enumerate(evs) if ev.tool_args)
    assert evs[announced[0]][0].tool_call == ("call_1", "calc") and len(announced) == 1
    assert announced[0] <= first_arg
    assert "".join(ev.tool_args for ev, _ in evs) == '{"x": 42}'
    assert [r for _, r in evs][-1] == FinishReason.TOOL_CALLS and all(r is None for _, r in evs[:-1])


# ---- stop strings --------------------------------------------------------------------------------


@FAST
@given(
    st.text(alphabet="abc", max_size=40),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
)
def test_stop_strings_cut_at_the_first_occurrence_and_are_never_streamed(text, stops):
    out = TextOutput(tuple(stops))
    streamed, reason = "", None
    for b in text.encode():
        ev = SeqEvent(0)
        reason = out.feed(b, ev)
        streamed += ev.text
        if reason:
            break
    if reason is None:
        ev = SeqEvent(0)
        out.flush(ev)
        streamed += ev.text
    ends = [(text.find(s) + len(s), len(s)) for s in stops if s in text]
    first = min(e for e, _ in ends) if ends else None
    expected = text[: first - max(n for e, n in ends if e == first)] if ends else text
    assert reason == (FinishReason.STOP if ends else None)
    assert streamed == expected
    assert not any(s in streamed for s in stops)


# ---- allocator and scheduler ---------------------------------------------------------------------


def make_seq(rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    out = TextOutput()
    return Sequence(rid, 0, [1] * prompt_len, SamplingParams(max_tokens, 0.0), out, None, 10_000)


def check_blocks(alloc: BlockAllocator, seqs: list[Sequence]) -> None:
    held = [b for s in seqs for b in s.blocks]
    assert len(held) == len(set(held)), "a block is held twice"
    assert 0 not in held, "the null block was handed out"
    assert len(held) + alloc.free_count == alloc.num_blocks - 1, "a block was lost"


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 120), st.integers(1, 30)), min_size=1, max_size=25),
    st.integers(9, 40),
    st.integers(1, 8),
    st.integers(16, 64),
    st.data(),
)
def test_scheduler_loses_nothing_and_never_exceeds_capacity(reqs, num_blocks, max_seqs, budget, data):
    alloc = BlockAllocator(num_blocks, 16)
    sched = Scheduler(alloc, max_seqs, max(budget, max_seqs), chunk=32)
    seqs = [make_seq(f"r{i}", min(p, 16 * (num_blocks - 2)), m) for i, (p, m) in enumerate(reqs)]
    for s in seqs:
        sched.add(s)
    for _ in range(5000):
        if not sched.has_work:
            break
        plan = sched.schedule()
        assert len(sched.running) <= max_seqs
        assert plan.num_tokens <= max(budget, max_seqs)
        for c in plan.chunks:
            assert c.seq.status == SeqStatus.RUNNING and len(c.seq.blocks) * 16 >= c.start + c.n
            assert c.start == c.seq.num_computed
        check_blocks(alloc, seqs)
        for c in plan.chunks:  # what the runner and core would do
            c.seq.num_computed += c.n
            if c.samples:
                c.seq.tokens.append(7)
                if c.seq.budget() <= 0:
                    sched.finish(c.seq, FinishReason.LENGTH)
        if data.draw(st.integers(0, 9)) == 0:
            live = [s for s in seqs if s.status != SeqStatus.FINISHED]
            if live:
                sched.finish(data.draw(st.sampled_from(live)), FinishReason.ABORT)
    assert not sched.has_work, "the scheduler stalled"
    assert all(s.status == SeqStatus.FINISHED for s in seqs)
    assert all(s.n_generated == s.params.max_tokens for s in seqs if s.finish_reason == FinishReason.LENGTH)
    assert alloc.free_count == num_blocks - 1


def test_scheduler_preempts_the_newest_when_blocks_run_out():
    alloc = BlockAllocator(6, 4)  # 5 usable blocks of 4 tokens
    sched = Scheduler(alloc, 4, 64, chunk=64)
    a, b = make_seq("a", 7, 10), make_seq("b", 7, 10)
    sched.add(a)
    sched.add(b)
    plans = []
    for _ in range(3):
        plans.append(sched.schedule())
        for c in plans[-1].chunks:
            c.seq.num_computed += c.n
            c.seq.tokens.append(1)
    assert [c.seq for c in plans[0].prefills] == [a, b] and not plans[1].preempted
    # Step 3 writes position 8: each needs a third block, and there is room for one only.
    assert plans[2].preempted == [b] and [c.seq for c in plans[2].chunks] == [a]
    assert b.status == SeqStatus.WAITING and sched.waiting[0] is b and b.num_computed == 0 and not b.blocks


def test_sequence_transitions_check_their_starting_state():
    s = make_seq("x", 3, 3)
    with pytest.raises(RuntimeError):
        s.preempt()
    s.admit(0)
    with pytest.raises(RuntimeError):
        s.admit(1)
    s.finish(FinishReason.STOP)
    with pytest.raises(RuntimeError):
        s.finish(FinishReason.STOP)


# ---- the tool-call rule and configuration ----------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def chat(messages, **kw) -> ChatRequest:
    return build(ChatRequest, {"model": "tiny", "messages": messages, **kw})


def test_tool_rule_calls_then_answers():
    user = {"role": "user", "content": "hi"}
    call = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": "c1", "content": "sun"}
    assert tool_mode(chat([user]), 1) is None
    assert set(tool_mode(chat([user], tools=[WEATHER]), 1)) == {"get_weather"}
    assert tool_mode(chat([user, call, result], tools=[WEATHER]), 1) is None
    assert tool_mode(chat([user, call, result], tools=[WEATHER], libra_tool_rounds=2), 1) is not None
    assert tool_mode(chat([user], tools=[WEATHER], tool_choice="none"), 1) is None
    assert tool_mode(chat([user, call, result], tools=[WEATHER], tool_choice="required"), 1) is not None
    assert tool_mode(chat([user, call, result, user], tools=[WEATHER]), 1) is not None
    named = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(ConfigError):
        tool_mode(chat([user], tools=[WEATHER], tool_choice=named), 1)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"kv_cache_mb": 2}, "kv_cache_mb"),
        ({"max_num_seqs": 600}, "max_num_batched_tokens"),
        ({"model": "huge"}, "model"),
        ({"threads": 0}, "threads"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(fields, field):
    with pytest.raises(ConfigError) as e:
        build(EngineConfig, fields)
    assert e.value.field == field


def test_merge_folds_queued_events_per_choice_in_order():
    from libra.runtime.engine.server import merge

    evs = [
        SeqEvent(0, text="a"),
        SeqEvent(1, tool_call=("call_1", "f")),
        SeqEvent(0, text="b"),
        SeqEvent(1, tool_args='{"x": '),
        SeqEvent(1, tool_args="1}", finish=FinishReason.TOOL_CALLS, prompt_tokens=5, completion_tokens=9),
    ]
    first, second = merge(evs)
    assert (first.index, first.text, first.finish) == (0, "ab", None)
    assert second.tool_call == ("call_1", "f") and second.tool_args == '{"x": 1}'
    assert (second.finish, second.prompt_tokens, second.completion_tokens) == (FinishReason.TOOL_CALLS, 5, 9)
    assert evs[0].text == "a", "merging must not change the queued events"

"""The built-in engine as users see it: `libra serve engine` as a real subprocess on loopback,
driven by the official `openai` client (chat, streaming, tools, multi-turn, completions), plus
raw HTTP for bad requests, health, metrics and client disconnects."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import socket
import urllib.error
import urllib.request

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import run_cli, wait_for
from tests.engine_fixtures import engine, engine_factory  # noqa: F401

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}
USER = {"role": "user", "content": "What is the weather in Oslo?"}


@pytest.fixture(scope="module")
def client(engine):  # noqa: F811
    with openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0, timeout=600) as c:
        yield c


def post(engine, path: str, body: bytes | dict, timeout: float = 300) -> tuple[int, dict]:  # noqa: F811
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(engine.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- discovery -------------------------------------------------------------------------------------


def test_models_and_health(engine, client):  # noqa: F811
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = engine.get("/health")
    assert health["status"] == "ok" and health["tp_label"] == "tp1" and health["max_model_len"] == 8192


# ---- chat ------------------------------------------------------------------------------------------


def test_chat_completion_shape_and_usage(client):
    r = client.chat.completions.create(model="tiny", messages=[USER], max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 24
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 24
    again = client.chat.completions.create(model="tiny", messages=[USER], max_tokens=24, temperature=0)
    assert again.choices[0].message.content == choice.message.content  # greedy is deterministic


def test_seeded_sampling_and_n_choices(client):
    kw = dict(model="tiny", messages=[USER], max_tokens=16, temperature=1.0, seed=42, n=3)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1


def test_streaming_matches_non_streaming(client):
    kw = dict(model="tiny", messages=[USER], max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_logprobs_cover_every_generated_token(client):
    r = client.chat.completions.create(
        model="tiny", messages=[USER], max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for lp in content:
        top = [t.logprob for t in lp.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and lp.logprob <= top[0] + 1e-6 <= 1e-6
        for t in lp.top_logprobs:  # the same token has the same log-probability in both places
            if t.bytes == lp.bytes:
                assert abs(t.logprob - lp.logprob) < 1e-5
    # Streamed, no token's log-probability goes missing, not even for the first bytes of a
    # multi-byte character, whose text only arrives with its last byte.
    kw = dict(model="tiny", messages=[USER], max_tokens=60, temperature=1.0, seed=3, logprobs=True)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content
    ]
    assert len(streamed) == chunks[-1].usage.completion_tokens
    assert b"".join(bytes(lp.bytes) for lp in streamed if len(lp.bytes) == 1).decode() == "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices
    )


# ---- tool calls ------------------------------------------------------------------------------------


def tool_call_of(r):
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    return call


def test_tool_call_then_answer_multi_turn(client):
    r = client.chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER, SEARCH], temperature=0)
    call = tool_call_of(r)
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and isinstance(args["city"], str)
    else:
        assert call.function.name == "search" and set(args) == {"query"}
    history = [
        USER,
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Rain, 11 degrees."},
    ]
    final = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER, SEARCH], max_tokens=20
    )
    assert (
        final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
    )
    assert final.usage.prompt_tokens > r.usage.prompt_tokens
    # Asking for two rounds makes the second turn call again; a new user message starts over.
    again = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], extra_body={"libra_tool_rounds": 2}
    )
    assert tool_call_of(again).function.name == "get_weather"


def test_tool_choice_none_named_and_streamed(client):
    plain = client.chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"
    named = {"type": "function", "function": {"name": "search"}}
    kw = dict(model="tiny", messages=[USER], tools=[WEATHER, SEARCH], tool_choice=named, temperature=0)
    whole = tool_call_of(client.chat.completions.create(**kw))
    assert whole.function.name == "search"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id == whole.id or deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "search"
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_call_cut_by_max_tokens_says_length(client):
    r = client.chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER], max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


# ---- completions -----------------------------------------------------------------------------------


def test_completions_and_stop_strings(client):
    r = client.completions.create(model="tiny", prompt="The answer is", max_tokens=30, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    text = r.choices[0].text
    stop = text[10:13] if len(text) >= 13 else None
    if stop:  # greedy repeats itself, so the cut is at the stop string's first occurrence
        cut = client.completions.create(model="tiny", prompt="The answer is", max_tokens=30, temperature=0, stop=[stop])  # fmt: skip
        assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    many = client.completions.create(model="tiny", prompt=["a", "bb"], max_tokens=4, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == 2 + 3


def test_streamed_completion_and_ignore_eos(client):
    kw = dict(model="tiny", prompt="x", max_tokens=20, temperature=0)
    whole = client.completions.create(**kw)
    parts = list(client.completions.create(**kw, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    full = client.completions.create(
        model="tiny", prompt="x", max_tokens=50, n=4, extra_body={"ignore_eos": True}
    )
    assert full.usage.completion_tokens == 4 * 50 and {c.finish_reason for c in full.choices} == {"length"}


# ---- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b'{"model": "tiny", "messages": [', 400, None),
        (b"[1, 2]", 400, None),
        ({"model": "tiny"}, 400, "messages"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "gpt-9", "messages": [USER]}, 404, "model"),
        ({"model": "tiny", "messages": [USER], "max_tokens": -3}, 400, "max_tokens"),
        ({"model": "tiny", "messages": [USER], "temperature": 7}, 400, "temperature"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0"),
        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
        (
            {
                "model": "tiny",
                "messages": [USER],
                "tools": [{"type": "function", "function": {"name": "a b"}}],
            },
            400,
            None,
        ),  # fmt: skip
        (
            {
                "model": "tiny",
                "messages": [USER],
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            400,
            "tool_choice.function.name",
        ),  # fmt: skip
        ({"model": "tiny", "messages": [USER], "presence_penalty": 1.0}, 400, None),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 9000}]}, 400, "messages"),
    ],
)
def test_bad_requests_get_4xx_json(engine, body, status, param):  # noqa: F811
    code, err = post(engine, "/v1/chat/completions", body)
    assert code == status
    assert set(err["error"]) >= {"message", "type", "param", "code"} and err["error"]["message"]
    if param:
        assert err["error"]["param"] == param


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}',
            "stop[0]",
        ),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
        (b"[" * 50_000 + b"]" * 50_000, None),
    ],
)
def test_bodies_json_loads_accepts_but_the_engine_cannot_use_are_400(engine, raw, param):  # noqa: F811
    """An unpaired surrogate reached the tokenizer, NaN is not JSON, and deep nesting was a
    RecursionError: each was a 500."""
    code, err = post(engine, "/v1/chat/completions", raw)
    assert code == 400 and err["error"]["param"] == param, err
    assert engine.get("/health")["status"] == "ok"


def test_extreme_but_valid_sampling_and_tool_schemas_are_served(client):
    """A temperature or top_p that underflows (1e-300, 5e-324) samples greedily instead of failing
    the engine step; a tool schema with junk where types and required names go (a dict, a list,
    a number) is read as leniently as a missing one."""
    full = {"ignore_eos": True}
    greedy = client.chat.completions.create(model="tiny", messages=[USER], max_tokens=6, temperature=0, extra_body=full)  # fmt: skip
    for kw in ({"temperature": 1e-300}, {"top_p": 5e-324}, {"temperature": 1e-45, "top_p": 1e-45}):
        r = client.chat.completions.create(model="tiny", messages=[USER], max_tokens=6, extra_body=full, **kw)
        assert r.choices[0].finish_reason == "length"
        if "temperature" in kw:
            assert r.choices[0].message.content == greedy.choices[0].message.content
    for params in (
        {"type": "object", "properties": {"a": {"type": {"x": 1}}}, "required": 5},
        {"type": "object", "properties": {"a": {"type": [["x"]]}}, "required": [{}, ["a"], "a"]},
        {"type": ["object"], "properties": {"a": {"type": "array", "items": {"type": [1, 2]}}}},
    ):
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        r = client.chat.completions.create(model="tiny", messages=[USER], tools=[tool], tool_choice="required", max_tokens=60)  # fmt: skip
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "f" and isinstance(json.loads(call.function.arguments), dict)


any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=8,
)
tiny_floats = st.sampled_from([1e-300, 5e-324, 1e-45, 2.0, 0.0])  # the underflows that failed a step
CHAT = {"model": "tiny", "messages": [USER], "max_tokens": 4, "tools": [WEATHER]}
CHAT_FIELDS = ["messages", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs",
               "top_logprobs", "tools", "tool_choice", "user", "stream"]  # fmt: skip


def _tool(parameters: object) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# Where junk goes one level down: a message's content, and the parts of a tool schema the
# constrained decoder reads (a property's type, the required names, a property itself).
NESTED = {
    "content": lambda v: {**CHAT, "messages": [{"role": "user", "content": v}]},
    "type": lambda v: {**CHAT, "tools": [_tool({"type": "object", "properties": {"a": {"type": v}}})]},
    "required": lambda v: {
        **CHAT,
        "tools": [_tool({"type": "object", "properties": {"a": {}}, "required": v})],
    },
    "property": lambda v: {**CHAT, "tools": [_tool({"type": "object", "properties": {"a": v}})]},
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    field=st.sampled_from(CHAT_FIELDS),
    nested=st.sampled_from(sorted(NESTED)),
    value=json_values | tiny_floats,
)
def test_a_body_with_one_junk_field_gets_an_answer_below_500(engine, field, nested, value):  # noqa: F811
    """One field at a time set to junk reaches the code behind validation, at the top level and
    one level down."""
    for body in ({**CHAT, field: value}, NESTED[nested](value)):
        code, out = post(engine, "/v1/chat/completions", body)
        assert code < 500, (body, out)


def test_oversize_body_unknown_route_and_wrong_method(engine):  # noqa: F811
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * (9 * 2**20)}]}).encode()
    code, err = post(engine, "/v1/chat/completions", big)
    assert code == 413 and "--max-body-mb" in err["error"]["message"]
    code, err = post(engine, "/v1/nothing", {})
    assert code == 404 and err["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(engine.url + "/v1/chat/completions", timeout=300)
    assert e.value.code == 405 and json.loads(e.value.read())["error"]["message"]
    assert engine.get("/health")["status"] == "ok"


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[USER])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[USER], max_tokens=0)
    assert "max_tokens" in str(e.value)


# ---- load, batching and cancellation -----------------------------------------------------------


def concurrent_requests(engine, n: int) -> None:  # noqa: F811
    """`n` requests at once, a quarter each: plain, long prompt, tool call (default budget), streamed.
    The engine is paused while they arrive, so all of them wait together and start in one batch
    (whatever the machine's pace); every one completes."""

    async def one(c: openai.AsyncOpenAI, i: int):
        msgs = [{"role": "user", "content": f"request {i} " + ("long " * 60 if i % 4 == 1 else "")}]
        if i % 4 == 2:
            return await c.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER])
        if i % 4 == 3:
            stream = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=32, stream=True)
            return [chunk async for chunk in stream]
        return await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=32)

    async def main():
        async with openai.AsyncOpenAI(
            base_url=engine.base_url, api_key="unused", max_retries=0, timeout=600
        ) as c:
            calls = [asyncio.create_task(one(c, i)) for i in range(n)]
            await asyncio.to_thread(wait_for, lambda: engine.get("/health")["waiting"] == n, "all queued")
            assert (await asyncio.to_thread(post, engine, "/continue_generation", {}))[0] == 200
            return await asyncio.gather(*calls)

    before = metric(engine.metrics(), "libra_engine_generation_tokens_total")
    assert post(engine, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        results = asyncio.run(main())
    finally:
        post(engine, "/continue_generation", {})
    generated = 0
    for i, r in enumerate(results):
        if i % 4 == 3:
            assert r[0].choices[0].delta.role == "assistant"
            assert r[-1].choices[0].finish_reason in ("stop", "length")
            continue
        if i % 4 == 2:
            assert json.loads(tool_call_of(r).function.arguments)["unit"] in ("c", "f")
        else:
            assert (
                r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content is not None
            )
        generated += r.usage.completion_tokens
    text = engine.metrics()
    assert metric(text, "libra_engine_peak_running_seqs") > 1, "continuous batching never batched"
    single = metric(text, 'libra_engine_step_batch_size_bucket{le="1.0"}')
    assert single < metric(text, "libra_engine_step_batch_size_count"), (
        "no step ever ran more than one sequence"
    )
    assert metric(text, "libra_engine_generation_tokens_total") - before >= generated
    assert engine.get("/health")["running"] == 0


def test_concurrent_requests_all_complete_and_batch(engine):  # noqa: F811
    """16 at once (64, the engine's max_num_seqs, in benchmarks/bench_live_scale.py)."""
    concurrent_requests(engine, 16)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_sequence(engine, stream):  # noqa: F811
    body = json.dumps(
        {"model": "tiny", "messages": [USER], "max_tokens": 7000, "stream": stream, "ignore_eos": True}
    )
    aborted = metric(engine.metrics(), 'libra_engine_sequences_finished_total{reason="abort"}')
    with socket.create_connection(("127.0.0.1", engine.port), timeout=300) as s:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"  # fmt: skip
        s.sendall(head.encode() + body.encode())
        wait_for(lambda: engine.get("/health")["running"] > 0, "the request running")
        assert engine.get("/health")["running"] == 1
    # 7000 tokens would keep it running for minutes: only the abort ends it before the limit.
    wait_for(lambda: engine.get("/health")["running"] == 0, "the sequence stopped after its client left")
    assert metric(engine.metrics(), 'libra_engine_sequences_finished_total{reason="abort"}') == aborted + 1


def test_metrics_are_prometheus_text(engine):  # noqa: F811
    text = engine.metrics()
    for name in (
        "libra_engine_http_requests_total",
        "libra_engine_generation_tokens_total",
        "libra_engine_running_seqs",
        "libra_engine_waiting_seqs",
        "libra_engine_step_seconds_bucket",
        "libra_engine_time_to_first_token_seconds_count",
    ):
        assert re.search(rf"^{name}(\{{.*\}})? [0-9.e+-]+$", text, re.M), name


# ---- the command line ------------------------------------------------------------------------------


def test_checkpoint_save_and_load_through_the_cli(engine_factory, engine, tmp_path):  # noqa: F811
    """Seed-0 weights saved, then served by an engine told --seed 5: it must answer like seed 0.
    (That different seeds give different answers is checked in test_engine_model.)"""
    ckpt = tmp_path / "tiny-seed0.pt"
    r = run_cli("serve", "engine", "--seed", "0", "--save-checkpoint", str(ckpt))
    assert r.returncode == 0 and ckpt.exists(), r.stderr
    loaded = engine_factory("--checkpoint", str(ckpt), "--seed", "5")
    ask = {"model": "tiny", "messages": [USER], "max_tokens": 24, "temperature": 0}
    out = [
        post(e, "/v1/chat/completions", ask)[1]["choices"][0]["message"]["content"] for e in (loaded, engine)
    ]
    assert out[0] == out[1], "a checkpoint must reproduce the weights it was saved from"
    # This engine is stopped anyway, so check the drain on the way: a request still running at
    # SIGTERM gets a JSON 503 (after a 5 s grace) and the process exits 0.
    endless = {**ask, "max_tokens": 8000, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, loaded, "/v1/chat/completions", endless, 600)
        wait_for(lambda: loaded.get("/health")["running"] > 0, "the request running")
        assert loaded.stop() == 0, "SIGTERM should shut the engine down cleanly"
        code, err = pending.result()
    assert code == 503 and "shutting down" in err["error"]["message"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--checkpoint", "/nonexistent/x.pt"], "--checkpoint"),
        (["--kv-cache-mb", "1"], "--kv-cache-mb"),
        (["--model", "huge"], "--model"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--kv-cache-mb", "100000000"], "this machine's memory"),  # hung allocating 100 TB
        (["--max-body-mb", "1e308"], "--max-body-mb"),  # was an OverflowError traceback
        (["--tp-label", "tp\x01"], "visible characters"),  # shown in /health, read by the gateway
        (["--name", "my model"], "visible characters"),  # clients must send it back
    ],
)
def test_bad_options_are_one_line_and_exit_2(args, words):
    r = run_cli("serve", "engine", "--port", "0", *args, timeout=300)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_busy_port_is_a_clear_error(engine):  # noqa: F811
    r = run_cli("serve", "engine", "--port", str(engine.port), timeout=300)
    assert r.returncode == 2 and "--port" in r.stderr and "Traceback" not in r.stderr, r.stderr

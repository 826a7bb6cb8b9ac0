"""The gateway's parts on their own: configuration, conversation scanning, sessions, the pool's
state machine, usage parsing, and the command line's configuration errors (one line, exit 2)."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.cli import main
from libra.core.errors import ConfigError
from libra.rollout.base import Bucket, InstanceView, RouteDecision, Status
from libra.rollout.registry import make_router
from libra.rollout.tool_state import SizeThresholds, classify
from libra.runtime.gateway.config import (
    BackendConfig,
    GatewayConfig,
    SessionConfig,
    backend_from_spec,
    load_gateway_config,
    parse_backend_spec,
)
from libra.runtime.gateway.conversation import Scan, prompt_id_of, scan_messages
from libra.runtime.gateway.pool import AdminState, Health, Pool, StateError
from libra.runtime.gateway.sessions import SessionError, SessionTracker
from libra.runtime.gateway.upstream import SSEUsage, usage_in_body

TH = SizeThresholds()


def be(url="http://127.0.0.1:9001", bucket="short", tp=1, max_context=4096, **kw) -> dict:
    return {"url": url, "bucket": bucket, "tp": tp, "max_context": max_context, **kw}


# ---- configuration ---------------------------------------------------------------------------------


def test_backend_specs_parse_and_name_what_is_wrong():
    assert parse_backend_spec("http://h:1,bucket=a,tp=2,max_context=8") == {"url": "http://h:1", "bucket": "a", "tp": "2", "max_context": "8"}  # fmt: skip
    assert backend_from_spec("http://h:1/v1/,bucket=a,tp=2,max-context=8,cap=9")["url"] == "http://h:1"
    for spec, field in [("http://h:1,bucket=a,tpp=2", "--backend"), ("http://h:1,bucket", "--backend"),
                        ("http://h:1,bucket=a,tp=two", "--backend tp"), ("ftp://h,bucket=a", "--backend url"),
                        ("http://h:port,bucket=a", "--backend url")]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            backend_from_spec(spec)
        assert e.value.field == field, spec


def test_buckets_are_derived_from_backend_labels_and_ordered_by_context():
    cfg = load_gateway_config({"backends": [be(bucket="long", tp=4, max_context=32768, url="http://h:2"), be(), be(url="http://h:3")]})  # fmt: skip
    assert cfg.bucket_list() == [Bucket("short", 1, 4096), Bucket("long", 4, 32768)]
    assert [b.id for b in cfg.backends] == ["h:2", "127.0.0.1:9001", "h:3"]


@pytest.mark.parametrize(
    "data, field",
    [
        ({"backends": []}, "backends"),
        ({"backends": [be(), be(url="http://h:2", tp=2)]}, "backends[1]"),
        ({"backends": [be(), be(url="http://h:2", bucket="other")]}, "buckets.max_context"),
        ({"backends": [{"url": "http://h:1", "bucket": "a"}]}, "backends[0].tp"),
        ({"backends": [be(), be()]}, "backends"),
        (
            {"buckets": [{"name": "a", "tp": 1, "max_context": 10}], "backends": [be(bucket="b")]},
            "backends[0].bucket",
        ),
        (
            {
                "buckets": [{"name": "short", "tp": 1, "max_context": 10}],
                "backends": [be(tp=2, max_context=None)],
            },
            "backends[0].tp",
        ),  # fmt: skip
        ({"backends": [be()], "health": {"interval_s": 0}}, "health.interval_s"),
        ({"backends": [be()], "nonsense": 1}, "nonsense"),
    ],
)
def test_configuration_errors_name_the_field(data, field):
    with pytest.raises(ConfigError) as e:
        load_gateway_config(data)
    assert e.value.field == field


def test_explicit_buckets_fill_backend_labels():
    cfg = GatewayConfig.model_validate({
        "buckets": [{"name": "long", "tp": 2, "max_context": 9000}, {"name": "short", "tp": 1, "max_context": 900}],
        "backends": [{"url": "http://h:1", "bucket": "long"}],
    })  # fmt: skip
    assert [b.name for b in cfg.buckets] == ["short", "long"] and cfg.backends[0].tp == 2


def cli_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["serve", "gateway", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_cli_configuration_errors_are_one_line_and_exit_2(capsys, tmp_path):
    backend = ["--backend", "http://127.0.0.1:9,bucket=a,tp=1,max_context=100"]
    assert "backends" in cli_error(capsys)
    assert "--backend" in cli_error(capsys, "--backend", "http://h:1,bucket=a,size=2")
    assert "cmlfq" in cli_error(capsys, *backend, "--router", "nope")
    assert "health" in cli_error(capsys, *backend, "--set", "helth.interval_s=1")  # names the known fields
    assert "causal tree" in cli_error(capsys, *backend, "--router", "round-robin", "--tree-path", str(tmp_path / "t.json"))  # fmt: skip
    assert "cost_model.model" in cli_error(capsys, *backend, "--set", "cost_model={model: gpt-9, hardware: a800-80g}")  # fmt: skip
    assert "cost_model.hardware" in cli_error(capsys, *backend, "--set", "cost_model={model: qwen3-14b}")
    bad_tree = tmp_path / "bad.json"
    bad_tree.write_text("{not a tree")
    assert "tree_path" in cli_error(capsys, *backend, "--tree-path", str(bad_tree))
    assert "regular file" in cli_error(capsys, *backend, "--tree-path", "/dev/zero")  # read forever
    assert "labels of 1 to 63" in cli_error(
        capsys, "--backend", "http://a..b:1,bucket=a,tp=1,max_context=100"
    )
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "buckets: [{name: a, tp: 1, max_context: 100}]\nbackends: [{url: 'http://h:1', bucket: b}]\n"
    )
    assert "backends[0].bucket" in cli_error(capsys, "--config", str(cfg))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        assert "port" in cli_error(capsys, *backend, "--port", str(busy.getsockname()[1]))


# ---- reading conversations ---------------------------------------------------------------------------

FAIL = "Traceback (most recent call last):\nValueError: bad"


def call(cid: str, name: str, args: str = "{}") -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]}  # fmt: skip


def test_the_path_comes_from_tool_messages_named_by_their_calls():
    msgs = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "first "}, {"type": "text", "text": "question"}],
        },
        call("c1", "search"),
        {"role": "tool", "tool_call_id": "c1", "content": "x" * 3000},
        call("c2", "python"),
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": FAIL}]},
        {
            "role": "tool",
            "tool_call_id": "zz",
            "name": "shell",
            "content": '{"status": "timeout", "stdout": ""}',
        },
        {"role": "tool", "tool_call_id": "c1", "content": "fine", "status": "error"},
    ]
    scan = scan_messages(Scan(), msgs, TH)
    assert [(s.tool, int(s.size), s.status) for s in scan.path] == [
        ("search", 1, Status.SUCCESS), ("python", 0, Status.FAILURE), ("shell", 0, Status.TIMEOUT), ("search", 0, Status.FAILURE),
    ]  # fmt: skip
    assert scan.first_user == "first question" and scan.assistant_chars == 4
    assert prompt_id_of(scan.first_user) == prompt_id_of("first question") != prompt_id_of("other")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "role",
                    "content",
                    "text",
                    "type",
                    "id",
                    "tool_calls",
                    "function",
                    "name",
                    "arguments",
                    "tool_call_id",
                    "status",
                ]
            ),
            inner,
            max_size=4,
        )
    ),  # fmt: skip
    max_leaves=15,
)
message = st.one_of(
    st.builds(lambda i, n: call(f"c{i}", n), st.integers(0, 3), st.sampled_from(["a", "b"])),
    st.builds(
        lambda i, c: {"role": "tool", "tool_call_id": f"c{i}", "content": c},
        st.integers(0, 4),
        st.sampled_from(["ok", FAIL, "y" * 2500, "", '{"error": "x"}']),
    ),  # fmt: skip
    st.builds(lambda c: {"role": "user", "content": c}, st.text(max_size=20)),
    json_values,
)


@settings(max_examples=200, deadline=None)
@given(msgs=st.lists(message, max_size=12), cut=st.integers(0, 12))
def test_scanning_in_steps_equals_scanning_at_once_and_never_raises(msgs, cut):
    whole = scan_messages(Scan(), msgs, TH)
    stepped = scan_messages(scan_messages(Scan(), msgs[:cut], TH), msgs, TH)
    assert (stepped.path, stepped.chars, stepped.assistant_chars, stepped.first_user) == (whole.path, whole.chars, whole.assistant_chars, whole.first_user)  # fmt: skip
    tools = [m for m in msgs if isinstance(m, dict) and m.get("role") == "tool"]
    assert len(whole.path) == len(tools)
    # A conversation that shrank is a different one: the scan starts over.
    again = scan_messages(whole, msgs[: max(0, len(msgs) - 1)], TH)
    assert again.path == scan_messages(Scan(), msgs[: max(0, len(msgs) - 1)], TH).path


@settings(max_examples=100, deadline=None)
@given(
    content=st.sampled_from(["ok", FAIL, "z" * 30000, "Error: disk full"]), name=st.sampled_from(["a", "run"])
)
def test_a_plain_tool_return_is_classified_like_the_offline_tools_do(content, name):
    scan = scan_messages(
        Scan(), [call("c0", name), {"role": "tool", "tool_call_id": "c0", "content": content}], TH
    )
    assert scan.path == [classify(name, content)]


# ---- sessions --------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def turn(tracker, s, msgs, bucket=0, instance="i0"):
    req = tracker.begin_turn(s, msgs)
    tracker.routed(s, req, RouteDecision(bucket, instance))
    return req


def test_context_is_anchored_on_usage_and_generated_tokens_counted_once():
    tr = SessionTracker(SessionConfig(), TH)
    s = tr.open("s", None, 3)
    msgs = [{"role": "user", "content": "u" * 400}]
    req = turn(tr, s, msgs)
    assert (req.turn, req.context_tokens, req.prompt_tokens, req.step, req.current_instance) == (
        0,
        100,
        100,
        3,
        None,
    )
    tr.metered(s, {"prompt_tokens": 130, "completion_tokens": 20})
    msgs += [call("c0", "run", "a" * 40), {"role": "tool", "tool_call_id": "c0", "content": "t" * 80}]
    req = turn(tr, s, msgs, bucket=1, instance="i1")
    assert req.context_tokens == 130 + 30 and req.generated_tokens == 20 and req.current_instance == "i0"
    assert req.current_bucket == 0 and len(req.path) == 1
    # A turn the backend reported no usage for (a stream without include_usage): its output is
    # estimated from the assistant text at the next turn.
    msgs += [call("c1", "run", "b" * 80), {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    req = turn(tr, s, msgs)
    assert req.generated_tokens == 20 + 20
    assert s.turns[1].migrated and not s.turns[0].migrated
    _, traj = tr.finish("s")
    assert traj.turn_contexts == tuple(t.context for t in s.turns) and len(traj.path) == 2
    assert traj.final_tokens >= max(traj.turn_contexts)
    with pytest.raises(SessionError):
        tr.finish("s")


def test_a_backends_absurd_usage_is_ignored_and_routing_goes_on():
    """A backend reporting 10^30 tokens (or a bool, a float) is not believed: before, the count
    reached the router's sibling features and every later turn of the group raised OverflowError."""
    tr = SessionTracker(SessionConfig(), TH)
    router = make_router("cmlfq", [Bucket("s", 1, 4096), Bucket("l", 2, 40960)])
    views = [InstanceView("i0", 0, 1), InstanceView("i1", 1, 2)]
    msgs = [{"role": "user", "content": "u" * 400}]
    a, b = tr.open("a", "p", 0), tr.open("b", "p", 0)
    for s in (a, b):
        router.route(turn(tr, s, msgs), views)
    tr.metered(a, {"prompt_tokens": 10**30, "completion_tokens": 10**30})
    tr.metered(a, {"prompt_tokens": True, "completion_tokens": 1.5})
    assert a.generated == 0 and a.last_final < 10**6
    _, traj = tr.finish("a")
    router.on_finish(traj)
    msgs += [call("c0", "run", "x"), {"role": "tool", "tool_call_id": "c0", "content": "ok"}]
    assert router.route(turn(tr, b, msgs), views).instance in ("i0", "i1")


def test_a_session_carries_the_routers_chosen_bucket_to_its_next_turn():
    """The router's choice (RouteDecision.target) comes back as RouteRequest.target_bucket, so a
    turn that spilled to a larger bucket is not read as the router's decision (docs/rollout.md)."""
    tr = SessionTracker(SessionConfig(), TH)
    s = tr.open("s", None, 0)
    msgs = [{"role": "user", "content": "go"}]
    req = tr.begin_turn(s, msgs)
    assert req.target_bucket is None and req.level is None
    tr.routed(s, req, RouteDecision(2, "i2", target=0))  # bucket 0 was full: spilled to bucket 2
    msgs += [call("c0", "run", "x"), {"role": "tool", "tool_call_id": "c0", "content": "ok"}]
    req = tr.begin_turn(s, msgs)
    assert (req.current_bucket, req.target_bucket, req.level) == (2, 0, 0)


@settings(max_examples=200, deadline=None)
@given(jumps=st.lists(st.integers(0, 3), min_size=1, max_size=10))
def test_turn_contexts_have_one_entry_per_path_depth(jumps):
    """Whatever number of tool returns arrive between turns, the finished trajectory has exactly
    one context per depth 0..len(path), non-decreasing, as the causal tree expects."""
    tr = SessionTracker(SessionConfig(), TH)
    s = tr.open("s", None, 0)
    msgs: list = [{"role": "user", "content": "go"}]
    k = 0
    for j in jumps:
        for _ in range(j):
            msgs += [
                call(f"c{k}", "run", "x" * 10),
                {"role": "tool", "tool_call_id": f"c{k}", "content": "ok"},
            ]
            k += 1
        turn(tr, s, msgs)
    _, traj = tr.finish("s", 5)
    assert len(traj.turn_contexts) == len(traj.path) + 1 == k + 1
    assert list(traj.turn_contexts) == sorted(traj.turn_contexts)
    assert traj.final_tokens >= traj.turn_contexts[-1]


def test_idle_and_excess_sessions_are_ended_oldest_first():
    clock = Clock()
    tr = SessionTracker(SessionConfig(idle_timeout_s=10, max_sessions=2), TH, clock)
    for sid in ("a", "b", "c"):
        turn(tr, tr.open(sid, None, 0), [{"role": "user", "content": sid}])
        clock.t += 1
    tr.open("a", None, 0)  # seen again: now the most recent
    assert [(r, t.traj_id) for r, t in tr.expire()] == [("evicted", "b")]
    clock.t += 10.5
    assert [(r, t.traj_id) for r, t in tr.expire()] == [("idle", "c"), ("idle", "a")] and len(tr) == 0


def test_anonymous_requests_are_one_turn_sessions_not_kept():
    tr = SessionTracker(SessionConfig(), TH)
    s = tr.open(None, None, 0)
    req = turn(tr, s, [{"role": "user", "content": "hi"}])
    assert req.turn == 0 and len(tr) == 0 and s.turns == []


# ---- the pool ------------------------------------------------------------------------------------------


def test_pool_admin_state_machine_checks_where_it_starts():
    pool = Pool([Bucket("short", 1, 100), Bucket("long", 2, 1000)])
    inst = pool.add(BackendConfig(url="http://h:1", bucket="short"))
    assert inst.view == InstanceView("h:1", 0, 1, 0, 256, False, 0)  # not routable until a check passes
    inst.mark_up()
    pool.refresh()
    assert inst.view.healthy and pool.routable.is_set()
    with pytest.raises(StateError):
        inst.resume()
    inst.drain()
    assert not inst.view.healthy and inst.state == AdminState.DRAINING
    with pytest.raises(StateError):
        inst.drain()
    inst.resume()
    pool.remove(inst)
    assert pool.views == [] and not pool.routable.is_set()
    with pytest.raises(StateError):
        inst.drain()
    with pytest.raises(ConfigError):
        pool.add(BackendConfig(url="http://h:2", bucket="huge"))
    with pytest.raises(ConfigError):
        pool.add(BackendConfig(url="http://h:2", bucket="long", tp=4))
    again = pool.add(BackendConfig(url="http://h:1", bucket="long"))  # a removed id can come back
    assert again.view.bucket == 1 and again.view.tp == 2


ops = st.lists(st.sampled_from(["drain", "resume", "remove", "up", "down", "fail"]), max_size=25)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_an_instance_is_routable_exactly_when_active_and_up(ops):
    pool = Pool([Bucket("b", 1, 100)])
    inst = pool.add(BackendConfig(url="http://h:1", bucket="b"))
    for op in ops:
        try:
            if op in ("drain", "resume"):
                getattr(inst, op)()
            elif op == "remove":
                pool.remove(inst)
            elif op == "up":
                inst.mark_up()
            elif op == "down":
                pool.mark_down(inst, "refused")
            else:
                inst.check_failed("timeout", 2)
        except StateError:
            pass
        pool.refresh()
        assert inst.view.healthy == (inst.state == AdminState.ACTIVE and inst.health == Health.UP)
        assert (inst.view in pool.views) == (inst.state != AdminState.REMOVED)
        assert pool.routable.is_set() == any(v.healthy for v in pool.views)


# ---- usage, without decoding bodies ----------------------------------------------------------------------


def test_usage_is_found_in_a_body_without_decoding_it():
    body = {"id": "x", "choices": [{"message": {"content": 'the "usage": key, and "usage"'}}], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "details": {"a": 1}}}  # fmt: skip
    assert usage_in_body(json.dumps(body).encode()) == body["usage"]
    assert usage_in_body(json.dumps({"usage": None, "choices": []}).encode()) is None
    assert usage_in_body(b'{"choices": [{"text": "usage"}]}') is None
    assert usage_in_body(b'{"usage" : {"prompt_tokens": 1}, "id": "x"}') == {"prompt_tokens": 1}
    assert usage_in_body(b'{"usage": {"prompt_tokens": ') is None
    deep = b'{"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # a backend's junk: RecursionError, a 500
    assert usage_in_body(deep) is None
    watch = SSEUsage()
    watch.feed(b'data: {"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n\n")
    assert watch.usage is None


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=8), with_usage=st.booleans())
def test_sse_usage_is_found_however_the_stream_is_cut(cuts, with_usage):
    events = [{"choices": [{"delta": {"content": "usage"}}], "usage": None}, {"choices": [{"delta": {}}]}]
    if with_usage:
        events.append({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}})
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    watch = SSEUsage()
    edges = sorted({min(c, len(stream)) for c in cuts})
    for a, b in zip([0, *edges], [*edges, len(stream)], strict=True):
        if b > a:
            watch.feed(stream[a:b])
    assert watch.usage == ({"prompt_tokens": 11, "completion_tokens": 3} if with_usage else None)

"""The gateway as a real process on loopback, in front of instant backends.

Instant backends answer at once, so these tests exercise the gateway's own behaviour quickly:
bad requests, streaming, sessions, the admin API, failover, the causal tree (learning, saving,
reloading), and 200 concurrent sessions. The end-to-end tests with real token generation (the
built-in engine, the `openai` client) are in test_gateway_engines.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from urllib.parse import quote

import aiohttp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from libra.rollout.base import Bucket, FinishedTrajectory, InstanceView, RouteRequest
from libra.rollout.registry import make_router
from libra.rollout.tree import CausalTree, state_from_key
from tests.conftest import wait_for
from tests.test_gateway_fixtures import (  # noqa: F401
    backend_arg,
    gateway_factory,
    instant_factory,
    metric,
    start_gateway,
    start_instant,
)

FAIL = 'Traceback (most recent call last):\n  File "main.py", line 3\nZeroDivisionError: division by zero'
OK = "ok: 42"
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
SHORT, LONG = 2048, 16384


def conversation(statuses: str, prompt: str = "solve the task") -> list[dict]:
    """A user message, then one tool call and its return per letter (F fails, S succeeds)."""
    msgs: list[dict] = [{"role": "user", "content": prompt}]
    for k, st_ in enumerate(statuses):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "run", "arguments": '{"code": "x"}'}}
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": FAIL if st_ == "F" else OK})
    return msgs


def chat(gw, sid: str | None, messages: list, **extra) -> tuple[int, dict, dict]:
    headers = {"X-Session-ID": sid} if sid else {}
    body = {"model": "instant", "messages": messages, **extra}
    return gw.request("POST", "/v1/chat/completions", body, headers=headers)


def is_openai_error(body: dict) -> bool:
    err = body.get("error")
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and err["message"]


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    be = start_instant(ports=2, log_dir=tmp_path_factory.mktemp("instant"))
    yield be
    be.stop()


@pytest.fixture(scope="module")
def gw(backends, tmp_path_factory):
    g = start_gateway(*backend_arg(backends.urls[0], "short", 1, SHORT), *backend_arg(backends.urls[1], "long", 2, LONG),  # fmt: skip
                      "--set", "max_body_mb=0.05", log_dir=tmp_path_factory.mktemp("gw"))  # fmt: skip
    yield g
    g.stop()


# ---- bad input ---------------------------------------------------------------------------------------


def test_bad_requests_get_json_4xx_and_the_gateway_keeps_serving(gw):
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ("POST", "/v1/chat/completions", b"{not json", {}, 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_json"),
        ("POST", "/v1/chat/completions", {"model": "instant"}, {}, 400, "invalid_value"),
        ("POST", "/v1/chat/completions", {"model": "instant", "messages": []}, {}, 400, "invalid_value"),
        ("POST", "/v1/chat/completions", {"model": "nope", "messages": user}, {}, 404, "model_not_found"),
        ("POST", "/v1/chat/completions", {"messages": user}, {}, 400, "invalid_value"),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "instant", "messages": user, "pad": "x" * 60_000},
            {},
            413,
            "request_entity_too_large",
        ),  # fmt: skip
        ("POST", "/v1/completions", {"model": "instant"}, {}, 400, "invalid_value"),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "instant", "messages": user},
            {"X-Session-ID": "s" * 300},
            400,
            "invalid_value",
        ),  # fmt: skip
        (
            "POST",
            "/v1/chat/completions",
            {"model": "instant", "messages": user},
            {"X-Libra-Step": "-1"},
            400,
            "invalid_value",
        ),  # fmt: skip
        ("GET", "/v1/chat/completions", None, {}, 405, "method_not_allowed"),
        ("GET", "/no/such/thing", None, {}, 404, "not_found"),
        ("POST", "/sessions/nobody/finish", b"", {}, 404, "session_not_found"),
    ]
    for method, path, body, headers, status, code in cases:
        got, data, resp_headers = gw.request(method, path, body, headers=headers)
        assert (got, data.get("error", {}).get("code")) == (status, code), (path, body if not isinstance(body, dict) else list(body), data)  # fmt: skip
        assert is_openai_error(data) and resp_headers["Content-Type"].startswith("application/json")
    assert data["error"]["param"] is None
    status, data, _ = chat(gw, None, user)
    assert status == 200 and data["choices"][0]["message"]["content"] == "Done."
    text = gw.metrics()
    assert metric(text, "libra_gateway_requests_total", endpoint="/v1/chat/completions", status="400") >= 5
    assert metric(text, "libra_gateway_requests_total", endpoint="/v1/chat/completions", status="413") >= 1


def test_bodies_and_ids_that_would_break_a_header_or_a_router_are_400(gw, backends):
    """Each was a 500 (or a dropped connection) before: an unpaired surrogate, NaN, deep nesting,
    a session id with a control character (it goes back out in X-Session-ID), a step that
    `str.isdigit` passes but `int` refuses, a 100k-character prompt id, a backend whose host the
    resolver refuses or whose API key holds NUL, and a finish with 10^30 tokens (which then broke
    routing for every sibling of the session)."""
    user = [{"role": "user", "content": "hi"}]
    ok = {"model": "instant", "messages": user}
    cases = [
        (
            "/v1/chat/completions",
            b'{"model": "instant", "messages": [{"role": "user", "content": "\\ud800"}]}',
            {},
            "messages[0].content",
        ),  # fmt: skip
        ("/v1/chat/completions", b'{"model": "instant", "messages": [], "n": NaN}', {}, None),
        ("/v1/chat/completions", b"[" * 20_000 + b"]" * 20_000, {}, None),
        ("/v1/chat/completions", {**ok, "user": "a\x00b"}, {}, "user"),
        ("/v1/chat/completions", {**ok, "user": "a\r\nSet-Cookie: x=1"}, {}, "user"),
        ("/v1/chat/completions", ok, {"X-Libra-Step": "\xb2"}, "X-Libra-Step"),
        ("/v1/chat/completions", ok, {"X-Libra-Step": "9" * 5000}, "X-Libra-Step"),
        ("/v1/chat/completions", ok, {"X-Session-ID": "p", "X-Prompt-ID": "p" * 300}, "X-Prompt-ID"),
        ("/admin/instances", {"url": "http://" + "a" * 70 + ".com:1", "bucket": "short"}, {}, "url"),
        ("/admin/instances", {"url": "http://a..b:1", "bucket": "short"}, {}, "url"),
        (
            "/admin/instances",
            {"url": backends.urls[0], "bucket": "short", "name": "k", "api_key": "x\x00"},
            {},
            "api_key",
        ),  # fmt: skip
    ]
    for path, body, headers, param in cases:
        status, data, _ = gw.request("POST", path, body, headers=headers)
        assert status == 400 and is_openai_error(data), (path, str(body)[:80], data)
        assert data["error"]["param"] == param, (str(body)[:80], data)
    assert chat(gw, "fin-1", user)[0] == 200
    status, data = gw.post("/sessions/fin-1/finish", {"final_tokens": 10**30})
    assert status == 400 and data["error"]["param"] == "final_tokens"
    assert gw.post("/sessions/fin-1/finish", {"final_tokens": 40})[0] == 200
    assert chat(gw, None, user)[0] == 200 and gw.get("/health")[0] == 200
    assert len(gw.get("/admin/instances")[1]["instances"]) == 2


# Text as a client may send it: any code point, unpaired surrogates and control characters too
# (json.dumps writes a surrogate as its \\uXXXX escape, which json.loads reads back).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
messages_like = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "assistant", "tool", "system", 3]),
            "content": json_values,
            "tool_calls": json_values,
            "tool_call_id": json_values | st.just("c0"),
        },
    )  # fmt: skip
    | json_values,
    max_size=5,
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.tuples(messages_like, json_values).map(
        lambda mu: json.dumps({"model": "instant", "messages": mu[0], "user": mu[1]}).encode()
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, sid=st.sampled_from([None, "fuzz-1", "fuzz-2"]))
def test_any_body_gets_an_answer_below_500(gw, body, sid):
    status, data, _ = gw.request(
        "POST", "/v1/chat/completions", body, headers={"X-Session-ID": sid} if sid else {}
    )
    assert status < 500, data
    assert status == 200 or is_openai_error(data)


BACKEND_FIELDS = ["url", "bucket", "tp", "max_context", "cap", "node", "name", "api_key"]
urls_like = st.sampled_from(["http://a..b:1", "http://" + "a" * 70 + ".c:1", "http://[::1", "ftp://x", "http://127.0.0.1:99999", "http://h:1/\ud800"])  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(BACKEND_FIELDS), value=json_values | urls_like)
@example(field="name", value="http://[::1")  # reachable percent-encoded (the test's own cleanup was not)
@example(field="name", value="é x")
def test_an_admin_add_with_one_junk_field_gets_an_answer_below_500(gw, backends, field, value):
    body = {"url": backends.urls[0], "bucket": "short", "name": "fz", field: value}
    status, data, _ = gw.request("POST", "/admin/instances", json.dumps(body).encode())
    assert status < 500 and is_openai_error(data) or status == 201, (body, data)
    if status == 201:  # every id it accepts must be reachable at its admin URL
        assert gw.request("DELETE", f"/admin/instances/{quote(data['id'], safe='')}?force=true")[0] == 200
    assert len(gw.get("/admin/instances")[1]["instances"]) == 2


# ---- discovery, streaming, sessions -------------------------------------------------------------------


def test_models_health_and_metrics(gw):
    # the backend's card passes through, max_model_len included (the instant backend's 32768)
    assert gw.get("/v1/models") == (200, {"object": "list", "data": [{"id": "instant", "object": "model", "created": pytest.approx(time.time(), abs=3600), "owned_by": "libra-instant", "max_model_len": 32768}]})  # fmt: skip
    assert gw.get("/v1/models/instant")[1]["max_model_len"] == 32768 and gw.get("/v1/models/nope")[0] == 404
    status, health = gw.get("/health")
    assert status == 200 and health["routable"] == 2 and health["router"] == "cmlfq"
    assert [b["name"] for b in health["buckets"]] == ["short", "long"]
    chat(gw, "metrics-1", conversation(""))
    text = gw.metrics()
    for name in ("libra_gateway_decisions_total", "libra_gateway_outstanding", "libra_gateway_instance_up",
                 "libra_gateway_request_seconds_bucket", "libra_gateway_overhead_seconds_bucket",
                 "libra_gateway_upstream_seconds_bucket", "libra_gateway_active_sessions"):  # fmt: skip
        assert name in text, name
    assert metric(text, "libra_gateway_decisions_total", bucket="short") >= 1
    assert metric(text, "libra_gateway_instance_up") == 2


def test_stream_passes_through_and_its_usage_is_read(gw):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="instant", messages=conversation("S"), stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Session-ID": "stream-1"},
        )  # fmt: skip
        assert raw.headers["X-Libra-Bucket"] == "short" and raw.headers["content-type"] == "text/event-stream"
        chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Done."
    assert chunks[-1].usage.completion_tokens == 2
    status, s = gw.get("/sessions/stream-1")
    assert status == 200 and s["generated_tokens"] == 2 and s["path"] == ["run|0|0"]


def test_user_field_identifies_the_session_and_anonymous_requests_are_not_kept(gw):
    before = gw.get("/health")[1]["sessions"]
    for turn in ("", "S"):
        assert chat(gw, None, conversation(turn), user="user-7")[0] == 200
    status, s = gw.get("/sessions/user-7")
    assert status == 200 and len(s["turns"]) == 2 and s["path"] == ["run|0|0"]
    chat(gw, None, conversation("S"))
    assert gw.get("/health")[1]["sessions"] == before + 1


def test_finish_and_steps(gw):
    for turn in ("", "F", "FF"):
        assert chat(gw, "fin-1", conversation(turn))[0] == 200
    assert gw.post("/sessions/fin-1/finish", {"final_tokens": -3})[0] == 400
    status, out = gw.post("/sessions/fin-1/finish", {"final_tokens": 9000})
    assert status == 200 and out["trajectory"]["final_tokens"] == 9000
    assert (
        out["trajectory"]["path"] == ["run|0|1", "run|0|1"] and len(out["trajectory"]["turn_contexts"]) == 3
    )
    assert gw.post("/sessions/fin-1/finish")[0] == 404  # finished once, fed once
    step = gw.post("/steps/end")[1]["step"]
    chat(gw, "after-step", conversation(""))
    assert gw.get("/sessions/after-step")[1]["step"] == step


# ---- the causal tree: live learning, persistence, and the same decisions as the router offline -----


def run_session(gw, sid: str, statuses: str, final: int | None) -> list[str]:
    """Turns 0..len(statuses) of a session; returns the bucket of each turn; finishes it if asked."""
    buckets = []
    for k in range(len(statuses) + 1):
        status, _, headers = chat(gw, sid, conversation(statuses[:k], prompt=f"task {sid[-1]}"))
        assert status == 200
        buckets.append(headers["X-Libra-Bucket"])
    if final is not None:
        assert gw.post(f"/sessions/{sid}/finish", {"final_tokens": final})[0] == 200
    return buckets


def replay_offline(router, record: dict, views: list[InstanceView]) -> list[int]:
    """Feed a router the gateway's recorded inputs of a session, turn by turn; its chosen buckets."""
    path = tuple(state_from_key(k) for k in record["path"])
    bucket = instance = None
    out = []
    for turn, t in enumerate(record["turns"]):
        req = RouteRequest(record["id"], record["prompt_id"], record["step"], turn, record["prompt_tokens"],
                           t["context_tokens"], t["generated_tokens"], path[: t["path_len"]], bucket, instance)  # fmt: skip
        dec = router.route(req, views)
        bucket, instance = dec.bucket, dec.instance
        out.append(dec.bucket)
    return out


def feed_offline(router, trajectory: dict) -> None:
    t = trajectory
    path = tuple(state_from_key(k) for k in t["path"])
    router.on_finish(FinishedTrajectory("x", t["prompt_id"], t["step"], path, tuple(t["turn_contexts"]), t["final_tokens"]))  # fmt: skip


def test_tree_learns_from_finished_sessions_survives_a_restart_and_routes_like_the_router(backends, gateway_factory, tmp_path):  # noqa: F811  # fmt: skip
    be = backends
    tree_path = tmp_path / "tree.json"
    args = [*backend_arg(be.urls[0], "short", 1, SHORT), *backend_arg(be.urls[1], "long", 2, LONG), "--tree-path", str(tree_path)]  # fmt: skip
    gw = gateway_factory(*args)
    buckets = [Bucket("short", 1, SHORT), Bucket("long", 2, LONG)]
    views = [InstanceView(i["id"], i["bucket_index"], i["tp"], 0, i["cap"], True) for i in gw.get("/admin/instances")[1]["instances"]]  # fmt: skip
    # The same router class, offline, fed the same calls in the same order, must decide the same
    # at every turn, while the gateway learns from each finished session.
    offline = make_router("cmlfq", buckets)
    index = {"short": 0, "long": 1}
    for i, (sid, statuses, final) in enumerate([("ok-0", "SS", 300), ("fail-0", "FF", 12000)] * 4):
        sid = f"{sid[:-1]}{i}"
        live = [index[b] for b in run_session(gw, sid, statuses, None)]
        status, out = gw.post(f"/sessions/{sid}/finish", {"final_tokens": final})
        assert status == 200 and [t["bucket"] for t in out["session"]["turns"]] == live
        assert replay_offline(offline, out["session"], views) == live, sid
        feed_offline(offline, out["trajectory"])
    # What it learned: a failing tool predicts a long trajectory (mean and P90 agree), so the
    # session moves to the larger bucket at its first failure; a succeeding one stays.
    assert run_session(gw, "fail-new", "FF", None) == ["short", "long", "long"]
    assert run_session(gw, "ok-new", "SS", None) == ["short"] * 3
    for sid, route in (("fail-new", [0, 1, 1]), ("ok-new", [0, 0, 0])):
        assert replay_offline(offline, gw.get(f"/sessions/{sid}")[1], views) == route

    # The tree is saved at shutdown and loaded at start: the new gateway routes ahead at once.
    assert gw.get("/admin/tree")[1]["samples"] == 8
    assert gw.stop() == 0
    saved = CausalTree.load(tree_path)
    assert saved.root.count == 8 and saved.to_dict() == offline.tree.to_dict()
    gw2 = gateway_factory(*args)
    assert gw2.get("/admin/tree")[1]["samples"] == 8
    assert run_session(gw2, "fail-after", "FF", 12000) == ["short", "long", "long"]
    status, info = gw2.post("/admin/tree/save")
    assert status == 200 and info["samples"] == 9 and CausalTree.load(tree_path).root.count == 9


def test_idle_sessions_end_and_feed_the_tree(backends, gateway_factory, tmp_path):  # noqa: F811
    be = backends
    gw = gateway_factory(*backend_arg(be.url, "only", 1, SHORT), "--tree-path", str(tmp_path / "t.json"),
                         "--set", "sessions.idle_timeout_s=0.3")  # fmt: skip
    run_session(gw, "idle-1", "S", None)
    wait_for(lambda: gw.get("/sessions/idle-1")[0] != 200, "the idle session ended")
    assert gw.get("/sessions/idle-1")[0] == 404
    assert gw.get("/admin/tree")[1]["samples"] == 1
    assert metric(gw.metrics(), "libra_gateway_sessions_finished_total", reason="idle") == 1


# ---- the admin API -------------------------------------------------------------------------------------


def test_admin_add_drain_resume_remove(backends, instant_factory, gateway_factory):  # noqa: F811
    a, b = backends.urls
    slow = instant_factory()  # its gate holds a request in flight while the test removes it
    gw = gateway_factory(
        *backend_arg(a, "short", 1, SHORT, name="a"), *backend_arg(b, "long", 2, LONG, name="b")
    )
    assert chat(gw, "adm", conversation(""))[2]["X-Libra-Instance"] == "a"
    status, added = gw.post("/admin/instances", {"url": slow.url, "bucket": "short", "name": "c"})
    assert status == 201 and added["routable"] and added["tp"] == 1 and added["health"] == "up"
    # Bad adds: unknown bucket, a TP that is not the bucket's, a duplicate, a malformed URL.
    assert gw.post("/admin/instances", {"url": slow.url, "bucket": "huge"})[0] == 400
    assert gw.post("/admin/instances", {"url": slow.url, "bucket": "short", "tp": 4, "name": "d"})[0] == 400
    assert gw.post("/admin/instances", {"url": slow.url, "bucket": "short", "name": "c"})[0] == 409
    assert gw.post("/admin/instances", {"url": "ftp://x", "bucket": "short"})[0] == 400
    # Draining `a` moves its session to the other instance of the bucket on its next turn.
    status, drained = gw.post("/admin/instances/a/drain")
    assert status == 200 and drained["state"] == "draining" and not drained["routable"]
    assert gw.post("/admin/instances/a/drain")[0] == 409
    status, _, headers = chat(gw, "adm", conversation("S"))
    assert status == 200 and headers["X-Libra-Instance"] == "c"
    assert gw.get("/sessions/adm")[1]["turns"][-1]["migrated"] is True
    assert gw.post("/admin/instances/a/resume")[1]["state"] == "active"
    # Removing an instance with a request in flight needs force; the request still completes.
    assert slow.post("/gate", {"open": False})[0] == 200
    result = {}
    t = threading.Thread(target=lambda: result.update(r=chat(gw, "adm", conversation("SS"))))
    t.start()
    wait_for(lambda: slow.get("/stats")[1]["held"] == 1, "the turn held by instance c")
    assert gw.get("/admin/instances")[1]["instances"][2]["outstanding"] == 1
    status, busy = gw.request("DELETE", "/admin/instances/c")[:2]
    assert status == 409 and busy["error"]["code"] == "instance_busy"
    assert gw.request("DELETE", "/admin/instances/c?force=true")[0] == 200
    assert slow.post("/gate", {"open": True})[0] == 200
    t.join(timeout=300)
    assert result["r"][0] == 200 and result["r"][2]["X-Libra-Instance"] == "c"
    assert [i["id"] for i in gw.get("/admin/instances")[1]["instances"]] == ["a", "b"]
    assert gw.request("DELETE", "/admin/instances/c")[0] == 404
    assert chat(gw, "adm", conversation("SSS"))[2]["X-Libra-Instance"] == "a"


def test_admin_buckets_move_the_boundaries_and_refuse_what_an_engine_cannot_hold(backends, gateway_factory):  # noqa: F811  # fmt: skip
    """A planner's boundary refit (`libra train`'s re-plan): the thresholds move, the engines stay;
    a bad body is a 400 naming the field; a boundary past an engine's max_model_len is a 409."""
    a, b = backends.urls
    gw = gateway_factory(
        *backend_arg(a, "short", 1, SHORT, name="a"), *backend_arg(b, "long", 2, LONG, name="b")
    )

    def retune(body) -> tuple[int, dict]:
        return gw.post("/admin/buckets", body)[:2]

    bad = [({}, "buckets"), ({"buckets": [{"name": "short", "max_context": 4096}]}, "buckets"),
           ({"buckets": [{"name": "long", "max_context": 1}, {"name": "short", "max_context": 2}]}, "buckets[0].name"),
           ({"buckets": [{"name": "short", "max_context": 4096}, {"name": "long", "max_context": 4096}]}, "buckets[1].max_context"),
           ({"buckets": [{"name": "short", "max_context": True}, {"name": "long", "max_context": LONG}]}, "buckets[0].max_context"),
           ({"buckets": ["short", "long"]}, "buckets[0].name")]  # fmt: skip
    for body, field in bad:
        status, err = retune(body)
        assert status == 400 and err["error"]["param"] == field, (body, err)
    # the instant backends report max_model_len 32768: a long bucket past it is refused
    status, err = retune({"buckets": [{"name": "short", "max_context": 4096}, {"name": "long", "max_context": 65536}]})  # fmt: skip
    assert status == 409 and err["error"]["code"] == "instance_too_short"
    assert [x["max_context"] for x in gw.get("/admin/instances")[1]["buckets"]] == [SHORT, LONG]
    status, out = retune({"buckets": [{"name": "short", "max_context": 4096}, {"name": "long", "max_context": LONG}]})  # fmt: skip
    assert status == 200 and [x["max_context"] for x in out["buckets"]] == [4096, LONG]
    listing = gw.get("/admin/instances")[1]
    assert [x["max_context"] for x in listing["buckets"]] == [4096, LONG]
    assert {i["id"]: i["max_context"] for i in listing["instances"]} == {"a": 4096, "b": LONG}
    # an engine added to the bucket now takes its new max_context, and sessions still route
    assert chat(gw, "retuned", conversation(""))[0] == 200


# ---- failures ---------------------------------------------------------------------------------------


def test_a_dead_instance_is_taken_out_and_its_session_continues(backends, instant_factory, gateway_factory):  # noqa: F811  # fmt: skip
    a, b = instant_factory(), instant_factory()  # each killed on its own; c is the module's
    c, c_before = backends.urls[1], backends.get("/stats")[1]["chat"]
    gw = gateway_factory(*backend_arg(a.url, "short", 1, SHORT, name="a"), *backend_arg(b.url, "short", 1, SHORT, name="b"),
                         *backend_arg(c, "long", 2, LONG, name="c"), "--set", "health.interval_s=60")  # fmt: skip
    assert chat(gw, "f", conversation(""))[2]["X-Libra-Instance"] == "a"
    a.kill()  # the health check will not run for a minute: the request itself finds out
    status, _, headers = chat(gw, "f", conversation("S"))
    assert status == 200 and headers["X-Libra-Instance"] == "b"  # same bucket
    assert chat(gw, "f", conversation("SS"))[2]["X-Libra-Instance"] == "b"  # and it stays there
    b.kill()
    status, _, headers = chat(gw, "f", conversation("SSS"))
    assert status == 200 and headers["X-Libra-Instance"] == "c"  # nearest bucket with a healthy instance
    turns = gw.get("/sessions/f")[1]["turns"]
    assert [t["failover_to"] for t in turns] == [None, "b", None, "c"]
    health = {i["id"]: i["health"] for i in gw.get("/admin/instances")[1]["instances"]}
    assert health == {"a": "down", "b": "down", "c": "up"}
    text = gw.metrics()
    assert metric(text, "libra_gateway_retries_total") == 2
    assert metric(text, "libra_gateway_migrations_total", reason="failover") == 2
    assert backends.get("/stats")[1]["chat"] - c_before == 1


def test_requests_wait_for_an_instance_to_come_back(instant_factory, gateway_factory):  # noqa: F811
    be = instant_factory()
    port = be.url.rsplit(":", 1)[1]
    gw = gateway_factory(*backend_arg(be.url, "only", 1, SHORT), "--set", "health.interval_s=0.1", "--set", "no_instance_wait_s=0.3")  # fmt: skip
    be.kill()
    wait_for(lambda: gw.get("/health")[0] != 200, "the dead backend taken out")
    status, body, _ = chat(gw, "w", conversation(""))
    assert status == 503 and body["error"]["code"] == "no_healthy_instance"
    gw2 = gateway_factory(*backend_arg(be.url, "only", 1, SHORT), "--set", "health.interval_s=0.1", "--set", "no_instance_wait_s=600")  # fmt: skip
    result = {}
    t = threading.Thread(target=lambda: result.update(r=chat(gw2, "w", conversation(""))))
    t.start()
    wait_for(lambda: gw2.get("/sessions/w")[0] == 200, "the turn reached the gateway")
    assert t.is_alive()  # kept, not dropped
    instant_factory("--port", port)
    t.join(timeout=600)
    assert result["r"][0] == 200


# ---- scale ------------------------------------------------------------------------------------------


async def _drive_sessions(url: str, n: int) -> list[tuple[int, ...]]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def one(i: int) -> tuple[int, ...]:
            sid, msgs, statuses = f"many-{i}", [{"role": "user", "content": f"task {i}"}], []
            body = {"model": "instant", "messages": msgs, "tools": TOOLS}
            async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": sid}) as r:
                statuses.append(r.status)
                reply = (await r.json())["choices"][0]["message"]
            call_id = reply["tool_calls"][0]["id"]
            msgs += [reply, {"role": "tool", "tool_call_id": call_id, "content": OK if i % 2 else FAIL}]
            async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": sid}) as r:
                statuses.append(r.status)
                assert (await r.json())["choices"][0]["finish_reason"] == "stop"
            async with http.post(f"{url}/sessions/{sid}/finish", json={}) as r:
                statuses.append(r.status)
            return tuple(statuses)

        return await asyncio.gather(*(one(i) for i in range(n)))


def concurrent_sessions(instant_factory, gateway_factory, n: int) -> None:  # noqa: F811
    """`n` two-turn sessions at once, their first turns all held by the backends together (a gate,
    not a delay: none is answered before all `n` are in flight, however slow the machine)."""
    be = instant_factory("--hold-until", str(n), ports=2)
    gw = gateway_factory(
        *backend_arg(be.urls[0], "short", 1, SHORT), *backend_arg(be.urls[1], "long", 2, LONG)
    )
    results = asyncio.run(_drive_sessions(gw.url, n))
    assert results == [(200, 200, 200)] * n
    stats = be.get("/stats")[1]
    assert stats["chat"] == 2 * n  # every turn reached a backend exactly once: none lost, none doubled
    assert stats["peak_inflight"] >= n  # they really were in flight together
    text = gw.metrics()
    assert (
        metric(text, "libra_gateway_requests_total", endpoint="/v1/chat/completions", status="200") == 2 * n
    )
    assert metric(text, "libra_gateway_sessions_finished_total", reason="client") == n
    assert (
        metric(text, "libra_gateway_active_sessions") == 0 and metric(text, "libra_gateway_outstanding") == 0
    )


def test_concurrent_sessions_complete(instant_factory, gateway_factory):  # noqa: F811
    """200 sessions in flight together (1000 in benchmarks/bench_live_scale.py)."""
    concurrent_sessions(instant_factory, gateway_factory, 200)


async def _first_turns_at_once(url: str, n: int) -> list[int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def one(i: int) -> int:
            body = {
                "model": "instant",
                "messages": [{"role": "user", "content": f"task {i}"}],
                "tools": TOOLS,
            }
            async with http.post(
                url + "/v1/chat/completions", json=body, headers={"X-Session-ID": f"b{i}"}
            ) as r:
                await r.read()
                return r.status

        return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("spill", ["balance", "saturated"])
def test_turns_overflow_to_a_larger_bucket_with_less_load_per_gpu(instant_factory, gateway_factory, spill):  # noqa: F811
    """The placement rule live (docs/rollout.md, "Instance choice"): eight new sessions at once,
    every backend holding its answers. C-MLFQ starts them all in the short (TP1) bucket; with
    spill: balance each turn goes where the outstanding requests per GPU are fewest, so the idle
    TP4 engine takes most of them; with spill: saturated all wait on the short engine. (The
    backends hold every answer until all eight arrived.)"""
    be = instant_factory("--hold-until", "8", ports=2)
    gw = gateway_factory(*backend_arg(be.urls[0], "short", 1, SHORT), *backend_arg(be.urls[1], "long", 4, LONG),
                         "--set", f"router_params.spill={spill}")  # fmt: skip
    assert asyncio.run(_first_turns_at_once(gw.url, 8)) == [200] * 8
    text = gw.metrics()
    placed = {b: metric(text, "libra_gateway_decisions_total", bucket=b) for b in ("short", "long")}
    assert sum(placed.values()) == 8
    if spill == "balance":  # short takes a turn only while its 1 GPU is no busier than long's 4
        assert placed["long"] >= 5, placed
    else:
        assert placed == {"short": 8, "long": 0}


@pytest.mark.parametrize("spill", ["cost", "balance"])
def test_spill_cost_with_a_cost_model(backends, gateway_factory, spill):  # noqa: F811
    """Told what the backends serve on (`cost_model`), the routers price placement with the cost
    model: on idle engines a turn adds the least token time on the larger TP, so spill: cost sends
    C-MLFQ's first turns, chosen for the short bucket, to the TP4 engine; spill: balance keeps them
    where the router chose (per GPU the idle engines tie)."""
    be = backends
    gw = gateway_factory(*backend_arg(be.urls[0], "short", 1, SHORT), *backend_arg(be.urls[1], "long", 4, LONG),
                         "--set", "cost_model={model: qwen3-14b, hardware: a800-80g}",
                         "--set", f"router_params.spill={spill}")  # fmt: skip
    assert asyncio.run(_first_turns_at_once(gw.url, 1)) == [200]
    text = gw.metrics()
    placed = {b: metric(text, "libra_gateway_decisions_total", bucket=b) for b in ("short", "long")}
    assert placed == ({"short": 0, "long": 1} if spill == "cost" else {"short": 1, "long": 0})


def test_a_yaml_config_with_overrides(backends, gateway_factory, tmp_path):  # noqa: F811
    be = backends
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(
        "router: cmlfq-paper\n"
        "buckets:\n  - {name: long, tp: 4, max_context: 32768}\n  - {name: short, tp: 1, max_context: 4096}\n"
        f"backends:\n  - {{url: '{be.urls[0]}', bucket: short, name: s1}}\n  - {{url: '{be.urls[1]}/v1', bucket: long, name: l1}}\n"
        "health: {interval_s: 0.5}\n"
    )  # fmt: skip
    gw = gateway_factory(
        "--config", str(cfg), "--set", "router=least-loaded", "--set", "models=[instant, alias]"
    )
    status, health = gw.get("/health")
    assert status == 200 and health["router"] == "least-loaded"
    assert [(b["name"], b["tp"]) for b in health["buckets"]] == [("short", 1), ("long", 4)]
    assert [m["id"] for m in gw.get("/v1/models")[1]["data"]] == ["alias", "instant"]
    instances = gw.get("/admin/instances")[1]["instances"]
    assert [(i["id"], i["bucket"], i["url"]) for i in instances] == [("s1", "short", be.urls[0]), ("l1", "long", be.urls[1])]  # fmt: skip


def test_completions_pass_through_streamed_or_not(gw):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as client:
        r = client.completions.create(model="instant", prompt="x" * 400, user="cmpl-1")
        assert r.choices[0].text == "Done." and r.usage.prompt_tokens == 100
        chunks = list(
            client.completions.create(model="instant", prompt=["a", "b"], stream=True, user="cmpl-1")
        )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Done."
    turns = gw.get("/sessions/cmpl-1")[1]["turns"]
    assert [t["context_tokens"] for t in turns] == [100, 100]  # the first from chars, then usage-anchored


def test_a_backend_dying_mid_stream_ends_the_stream_with_an_error_and_the_session_goes_on(backends, instant_factory, gateway_factory):  # noqa: F811  # fmt: skip
    openai = pytest.importorskip("openai")
    dying, alive = instant_factory("--exit-mid-stream"), backends.urls[1]
    gw = gateway_factory(*backend_arg(dying.url, "short", 1, SHORT, name="dying"), *backend_arg(alive, "long", 2, LONG, name="alive"),
                         "--set", "health.interval_s=60")  # fmt: skip
    with openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as client:
        stream = client.chat.completions.create(
            model="instant", messages=conversation(""), stream=True, user="mid"
        )
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            for _ in stream:
                pass
        r = client.chat.completions.with_raw_response.create(
            model="instant", messages=conversation(""), user="mid"
        )
    assert r.headers["X-Libra-Instance"] == "alive" and r.parse().choices[0].message.content == "Done."
    text = gw.metrics()
    assert metric(text, "libra_gateway_upstream_errors_total", instance="dying", kind="mid_stream") == 1
    assert gw.get("/health")[1]["routable"] == 1
    # The client's retry of the turn is a failover, not the router's choice, whichever way it
    # went: routed away from `dying` once the health probe the failure asked for has marked it
    # down (`migrated`), or, on a slower machine where that probe has not answered yet, kept on
    # `dying` by session affinity and carried to `alive` when the connection is refused.
    (first, retry) = gw.get("/sessions/mid")[1]["turns"]
    assert retry["failover_to"] == "alive" and first["failover_to"] is None, (first, retry)
    assert metric(text, "libra_gateway_migrations_total", reason="failover") == 1
    assert metric(text, "libra_gateway_migrations_total", reason="policy") == 0


def test_a_router_bug_costs_no_turn_and_no_session(backends, gateway_factory):  # noqa: F811
    be = backends
    gw = gateway_factory(*backend_arg(be.urls[0], "short", 1, SHORT), *backend_arg(be.urls[1], "long", 2, LONG),
                         "--router", "tests.test_gateway_fixtures:ExplodingRouter")  # fmt: skip
    for turn in ("", "F"):
        status, _, headers = chat(gw, "boom-1", conversation(turn))
        assert status == 200 and headers["X-Libra-Bucket"] == "short"  # kept where it is
    assert gw.post("/sessions/boom-1/finish")[0] == 200
    assert chat(gw, "fine-1", conversation(""))[0] == 200
    text = gw.metrics()
    assert metric(text, "libra_gateway_upstream_errors_total", instance="router", kind="exception") == 2
    assert metric(text, "libra_gateway_upstream_errors_total", instance="router", kind="on_finish") == 1

"""What RL frameworks send through the gateway: token-id prompts and their session keys.

Real `libra serve gateway` processes in front of instant backends on loopback (one of each for
the module, and one more of each for the test of a backend too short for its bucket):

- token-in clients (vLLM's token-id prompts, SGLang's `input_ids`) are counted in tokens, exactly,
  so a 30,000-token prompt is routed as 30,000 tokens and a session that outgrows its bucket
  leaves it, as it does for chat clients;
- a session is recognised as each framework names it: `X-Session-ID`, slime's `X-SMG-Routing-Key`,
  SkyRL's `trajectory_id` (a string or an integer; the first of a batch), OpenAI's `user`, and a
  configured header or body field; `X-Request-Id` reaches the backend.
"""

from __future__ import annotations

import openai
import pytest

from tests.test_gateway_fixtures import backend_arg, instant_factory, start_gateway, start_instant  # noqa: F401

SHORT, LONG = 4096, 32768


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One instant backend (two ports) behind one gateway in two buckets, for the module: sessions
    are keyed apart by each test, and the extra session keys (a header, a body field) are set for
    all since nothing else sends them."""
    log_dir = tmp_path_factory.mktemp("rl")
    be = start_instant("--model", "m", "--max-context", str(LONG), ports=2, log_dir=log_dir)
    try:
        gw = start_gateway(*backend_arg(be.urls[0], "short", 1, SHORT, name="s"), *backend_arg(be.urls[1], "long", 4, LONG, name="l"),
                           "--set", "sessions.key_header=X-Episode", "--set", "sessions.key_field=episode_id", log_dir=log_dir)  # fmt: skip
    except BaseException:
        be.stop()
        raise
    yield be, gw
    gw.stop()
    be.stop()


def test_token_id_prompts_are_counted_and_route_by_length(stack):
    be, gw = stack
    sid = {"X-Session-ID": "tok-1"}
    status, _, headers = gw.request("POST", "/v1/completions", {"model": "m", "prompt": [7] * 3000}, sid)
    assert status == 200 and headers["X-Libra-Bucket"] == "short"
    session = gw.get("/sessions/tok-1")[1]
    assert session["context_tokens"] == 3000
    # the follow-up has outgrown the short bucket: it must leave it
    status, _, headers = gw.request("POST", "/v1/completions", {"model": "m", "prompt": [7] * 30000}, sid)
    assert status == 200 and headers["X-Libra-Bucket"] == "long"
    turns = gw.get("/sessions/tok-1")[1]["turns"]
    assert [t["context_tokens"] for t in turns] == [3000, 30000] and turns[1]["migrated"]
    # a batch is sized by its longest prompt; an anonymous long prompt starts where it fits
    status, _, headers = gw.request(
        "POST", "/v1/completions", {"model": "m", "prompt": [[1] * 10, [2] * 20000]}
    )
    assert headers["X-Libra-Bucket"] == "long"
    status, _, headers = gw.request("POST", "/v1/completions", {"model": "m", "prompt": [1] * 100})
    assert headers["X-Libra-Bucket"] == "short"


def test_generate_routes_by_input_ids_and_reads_meta_info(stack):
    be, gw = stack
    before = be.get("/stats")[1]["generate"]
    key = {"X-SMG-Routing-Key": "slime-sample-9"}  # what slime sets per sample
    body = {"input_ids": [5] * 2000, "sampling_params": {"max_new_tokens": 8}, "return_logprob": True}
    status, out, headers = gw.request("POST", "/generate", body, key)
    assert (
        status == 200 and headers["X-Libra-Bucket"] == "short" and out["meta_info"]["prompt_tokens"] == 2000
    )
    status, out, headers = gw.request("POST", "/generate", {**body, "input_ids": [5] * 20000}, key)
    assert headers["X-Libra-Bucket"] == "long"
    s = gw.get("/sessions/slime-sample-9")[1]
    assert [t["context_tokens"] for t in s["turns"]] == [2000, 20000]
    assert s["generated_tokens"] == 2 * len(out["output_ids"])  # meta_info's completion_tokens, metered
    status, _, headers = gw.request("POST", "/generate", {"text": "x" * 400, "stream": True}, key)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert gw.get("/sessions/slime-sample-9")[1]["generated_tokens"] == 3 * len(out["output_ids"])
    assert gw.post("/generate", {"sampling_params": {}})[0] == 400
    assert be.get("/stats")[1]["generate"] - before == 3  # one process serves both ports; the 400 never left


def test_sessions_keyed_as_frameworks_key_them(stack):
    be, gw = stack
    msgs = [{"role": "user", "content": "hi"}]
    # SkyRL: trajectory_id in the body, through the official client's extra_body
    with openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as client:
        for _ in range(3):
            client.chat.completions.create(model="m", messages=msgs, extra_body={"trajectory_id": "sky-1"})
        client.chat.completions.create(model="m", messages=msgs, extra_body={"trajectory_id": 42})
        client.completions.create(
            model="m", prompt=["a", "b"], extra_body={"trajectory_id": ["sky-b", "sky-c"]}
        )
        client.chat.completions.create(model="m", messages=msgs, user="u-1")
        client.chat.completions.create(model="m", messages=msgs, extra_headers={"X-Episode": "ep-1"})
        client.chat.completions.create(model="m", messages=msgs, extra_body={"episode_id": "ep-2"})
        client.chat.completions.create(model="m", messages=msgs, extra_headers={"X-Request-Id": "req-77"})
    assert len(gw.get("/sessions/sky-1")[1]["turns"]) == 3
    for sid in ("42", "sky-b", "u-1", "ep-1", "ep-2"):
        status, s = gw.get(f"/sessions/{sid}")
        assert status == 200 and len(s["turns"]) == 1, sid
    assert be.get("/stats")[1]["last_request_id"] == "req-77"  # vLLM takes it as the request's id
    status, body = gw.post(
        "/v1/chat/completions", {"model": "m", "messages": msgs, "trajectory_id": "x" * 300}
    )
    assert status == 400 and body["error"]["param"] == "trajectory_id"


def test_max_context_above_the_backends_model_is_refused(stack, instant_factory, tmp_path):  # noqa: F811
    small = instant_factory("--model", "m", "--max-context", "8192")
    with pytest.raises(RuntimeError, match=r"backends\[0\]\.max_context.*max_model_len 8192"):
        start_gateway(*backend_arg(small.url, "long", 4, 40960), log_dir=tmp_path)  # exits 2 at start
    be, gw = stack
    status, body = gw.post("/admin/instances", {"url": small.url, "bucket": "long", "name": "x"})
    assert status == 400 and body["error"]["param"] == "max_context" and "8192" in body["error"]["message"]
    assert "x" not in [i["id"] for i in gw.get("/admin/instances")[1]["instances"]]
    assert gw.post("/admin/instances", {"url": small.url, "bucket": "short", "name": "y"})[0] == 201
    assert gw.request("DELETE", "/admin/instances/y?force=true")[0] == 200  # the module's gateway as it was

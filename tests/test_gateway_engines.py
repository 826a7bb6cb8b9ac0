"""End to end with real token generation: the official `openai` client drives multi-turn,
tool-calling sessions through `libra serve gateway` to built-in engine processes in two buckets.

- Sessions whose tool returns fail repeatedly move to the larger bucket, and every decision the
  live gateway made is the one the same router class makes offline for the same path and inputs.
- An engine is killed (SIGKILL) while it serves requests: every session still completes, each
  turn is answered exactly once, and the sessions continue on the other instance of the bucket.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from libra.rollout.base import Bucket, FinishedTrajectory, InstanceView
from libra.rollout.registry import make_router
from libra.rollout.tool_state import classify
from libra.rollout.tree import state_key
from tests.conftest import wait_for
from tests.engine_fixtures import engine_factory, start_engine  # noqa: F401
from tests.test_engine_http import metric as engine_metric
from tests.test_gateway_fixtures import backend_arg, gateway_factory, metric  # noqa: F401
from tests.test_gateway_http import replay_offline

RUN_CODE = {
    "type": "function",
    "function": {
        "name": "run_code",
        "description": "Run a Python snippet.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
FAIL = 'Traceback (most recent call last):\n  File "main.py", line 1\nNameError: name "x" is not defined'
OK = "exit code 0\nstdout: 42"
SHORT, LONG = 1024, 8192
BUCKETS = [Bucket("short", 1, SHORT), Bucket("long", 2, LONG)]
F, S = classify("run_code", FAIL), classify("run_code", OK)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A short-bucket and a long-bucket engine, started in parallel."""
    log_dir = tmp_path_factory.mktemp("engines")
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: start_engine(log_dir=log_dir), range(2)))
    yield started
    for e in started:
        e.stop()


def offline_tree(path) -> None:
    """A learned tree: one failure is usually followed by recovery, two failures by a long run.

    After one failure both the mean and the P90 of what remains fit the short bucket, so C-MLFQ
    keeps the session; after two, both say long, so it moves.
    """
    router = make_router("cmlfq-paper", BUCKETS)
    contexts = (100, 200, 300, 400)
    runs = [((F, F, F), 5000)] + [((F, S, S), 500)] * 9 + [((S, S, S), 500)] * 4
    for i, (p, final) in enumerate(runs):
        router.on_finish(FinishedTrajectory(f"t{i}", "synthetic", 0, p, contexts, final))
    router.tree.save(path)


async def agent_session(client, sid: str, returns: list[str], answer_tokens: int = 16) -> list[str]:
    """One agent loop: a tool call per entry of `returns` (answered with that text), then an answer.
    Returns the bucket that served each turn."""
    messages = [{"role": "user", "content": f"Compute the answer for case {sid}."}]
    headers = {"X-Session-ID": sid}
    buckets = []
    for text in returns:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, tools=[RUN_CODE], temperature=0.7, extra_headers=headers,
            extra_body={"libra_tool_rounds": len(returns) + 1},
        )  # fmt: skip
        buckets.append(raw.headers["X-Libra-Bucket"])
        reply = raw.parse().choices[0]
        assert reply.finish_reason == "tool_calls", reply
        (call,) = reply.message.tool_calls
        assert call.function.name == "run_code"
        messages += [reply.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": text}]  # fmt: skip
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, tools=[RUN_CODE], tool_choice="none", max_tokens=answer_tokens,
        extra_headers=headers, extra_body={"ignore_eos": True},
    )  # fmt: skip
    buckets.append(raw.headers["X-Libra-Bucket"])
    final = raw.parse()
    assert final.choices[0].message.tool_calls is None and final.usage.completion_tokens == answer_tokens
    return buckets


def test_failing_sessions_move_to_the_larger_bucket_exactly_as_the_router_predicts(engines, gateway_factory, tmp_path):  # noqa: F811  # fmt: skip
    short, long_ = engines
    tree = tmp_path / "tree.json"
    offline_tree(tree)
    # spill: saturated, so that each turn runs where the router put it: with the default (cost, which
    # without a cost model balances load per GPU), a turn sent to the busy short engine would run on
    # the idle long one (placement, tested apart).
    gw = gateway_factory(*backend_arg(short.url, "short", 1, SHORT), *backend_arg(long_.url, "long", 2, LONG),
                         "--router", "cmlfq-paper", "--tree-path", str(tree),
                         "--set", "router_params.spill=saturated")  # fmt: skip
    plans = {"fff-0": [FAIL] * 3, "fff-1": [FAIL] * 3, "fss-0": [FAIL, OK, OK], "sss-0": [OK] * 3}

    async def drive():
        async with openai.AsyncOpenAI(
            base_url=gw.base_url, api_key="x", max_retries=0, timeout=600
        ) as client:
            return await asyncio.gather(*(agent_session(client, sid, r) for sid, r in plans.items()))

    routes = dict(zip(plans, asyncio.run(drive()), strict=True))
    assert routes["fff-0"] == routes["fff-1"] == ["short", "short", "long", "long"]
    assert routes["fss-0"] == routes["sss-0"] == ["short"] * 4
    # The same router class, fed the same tree and each session's recorded inputs, agrees turn by turn.
    offline = make_router("cmlfq-paper", BUCKETS)
    offline.tree.merge(type(offline.tree).load(tree))
    views = [InstanceView(i["id"], i["bucket_index"], i["tp"], 0, i["cap"], True) for i in gw.get("/admin/instances")[1]["instances"]]  # fmt: skip
    for sid, route in routes.items():
        record = gw.get(f"/sessions/{sid}")[1]
        assert replay_offline(offline, record, views) == [["short", "long"].index(b) for b in route], sid
        assert record["path"] == [
            state_key(s) for s in {"fff": [F] * 3, "fss": [F, S, S], "sss": [S] * 3}[sid[:3]]
        ]
        assert gw.post(f"/sessions/{sid}/finish")[0] == 200
    text = gw.metrics()
    assert (
        metric(text, "libra_gateway_migrations_total", from_bucket="short", to_bucket="long", reason="policy")
        == 2
    )
    assert metric(text, "libra_gateway_decisions_total", bucket="long") == 4


def test_an_engine_killed_mid_run_loses_no_session(engines, engine_factory, gateway_factory):  # noqa: F811
    b, long_ = engines  # the module's engines take the other short slot and the long bucket
    a = engine_factory()  # the victim
    gw = gateway_factory(*backend_arg(a.url, "short", 1, SHORT, name="a"), *backend_arg(b.url, "short", 1, SHORT, name="b"),
                         *backend_arg(long_.url, "long", 2, LONG, name="long"), "--router", "cmlfq-paper")  # fmt: skip
    sids = [f"kill-{i}" for i in range(SESSIONS)]
    returns = [OK, FAIL, OK]

    async def drive():
        async with openai.AsyncOpenAI(
            base_url=gw.base_url, api_key="x", max_retries=0, timeout=600
        ) as client:
            tasks = [
                asyncio.create_task(agent_session(client, sid, returns, answer_tokens=100)) for sid in sids
            ]
            await asyncio.to_thread(kill_when_busy, gw, a, after_turns=2 * SESSIONS, total_turns=4 * SESSIONS)
            return await asyncio.gather(*tasks)

    routes = asyncio.run(drive())
    assert len(routes) == SESSIONS and all(len(r) == 4 for r in routes)  # every session, every turn answered
    instances = {i["id"]: i for i in gw.get("/admin/instances")[1]["instances"]}
    assert instances["a"]["health"] == "down" and instances["b"]["routable"]
    turns_total = moved = 0
    for sid in sids:
        status, out = gw.post(f"/sessions/{sid}/finish")
        turns = out["session"]["turns"]
        assert status == 200 and len(turns) == 4  # each turn recorded once: none lost, none doubled
        turns_total += len(turns)
        served = [t["failover_to"] or t["instance"] for t in turns]
        # Once a session left the dead instance it never went back; it stayed in its bucket.
        assert set(served) <= {"a", "b"} and "a" not in served[served.index("b") :] if "b" in served else True
        moved += served[0] == "a" and served[-1] == "b"
    assert moved >= 1
    assert turns_total == 4 * SESSIONS
    text = gw.metrics()
    assert (
        metric(text, "libra_gateway_requests_total", endpoint="/v1/chat/completions", status="200")
        == 4 * SESSIONS
    )
    assert metric(text, "libra_gateway_retries_total") >= 1
    assert metric(text, "libra_gateway_requests_total", endpoint="/v1/chat/completions", status="502") == 0


# Sessions in the kill test: enough that each short engine serves several at once (each has four
# turns, the last a 100-token answer, so the victim is busy for many polls of kill_when_busy).
SESSIONS = 8


def kill_when_busy(gw, victim, after_turns: int, total_turns: int, timeout: float = 600.0) -> None:
    """SIGKILL `victim` mid-run: once `after_turns` turns were answered, while it has requests in
    flight. Fails at once if the run ends first (the timeout only stops a hung run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = metric(
            gw.metrics(), "libra_gateway_requests_total", endpoint="/v1/chat/completions", status="200"
        )
        inst = next(i for i in gw.get("/admin/instances")[1]["instances"] if i["id"] == "a")
        if done >= after_turns and inst["outstanding"] >= 2:
            victim.kill()
            return
        assert done < total_turns, "instance a never had requests in flight late enough in the run"
        time.sleep(0.01)
    raise AssertionError("the sessions never got far enough to kill instance a")


def test_a_client_that_leaves_mid_stream_frees_the_engine(engines, gateway_factory):  # noqa: F811
    short, long_ = engines
    gw = gateway_factory(*backend_arg(short.url, "short", 1, SHORT), *backend_arg(long_.url, "long", 2, LONG))
    aborted = engine_metric(short.metrics(), 'libra_engine_sequences_finished_total{reason="abort"}')
    finished = engine_metric(short.metrics(), 'libra_engine_sequences_finished_total{reason="length"}')
    with openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=600) as client:
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Write a long story."}], max_tokens=8000,
            stream=True, extra_body={"ignore_eos": True}, user="leaver",
        )  # fmt: skip
        first = [next(iter(stream)) for _ in range(3)]
        assert first[0].choices[0].delta.role == "assistant"
        stream.close()

    def idle() -> bool:
        busy = sum(i["outstanding"] for i in gw.get("/admin/instances")[1]["instances"])
        return busy == 0 and short.get("/health")["running"] == 0

    wait_for(idle, "the engine freed")
    # The generation was aborted, not left to run its 8000 tokens: the engine counts it as such.
    assert (
        engine_metric(short.metrics(), 'libra_engine_sequences_finished_total{reason="abort"}') == aborted + 1
    )
    assert (
        engine_metric(short.metrics(), 'libra_engine_sequences_finished_total{reason="length"}') == finished
    )

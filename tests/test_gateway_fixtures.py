"""Real processes for the gateway tests: `libra serve gateway` and the instant backend, on loopback.

Both bind port 0 and print the port they got, so parallel runs never race for a port; their
output goes to a log file that is attached to any start-up failure. `gateway_factory` and
`instant_factory` stop everything they started at teardown. The few tests at the bottom check the
instant backend itself, since the benchmark's figures rest on it answering like a real server.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from libra.rollout.routers import LeastLoadedRouter
from tests.conftest import wait_for
from tests.engine_fixtures import HANG_S, ProcessControl

LISTENING = re.compile(r"listening on (http://[^\s:]+:(\d+))")


@dataclass
class Proc(ProcessControl):
    proc: subprocess.Popen
    urls: list[str]
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    # ---- plain HTTP, for what the openai client does not cover ----------------------------------

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None, url: str | None = None, timeout: float = HANG_S) -> tuple[int, dict, dict]:  # fmt: skip
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        req = urllib.request.Request((url or self.url) + path, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, _json(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, _json(e.read()), dict(e.headers)

    def get(self, path: str, **kw) -> tuple[int, dict]:
        status, body, _ = self.request("GET", path, **kw)
        return status, body

    def post(self, path: str, body: bytes | dict | None = None, **kw) -> tuple[int, dict]:
        status, data, _ = self.request("POST", path, body if body is not None else b"", **kw)
        return status, data

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=HANG_S) as r:
            return r.read().decode()


def _json(raw: bytes) -> dict:
    try:
        return json.loads(raw)
    except ValueError:
        return {"_raw": raw.decode(errors="replace")}


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + " ") or line.startswith(name + "{")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start(cmd: list[str], log_dir: Path, n_urls: int = 1, timeout: float = HANG_S) -> Proc:
    log_path = log_dir / f"proc-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = LISTENING.findall(log_path.read_text(errors="replace"))
        if len(found) >= n_urls:
            return Proc(proc, [u for u, _ in found[:n_urls]], log_path)
        if proc.poll() is not None:
            raise RuntimeError(
                f"{cmd[3:6]} exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}"
            )
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{cmd} did not start in {timeout}s:\n{log_path.read_text(errors='replace')}")


def start_instant(*args: str, ports: int = 1, log_dir: Path | None = None) -> Proc:
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="libra-instant-"))
    cmd = [sys.executable, "-m", "tests.instant_backend", *(["--port", "0"] * ports), *args]
    return start(cmd, log_dir, n_urls=ports)


def start_gateway(*args: str, log_dir: Path | None = None) -> Proc:
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="libra-gateway-"))
    cmd = [sys.executable, "-m", "libra", "serve", "gateway", "--port", "0", *args]
    return start(cmd, log_dir)


def backend_arg(url: str, bucket: str, tp: int, max_context: int, **more) -> list[str]:
    extra = "".join(f",{k}={v}" for k, v in more.items())
    return ["--backend", f"{url},bucket={bucket},tp={tp},max_context={max_context}{extra}"]


@pytest.fixture
def instant_factory(tmp_path):
    started: list[Proc] = []

    def make(*args: str, ports: int = 1) -> Proc:
        p = start_instant(*args, ports=ports, log_dir=tmp_path)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


@pytest.fixture
def gateway_factory(tmp_path):
    started: list[Proc] = []

    def make(*args: str) -> Proc:
        p = start_gateway(*args, log_dir=tmp_path)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


class ExplodingRouter(LeastLoadedRouter):
    """A router with a bug: it raises for sessions whose id starts with 'boom' (plugged into a
    gateway as `--router tests.test_gateway_fixtures:ExplodingRouter`)."""

    name = "exploding"

    def route(self, req, instances):
        if req.traj_id.startswith("boom"):
            raise RuntimeError("router bug")
        return super().route(req, instances)

    def on_finish(self, traj) -> None:
        if traj.traj_id.startswith("boom"):
            raise RuntimeError("router bug")


# ---- the instant backend answers like an OpenAI server ------------------------------------------


def test_instant_backend_chat_tools_stream_and_errors(instant_factory):
    be = instant_factory("--model", "m", "--reply", "hello")
    user = {"role": "user", "content": "x" * 40}
    status, body = be.post("/v1/chat/completions", {"model": "m", "messages": [user]})
    assert status == 200 and body["choices"][0]["message"]["content"] == "hello"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    tools = [{"type": "function", "function": {"name": "run"}}]
    status, body = be.post("/v1/chat/completions", {"model": "m", "messages": [user], "tools": tools})
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "run"
    after = [
        user,
        body["choices"][0]["message"],
        {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
    ]
    status, body = be.post("/v1/chat/completions", {"model": "m", "messages": after, "tools": tools})
    assert body["choices"][0]["finish_reason"] == "stop"  # one round by default, then text
    assert be.post("/v1/chat/completions", {"model": "other", "messages": [user]})[0] == 404
    assert be.post("/v1/chat/completions", b"{")[0] == 400
    stats = be.get("/stats")[1]
    assert stats["chat"] == 3 and stats["completions"] == 0


def test_instant_backend_speaks_to_the_openai_client(instant_factory):
    openai = pytest.importorskip("openai")
    be = instant_factory("--model", "m", "--reply", "hello world")
    with openai.OpenAI(base_url=be.base_url, api_key="x", max_retries=0) as c:
        chunks = list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}))  # fmt: skip
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == "hello world" and chunks[-1].usage.completion_tokens == 3
        assert c.completions.create(model="m", prompt="abc").choices[0].text == "hello world"
        assert [m.id for m in c.models.list().data] == ["m"]


def test_instant_backend_gate_holds_requests_until_enough_wait_or_it_is_opened(instant_factory):
    """The gate the gateway tests use instead of delays: the first requests wait until N are held
    together (then all go on), and a gate closed by hand holds every request until it is opened."""
    be = instant_factory("--model", "m", "--hold-until", "2")
    body = {"model": "m", "prompt": "x"}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(be.post, "/v1/completions", body)
        wait_for(lambda: be.get("/stats")[1]["held"] == 1, "the first request held")
        assert not first.done()  # held until a second one arrives
        second = pool.submit(be.post, "/v1/completions", body)
        assert first.result()[0] == second.result()[0] == 200
        assert (
            be.get("/stats")[1]["peak_inflight"] == 2 and be.post("/v1/completions", body)[0] == 200
        )  # open now
        assert be.post("/gate", {"open": False}) == (200, {"open": False, "held": 0})
        third = pool.submit(be.post, "/v1/completions", body)
        wait_for(lambda: be.get("/stats")[1]["held"] == 1, "the request held by the closed gate")
        assert not third.done()
        assert be.post("/gate", {"open": True})[0] == 200 and third.result()[0] == 200
    assert be.get("/stats")[1] | {"last_request_id": None} == {
        "chat": 0, "completions": 4, "generate": 0, "inflight": 0, "peak_inflight": 2, "held": 0,
        "last_request_id": None}  # fmt: skip
    status, err = be.post("/gate", {"open": "yes"})
    assert status == 400 and err["error"]["param"] == "open"

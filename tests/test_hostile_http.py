"""The hostile-input suite: each probe of issue 38 against the live engine, gateway and actions
service over real HTTP on loopback, with the service process's resident memory measured before and
after every probe (growth under 100 MB).

Each service is started once for the module, with small caps (they are settings), so a payload
only as large as it takes to cross a cap proves the cap: a batch of prompts one past
`max_prompts_per_request`, a header left unfinished past a 1 s `header_timeout_s`, files past a
1 MiB `max_response_bytes`. Every refusal is a 4xx that names the field or the setting.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch

from libra.runtime.sandbox.client import ServiceProcess
from tests.engine_fixtures import start_engine
from tests.test_actions_service import PATIENT_S, unavailable
from tests.test_actions_service import sandbox_available as _sandbox
from tests.test_gateway_fixtures import backend_arg, start_gateway

TOKEN = "hostile-admin"
RSS_GROWTH_MB = 100
T = 60.0  # a bound that only stops a hung service from hanging the suite, never a measurement


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@contextlib.contextmanager
def bounded(pid: int):
    """The probe inside must leave the service's resident memory within RSS_GROWTH_MB."""
    before = rss_mb(pid)
    yield
    grew = rss_mb(pid) - before
    assert grew < RSS_GROWTH_MB, f"the service grew by {grew:.0f} MB ({before:.0f} MB before)"


def partial(url: str, data: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=T)
    if data:
        s.sendall(data)
    return s


def answer(s: socket.socket) -> bytes:
    """What the server sends before closing (b'' when it just closes)."""
    out = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            out += chunk
    s.close()
    return out


def slowloris(url: str, path: str, n: int = 40) -> None:
    """`n` connections that send half a request's headers, then `n` whose body never arrives:
    every one is answered 408 naming the setting and closed, and the service keeps serving."""
    heads = [partial(url, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-".encode()) for _ in range(n)]
    bodies = [partial(url, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{".encode()) for _ in range(n)]  # fmt: skip
    assert httpx.get(url + "/health", timeout=T).status_code in (200, 503)  # still serving meanwhile
    for s in heads:
        got = answer(s)
        assert got.startswith(b"HTTP/1.1 408") and b"header_timeout_s" in got, got[:300]
    for s in bodies:
        got = answer(s)
        assert got.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in got, got[:300]


def per_client(url: str, limit: int) -> None:
    """`limit` open connections from one client; the next is answered 503 naming the setting and
    closed (connections are accepted in the order they were made, so the one too many is the
    last); once they close, the client is served again."""
    held = [partial(url, b"") for _ in range(limit)]
    extra = answer(partial(url, b""))
    assert extra.startswith(b"HTTP/1.1 503") and b"max_connections_per_client" in extra, extra[:300]
    for s in held:
        s.close()
    deadline = time.monotonic() + T  # until the server has seen the closes
    while httpx.get(url + "/health", timeout=T).status_code != 200:
        assert time.monotonic() < deadline, "the client was never served again"
        time.sleep(0.05)


# ---- the engine and the gateway in front of it --------------------------------------------------------

LIMITS = ["--header-timeout-s", "1", "--body-timeout-s", "1"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine("--kv-cache-mb", "32", "--max-prompts-per-request", "64", "--max-request-tokens", "20000",
                       "--admin-token", TOKEN, *LIMITS, log_dir=tmp_path_factory.mktemp("engine"))  # fmt: skip
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory):
    sets = {"max_prompts_per_request": 32, "max_request_tokens": 10000, "header_timeout_s": 1,
            "body_timeout_s": 1, "max_connections_per_client": 16}  # fmt: skip
    gw = start_gateway(*backend_arg(engine.url, "only", 1, 8192), "--admin-token", TOKEN,
                       *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), log_dir=tmp_path_factory.mktemp("gw"))  # fmt: skip
    deadline = time.monotonic() + T
    while httpx.get(gw.url + "/health", timeout=T).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    yield gw
    gw.stop()


def post(url: str, path: str, body: object, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=T)


def error_of(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_engine_refuses_a_batch_past_its_prompt_cap_before_reading_it(engine):
    with bounded(engine.proc.pid):
        r = post(engine.url, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 20_000, "max_tokens": 1})
        assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text[:300]
        assert "max_prompts_per_request" in error_of(r)["message"] and "20000" in error_of(r)["message"]
        r = post(
            engine.url, "/generate", {"input_ids": [[1, 2]] * 65, "sampling_params": {"max_new_tokens": 1}}
        )
        assert r.status_code == 400 and error_of(r)["param"] == "input_ids", r.text[:300]
    ok = post(engine.url, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 64, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64


def test_engine_caps_the_tokens_one_request_queues(engine):
    with bounded(engine.proc.pid):
        r = post(engine.url, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 64, "max_tokens": 400})
        assert r.status_code == 400 and "max_request_tokens" in error_of(r)["message"], r.text[:300]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 16, "max_tokens": 2000}
        r = post(engine.url, "/v1/chat/completions", chat)
        assert r.status_code == 400 and error_of(r)["code"] == "request_too_large", r.text[:300]


def test_engine_types_are_as_strict_as_vllms(engine):
    """vLLM refuses max_tokens past the context (400 naming it); it takes token ids as pydantic's
    lax mode does (true is 1), and so does the engine (docs/engine.md)."""
    r = post(engine.url, "/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 2**63})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens", r.text[:300]
    assert "is too large" in error_of(r)["message"]
    r = post(engine.url, "/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 8191})
    assert r.status_code == 400 and "8191 > 8192 - 2" in error_of(r)["message"], r.text[:300]
    r = post(engine.url, "/v1/completions", {"model": "tiny", "prompt": [True, False], "max_tokens": 1, "return_token_ids": True})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["prompt_token_ids"] == [1, 0], r.text[:300]


def test_engine_reads_weights_only_from_regular_finite_files(engine, tmp_path):
    """A FIFO (eight times: each once held a thread forever), a device and NaN weights are each a
    400 naming model_path, and the engine still takes a good file afterwards."""
    from libra.runtime.engine.config import PRESETS
    from libra.runtime.engine.model import TinyTransformer

    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    good = TinyTransformer(PRESETS["tiny"], 3).state_dict()
    torch.save(good, tmp_path / "good.pt")
    nan = {k: v.clone() for k, v in good.items()}
    next(iter(nan.values())).fill_(float("nan"))
    torch.save(nan, tmp_path / "nan.pt")
    path = "/update_weights_from_disk"
    with bounded(engine.proc.pid):
        assert post(engine.url, path, {"model_path": str(tmp_path / "good.pt")}).status_code == 401
        for _ in range(8):
            r = post(engine.url, path, {"model_path": str(fifo)}, TOKEN)
            assert r.status_code == 400 and "named pipe" in r.json()["message"], r.text[:300]
        r = post(engine.url, path, {"model_path": "/dev/zero"}, TOKEN)
        assert r.status_code == 400 and "character device" in r.json()["message"], r.text[:300]
        r = post(engine.url, path, {"model_path": str(tmp_path / "nan.pt")}, TOKEN)
        assert r.status_code == 400 and "NaN" in r.json()["message"] and r.json()["param"] == "model_path"
        r = post(engine.url, path, {"model_path": str(tmp_path / "good.pt"), "weight_version": "7"}, TOKEN)
        assert r.status_code == 200 and r.json()["success"], r.text[:300]
    assert engine.get("/health")["weight_version"] == "7"


def test_engine_times_out_unfinished_headers_and_bodies(engine):
    with bounded(engine.proc.pid):
        slowloris(engine.url, "/v1/completions")


def test_gateway_caps_prompts_and_tokens_itself(gateway):
    with bounded(gateway.proc.pid):
        r = post(gateway.url, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 20_000, "max_tokens": 1})
        assert r.status_code == 400 and "this gateway" in error_of(r)["message"], r.text[:300]
        assert error_of(r)["param"] == "prompt" and "max_prompts_per_request" in error_of(r)["message"]
        r = post(
            gateway.url, "/v1/completions", {"model": "tiny", "prompt": [[1, 2]] * 30, "max_tokens": 400}
        )
        assert r.status_code == 400 and "max_request_tokens" in error_of(r)["message"], r.text[:300]
        r = post(gateway.url, "/generate", {"text": ["x"] * 33})
        assert r.status_code == 400 and error_of(r)["param"] == "text", r.text[:300]
    ok = post(gateway.url, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 32, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 32


def test_gateway_steps_and_session_ends_need_the_token(gateway):
    assert post(gateway.url, "/steps/end", {}).status_code == 401
    assert post(gateway.url, "/sessions/nobody/finish", {}).status_code == 401
    step = post(gateway.url, "/steps/end", {}, TOKEN)
    assert step.status_code == 200 and step.json()["step"] >= 1
    assert post(gateway.url, "/sessions/nobody/finish", {}, TOKEN).status_code == 404


def test_gateway_times_out_headers_and_bodies_and_limits_each_client(gateway):
    with bounded(gateway.proc.pid):
        slowloris(gateway.url, "/v1/chat/completions", n=6)  # within its per-client limit of 16
        per_client(gateway.url, 16)


# ---- the actions service ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def actions(tmp_path_factory):
    unavailable(_sandbox())
    cfg = tmp_path_factory.mktemp("actions") / "actions.yaml"
    cfg.write_text(json.dumps({
        "warm_pool": 1, "max_response_bytes": 2**20, "header_timeout_s": 1, "body_timeout_s": 1,
        "max_connections_per_client": 16,
        "sandbox": {"memory_mb": 256, "max_memory_mb": 512, "fsize_mb": 8, "output_limit_bytes": 2**19},
    }))  # fmt: skip
    with ServiceProcess(str(cfg)) as svc:
        yield svc


def run_code(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/run_code", json=body, timeout=PATIENT_S)


def test_one_action_cannot_return_more_than_the_response_cap(actions):
    """The issue's probe, scaled to the cap: one file hard-linked 40 times, all fetched; and
    output whose JSON escaping is six times its size."""
    links = "import os\nopen('b', 'wb').write(os.urandom(256 * 1024))\nfor i in range(40):\n    os.link('b', f'l{i}')"
    with bounded(actions.proc.pid):
        r = run_code(
            actions.url, {"language": "python", "code": links, "fetch_files": [f"l{i}" for i in range(40)]}
        )
        assert r.status_code == 200 and len(r.content) <= 2**20 + 4096, len(r.content)
        body = r.json()
        assert 1 <= len(body["files"]) < 40 and "max_response_bytes" in body["message"], body["message"][:500]
        assert all(len(base64.b64decode(v)) == 256 * 1024 for v in body["files"].values())
        nul = "import sys\nsys.stdout.write('\\0' * 400_000)"
        r = run_code(actions.url, {"language": "python", "code": nul})
        out = r.json()["run_result"]["stdout"]
        assert len(r.content) <= 2**20 + 4096 and "capped at max_response_bytes" in out, len(r.content)
        assert "response cap" in r.json()["message"]


def test_actions_types_follow_sandboxfusion(actions):
    """SandboxFusion requires `language` (422 naming it); it takes run_timeout "1" or true as a
    number (pydantic's lax mode), and so does this service (docs/actions.md)."""
    r = run_code(actions.url, {"code": "print(1)"})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "language", r.text[:300]
    for timeout in ("5", True):
        r = run_code(actions.url, {"language": "python", "code": "print(1)", "run_timeout": timeout})
        assert r.status_code == 200 and r.json()["status"] == "Success", r.text[:300]


def test_deaths_by_signal_name_the_signal_and_the_limit(actions):
    segv = run_code(actions.url, {"language": "python", "code": "import ctypes\nctypes.string_at(0)"}).json()
    assert segv["run_result"]["return_code"] == 139 and "SIGSEGV" in segv["message"], segv["message"]
    big = run_code(actions.url, {"language": "bash", "code": "head -c 20000000 /dev/zero > /tmp/big"}).json()
    assert "SIGXFSZ" in big["message"] and "file size limit (8 MB" in big["message"], big["message"]
    fork = "import os\nfor _ in range(400):\n    os.fork()"
    procs = run_code(actions.url, {"language": "python", "code": fork}).json()
    assert "process limit" in procs["message"], procs["message"]


def test_go_test_output_is_cut_not_killed_for_memory(actions):
    """go test holds a test's whole output in memory; 300 MB under a 256 MB limit is cut at the
    output limit with the marker, as every language's output is."""
    if "go_test" not in httpx.get(actions.url + "/health", timeout=T).json()["languages"]:
        unavailable("go is not installed (Debian: golang-go)")
    code = ('package main\nimport ("fmt"; "strings"; "testing")\nfunc TestLoud(t *testing.T) '
            '{ s := strings.Repeat("x", 1<<20); for i := 0; i < 300; i++ { fmt.Println(s) }; t.Fail() }')  # fmt: skip
    r = run_code(
        actions.url, {"language": "go_test", "code": code, "memory_limit_MB": 256, "run_timeout": 60}
    ).json()
    rr = r["run_result"]
    assert rr["status"] == "Finished" and rr["return_code"] == 1, r["message"]
    assert "truncated" in rr["stdout"] and "FAIL" in rr["stdout"] and "memory" not in r["message"], r[
        "message"
    ]


def test_actions_times_out_headers_and_bodies_and_limits_each_client(actions):
    with bounded(actions.proc.pid):
        slowloris(actions.url, "/run_code", n=6)
        per_client(actions.url, 16)

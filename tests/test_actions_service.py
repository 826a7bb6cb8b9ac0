"""The live actions service, as a real process on loopback: SandboxFusion's /run_code, sessions with
persistent files and elastic cores, the python test runner, a quota-limited HTTP tool calling a
real loopback server, reward functions, health, metrics, and 4xx answers for bad requests."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra.runtime.sandbox.client import ActionsClient, ServiceProcess
from libra.runtime.sandbox.rewards import judge_reward, unit_test_reward
from tests.conftest import wait_for


def sandbox_available() -> str | None:
    missing = [t for t in ("bwrap", "setpriv", "prlimit", "taskset") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install bubblewrap util-linux)"
    if os.geteuid() != 0:
        return "the sandbox needs root (it runs actions under their own uids)"
    return None


# CI runs `make test` as root on Debian, whose `make sysdeps` installs bubblewrap and every language's
# toolchain: there a missing one is a failure, never a skip that reads as if the tests ran.
ON_CI = bool(os.environ.get("CI"))


# A limit on a request only stops a hung service from hanging the suite; it never measures speed
# (httpx's own default, 5 s, can pass on a loaded 2-core machine while 600 programs queue).
PATIENT_S = 1800.0


class _Patient:
    """httpx's get/post/delete with PATIENT_S as the timeout unless the call gives its own."""

    def __getattr__(self, verb: str):
        return functools.partial(getattr(httpx, verb), timeout=PATIENT_S)


api = _Patient()


def unavailable(reason: str | None) -> None:
    """Skips the test with the reason (fails it on CI); nothing when `reason` is None."""
    if reason is not None:
        (pytest.fail if ON_CI else pytest.skip)(f"{reason}{' (on CI: make sysdeps installs it)' * ON_CI}")


def needs_sandbox(test):
    """Runs the test only where the sandbox can run (see `unavailable`); fixtures pass through."""

    @functools.wraps(test)
    def checked(*args, **kwargs):
        unavailable(sandbox_available())
        return test(*args, **kwargs)

    return checked


class Judge:
    """A real HTTP scoring server on loopback; it records how many calls overlap and when."""

    def __init__(self):
        from aiohttp import web

        self.active, self.peak, self.times = 0, 0, []
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.add_routes([web.post("/score", self.score)])
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def score(self, request):
        from aiohttp import web

        self.active += 1
        self.peak = max(self.peak, self.active)
        self.times.append(time.monotonic())
        body = await request.json()
        await asyncio.sleep(0.2)
        self.active -= 1
        return web.json_response({"score": len(str(body.get("answer", ""))) / 10})

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def judge():
    j = Judge()
    yield j
    j.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory, judge):
    unavailable(sandbox_available())
    cfg = tmp_path_factory.mktemp("svc") / "actions.yaml"
    cfg.write_text(json.dumps({
        "warm_pool": 2, "max_body_bytes": 2**20, "max_code_bytes": 2**18,
        "sandbox": {"default_timeout_s": 5, "max_timeout_s": 30, "max_memory_mb": 4096,
                    "uid_count": 64},  # few, so a leaked uid shows (test_files_the_work_dir_...)
        "quotas": {"judge": {"max_concurrency": 2, "tokens_per_period": 6, "period_s": 2}},
        "http_tools": {"judge": {"url": f"http://127.0.0.1:{judge.port}/score", "quota": "judge"}},
    }))  # fmt: skip
    with ServiceProcess(str(cfg)) as svc:
        yield svc


@pytest.fixture(scope="module")
def http(service):
    with httpx.Client(base_url=service.url, timeout=PATIENT_S) as c:
        yield c


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


# ---- /run_code ---------------------------------------------------------------------------------


@needs_sandbox
def test_run_code_speaks_sandboxfusion(http):
    r = http.post("/run_code", json={"code": "import sys\nprint(input()[::-1])\nprint('err', file=sys.stderr)",
                                     "language": "python", "stdin": "olleh", "compile_timeout": 10})  # fmt: skip
    assert r.status_code == 200
    body = r.json()
    assert set(body) >= {"status", "message", "compile_result", "run_result", "files"}
    assert body["status"] == "Success"
    rr = body["run_result"]
    assert rr["status"] == "Finished" and rr["return_code"] == 0
    assert rr["stdout"] == "hello\n" and rr["stderr"] == "err\n" and rr["execution_time"] > 0
    fail = http.post("/run_code", json={"code": "raise ValueError('no')", "language": "python"}).json()
    assert fail["status"] == "Failed" and fail["run_result"]["return_code"] == 1
    assert (
        fail["run_result"]["stderr"].startswith("Traceback")
        and "ValueError: no" in fail["run_result"]["stderr"]
    )
    bash = http.post("/run_code", json={"code": "echo $((6*7)); exit 3", "language": "bash"}).json()
    assert bash["run_result"]["stdout"] == "42\n" and bash["run_result"]["return_code"] == 3


@needs_sandbox
def test_run_code_files_in_and_out(http):
    r = http.post("/run_code", json={
        "language": "python", "code": "data = open('in/data.txt').read()\nopen('out.txt', 'w').write(data.upper())",
        "files": {"in/data.txt": b64("abc")}, "fetch_files": ["out.txt", "missing.txt"],
    }).json()  # fmt: skip
    assert r["status"] == "Success"
    assert base64.b64decode(r["files"]["out.txt"]) == b"ABC" and "missing.txt" not in r["files"]


@needs_sandbox
def test_run_code_timeout_is_reported(http):
    r = http.post(
        "/run_code", json={"language": "python", "code": "import time; time.sleep(600)", "run_timeout": 1}
    ).json()
    assert r["status"] == "Failed" and r["run_result"]["status"] == "TimeLimitExceeded"
    # Killed at its limit, not when the program would have ended.
    assert r["run_result"]["return_code"] is None and 1 <= r["run_result"]["execution_time"] < 600


def cold(body: dict) -> dict:
    """The same request, on the cold path: naming an absolute area other than /workspace and /tmp
    needs binds made at sandbox start, which a warm sandbox does not have."""
    return {**body, "fetch_files": [*body.get("fetch_files", []), "/cold/none"]}


# Programs whose output shows how they were run: the warm zygote must print exactly what
# `python _libra_main.py` does (the cold path runs exactly that).
PYTHON_PROBES = {
    "syntax error": "int a = 1",
    "indentation": "def f():\nreturn 1",
    "deep traceback": "def f(n):\n    return 1 / n if n == 0 else f(n - 1)\nf(3)",
    "exit message": "import sys\nsys.exit('bye')",
    "exit code": "raise SystemExit(3)",
    "excepthook": "import sys\nsys.excepthook = lambda *a: print('hooked', a[0].__name__)\nraise KeyError(1)",
    "identity": "import sys, os\nprint(__name__, __file__, sys.argv, sys.path[0], os.getcwd())",
    "chained": "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    raise ValueError('x') from e",
}


@needs_sandbox
def test_python_output_is_what_plain_python_prints_on_every_path(http, tmp_path):
    """Bug 3: a syntax error showed the service's own frames (`_libra_zygote`) on the warm path only,
    so the model saw different output depending on memory_limit_MB. Warm, cold and any memory limit
    now print the same, and a syntax error is exactly what `python3 file.py` prints."""
    for name, code in PYTHON_PROBES.items():
        warm = http.post("/run_code", json={"language": "python", "code": code}).json()["run_result"]
        limited = http.post(
            "/run_code", json={"language": "python", "code": code, "memory_limit_MB": 512}
        ).json()["run_result"]
        coldr = http.post("/run_code", json=cold({"language": "python", "code": code})).json()["run_result"]
        for other in (limited, coldr):
            assert (other["stdout"], other["stderr"], other["return_code"]) == (
                warm["stdout"], warm["stderr"], warm["return_code"]), name  # fmt: skip
        assert "_libra_zygote" not in warm["stderr"] and "<string>" not in warm["stderr"], (name, warm)
    script = tmp_path / "_libra_main.py"
    script.write_text(PYTHON_PROBES["syntax error"])
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    got = http.post("/run_code", json={"language": "python", "code": PYTHON_PROBES["syntax error"]}).json()[
        "run_result"
    ]
    assert got["stderr"] == plain.stderr.replace(str(script), "/workspace/_libra_main.py")


@needs_sandbox
def test_absolute_paths_map_inside_the_sandbox(http):
    """Item 6: SandboxFusion's own test writes `/mnt/b` and fetches it back; `files` may name
    /tmp and other absolute paths too, and `files: {"x": null}` is skipped, as there."""
    r = http.post("/run_code", json={
        "language": "python", "code": "open('a.txt', 'w').write('secret'); open('/mnt/b', 'w').write('sauce')\n"
                "print(open('/data/in/x.txt').read(), open('/tmp/t.txt').read(), __import__('os').path.exists('skip'))",
        "files": {"/data/in/x.txt": b64("dx"), "/tmp/t.txt": b64("tx"), "skip": None},
        "fetch_files": ["a.txt", "/mnt/b", "/workspace/a.txt"],
    }).json()  # fmt: skip
    assert r["status"] == "Success", r
    assert r["run_result"]["stdout"] == "dx tx False\n"
    assert {k: base64.b64decode(v) for k, v in r["files"].items()} == {
        "a.txt": b"secret", "/mnt/b": b"sauce", "/workspace/a.txt": b"secret"}  # fmt: skip
    # Nothing maps outside: not the system, not the interpreter's tree, not /proc or /dev.
    top = sys.prefix.split("/")[1]
    # The interpreter's top-level directory is refused, unless it is /tmp (a checkout under /tmp):
    # the sandbox's own /tmp is a request's to write, with the interpreter bound inside it.
    interpreter = [f"/{top}/x"] if top not in ("tmp", "workspace") else []
    for name in (
        "/etc/passwd",
        "/usr/x",
        *interpreter,
        "/proc/self/environ",
        "/dev/zero",
        "/",
        "/mnt",
        "/a/../b",
    ):
        for body in (
            {"language": "python", "code": "pass", "files": {name: b64("x")}},
            {"language": "python", "code": "pass", "fetch_files": [name]},
        ):
            bad = http.post("/run_code", json=body)
            assert bad.status_code == 422, (name, bad.text[:300])
            assert name[:50] in json.dumps(bad.json()), bad.text[:300]
    # A session keeps its absolute areas from action to action.
    sid = http.post("/sessions", json={"files": {"/opt/app/cfg": b64("v1")}}).json()["session_id"]
    a = http.post(
        f"/sessions/{sid}/actions", json={"command": "cat /opt/app/cfg; echo v2 > /opt/app/out"}
    ).json()
    b = http.post(
        f"/sessions/{sid}/actions", json={"command": "cat /opt/app/out", "fetch_files": ["/opt/app/out"]}
    )
    assert a["run_result"]["stdout"] == "v1" and b.json()["run_result"]["stdout"] == "v2\n", (a, b.text)
    assert base64.b64decode(b.json()["files"]["/opt/app/out"]) == b"v2\n"
    http.delete(f"/sessions/{sid}")


@needs_sandbox
def test_output_is_whole_by_default_and_a_cut_is_reported(http):
    """Item 7: a 5 MB answer comes back whole (SandboxFusion's default: the whole output); a request
    may ask for less, never for more than the service allows, and a cut says so."""
    code = "import sys\nsys.stdout.write('y' * (5 * 2**20))"
    whole = http.post("/run_code", json={"language": "python", "code": code}).json()
    assert whole["status"] == "Success" and len(whole["run_result"]["stdout"]) == 5 * 2**20
    assert "truncated" not in whole["message"]
    cut = http.post("/run_code", json={"language": "python", "code": code, "output_limit_bytes": 1000}).json()
    assert cut["run_result"]["stdout"].startswith("y" * 1000) and len(cut["run_result"]["stdout"]) < 1100
    assert f"{5 * 2**20 - 1000} bytes dropped" in cut["message"]
    over = http.post("/run_code", json={"language": "python", "code": code, "output_limit_bytes": 2**40})
    assert over.status_code == 422 and over.json()["field"] == "output_limit_bytes"


# 32 threads that all exist at once (the barrier), then how many threads there were: 33.
THREADS_32 = ("from concurrent.futures import ThreadPoolExecutor\nimport threading\nb = threading.Barrier(33, timeout=20)\n"
              "with ThreadPoolExecutor(32) as p:\n    fs = [p.submit(b.wait) for _ in range(32)]\n    b.wait()\n"
              "    print(len(threading.enumerate()))")  # fmt: skip


@needs_sandbox
def test_memory_is_resident_and_minus_one_means_no_limit_of_its_own(http):
    """Item 8: 32 threads start at verl's 1 GB (an address-space limit allowed about 22, each thread
    reserving a malloc arena); a program over its limit is killed and told so; -1 runs up to the
    service's ceiling, as SandboxFusion's -1 means no limit."""
    r = http.post(
        "/run_code", json={"language": "python", "code": THREADS_32, "memory_limit_MB": 1024}
    ).json()
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "33\n", r
    hog = "x = bytearray(300 * 2**20)\nx[::4096] = b'1' * len(x[::4096])\nprint('survived')"
    health = http.get("/health").json()
    killed = http.post("/run_code", json={"language": "python", "code": hog, "memory_limit_MB": 100}).json()
    assert killed["status"] == "Failed" and "survived" not in killed["run_result"]["stdout"], killed
    if health["limits"]["memory"].startswith("resident"):
        assert "over its memory limit" in killed["message"]
    free = http.post("/run_code", json={"language": "python", "code": hog, "memory_limit_MB": -1}).json()
    assert free["status"] == "Success" and free["run_result"]["stdout"] == "survived\n", free


@needs_sandbox
def test_ping_answers_as_sandboxfusion_does(http):
    r = http.get("/v1/ping")
    assert r.status_code == 200 and r.json() == "pong"


@needs_sandbox
def test_errors_quote_a_short_prefix_never_the_request(http):
    """Bug 4: an unsupported language in a 4.2 MB request got a 4.2 MB error (field `body`, value the
    whole request). Now the field is named, with what is allowed, and at most a short prefix."""
    big = "x" * (2**18 - 100)
    for body in ({"code": big, "language": "cobol"}, {"code": big, "language": "z" * 10_000},
                 {"language": "python", "code": big, "memory_limit_MB": "lots"}, {"language": "python", "code": big, "files": {"a": 1}}):  # fmt: skip
        r = http.post("/run_code", json=body)
        assert r.status_code == 422 and len(r.content) < 3000, (r.status_code, r.text[:300])
    r = http.post("/run_code", json={"code": big, "language": "cobol"}).json()["detail"][0]
    assert r["field"] == "language" and r["value"] == "cobol" and "cpp" in r["allowed"]
    sid = http.post("/sessions", json={}).json()["session_id"]
    r = http.post(f"/sessions/{sid}/actions", json={"command": big, "tool": "python_tests"})
    assert r.status_code == 422 and len(r.content) < 3000, r.text[:300]
    http.delete(f"/sessions/{sid}")


# ---- sessions --------------------------------------------------------------------------------------


@needs_sandbox
def test_session_files_persist_and_cores_are_granted_per_action(http):
    sid = http.post("/sessions", json={"files": {"notes.txt": b64("one\n")}}).json()["session_id"]
    a = http.post(f"/sessions/{sid}/actions", json={"command": "echo two >> notes.txt; cat notes.txt"}).json()
    assert a["status"] == "Success" and a["run_result"]["stdout"] == "one\ntwo\n"
    assert a["parallel"] == 1 and len(a["cores"]) == 1
    # A parallel hint: `{parallel}` becomes the cores granted, and the action is pinned to them.
    b = http.post(f"/sessions/{sid}/actions", json={
        "command": "python3 -c 'import os; print(len(os.sched_getaffinity(0)))'; echo {parallel}", "parallel": 2,
    }).json()  # fmt: skip
    granted = b["parallel"]
    assert 1 <= granted <= 2 and b["run_result"]["stdout"].split() == [str(granted), str(granted)]
    c = http.post(f"/sessions/{sid}/actions", json={"command": "cat notes.txt; ls"}).json()
    assert c["run_result"]["stdout"].startswith("one\ntwo\n")  # the work dir outlives actions
    assert http.delete(f"/sessions/{sid}").status_code == 200
    gone = http.post(f"/sessions/{sid}/actions", json={"command": "true"})
    assert gone.status_code == 404 and gone.json()["error"] == "no such session"


@needs_sandbox
def test_python_test_runner_shards_over_granted_cores(http):
    solution = "def add(a, b):\n    return a + b\n"
    tests = "\n".join(f"from solution import add\ndef test_{i}():\n    assert add({i}, 1) == {i + 1 if i % 4 else 0}\n"
                      for i in range(8))  # fmt: skip
    sid = http.post(
        "/sessions", json={"files": {"solution.py": b64(solution), "test_s.py": b64(tests)}}
    ).json()["session_id"]
    try:
        r = http.post(
            f"/sessions/{sid}/actions",
            json={"tool": "python_tests", "path": "test_s.py", "parallel": 2, "timeout": 30},
        ).json()
    finally:
        http.delete(f"/sessions/{sid}")
    t = r["tests"]
    assert t["tests"] == 8 and t["failures"] == 2 and t["passed"] == 6  # test_0 and test_4 assert wrongly
    assert t["workers"] == r["parallel"] and r["status"] == "Failed"
    assert sorted(t["failed_tests"]) == ["test_s::test_0", "test_s::test_4"]


# ---- the quota-limited HTTP tool and the reward functions ------------------------------------------


@needs_sandbox
def test_http_tool_respects_concurrency_and_tokens_per_period(service, judge):
    async def main():
        async with httpx.AsyncClient(base_url=service.url, timeout=PATIENT_S) as c:
            return await asyncio.gather(
                *[c.post("/tools/judge", json={"payload": {"answer": "x" * i}}) for i in range(8)]
            )

    judge.peak, judge.times = 0, []
    t0 = time.monotonic()
    rs = asyncio.run(main())
    assert all(r.status_code == 200 and r.json()["status"] == "Success" for r in rs)
    assert judge.peak <= 2  # max_concurrency
    # 6 tokens per 2 s window, one per call: 8 calls need a second window.
    assert time.monotonic() - t0 >= 0.5 and max(judge.times) - min(judge.times) > 0.3
    assert sorted(r.json()["body"]["score"] for r in rs) == [i / 10 for i in range(8)]
    over = api.post(f"{service.url}/tools/judge", json={"payload": {}, "tokens": 100})
    assert over.status_code == 422 and "tokens_per_period" in over.json()["allowed"]
    assert api.post(f"{service.url}/tools/nope", json={}).status_code == 404


@needs_sandbox
def test_reward_functions_use_the_real_tools(service):
    async def main():
        async with ActionsClient(service.url) as c:
            good = await unit_test_reward(c, "def f(x):\n    return 2 * x\n",
                                          "from solution import f\ndef test_a():\n    assert f(2) == 4\n"
                                          "def test_b():\n    assert f(0) == 1\n")  # fmt: skip
            crash = await unit_test_reward(
                c, "import sys; sys.exit(1)", "from solution import f\ndef test_a(): pass\n"
            )
            judged = await judge_reward(c, "judge", {"answer": "abcde"})
            return good, crash, judged

    good, crash, judged = asyncio.run(main())
    assert good == 0.5 and crash == 0.0 and judged == pytest.approx(0.5)


# ---- health, metrics, bad requests -----------------------------------------------------------------


@needs_sandbox
def test_health_and_metrics(http):
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["isolation"] == "bwrap" and h["cores"] >= 1
    http.post("/run_code", json={"language": "python", "code": "pass"})
    text = http.get("/metrics").text
    for name in ("libra_actions_queue_length", "libra_actions_act_seconds_bucket", "libra_actions_cores_busy",
                 'libra_actions_total{endpoint="run_code",status="success"}'):  # fmt: skip
        assert name in text


def finished_run_code(http) -> float:
    """How many /run_code actions the service has finished, from its metrics."""
    lines = http.get("/metrics").text.splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith('libra_actions_total{endpoint="run_code"')
    )


@needs_sandbox
def test_a_client_that_leaves_withdraws_its_queued_action(service, http):
    """Fill every core with a running action, queue one more, and drop its client: the queued
    action is withdrawn (it never runs), while the running ones finish and give their cores back.
    Before, the handler was not cancelled and the action waited, then ran for nobody."""
    cores = http.get("/health").json()["cores"]
    before = finished_run_code(http)
    hold = "import time; time.sleep(15)"  # long enough to still hold every core when the next one queues
    with concurrent.futures.ThreadPoolExecutor(cores) as pool:
        running = [
            pool.submit(http.post, "/run_code", json={"language": "python", "code": hold, "run_timeout": 30})
            for _ in range(cores)
        ]
        wait_for(lambda: http.get("/health").json()["running"] == cores, "every core held")
        with httpx.Client(base_url=service.url, timeout=0.5) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                impatient.post("/run_code", json={"language": "python", "code": "print('ran for nobody')"})
        wait_for(lambda: http.get("/health").json()["queue"] == 0, "the queued action withdrawn")
        assert all(f.result().json()["run_result"]["return_code"] == 0 for f in running)
    wait_for(lambda: http.get("/health").json()["running"] == 0, "every action done")
    assert finished_run_code(http) - before == cores  # the withdrawn one never ran
    assert http.get("/health").json()["cores_busy"] == 0


@needs_sandbox
def test_a_running_session_action_whose_client_left_still_goes_first(service, http):
    """A running action is not withdrawn: it finishes, and the session's next action waits for it,
    so two actions of one session never overlap in its work dir."""
    sid = http.post("/sessions", json={}).json()["session_id"]
    with httpx.Client(base_url=service.url, timeout=0.5) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(f"/sessions/{sid}/actions", json={"command": "sleep 2; echo done > m"})
    r = http.post(f"/sessions/{sid}/actions", json={"command": "cat m"}).json()
    assert r["run_result"]["stdout"] == "done\n", r
    http.delete(f"/sessions/{sid}")


@needs_sandbox
def test_bad_requests_get_4xx_with_json(http):
    cases = [
        (http.post("/run_code", content=b"{not json"), 400),
        (http.post("/run_code", content=b"[1, 2]"), 400),
        (http.post("/run_code", json={"code": "x", "language": "cobol"}), 422),
        (http.post("/run_code", json={"language": "python", "code": "x", "run_timeout": -1}), 422),
        (http.post("/run_code", json={"language": "python", "code": "x", "run_timeout": 10_000}), 422),
        (http.post("/run_code", json={"language": "python", "code": "x", "memory_limit_MB": 10**6}), 422),
        (http.post("/run_code", json={"language": "python", "code": "x" * (2**18 + 1)}), 422),
        (
            http.post("/run_code", content=b'{"language": "python", "code": "' + b"x" * (3 * 2**20) + b'"}'),
            400,
        ),
        (
            http.post(
                "/run_code", json={"language": "python", "code": "x", "files": {"../escape": b64("x")}}
            ),
            422,
        ),
        (http.post("/run_code", json={"language": "python", "code": "x", "files": {"a": "***"}}), 422),
        (http.post("/sessions/none/actions", json={"command": "true"}), 404),
        (http.post("/sessions", json={"memory_mb": 1}), 422),
        (http.get("/nowhere"), 404),
    ]
    for r, status in cases:
        assert r.status_code == status, (r.request.url, r.text[:200])
        assert "error" in r.json()
    detail = cases[2][0].json()["detail"][0]
    assert detail["field"] == "language" and detail["value"] == "cobol" and "python" in detail["allowed"]
    assert http.get("/health").json()["status"] == "ok"


@needs_sandbox
def test_bodies_json_loads_accepts_but_nothing_can_use_get_4xx(http):
    """Found by sending junk to every field: each of these was a 500 (a traceback in the log)."""
    cases = [
        (
            b'{"language": "python", "code": "\\ud800"}',
            422,
            "code",
        ),  # an unpaired surrogate: no file can hold it
        (b'{"language": "python", "code": "print(1)", "files": {"\\udc00": "eA=="}}', 422, "files (a key)"),
        (b'{"language": "python", "code": "x", "run_timeout": NaN}', 400, None),  # not JSON (RFC 8259)
        (b"[" * 100_000 + b"]" * 100_000, 400, None),  # RecursionError in json.loads
    ]
    for raw, status, field in cases:
        r = http.post("/run_code", content=raw)
        assert r.status_code == status, (raw[:60], r.text[:200])
        if field is not None:
            assert r.json()["detail"][0]["field"] == field
    sid = http.post("/sessions", json={}).json()["session_id"]
    for bad in (
        {"command": "ls\0"},
        {"command": "ls", "args": ["\0"]},
        {"tool": "python_tests", "path": "a\0"},
    ):
        r = http.post(f"/sessions/{sid}/actions", json=bad)
        assert r.status_code == 422 and "NUL" in r.text, r.text[:200]
    assert http.delete(f"/sessions/{sid}").status_code == 200
    assert http.get("/health").json()["status"] == "ok"


# A valid body with one field set to junk: any code point (unpaired surrogates and control
# characters too), any JSON shape, or a name a file system cannot hold. One bad field at a time is
# what reaches the code behind validation, where the 500s were.
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=8,
)
names = (
    st.sampled_from([".", "..", "", "/etc/x", "a\x00", "\ud800", "x" * 300, "a/./b", "main.py/x"]) | any_text
)
junk = {
    "files": st.dictionaries(names, st.just("eA=="), min_size=1, max_size=2) | json_values,
    "fetch_files": st.lists(names, min_size=1, max_size=2) | json_values,
}


def one_bad_field(valid: dict, fields: list[str]):
    return st.sampled_from(fields).flatmap(
        lambda f: (junk.get(f, st.nothing()) | json_values | any_text).map(lambda v: {**valid, f: v})
    )


run_code_bodies = one_bad_field(
    {"code": "print(1)", "language": "python", "run_timeout": 5, "files": {"a.txt": "eA=="}},
    ["code", "language", "run_timeout", "memory_limit_MB", "stdin", "files", "fetch_files"],
)
action_bodies = one_bad_field(
    {"command": "echo {parallel}", "parallel": 2, "files": {"a.txt": "eA=="}},
    ["command", "path", "args", "parallel", "timeout", "stdin", "files", "fetch_files", "kind"],
)


@needs_sandbox
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=run_code_bodies, action=action_bodies)
def test_any_body_gets_an_answer_below_500(http, run, action):
    r = http.post("/run_code", content=json.dumps(run).encode())
    assert r.status_code < 500 and isinstance(r.json(), dict), (run, r.text[:300])
    sid = http.post("/sessions", json={}).json()["session_id"]
    try:
        r = http.post(f"/sessions/{sid}/actions", content=json.dumps(action).encode())
        assert r.status_code < 500 and isinstance(r.json(), dict), (action, r.text[:300])
    finally:
        http.delete(f"/sessions/{sid}")


@needs_sandbox
def test_files_the_work_dir_cannot_hold_are_422_and_leak_nothing(http):
    """'.', a 300-byte name, a file that is also a directory, the script's own name as a directory,
    and a file where an earlier action left a directory: each is the request's error, named."""
    x = b64("x")
    for files in ({".": x}, {"a/./b": x}, {"n" * 300: x}, {"a": x, "a/b": x}, {"_libra_main.py/x": x}):
        r = http.post("/run_code", json={"language": "python", "code": "print(1)", "files": files})
        assert r.status_code == 422 and r.json()["field"].startswith("files."), (files.keys(), r.text[:200])
    sid = http.post("/sessions", json={}).json()["session_id"]
    assert http.post(f"/sessions/{sid}/actions", json={"command": "mkdir d"}).json()["status"] == "Success"
    r = http.post(f"/sessions/{sid}/actions", json={"command": "true", "files": {"d": x}})
    assert r.status_code == 422 and r.json()["field"] == "files.d", r.text[:200]
    assert http.post(f"/sessions/{sid}/actions", json={"command": "true"}).json()["status"] == "Success"
    http.delete(f"/sessions/{sid}")
    # A session refused at creation gives its uid and work dir back: more refusals than the service
    # has uids, then a session still opens and a warm /run_code still runs.
    for _ in range(300):
        assert http.post("/sessions", json={"files": {"a": x, "a/b": x}}).status_code == 422
    sid = http.post("/sessions", json={})
    assert sid.status_code == 201, sid.text
    http.delete(f"/sessions/{sid.json()['session_id']}")
    assert (
        http.post("/run_code", json={"language": "python", "code": "print(2)"}).json()["run_result"]["stdout"]
        == "2\n"
    )


def test_refuses_to_start_without_a_sandbox(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no bwrap on PATH
    r = subprocess.run([sys.executable, "-m", "libra", "serve", "actions", "--port", "0"], env=env,
                       capture_output=True, text=True, timeout=PATIENT_S)  # fmt: skip
    assert r.returncode == 2 and "sandbox unavailable" in r.stderr and "--insecure-no-sandbox" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "setting,needle",
    [
        ("cores=[99999]", "cores: got [99999]"),  # a CPU this machine does not have: was accepted
        ("cores=[]", "non-empty"),  # no cores at all: every action would queue forever
        ("numa=[[0],[0]]", "do not share a core"),  # was counted twice
        ("memory_gib=0.001", "room for one session"),  # no session could ever start
        ("warm_pool=100000", "warm_pool"),  # hung at start-up, spawning sandboxes
    ],
)
def test_a_service_config_no_action_could_run_under_exits_2(setting, needle):
    r = subprocess.run([sys.executable, "-m", "libra", "serve", "actions", "--port", "0",
                        "--insecure-no-sandbox", "--set", setting],
                       capture_output=True, text=True, timeout=PATIENT_S)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr

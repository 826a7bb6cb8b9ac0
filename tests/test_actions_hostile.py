"""The hostile suite: real attacks on the real sandbox service, each contained and reported with the
right status, the service still serving, and no process of any sandbox uid left afterwards.
Then 500 concurrent /run_code requests: every one answered, none lost."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from libra.runtime.sandbox.client import ServiceProcess
from libra.runtime.sandbox.sandbox import processes_of
from tests.test_actions_service import needs_sandbox, sandbox_available

SOURCE = __import__("libra.runtime.sandbox.service", fromlist=["x"]).__file__

HOSTILE = {
    "fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        2,
    ),
    "memory bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))", 5),
    "infinite loop": ("while True:\n    pass", 1),
    "ignores SIGTERM": (
        "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    pass",
        1,
    ),
    "network": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)\nprint('CONNECTED')", 5),
    "loopback service": (
        "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=3)\nprint('CONNECTED')",
        5,
    ),
    "read shadow": ("print(open('/etc/shadow').read())", 5),
    "read own source": (f"print(open({SOURCE!r}).read())", 5),
    "write outside": ("open('/usr/evil', 'w').write('x')", 5),
    "write tmp outside": ("open('/etc/evil', 'w').write('x')", 5),
    "100 MB stdout": (
        "import sys\nblock = 'x' * 2**20\nfor _ in range(100):\n    sys.stdout.write(block)",
        20,
    ),
    "orphan child": ("import subprocess\nsubprocess.Popen(['sleep', '600'])\nprint('parent done')", 5),
    "daemonized child": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint('parent done')",
        5,
    ),
}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    if sandbox_available():
        pytest.skip(sandbox_available())
    cfg = tmp_path_factory.mktemp("hostile") / "actions.yaml"
    cfg.write_text(
        json.dumps(
            {
                "warm_pool": 2,
                "sandbox": {
                    "memory_mb": 512,
                    "max_memory_mb": 512,
                    "nproc": 64,
                    "output_limit_bytes": 64_000,
                },
            }
        )
    )
    with ServiceProcess(str(cfg)) as svc:
        yield svc


def run_all(url: str, codes: dict[str, tuple[str, float]]) -> dict[str, dict]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            rs = await asyncio.gather(*[c.post("/run_code", json={"code": code, "run_timeout": t})
                                        for code, t in codes.values()])  # fmt: skip
            return {name: r.json() for name, r in zip(codes, rs, strict=True)}

    return asyncio.run(main())


def uid_range(url: str) -> range:
    lo, hi = httpx.get(f"{url}/health").json()["uids"]
    return range(lo, hi + 1)


def leftovers(uids: range) -> list[str]:
    """Command lines of the service's sandbox-uid processes, except the warm pool's idle zygotes
    (pre-started for future requests, they belong to no action yet)."""
    out = []
    for pid in processes_of(uids):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "_libra_zygote" not in cmd:
            out.append(cmd[:120])
    return out


def settle(url: str, deadline_s: float = 10.0) -> list[str]:
    """Leftovers, after giving the kernel a moment to tear namespaces down."""
    end = time.monotonic() + deadline_s
    uids = uid_range(url)
    while (left := leftovers(uids)) and time.monotonic() < end:
        time.sleep(0.1)
    return left


@needs_sandbox
def test_hostile_programs_are_contained_and_reported(service):
    port = int(service.url.rsplit(":", 1)[1])
    codes = {k: (c.replace("PORT", str(port)), t) for k, (c, t) in HOSTILE.items()}
    t0 = time.monotonic()
    r = run_all(service.url, codes)
    elapsed = time.monotonic() - t0

    def status(name):
        return r[name]["status"], (r[name]["run_result"] or {}).get("status")

    assert status("fork bomb") == ("Failed", "TimeLimitExceeded")
    # Killed by the kernel at its memory cgroup's limit (or MemoryError at the address-space
    # limit, where the host has no memory cgroup for the service).
    assert r["memory bomb"]["status"] == "Failed"
    assert (
        "over its memory limit" in r["memory bomb"]["message"]
        or "MemoryError" in r["memory bomb"]["run_result"]["stderr"]
    )
    assert status("infinite loop") == ("Failed", "TimeLimitExceeded")
    assert status("ignores SIGTERM") == ("Failed", "TimeLimitExceeded")
    for name in ("network", "loopback service"):
        assert r[name]["status"] == "Failed" and "CONNECTED" not in r[name]["run_result"]["stdout"]
        assert "OSError" in r[name]["run_result"]["stderr"] or "Error" in r[name]["run_result"]["stderr"]
    assert "PermissionError" in r["read shadow"]["run_result"]["stderr"]
    assert "FileNotFoundError" in r["read own source"]["run_result"]["stderr"]
    for name in ("write outside", "write tmp outside"):
        assert r[name]["status"] == "Failed" and "Read-only file system" in r[name]["run_result"]["stderr"]
    big = r["100 MB stdout"]
    assert big["status"] == "Success" and len(big["run_result"]["stdout"]) < 100_000
    assert "truncated" in big["run_result"]["stdout"] and "truncated" in big["message"]
    for name in ("orphan child", "daemonized child"):
        assert r[name]["status"] == "Success" and r[name]["run_result"]["stdout"] == "parent done\n"
        assert r[name]["run_result"]["execution_time"] < 30  # nobody waited for the 600 s sleeper
    assert elapsed < 90
    assert settle(service.url) == []  # no process outlives its action
    health = httpx.get(f"{service.url}/health").json()
    assert health["status"] == "ok" and health["running"] == 0 and health["cores_busy"] == 0
    ok = httpx.post(f"{service.url}/run_code", json={"code": "print('still serving')"}).json()
    assert ok["run_result"]["stdout"] == "still serving\n"


@needs_sandbox
def test_500_concurrent_requests_are_all_answered(service):
    async def main():
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
        async with httpx.AsyncClient(base_url=service.url, timeout=300, limits=limits) as c:
            rs = await asyncio.gather(
                *[c.post("/run_code", json={"code": f"print({i} * 3)"}) for i in range(500)]
            )
            return [(r.status_code, r.json()) for r in rs]

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert len(results) == 500
    for i, (code, body) in enumerate(results):
        assert code == 200 and body["status"] == "Success", body
        assert body["run_result"]["stdout"] == f"{i * 3}\n"  # each answer is its own request's
    assert time.monotonic() - t0 < 60
    metrics = httpx.get(f"{service.url}/metrics").text
    assert "libra_actions_queue_length 0.0" in metrics
    assert settle(service.url) == []


@needs_sandbox
def test_two_services_side_by_side_never_touch_each_others_sandboxes(tmp_path):
    """Each service owns its uid range (a lock per block of uids), so the leftovers one kills after
    a run are never the other's programs: 300 + 300 correct programs, all answered correctly. A
    service told to use a range another one holds refuses to start, naming the holder."""
    cfg = tmp_path / "actions.yaml"
    cfg.write_text(json.dumps({"warm_pool": 2, "sandbox": {"uid_count": 128}}))
    with ServiceProcess(str(cfg)) as a, ServiceProcess(str(cfg)) as b:
        ra, rb = uid_range(a.url), uid_range(b.url)
        assert not set(ra) & set(rb), (ra, rb)

        async def burst(url: str, tag: int):
            limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
            async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
                code = "import time, sys\ntime.sleep(0.05)\nprint(int(sys.stdin.read()) * 7)"
                return await asyncio.gather(
                    *[c.post("/run_code", json={"code": code, "stdin": f"{tag + i}"}) for i in range(300)]
                )

        async def both():
            return await asyncio.gather(burst(a.url, 0), burst(b.url, 1000))

        for tag, results in zip((0, 1000), asyncio.run(both()), strict=True):
            bodies = [r.json() for r in results]
            bad = [x for x in bodies if x["status"] != "Success"]
            assert not bad, bad[:3]
            assert [x["run_result"]["stdout"] for x in bodies] == [f"{(tag + i) * 7}\n" for i in range(300)]
        r = subprocess.run([sys.executable, "-m", "libra", "serve", "actions", "--port", "0",
                            "--set", f"sandbox.uid_base={ra.start}"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and "sandbox.uid_base" in r.stderr and "held by pid" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr

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
from tests.test_actions_languages import CASES, verl_request
from tests.test_actions_service import (
    PATIENT_S,
    THREADS_32,
    api,
    needs_sandbox,
    sandbox_available,
    unavailable,
)

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
    unavailable(sandbox_available())
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
                    "disk_mb": 64,
                },
            }
        )
    )
    with ServiceProcess(str(cfg)) as svc:
        yield svc


def run_all(
    url: str, codes: dict[str, tuple[str, float]], extra: dict[str, dict] | None = None
) -> dict[str, dict]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=PATIENT_S) as c:
            rs = await asyncio.gather(*[c.post("/run_code", json={"language": "python", "code": code, "run_timeout": t, **(extra or {}).get(k, {})})
                                        for k, (code, t) in codes.items()])  # fmt: skip
            return {name: r.json() for name, r in zip(codes, rs, strict=True)}

    return asyncio.run(main())


def uid_range(url: str) -> range:
    lo, hi = api.get(f"{url}/health").json()["uids"]
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


def settle(url: str, deadline_s: float = 300.0) -> list[str]:
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
    r = run_all(service.url, codes)

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
        # Success within its 5 s limit: nobody waited for the 600 s sleeper, which is gone (below).
        assert r[name]["status"] == "Success" and r[name]["run_result"]["stdout"] == "parent done\n"
    assert settle(service.url) == []  # no process outlives its action
    health = api.get(f"{service.url}/health").json()
    assert health["status"] == "ok" and health["running"] == 0 and health["cores_busy"] == 0
    ok = api.post(
        f"{service.url}/run_code", json={"language": "python", "code": "print('still serving')"}
    ).json()
    assert ok["run_result"]["stdout"] == "still serving\n"


# Programs that attack the service through its file handling and the sandbox's limits. `fetch` is the
# request's fetch_files.
FILE_ATTACKS = {
    "fifo": ("import os\nos.mkfifo('out.txt')", ["out.txt"]),
    "socket": ("import socket\ns = socket.socket(socket.AF_UNIX)\ns.bind('sock')", ["sock"]),
    "symlink to a secret": ("import os\nos.symlink('/etc/shadow', 'out')", ["out"]),
    "fifo in /tmp": ("import os\nos.mkfifo('/tmp/p')", ["/tmp/p"]),
    "fifo on the way": ("import os\nos.mkfifo('d')", ["d/x"]),
}
FILL_DISK = """import os
total = 0
block = b'x' * 2**20
try:
    for d in ('/workspace', '/tmp'):
        for i in range(10**6):
            with open(f'{d}/fill{i}', 'wb') as f:
                f.write(block)
            total += len(block)
except OSError as e:
    print(total // 2**20, e.errno)
"""
MANY_FILES = """import os
try:
    for i in range(10**7):
        open(f'/tmp/f{i}', 'w').close()
except OSError as e:
    print(i, e.errno)
"""
WIDEN = """import os
granted = sorted(os.sched_getaffinity(0))
try:
    os.sched_setaffinity(0, range(os.cpu_count()))
    outcome = 'allowed'
except PermissionError:
    outcome = 'refused'
print(granted == sorted(os.sched_getaffinity(0)), len(granted), outcome)
"""


def cold_body(code: str, **extra) -> dict:
    """A request that takes the cold path: a warm sandbox has no area for /cold."""
    return {"language": "python", "code": code, "fetch_files": ["/cold/x"], **extra}


def assert_healthy(url: str) -> None:
    health = api.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["running"] == 0 and health["cores_busy"] == 0, health
    ok = api.post(f"{url}/run_code", json={"language": "python", "code": "print('still serving')"}).json()
    assert ok["run_result"]["stdout"] == "still serving\n", ok


@needs_sandbox
def test_files_that_are_not_regular_never_hang_the_service(tmp_path):
    """Bug 1: a FIFO asked for in fetch_files (or left where a session's next `files` writes) blocked
    the event loop in open(): /health stopped, SIGTERM did nothing. Now file I/O runs in worker
    threads and opens only regular files, non-blocking; anything else is named in the answer, and
    the service stays responsive and stops on SIGTERM."""
    cfg = tmp_path / "actions.yaml"
    cfg.write_text(json.dumps({"warm_pool": 1, "sandbox": {"uid_count": 64}}))
    with ServiceProcess(str(cfg)) as svc:
        bodies = {k: (c, 5) for k, (c, _) in FILE_ATTACKS.items()}
        r = run_all(svc.url, bodies, {k: {"fetch_files": f} for k, (_, f) in FILE_ATTACKS.items()})
        for name, (_, fetch) in FILE_ATTACKS.items():
            body = r[name]
            assert body["status"] == "Success" and body["files"] == {}, (name, body)
            assert f"{fetch[0]}:" in body["message"], (name, body["message"])
        assert "a FIFO" in r["fifo"]["message"] and "a socket" in r["socket"]["message"]
        assert "a symbolic link" in r["symlink to a secret"]["message"]
        # The event loop answers (a hung one never would: the request times out).
        assert api.get(f"{svc.url}/health").json()["status"] == "ok"
        sid = api.post(f"{svc.url}/sessions", json={}).json()["session_id"]
        made = api.post(
            f"{svc.url}/sessions/{sid}/actions", json={"command": "mkfifo x; mkdir -p /tmp/d"}
        ).json()
        assert made["status"] == "Success", made
        for name in ("x", "/dev/null", "/dev/sda", "/proc/1/mem"):
            bad = api.post(
                f"{svc.url}/sessions/{sid}/actions", json={"command": "true", "files": {name: "eA=="}}
            )
            assert bad.status_code == 422 and bad.json()["field"] == f"files.{name}", (name, bad.text[:300])
        bad = api.post(
            f"{svc.url}/run_code", json={"language": "python", "code": "pass", "fetch_files": ["/dev/zero"]}
        )
        assert bad.status_code == 422 and bad.json()["field"] == "fetch_files./dev/zero", bad.text[:300]
        api.delete(f"{svc.url}/sessions/{sid}")
        assert_healthy(svc.url)
        svc.proc.terminate()
        assert svc.proc.wait(timeout=300) == 0  # SIGTERM stops it (it was SIGKILL only)


@needs_sandbox
def test_disk_and_cores_are_bounded(service):
    """Items 10 and 11: everything a sandbox writes (/workspace, /tmp) shares one bound (disk_mb, 64
    here; it wrote 1.2 GB in 3.3 s before), files too (inodes), and a program cannot widen its CPU
    affinity beyond the cores it was granted (a cpuset, or seccomp where there is none)."""
    r = run_all(service.url, {"fill": (FILL_DISK, 60), "files": (MANY_FILES, 60), "widen": (WIDEN, 10)})
    mb, err = r["fill"]["run_result"]["stdout"].split()
    assert int(mb) <= 64 and int(err) == 28, r["fill"]  # ENOSPC
    count, err = r["files"]["run_result"]["stdout"].split()
    assert int(count) < 10**6 and int(err) == 28, r["files"]
    same, n, _ = r["widen"]["run_result"]["stdout"].split()
    assert same == "True" and n == "1", r["widen"]
    cold = api.post(f"{service.url}/run_code", json=cold_body(WIDEN)).json()
    assert cold["run_result"]["stdout"].split()[:2] == ["True", "1"], cold
    assert_healthy(service.url)
    assert settle(service.url) == []


@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    """The same service with cgroups off: what a host without cgroup delegation gets."""
    unavailable(sandbox_available())
    cfg = tmp_path_factory.mktemp("fallback") / "actions.yaml"
    cfg.write_text(json.dumps({"warm_pool": 1, "sandbox": {"memory_mb": 256, "max_memory_mb": 512, "nproc": 64,
                                                           "disk_mb": 64, "cgroups": "off", "uid_count": 64}}))  # fmt: skip
    with ServiceProcess(str(cfg)) as svc:
        yield svc


@needs_sandbox
def test_without_cgroups_the_fallbacks_still_contain(fallback):
    """Where the host gives no cgroup: memory is an address-space limit (MemoryError), with malloc
    arenas capped so that 32 threads still start, and the seccomp filter refuses sched_setaffinity,
    warm and cold, so the granted core still holds."""
    limits = api.get(f"{fallback.url}/health").json()["limits"]
    assert limits["memory"].startswith("address space") and "seccomp" in limits["cores"], limits
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))"
    r = run_all(fallback.url, {"bomb": (bomb, 10), "widen": (WIDEN, 10), "fill": (FILL_DISK, 60),
                               "threads": (THREADS_32, 60)})  # fmt: skip
    assert r["bomb"]["status"] == "Failed" and "MemoryError" in r["bomb"]["run_result"]["stderr"], r["bomb"]
    assert r["threads"]["run_result"]["stdout"] == "33\n", r["threads"]  # at the service's 512 MB ceiling
    threads_cold = api.post(
        f"{fallback.url}/run_code", json=cold_body(THREADS_32, memory_limit_MB=512)
    ).json()
    assert threads_cold["run_result"]["stdout"] == "33\n", threads_cold
    assert r["widen"]["run_result"]["stdout"].split() == ["True", "1", "refused"], r["widen"]
    cold = api.post(f"{fallback.url}/run_code", json=cold_body(WIDEN)).json()
    assert cold["run_result"]["stdout"].split() == ["True", "1", "refused"], cold
    assert int(r["fill"]["run_result"]["stdout"].split()[0]) <= 64
    # Runtimes that reserve much address space up front (the JVM, V8, Go) still start at 512 MB:
    # they are given room for those reservations (languages.RESERVE_MB).
    found = api.get(f"{fallback.url}/health").json()["languages"]
    for language in [x for x in ("java", "nodejs", "typescript", "go", "go_test") if x in found]:
        body = verl_request(language, CASES[language]["ok"], "21", 120) | {"memory_limit_MB": 512}
        ok = api.post(f"{fallback.url}/run_code", json=body).json()
        expected = "ok" if language == "go_test" else "42\n"
        assert ok["status"] == "Success" and expected in ok["run_result"]["stdout"], (language, ok)
    assert_healthy(fallback.url)


@needs_sandbox
def test_500_concurrent_requests_are_all_answered(service):
    async def main():
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
        async with httpx.AsyncClient(base_url=service.url, timeout=PATIENT_S, limits=limits) as c:
            rs = await asyncio.gather(
                *[
                    c.post("/run_code", json={"language": "python", "code": f"print({i} * 3)"})
                    for i in range(500)
                ]
            )
            return [(r.status_code, r.json()) for r in rs]

    results = asyncio.run(main())
    assert len(results) == 500
    for i, (code, body) in enumerate(results):
        assert code == 200 and body["status"] == "Success", body
        assert body["run_result"]["stdout"] == f"{i * 3}\n"  # each answer is its own request's
    metrics = api.get(f"{service.url}/metrics").text
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
            async with httpx.AsyncClient(base_url=url, timeout=PATIENT_S, limits=limits) as c:
                code = "import time, sys\ntime.sleep(0.05)\nprint(int(sys.stdin.read()) * 7)"
                return await asyncio.gather(
                    *[
                        c.post("/run_code", json={"language": "python", "code": code, "stdin": f"{tag + i}"})
                        for i in range(300)
                    ]
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
                           capture_output=True, text=True, timeout=PATIENT_S)  # fmt: skip
        assert r.returncode == 2 and "sandbox.uid_base" in r.stderr and "held by pid" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


@needs_sandbox
def test_a_killed_service_leaves_nothing_that_outlives_its_successor(tmp_path):
    """Bug 1's tail: only SIGKILL stopped a hung service, and it left work dirs behind. A service's
    tmpfs mounts live in its own mount namespace (they vanish with it), its sandboxes die with it
    (--die-with-parent), and the next service on the same uid range removes what it left on disk."""
    import random

    base = 1_900_000_000 + 64 * random.randrange(100_000)
    cfg = tmp_path / "actions.yaml"
    cfg.write_text(json.dumps({"warm_pool": 1, "sandbox": {"uid_base": base, "uid_count": 64,
                                                           "workdir_root": str(tmp_path / "work")}}))  # fmt: skip
    root = tmp_path / "work" / f"libra-actions-{base}"
    with ServiceProcess(str(cfg)) as a:
        sid = api.post(f"{a.url}/sessions", json={"files": {"big": "eHh4" * 1000}}).json()["session_id"]
        with pytest.raises(httpx.ReadTimeout):
            api.post(f"{a.url}/sessions/{sid}/actions", json={"command": "sleep 600"}, timeout=2)
        assert any(root.iterdir())
        a.proc.kill()
        a.proc.wait()
    deadline = time.monotonic() + 300
    while processes_of(range(base, base + 64)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(range(base, base + 64)) == []  # the sandboxes died with their service
    left = [p for p in root.iterdir() if any(p.iterdir())]
    assert left == [], left  # its tmpfs mounts went with its mount namespace: empty mount points only
    with ServiceProcess(str(cfg)) as b:
        assert api.get(f"{b.url}/health").json()["uids"] == [base, base + 63]
        assert len(list(root.iterdir())) <= 1  # the stale two are gone: at most its own warm sandbox

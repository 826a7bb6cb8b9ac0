"""Gateway overhead: added latency (p50, p99) and the most requests per second on one core, side by
side with `sglang-router` routing to the same backends, in the same run.

What is timed is the router, not a model: both routers sit in front of the *instant* backend
(`tests.instant_backend`, answers at once with a fixed reply), so a request's time is the
client, the router and the backend's fixed HTTP cost. Added latency is a router's percentile minus
the same percentile of the backend called directly, measured one request at a time. Throughput is
a closed loop of `--concurrency` keep-alive connections for `--duration` seconds.

Placement: for throughput, each router process is pinned to one core (`sched_setaffinity`, every
thread; `sglang-router` is also started there, so its runtime sizes itself to one core) and the
backends and the load generator to the other cores. For latency (one request at a time, far less
than a core) nothing is pinned: a chain of pinned processes on a shared machine measures the
scheduler's wake-up delays, not the router. The load generator is a separate process with a
minimal HTTP/1.1 client on raw asyncio, so it costs a fraction of what the routers do. Requests are
agent turns: a user message, a tool call and its (failing or succeeding) tool return, with an
`X-Session-ID`, so the Libra gateway does its full per-turn work (session, path, C-MLFQ decision).
Each connection runs sessions of four turns one after the other; every 16 sessions share a prompt
(a GRPO group), which is what the router's sibling statistics see in RL.

Because a shared machine steals time from a pinned process, each router's CPU time during the
throughput run is read from /proc and reported as `*_rps_per_cpu_s`: what one dedicated core
sustains. Rounds alternate the two routers and the median is reported.

`--baseline DIR` also times the gateway of another source tree (`DIR/src`, e.g. the main branch
unpacked with `git archive main src | tar -x -C DIR`) in the same rounds, reported as `before_*`
with `libra_added_p50_vs_before`: how a change moved the gateway's cost, on one machine in one run.

Run: .venv/bin/python benchmarks/bench_gateway.py [--duration 5] [--rounds 3] [--concurrency 64] [--baseline DIR]
Needs `pip install sglang-router` for the comparison (`make bench` installs the `bench` extra);
without it the comparison is skipped with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402

LISTENING = re.compile(r"listening on http://[^\s:]+:(\d+)")
MODEL = "instant"
TARGET_P50_MS, TARGET_RPS = 2.0, 1500


# ---- the load generator (runs in its own process) --------------------------------------------------


PROMPT_SLOT = b"@@@@@@@@"  # replaced by a prompt number per session: GRPO groups of GROUP sessions
GROUP = 16


def turn_bodies() -> list[bytes]:
    """Four turns of one agent session: the conversation grows by a tool call and return each turn."""
    task = f"Task {PROMPT_SLOT.decode()}: fix the failing test in utils.py."
    msgs: list[dict] = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": task}]  # fmt: skip
    out = []
    for k in range(4):
        out.append(json.dumps({"model": MODEL, "messages": list(msgs), "max_tokens": 64}).encode())
        call = {"id": f"call_{k}", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "tests/"}'}}  # fmt: skip
        result = (
            "Traceback (most recent call last):\nAssertionError: 3 != 4"
            if k % 2 == 0
            else "4 passed in 0.12s"
        )
        msgs += [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": f"call_{k}", "content": result}]  # fmt: skip
    return out


def response_end(buf: bytearray) -> tuple[int, int] | None:
    """(bytes of the first complete HTTP response in buf, its status), or None if incomplete."""
    h = buf.find(b"\r\n\r\n")
    if h < 0:
        return None
    head = bytes(buf[:h]).lower()
    status = int(head[9:12])
    m = re.search(rb"content-length:\s*(\d+)", head)
    if m:
        end = h + 4 + int(m.group(1))
        return (end, status) if len(buf) >= end else None
    pos = h + 4  # chunked
    while True:
        e = buf.find(b"\r\n", pos)
        if e < 0:
            return None
        size = int(bytes(buf[pos:e]).split(b";")[0], 16)
        if size == 0:
            end = e + 4
            return (end, status) if len(buf) >= end else None
        pos = e + 2 + size + 2
        if pos > len(buf):
            return None


class Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        done = response_end(self.buf)
        if done and self.waiter is not None and not self.waiter.done():
            del self.buf[: done[0]]
            self.waiter.set_result(done[1])

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))


async def _worker(i: int, port: int, bodies: list[bytes], t_end: float, lat: list, errors: list) -> None:
    loop = asyncio.get_running_loop()
    transport, conn = await loop.create_connection(Conn, "127.0.0.1", port)
    k = 0
    while (t0 := time.perf_counter()) < t_end:
        session = i * 100_000 + k // 4
        body = bodies[k % 4].replace(PROMPT_SLOT, b"%08d" % (session // GROUP))
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Session-ID: s%d\r\nContent-Length: %d\r\n\r\n" % (session, len(body))  # fmt: skip
        conn.waiter = loop.create_future()
        transport.write(head + body)
        status = await conn.waiter
        lat.append(time.perf_counter() - t0)
        if status != 200:
            errors.append(status)
        k += 1
    transport.close()


async def _load(port: int, concurrency: int, duration: float, warmup: float) -> dict:
    bodies = turn_bodies()
    if warmup:
        await asyncio.gather(*(_worker(i + 10**6, port, bodies, time.perf_counter() + warmup, [], []) for i in range(concurrency)))  # fmt: skip
    lat: list[float] = []
    errors: list[int] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(_worker(i, port, bodies, t0 + duration, lat, errors) for i in range(concurrency)))
    elapsed = time.perf_counter() - t0
    lat.sort()
    n = len(lat)
    return {"n": n, "errors": len(errors), "rps": n / elapsed, "p50_ms": lat[n // 2] * 1e3, "p99_ms": lat[min(n - 1, int(n * 0.99))] * 1e3}  # fmt: skip


def loadgen_main(spec: str) -> None:
    s = json.loads(spec)
    os.sched_setaffinity(0, set(s["cores"]))
    if s.get("nice"):
        os.nice(s["nice"])
    print(json.dumps(asyncio.run(_load(s["port"], s["concurrency"], s["duration"], s["warmup"]))))


def run_load(port: int, concurrency: int, duration: float, cores: list[int], warmup: float = 1.0) -> dict:
    spec = json.dumps({"port": port, "concurrency": concurrency, "duration": duration, "cores": cores, "warmup": warmup, "nice": NICE})  # fmt: skip
    out = subprocess.run([sys.executable, __file__, "--loadgen", spec], capture_output=True, text=True, timeout=duration + warmup + 120)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{out.stderr}")
    return json.loads(out.stdout)


# ---- the processes under test ------------------------------------------------------------------------


NICE = 0  # set from --nice: the priority of every process under test


def pinned(cores: list[int]):
    def setup() -> None:
        os.sched_setaffinity(0, set(cores))
        if NICE:
            os.nice(NICE)

    return setup


def start(cmd: list[str], cores: list[int], log: Path, pattern=LISTENING, n: int = 1, timeout: float = 60, env: dict | None = None) -> tuple[subprocess.Popen, list[int]]:  # fmt: skip
    f = open(log, "wb")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=pinned(cores), env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pattern.findall(log.read_text(errors="replace"))
        if len(found) >= n:
            return proc, [int(p) for p in found[:n]]
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} did not start:\n{log.read_text(errors='replace')[-3000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, path: str, timeout: float = 60) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers={"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"port {port} never answered {path}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children (all threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat.parent.name) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the measurement ---------------------------------------------------------------------------------


def place(pid: int, cores: list[int]) -> None:
    """Move every thread of a process onto `cores`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except OSError:  # a thread that just ended
            pass


def measure(name: str, port: int, pid: int | None, args, placement: dict) -> dict:
    """Latency with every process free to run anywhere (one request at a time needs far less than
    a core, and pinning a chain of processes on a shared machine measures the scheduler, not the
    router); then throughput with the router pinned to its one core."""
    all_cores, router_core, others = placement["all"], placement["router"], placement["others"]
    for p in (pid, placement["backend"]):
        if p:
            place(p, all_cores)
    lat = run_load(port, 1, args.duration, all_cores)
    if pid:
        place(pid, router_core)
    place(placement["backend"], others)
    c0 = cpu_seconds(pid) if pid else 0.0
    tput = run_load(port, args.concurrency, args.duration, others, warmup=0.5)
    cpu = cpu_seconds(pid) - c0 if pid else 0.0
    out = {"p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"], "rps": tput["rps"], "errors": lat["errors"] + tput["errors"]}  # fmt: skip
    if pid:
        out["cpu_ms_per_req"] = 1e3 * cpu / max(1, tput["n"])
        out["rps_per_cpu_s"] = tput["n"] / cpu if cpu > 0 else float("nan")
    print(f"  {name:<14} p50 {lat['p50_ms']:.3f} ms  p99 {lat['p99_ms']:.3f} ms  {tput['rps']:.0f} req/s"
          + (f"  {out['cpu_ms_per_req']:.3f} CPU-ms/req" if pid else ""), file=sys.stderr, flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--router", default="cmlfq", help="Libra router the gateway runs.")
    ap.add_argument("--skip-sglang", action="store_true", help="Time the Libra gateway only.")
    ap.add_argument("--baseline", help="Also time the gateway of this source tree (DIR/src), as before_*.")
    ap.add_argument("--nice", type=int, default=0, help="Priority of every process under test (negative: ahead of other work; needs root).")  # fmt: skip
    ap.add_argument("--loadgen", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loadgen:
        loadgen_main(args.loadgen)
        return
    global NICE
    NICE = args.nice
    cores = sorted(os.sched_getaffinity(0))
    router_core, others = [cores[0]], (cores[1:] or cores)
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    procs: list[subprocess.Popen] = []
    try:
        be, ports = start([sys.executable, "-m", "tests.instant_backend", "--port", "0", "--port", "0", "--model", MODEL], others, tmp / "backend.log", n=2)  # fmt: skip
        procs.append(be)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        gw_cmd = [sys.executable, "-m", "libra", "serve", "gateway", "--port", "0", "--router", args.router, "--log-level", "warning",
                  "--backend", f"{urls[0]},bucket=short,tp=1,max_context=8192", "--backend", f"{urls[1]},bucket=long,tp=2,max_context=32768"]  # fmt: skip
        gw, (gw_port,) = start(gw_cmd, router_core, tmp / "gateway.log")
        procs.append(gw)
        before = before_port = None
        if args.baseline:
            path = [str(Path(args.baseline).resolve() / "src"), os.environ.get("PYTHONPATH", "")]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
            before, (before_port,) = start(gw_cmd, router_core, tmp / "before.log", env=env)
            procs.append(before)
            wait_http(before_port, "/v1/chat/completions")
        sgl = sgl_port = None
        if args.skip_sglang:
            print("note: sglang-router comparison skipped (--skip-sglang)", file=sys.stderr)
        elif importlib.util.find_spec("sglang_router") is not None:
            sgl_port = free_port()
            sgl_cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(sgl_port),
                       "--worker-urls", *urls, "--policy", "round_robin", "--log-level", "error"]  # fmt: skip
            sgl = subprocess.Popen(sgl_cmd, stdout=open(tmp / "sglang.log", "wb"), stderr=subprocess.STDOUT, preexec_fn=pinned(router_core))  # fmt: skip
            procs.append(sgl)
            wait_http(sgl_port, "/v1/chat/completions")
        else:
            print("note: sglang-router is not installed (pip install sglang-router); comparison skipped", file=sys.stderr)  # fmt: skip
        wait_http(gw_port, "/v1/chat/completions")
        rounds: dict[str, list[dict]] = {"direct": [], "libra": [], "before": [], "sglang": []}
        load_before = os.getloadavg()[0]
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            placement = {"all": cores, "router": router_core, "others": others, "backend": be.pid}
            rounds["direct"].append(measure("direct", ports[0], None, args, placement))
            rounds["libra"].append(measure("libra-gateway", gw_port, gw.pid, args, placement))
            if before is not None:
                rounds["before"].append(measure("libra-before", before_port, before.pid, args, placement))
            if sgl is not None:
                rounds["sglang"].append(measure("sglang-router", sgl_port, sgl.pid, args, placement))
        figures = summarise(rounds, args, router_core, others)
        figures.update(gateway_overhead(gw_port))
        figures["libra_policy_us_per_turn"] = round(policy_cost(args.router), 1)
        # Other work on the machine steals time from the pinned router: say how busy it was.
        figures["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        report("gateway", figures)
    finally:
        for p in reversed(procs):
            stop(p)


def policy_cost(router_name: str, turns: int = 4000) -> float:
    """CPU microseconds per turn of the gateway's own work, in process and without HTTP: decoding
    the body, tracking the session (tool-state classification included) and the router's decision."""
    from libra.rollout.base import Bucket, InstanceView
    from libra.rollout.registry import make_router
    from libra.rollout.tool_state import SizeThresholds
    from libra.runtime.gateway.config import SessionConfig
    from libra.runtime.gateway.sessions import SessionTracker

    buckets = [Bucket("short", 1, 8192), Bucket("long", 2, 32768)]
    router = make_router(router_name, buckets)
    views = [InstanceView("a", 0, 1, 0, 256, True), InstanceView("b", 1, 2, 0, 256, True)]
    tracker = SessionTracker(SessionConfig(), SizeThresholds())
    raw = turn_bodies()
    bodies = [raw[k % 4].replace(PROMPT_SLOT, b"%08d" % (k // 4 // GROUP)) for k in range(turns)]
    t0 = time.process_time()
    for k, body in enumerate(bodies):
        s = tracker.open(f"s{k // 4}", None, 0)
        req = tracker.begin_turn(s, json.loads(body)["messages"])
        tracker.routed(s, req, router.route(req, views))
    return (time.process_time() - t0) / turns * 1e6


def gateway_overhead(port: int) -> dict:
    """The gateway's own view: quantiles of `libra_gateway_overhead_seconds` (time in the gateway,
    excluding the backend), as the upper edge of the histogram bucket where each falls."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    pat = re.compile(
        r'libra_gateway_overhead_seconds_bucket\{endpoint="/v1/chat/completions",le="([^"]+)"\} (\S+)'
    )
    buckets = [(float(le), float(n)) for le, n in pat.findall(text)]
    total = buckets[-1][1] if buckets else 0
    out = {}
    for q in (0.5, 0.99):
        edge = next((le for le, n in buckets if n >= q * total), float("inf"))
        out[f"libra_internal_p{int(q * 100)}_ms_at_most"] = round(edge * 1e3, 3)
    return out


def summarise(rounds: dict[str, list[dict]], args, router_core: list[int], others: list[int]) -> dict:
    def med(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rounds[name]), 3)

    out = {
        "router": args.router,
        "placement": f"latency: unpinned; throughput: router on core {router_core[0]}, backends and load on cores {others}",
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "nice": args.nice,
        "direct_p50_ms": med("direct", "p50_ms"),
        "direct_p99_ms": med("direct", "p99_ms"),
        "direct_rps": round(med("direct", "rps")),
    }
    for name in ("libra", "before", "sglang"):
        if not rounds[name]:
            continue
        best = min(r["p50_ms"] for r in rounds[name]) - min(r["p50_ms"] for r in rounds["direct"])
        out[f"{name}_added_p50_ms_best_round"] = round(best, 3)
        out[f"{name}_added_p50_ms"] = round(med(name, "p50_ms") - out["direct_p50_ms"], 3)
        out[f"{name}_added_p99_ms"] = round(med(name, "p99_ms") - out["direct_p99_ms"], 3)
        out[f"{name}_rps"] = round(med(name, "rps"))
        out[f"{name}_rps_per_cpu_s"] = round(med(name, "rps_per_cpu_s"))
        out[f"{name}_cpu_ms_per_req"] = med(name, "cpu_ms_per_req")
        out[f"{name}_errors"] = sum(r["errors"] for r in rounds[name])
    if rounds["before"]:
        out["libra_added_p50_vs_before"] = round(out["libra_added_p50_ms"] / out["before_added_p50_ms"], 3)
    if not rounds["sglang"]:
        out["sglang"] = (
            "skipped: --skip-sglang" if args.skip_sglang else "skipped: sglang-router not installed"
        )
    out["target_added_p50_ms"] = TARGET_P50_MS
    out["target_rps_one_core"] = TARGET_RPS
    out["meets_p50"] = out["libra_added_p50_ms"] <= TARGET_P50_MS
    out["meets_rps_wall"] = out["libra_rps"] >= TARGET_RPS
    out["meets_rps_per_cpu_s"] = out["libra_rps_per_cpu_s"] >= TARGET_RPS
    return out


if __name__ == "__main__":
    main()

"""Run `libra train` and account for the host's CPU: what the live-run prediction needs of the host.

    python benchmarks/live_cpu.py [--before 15] -- libra train --out RUN --steps 5 ...

The prediction takes the host's other work as an input (`libra.sim.rl.live.Host`). Linux shares
the cores fairly between sessions (autogroup), not threads, and the run is started in a session of
its own: so every half second of the run's RL steps it counts the runnable threads of every other
session (less the run's own tool sandboxes) and records the share of a core one of the run's
processes would get with 1..8 of them busy (`libra.sim.rl.live.fair_share`); `shares`, their
mean, is what the prediction reads. `background` is the mean count of those threads, and
`background_before` the same for `--before` seconds before the run (for comparison).

During the run it also samples the CPU time of every process the run started, by role (engine per
bucket, gateway, actions service and its tool processes, trainer replicas, driver), and the host's
busy CPU; the CPU spent during the RL steps (from the first rollout to the last publication on the run's timeline, placed on the wall clock by
the time steps.json was first written, right after step 0's publication) is what the prediction's
CPU figures are compared with. Every 2 s it also times the host's speed probe
(`libra.runtime.profiler.cpu_probe`, a fixed forward pass of the built-in model in CPU seconds):
its median over the RL steps, `probe_cpu_s`, against the profile's says how much slower or faster
the run's host was than the profile's (the live prediction's `host_speed`, applied only when asked);
`probe_before_s` and `probe_after_s` time it once a second for `--before` and `--after` seconds
with the run not yet started and gone.

The tool sandboxes' processes are reaped inside their PID namespaces, so most of their CPU reaches
no parent's `cutime`: where /sys/fs/cgroup/cpuacct is writable (root), the run is started in a
cpuacct group of its own, whose usage (`all`) counts every process the run started, and the live
prediction takes the sandboxes' CPU as `all` less the run's other roles. `others` is the other
sessions' runnable threads as sampled over the RL steps ([threads of each session, fraction of the
samples]), which the prediction water-fills the cores with beside the run and its sandboxes.
Writes RUN/host.json (and every sample in RUN/host-series.json, the host's /proc/stat included)
and prints one JSON line. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from libra.runtime.profiler import cpu_probe, probe_model
from libra.sim.rl.live import fair_share

HZ = os.sysconf("SC_CLK_TCK")
PROBE_EVERY = 4  # samples (2 s) between two runs of the host's speed probe
MAX_BUSY = 8  # the run's busy processes the share table goes to (two engines, serving, trainers)
ROLES = (("--tp-label", "engine"), ("serve gateway", "gateway"), ("serve actions", "actions"),
         ("train.worker", "trainer"), ("libra train", "driver"))  # fmt: skip


def host_sample() -> tuple[float, int]:
    """(busy CPU seconds of the host since boot, runnable processes now, less this one)."""
    with open("/proc/stat") as f:
        cpu = f.readline().split()
        busy = sum(int(x) for x in cpu[1:8]) - int(cpu[4]) - int(cpu[5])
        running = next(int(x.split()[1]) for x in f if x.startswith("procs_running"))
    return busy / HZ, running - 1


STAT_KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def proc_stat() -> list[float]:
    """The host's CPU seconds since boot by kind (STAT_KINDS): where a core went when the run's
    processes and the other sessions' do not account for it (kernel threads, a hypervisor)."""
    with open("/proc/stat") as f:
        return [int(x) / HZ for x in f.readline().split()[1 : 1 + len(STAT_KINDS)]]


def descendants(pid: int) -> list[int]:
    todo, out = [pid], []
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return out


def runnable_by_session(
    skip: set[int], tools: set[int] | frozenset[int] = frozenset()
) -> tuple[list[int], int]:
    """Runnable threads (state R) of each session not in `skip`; kernel threads (session 0) are
    scheduled one by one, so each counts as its own. Also the runnable threads of the sessions in
    `tools` (the run's tool sandboxes, each in a session of its own)."""
    by_sid: dict[int, int] = {}
    kernel = in_tools = 0
    me = str(os.getpid())  # this sampler, runnable while it looks
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pid == me:
            continue
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                f = Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            sid = int(f[3])
            in_tools += f[0] == "R" and sid in tools
            if f[0] != "R" or sid in skip:
                continue
            if sid == 0:
                kernel += 1
            else:
                by_sid[sid] = by_sid.get(sid, 0) + 1
    return list(by_sid.values()) + [1] * kernel, in_tools


def sessions(pids: list[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            out.add(os.getsid(pid))
        except OSError:
            continue
    return out


def cpu_and_role(pid: int) -> list[tuple[float, str]]:
    """The process's CPU seconds by role; for the actions service also its reaped children's
    (`tools_reaped`): the tool sandboxes' processes mostly exit between two samples, so `tools`
    (those alive when sampled) misses most of their CPU, which comes back to the service as its
    children's (cutime, cstime) once it has waited for them."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return []
    role = next((r for key, r in ROLES if key in cmd), "tools")
    own = [((int(stat[11]) + int(stat[12])) / HZ, role)]
    return own + [((int(stat[13]) + int(stat[14])) / HZ, "tools_reaped")] if role == "actions" else own


class RunGroup:
    """A cgroup-v1 cpuacct group holding the run's processes: the CPU they and every process they
    started used, the tool sandboxes that exited between two samples included (a sandbox's
    processes are reaped inside its PID namespace, so their CPU never reaches the actions
    service's `cutime`). Needs a writable /sys/fs/cgroup/cpuacct (root on this project's hosts)."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def make(cls) -> RunGroup | None:
        path = cls.ROOT / f"libra-live-{os.getpid()}"
        try:
            path.mkdir()
        except OSError:
            return None
        return cls(path)

    def join(self) -> None:
        """In the child before it runs the command (preexec_fn): nothing runs outside the group."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage_s(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


class Accounting:
    """CPU seconds by role over time: [(wall-clock time, {role: cumulative CPU})]."""

    def __init__(self) -> None:
        self.last: dict[tuple[int, str], float] = {}
        self.roles: dict[tuple[int, bool], str] = {}
        self.total: dict[str, float] = {}
        self.series: list[tuple[float, dict[str, float]]] = []
        # (wall-clock time, runnable threads of each other session)
        self.others: list[tuple[float, list[int]]] = []
        self.tools: list[tuple[float, int]] = []  # (wall-clock time, the tool sandboxes' runnable threads)
        self.group: RunGroup | None = None
        self.stat: list[tuple[float, list[float]]] = []  # (wall-clock time, the host's CPU seconds by kind)

    def sample(self, root: int, t: float) -> None:
        pids = descendants(root)
        sids = sessions(pids)
        others, tools = runnable_by_session(sids, sids - {root})  # the run started its own session: sid = pid
        self.others.append((t, others))
        self.tools.append((t, tools))
        for pid in pids:
            for cpu, role in cpu_and_role(pid):
                # A process keeps the role it was first seen with (an exiting one's cmdline is empty).
                role = self.roles.setdefault((pid, role == "tools_reaped"), role)
                before = self.last.get((pid, role), 0.0)
                self.total[role] = self.total.get(role, 0.0) + cpu - before
                self.last[(pid, role)] = cpu
        if self.group is not None:  # everything the run's processes ran, the exited ones' too
            self.total["all"] = self.group.usage_s()
        self.series.append((t, dict(self.total)))
        self.stat.append((t, proc_stat()))

    def between(self, t0: float, t1: float) -> dict[str, float]:
        at = lambda t: next((c for s, c in self.series if s >= t), self.series[-1][1])  # noqa: E731
        a, b = at(t0), at(t1)
        return {r: round(b.get(r, 0.0) - a.get(r, 0.0), 2) for r in sorted(b)}

    def others_between(self, t0: float, t1: float) -> tuple[float, list[float]]:
        """Other work over [t0, t1]: mean runnable threads, and the mean share of a core of one
        of the run's processes with 1..MAX_BUSY of them busy."""
        seen = [o for t, o in self.others if t0 <= t <= t1] or [o for _, o in self.others]
        cores = float(os.cpu_count() or 1)
        shares = [sum(fair_share(cores, n, o) for o in seen) / len(seen) for n in range(1, MAX_BUSY + 1)]
        return sum(sum(o) for o in seen) / len(seen), shares

    def others_seen(self, t0: float, t1: float) -> list[list]:
        """The other sessions' runnable threads over [t0, t1] as [sample, fraction of the samples]."""
        seen = [tuple(sorted(o)) for t, o in self.others if t0 <= t <= t1] or [
            tuple(sorted(o)) for _, o in self.others
        ]
        return [[list(o), round(n / len(seen), 4)] for o, n in sorted(Counter(seen).items())]


def rl_phase(run: Path, first_write: float) -> tuple[float, float]:
    """The first rollout's start and the last publication's end, on the wall clock: the run's
    timeline starts `first_write` (steps.json's first mtime) less step 0's publication end."""
    ev = json.loads((run / "trace.json").read_text())["traceEvents"]
    phases = [e for e in ev if e.get("ph") == "X" and e["name"].split(" ")[0] in ("rollout", "publish")]
    step0 = max(e["ts"] + e["dur"] for e in phases if e["name"] == "publish (step 0)") / 1e6
    origin = first_write - step0
    return origin + min(e["ts"] for e in phases) / 1e6, origin + max(e["ts"] + e["dur"] for e in phases) / 1e6


def write_series(path: Path, acc: Accounting, probes: list[tuple[float, float]], p0: float) -> None:
    """Every sample as it was taken, in seconds from the RL steps' start (`rl_start`, the epoch):
    the run's cumulative CPU by role, the other sessions' runnable threads, the tool sandboxes'
    (sessions of the run's processes but its own), and the speed probes;
    what happens when, where host.json has the means."""
    at = lambda t: round(t - p0, 3)  # noqa: E731
    series = {"rl_start": p0, "cpu": [[at(t), c] for t, c in acc.series],
              "others": [[at(t), o] for t, o in acc.others], "tools": [[at(t), n] for t, n in acc.tools], "probes": [[at(t), c] for t, c in probes],
              "stat_kinds": STAT_KINDS, "stat": [[at(t), c] for t, c in acc.stat]}  # fmt: skip
    path.write_text(json.dumps(series) + "\n")


def mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def quiet_probes(net, seconds: float) -> list[float]:
    """The speed probe once a second for `seconds` with the run gone: the host as the profile
    sees it (its probes run with nothing of its own busy), unlike the probes under the run's load."""
    out = []
    for _ in range(int(seconds)):
        out.append(cpu_probe(net))
        time.sleep(1.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=float, default=15.0, help="seconds of background sampling first")
    ap.add_argument("--after", type=float, default=15.0, help="seconds of speed probes after the run")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- libra train --out RUN ...")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if "--out" not in cmd:
        sys.exit("error: the command must name its run folder with --out")
    run = Path(cmd[cmd.index("--out") + 1])
    net, runnable, before = probe_model(), [], []
    for i in range(max(1, int(a.before * 2))):
        runnable.append(sum(runnable_by_session(set())[0]))
        if i % 2 == 0:
            before.append(cpu_probe(net))
        time.sleep(0.5)
    probes = []  # (wall-clock time, the probe's CPU seconds)
    acc, t0, busy0, first_write = Accounting(), time.time(), host_sample()[0], None
    group = RunGroup.make()
    # The run's own session (one autogroup), and a cpuacct group of its own where the host allows.
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=group.join if group else None)
    acc.group = group
    while proc.poll() is None:
        acc.sample(proc.pid, time.time())
        first_write = first_write or mtime(run / "steps.json")
        if len(acc.series) % PROBE_EVERY == 0:
            probes.append((time.time(), cpu_probe(net)))
        time.sleep(0.5)
    wall, busy = time.time() - t0, host_sample()[0] - busy0
    if group is not None:
        time.sleep(1.0)  # the run's last processes leave the group as they are reaped
        group.remove()
    after = quiet_probes(net, a.after)
    if proc.returncode != 0 or first_write is None:
        sys.exit(proc.returncode or "error: the run wrote no steps.json")
    p0, p1 = rl_phase(run, first_write)
    background, shares = acc.others_between(p0, p1)
    in_rl = sorted(c for t, c in probes if p0 <= t <= p1) or sorted(c for _, c in probes)
    out = {"cores": os.cpu_count(), "background": round(background, 2), "shares": [round(x, 4) for x in shares], "others": acc.others_seen(p0, p1),
           "background_before": round(sum(runnable) / len(runnable), 2), "probe_cpu_s": round(median(in_rl), 6),
           "probe_before_s": round(median(before), 6), "probe_after_s": round(median(after), 6) if after else None, "rl_phase_s": round(p1 - p0, 2), "cpu_s_in_rl_phase": acc.between(p0, p1),
           "cpu_s_whole_run": {r: round(v, 2) for r, v in sorted(acc.total.items())},
           "host_busy_cores": round(busy / wall, 3), "run_cores": round(acc.total.get("all", sum(acc.total.values())) / wall, 3)}  # fmt: skip
    (run / "host.json").write_text(json.dumps(out, indent=1) + "\n")
    write_series(run / "host-series.json", acc, probes, p0)
    print(json.dumps({"bench": "live_cpu", **out}))


if __name__ == "__main__":
    main()

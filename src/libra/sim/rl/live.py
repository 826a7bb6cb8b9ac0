"""Predict a live `libra train` run with the simulator, from what the run wrote.

The run folder (`libra train --set save_trajectories=true`) holds every trained trajectory turn by
turn (trajectories.jsonl: prompt and sampled token ids, and the engine instance that served each
turn), the Perfetto timeline with each turn's wall-clock span (trace.json), the configuration
(config.json) and the measured steps (steps.json).

The prediction runs the run's whole pipeline on the simulated clock, with the pipeline's own
policy (`libra.planner.staleness`: batch b starts once b - k steps are trained; a step trains the
first whole groups to finish): one simulated engine per live instance, each turn on the instance
that served it live, a trajectory waiting between turns as long as its tool call took live (the
actions service is not simulated), the built-in engine's steps priced by the `libra-builtin`
preset and the trainer replicas' steps by the training cost model, both fitted to the engine's and
the trainer's own steps (`libra costmodel profile --model builtin-tiny --device cpu`, CPU seconds).

The run's processes share one CPU host, so CPU seconds become wall seconds by processor sharing.
Linux shares the cores fairly between sessions (autogroup) and the run is one session, so a busy
process's share of a core depends on how many of the run's processes are busy (the busy engines,
the serving path that streams their tokens: SERVING_PER_ENGINE each, the trainer replicas while
they train) and on the other sessions' runnable threads, which `benchmarks/live_cpu.py` measures
during the run (`Host.others`; `fair_share` water-fills the cores between sessions). Each tool
call's sandbox is a session of its own, so while one runs the run's session gets that much less
(`Sandboxes`: their CPU as the run's cpuacct group measured it). A training step advances a slice
at a time at the share of that moment, since the engines finish a batch or start the next while
it trains. Asked for, the engines' CPU is scaled by the host's speed during the run (`host_speed`:
the profile's speed probe timed during the run over the profile's own; off by default).

Of the run's own timings only its tool waits and its weight-publication time enter the prediction.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from libra.core.config import read_text_file
from libra.core.errors import ConfigError
from libra.core.trace import build_line, json_lines
from libra.costmodel.catalog import Catalog, load_catalog
from libra.costmodel.efficiency import EngineOverhead, Profile, RolloutEfficiency, load_profile
from libra.costmodel.rollout import RolloutCostModel
from libra.costmodel.training import TrainCostModel, TrainParallel, sequences_per_micro_batch
from libra.planner.staleness import GroupQueue, StalenessGate
from libra.sim.engine import Engine, KVPolicy, Seq
from libra.sim.kernel import Kernel

ENGINE = "libra-builtin"
HARDWARE = "cpu-host"
BUILTIN_MAX_BATCHED_TOKENS = 512  # the built-in engine's default max_num_batched_tokens
# CPU the serving path spends per CPU second of a busy engine: the driver's agent loop, the
# gateway's routing and the actions service's HTTP, all streaming every token. Measured by CPU
# accounting over the RL steps of seven 10-step default runs (benchmarks/live_cpu.py's
# cpu_s_in_rl_phase: driver + gateway + actions over engine, 0.333-0.361; docs/fidelity.md). The
# 0.47 used before came from a whole 5-step run, whose driver CPU includes the warm-start's.
SERVING_PER_ENGINE = 0.34
# Simulated seconds between two readings of a training step's share of a core (`LivePipeline._train`):
# short beside a step (seconds), so an engine going idle during it is seen within one slice.
TRAIN_SLICE_S = 0.05
# The most cores the actions service grants one tool call, exclusively
# (`libra.runtime.sandbox.service`: a tool call asks for 4 unless it says otherwise).
TOOL_CORES = 4
ORACLE_ROUNDS = 3  # `predict_live(oracle=True)`: rounds of rescaling the CPU to the measured
T = TypeVar("T")
_TRAJ_ID = re.compile(r"^b(\d+)-g(\d+)-")


def fair_share(cores: float, own: float, others: Sequence[float]) -> float:
    """One of `own` busy processes' share of a core, when the kernel shares `cores` fairly between
    process groups (Linux's autogroup: one per session; the run's processes are one session) and
    each other group has `others[i]` runnable threads. Water-filling: no group gets more than it
    can run, the rest is split evenly."""
    if own <= 0:
        return 1.0
    demands, left, level = sorted([own, *(d for d in others if d > 0)]), cores, 0.0
    for i, d in enumerate(demands):
        level = left / (len(demands) - i)
        if d > level:
            break
        left -= d
        level = d
    else:
        return 1.0
    return min(1.0, min(own, level) / own)


@dataclass(frozen=True, slots=True)
class Host:
    """The CPU host the run shared: its cores (None: a core for every process, no sharing) and the
    other work on it, as a busy process's share of a core by how many of the run's processes are
    busy (`shares[n - 1]`: n busy; `benchmarks/live_cpu.py` measures it during the run), or else
    `background` other sessions of one runnable thread each."""

    cores: float | None = None
    background: float = 0.0
    shares: tuple[float, ...] = ()
    probe_cpu_s: float | None = None  # the host's speed during the run (live_cpu.py), if measured
    # The other sessions as sampled during the run: (runnable threads of each, the fraction of the
    # samples that saw them); where given it replaces `shares` and `background`.
    others: tuple[tuple[tuple[int, ...], float], ...] = ()

    def share(self, busy: float, sandboxes: int = 0) -> float:
        """One busy process's share of a core when `busy` of the run's processes are busy and
        `sandboxes` tool sandboxes run, each in a session of its own."""
        if self.cores is None:
            return 1.0
        if self.others:
            return _mean_share(self.cores, busy, self.others, sandboxes)
        if not self.shares or sandboxes:
            return fair_share(self.cores, busy, [1.0] * (round(self.background) + sandboxes))
        n = min(max(busy, 1.0), len(self.shares))
        lo = int(n)
        s = self.shares[lo - 1] if lo == len(self.shares) else (
            self.shares[lo - 1] + (n - lo) * (self.shares[lo] - self.shares[lo - 1]))  # fmt: skip
        return min(1.0, s * n / max(busy, 1.0))  # past the table, the run's group keeps its cores

    def sandbox_share(self, busy: float, sandboxes: int) -> float:
        """A tool sandbox's share of a core: a session of one runnable thread beside the run's
        (`busy` processes) and `sandboxes` - 1 other sandboxes."""
        if self.cores is None:
            return 1.0
        others = self.others or (((1,) * round(self.background), 1.0),)
        return _mean_share(self.cores, 1.0, others, sandboxes - 1, busy)


@functools.lru_cache(maxsize=4096)
def _mean_share(cores: float, own: float, others: tuple[tuple[tuple[int, ...], float], ...], sandboxes: int,
                run: float = 0.0) -> float:  # fmt: skip
    """`fair_share` averaged over the sampled other sessions, with `sandboxes` more sessions of
    one thread (and the run's group of `run` busy processes, when `own` is a sandbox)."""
    extra = [1.0] * sandboxes + ([run] if run > 0 else [])
    return sum(w * fair_share(cores, own, [*o, *extra]) for o, w in others)


@dataclass(frozen=True, slots=True)
class RunLayout:
    """What of the run's config.json the prediction needs."""

    model: str
    max_num_seqs: int
    kv_cache_mb: int
    replicas: int
    micro_batch_tokens: int
    groups_per_step: int
    staleness: int
    consume: str

    @classmethod
    def of(cls, cfg: dict) -> RunLayout:
        try:
            e, t, p = cfg["engine"], cfg["trainer"], cfg["pipeline"]
            return cls(f"builtin-{e['model']}", int(e["max_num_seqs"]), int(e["kv_cache_mb"]), int(t["replicas"]),
                       int(t["micro_batch_tokens"]), int(cfg["rollout"]["groups_per_step"]), int(p["staleness"]),
                       str(p["consume"]))  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError("--live", "config.json", f"a libra train config (missing or bad {e})") from None


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    step_s: float
    train_s: float
    publish_s: float


@dataclass(slots=True)
class LiveTurn:
    prompt: int
    sampled: int
    instance: str
    start: float  # seconds of the run's timeline
    end: float


@dataclass(slots=True)
class LiveTraj:
    step: int
    batch: int
    id: str
    turns: list[LiveTurn] = field(default_factory=list)

    @property
    def group(self) -> tuple[int, str]:
        m = _TRAJ_ID.match(self.id)
        return (self.batch, m.group(2) if m else self.id)

    @property
    def tokens(self) -> int:
        return self.turns[-1].prompt + self.turns[-1].sampled


@dataclass(slots=True)
class LiveRun:
    layout: RunLayout
    steps: list[MeasuredStep]
    trajs: list[LiveTraj]

    def batches(self) -> dict[int, list[LiveTraj]]:
        out: dict[int, list[LiveTraj]] = {}
        for t in self.trajs:
            out.setdefault(t.batch, []).append(t)
        return out


def _json(path: Path) -> object:
    try:
        return json.loads(read_text_file(path))
    except (OSError, ValueError) as e:
        raise ConfigError("--live", str(path), f"a libra train run folder with {path.name} ({e})") from None


class _Turn(BaseModel):
    """One turn of a trajectories.jsonl line: what the prediction reads of it."""

    model_config = ConfigDict(extra="ignore")
    prompt_ids: list[int] = Field(min_length=1)
    token_ids: list[int]
    instance: str = Field(min_length=1, max_length=200)


class _Traj(BaseModel):
    """One line of trajectories.jsonl (libra.runtime.train.report)."""

    model_config = ConfigDict(extra="ignore")
    step: int = Field(ge=0)
    batch: int = Field(ge=0)
    id: str = Field(min_length=1, max_length=200)
    turns: list[_Turn] = Field(min_length=1)


class _Span(BaseModel):
    """One complete event of trace.json (Perfetto's "X"), in microseconds."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    name: str
    ts: float = Field(ge=0)
    dur: float = Field(ge=0)


def _spans(folder: Path) -> dict[str, tuple[float, float]]:
    """Each turn's (start, end) in seconds of the run's timeline, by the span's name."""
    path, spans = folder / "trace.json", {}
    events = _json(path)
    events = events.get("traceEvents") if isinstance(events, dict) else None
    if not isinstance(events, list):
        raise ConfigError("--live", str(path), "a Perfetto trace with a traceEvents list (libra train's)")
    for n, ev in enumerate(events):
        if isinstance(ev, dict) and ev.get("ph") == "X" and " turn " in str(ev.get("name", "")):
            span = build_line(_Span, ev, path, n)
            spans[span.name] = (span.ts / 1e6, (span.ts + span.dur) / 1e6)
    return spans


def _steps(folder: Path) -> list[MeasuredStep]:
    try:
        return [MeasuredStep(float(r["step_time_s"]), float(r["train_s"]), float(r["publish_s"]))
                for r in _json(folder / "steps.json")]  # type: ignore[union-attr]  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError("--live", str(folder / "steps.json"), f"libra train's steps (bad {e})") from None


def load_run(folder: str | Path) -> LiveRun:
    """Read the run folder; turns are timed from the timeline's spans of the same turn (a
    trajectory with a turn the timeline lacks is left out)."""
    folder = Path(folder)
    path = folder / "trajectories.jsonl"
    if not path.is_file():
        raise ConfigError(
            "--live", str(folder), "a run folder with trajectories.jsonl (save_trajectories: true)"
        )
    spans, trajs = _spans(folder), []
    for n, rec in json_lines(path):
        r = build_line(_Traj, rec, path, n)
        t = LiveTraj(r.step, r.batch, r.id)
        for k, turn in enumerate(r.turns):
            start, end = spans.get(f"{r.id} turn {k}", (0.0, 0.0))
            t.turns.append(LiveTurn(len(turn.prompt_ids), len(turn.token_ids), turn.instance, start, end))
        if all(x.end > 0 for x in t.turns):
            trajs.append(t)
    if not trajs:
        raise ConfigError(
            "--live", str(path), "trajectories whose turns trace.json times (libra train's own)"
        )
    return LiveRun(RunLayout.of(_json(folder / "config.json")), _steps(folder), trajs)  # type: ignore[arg-type]


def _host_json(folder: str | Path, read: Callable[[dict], T]) -> T | None:
    """What `benchmarks/live_cpu.py` wrote of the run (RUN/host.json) read by `read`, or None."""
    path = Path(folder) / "host.json"
    if not path.is_file():
        return None
    try:
        return read(_json(path))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError("--live", str(path), f"live_cpu.py's host.json (bad {e})") from None


def _host(d: dict) -> Host:
    probe = d.get("probe_cpu_s")
    seen = [(tuple(int(n) for n in o), float(w)) for o, w in d.get("others", ())]
    total = sum(w for _, w in seen) or 1.0
    others = tuple((o, w / total) for o, w in seen)  # the weights were rounded
    host = Host(float(d["cores"]), float(d["background"]), tuple(float(x) for x in d.get("shares", ())),
                None if probe is None else float(probe), others)  # fmt: skip
    if not (1 <= host.cores < 1e5 and 0 <= host.background < 1e5 and all(0 < x <= 1 for x in host.shares)):
        raise ValueError("cores >= 1, background >= 0 and shares in (0, 1]")
    if not all(w > 0 and all(n > 0 for n in o) for o, w in others):
        raise ValueError("others: [runnable threads of each session (> 0), weight (> 0)]")
    if host.probe_cpu_s is not None and not 0 < host.probe_cpu_s < 1e3:
        raise ValueError("probe_cpu_s in (0, 1000) seconds")
    return host


def load_host(folder: str | Path) -> Host | None:
    """The host the run shared, as live_cpu.py measured it, or None."""
    return _host_json(folder, _host)


@dataclass(frozen=True, slots=True)
class RunCpu:
    """CPU seconds of the run's processes during its RL steps: engines, trainer replicas, and the
    serving path (driver, gateway, actions service)."""

    engine: float
    trainer: float
    serving: float | None = None
    tools: float | None = None  # the tool sandboxes', each in a session of its own


def load_run_cpu(folder: str | Path) -> RunCpu | None:
    """The run's CPU seconds as live_cpu.py measured them, or None. The tool sandboxes': what the
    run's cpuacct group used beyond its other processes (`all`) where live_cpu.py had one, else
    what it saw of them (most of their processes exit unseen: an undercount)."""

    def read(d: dict) -> RunCpu:
        c = d["cpu_s_in_rl_phase"]
        engine, trainer, serving = (
            float(c["engine"]),
            float(c["trainer"]),
            float(c["driver"] + c["gateway"] + c["actions"]),
        )
        tools = (
            float(c["all"]) - engine - trainer - serving
            if "all" in c
            else c.get("tools", 0.0) + c.get("tools_reaped", 0.0)
        )
        return RunCpu(engine, trainer, serving, max(0.0, tools))

    return _host_json(folder, read)


def measured_makespan(trajs: list[LiveTraj]) -> float:
    return max(t.turns[-1].end for t in trajs) - min(t.turns[0].start for t in trajs)


class SharedCpuCost(RolloutCostModel):
    """The built-in engine's cost model with each step stretched by the engine's current share of
    the host's cores (a subclass, so the compiled simulated engine takes it as its cost model).
    `cpu_s` adds up the CPU seconds of the steps it priced: the engine steps one at a time
    (max_segment_steps=1), so a decode step is A + B * ctx_sum of the engine's context now
    (`ctx_now`). The engine process's CPU outside its steps (the preset's `request_cpu_s` and
    `token_cpu_s`) runs between steps on the same Python interpreter, so it lengthens the next
    step: a turn's request and first token when it arrives (`request`), each decoding sequence's
    token in its step; `serving_cpu_s` adds it up. Both are times `speed` (the host's speed
    where asked for, else 1)."""

    __slots__ = ("share_now", "speed", "ctx_now", "cpu_s", "serving_cpu_s", "pending")

    def step_time(self, prefill_tokens, prefill_attn, decode_seqs, decode_ctx):  # type: ignore[override]
        t = super().step_time(prefill_tokens, prefill_attn, decode_seqs, decode_ctx)
        s, f = self.share_now(), self.speed
        self.cpu_s += t * f
        return (t + self._serving(decode_seqs)) * f / s

    def decode_coeffs(self, n: int) -> tuple[float, float]:
        a, b = super().decode_coeffs(n)
        s, f = self.share_now(), self.speed
        self.cpu_s += (a + b * self.ctx_now()) * f
        return (a + self._serving(n)) * f / s, b * f / s

    def request(self) -> None:
        """A turn arrived: its request's CPU and its first token's (its prefill samples it)."""
        o = self.overhead
        self.pending += o.request_cpu_s + o.token_cpu_s

    def _serving(self, tokens: int) -> float:
        extra, self.pending = self.pending + tokens * self.overhead.token_cpu_s, 0.0
        self.serving_cpu_s += extra * self.speed
        return extra


def cpu_engine(k: Kernel, iid: str, eff: RolloutEfficiency, max_num_seqs: int, kv_cache_mb: int,
               share_now: Callable[[], float], catalog: Catalog, model: str, speed: float | None = 1.0) -> Engine:  # fmt: skip
    """One simulated built-in engine on the CPU host, its steps priced by `SharedCpuCost` times
    `speed` (CPU seconds on this host per the profile's; None: 1, as the profile's own replay)."""
    hw, m = catalog.hardware(HARDWARE), catalog.model(model)
    cost = SharedCpuCost(hw, m, 1, eff, 1.0, BUILTIN_MAX_BATCHED_TOKENS, ENGINE, max_num_seqs)
    # One step at a time, so each step is priced at the share of its own moment.
    eng = Engine(k, iid, cost, max_num_seqs, BUILTIN_MAX_BATCHED_TOKENS, KVPolicy.DROP, max_segment_steps=1)
    eng.kv_cap = int(kv_cache_mb * 2**20 // m.kv_bytes_per_token)  # the engine's --kv-cache-mb
    cost.share_now, cost.ctx_now, cost.cpu_s, cost.serving_cpu_s, cost.pending = (
        share_now, lambda: eng.ctx_sum, 0.0, 0.0, 0.0)  # fmt: skip
    # The profile's contention factors (its steps timed beside busy trainer-like processes) are
    # not applied: on the fresh runs of docs/fidelity.md an engine's decode steps cost no more
    # CPU the smaller its share of a core, nor while the trainers train, and applying them priced
    # the engines' CPU 16% high on average.
    cost.speed = 1.0 if speed is None else speed
    return eng


def host_speed(host: Host, engine: EngineOverhead) -> float:
    """CPU seconds on the run's host per CPU second on the profile's: the ratio of the speed probe
    timed during the run (live_cpu.py) to the one timed during the profile; 1 without both."""
    if host.probe_cpu_s and engine.probe_cpu_s:
        return host.probe_cpu_s / engine.probe_cpu_s
    return 1.0


def submit_turn(eng: Engine, key: object, prompt: int, sampled: int, on_done: Callable[[Seq], None]) -> None:
    eng.cost.request()  # type: ignore[attr-defined]
    eng.submit(Seq(key, max(1, prompt), max(1, sampled), on_done=on_done))


def profile_step_cpu_s(trajs: Sequence[Sequence[tuple[int, int]]], eff: RolloutEfficiency, max_num_seqs: int,
                       kv_cache_mb: int, model: str, catalog: Catalog | None = None) -> float:  # fmt: skip
    """The step CPU seconds one simulated engine prices for a workload of the serving profile
    (`libra.runtime.serving_profile`): `trajs`, each a trajectory's turns as (prompt, sampled)
    tokens, all started at once, each turn submitted when the one before it ends."""
    k = Kernel(0)
    eng = cpu_engine(
        k, "profile", eff, max_num_seqs, kv_cache_mb, lambda: 1.0, catalog or load_catalog(), model
    )

    def turn(t: int, i: int) -> None:
        if i < len(trajs[t]):
            submit_turn(eng, (t, i), *trajs[t][i], on_done=lambda _seq: turn(t, i + 1))

    for t in range(len(trajs)):
        turn(t, 0)
    k.run()
    return eng.cost.cpu_s  # type: ignore[attr-defined]


class Sandboxes:
    """The actions service's tool sandboxes as CPU load. Each tool call runs a sandbox (bwrap, its
    helpers, a Python interpreter) in a session of its own, so the kernel gives it as much of the
    cores as the run's whole session; the service grants a tool call up to TOOL_CORES cores,
    exclusively, so `slots` run at once. The trajectories still wait as long as they did live;
    what the sandboxes change is the share of a core left to the run's processes. Each call adds
    `cpu_s` CPU seconds of work; while any is owed, `slots` sandboxes run at their fair share
    (advanced whenever the share is read, which every engine step and training slice does)."""

    def __init__(self, cpu_s: float, host: Host):
        self.cpu_s, self.host = cpu_s, host
        self.slots = max(1, int(host.cores // min(TOOL_CORES, host.cores))) if host.cores else 1
        self.owed = self.rate = self.at = 0.0
        self.cpu_total = 0.0

    def call(self, now: float, busy: float) -> None:
        self.running(now, busy)
        self.owed += self.cpu_s
        self.cpu_total += self.cpu_s
        self.running(now, busy)

    def running(self, now: float, busy: float) -> int:
        """How many sandboxes run now, their work advanced to `now` at the rate last set."""
        self.owed = max(0.0, self.owed - self.rate * (now - self.at))
        self.at = now
        n = self.slots if self.owed > 1e-12 else 0
        self.rate = n * self.host.sandbox_share(busy, n) if n else 0.0
        return n


@dataclass(slots=True)
class Timeline:
    """What the simulated run did: each batch's span, each step's end and training time."""

    batch_span: dict[int, list[float]] = field(default_factory=dict)
    step_end: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    train_cpu_s: float = 0.0  # all replicas


class LivePipeline:
    """The run's pipeline on the simulated clock (module docstring)."""

    def __init__(self, run: LiveRun, host: Host, profile: Profile, catalog: Catalog,
                 scale: tuple[float, float] = (1.0, 1.0), tool_cpu_s: float = 0.0, speed: bool = False):  # fmt: skip
        """`scale`: the engines' and the trainers' CPU seconds times these (1: as priced; the
        oracle of `predict_live` sets them to the measured over the priced). `tool_cpu_s`: the
        CPU seconds of one tool call's sandbox (`Sandboxes`). `speed`: the engines' CPU scaled
        by `host_speed` (off by default: on the runs of docs/fidelity.md it made them worse)."""
        self.run, self.host, self.k, lay = run, host, Kernel(0), run.layout
        self.tools = Sandboxes(tool_cpu_s, host)
        self.train_scale = scale[1]
        self.gate = StalenessGate(lay.staleness, lay.consume)  # type: ignore[arg-type]
        self.queue: GroupQueue[list[LiveTraj]] = GroupQueue(self.gate)
        self.batches = run.batches()
        self.publish_s = statistics.fmean(s.publish_s for s in run.steps)
        self.train_cost = TrainCostModel(catalog.hardware(HARDWARE), catalog.model(lay.model), profile.train)
        # Applied to the engines, not the trainers: the probe is a small forward pass like an
        # engine's steps (the trainers' are large batched forward and backward passes).
        self.speed = host_speed(host, profile.rollout.engine(ENGINE)) if speed else 1.0
        self.engines = {inst: cpu_engine(self.k, inst, profile.rollout, lay.max_num_seqs, lay.kv_cache_mb,
                                         self._engine_share, catalog, lay.model, self.speed * scale[0])
                        for inst in sorted({x.instance for t in run.trajs for x in t.turns})}  # fmt: skip
        self.trained = self.next_batch = 0
        self.training = False
        self.train_start = 0.0
        self.left: dict[tuple[int, str], int] = {}
        self.out = Timeline()

    def engine_cpu_s(self) -> float:
        """The engines' CPU seconds: their steps, what serving the turns adds, and one weight
        update each per step (its wall time is in the run's measured publication time)."""
        costs = [e.cost for e in self.engines.values()]
        loads = len(self.run.steps) * sum(c.overhead.weight_load_cpu_s for c in costs)
        return sum(c.cpu_s + c.serving_cpu_s for c in costs) + loads  # type: ignore[attr-defined]

    def _busy(self) -> float:
        engines = sum(1 for e in self.engines.values() if e.outstanding)
        return engines * (1 + SERVING_PER_ENGINE) + (self.run.layout.replicas if self.training else 0)

    def _engine_share(self) -> float:
        busy = self._busy()
        return self.host.share(busy, self.tools.running(self.k.now, busy))

    def run_all(self) -> Timeline:
        self._start_batches()
        self.k.run()
        return self.out

    # ---- rollout ------------------------------------------------------------------------------------

    def _start_batches(self) -> None:
        while self.next_batch < len(self.run.steps) and self.gate.may_start(self.next_batch, self.trained):
            b, self.next_batch = self.next_batch, self.next_batch + 1
            self.out.batch_span[b] = [self.k.now, self.k.now]
            for traj in self.batches.get(b, []):
                self.left[traj.group] = self.left.get(traj.group, 0) + 1
                self._submit(traj, 0)

    def _submit(self, traj: LiveTraj, i: int) -> None:
        turn = traj.turns[i]

        def done(seq: Seq) -> None:
            if i + 1 < len(traj.turns):
                self.tools.call(self.k.now, self._busy())
                self.k.after(max(0.0, traj.turns[i + 1].start - turn.end), self._submit, traj, i + 1)
            else:
                self._traj_done(traj)

        submit_turn(self.engines[turn.instance], (traj.id, i), turn.prompt, turn.sampled, done)

    def _traj_done(self, traj: LiveTraj) -> None:
        span = self.out.batch_span[traj.batch]
        span[1] = max(span[1], self.k.now)
        self.left[traj.group] -= 1
        if self.left[traj.group] == 0:
            members = [t for t in self.batches[traj.batch] if t.group == traj.group]
            self.queue.add(traj.batch, self.trained, members)
            self._train_if_ready()

    # ---- training -----------------------------------------------------------------------------------

    def _train_if_ready(self) -> None:
        if self.training or self.trained >= len(self.run.steps):
            return
        groups = self.queue.take(self.trained, self.run.layout.groups_per_step)
        if groups is None:
            return
        lens = [t.tokens for g in groups for t in g.group]
        self.training, self.train_start = True, self.k.now
        cpu = self.train_cpu_s(lens)
        self.out.train_cpu_s += cpu * self.run.layout.replicas
        self._train(cpu)

    def _train(self, left: float) -> None:
        """Advance the training step by the CPU seconds its replicas get at the share of this
        moment, a slice at a time: the engines finish their batches and start the next one while
        it trains, so its share changes during it (processor sharing)."""
        share = self._engine_share()
        if left <= TRAIN_SLICE_S * share:
            self.k.after(left / share, self._trained)
        else:
            self.k.after(TRAIN_SLICE_S, self._train, left - TRAIN_SLICE_S * share)

    def _trained(self) -> None:
        self.out.train_s.append(self.k.now - self.train_start)
        self.k.after(self.publish_s, self._published)

    def train_cpu_s(self, lens: list[int]) -> float:
        """CPU seconds of one step: the slowest replica's share, as the driver splits by tokens."""
        lay = self.run.layout
        par = TrainParallel(dp=lay.replicas, micro_batch=sequences_per_micro_batch(lens, lay.micro_batch_tokens),
                            recompute=False)  # fmt: skip
        return self.train_cost.step(par, lens).compute_s * self.train_scale

    def _published(self) -> None:
        self.trained += 1
        self.training = False
        self.out.step_end.append(self.k.now)
        self._start_batches()
        self._train_if_ready()


@dataclass(slots=True)
class LivePrediction:
    rollout: tuple[float, float]  # (measured, predicted) mean batch makespan, seconds
    train: tuple[float, float]  # mean training step
    step: tuple[float, float]  # mean step time
    steps: int
    host: Host
    cpu: tuple[RunCpu | None, RunCpu]  # (measured by live_cpu.py if it was, predicted) over the RL steps
    speed: float = 1.0  # the run's host's CPU seconds per the profile's (`host_speed`; scales the engines')

    def errors(self) -> dict:
        err = lambda p: (p[1] - p[0]) / p[0]  # noqa: E731
        measured, pred = self.cpu
        return {"step_err": err(self.step), "rollout_err": err(self.rollout), "train_err": err(self.train),
                "measured": {"step_s": self.step[0], "rollout_s": self.rollout[0], "train_s": self.train[0]},
                "predicted": {"step_s": self.step[1], "rollout_s": self.rollout[1], "train_s": self.train[1]},
                "cpu_s": {"measured": measured and asdict(measured), "predicted": asdict(pred)},
                "steps": self.steps, "host": asdict(self.host), "host_speed": self.speed}  # fmt: skip


def predict_live(
    folder: str | Path,
    profile_path: str | Path | None = None,
    host: Host | None = None,
    oracle: bool = False,
    speed: bool = False,
) -> LivePrediction:
    """Simulate the run in `folder` (module docstring); `host` defaults to what RUN/host.json
    says, else no sharing. `oracle`: the engines' and trainers' CPU seconds scaled to what
    live_cpu.py measured (RUN/host.json), which leaves only the sharing model's error."""
    run, catalog = load_run(folder), load_catalog()
    host = host or load_host(folder) or Host()
    profile, measured, scale = load_profile(profile_path), load_run_cpu(folder), (1.0, 1.0)
    if oracle and measured is None:
        raise ConfigError("--live", str(folder), "a run measured by benchmarks/live_cpu.py (host.json)")
    calls = sum(len(t.turns) - 1 for t in run.trajs)
    tool_cpu_s = measured.tools / calls if measured and measured.tools and calls else 0.0
    for _ in range(ORACLE_ROUNDS if oracle else 1):
        sim = LivePipeline(run, host, profile, catalog, scale, tool_cpu_s, speed)
        tl = sim.run_all()
        if len(tl.step_end) < len(run.steps):
            raise ConfigError(
                "--live", str(folder), "a run whose saved trajectories fill every step's groups"
            )
        if oracle:  # the contention factors move with the timeline: a few rounds settle it
            scale = (scale[0] * measured.engine / sim.engine_cpu_s(), scale[1] * measured.trainer / tl.train_cpu_s)  # type: ignore[union-attr]  # fmt: skip
    batches = {b: ts for b, ts in run.batches().items() if b < len(run.steps)}
    pred_roll = [tl.batch_span[b][1] - tl.batch_span[b][0] for b in batches]
    return LivePrediction(
        (statistics.fmean(measured_makespan(ts) for ts in batches.values()), statistics.fmean(pred_roll)),
        (statistics.fmean(s.train_s for s in run.steps), statistics.fmean(tl.train_s)),
        (statistics.fmean(s.step_s for s in run.steps), tl.step_end[-1] / len(run.steps)),
        len(run.steps),
        host,
        (
            measured,
            RunCpu(
                sim.engine_cpu_s(),
                tl.train_cpu_s,
                SERVING_PER_ENGINE * sim.engine_cpu_s(),
                sim.tools.cpu_total,
            ),
        ),
        sim.speed,
    )

"""Predict a live `libra train` run with the simulator, from what the run wrote.

The run folder (`libra train --set save_trajectories=true`) holds every trained trajectory turn by
turn (trajectories.jsonl: prompt and sampled token ids, and the engine instance that served each
turn), the Perfetto timeline with each turn's wall-clock span (trace.json), the configuration
(config.json) and the measured steps (steps.json). The prediction replays each batch's
trajectories on simulated engines of the same layout: one engine per live instance, the built-in
engine's model on `cpu-host` with the `libra-builtin` preset (fitted to the engine's own steps,
`libra costmodel profile --model builtin-tiny --device cpu`), each turn on the instance that ran
it live, a trajectory starting when it started live and waiting, between turns, as long as its
tool call took live (the actions service is not simulated). The training step is priced by the
training cost model on the same CPU, and a step by the asynchronous pipeline's rule
(max(train + publish, rollout)). Of the run's own timings only its tool waits, its batches' start
offsets and its weight-publication time (the broadcast to the engines, which the simulator does not
model for the CPU) enter the prediction.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from libra.core.config import read_text_file
from libra.core.errors import ConfigError
from libra.costmodel.catalog import Catalog, load_catalog
from libra.costmodel.efficiency import RolloutEfficiency, load_profile
from libra.costmodel.rollout import RolloutCostModel
from libra.costmodel.training import TrainCostModel, TrainParallel
from libra.sim.engine import Engine, KVPolicy, Seq
from libra.sim.kernel import Kernel

ENGINE = "libra-builtin"
HARDWARE = "cpu-host"
BUILTIN_MAX_BATCHED_TOKENS = 512  # the built-in engine's default max_num_batched_tokens


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


@dataclass(slots=True)
class LiveRun:
    config: dict
    steps: list[dict]
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


def load_run(folder: str | Path) -> LiveRun:
    """Read the run folder; turns are timed from the timeline's spans of the same turn."""
    folder = Path(folder)
    spans = {}
    for ev in _json(folder / "trace.json").get("traceEvents", []):  # type: ignore[union-attr]
        name = ev.get("name", "")
        if " turn " in name and ev.get("ph") == "X":
            spans[name] = (ev["ts"] / 1e6, (ev["ts"] + ev["dur"]) / 1e6)
    trajs = []
    path = folder / "trajectories.jsonl"
    if not path.is_file():
        raise ConfigError("--live", str(folder), "a run with trajectories.jsonl (save_trajectories: true)")
    for line in read_text_file(path).splitlines():
        rec = json.loads(line)
        t = LiveTraj(rec["step"], rec["batch"], rec["id"])
        for k, turn in enumerate(rec["turns"]):
            start, end = spans.get(f"{rec['id']} turn {k}", (0.0, 0.0))
            t.turns.append(
                LiveTurn(len(turn["prompt_ids"]), len(turn["token_ids"]), turn["instance"], start, end)
            )
        if t.turns and all(x.end > 0 for x in t.turns):
            trajs.append(t)
    if not trajs:
        raise ConfigError("--live", str(folder), "a run with trajectories.jsonl (save_trajectories: true)")
    return LiveRun(_json(folder / "config.json"), _json(folder / "steps.json"), trajs)  # type: ignore[arg-type]


def _engines(run: LiveRun, k: Kernel, catalog: Catalog, eff: RolloutEfficiency) -> dict[str, Engine]:
    ecfg = run.config["engine"]
    model = catalog.model(f"builtin-{ecfg['model']}")
    cost = RolloutCostModel(catalog.hardware(HARDWARE), model, 1, eff, 1.0, BUILTIN_MAX_BATCHED_TOKENS, ENGINE,
                            ecfg["max_num_seqs"])  # fmt: skip
    out = {}
    for inst in sorted({x.instance for t in run.trajs for x in t.turns}):
        eng = Engine(k, inst, cost, ecfg["max_num_seqs"], BUILTIN_MAX_BATCHED_TOKENS, KVPolicy.DROP)
        eng.kv_cap = int(
            ecfg["kv_cache_mb"] * 2**20 // model.kv_bytes_per_token
        )  # the engine's --kv-cache-mb
        out[inst] = eng
    return out


def batch_makespan(
    trajs: list[LiveTraj], engines_of, catalog: Catalog, eff: RolloutEfficiency, run: LiveRun
) -> float:
    """Simulated seconds from the batch's first turn to its last, turns on their live instances."""
    k = Kernel(0)
    engines = engines_of(run, k, catalog, eff)
    t0 = min(t.turns[0].start for t in trajs)
    ends: list[float] = []

    def submit(traj: LiveTraj, i: int) -> None:
        turn = traj.turns[i]

        def done(seq: Seq) -> None:
            if i + 1 < len(traj.turns):
                k.after(max(0.0, traj.turns[i + 1].start - turn.end), submit, traj, i + 1)
            else:
                ends.append(k.now)

        engines[turn.instance].submit(Seq(traj.id, max(1, turn.prompt), max(1, turn.sampled), on_done=done))

    for traj in trajs:
        k.at(traj.turns[0].start - t0, submit, traj, 0)
    k.run()
    return max(ends)


def measured_makespan(trajs: list[LiveTraj]) -> float:
    return max(t.turns[-1].end for t in trajs) - min(t.turns[0].start for t in trajs)


@dataclass(slots=True)
class LivePrediction:
    rollout: tuple[float, float]  # (measured, predicted) mean batch makespan, seconds
    train: tuple[float, float]  # mean training step
    step: tuple[float, float]  # mean step time
    steps: int

    def errors(self) -> dict:
        err = lambda p: (p[1] - p[0]) / p[0]  # noqa: E731
        return {"step_err": err(self.step), "rollout_err": err(self.rollout), "train_err": err(self.train),
                "measured": {"step_s": self.step[0], "rollout_s": self.rollout[0], "train_s": self.train[0]},
                "predicted": {"step_s": self.step[1], "rollout_s": self.rollout[1], "train_s": self.train[1]},
                "steps": self.steps}  # fmt: skip


def train_time(run: LiveRun, trajs: list[LiveTraj], catalog: Catalog, profile) -> float:
    """One GRPO step of the batch's trajectories on the trainer replicas (data parallel)."""
    model = catalog.model(f"builtin-{run.config['engine']['model']}")
    lens = [t.turns[-1].prompt + t.turns[-1].sampled for t in trajs]
    par = TrainParallel(dp=run.config["trainer"]["replicas"], recompute=False)
    return TrainCostModel(catalog.hardware(HARDWARE), model, profile.train).step(par, lens).step_time_s


def predict_live(folder: str | Path, profile_path: str | Path | None = None) -> LivePrediction:
    run, catalog = load_run(folder), load_catalog()
    profile = load_profile(profile_path)
    batches = {b: ts for b, ts in run.batches().items() if b < len(run.steps)}
    meas_roll = [measured_makespan(ts) for ts in batches.values()]
    pred_roll = [batch_makespan(ts, _engines, catalog, profile.rollout, run) for ts in batches.values()]
    pred_train = [train_time(run, ts, catalog, profile) for ts in batches.values()]
    publish = statistics.fmean(r["publish_s"] for r in run.steps)
    pred_step = [max(t + publish, r) for t, r in zip(pred_train, pred_roll, strict=True)]
    return LivePrediction(
        (statistics.fmean(meas_roll), statistics.fmean(pred_roll)),
        (statistics.fmean(r["train_s"] for r in run.steps), statistics.fmean(pred_train)),
        (statistics.fmean(r["step_time_s"] for r in run.steps), statistics.fmean(pred_step)),
        len(run.steps),
    )

"""Fit the cost model's efficiency coefficients to measurements.

Input is JSONL, one measured engine iteration per line:
    {"hardware": "a800-80g", "model": "qwen3-14b", "tp": 1, "prefill_tokens": 0,
     "prefill_attn": 0, "decode_seqs": 64, "decode_ctx": 65536, "step_time_s": 0.031}
(`prefill_attn` is optional and defaults to a fresh prefill: n*(n+1)/2.) Optional `engine` names the
engine preset (default vllm-v1). The fit minimises the mean squared log error with a Nelder-Mead
search over the log of each coefficient, so every coefficient stays positive and fractions are
clipped to (0, 1]. GPU terms (`bw`, `compute`, ...) are fitted for every GPU type in the data,
CPU terms (`base_overhead_s`, ...) for the engine preset. No scipy: the core stays light.

Training steps (`--train-data`) are JSONL too, one measured optimizer step of one replica a line:
    {"hardware": "cpu-host", "model": "builtin-tiny", "seq_lens": [280, 280, ...],
     "micro_batch_tokens": 8192, "step_time_s": 1.1}
and fit the training cost model's `mfu` and `per_microbatch_overhead_s` the same way.

The built-in engine served over HTTP (`--serving-data`, `libra.runtime.serving_profile`) is JSONL
too, a workload a line: its trajectories' turns, the engine process's CPU seconds and its engine
thread's in steps, or a run of weight updates; the CPU outside the steps is fitted per request and
per generated token (`fit_serving`), and a weight update's CPU is measured directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from libra.core.errors import ConfigError
from libra.core.trace import MAX_TOKENS, build_line, json_lines
from libra.costmodel.catalog import Catalog
from libra.costmodel.efficiency import DEFAULT_ENGINE, FRACTIONS, RolloutEfficiency, TrainEfficiency
from libra.costmodel.rollout import RolloutCostModel
from libra.costmodel.training import TrainCostModel, TrainParallel, sequences_per_micro_batch

FIT_FIELDS = ("bw", "compute", "base_overhead_s", "per_seq_overhead_s")


def nelder_mead(
    f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.3, iters: int = 600
) -> np.ndarray:
    """Minimise f from x0 (plain Nelder-Mead; enough for a handful of smooth coefficients)."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(vals)
        simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = f(xe)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                vals = [f(x) for x in simplex]
        if max(vals) - min(vals) < 1e-12:
            break
    return simplex[int(np.argmin(vals))]


def _with(base: RolloutEfficiency, fields: Sequence[str], logx: np.ndarray, hardware: Sequence[str],
          engine: str) -> RolloutEfficiency:  # fmt: skip
    """`base` with the fitted values: GPU terms for each of `hardware`, CPU terms for `engine`."""
    upd = {}
    for name, lx in zip(fields, logx, strict=True):
        v = math.exp(lx)
        upd[name] = min(v, 1.0) if name in FRACTIONS else v
    out = base
    for hw in hardware:
        out = out.updated(hw, engine, upd)
    return out


# Where a term that is zero today starts its fit. The search runs on the log of each term with
# steps of about 0.3, so a start at ~0 (a shipped per-sequence term of 0.0) would sit 10+ nats from
# any real value and never leave: 10 us is the scale of every CPU and per-layer term we fit.
START_FLOOR_S = 1e-5


def start(base: RolloutEfficiency, fields: Sequence[str], hardware: str, engine: str) -> np.ndarray:
    """The log of each field's current value (at least START_FLOOR_S): where a fit starts."""
    gpu, eng = base.gpu(hardware), base.engine(engine)
    return np.log(np.array([max(getattr(gpu if hasattr(gpu, f) else eng, f), START_FLOOR_S) for f in fields]))


class Measurement(BaseModel):
    """One line of the input (module docstring). Bounds are those of a real engine iteration."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")
    hardware: str
    model: str
    tp: int = Field(ge=1, le=64)
    decode_seqs: int = Field(ge=0, le=1 << 16)
    step_time_s: float = Field(gt=0)
    prefill_tokens: int = Field(0, ge=0, le=1 << 20)
    prefill_attn: float | None = Field(None, ge=0)
    decode_ctx: float = Field(0, ge=0, le=MAX_TOKENS)
    engine: str = DEFAULT_ENGINE
    # Beside how many busy processes it was timed, and the share of a core it got (the profile's
    # contended runs; `fit_contention`).
    co_runners: int = Field(0, ge=0, le=1024)
    share: float | None = Field(None, gt=0, le=1)
    probe_s: float | None = Field(None, gt=0, le=1e3)  # the host's speed before its batch


def read_measurements(path: str | Path) -> list[dict]:
    recs = []
    for n, r in json_lines(Path(path)):
        recs.append(build_line(Measurement, r, path, n).model_dump())
    if not recs:
        raise ConfigError("data", str(path), "a JSONL file with at least one measurement")
    return recs


def _predict(recs: list[dict], catalog: Catalog, eff: RolloutEfficiency) -> np.ndarray:
    models: dict[tuple, RolloutCostModel] = {}
    out = []
    for r in recs:
        key = (r["hardware"], r["model"], int(r["tp"]), r.get("engine", DEFAULT_ENGINE))
        if key not in models:
            hw, model = catalog.hardware(key[0]), catalog.model(key[1])
            models[key] = RolloutCostModel(hw, model, key[2], eff, engine=key[3])
        p = int(r.get("prefill_tokens", 0))
        attn = r.get("prefill_attn")
        attn = float(p * (p + 1) / 2 if attn is None else attn)
        out.append(models[key].step_time(p, attn, int(r["decode_seqs"]), float(r.get("decode_ctx", 0))))
    return np.array(out)


def fit_rollout(
    recs: list[dict],
    catalog: Catalog,
    base: RolloutEfficiency | None = None,
    fields: Sequence[str] = FIT_FIELDS,
) -> tuple[RolloutEfficiency, float]:
    """Return the fitted coefficients and the mean absolute percentage error after the fit."""
    base = base or RolloutEfficiency()
    y = np.log(np.array([r["step_time_s"] for r in recs]))
    hardware = sorted({r["hardware"] for r in recs})
    engines = sorted({r.get("engine", DEFAULT_ENGINE) for r in recs})
    if len(engines) > 1:
        raise ConfigError("engine", engines, "one engine preset per fit")
    for hw in hardware:
        catalog.hardware(hw)
    base.engine(engines[0])

    def fitted(logx: np.ndarray) -> RolloutEfficiency:
        return _with(base, fields, logx, hardware, engines[0])

    def loss(logx: np.ndarray) -> float:
        pred = _predict(recs, catalog, fitted(logx))
        return float(np.mean((np.log(np.maximum(pred, 1e-12)) - y) ** 2))

    best = fitted(nelder_mead(loss, start(base, fields, hardware[0], engines[0])))
    pred = _predict(recs, catalog, best)
    mape = float(np.mean(np.abs(pred - np.exp(y)) / np.exp(y)))
    return best, mape


def fit_contention(
    recs: list[dict], catalog: Catalog, eff: RolloutEfficiency
) -> tuple[tuple[float, float], ...]:
    """The (share, factor) points of `EngineOverhead.contention`: for the steps timed beside each
    number of busy processes, the share of a core they got (median) and their CPU seconds over
    what `eff` prices them at; made non-increasing in share (pooling adjacent points that are not:
    a busier core never costs fewer CPU seconds, and the host's other work varies between runs).
    Empty when the steps were timed beside one number of busy processes only."""
    by_k: dict[int, list[dict]] = {}
    for r in recs:
        if r.get("share") is not None:
            by_k.setdefault(int(r["co_runners"]), []).append(r)
    if len(by_k) < 2:
        return ()
    pts = []  # [share, CPU seconds, priced seconds], by share
    for group in by_k.values():
        share = float(np.median([r["share"] for r in group]))
        pts.append(
            [share, sum(r["step_time_s"] for r in group), float(np.sum(_predict(group, catalog, eff)))]
        )
    pts.sort()
    pooled: list[list] = []  # pool adjacent violators: [[shares], CPU, priced]
    for share, cpu, priced in pts:
        pooled.append([[share], cpu, priced])
        while len(pooled) > 1 and pooled[-2][1] / pooled[-2][2] < pooled[-1][1] / pooled[-1][2]:
            last = pooled.pop()
            pooled[-1] = [pooled[-1][0] + last[0], pooled[-1][1] + last[1], pooled[-1][2] + last[2]]
    out = {round(s, 4): round(cpu / priced, 4) for shares, cpu, priced in pooled for s in shares}
    return tuple(sorted(out.items()))


# ---- training steps --------------------------------------------------------------------------------

TRAIN_FIT = ("mfu", "per_microbatch_overhead_s")


class TrainMeasurement(BaseModel):
    """One line of `--train-data` (module docstring): one replica's optimizer step."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")
    hardware: str
    model: str
    seq_lens: list[Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = Field(min_length=1, max_length=1 << 16)
    micro_batch_tokens: int = Field(8192, ge=1, le=MAX_TOKENS)
    step_time_s: float = Field(gt=0)


def read_train_measurements(path: str | Path) -> list[TrainMeasurement]:
    recs = [build_line(TrainMeasurement, r, path, n) for n, r in json_lines(Path(path))]
    if not recs:
        raise ConfigError("train-data", str(path), "a JSONL file with at least one training step")
    return recs


def predict_train(recs: Sequence[TrainMeasurement], catalog: Catalog, eff: TrainEfficiency) -> np.ndarray:
    """The training cost model's step time for each measured step (one replica, no recompute)."""
    out = []
    for r in recs:
        cm = TrainCostModel(catalog.hardware(r.hardware), catalog.model(r.model), eff)
        par = TrainParallel(
            micro_batch=sequences_per_micro_batch(r.seq_lens, r.micro_batch_tokens), recompute=False
        )
        out.append(cm.step(par, r.seq_lens).step_time_s)
    return np.array(out)


def fit_train(
    recs: Sequence[TrainMeasurement], catalog: Catalog, base: TrainEfficiency | None = None
) -> tuple[TrainEfficiency, float]:
    """Fit `mfu` and the per-micro-batch overhead; return them and the MAPE after the fit."""
    base = base or TrainEfficiency()
    y = np.log(np.array([r.step_time_s for r in recs]))

    def fitted(logx: np.ndarray) -> TrainEfficiency:
        mfu, per_mb = (math.exp(v) for v in logx)
        return base.model_copy(update={"mfu": min(mfu, 1.0), "per_microbatch_overhead_s": per_mb})

    def loss(logx: np.ndarray) -> float:
        return float(
            np.mean((np.log(np.maximum(predict_train(recs, catalog, fitted(logx)), 1e-12)) - y) ** 2)
        )

    x0 = np.log([base.mfu, max(base.per_microbatch_overhead_s, START_FLOOR_S)])
    best = fitted(nelder_mead(loss, x0))
    pred = predict_train(recs, catalog, best)
    return best, float(np.mean(np.abs(pred - np.exp(y)) / np.exp(y)))


# ---- the engine's CPU outside its steps (`--serving-data`) -----------------------------------------

SERVING_FIT = ("request_cpu_s", "token_cpu_s", "weight_load_cpu_s")
Turn = tuple[Annotated[int, Field(ge=0, le=MAX_TOKENS)], Annotated[int, Field(ge=0, le=MAX_TOKENS)]]


class ServingMeasurement(BaseModel):
    """One line of `--serving-data` (`libra.runtime.serving_profile`): a workload the built-in
    engine served over HTTP, or a run of weight updates, and its process's CPU seconds."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")
    kind: Literal["chat", "weights"]
    hardware: str
    model: str
    engine: str = DEFAULT_ENGINE
    max_num_seqs: int = Field(64, ge=1, le=16384)
    kv_cache_mb: int = Field(32, ge=1, le=1 << 20)
    cpu_s: float = Field(gt=0, le=1e6)
    step_cpu_s: float = Field(0.0, ge=0, le=1e6)  # the engine thread's, in steps
    # chat: each trajectory's turns as [prompt tokens, sampled tokens]; weights: how many updates
    trajectories: list[Annotated[list[Turn], Field(min_length=1, max_length=64)]] = Field([], max_length=4096)
    loads: int = Field(0, ge=0, le=1 << 20)

    @model_validator(mode="after")
    def _complete(self) -> ServingMeasurement:
        if self.kind == "chat" and not (self.trajectories and 0 < self.step_cpu_s <= self.cpu_s):
            raise ValueError(
                "a chat workload needs its trajectories and its steps' CPU (0 < step_cpu_s <= cpu_s)"
            )
        if self.kind == "weights" and not self.loads:
            raise ValueError("a weights record needs loads >= 1")
        return self

    @property
    def requests(self) -> int:
        return sum(len(t) for t in self.trajectories)

    @property
    def tokens(self) -> int:
        return sum(max(1, s) for t in self.trajectories for _, s in t)


def read_serving_measurements(path: str | Path) -> list[ServingMeasurement]:
    recs = [build_line(ServingMeasurement, r, path, n) for n, r in json_lines(Path(path))]
    if not [r for r in recs if r.kind == "chat"] or not [r for r in recs if r.kind == "weights"]:
        raise ConfigError("serving-data", str(path), "a JSONL file with chat workloads and a weights record")
    if len({(r.hardware, r.model, r.engine) for r in recs}) > 1:
        raise ConfigError("serving-data", str(path), "one hardware, model and engine for every line")
    return recs


@dataclass(frozen=True, slots=True)
class ServingFit:
    """The engine's CPU terms outside its steps, and how well the priced steps alone, and the
    priced steps with the terms, account for the chat workloads' measured CPU (mean absolute
    relative error), and the engine thread's measured step CPU over the priced steps."""

    request_cpu_s: float
    token_cpu_s: float
    weight_load_cpu_s: float
    workloads: int
    outside_steps: float  # the share of the workloads' CPU outside the engine thread's steps
    steps_only_mape: float
    mape: float
    steps_measured_vs_priced: float


def fit_serving(recs: Sequence[ServingMeasurement], priced_steps: Sequence[float]) -> ServingFit:
    """Fit the process's CPU beyond its priced steps as request_cpu_s * requests + token_cpu_s *
    tokens over the chat workloads (least squares on the error relative to the process's CPU,
    both terms >= 0); `weight_load_cpu_s` is the weights records' CPU per update.
    `priced_steps[i]` is the step CPU the simulated engine prices for chat workload i
    (`libra.sim.rl.live.profile_step_cpu_s`, the step terms fitted in process): with the terms,
    the whole process's CPU as the live prediction prices it. Beyond the priced steps, not
    outside the measured ones: a served decode step costs 1.3-1.9x what the same step costs in
    process (each token's logprob, token id and tool-call grammar; docs/fidelity.md), and that
    is per token as well."""
    chats = [r for r in recs if r.kind == "chat"]
    if len(priced_steps) != len(chats):
        raise ValueError("one priced step CPU per chat workload")
    y = np.array([r.cpu_s for r in chats])
    steps = np.array([r.step_cpu_s for r in chats])
    p = np.array(priced_steps, dtype=float)
    x = np.array([[r.requests, r.tokens] for r in chats], dtype=float)
    a, b = _nonneg_lsq(x / y[:, None], (y - p) / y)
    pred = p + x @ np.array([a, b])
    loads = [r for r in recs if r.kind == "weights"]
    return ServingFit(
        float(a), float(b), sum(r.cpu_s for r in loads) / sum(r.loads for r in loads), len(chats),
        float(1 - steps.sum() / y.sum()), float(np.mean(np.abs(p - y) / y)), float(np.mean(np.abs(pred - y) / y)),
        float(steps.sum() / p.sum()),
    )  # fmt: skip


def _nonneg_lsq(x: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """min |x c - y|^2 with every c >= 0, for a few columns: the best over the subsets of columns
    whose unconstrained fit is nonnegative."""
    n, best, best_err = x.shape[1], (0.0,) * x.shape[1], float(np.sum(y**2))
    for mask in range(1, 2**n):
        cols = [i for i in range(n) if mask >> i & 1]
        c = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
        if (c < 0).any():
            continue
        err = float(np.sum((x[:, cols] @ c - y) ** 2))
        if err < best_err:
            full = [0.0] * n
            for i, v in zip(cols, c, strict=True):
                full[i] = float(v)
            best, best_err = tuple(full), err
    return best

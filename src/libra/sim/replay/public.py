"""Replay public vLLM measurements on the simulated engine: the cost model's out-of-sample check.

`public_figures.yaml` (beside this module) lists each published figure with its source: vLLM's
`benchmark_latency` runs (a batch of prompts at once, the time until all are done) and
`benchmark_serving` runs at request rate inf (per-request token counts, the run's duration). Each
is played on one simulated engine built from the catalog, the measured GPU terms and the figure's
engine preset, and compared with the published value. Nothing here is fitted per figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from libra.core.config import build, load_yaml
from libra.costmodel.catalog import Catalog
from libra.costmodel.efficiency import RolloutEfficiency
from libra.costmodel.rollout import RolloutCostModel
from libra.sim.engine import Engine, Seq
from libra.sim.kernel import Kernel

FIGURES = Path(__file__).with_name("public_figures.yaml")


class Figure(BaseModel):
    """One published measurement and the run that produced it."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)
    id: str
    source: str
    engine: str
    hardware: str
    model: str
    tp: int = Field(ge=1, le=64)
    kind: Literal["latency", "serving"]
    value: float = Field(gt=0, description="seconds: the batch's latency, or the serving run's duration")
    custom_allreduce: bool = True
    batch: int = Field(1, ge=1)
    input: int = Field(1, ge=1)
    output: int = Field(1, ge=1)
    inputs: list[int] = Field(default_factory=list)
    outputs: list[int] = Field(default_factory=list)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)

    def requests(self) -> list[tuple[int, int]]:
        if self.kind == "latency":
            return [(self.input, self.output)] * self.batch
        return [
            (i, max(1, o)) for i, o in zip(self.inputs, self.outputs, strict=True)
        ]  # 0: one token, empty text


@dataclass(frozen=True, slots=True)
class Result:
    figure: Figure
    simulated: float

    @property
    def error(self) -> float:
        return (self.simulated - self.figure.value) / self.figure.value


def load_figures(path: str | Path = FIGURES) -> list[Figure]:
    data = load_yaml(path)
    return [
        build(Figure, rec, f"{Path(path).name}: figures[{i}]")
        for i, rec in enumerate(data.get("figures", []))
    ]


def _variant(eff: RolloutEfficiency, fig: Figure) -> tuple[RolloutEfficiency, str]:
    """The figure's engine preset, with the engine's own all-reduce off where the run had it off."""
    if fig.custom_allreduce:
        return eff, fig.engine
    name = f"{fig.engine}+nccl"
    eng = eff.engine(fig.engine).model_copy(update={"custom_allreduce": False})
    return eff.model_copy(update={"engines": {**eff.engines, name: eng}}), name


def simulate(fig: Figure, catalog: Catalog, eff: RolloutEfficiency | None = None) -> Result:
    """Every request arrives at once; the result is the time until the last one is done."""
    eff, engine = _variant(eff or RolloutEfficiency(), fig)
    cost = RolloutCostModel(catalog.hardware(fig.hardware), catalog.model(fig.model), fig.tp, eff,
                            fig.gpu_memory_utilization, fig.max_num_batched_tokens, engine, fig.max_num_seqs)  # fmt: skip
    k = Kernel(0)
    eng = Engine(k, fig.id, cost, fig.max_num_seqs, fig.max_num_batched_tokens)
    seqs = [Seq(i, ctx, out) for i, (ctx, out) in enumerate(fig.requests())]
    for s in seqs:
        eng.submit(s)
    k.run()
    return Result(fig, max(s.t_done for s in seqs))


def replay_all(
    catalog: Catalog, eff: RolloutEfficiency | None = None, figures: list[Figure] | None = None
) -> list[Result]:
    return [simulate(f, catalog, eff) for f in (figures if figures is not None else load_figures())]


def mape(results: list[Result]) -> float:
    return sum(abs(r.error) for r in results) / len(results)


def fit_engine(catalog: Catalog, engine: str, fields: tuple[str, ...], base: RolloutEfficiency | None = None,
               figures: list[Figure] | None = None) -> RolloutEfficiency:  # fmt: skip
    """Fit an engine preset's CPU terms to the figures that name it (squared log error)."""
    import numpy as np

    from libra.costmodel.calibrate import _with, nelder_mead, start

    base = base or RolloutEfficiency()
    figs = [f for f in (figures if figures is not None else load_figures()) if f.engine == engine]
    hardware = sorted({f.hardware for f in figs})

    def fitted(logx: np.ndarray) -> RolloutEfficiency:
        return _with(base, fields, logx, hardware, engine)

    def loss(logx: np.ndarray) -> float:
        res = replay_all(catalog, fitted(logx), figs)
        return sum(float(np.log(r.simulated / r.figure.value)) ** 2 for r in res)

    x0 = start(base, fields, hardware[0], engine)
    return fitted(nelder_mead(loss, nelder_mead(loss, x0, step=0.5, iters=300), step=0.2, iters=300))

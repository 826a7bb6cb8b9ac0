"""Replay a real vLLM benchmark on one simulated engine, and compare latencies.

The folder format is described in the shared data README: `meta.json` (engine arguments),
`config.json` (hardware), `requests.jsonl` (arrivals, token counts and the engine's timestamps).
The model and hardware are looked up in the catalog by name, so the replay uses spec-sheet numbers
and whatever efficiency profile is given: nothing is fitted per trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from libra.core.config import build, read_text_file
from libra.core.errors import ConfigError, TraceError
from libra.core.trace import MAX_TOKENS, build_line, json_lines
from libra.costmodel.catalog import Catalog
from libra.costmodel.efficiency import RolloutEfficiency
from libra.costmodel.rollout import RolloutCostModel
from libra.sim.engine import Engine, Seq
from libra.sim.kernel import Kernel

METRICS = ("ttft", "tpot", "latency")
STATS = {
    "mean": np.mean,
    "median": np.median,
    "p90": lambda a: np.percentile(a, 90),
    "p99": lambda a: np.percentile(a, 99),
}


@dataclass(slots=True)
class Bench:
    hardware: str
    model: str
    tp: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    requests: list[dict]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(read_text_file(path))
    except OSError as e:
        raise ConfigError(
            "dir", str(path.parent), f"a vLLM bench folder with {path.name} ({e.strerror})"
        ) from None
    except json.JSONDecodeError as e:
        raise TraceError(str(path), e.lineno, "<file>", f"is not valid JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:  # not UTF-8, not a regular file, nested too deep
        raise TraceError(str(path), 0, "<file>", f"is not a JSON text file ({str(e)[:200]})") from None


def _match(names: dict, wanted: str, field: str, key=lambda spec: spec.source) -> str:
    norm = wanted.lower().replace("_", "-")
    for name, spec in names.items():
        if (
            name == norm
            or (key(spec) or "").lower() == wanted.lower()
            or name.replace("-", "") == norm.replace("-", "")
        ):
            return name
    raise ConfigError(field, wanted, names.keys())


# What the replay reads from the folder, typed, so a bad value is one line naming its field. The
# bounds are those of a real engine (libra.core.trace.MAX_TOKENS for token counts); other keys of
# the files are not read and not checked.
class _Lenient(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class _EngineKwargs(_Lenient):
    model: str | None = None
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    max_num_seqs: int | None = Field(None, ge=1, le=16384)
    max_num_batched_tokens: int | None = Field(None, ge=1, le=1 << 20)


class _Meta(_Lenient):
    model: str = ""
    engine_kwargs: _EngineKwargs = _EngineKwargs()


class _NpuMem(_Lenient):
    mem_util: float = Field(0.9, gt=0, le=1)


class _Instance(_Lenient):
    hardware: str
    npu_mem: _NpuMem = _NpuMem()


class _Node(_Lenient):
    instances: list[_Instance] = Field(min_length=1)


class _Config(_Lenient):
    nodes: list[_Node] = Field(min_length=1)


class _Request(_Lenient):
    input_toks: int = Field(ge=0, le=MAX_TOKENS)
    output_toks: int = Field(ge=0, le=MAX_TOKENS)
    arrival_time: float = Field(ge=0)
    queued_ts: float
    first_token_ts: float
    last_token_ts: float


def load_bench(folder: str | Path, catalog: Catalog) -> Bench:
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError("dir", str(folder), "a folder with meta.json, config.json and requests.jsonl")
    meta = build(_Meta, _read_json(folder / "meta.json"), "meta.json")
    inst = build(_Config, _read_json(folder / "config.json"), "config.json").nodes[0].instances[0]
    kw = meta.engine_kwargs
    hw = _match(catalog.hardware_specs, inst.hardware, "config.json: hardware", key=lambda s: "")
    model = _match(catalog.model_specs, kw.model or meta.model, "meta.json: model")
    reqs = _read_requests(folder / "requests.jsonl")
    return Bench(hw, model, kw.tensor_parallel_size, kw.max_num_seqs or 256, kw.max_num_batched_tokens or 8192,
                 inst.npu_mem.mem_util, reqs)  # fmt: skip


def _read_requests(path: Path) -> list[dict]:
    out = []
    for n, r in json_lines(path):
        out.append(build_line(_Request, r, path, n).model_dump())
    if not out:
        raise TraceError(str(path), 0, "<file>", "holds no requests")
    if not any(r["output_toks"] > 1 for r in out):  # TPOT is measured between output tokens
        raise TraceError(str(path), 0, "output_toks", "must be more than 1 in at least one request")
    return out


def measured(bench: Bench) -> dict[str, np.ndarray]:
    r = bench.requests
    q = np.array([x["queued_ts"] for x in r])
    first = np.array([x["first_token_ts"] for x in r])
    last = np.array([x["last_token_ts"] for x in r])
    out = np.array([x["output_toks"] for x in r])
    keep = out > 1
    return {"ttft": first - q, "latency": last - q, "tpot": ((last - first)[keep] / (out[keep] - 1))}


def simulate(bench: Bench, catalog: Catalog, eff: RolloutEfficiency | None = None) -> dict[str, np.ndarray]:
    hw, model = catalog.hardware(bench.hardware), catalog.model(bench.model)
    cost = RolloutCostModel(
        hw, model, bench.tp, eff, bench.gpu_memory_utilization, bench.max_num_batched_tokens
    )
    _check_fits(bench, cost)
    k = Kernel(0)
    eng = Engine(k, "replay", cost, bench.max_num_seqs, bench.max_num_batched_tokens)
    t0 = min(r["arrival_time"] for r in bench.requests)
    seqs = []
    for i, r in enumerate(bench.requests):
        s = Seq(i, max(1, int(r["input_toks"])), max(1, int(r["output_toks"])))
        seqs.append(s)
        k.at(r["arrival_time"] - t0, eng.submit, s)
    k.run()
    out = np.array([s.out_total for s in seqs])
    first, done, sub = (np.array([getattr(s, a) for s in seqs]) for a in ("t_first", "t_done", "t_submit"))
    keep = out > 1
    return {"ttft": first - sub, "latency": done - sub, "tpot": (done - first)[keep] / (out[keep] - 1)}


def _check_fits(bench: Bench, cost: RolloutCostModel) -> None:
    """The engine the folder describes must hold its longest request: else it is an input error
    naming what to change, not a simulated engine that stalls."""
    hw = cost.hw
    if bench.tp > hw.gpus_per_node:
        raise ConfigError("meta.json: engine_kwargs.tensor_parallel_size", bench.tp,
                          f"<= gpus_per_node ({hw.gpus_per_node}) of {hw.name}")  # fmt: skip
    cap = cost.kv_capacity_tokens()
    i = max(range(len(bench.requests)), key=lambda j: bench.requests[j]["input_toks"] + bench.requests[j]["output_toks"])  # fmt: skip
    need = bench.requests[i]["input_toks"] + bench.requests[i]["output_toks"]
    if need > cap:
        where = f"{bench.model} at TP{bench.tp} on {hw.name} with mem_util {bench.gpu_memory_utilization:g}"
        if cap == 0:
            raise ConfigError("config.json: npu_mem.mem_util", bench.gpu_memory_utilization,
                              f"room for the weights and a KV cache ({where} leaves none)")  # fmt: skip
        raise ConfigError(f"requests.jsonl: request {i}", f"{need} tokens (input + output)",
                          f"at most the KV cache's {cap} tokens ({where})")  # fmt: skip


def summarize(arrs: dict[str, np.ndarray]) -> dict[str, float]:
    return {f"{m}_{s}": float(f(arrs[m])) for m in METRICS for s, f in STATS.items()}


def compare(bench: Bench, catalog: Catalog, eff: RolloutEfficiency | None = None) -> dict:
    real, sim = summarize(measured(bench)), summarize(simulate(bench, catalog, eff))
    keys = ("ttft_mean", "latency_mean", "latency_p90", "tpot_mean")
    return {"measured": real, "simulated": sim, "error": {k: (sim[k] - real[k]) / real[k] for k in keys}}


FIT_KEYS = ("latency_mean", "latency_p90", "ttft_mean", "tpot_mean")


def calibrate(bench: Bench, catalog: Catalog, base: RolloutEfficiency | None = None,
              fields: tuple[str, ...] = ("bw", "compute", "base_overhead_s", "per_seq_overhead_s")) -> tuple[RolloutEfficiency, dict]:  # fmt: skip
    """Fit efficiency coefficients so the replay matches the measured latencies of `bench`.

    Minimises the squared log-ratio of simulated to measured latency mean and p90, TTFT mean and
    TPOT mean, with Nelder-Mead over the log of each coefficient (fractions clipped to 1).
    """
    from libra.costmodel.calibrate import _with, nelder_mead

    base = base or RolloutEfficiency()
    real = summarize(measured(bench))

    def loss(logx: np.ndarray) -> float:
        sim = summarize(simulate(bench, catalog, _with(base, fields, logx)))
        return float(sum(np.log(sim[k] / real[k]) ** 2 for k in FIT_KEYS))

    x0 = np.log(np.array([getattr(base, f) for f in fields]))
    best = _with(base, fields, nelder_mead(loss, x0, step=0.2, iters=150))
    return best, compare(bench, catalog, best)["error"]

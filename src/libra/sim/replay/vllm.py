"""Replay a real vLLM benchmark on simulated engines, and compare latencies.

The folder format is described in the shared data README: `meta.json` (engine arguments, and in
newer runs the KV cache vLLM allocated), `config.json` (hardware and the engine layout),
`requests.jsonl` (arrivals, token counts and the engine's timestamps). Every instance of the
layout is simulated: data-parallel ranks each run their own engine behind vLLM's load balancer,
and a mixture-of-experts model served with expert parallelism splits its experts over the ranks
(`RolloutCostModel(..., ep=...)`), its ranks stepping together (`LockstepGroup`). The model and
hardware are looked up in the catalog by name, so the replay uses spec-sheet numbers, the measured
GPU terms and an engine preset: nothing is fitted per trace. Where meta.json records the KV cache
vLLM allocated, the engines run on it and the cost model's own (vLLM's memory profile, term by
term, from the run's vLLM version) is reported beside it; where it records vLLM's preemption
counter, each rank's simulated count is reported beside it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from libra.core.config import build, read_text_file
from libra.core.errors import ConfigError, TraceError
from libra.core.specs import GIB
from libra.core.trace import MAX_TOKENS, build_line, json_lines
from libra.costmodel.catalog import Catalog
from libra.costmodel.efficiency import DEFAULT_ENGINE, RolloutEfficiency
from libra.costmodel.rollout import RolloutCostModel
from libra.sim.engine import Engine, LockstepGroup, Seq
from libra.sim.kernel import Kernel

METRICS = ("ttft", "tpot", "latency")
STATS = {
    "mean": np.mean,
    "median": np.median,
    "p90": lambda a: np.percentile(a, 90),
    "p99": lambda a: np.percentile(a, 99),
}
MAX_RANKS = 64  # data-parallel ranks of one benchmark: past this a value is surely a typo


@dataclass(slots=True)
class Rank:
    """One engine instance of the layout (a data-parallel rank)."""

    hardware: str
    tp: int
    ep: int
    gpu_memory_utilization: float


@dataclass(slots=True)
class Bench:
    model: str
    ranks: list[Rank]
    max_num_seqs: int
    max_num_batched_tokens: int
    requests: list[dict]
    dtype: str = ""  # the weight dtype a model-name suffix notes (`-FP8`)
    vllm_kv_tokens: int | None = None  # per rank, when meta.json reports what vLLM allocated
    vllm_version: tuple[int, ...] | None = None  # meta.json's vllm_version, when recorded
    vllm_preemptions: list[int] | None = None  # per rank (or one total), when meta.json has them

    @property
    def hardware(self) -> str:
        return self.ranks[0].hardware

    @property
    def tp(self) -> int:
        return self.ranks[0].tp


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


def _match(names: dict, wanted: str, field: str) -> str:
    norm = wanted.lower().replace("_", "-")
    for name in names:
        if name == norm or name.replace("-", "") == norm.replace("-", ""):
            return name
    raise ConfigError(field, wanted, names.keys())


# What the replay reads from the folder, typed, so a bad value is one line naming its field. The
# bounds are those of a real engine (libra.core.trace.MAX_TOKENS for token counts); other keys of
# the files are not read and not checked.
class _Lenient(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class _EngineKwargs(_Lenient):
    model: str | None = None
    tensor_parallel_size: int | None = Field(None, ge=1, le=64)
    data_parallel_size: int = Field(1, ge=1, le=MAX_RANKS)
    enable_expert_parallel: bool = False
    max_num_seqs: int | None = Field(None, ge=1, le=16384)
    max_num_batched_tokens: int | None = Field(None, ge=1, le=1 << 20)


class _KVCache(_Lenient):
    num_kv_tokens: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)


class _CacheConfig(_Lenient):
    kv_cache_size_tokens: int | None = Field(None, ge=1)


class _Resolved(_Lenient):
    cache_config: _CacheConfig = _CacheConfig()


class _Metrics(_Lenient):
    """vLLM's own counters at the end of the run, where the recorder kept them: the preemptions
    (vLLM's `vllm:num_preemptions` counter), for the whole run or one per data-parallel rank."""

    num_preemptions: int | list[int] | None = None


class _Meta(_Lenient):
    model: str = ""
    vllm_version: str = ""
    engine_kwargs: _EngineKwargs = _EngineKwargs()
    kv_cache: _KVCache = _KVCache()
    resolved_config: _Resolved = _Resolved()
    metrics: _Metrics = _Metrics()


class _NpuMem(_Lenient):
    mem_util: float = Field(0.9, gt=0, le=1)


class _Instance(_Lenient):
    hardware: str
    npu_mem: _NpuMem = _NpuMem()
    tp_size: int | None = Field(None, ge=1, le=64)
    ep_size: int | None = Field(None, ge=1, le=512)


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
    cfg = build(_Config, _read_json(folder / "config.json"), "config.json")
    kw = meta.engine_kwargs
    model, dtype = catalog.resolve_model(kw.model or meta.model, "meta.json: model")
    ranks = _ranks(meta, [i for node in cfg.nodes for i in node.instances], catalog)
    if catalog.model(model).is_moe is False:
        ranks = [Rank(r.hardware, r.tp, 1, r.gpu_memory_utilization) for r in ranks]
    reqs = _read_requests(folder / "requests.jsonl")
    pre = meta.metrics.num_preemptions
    return Bench(model, ranks, kw.max_num_seqs or 256, kw.max_num_batched_tokens or 8192, reqs, dtype,
                 _vllm_kv_tokens(meta, len(ranks)), _version(meta.vllm_version),
                 [pre] if isinstance(pre, int) else pre)  # fmt: skip


def _version(text: str) -> tuple[int, ...] | None:
    """'0.19.0' -> (0, 19, 0); None when absent or not numbers (a dev build's suffix is dropped)."""
    parts = []
    for piece in text.strip().split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


# vLLM subtracts its CUDA graphs' estimated memory before sizing the KV cache as from 0.21
# (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS on by default); earlier runs captured them afterwards.
CUDAGRAPH_PROFILED_FROM = (0, 21)


def _for_version(eff: RolloutEfficiency, engine: str, version: tuple[int, ...] | None) -> RolloutEfficiency:
    if version is None or version >= CUDAGRAPH_PROFILED_FROM:
        return eff
    eng = eff.engine(engine)
    mem = eng.memory.model_copy(update={"cudagraph_mib": 0.0})
    return eff.model_copy(update={"engines": {**eff.engines, engine: eng.model_copy(update={"memory": mem})}})


def _ranks(meta: _Meta, instances: list[_Instance], catalog: Catalog) -> list[Rank]:
    """Every engine of the layout: one per instance listed, and as many as data_parallel_size says.

    A config that lists one instance for a DP group (older LLMServingSim files) is expanded to the
    group's size. Expert parallelism spans the DP group times TP, as in vLLM."""
    kw = meta.engine_kwargs
    n = max(len(instances), kw.data_parallel_size)
    util = meta.kv_cache.gpu_memory_utilization
    out = []
    for i in range(n):
        inst = instances[i % len(instances)]
        hw = _match(catalog.hardware_specs, inst.hardware, "config.json: hardware")
        tp = kw.tensor_parallel_size or inst.tp_size or 1  # what vLLM ran with, else the layout's
        ep = inst.ep_size or (n * tp if kw.enable_expert_parallel else 1)
        out.append(Rank(hw, tp, ep, util or inst.npu_mem.mem_util))
    return out


def _vllm_kv_tokens(meta: _Meta, ranks: int) -> int | None:
    """The KV cache vLLM allocated per rank, if the run recorded it (meta.json of newer runs)."""
    if meta.resolved_config.cache_config.kv_cache_size_tokens:
        return meta.resolved_config.cache_config.kv_cache_size_tokens
    total = meta.kv_cache.num_kv_tokens
    return total // ranks if total else None


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


def cost_models(bench: Bench, catalog: Catalog, eff: RolloutEfficiency | None = None,
                engine: str = DEFAULT_ENGINE) -> list[RolloutCostModel]:  # fmt: skip
    model = catalog.model(bench.model)
    eff = _for_version(eff or RolloutEfficiency(), engine, bench.vllm_version)
    out = []
    for r in bench.ranks:
        cost = RolloutCostModel(catalog.hardware(r.hardware), model, r.tp, eff, r.gpu_memory_utilization,
                                bench.max_num_batched_tokens, engine, bench.max_num_seqs, r.ep)  # fmt: skip
        _check_fits(bench, cost)
        out.append(cost)
    return out


@dataclass(slots=True)
class Replay:
    """The simulated run: per-request metrics over all ranks, and each rank's engine."""

    metrics: dict[str, np.ndarray]
    engines: list[Engine]
    seqs: list[list[Seq]] = field(default_factory=list)  # per rank, the requests it served


def simulate(bench: Bench, catalog: Catalog, eff: RolloutEfficiency | None = None,
             engine: str = DEFAULT_ENGINE) -> Replay:  # fmt: skip
    k = Kernel(0)
    # The KV cache vLLM allocated where the run recorded it (the computed one is reported beside).
    engines = [Engine(k, f"rank{i}", c, bench.max_num_seqs, bench.max_num_batched_tokens,
                      kv_capacity=bench.vllm_kv_tokens)
               for i, c in enumerate(cost_models(bench, catalog, eff, engine))]  # fmt: skip
    if len(engines) > 1 and catalog.model(bench.model).is_moe:
        LockstepGroup(k, engines)  # an MoE model's data-parallel ranks run each forward together
    served: list[list[Seq]] = [[] for _ in engines]
    t0 = min(r["arrival_time"] for r in bench.requests)
    seqs = []
    for i, r in enumerate(bench.requests):
        s = Seq(i, max(1, int(r["input_toks"])), max(1, int(r["output_toks"])))
        seqs.append(s)
        k.at(r["arrival_time"] - t0, _dispatch, engines, served, s)
    k.run()
    return Replay(_metrics(seqs), engines, served)


def _dispatch(engines: Sequence[Engine], served: list[list[Seq]], seq: Seq) -> None:
    """vLLM's data-parallel load balancer: the rank with the fewest waiting x 4 + running."""
    i = min(range(len(engines)), key=lambda j: (4 * len(engines[j].waiting) + engines[j].running, j))
    served[i].append(seq)
    engines[i].submit(seq)


def _metrics(seqs: Sequence[Seq]) -> dict[str, np.ndarray]:
    out = np.array([s.out_total for s in seqs])
    first, done, sub = (np.array([getattr(s, a) for s in seqs]) for a in ("t_first", "t_done", "t_submit"))
    keep = out > 1
    return {"ttft": first - sub, "latency": done - sub, "tpot": (done - first)[keep] / (out[keep] - 1)}


def _check_fits(bench: Bench, cost: RolloutCostModel) -> None:
    """The engine the folder describes must hold its longest request: else it is an input error
    naming what to change, not a simulated engine that stalls."""
    hw = cost.hw
    if cost.tp > hw.gpus_per_node:
        raise ConfigError("meta.json: engine_kwargs.tensor_parallel_size", cost.tp,
                          f"<= gpus_per_node ({hw.gpus_per_node}) of {hw.name}")  # fmt: skip
    cap = bench.vllm_kv_tokens or cost.kv_capacity_tokens()
    i = max(range(len(bench.requests)), key=lambda j: bench.requests[j]["input_toks"] + bench.requests[j]["output_toks"])  # fmt: skip
    need = bench.requests[i]["input_toks"] + bench.requests[i]["output_toks"]
    if need > cap:
        where = f"{bench.model} at TP{cost.tp} on {hw.name} with mem_util {cost.gpu_memory_utilization:g}"
        if cap == 0:
            raise ConfigError("config.json: npu_mem.mem_util", cost.gpu_memory_utilization,
                              f"room for the weights and a KV cache ({where} leaves none)")  # fmt: skip
        raise ConfigError(f"requests.jsonl: request {i}", f"{need} tokens (input + output)",
                          f"at most the KV cache's {cap} tokens ({where})")  # fmt: skip


def summarize(arrs: dict[str, np.ndarray]) -> dict[str, float]:
    return {f"{m}_{s}": float(f(arrs[m])) for m in METRICS for s, f in STATS.items() if len(arrs[m])}


def kv_capacity(bench: Bench, costs: Sequence[RolloutCostModel]) -> dict:
    """The KV tokens per rank as the cost model computes them (vLLM's memory profile, term by
    term, in GiB), against what vLLM reported allocating where it did; the replay runs on vLLM's."""
    sim = costs[0].kv_capacity_tokens()
    out: dict = {"computed": sim, "vllm": bench.vllm_kv_tokens, "error": None, "replayed": sim,
                 "breakdown_gib": {k: round(v / GIB, 3) for k, v in costs[0].memory_breakdown().items()}}  # fmt: skip
    if bench.vllm_kv_tokens is not None:
        out["error"] = (sim - bench.vllm_kv_tokens) / bench.vllm_kv_tokens
        out["replayed"] = bench.vllm_kv_tokens
    return out


def per_instance(replay: Replay, vllm_preemptions: list[int] | None = None) -> list[dict]:
    """Each rank's share: requests, busy fraction, preemptions (beside vLLM's count where the run
    recorded it per rank; a single total goes on the first row) and its simulated latencies."""
    out = []
    horizon = max((s.t_done for seqs in replay.seqs for s in seqs), default=0.0) or 1.0
    for i, (eng, seqs) in enumerate(zip(replay.engines, replay.seqs, strict=True)):
        row = {"instance": eng.id, "tp": eng.tp, "ep": eng.cost.ep, "requests": len(seqs),
               "busy": eng.busy_s / horizon, "preemptions": eng.preemptions,
               "vllm_preemptions": _rank_count(vllm_preemptions, i, len(replay.engines))}  # fmt: skip
        if seqs:
            m = _metrics(seqs)
            row.update({f"{k}_mean": float(np.mean(v)) for k, v in m.items() if len(v)})
        out.append(row)
    return out


def _rank_count(counts: list[int] | None, rank: int, ranks: int) -> int | None:
    if counts is None:
        return None
    if len(counts) == ranks:
        return counts[rank]
    return sum(counts) if rank == 0 else None


def compare(bench: Bench, catalog: Catalog, eff: RolloutEfficiency | None = None,
            engine: str = DEFAULT_ENGINE) -> dict:  # fmt: skip
    replay = simulate(bench, catalog, eff, engine)
    real, sim = summarize(measured(bench)), summarize(replay.metrics)
    keys = ("ttft_mean", "latency_mean", "latency_p90", "tpot_mean")
    return {"measured": real, "simulated": sim, "error": {k: (sim[k] - real[k]) / real[k] for k in keys},
            "instances": per_instance(replay, bench.vllm_preemptions),
            "kv_capacity": kv_capacity(bench, [e.cost for e in replay.engines])}  # fmt: skip


FIT_KEYS = ("latency_mean", "latency_p90", "ttft_mean", "tpot_mean")


def calibrate(benches: Bench | Sequence[Bench], catalog: Catalog, base: RolloutEfficiency | None = None,
              fields: tuple[str, ...] = ("base_overhead_s", "per_seq_overhead_s"),
              engine: str = DEFAULT_ENGINE) -> tuple[RolloutEfficiency, dict]:  # fmt: skip
    """Fit efficiency terms so the replays match the measured latencies of `benches`.

    Minimises the squared log-ratio of simulated to measured latency mean and p90, TTFT mean and
    TPOT mean over every bench, with Nelder-Mead over the log of each term (fractions clipped to
    1). GPU terms are fitted for each bench's GPU type; CPU terms for the engine preset. Returns the
    errors of the first bench after the fit."""
    from libra.costmodel.calibrate import _with, nelder_mead, start

    benches = [benches] if isinstance(benches, Bench) else list(benches)
    base = base or RolloutEfficiency()
    hardware = sorted({b.hardware for b in benches})
    reals = [summarize(measured(b)) for b in benches]

    def fitted(logx: np.ndarray) -> RolloutEfficiency:
        return _with(base, fields, logx, hardware, engine)

    def loss(logx: np.ndarray) -> float:
        eff, total = fitted(logx), 0.0
        for b, real in zip(benches, reals, strict=True):
            sim = summarize(simulate(b, catalog, eff, engine).metrics)
            total += sum(float(np.log(sim[k] / real[k])) ** 2 for k in FIT_KEYS)
        return total

    best = fitted(nelder_mead(loss, start(base, fields, hardware[0], engine), step=0.2, iters=150))
    return best, compare(benches[0], catalog, best, engine)["error"]

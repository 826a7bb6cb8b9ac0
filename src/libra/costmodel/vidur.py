"""Fit the cost model's GPU terms to measured kernel and collective times (Vidur's profiles).

The folder is laid out as the shared `vidur-profiles` data (its README explains the columns):
- `compute/<gpu>/<org>/<model>/mlp.csv`: per transformer layer, per GPU, the time of every linear
  and elementwise kernel, at TP 1/2/4/8 and 1 to a few thousand tokens;
- `network/<gpu>_dgx/all_reduce.csv`: NCCL all-reduce inside one node, by message size.

`fit_vidur` fits, per GPU type, the linear-layer terms (bandwidth and compute efficiency, the
per-layer time that does not shrink with TP, the per-token norm term) and NCCL's all-reduce by
size band, and reports the median absolute error of each against the measurements it came from.
The prediction here is vectorised for the fit; `tests/test_vidur_fit.py` checks that it is the
very formula `RolloutCostModel` uses.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from libra.core.errors import ConfigError
from libra.core.specs import HardwareSpec
from libra.costmodel.calibrate import nelder_mead
from libra.costmodel.catalog import Catalog
from libra.costmodel.efficiency import AllReduceBand, AllReduceTerms, GpuTerms

# Vidur's folder names for the GPUs it measured (and `libra costmodel profile`'s for the local CPU),
# and the catalog entries they are.
GPU_NAMES = {"a100": "a100-80g", "h100": "h100-80g", "cpu": "cpu-host"}
# Catalog GPUs with the same chip as a measured one: same kernel terms, all-reduce bandwidth scaled
# by their NVLink bandwidth (the A800 is an A100 with NVLink capped at 400 GB/s).
SAME_CHIP = {"a800-80g": "a100-80g", "h200-141g": "h100-80g"}
LAYER_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "input_layernorm",
             "post_attention_layernorm", "mlp_act", "attn_rope", "add")  # fmt: skip
# NCCL's protocol and algorithm change with the message size (LL, LL128, Simple; ring or tree):
# one band each, upper bounds in bytes. Decode all-reduces of small batches sit in the first band.
BANDS = (64 << 10, 1 << 20, 8 << 20, 64 << 20, 1 << 50)
BAND_NAMES = ("<64KiB", "64KiB-1MiB", "1-8MiB", "8-64MiB", ">=64MiB")


@dataclass(frozen=True, slots=True)
class LayerSample:
    """One measured transformer layer (its linear and elementwise kernels) on one GPU."""

    model: str
    hidden: int
    params: int  # matmul parameters of the layer (attention + gated MLP), whole model
    bytes_per_param: int
    tp: int
    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class AllReduceSample:
    group: int
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class FitReport:
    """Median absolute relative error of each fitted term against its measurements."""

    layers: dict[str, dict[int, float]]  # gpu -> tp -> median |error|
    allreduce: dict[str, dict[int, dict[str, float]]]  # gpu -> group -> band -> median |error|
    samples: dict[str, int]


def _float(row: dict, key: str, where: str) -> float:
    try:
        return float(row[key])
    except (KeyError, ValueError):
        raise ConfigError(where, row.get(key, "<missing>"), f"a number in column {key}") from None


def read_layers(path: Path) -> list[LayerSample]:
    """Samples of one `mlp.csv`: gated-MLP models only (the cost model's shape)."""
    out = []
    with path.open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            where = f"{path}:{i}"
            if row.get("use_gated_mlp") != "True":
                continue
            h, heads, kv = (int(_float(row, k, where)) for k in ("n_embd", "n_head", "n_kv_head"))
            inter, tp, tokens = (int(_float(row, k, where)) for k in ("n_expanded_embd", "num_tensor_parallel_workers", "num_tokens"))  # fmt: skip
            hd = h // heads
            params = h * (heads * hd + 2 * kv * hd) + heads * hd * h + 3 * h * inter
            ms = sum(
                _float(row, f"time_stats.{op}.median", where)
                for op in LAYER_OPS
                if f"time_stats.{op}.median" in row
            )
            bpp = (
                int(_float(row, "bytes_per_param", where)) if row.get("bytes_per_param") else 2
            )  # Vidur: fp16
            out.append(LayerSample(path.parent.name, h, params, bpp, tp, tokens, ms * 1e-3))
    return out


def read_allreduce(path: Path) -> list[AllReduceSample]:
    """NCCL all-reduce inside one node (every worker on the node); sizes are fp16 elements."""
    out = []
    with path.open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            where = f"{path}:{i}"
            if row.get("num_workers") != row.get("devices_per_node"):
                continue
            group, n = int(_float(row, "num_workers", where)), int(_float(row, "size", where))
            out.append(
                AllReduceSample(group, 2 * n, _float(row, "time_stats.all_reduce.median", where) * 1e-3)
            )
    return out


# ---- the linear layers ----------------------------------------------------------------------------


def predict_layers(terms: GpuTerms, hw: HardwareSpec, hidden, params, tp, tokens, bpp=2) -> np.ndarray:
    """Per-layer linear time, vectorised: the formula of `RolloutCostModel.layer_time`."""
    bw = hw.memory_bw_gbps * 1e9 * terms.bw
    flops = hw.bf16_tflops * 1e12 * terms.compute
    a, b, p = bpp * params / tp / bw, 2.0 * params * tokens / tp / flops, terms.roofline_p
    return (a**p + b**p) ** (1.0 / p) + terms.layer_fixed_s + terms.norm_s * hidden * tokens


def _columns(samples: list[LayerSample]) -> tuple[np.ndarray, ...]:
    """hidden, params, tp, tokens, bytes per param, seconds."""
    cols = zip(
        *((s.hidden, s.params, s.tp, s.tokens, s.bytes_per_param, s.seconds) for s in samples), strict=True
    )
    return tuple(np.array(c, dtype=float) for c in cols)


def fit_layer_terms(samples: list[LayerSample], hw: HardwareSpec, base: GpuTerms) -> GpuTerms:
    """Least squares in log space over bw, compute, layer_fixed_s and norm_s."""
    h, p, tp, n, bpp, y = _columns(samples)

    def terms(x: np.ndarray) -> GpuTerms:
        v = [float(e) for e in np.exp(x)]
        return base.model_copy(update={"bw": min(v[0], 1.0), "compute": min(v[1], 1.0),
                                       "layer_fixed_s": v[2], "norm_s": v[3]})  # fmt: skip

    def loss(x: np.ndarray) -> float:
        return float(np.mean(np.log(predict_layers(terms(x), hw, h, p, tp, n, bpp) / y) ** 2))

    x0 = np.log([0.8, 0.7, 40e-6, 5e-12])
    return terms(nelder_mead(loss, nelder_mead(loss, x0, iters=1500), iters=1500))


def layer_errors(terms: GpuTerms, hw: HardwareSpec, samples: list[LayerSample]) -> dict[int, float]:
    h, p, tp, n, bpp, y = _columns(samples)
    err = np.abs(predict_layers(terms, hw, h, p, tp, n, bpp) / y - 1)
    return {int(t): float(np.median(err[tp == t])) for t in sorted(set(tp))}


# ---- all-reduce -----------------------------------------------------------------------------------


def fit_allreduce(samples: list[AllReduceSample]) -> dict[int, AllReduceTerms]:
    """Per group size and size band: latency and bus bandwidth, minimising the median error."""
    out = {}
    for group in sorted({s.group for s in samples}):
        b = np.array([s.nbytes for s in samples if s.group == group], dtype=float)
        t = np.array([s.seconds for s in samples if s.group == group])
        bands, lo = [], 0.0
        for hi in BANDS:
            m = (b > lo) & (b <= hi)
            if m.any():
                bands.append(_fit_band(b[m], t[m], group, hi))
            lo = hi
        out[group] = AllReduceTerms(bands=bands)
    return out


def _fit_band(b: np.ndarray, t: np.ndarray, group: int, hi: float) -> AllReduceBand:
    ring = 2.0 * (group - 1) / group

    def loss(x: np.ndarray) -> float:
        return float(np.median(np.abs(np.log((np.exp(x[0]) + ring * b / np.exp(x[1])) / t))))

    starts = [np.log([lat, bw]) for lat in (5e-6, 20e-6, 50e-6) for bw in (100e9, 300e9, 1000e9)]
    x = min((nelder_mead(loss, s, iters=400) for s in starts), key=loss)
    return AllReduceBand(
        up_to_bytes=float(hi), latency_s=float(np.exp(x[0])), bus_gbps=float(np.exp(x[1]) / 1e9)
    )


def allreduce_errors(
    terms: dict[int, AllReduceTerms], samples: list[AllReduceSample]
) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for group, ar in terms.items():
        pts = [s for s in samples if s.group == group]
        err = np.array([abs(ar.time(s.nbytes, group) / s.seconds - 1) for s in pts])
        b = np.array([s.nbytes for s in pts])
        out[group] = {}
        lo = 0
        for hi, name in zip(BANDS, BAND_NAMES, strict=True):
            m = (b > lo) & (b <= hi)
            if m.any():
                out[group][name] = float(np.median(err[m]))
            lo = hi
    return out


# ---- the engine's own all-reduce kernel ------------------------------------------------------------

# vLLM's custom all-reduce on H100 (one-shot/two-shot kernels over NVLink), measured without CUDA
# graphs, microseconds by message size in bf16 elements, TP 2/4/8: sgl-project/sglang PR 2904.
CUSTOM_H100_US = {
    512: (9.5, 9.1, 10.1),
    4096: (8.8, 8.5, 9.3),
    32768: (8.7, 9.2, 11.8),
    262144: (12.9, 20.6, 24.1),
    524288: (17.7, 26.9, 30.4),
    1048576: (26.6, 40.2, 45.0),
}


def custom_allreduce_terms(link_scale: float) -> dict[int, AllReduceTerms]:
    """One band up to vLLM's 8 MiB limit: latency and bandwidth fitted to the points above, the
    bandwidth scaled by `link_scale` (a GPU's NVLink bandwidth over the H100's)."""
    out = {}
    for i, group in enumerate((2, 4, 8)):
        b = np.array([2.0 * n for n in CUSTOM_H100_US], dtype=float)
        t = np.array([v[i] for v in CUSTOM_H100_US.values()]) * 1e-6
        band = _fit_band(b, t, group, 8 * 2**20)
        out[group] = AllReduceTerms(bands=[band.model_copy(update={"bus_gbps": band.bus_gbps * link_scale})])
    return out


# ---- the whole fit --------------------------------------------------------------------------------


def fit_vidur(
    folder: str | Path, catalog: Catalog, base: GpuTerms | None = None
) -> tuple[dict[str, GpuTerms], FitReport]:
    folder = Path(folder)
    if not (folder / "compute").is_dir():
        raise ConfigError("--vidur", str(folder), "a Vidur profiles folder with compute/ (and network/)")
    base = base or GpuTerms()
    gpus: dict[str, GpuTerms] = {}
    lerr: dict[str, dict[int, float]] = {}
    aerr: dict[str, dict[int, dict[str, float]]] = {}
    counts: dict[str, int] = {}
    for short, name in GPU_NAMES.items():
        files = sorted((folder / "compute" / short).glob("*/*/mlp.csv"))
        if not files:
            continue
        hw = catalog.hardware(name)
        layers = [s for f in files for s in read_layers(f)]
        terms = fit_layer_terms(layers, hw, base)
        net = folder / "network" / f"{short}_dgx" / "all_reduce.csv"
        ar = read_allreduce(net) if net.is_file() else []  # one device profiled: no all-reduce
        if ar:
            terms = terms.model_copy(update={"nccl": fit_allreduce(ar), "custom": _custom_for(hw, catalog)})
            aerr[name] = allreduce_errors(terms.nccl, ar)
        gpus[name] = terms.model_copy(update={"source": _source(folder, short, layers, ar)})
        lerr[name] = layer_errors(terms, hw, layers)
        counts[name] = len(layers) + len(ar)
    if not gpus:
        raise ConfigError("--vidur", str(folder), f"measurements for at least one of {sorted(GPU_NAMES)}")
    gpus.update(_same_chip(gpus, catalog))
    return gpus, FitReport(lerr, aerr, counts)


def _custom_for(hw: HardwareSpec, catalog: Catalog) -> dict[int, AllReduceTerms]:
    return custom_allreduce_terms(hw.intra_node_bw_gbps / catalog.hardware("h100-80g").intra_node_bw_gbps)


def _source(folder: Path, short: str, layers: Iterable[LayerSample], ar: list[AllReduceSample]) -> str:
    models = ", ".join(sorted({s.model for s in layers}))
    net = f" and {len(ar)} NCCL all-reduce sizes; custom all-reduce from sglang PR 2904 (H100, scaled by NVLink bandwidth)"
    return (
        f"fitted by `libra costmodel calibrate --vidur {folder.name}` to {short} layer kernels of {models}"
        + (net if ar else "")
    )


def _same_chip(gpus: dict[str, GpuTerms], catalog: Catalog) -> dict[str, GpuTerms]:
    out = {}
    for name, like in SAME_CHIP.items():
        if like not in gpus or name not in catalog.hardware_specs:
            continue
        scale = catalog.hardware(name).intra_node_bw_gbps / catalog.hardware(like).intra_node_bw_gbps
        src = gpus[like]
        out[name] = src.model_copy(update={
            "nccl": _scaled(src.nccl, scale), "custom": _scaled(src.custom, scale),
            "source": f"the {like} terms (same chip), all-reduce bandwidth x {scale:.3g} for its NVLink"})  # fmt: skip
    return out


def _scaled(table: dict[int, AllReduceTerms], scale: float) -> dict[int, AllReduceTerms]:
    return {g: AllReduceTerms(bands=[b.model_copy(update={"bus_gbps": b.bus_gbps * scale}) for b in t.bands])
            for g, t in table.items()}  # fmt: skip


# The CPU work of one step of a vLLM-V0-generation engine, as Vidur profiled it (its
# `cpu_overheads.csv`: Sarathi, a vLLM 0.2 fork, with vLLM's scheduler and Ray workers, timed per
# step by batch size 8-128 and TP): scheduling, preparing the inputs, sampling and processing the
# outputs (detokenising included), each a mean per step in milliseconds.
CPU_PHASES = ("schedule_mean", "prepare_inputs_e2e_mean", "sampler_e2e_mean", "process_model_outputs_mean")


def fit_cpu_overheads(path: str | Path, tp: int = 1) -> tuple[float, float]:
    """(seconds per step, seconds per scheduled sequence per step): least squares of the
    profile's CPU time per step against its batch size, at TP `tp`, over every model it timed."""
    path = Path(path)
    xs, ys = [], []
    with path.open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            where = f"{path}:{i}"
            if int(_float(row, "tensor_parallel_degree", where)) != tp:
                continue
            xs.append(_float(row, "batch_size", where))
            ys.append(sum(_float(row, c, where) for c in CPU_PHASES) * 1e-3)
    if len(set(xs)) < 2:
        raise ConfigError(
            str(path), f"{len(xs)} rows at TP {tp}", "a CPU-overhead profile with two batch sizes or more"
        )
    slope, intercept = np.polyfit(np.asarray(xs), np.asarray(ys), 1)
    return float(intercept), float(slope)

"""Efficiency terms: the numbers that turn spec-sheet physics into engine time, with their sources.

Three kinds, kept apart because they come from different measurements:
- `GpuTerms`, per GPU type: how close the kernels get to the hardware (memory-bandwidth and compute
  efficiency of the linear layers, a per-layer time that does not shrink with TP, attention's fixed
  cost) and the all-reduce, by backend (NCCL or the engine's own kernel), TP degree and size band.
  Fitted to measured kernel and collective times by `libra costmodel calibrate --vidur DIR`; the
  shipped values are in `data/gpu_terms.yaml` with the command that produced them.
- `EngineOverhead`, per engine generation: the CPU time of a step (fixed, per running sequence,
  per extra TP worker) and whether the engine's own all-reduce kernel is used. Shipped presets in
  `data/engines.yaml`: `vllm-v1` (the default; vLLM 0.8 and later) and `vllm-v0` (0.7 and earlier).
- The links used for KV transfers; each engine generation's memory profile is in `EngineMemory`.

`libra costmodel calibrate` fits any of them and writes a profile YAML of this same shape, which
every command loads with `--profile FILE`. They are never fitted per test.
"""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from libra.core.config import build, load_yaml
from libra.core.errors import ConfigError

_DATA = Path(__file__).parent / "data"
DEFAULT_ENGINE = "vllm-v1"


class _Frozen(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)


class AllReduceBand(_Frozen):
    """Messages up to `up_to_bytes` take latency_s + ring bytes / bus bandwidth."""

    up_to_bytes: float = Field(gt=0)
    latency_s: float = Field(ge=0)
    bus_gbps: float = Field(gt=0)


class AllReduceTerms(_Frozen):
    """One all-reduce backend on one GPU type at one group size, by message-size band.

    NCCL switches protocol and algorithm with the message size (LL, LL128, Simple; ring or tree),
    so one latency and one bandwidth do not fit it: each band gets its own."""

    bands: list[AllReduceBand] = Field(min_length=1)

    def time(self, nbytes: float, group: int) -> float:
        ring = 2.0 * (group - 1) / group
        for band in self.bands:
            if nbytes <= band.up_to_bytes:
                break
        return band.latency_s + ring * nbytes / (band.bus_gbps * 1e9)


class GpuTerms(_Frozen):
    """How the kernels of an inference engine behave on one GPU type."""

    # Achieved fraction of HBM bandwidth in weight-bound GEMMs, and of the dense bf16 peak in
    # compute-bound ones. The linear layers take the smooth roofline (a^p + b^p)^(1/p) of the two
    # times: near the ridge point a GEMM is neither purely bandwidth- nor compute-bound.
    # The defaults (GPU types with no measured terms) are the mean of the measured A100 and H100.
    bw: float = Field(0.81, gt=0, le=1)
    compute: float = Field(0.67, gt=0, le=1)
    roofline_p: float = Field(2.0, ge=1, le=64)
    # Per transformer layer per step, whatever the TP degree: GEMM tails and launches, norms,
    # activation, rope, residual adds at small batch.
    layer_fixed_s: float = Field(43e-6, ge=0)
    # Per token and hidden element per layer: norms and residual adds read the full hidden state
    # on every rank, so this part does not shrink with TP either.
    norm_s: float = Field(1e-11, ge=0)
    # Per layer per step: the attention kernel's launch and tail (FlashAttention/FlashInfer).
    attn_fixed_s: float = Field(6e-6, ge=0)
    # All-reduce by group size; a size missing here uses the nearest one below it.
    nccl: dict[int, AllReduceTerms] = Field(default_factory=dict)
    custom: dict[int, AllReduceTerms] = Field(default_factory=dict)
    source: str = ""

    def allreduce(self, backend: str, group: int) -> AllReduceTerms | None:
        table = self.custom if backend == "custom" else self.nccl
        below = [g for g in table if g <= group]
        return table[max(below)] if below else None


class EngineMemory(_Frozen):
    """What an engine generation's startup memory profile holds besides weights and KV cache.

    vLLM sizes its KV cache as gpu_memory_utilization x device memory less what a profiling run
    used (`Worker.determine_available_memory`): the weights, the torch peak of a dummy forward of
    max_num_batched_tokens tokens followed by a dummy sampling of max_num_seqs requests, the memory
    allocated outside torch meanwhile (cuBLAS workspaces, NCCL and all-reduce buffers), and, from
    vLLM 0.21 on, an estimate of the CUDA graphs it will capture. The constants here are measured
    figures, not fitted to the traces the replay checks (docs/fidelity.md, "KV capacity")."""

    # The sampler's peak per logit (max_num_seqs x vocab): the fp32 logits, their sort, the sort's
    # int64 indices, softmax and the top-p cumulative sum. 38.3 B: vLLM's logged peak activation on
    # H100 for Llama-3.1-8B, Qwen3-0.6B, Qwen3-32B and gpt-oss-20b at max_num_seqs 1024 (4.76-7.38
    # GiB; llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md), less the
    # hidden states of max_num_batched_tokens tokens: 38.3-38.4 B for all four.
    sampler_bytes_per_logit: float = Field(38.3, ge=0)
    # Allocations outside torch during the profile: 0.13 GiB on one GPU (the same four runs), 0.55
    # GiB when the GPU is part of a TP or EP group (Llama-3.3-70B at TP2, same source).
    non_torch_gib: float = Field(0.13, ge=0)
    collective_gib: float = Field(0.42, ge=0)
    # CUDA-graph memory, per captured graph, where the engine subtracts its estimate before sizing
    # the KV cache (vLLM 0.21 and later, VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS on by default):
    # about 24 MiB a graph (vllm-project/vllm issue 50780; 16 piecewise graphs took 0.36 GiB in
    # the log of gpustack/runner PR 251). 0: the engine does not subtract it (vLLM before 0.21).
    cudagraph_mib: float = Field(0.0, ge=0)
    # The largest batch captured in a piecewise graph (vLLM: min(2 x max_num_seqs, 512)).
    max_capture_size: int = Field(512, ge=1)

    def cudagraphs(self, max_num_seqs: int) -> int:
        """Graphs captured: piecewise ones up to min(2 x max_num_seqs, 512) tokens and full
        decode ones up to max_num_seqs, at vLLM's capture sizes (1, 2, 4, then every 8 to 256,
        then every 16)."""
        return _capture_sizes(min(2 * max_num_seqs, self.max_capture_size)) + _capture_sizes(
            min(max_num_seqs, self.max_capture_size)
        )


def _capture_sizes(top: int) -> int:
    small = sum(1 for s in (1, 2, 4) if s <= top)
    return small + max(0, min(top, 248) // 8) + max(0, (top - 256) // 16 + 1 if top >= 256 else 0)


class EngineOverhead(_Frozen):
    """One engine generation: the CPU side of its steps, its scheduler's KV rules, its memory
    profile."""

    # Scheduling, input preparation, sampling and output processing, per step.
    base_overhead_s: float = Field(ge=0)
    # Per running sequence per step: block tables, sampling metadata, detokenisation.
    per_seq_overhead_s: float = Field(ge=0)
    # Per extra TP worker: the broadcast of the step's inputs and a cross-process barrier.
    tp_overhead_s: float = Field(0.0, ge=0)
    # Per running sequence per extra TP worker (older engines sent per-sequence metadata to
    # every worker each step).
    tp_seq_overhead_s: float = Field(0.0, ge=0)
    # The share of the GPU type's per-layer fixed time (measured kernel by kernel, as Vidur does)
    # left when the engine fuses norms, residual adds, activation and rope into fewer kernels
    # (vLLM V1 compiles the model with torch.compile; V0 ran them one by one).
    layer_kernel_fraction: float = Field(1.0, gt=0, le=2)
    # The engine's own one-shot all-reduce kernel for messages up to this size on NVLink (vLLM's
    # custom all-reduce); NCCL above it, or when it is off.
    custom_allreduce: bool = True
    custom_allreduce_max_bytes: float = Field(8 * 2**20, ge=0)
    # The engine process's CPU beyond its priced steps, for an engine that shares a CPU host with
    # its steps (the built-in engine; the live-run prediction, `libra.sim.rl.live`): per request
    # (parsing it, rendering the chat template, building the response), per generated token
    # (its logprob, token id and tool-call grammar, the event that carries it across threads) and
    # per weight update from disk (reading and copying the checkpoint). Fitted by `libra
    # costmodel calibrate --serving-data`; 0 for the GPU engines, whose serving CPU is off the
    # step's critical path.
    request_cpu_s: float = Field(0.0, ge=0)
    token_cpu_s: float = Field(0.0, ge=0)
    weight_load_cpu_s: float = Field(0.0, ge=0)
    # CPU seconds per priced CPU second by the share of a core the engine got, as (share, factor)
    # points by share, measured by the profile beside 0..3 busy trainer-like processes and fitted
    # by `libra costmodel calibrate --data`. Recorded, not applied: a live run's engine steps cost
    # no more with a smaller share (docs/fidelity.md, "The live run").
    contention: tuple[tuple[float, float], ...] = ()
    # The host's speed when these terms were measured: CPU seconds of the profile's probe (a fixed
    # forward pass of the built-in model, `libra.runtime.profiler.cpu_probe`), median over the
    # uncontended steps' batches. Against RUN/host.json's `probe_cpu_s` (the same probe during a
    # live run), how much slower or faster the run's host was (applied by the live prediction
    # only when asked, `--host-speed`: docs/fidelity.md). 0: not measured.
    probe_cpu_s: float = Field(0.0, ge=0)
    # The scheduler's KV rules (`libra.sim.engine`). A waiting or preempted request is admitted
    # when its whole current sequence fits in free and evictable KV (vLLM V1's
    # scheduler_reserve_full_isl, on by default; V0's block manager checked the whole prompt too),
    # or, with admit_full_sequence off, its first chunk (the built-in engine). Beside it, a share
    # of the cache is kept free (kv_watermark: V0's 1%; V1's default 0) and a number of blocks per
    # running request (the built-in engine keeps one). prefix_caching: freed KV stays cached for
    # reuse (vLLM V1, on by default), so a preempted request recomputes only what was evicted.
    admit_full_sequence: bool = True
    kv_watermark: float = Field(0.0, ge=0, lt=1)
    reserve_blocks_per_running: int = Field(0, ge=0)
    prefix_caching: bool = True
    memory: EngineMemory = EngineMemory()

    @field_validator("contention")
    @classmethod
    def _by_share(cls, pts: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        if any(not (0 < s <= 1 and 0 < f <= 100) for s, f in pts):
            raise ValueError("(share, factor) points with share in (0, 1] and factor in (0, 100]")
        if any(b[0] <= a[0] for a, b in itertools.pairwise(pts)):
            raise ValueError("points in increasing share")
        return pts

    source: str = ""


class RolloutEfficiency(_Frozen):
    """Everything the rollout cost model needs besides the spec sheets."""

    gpus: dict[str, GpuTerms] = Field(default_factory=lambda: shipped_gpu_terms())
    # For GPU types with no measured terms.
    default_gpu: GpuTerms = GpuTerms(source="defaults for GPUs without measured terms (docs/fidelity.md)")
    engines: dict[str, EngineOverhead] = Field(default_factory=lambda: shipped_engines())
    # NCCL ring bus bandwidth relative to the link, used for KV transfers and for NVLink GPUs with
    # no measured all-reduce (nccl-tests: ~75-80% on NVLink).
    link: float = Field(0.75, gt=0, le=1)
    allreduce_latency_s: float = Field(20e-6, ge=0)
    # Without NVLink and without PCIe peer-to-peer (the usual case for workstation-class cards in
    # servers), NCCL's SHM transport stages every byte through host memory: it crosses PCIe twice
    # and is copied once on the host, so bus bandwidth is about a quarter of the link rate, with
    # 50-70 us small-message latency. (The Qwen3-32B TP2 vLLM trace is what exposed this term.)
    pcie_link: float = Field(0.25, gt=0, le=1)
    pcie_allreduce_latency_s: float = Field(60e-6, ge=0)
    # Memory held beyond what the engine's memory profile accounts for (`EngineMemory`): 0 for
    # vLLM, whose profile is modelled term by term; a calibration may set it.
    fixed_workspace_gib: float = Field(0.0, ge=0)

    def gpu(self, hardware: str) -> GpuTerms:
        return self.gpus.get(hardware, self.default_gpu)

    def engine(self, name: str, field: str = "engine") -> EngineOverhead:
        if name not in self.engines:
            raise ConfigError(field, name, sorted(self.engines))
        return self.engines[name]

    def updated(self, hardware: str, engine: str, values: dict[str, float]) -> RolloutEfficiency:
        """A copy with GPU-term fields of `hardware` and overhead fields of `engine` replaced."""
        gpu_upd = {k: v for k, v in values.items() if k in GpuTerms.model_fields}
        eng_upd = {k: v for k, v in values.items() if k in EngineOverhead.model_fields}
        unknown = set(values) - set(gpu_upd) - set(eng_upd)
        if unknown:
            raise ConfigError("fields", sorted(unknown), sorted(FIT_FIELDS_ALL))
        gpus = {**self.gpus, hardware: self.gpu(hardware).model_copy(update=gpu_upd)}
        engines = {**self.engines, engine: self.engine(engine).model_copy(update=eng_upd)}
        return self.model_copy(update={"gpus": gpus, "engines": engines})


FIT_FIELDS_ALL = ("bw", "compute", "layer_fixed_s", "attn_fixed_s", "norm_s", "base_overhead_s",
                  "per_seq_overhead_s", "tp_overhead_s", "tp_seq_overhead_s", "layer_kernel_fraction")  # fmt: skip
FRACTIONS = frozenset({"bw", "compute"})


@cache
def shipped_gpu_terms() -> dict[str, GpuTerms]:
    data = load_yaml(_DATA / "gpu_terms.yaml") or {}
    return {
        name: build(GpuTerms, rec, f"gpu_terms.yaml: {name}") for name, rec in data.get("gpus", {}).items()
    }


@cache
def shipped_engines() -> dict[str, EngineOverhead]:
    data = load_yaml(_DATA / "engines.yaml") or {}
    return {
        name: build(EngineOverhead, rec, f"engines.yaml: {name}")
        for name, rec in data.get("engines", {}).items()
    }


def _known_engine(name: str) -> str:
    if name not in shipped_engines():
        raise ValueError(f"an engine preset, one of {sorted(shipped_engines())}")
    return name


# A config field naming an engine preset (a scenario's rollout.engine, the gateway's cost_model.engine).
EngineName = Annotated[str, AfterValidator(_known_engine)]


class TrainEfficiency(_Frozen):
    """Training-side coefficients (Megatron-style 3D parallel training)."""

    # Model FLOPs utilisation of well-tuned Megatron GEMMs on A100/H100: 40-55% (Megatron-LM
    # papers report 52% for 175B on A100); 0.45 leaves room for kernels outside the GEMMs.
    mfu: float = Field(0.45, gt=0, le=1)
    link: float = Field(0.75, gt=0, le=1)
    # Fraction of the DP gradient reduction that hides behind the backward pass.
    dp_overlap: float = Field(0.5, ge=0, le=1)
    # Per micro-batch launch and framework overhead (Python, optimizer hooks).
    per_microbatch_overhead_s: float = Field(5e-3, ge=0)
    fixed_workspace_gib: float = Field(3.0, ge=0)


class Profile(_Frozen):
    """A calibration profile: what `libra costmodel calibrate` writes and `--profile` reads."""

    rollout: RolloutEfficiency = RolloutEfficiency()
    train: TrainEfficiency = TrainEfficiency()
    note: str = ""


def load_profile(path: str | Path | None) -> Profile:
    if path is None:
        return Profile()
    return build(Profile, load_yaml(path), prefix=str(path))


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(profile.model_dump(), sort_keys=False), encoding="utf-8")

"""Efficiency coefficients: the few numbers that turn spec-sheet physics into engine time.

Shipped defaults are honest constants with their source. `libra costmodel calibrate` fits them to
measurements and writes a profile YAML of this same shape, which every command loads with
`--profile FILE`. They are never fitted per test.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from libra.core.config import build, load_yaml


class RolloutEfficiency(BaseModel):
    """How close an inference engine gets to the hardware, and what it spends besides."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    # Decode GEMV and paged-attention kernels on Hopper/Blackwell-class GPUs reach 80-90% of HBM
    # bandwidth (FlashInfer and vLLM kernel benchmarks); 0.85 is the middle of that range.
    bw: float = Field(0.85, gt=0, le=1)
    # Achieved fraction of dense bf16 peak for the GEMMs of a mixed prefill/decode batch. Large
    # prefill GEMMs reach 60-70% MFU; the small decode part of a batch much less, so 0.5.
    compute: float = Field(0.5, gt=0, le=1)
    # NCCL ring all-reduce bus bandwidth relative to the link (nccl-tests: ~75-80% on NVLink).
    link: float = Field(0.75, gt=0, le=1)
    # Latency of one small all-reduce inside an NVLink node (nccl-tests, small messages: 15-30 us).
    allreduce_latency_s: float = Field(20e-6, ge=0)
    # Without NVLink and without PCIe peer-to-peer (the usual case for workstation-class cards in
    # servers), NCCL's SHM transport stages every byte through host memory: it crosses PCIe twice
    # and is copied once on the host, so bus bandwidth is about a quarter of the link rate, with
    # 50-70 us small-message latency. (The Qwen3-32B TP2 vLLM trace is what exposed this term.)
    pcie_link: float = Field(0.25, gt=0, le=1)
    pcie_allreduce_latency_s: float = Field(60e-6, ge=0)
    # Per-iteration CPU work outside the GPU kernels: scheduling, input preparation, sampler and
    # output processing (vLLM profiles show 2-4 ms per step for mid-size batches).
    base_overhead_s: float = Field(2.5e-3, ge=0)
    # Each extra TP worker adds a broadcast of the step's scheduler output and a cross-process
    # barrier (vLLM V1 shared-memory message queue: ~0.3 ms per worker).
    tp_overhead_s: float = Field(0.3e-3, ge=0)
    # CPU cost per running sequence per step: block tables, sampling metadata, detokenisation.
    # vLLM's CPU-bound regime at large batch implies 15-30 us per sequence.
    per_seq_overhead_s: float = Field(20e-6, ge=0)
    # Memory held outside weights and KV: CUDA context, CUDA graphs, NCCL buffers (~1.5 GiB),
    # plus the activation peak that vLLM profiles at max_num_batched_tokens (computed separately).
    fixed_workspace_gib: float = Field(1.5, ge=0)


class TrainEfficiency(BaseModel):
    """Training-side coefficients (Megatron-style 3D parallel training)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    # Model FLOPs utilisation of well-tuned Megatron GEMMs on A100/H100: 40-55% (Megatron-LM
    # papers report 52% for 175B on A100); 0.45 leaves room for kernels outside the GEMMs.
    mfu: float = Field(0.45, gt=0, le=1)
    link: float = Field(0.75, gt=0, le=1)
    # Fraction of the DP gradient reduction that hides behind the backward pass.
    dp_overlap: float = Field(0.5, ge=0, le=1)
    # Per micro-batch launch and framework overhead (Python, optimizer hooks).
    per_microbatch_overhead_s: float = Field(5e-3, ge=0)
    fixed_workspace_gib: float = Field(3.0, ge=0)


class Profile(BaseModel):
    """A calibration profile: what `libra costmodel calibrate` writes and `--profile` reads."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    rollout: RolloutEfficiency = RolloutEfficiency()
    train: TrainEfficiency = TrainEfficiency()
    note: str = ""


def load_profile(path: str | Path | None) -> Profile:
    if path is None:
        return Profile()
    return build(Profile, load_yaml(path), prefix=str(path))


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(profile.model_dump(), sort_keys=False), encoding="utf-8")

"""Training cost model: step time and per-GPU memory for TP/PP/DP/CP and a micro-batch size.

The batch is a list of sequences of varying length (what a rollout produced). Sequences are dealt
to DP ranks longest-first onto the least-loaded rank, then cut into micro-batches. Per rank:
- compute: 6 x matmul params per token (forward + backward), +2 with full recompute, plus the
  causal attention term, which is quadratic in each sequence's length;
- TP: four all-reduces of the micro-batch's activations per layer (two forward, two backward);
- CP: ring exchange of K/V blocks, overlapped with attention except its latency;
- PP: the 1F1B bubble, (pp - 1) extra micro-batch slots, plus activation sends between stages;
  a pp that does not divide the layers gives uneven stages (Megatron's uneven first and last
  stages), and the largest stage, ceil(layers / pp) layers, sets the time and the memory;
- DP: reduce-scatter + all-gather of gradients (distributed optimizer), partly hidden behind the
  backward pass.

The memory model answers "does this fit?" so that no planner emits a configuration that would OOM.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from libra.core.errors import ConfigError
from libra.core.specs import GIB, HardwareSpec, ModelSpec
from libra.costmodel.efficiency import TrainEfficiency


@dataclass(frozen=True, slots=True)
class TrainParallel:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    micro_batch: int = 1
    recompute: bool = True

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def validate(self, hw: HardwareSpec, model: ModelSpec) -> None:
        for name in ("tp", "pp", "dp", "cp", "micro_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "an integer >= 1")
        if self.tp * self.cp > hw.gpus_per_node:
            raise ConfigError("tp", self.tp, f"tp x cp <= gpus_per_node ({hw.gpus_per_node}) of {hw.name}")
        if self.pp > model.layers:
            raise ConfigError("pp", self.pp, f"at most the model's {model.layers} layers")
        if model.heads % self.tp:
            raise ConfigError("tp", self.tp, f"a divisor of the model's {model.heads} attention heads")


@dataclass(frozen=True, slots=True)
class TrainMemory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    workspace: float
    capacity: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.workspace

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True, slots=True)
class TrainEstimate:
    step_time_s: float
    compute_s: float
    tp_comm_s: float
    pp_bubble_s: float
    dp_comm_s: float
    memory: TrainMemory


class TrainCostModel:
    def __init__(self, hw: HardwareSpec, model: ModelSpec, eff: TrainEfficiency | None = None):
        self.hw, self.model, self.eff = hw, model, eff or TrainEfficiency()

    # ---- memory -------------------------------------------------------------------------------

    def memory(self, par: TrainParallel, max_len: int) -> TrainMemory:
        m, e = self.model, self.eff
        stage = stage_layers(m.layers, par.pp)
        shard = m.total_params * stage / m.layers / par.tp
        # bf16 weights; fp32 main gradients; fp32 master weights + Adam m and v sharded over DP*CP.
        weights, grads = 2 * shard, 4 * shard
        optimizer = 12 * shard / (par.dp * par.cp)
        seq = max_len / par.cp
        tokens = par.micro_batch * seq
        if par.recompute:  # only each layer's input survives; one layer is live during recompute
            per_layer = 2 * tokens * m.hidden / par.tp
            act = per_layer * stage * par.pp + self._layer_activation(tokens, par.tp)
        else:  # Korthikanti et al. with flash attention and sequence parallelism: 34 s b h / t
            act = 34 * tokens * m.hidden / par.tp * stage * par.pp
        # 1F1B: the first stage holds pp micro-batches in flight, the (x pp) above.
        logits = 2 * tokens * m.vocab * 4 / par.tp  # fp32 logits and their gradient, vocab-parallel
        cap = self.hw.memory_bytes
        return TrainMemory(weights, grads, optimizer, act, logits, e.fixed_workspace_gib * GIB, cap)

    def _layer_activation(self, tokens: float, tp: int) -> float:
        m = self.model
        width = m.expert_intermediate * m.active_experts if m.is_moe else m.intermediate
        return tokens * (34 * m.hidden + 4 * width) / tp

    # ---- time ---------------------------------------------------------------------------------

    def step(self, par: TrainParallel, seq_lens: list[int]) -> TrainEstimate:
        """Estimate one optimizer step over `seq_lens` (one entry per sequence)."""
        par.validate(self.hw, self.model)
        if not seq_lens:
            raise ConfigError("seq_lens", "[]", "at least one sequence")
        ranks = _deal(tuple(seq_lens), par.dp)
        slowest = max(ranks, key=lambda r: self._rank_flops(r, par))
        n_micro = max(1, -(-len(slowest) // par.micro_batch))
        compute = self._rank_flops(slowest, par) / self._gpu_flops(par)
        compute += n_micro * self.eff.per_microbatch_overhead_s
        tp_comm = self._tp_comm(sum(slowest), par) + self._cp_comm(n_micro, par)
        per_micro = (compute + tp_comm) / n_micro
        bubble = (par.pp - 1) * per_micro + self._pp_comm(sum(slowest), n_micro, par)
        dp_comm = self._dp_comm(par)
        total = compute + tp_comm + bubble + dp_comm * (1 - self.eff.dp_overlap)
        mem = self.memory(par, max(seq_lens))
        return TrainEstimate(total, compute, tp_comm, bubble, dp_comm, mem)

    def _gpu_flops(self, par: TrainParallel) -> float:
        stages = self.model.layers / stage_layers(self.model.layers, par.pp)  # pp, or less when uneven
        return self.hw.bf16_tflops * 1e12 * self.eff.mfu * par.tp * stages * par.cp

    def _rank_flops(self, lens: Sequence[int], par: TrainParallel) -> float:
        m = self.model
        per_tok = (8 if par.recompute else 6) * m.active_matmul_params
        attn = (4 if par.recompute else 3) * 2 * m.layers * m.heads * m.head_dim  # fwd QK+PV=4, /2 causal
        return sum(per_tok * n + attn * n * n for n in lens)

    def _link_bw(self, group: int, crosses_nodes: bool) -> float:
        bw = self.hw.inter_node_bw_gbps if crosses_nodes else self.hw.intra_node_bw_gbps
        return bw * 1e9 * self.eff.link

    def _tp_comm(self, tokens: int, par: TrainParallel) -> float:
        if par.tp == 1:
            return 0.0
        m = self.model
        size = tokens / par.cp * m.hidden * 2
        ring = 2 * (par.tp - 1) / par.tp
        per_layer = 4 * ring * size / self._link_bw(par.tp, False)
        return per_layer * stage_layers(m.layers, par.pp) * (1.33 if par.recompute else 1.0)

    def _cp_comm(self, n_micro: int, par: TrainParallel) -> float:
        if par.cp == 1:
            return 0.0
        stage = stage_layers(self.model.layers, par.pp)
        return n_micro * stage * 3 * (par.cp - 1) * 20e-6  # exposed ring-step latency

    def _pp_comm(self, tokens: int, n_micro: int, par: TrainParallel) -> float:
        if par.pp == 1:
            return 0.0
        size = tokens / par.cp / par.tp * self.model.hidden * 2
        cross = par.tp * par.cp * par.pp > self.hw.gpus_per_node
        return 2 * size / self._link_bw(2, cross)

    def _dp_comm(self, par: TrainParallel) -> float:
        group = par.dp * par.cp
        if group == 1:
            return 0.0
        m = self.model
        grad_bytes = 2 * m.total_params * stage_layers(m.layers, par.pp) / m.layers / par.tp  # bf16
        cross = par.gpus > self.hw.gpus_per_node
        return 2 * (group - 1) / group * grad_bytes / self._link_bw(group, cross)


def stage_layers(layers: int, pp: int) -> int:
    """Layers of a pipeline's largest stage: ceil(layers / pp). Megatron spreads layers that pp
    does not divide over uneven first and last stages; the largest stage sets the step's time and
    the memory a GPU needs."""
    return -(-layers // pp)


def sequences_per_micro_batch(seq_lens: Sequence[int], max_tokens: int) -> int:
    """How many sequences a trainer that packs micro-batches by a padded-token budget (the built-in
    trainer's `micro_batch_tokens`) puts in one: the budget over the longest sequence, at least one."""
    return max(1, max_tokens // max(seq_lens))


@functools.lru_cache(maxsize=256)
def _deal(lens: tuple[int, ...], dp: int) -> tuple[tuple[int, ...], ...]:
    """Longest-first onto the rank with the fewest quadratic-weighted tokens (balanced FLOPs).

    Cached: the planner prices one step's lengths under hundreds of layouts that share a DP size."""
    ranks: list[list[int]] = [[] for _ in range(dp)]
    heap = [(0.0, i) for i in range(dp)]  # (load, rank): ties go to the lowest rank
    for n in sorted(lens, reverse=True):
        load, i = heap[0]
        ranks[i].append(n)
        heapq.heapreplace(heap, (load + n + n * n / 8192, i))
    return tuple(tuple(r) for r in ranks)

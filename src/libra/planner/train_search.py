"""Training side of the planner: a pruned search over TP / PP / DP / CP and micro-batch size.

The space is small enough to enumerate but each step estimate deals the whole batch over DP
ranks, so the search prunes before it estimates:
- TP is a power of two inside one node that divides the attention heads; PP splits the layers
  into stages at most `MAX_STAGE_PADDING` uneven (Megatron's uneven first and last stages: 40
  layers in 3 stages of 14, 13 and 13 are priced as 3 x 14), which lets a 40-layer model train on
  a GPU count with a factor of 3, such as 24;
- DP divides the GRPO groups (`prompts_per_step % dp == 0`), so every rank receives whole groups
  and the same number of samples, and the micro-batch divides the samples per rank;
- CP is used only when the context needs it: the smallest CP at which the memory model says the
  configuration fits at the context bound (EARL: lengthen context by parallelism, never truncate);
- the memory model (`TrainCostModel.memory(...).fits`) is a hard constraint;
- a closed-form 1F1B bubble (pp-1)/(m+pp-1) over m micro-batches prunes deep pipelines before any
  estimate; after the estimate, configurations whose bubble or exposed communication exceeds the
  configured fraction of the step are pruned too.

The result is the best configuration for each exact GPU count, and the Pareto frontier over GPU
counts (more GPUs must buy a shorter step, or the split search never wants them).
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.costmodel.training import TrainCostModel, TrainEstimate, TrainParallel, stage_layers
from libra.planner.config import PlannerConfig
from libra.planner.problem import PlanningProblem


@dataclass(frozen=True, slots=True)
class TrainChoice:
    par: TrainParallel
    time_s: float
    estimate: TrainEstimate


@dataclass(slots=True)
class PruneCounts:
    """Why candidates were dropped; named in the error when nothing is left."""

    enumerated: int = 0
    memory: int = 0
    too_many_gpus: int = 0
    bubble: int = 0
    comm: int = 0
    dominated: int = 0
    evaluated: int = 0

    def describe(self) -> str:
        return (
            f"{self.enumerated} candidates: {self.memory} do not fit in memory, {self.too_many_gpus} need "
            f"more GPUs than allowed, {self.bubble} have too large a pipeline bubble, {self.comm} spend "
            f"too much on communication, {self.dominated} are dominated"
        )


def divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0 and d <= n]


# The most the largest pipeline stage may exceed an even split: pp x ceil(layers / pp) <= layers
# x (1 + this). Past it the other stages idle a tenth of each micro-batch's slot.
MAX_STAGE_PADDING = 0.1


def pipeline_depths(layers: int, max_pp: int) -> list[int]:
    """PP degrees whose largest stage is within `MAX_STAGE_PADDING` of an even split."""
    return [
        pp
        for pp in range(1, min(max_pp, layers) + 1)
        if pp * stage_layers(layers, pp) <= layers * (1 + MAX_STAGE_PADDING)
    ]


class TrainSearch:
    """Best training configuration per GPU count, for one problem; reusable across steps."""

    __slots__ = ("problem", "config", "cm", "counts")

    def __init__(self, problem: PlanningProblem, config: PlannerConfig | None = None):
        self.problem, self.config = problem, config or PlannerConfig()
        self.cm: TrainCostModel = problem.train_model()
        self.counts = PruneCounts()

    def shapes(self) -> list[tuple[int, int, int, int]]:
        """(tp, pp, dp, micro_batch) that meet every divisibility rule, before memory."""
        p, c = self.problem, self.config
        tps = [t for t in c.train_tp if p.tp_allowed(t)]
        pps = pipeline_depths(p.model.layers, c.max_pp)
        out = []
        for dp in divisors(p.prompts_per_step):
            per_rank = p.batch_size // dp
            mbs = [mb for mb in c.micro_batches if per_rank % mb == 0]
            out += [(tp, pp, dp, mb) for tp in tps for pp in pps for mb in mbs]
        return out

    def fitting_cp(self, tp: int, pp: int, dp: int, mb: int, context: int) -> TrainParallel | None:
        """The configuration with the smallest CP that fits `context` tokens, or None."""
        cp, per_node = 1, self.problem.hw.gpus_per_node
        # A TP x CP group shares a node and must tile it (see plan.pack), so it divides the node.
        while cp <= self.config.max_cp and per_node % (tp * cp) == 0:
            par = TrainParallel(tp=tp, pp=pp, dp=dp, cp=cp, micro_batch=mb)
            if self.cm.memory(par, context).fits:
                return par
            cp *= 2
        return None

    def candidates(self, context: int, max_gpus: int) -> list[TrainParallel]:
        """Configurations that fit in memory on at most `max_gpus`, after the closed-form prunes."""
        n_samples, out, counts = self.problem.batch_size, {}, self.counts
        for tp, pp, dp, mb in self.shapes():
            counts.enumerated += 1
            if tp * pp * dp > max_gpus:
                counts.too_many_gpus += 1
                continue
            par = self.fitting_cp(tp, pp, dp, mb, context)
            if par is None:
                counts.memory += 1
            elif par.gpus > max_gpus:
                counts.too_many_gpus += 1
            elif _bubble_bound(pp, n_samples // dp // mb) > self.config.max_bubble_fraction:
                counts.bubble += 1
            else:
                key = (tp, pp, dp, par.cp, mb if pp > 1 else 0)
                # Without a pipeline, a larger micro-batch only saves per-micro-batch overhead
                # (no bubble to grow), so of those that fit only the largest is worth estimating.
                if key not in out or mb > out[key].micro_batch:
                    counts.dominated += key in out
                    out[key] = par
                else:
                    counts.dominated += 1
        return list(out.values())

    def evaluate(self, par: TrainParallel, lengths: list[int]) -> TrainChoice | None:
        """Estimate one step; None when the estimate shows too much bubble or communication."""
        est = self.cm.step(par, lengths)
        self.counts.evaluated += 1
        exposed = est.tp_comm_s + est.dp_comm_s * (1 - self.cm.eff.dp_overlap)
        if est.pp_bubble_s > self.config.max_bubble_fraction * est.step_time_s:
            self.counts.bubble += 1
            return None
        if exposed > self.config.max_comm_fraction * est.step_time_s:
            self.counts.comm += 1
            return None
        return TrainChoice(par, est.step_time_s, est)

    def best_per_gpus(self, lengths: list[int], context: int, max_gpus: int) -> dict[int, TrainChoice]:
        """For each GPU count that some surviving configuration uses exactly, its fastest one."""
        self.counts = PruneCounts()
        best: dict[int, TrainChoice] = {}
        for par in self._shortlist(self.candidates(context, max_gpus), lengths):
            choice = self.evaluate(par, lengths)
            if choice is None:
                continue
            old = best.get(par.gpus)
            if old is None or (choice.time_s, _size_key(choice.par)) < (old.time_s, _size_key(old.par)):
                best[par.gpus] = choice
        return best

    def _shortlist(self, cands: list[TrainParallel], lengths: list[int]) -> list[TrainParallel]:
        """On large batches, rank each GPU count's candidates on a quantile sample of the batch and
        keep the best few for the full estimate.

        A step estimate deals every sequence over the DP ranks, so at 8192 sequences it costs
        ~10-20 ms; ranking on `rank_sample` sequences is ~10x cheaper and the exact estimate of the
        `exact_per_count` best corrects any ranking error among the leaders.
        """
        k, m = self.config.exact_per_count, self.config.rank_sample
        if len(lengths) <= m:
            return cands
        srt = sorted(lengths)
        sample = [srt[int((i + 0.5) * len(srt) / m)] for i in range(m)]
        by_gpus: dict[int, list[tuple[float, TrainParallel]]] = {}
        for par in cands:
            t = self.cm.step(par, sample).step_time_s if par.dp * 4 <= m else 0.0  # too few to rank: keep
            by_gpus.setdefault(par.gpus, []).append((t, par))
        out = []
        for group in by_gpus.values():
            group.sort(key=lambda tp: tp[0])
            out += [p for _, p in group[:k]]
            self.counts.dominated += max(0, len(group) - k)
        return out


def frontier(best: dict[int, TrainChoice]) -> dict[int, TrainChoice]:
    """Keep a GPU count only if it trains faster than every smaller count."""
    out, fastest = {}, float("inf")
    for g in sorted(best):
        if best[g].time_s < fastest:
            out[g], fastest = best[g], best[g].time_s
    return out


def _bubble_bound(pp: int, micro_batches: int) -> float:
    """1F1B idles (pp - 1) slots out of (m + pp - 1) per stage."""
    return (pp - 1) / (max(1, micro_batches) + pp - 1)


def _size_key(par: TrainParallel) -> tuple:
    # Between equal times prefer smaller model-parallel groups: cheaper to reshard and to borrow.
    return (par.tp * par.pp * par.cp, par.micro_batch)

"""Rollout side of the planner: the makespan of a length range, and the bucket-layout DP.

**Range estimate.** A contiguous range of the length-sorted batch, served by `n` engines of TP
`t`, finishes after the larger of two bounds (Graham's two lower bounds on a makespan):
- the *work bound*: the range's decode tokens at the throughput of one engine at the batch its
  KV cache admits (min of max_num_seqs, the range's trajectories per engine, and KV capacity over
  the mean decode context), plus its prefill tokens (prompts and tool returns) at the chunked
  prefill cost per token, shared over n engines;
- the *latency floor*: the slowest trajectory's serial time, its own decode iterations at the
  iteration time x plus its tool latencies, D * x + S. Iterations are faster at larger TP, which
  is why long trajectories want large TP even where small TP has more throughput per GPU. Which
  trajectory is slowest depends on x, so each range keeps three champion lines (most decode, most
  tool time, most D * 30 ms + S; see `stats.champions`) and takes the largest. The batch drains as
  the bulk finishes: while the work bound W lasts the straggler runs at the full batch (serial
  time F), after it at `tail_fraction` of the batch (serial time F'), so the floor is
  W + (1 - W / F) * F' when F > W. `PlannerConfig.tail_fraction` (0.5) is calibrated against the
  simulator; docs/planner.md gives the error table and the command that measures it.
Iteration times come from `RolloutCostModel.step_time` itself: a decode step is exactly
A(batch) + K * (summed context), so A is tabulated per batch size and K read off once, which lets
numpy evaluate thousands of ranges at once without a second copy of the model.

**DP.** Requests sorted by recent final length are cut into B quantile bins (`PlannerConfig.bins`,
32 by default). dp[g][i] is the least makespan of the first i bins on at most g GPUs; a transition
adds a group of n engines of one TP t serving bins (j, i]:

    dp[g][i] = min(dp[g-1][i], min over t, j, n of max(dp[g - n*t][j], cost(t, n, j, i)))

With n = 1 this is the paper's recurrence; letting a transition add n identical engines lets one
bucket hold many engines without needing as many bins as engines. dp[g - n*t][j] grows with n and
cost(t, n, j, i) shrinks, so the best n is where they cross, found by a galloping search for
all (t, j, i) at once. The table carries a third index so TP never falls as length grows (see
`LayoutDP`). Rows are memoised per GPU budget: asking for a larger budget extends the table, and
every split the planner tries reads its rollout time from the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra.core.errors import InfeasibleError
from libra.planner.problem import PlanningProblem
from libra.planner.stats import LINES, X_REF_S, LengthBins

INF = float("inf")


class EngineTables:
    """Per allowed TP: KV capacity, decode-step coefficients and prefill cost per token."""

    __slots__ = ("tps", "kvcap", "A", "K", "_pf_grid", "_pf", "max_num_seqs", "tail_fraction", "kv_headroom",
                 "kv_share")  # fmt: skip

    def __init__(
        self, problem: PlanningProblem, tps: list[int], tail_fraction: float = 0.5, kv_headroom: float = 0.75
    ):
        self.tail_fraction, self.kv_headroom = tail_fraction, kv_headroom
        self.kv_share = RESIDENT * max(1.0, (problem.staleness + 1) / 2)
        self.tps = np.asarray([t for t in tps if problem.tp_allowed(t)], dtype=np.int64)
        self.max_num_seqs = problem.max_num_seqs
        models = [problem.rollout_model(int(t)) for t in self.tps]
        self.kvcap = np.asarray([m.kv_capacity_tokens() for m in models], dtype=np.float64)
        batches = range(problem.max_num_seqs + 1)
        self.A = np.asarray([[m.step_time(0, 0.0, b, 0.0) for b in batches] for m in models])
        probe = 1e6
        self.K = (
            np.asarray([m.step_time(0, 0.0, 1, probe) - m.step_time(0, 0.0, 1, 0.0) for m in models]) / probe
        )
        self._pf_grid = np.linspace(0, max(problem.max_length, 1), 17)
        self._pf = np.asarray([[_prefill_per_token(m, c) for c in self._pf_grid] for m in models])

    def __len__(self) -> int:
        return len(self.tps)

    def prefill_per_token(self, ti: int, ctx: np.ndarray) -> np.ndarray:
        return np.interp(ctx, self._pf_grid, self._pf[ti])

    def batch_cap(self, ti: np.ndarray, kv_ctx: np.ndarray) -> np.ndarray:
        """Trajectories an engine keeps going at once: max_num_seqs, capped by KV capacity.

        An agent's KV stays resident between its turns (evicting it means prefilling the whole
        context again), so each trajectory is charged its final length, not its mean context.
        """
        return np.clip(np.floor(self.kvcap[ti] / np.maximum(kv_ctx, 1.0)), 1, self.max_num_seqs)

    def range_cost(self, ti, n, r: RangeArrays, pf, bcap) -> np.ndarray:
        """Makespan of ranges `r` on n engines of TP index ti (all arrays broadcast together)."""
        work, x_busy, x_tail, b = self._work(ti, n, r, pf, bcap)
        full = _slowest(r, x_busy)  # slowest trajectory per step while the engine is busy ...
        tail = _slowest(r, x_tail)  # ... and once the batch has drained
        w = work[..., None]
        drained = np.where(full > w, w + (1 - w / np.maximum(full, 1e-12)) * tail, full)
        floor = (drained * r.present).sum(axis=-1) / np.maximum(r.present.sum(axis=-1), 1.0)
        # The trajectories an engine carries keep their KV between turns (charged here at their final
        # length); if together they outgrow the cache, the engine preempts and recomputes over and
        # over (vLLM admits on the blocks free now, not on those a sequence will need). Past
        # `kv_headroom` the estimate grows as the fourth power of the overload: steep, so the search
        # steers clear, yet overloaded layouts still rank when nothing else fits. Measured in the
        # simulator's pipeline (staleness 1): Search-R1's short bucket on TP1 engines ran clean at
        # 0.6 of the cache per batch and preempted 147 times at 0.9.
        # A trajectory holds its final length only at its end: from its prompt its context grows,
        # so over its life it holds about half of it, while a staleness bound s lets s + 1
        # batches overlap (`kv_share`). Charged a whole final length per trajectory of one batch,
        # R2E-Gym late in training (64 x 16, s = 1) was priced 4-5x slower on 24 rollout GPUs than
        # it ran: the simulator's engines held at most half of that (p90 of committed KV), with
        # no preemption; at s = 2 they held 0.76-1.3 of it.
        makespan = np.maximum(work, floor)
        demand = (
            np.ceil(r.count / np.minimum(n, np.maximum(1.0, np.ceil(r.count)))) * r.kv_ctx * self.kv_share
        )
        over = np.maximum(1.0, demand / (self.kv_headroom * self.kvcap[ti]))
        return makespan * over**4

    def range_work(self, ti, n, r: RangeArrays, pf, bcap) -> np.ndarray:
        """The work bound alone: the seconds the engines are busy with the range's tokens."""
        return self._work(ti, n, r, pf, bcap)[0]

    def _work(self, ti, n, r: RangeArrays, pf, bcap):
        n_eff = np.minimum(n, np.maximum(1.0, np.ceil(r.count)))  # an engine with no work adds nothing
        b = np.clip(np.ceil(r.count / n_eff), 1, bcap).astype(np.int64)
        x = self.A[ti, b] + self.K[ti] * b * r.ctx
        work = (r.gen * x / b + r.prefill * pf) / n_eff
        # While the engine is busy, each decode iteration also carries its share of the other
        # trajectories' prefill chunks (prompts, tool returns): the iteration a straggler sees.
        x_busy = x + r.prefill * pf * b / np.maximum(r.gen, 1.0)
        bt = np.maximum(1, (b * self.tail_fraction).astype(np.int64))
        x_tail = self.A[ti, bt] + self.K[ti] * bt * r.ctx
        return work, x_busy, x_tail, b


# The share of its final length a trajectory's KV holds over its life (its context grows from the
# prompt); with staleness s the KV-pressure term charges each trajectory of a range
# RESIDENT x max(1, (s + 1) / 2) of it (`EngineTables.kv_share`).
RESIDENT = 0.5


def _slowest(r: RangeArrays, x: np.ndarray) -> np.ndarray:
    """Per (range, step): the largest of the champion lines gen * x + tool at iteration time x.

    An explicit maximum over the few lines: numpy's reduce along a trailing axis of length 3 is
    about 8x slower, and this sits in the planner's innermost loop."""
    x = x[..., None]
    out = r.line_gen[..., 0] * x + r.line_tool[..., 0]
    for k in range(1, LINES):
        np.maximum(out, r.line_gen[..., k] * x + r.line_tool[..., k], out=out)
    return out


def _prefill_per_token(model, ctx: float) -> float:
    """Marginal prefill seconds per token for a full chunk attending to `ctx` earlier tokens."""
    c = model.max_num_batched_tokens
    return model.step_time(c, c * ctx + c * (c + 1) / 2, 0, 0.0) / c


@dataclass(frozen=True, slots=True)
class RangeArrays:
    """Aggregates of ranges of the sorted batch (one row per range)."""

    count: np.ndarray
    gen: np.ndarray
    prefill: np.ndarray
    ctx: np.ndarray  # generated-token weighted mean context while decoding: attention cost
    kv_ctx: np.ndarray  # mean final length: the KV each trajectory holds by its end
    tool: np.ndarray  # mean tool seconds per trajectory
    line_gen: np.ndarray  # (ranges, steps, LINES): champion trajectories' generated tokens ...
    line_tool: np.ndarray  # ... and their tool seconds (stats.champion_lines)
    present: np.ndarray  # (ranges, steps): 1 where the step has a trajectory in the range
    max_context: np.ndarray

    def take(self, idx: np.ndarray) -> RangeArrays:
        return RangeArrays(*(getattr(self, f)[idx] for f in self.__slots__))


def all_ranges(bins: LengthBins, max_length: int) -> tuple[np.ndarray, np.ndarray, RangeArrays]:
    """Every range (j, i] of bins, 0 <= j < i <= B, with its aggregates (prefix sums and champions)."""
    B = len(bins)
    jj, ii = np.triu_indices(B + 1, k=1)
    cs = {
        k: np.concatenate([[0.0], np.cumsum(getattr(bins, k))])
        for k in ("count", "gen", "prefill", "gen_ctx", "final", "tool")
    }
    seg = {k: cs[k][ii] - cs[k][jj] for k in cs}
    # Per step, each line's champion over the range is the bin whose champion scores highest on it.
    g, t = bins.line_gen, bins.line_tool
    score = np.stack([g[:, :, 0], t[:, :, 1], g[:, :, 2] * X_REF_S + t[:, :, 2]], axis=2)  # (B, S, L)
    S = score.shape[1]
    win = np.stack(
        [np.stack([_range_argmax(score[:, s, k], jj, ii) for k in range(LINES)], axis=1) for s in range(S)],
        axis=1,
    )  # (E, S, L): the winning bin
    s_idx, k_idx = np.arange(S)[None, :, None], np.arange(LINES)[None, None, :]
    line_gen, line_tool = g[win, s_idx, k_idx], t[win, s_idx, k_idx]
    cp = np.concatenate([np.zeros((1, S)), np.cumsum(bins.present, axis=0)])
    present = (cp[ii] - cp[jj] > 0).astype(np.float64)
    # The last range is the catch-all bucket: it must hold anything up to the length limit.
    maxctx = np.where(ii == B, float(max_length), bins.final_max[ii - 1])
    ctx = seg["gen_ctx"] / np.maximum(seg["gen"], 1e-9)
    kv_ctx = seg["final"] / np.maximum(seg["count"], 1e-9)
    tool = seg["tool"] / np.maximum(seg["count"], 1e-9)
    arrays = RangeArrays(
        seg["count"], seg["gen"], seg["prefill"], ctx, kv_ctx, tool, line_gen, line_tool, present, maxctx
    )
    return jj, ii, arrays


def _range_argmax(values: np.ndarray, jj: np.ndarray, ii: np.ndarray) -> np.ndarray:
    """For each range (j, i], the index of its largest value (the first on ties)."""
    B = len(values)
    table = np.zeros((B + 1, B + 1), dtype=np.int64)
    for j in range(B):
        best = j
        for i in range(j + 1, B + 1):
            if values[i - 1] > values[best]:
                best = i - 1
            table[j, i] = best
    return table[jj, ii]


LOWER, CARRY = -2, -1  # choices that are not a range: "all TPs are smaller", "one GPU fewer"


class LayoutDP:
    """dp[g][i][c] over quantile bins, extended lazily per GPU budget (the memo).

    The third index makes TP strictly increase with length, one bucket per TP: dp[g][i][c] is the
    least makespan of the first i bins on at most g GPUs using only TPs before column c (column 0
    allows none, column t + 1 allows tps[0..t]). A range of TP tps[t] therefore extends a layout
    from column t. Routers order buckets by max_context and only ever migrate a request to a larger
    bucket, so a layout whose TP fell as length grew would send long requests to small engines;
    and a bucket is one pool of one TP, so two ranges of one TP would be one bucket anyway.
    """

    __slots__ = ("tables", "B", "T", "jj", "ii", "tpv", "ti", "r", "pf", "bcap", "dp", "ch_e", "ch_n",
                 "seg_start", "seg_of", "seg_i", "seg_t", "cross")  # fmt: skip

    def __init__(
        self,
        tables: EngineTables,
        bins: LengthBins,
        max_length: int,
        min_concurrent: int,
        tps: list[int],
        min_bins: int = 1,
        min_ratio: float = 1.0,
    ):
        self.tables, self.B, self.T = tables, len(bins), len(tables)
        jj, ii, r = all_ranges(bins, max_length)
        E = len(jj)
        ti = np.repeat(np.arange(self.T), E)
        jj, ii, r = np.tile(jj, self.T), np.tile(ii, self.T), r.take(np.tile(np.arange(E), self.T))
        # Only the TPs the configuration allows, and never one whose KV cannot hold the range.
        ok = np.isin(tables.tps[ti], tps) & (tables.kvcap[ti] >= min_concurrent * r.max_context)
        ok &= bucket_shape_ok(bins, jj, ii, r, min_bins, min_ratio)
        order = np.flatnonzero(ok)
        order = order[np.lexsort((jj[order], ti[order], ii[order]))]  # grouped by (i, t) for reduceat
        self.ti, self.jj, self.ii, self.r = ti[order], jj[order], ii[order], r.take(order)
        self.tpv = tables.tps[self.ti]
        self.pf = np.zeros(len(self.ti))
        for t in range(self.T):
            sel = self.ti == t
            self.pf[sel] = tables.prefill_per_token(t, self.r.ctx[sel])
        self.bcap = tables.batch_cap(self.ti, self.r.kv_ctx)
        self.cross = np.ones(len(self.ti), dtype=np.int64)  # per element: the last row's crossing n
        key = self.ii * self.T + self.ti
        self.seg_start = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.zeros(0, int)
        self.seg_of = np.cumsum(np.r_[False, key[1:] != key[:-1]]) if len(key) else key
        self.seg_i, self.seg_t = self.ii[self.seg_start], self.ti[self.seg_start]
        self.dp = np.full((1, self.B + 1, self.T + 1), INF)
        self.dp[0, 0, :] = 0.0
        self.ch_e = np.full((1, self.B + 1, self.T + 1), CARRY, dtype=np.int64)
        self.ch_n = np.zeros((1, self.B + 1, self.T + 1), dtype=np.int64)

    @property
    def budget(self) -> int:
        return len(self.dp) - 1

    def best(self, g: int) -> float:
        self.extend(g)
        return float(self.dp[g, self.B, self.T])

    def extend(self, g: int) -> None:
        """Compute rows budget+1 .. g; rows already there are reused untouched."""
        start = len(self.dp)
        if g < start:
            return
        shape = (g + 1 - start, self.B + 1, self.T + 1)
        self.dp = np.concatenate([self.dp, np.full(shape, INF)])
        self.ch_e = np.concatenate([self.ch_e, np.full(shape, CARRY, dtype=np.int64)])
        self.ch_n = np.concatenate([self.ch_n, np.zeros(shape, dtype=np.int64)])
        for row in range(start, g + 1):
            self._row(row)

    def _cost(self, n: np.ndarray) -> np.ndarray:
        return self.tables.range_cost(self.ti, n, self.r, self.pf, self.bcap)

    def _value(self, g: int, n: np.ndarray) -> np.ndarray:
        prev = self.dp[np.maximum(g - n * self.tpv, 0), self.jj, self.ti]
        return np.maximum(prev, self._cost(n))

    def _crossed(self, g: int, n: np.ndarray) -> np.ndarray:
        """cost(n) <= dp[g - n t][j][t]: from here on, more engines stop paying for themselves."""
        return self._cost(n) <= self.dp[np.maximum(g - n * self.tpv, 0), self.jj, self.ti]

    def _row(self, g: int) -> None:
        self.dp[g] = self.dp[g - 1]  # "carry": the best on g-1 GPUs, leaving one unused
        self.dp[g, 0, :] = 0.0
        if not len(self.tpv):
            return
        n, val = self._best_n(g)
        self._commit(g, val, n)

    def _best_n(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """For each (t, j, i): the n where max(dp[g - n t][j][t], cost(n)) is least.

        The crossing (first n with cost(n) <= dp[g - n t][j]) never moves down as g grows, since
        dp only falls with more GPUs; so the search gallops up from last row's crossing and then
        bisects, a few vectorised steps per row instead of log2(g).
        """
        nmax = g // self.tpv
        lo = np.minimum(self.cross, nmax + 1)
        hi = np.where(lo > nmax, nmax + 1, -1)
        step, open_ = np.ones_like(lo), lo <= nmax
        while open_.any():
            probe = np.maximum(np.minimum(lo + step - 1, nmax), 1)
            ok = self._crossed(g, probe)
            hit, end = open_ & ok, open_ & ~ok & (probe >= nmax)
            hi = np.where(hit, probe, np.where(end, nmax + 1, hi))
            lo = np.where(open_ & ~ok, probe + 1, lo)
            step, open_ = step * 2, open_ & ~hit & ~end
        while True:
            open_ = lo < hi
            if not open_.any():
                break
            mid = np.maximum(np.where(open_, (lo + hi) // 2, np.minimum(lo, nmax)), 1)
            ok = self._crossed(g, mid)
            hi, lo = np.where(open_ & ok, mid, hi), np.where(open_ & ~ok, mid + 1, lo)
        self.cross = lo
        n1 = np.maximum(np.minimum(lo, nmax), 1)
        n0 = np.maximum(lo - 1, 1)
        v1 = self._value(g, n1)
        v0 = np.where(lo - 1 >= 1, self._value(g, n0), INF)
        use0 = v0 < v1
        val = np.where(nmax >= 1, np.minimum(v0, v1), INF)
        return np.where(use0, n0, n1), val

    def _commit(self, g: int, val: np.ndarray, n: np.ndarray) -> None:
        """Per (i, t): the best range ending at i with TP t, against carry and all-smaller-TP."""
        if not len(val):
            return
        seg_min = np.minimum.reduceat(val, self.seg_start)
        first = np.flatnonzero(val == seg_min[self.seg_of])
        _, at = np.unique(self.seg_of[first], return_index=True)
        winner = first[at]  # first element reaching its segment's minimum
        new = np.full((self.B + 1, self.T + 1), INF)
        new_e = np.full((self.B + 1, self.T + 1), CARRY, dtype=np.int64)
        new[self.seg_i, self.seg_t + 1] = seg_min
        new_e[self.seg_i, self.seg_t + 1] = winner
        row, ch_e, ch_n = self.dp[g], self.ch_e[g], self.ch_n[g]
        ch_e[:], ch_n[:] = CARRY, 0
        for c in range(1, self.T + 1):
            lower = row[:, c - 1] < row[:, c]  # ties keep the carry: fewer GPUs
            row[:, c] = np.where(lower, row[:, c - 1], row[:, c])
            ch_e[:, c] = np.where(lower, LOWER, ch_e[:, c])
            better = new[:, c] < row[:, c]  # ties keep smaller TPs
            better[0] = False
            row[:, c] = np.where(better, new[:, c], row[:, c])
            ch_e[:, c] = np.where(better, new_e[:, c], ch_e[:, c])
            ch_n[:, c] = np.where(better, n[np.maximum(new_e[:, c], 0)], ch_n[:, c])

    def ranges(self, g: int) -> list[tuple[int, int, int, int]]:
        """(tp, instances, j, i) of the best layout on at most g GPUs, shortest range first."""
        self.extend(g)
        c = self.T
        if not np.isfinite(self.dp[g, self.B, c]):
            raise InfeasibleError(f"no rollout layout on {g} GPUs holds the batch (KV capacity too small)")
        out, i = [], self.B
        while i > 0:
            e = int(self.ch_e[g, i, c])
            if e == LOWER:
                c -= 1
            elif e == CARRY:
                g -= 1
            else:
                n = int(self.ch_n[g, i, c])
                out.append((int(self.tpv[e]), n, int(self.jj[e]), i))
                g, i, c = g - n * int(self.tpv[e]), int(self.jj[e]), int(self.ti[e])
        return out[::-1]


def bucket_shape_ok(
    bins: LengthBins, jj: np.ndarray, ii: np.ndarray, r: RangeArrays, min_bins: int, min_ratio: float
) -> np.ndarray:
    """Which ranges (j, i] may be a bucket: a routable share of the batch, and wide enough.

    - At least `min_bins` bins: a bucket narrower than that could not be routed to reliably.
    - A max context at least `min_ratio` x the previous bucket's: a router sees a trajectory's
      length grow and predicts its final length only to within a spread, so boundaries close
      together make it migrate between buckets it cannot tell apart (C-MLFQ on search-r1 moved
      0.71 of its tokens between boundaries 1K apart; docs/planner.md, "Bucket shape"). The last
      bucket is exempt: its max context is the length limit, not a boundary a router decides on.
    """
    lower = np.where(jj > 0, bins.final_max[np.maximum(jj - 1, 0)], 0.0)
    wide = (r.max_context >= min_ratio * lower) | (ii == len(bins))
    return (ii - jj >= min(min_bins, len(bins))) & wide


def fit_boundaries(
    tables: EngineTables,
    bins: LengthBins,
    max_length: int,
    engines: list[tuple[int, int]],
    min_concurrent: int,
    min_bins: int = 1,
    min_ratio: float = 1.0,
) -> list[int] | None:
    """Bin cut points for fixed buckets ((tp, instances), shortest first) that minimise the makespan.

    Moving a boundary costs nothing (it is a router threshold), so before a new layout is compared
    with the current one, the current one gets its best boundaries for the new statistics; a
    candidate then wins only by changing what costs a restart. Returns the i of each range end
    (the last is B), or None when no cut fits every bucket's KV capacity.
    """
    B, K = len(bins), len(engines)
    if K > B:
        return None
    jj, ii, r = all_ranges(bins, max_length)
    shaped, last = bucket_shape_ok(bins, jj, ii, r, min_bins, min_ratio), ii == B  # the same for every bucket
    f = np.full((K + 1, B + 1), INF)
    arg = np.zeros((K + 1, B + 1), dtype=np.int64)
    f[0, 0] = 0.0
    for k, (tp, n) in enumerate(engines, 1):
        hits = np.flatnonzero(tables.tps == tp)
        if not len(hits):
            return None
        ti = np.full(len(jj), hits[0])
        cost = tables.range_cost(
            ti, np.full(len(jj), n), r, _pf(tables, ti, r.ctx), tables.batch_cap(ti, r.kv_ctx)
        )
        ok = (tables.kvcap[ti] >= min_concurrent * r.max_context) & shaped
        ok &= last == (k == K)  # only the last bucket ends at B
        val = np.where(ok, np.maximum(f[k - 1, jj], cost), INF)
        for i in range(1, B + 1):
            sel = np.flatnonzero(ii == i)
            best = sel[np.argmin(val[sel])]
            f[k, i], arg[k, i] = val[best], jj[best]
    if not np.isfinite(f[K, B]):
        return None
    ends, i = [], B
    for k in range(K, 0, -1):
        ends.append(i)
        i = int(arg[k, i])
    return ends[::-1]


def _pf(tables: EngineTables, ti: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    return tables.prefill_per_token(int(ti[0]), ctx) if len(ti) else np.zeros(0)

"""Robust C-MLFQ (`cmlfq`) and the current-length prior (`context-prior`) it is measured against.

Why the published design needs help: on long real agent trajectories the exact path of tool
states is unique after a few turns, so the causal tree's lookup falls back to shallow nodes. An
ancestor's remaining length was measured turns earlier, at a smaller context, over trajectories
that have little in common with this one, and the prediction is no better than reacting to the
current length. This router keeps the tree and the bucket semantics and changes three things.

**What predicts the final length** (`predictor.py`): a distribution of log(final / context), so
every prediction is conditioned on the current context, from these inputs (`features`):
- `context`: the current context length;
- `progress`: turns, failures, tool-return tokens and generated tokens so far — the aggregated
  back-off of a path that has become unique;
- `last`: the last tool return's size class and status (the recent suffix);
- `siblings`: the GRPO group in this step (the finished siblings' lengths, the share of the group
  finished, how far the longest running sibling has got) and the prompt's earlier final lengths.
The causal tree contributes where it is trustworthy: the node of the *exact* path (global, and
the prompt's own) is mixed in with weight n / (n + tree_prior); an ancestor is never used for a
trajectory that has moved past it. The regression is refit after every step from the router's own
past decisions, with the inputs exactly as it saw them then. Before the first fit (cold start) it
routes like the paper, on the tree alone, and stays put when the tree is empty.

**When to move** (`rule: gain`). The candidate is the bucket the trajectory most likely ends in.
The move is made when the probability it adds to being in the right bucket, times the tokens still
to come (predicted mean final minus context), is at least `move_cost` times the move's net cost:
the context moved now, less the forced moves it saves (a trajectory that outgrows its bucket is
moved anyway, later, with a bigger context). So a trajectory about to finish is left alone, a
confident early prediction moves while the context is small, and a coin flip does not move.
`move_cost` is the exchange rate between migrated tokens and tokens served in the right bucket.
`rule: mean-p90` applies the paper's rule to this predictor instead, to measure the two apart.

**Where to start** (`start: predicted`). A first turn has no KV cache, so placing it is free: it
goes to the bucket it most likely ends in, by a small model of the prompt's length and history.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field

from libra.rollout.base import FinishedTrajectory, RouteRequest
from libra.rollout.cmlfq import TreeParams, TreeRouterBase, mean_p90_rule
from libra.rollout.features import (
    FEATURE_GROUPS,
    MAX_PENDING,
    START,
    START_WIDTH,
    TOOL_RETURN,
    Featurizer,
    SiblingBook,
)
from libra.rollout.predictor import (
    LogLinearModel,
    Prediction,
    RowBuffer,
    select_and_fit,
)
from libra.rollout.tree import exact_nodes

# ---- the router ----------------------------------------------------------------------------------


class RobustParams(TreeParams):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    features: list[Literal["context", "progress", "last", "tools", "siblings"]] = Field(
        default=list(FEATURE_GROUPS), description="Input groups of the final-length model."
    )
    tree_prior: float = Field(
        default=32.0, ge=0, description="n0: an exact-path node of n samples gets weight n/(n+n0); 0: off."
    )
    rule: Literal["gain", "mean-p90"] = "gain"
    move_cost: float = Field(
        default=0.1, ge=0, description="Tokens placed right that one moved token must buy (rule=gain)."
    )
    start: Literal["smallest", "predicted"] = "predicted"
    ridge: float = Field(default=1e-3, ge=0, description="Ridge penalty per row (standardised features).")
    residual_bins: int = Field(default=8, gt=0, description="Bins of predicted y for the residuals.")
    min_rows: int = Field(default=40, gt=0, description="Decisions needed before a model's first fit.")
    # 20k is about six RL steps of decisions on libra-r2e-48gpu. At 100 steps it routes as well as
    # 50k did (r2e-gym 4,279 vs 4,274 tok/s, accuracy 0.863 vs 0.862; search-r1 4,320 vs 4,323)
    # and the refit after every step, the router's largest cost, takes 2.5x less.
    max_rows: int = Field(default=20_000, gt=0, description="Most recent decisions a fit uses.")


class RobustCMLFQRouter(TreeRouterBase):
    """C-MLFQ with a robust final-length predictor and a cost-aware move rule (module docstring)."""

    name = "cmlfq"
    Params = RobustParams

    def __init__(self, buckets, cost=None, seed=0, **params):
        super().__init__(buckets, cost, seed, **params)
        p = self.params
        self.uses_tree = p.tree_prior > 0
        self.book = SiblingBook()
        self.featurizer = Featurizer(p.features, self.book)
        # Two models: a first turn knows only its prompt, a tool return knows much more.
        self.start_model, self.model = LogLinearModel(), LogLinearModel()
        self.start_rows = RowBuffer(p.max_rows, START_WIDTH)
        self.rows = RowBuffer(p.max_rows, self.featurizer.width)
        self.pending: dict[str, list[tuple[int, list[float], int]]] = {}
        self.candidates = self.featurizer.candidates()
        self.chosen = 0  # index of the input set the last fit selected
        self._fitted_rows = 0
        self._fit_waiting = False  # the last fit was skipped: the layout had one bucket

    # -- routing --

    def target(self, req: RouteRequest, floor: int) -> tuple[int, float | None]:
        if req.level is None:
            return self._start(req)
        x = self.featurizer.row(req, self.book.seen(req))
        self._remember(req.traj_id, TOOL_RETURN, x, req.context_tokens)
        if len(self.buckets) == 1:  # nothing to choose: keep learning, skip the prediction
            return 0, None
        if self._fit_waiting:  # a re-plan brought buckets back: fit on the rows kept meanwhile
            self._fit()
        if not self.model.fitted:
            return self._cold(req, floor)
        pred = self.model.predict(x, req.context_tokens)
        self._mix_tree(req, pred)
        cur = max(req.level, floor)
        if self.params.rule == "mean-p90":
            return mean_p90_rule(self.buckets, cur, pred.mean, pred.quantile(self.params.quantile)), pred.mean
        return self._gain_rule(pred, cur, floor), pred.mean

    def _start(self, req: RouteRequest) -> tuple[int, float | None]:
        self.book.seen(req)
        x = self.featurizer.start_row(req)
        self._remember(req.traj_id, START, x, req.context_tokens)
        if self.params.start == "smallest" or not self.start_model.fitted or len(self.buckets) == 1:
            return 0, None
        pred = self.start_model.predict(x, req.context_tokens)
        probs = pred.bucket_probs(self.buckets)
        return max(range(len(probs)), key=probs.__getitem__), pred.mean

    def _mix_tree(self, req: RouteRequest, pred: Prediction) -> None:
        n0 = self.params.tree_prior
        if n0 <= 0:
            return
        depth = min(len(req.path), self.tree.max_depth)
        for node in exact_nodes(*self.walks(req), depth):
            if node is not None and len(node.samples) >= self.params.min_samples:
                pred.nodes.append((len(node.samples) / (len(node.samples) + n0), node.sorted_samples()))

    def _gain_rule(self, pred: Prediction, cur: int, floor: int) -> int:
        probs = pred.bucket_probs(self.buckets)
        best = max(range(floor, len(probs)), key=probs.__getitem__)
        if best == cur:
            return cur
        gain = (probs[best] - probs[cur]) * max(0.0, pred.mean - pred.context)
        return best if gain >= self.params.move_cost * self._net_cost(pred, cur, best) else cur

    def _net_cost(self, pred: Prediction, cur: int, to: int) -> float:
        """Tokens a move from `cur` to `to` costs now, less the forced moves it saves later.

        Staying in a bucket the trajectory outgrows means moving it anyway when it crosses the
        bucket's max_context, with a bigger context; moving up now pre-pays that. Moving down
        risks exactly such a forced move back.
        """
        forced = 0.0
        for i in range(min(cur, to), max(cur, to)):
            cap = self.buckets[i].max_context
            forced += (1.0 - pred.cdf(cap)) * cap
        return pred.context - forced if to > cur else pred.context + forced

    def _cold(self, req: RouteRequest, floor: int) -> tuple[int, float | None]:
        """Before the first fit: the paper's rule on the exact-path tree (stay when it is empty)."""
        cur = max(req.level, floor)
        m = self.match(req, 1) if self.params.tree_prior > 0 else None
        if m is None:
            return cur, None
        mean = req.context_tokens + m.node.mean
        upper = req.context_tokens + m.node.quantile(self.params.quantile)
        return mean_p90_rule(self.buckets, cur, mean, upper), mean

    def _remember(self, traj_id: str, kind: int, x: list[float], context: int) -> None:
        rows = self.pending.get(traj_id)
        if rows is None:
            if len(self.pending) >= MAX_PENDING:  # trajectories abandoned without on_finish
                self.pending.pop(next(iter(self.pending)))
            rows = self.pending[traj_id] = []
        rows.append((kind, x, context))

    # -- learning --

    def on_finish(self, traj: FinishedTrajectory) -> None:
        super().on_finish(traj)
        self.book.finish(traj)
        self.featurizer.forget(traj.traj_id)
        for kind, x, c in self.pending.pop(traj.traj_id, ()):
            y = math.log(max(traj.final_tokens, c) / max(1, c))
            (self.start_rows if kind == START else self.rows).add(x, y, c)
        # Refit when the data has doubled since the last fit: a long step (or a whole trace replayed
        # as one step) does not wait for its end to learn, and the cost stays O(log n) fits.
        if self.rows.n >= max(self.params.min_rows, 2 * self._fitted_rows):
            self._fit()

    def on_step_end(self, step: int) -> None:
        super().on_step_end(step)
        self.book.end_step(step)
        self._fit()

    def _fit(self) -> None:
        """Refit both models. With one bucket there is nothing to predict (a re-plan's layout
        often has one), so the rows are kept and the fit waits until there are buckets again."""
        p, caps = self.params, [b.max_context for b in self.buckets]
        self._fit_waiting = len(caps) == 1
        if self._fit_waiting:
            return
        if self.start_rows.n >= p.min_rows:
            x, y, _ = self.start_rows.arrays()
            self.start_model.fit(x, y, p.ridge, p.residual_bins)
        if self.rows.n < p.min_rows:
            return
        x, y, c = self.rows.arrays()
        self.chosen, self.model = select_and_fit(x, y, c, self.candidates, caps, p.ridge, p.residual_bins)
        self._fitted_rows = self.rows.n


class ContextPriorRouter(RobustCMLFQRouter):
    """A prior that uses only the current length: the same model, rule and start as `cmlfq`, fed
    nothing but the context and without the tree. The real-trace baseline, so that the comparison
    measures what tool states, progress and siblings add, not a different rule."""

    name = "context-prior"

    def __init__(self, buckets, cost=None, seed=0, **params):
        params.setdefault("features", ["context"])
        params.setdefault("tree_prior", 0.0)
        super().__init__(buckets, cost, seed, **params)

"""The final-length predictor behind robust C-MLFQ: a predictive *distribution*, not a point.

The routing rule needs more than a guess of the final length: it needs how likely each bucket is
(to weigh a move) and its mean and upper quantile (for the paper's rule). So the predictor models
y = log(final / context), which is >= 0 and puts trajectories of every scale on one axis, as

    y = x . beta + residual

with `beta` from ridge regression on standardised features, and the residual distribution taken
from the training rows themselves, binned by the predicted value (early predictions are far less
certain than late ones, so one residual spread for all would be wrong at both ends).

Where the causal tree has seen the trajectory's exact path often enough, its node's samples are
mixed in with weight n / (n + n0): many samples of exactly this history beat a regression over
summaries of it, and a handful do not.

Fitting uses numpy once per RL step; predicting is a dot product and two bisections, well inside
the router's latency budget.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from libra.rollout.base import Bucket


@dataclass(slots=True)
class Prediction:
    """The predicted distribution of one trajectory's final length, at context `context`."""

    context: int
    yhat: float
    mean_factor: float
    residuals: list[float]
    # (weight, sorted remaining-length samples) of exact-path tree nodes mixed in; the
    # regression's own weight is 1.
    nodes: list[tuple[float, list[int]]] = field(default_factory=list)

    def _reg_mean(self) -> float:
        return self.context * max(1.0, math.exp(self.yhat) * self.mean_factor)

    def _reg_cdf(self, tokens: float) -> float:
        if tokens < self.context:
            return 0.0
        r = self.residuals
        return bisect.bisect_right(r, math.log(tokens / self.context) - self.yhat) / len(r)

    @property
    def mean(self) -> float:
        total, weight = self._reg_mean(), 1.0
        for w, samples in self.nodes:
            total += w * (self.context + sum(samples) / len(samples))
            weight += w
        return total / weight

    def cdf(self, tokens: float) -> float:
        """P(final <= tokens)."""
        total, weight = self._reg_cdf(tokens), 1.0
        for w, samples in self.nodes:
            total += w * bisect.bisect_right(samples, tokens - self.context) / len(samples)
            weight += w
        return total / weight

    def quantile(self, q: float) -> float:
        """The smallest length whose CDF reaches q (bisection: used only by the mean-p90 rule)."""
        lo, hi = float(self.context), float(self.context) * 2.0
        while self.cdf(hi) < q and hi < 1e12:
            hi *= 2.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.cdf(mid) < q else (lo, mid)
        return hi

    def bucket_probs(self, buckets: Sequence[Bucket]) -> list[float]:
        """P(final length falls in each bucket); the last bucket takes everything beyond."""
        probs, below = [], 0.0
        for b in buckets[:-1]:
            at = self.cdf(b.max_context)
            probs.append(max(0.0, at - below))
            below = max(below, at)
        probs.append(max(0.0, 1.0 - below))
        return probs


class LogLinearModel:
    """y = log(final/context) by ridge regression, with residuals binned by the predicted value."""

    __slots__ = ("beta", "edges", "mexp", "resid", "rows")

    # Residuals kept per bin for CDF lookups (evenly spaced order statistics).
    RESIDUALS_PER_BIN = 256

    def __init__(self) -> None:
        self.beta: list[float] | None = None
        self.edges: list[float] = []
        self.mexp: list[float] = []
        self.resid: list[list[float]] = []
        self.rows = 0

    @property
    def fitted(self) -> bool:
        return self.beta is not None

    def fit(self, x: np.ndarray, y: np.ndarray, ridge: float, bins: int) -> None:
        """Fit all columns of `x` (column 0 the bias)."""
        self.set_beta(RidgeProblem(x, y, ridge).solve(), x, y, bins)

    def set_beta(self, beta: np.ndarray, x: np.ndarray, y: np.ndarray, bins: int) -> None:
        """Take `beta` and learn the residual distribution it leaves on (x, y)."""
        pred = x @ beta
        resid = y - pred
        order = np.argsort(pred, kind="stable")
        chunks = np.array_split(order, max(1, min(bins, len(y) // 100)))
        self.edges = [float(pred[c[-1]]) for c in chunks[:-1]]
        self.mexp = [float(np.mean(np.exp(resid[c]))) for c in chunks]
        self.resid = [_order_stats(resid[c], self.RESIDUALS_PER_BIN) for c in chunks]
        self.beta = beta.tolist()
        self.rows = len(y)

    def predict(self, x: Sequence[float], context: int) -> Prediction:
        assert self.beta is not None, "predict() before fit()"
        yhat = sum(map(operator.mul, self.beta, x))
        k = bisect.bisect_left(self.edges, yhat)
        return Prediction(context, yhat, self.mexp[k], self.resid[k])


class RidgeProblem:
    """Ridge regression on centred, standardised columns, set up once for many column subsets.

    The Gram matrix is computed once; each subset of columns solves its own block of it, so
    comparing nested input sets costs one pass over the rows, not one per set. Centring matters:
    a column that happens to be constant in the data (every prompt of a trace with the same
    length) would otherwise be collinear with the bias. Constant columns get coefficient 0.
    Column 0 must be the bias (all ones); it is neither centred nor penalised.
    """

    __slots__ = ("mu", "sd", "live", "gram", "xty", "ridge", "n")

    def __init__(self, x: np.ndarray, y: np.ndarray, ridge: float):
        self.mu = x.mean(axis=0)
        self.sd = x.std(axis=0)
        self.mu[0], self.sd[0] = 0.0, 1.0
        self.live = self.sd > 1e-9
        self.live[0] = True
        self.sd = np.where(self.live, self.sd, 1.0)
        xs = x - self.mu  # the same values as np.where(live, (x - mu) / sd, 0), at a third the cost
        xs /= self.sd
        xs[:, ~self.live] = 0.0
        self.gram, self.xty = xs.T @ xs, xs.T @ y
        self.ridge, self.n = ridge, len(y)

    def solve(self, cols: np.ndarray | None = None) -> np.ndarray:
        """Coefficients on the original scale, zero outside `cols` (all columns when None)."""
        use = self.live if cols is None else (self.live & cols)
        idx = np.flatnonzero(use)
        a = self.gram[np.ix_(idx, idx)] + self.ridge * self.n * np.eye(len(idx))
        a[0, 0] -= self.ridge * self.n  # the bias (index 0 is always live) is not penalised
        try:
            sol = np.linalg.solve(a, self.xty[idx])
        except np.linalg.LinAlgError:  # numerically singular: the least-squares solution
            sol = np.linalg.lstsq(a, self.xty[idx], rcond=None)[0]
        beta = np.zeros(len(self.mu))
        beta[idx] = sol / self.sd[idx]
        beta[0] = sol[0] - float(np.dot(beta[1:], self.mu[1:]))
        return beta


def _order_stats(values: np.ndarray, n: int) -> list[float]:
    s = np.sort(values)
    return s[np.linspace(0, len(s) - 1, min(len(s), n)).astype(int)].tolist()


class RowBuffer:
    """The most recent decisions and their outcomes, as a ring of fixed-width float rows."""

    __slots__ = ("x", "y", "c", "n", "head")

    def __init__(self, capacity: int, width: int):
        self.x = np.zeros((capacity, width))
        self.y = np.zeros(capacity)
        self.c = np.zeros(capacity)
        self.n = self.head = 0

    def add(self, x: Sequence[float], y: float, context: int) -> None:
        self.x[self.head] = x
        self.y[self.head] = y
        self.c[self.head] = context
        self.head = (self.head + 1) % len(self.y)
        self.n = min(self.n + 1, len(self.y))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(x, y, context), oldest row first."""
        if self.n < len(self.y):
            return self.x[: self.n], self.y[: self.n], self.c[: self.n]
        order = np.roll(np.arange(self.n), -self.head)
        return self.x[order], self.y[order], self.c[order]


def fit_columns(
    problem: RidgeProblem, cols: np.ndarray, x: np.ndarray, y: np.ndarray, bins: int
) -> LogLinearModel:
    """A model that uses only the columns where `cols` is True (zero coefficients elsewhere)."""
    model = LogLinearModel()
    model.set_beta(problem.solve(cols), x, y, bins)
    return model


def bucket_log_loss(
    model: LogLinearModel, x: np.ndarray, y: np.ndarray, c: np.ndarray, caps: Sequence[int]
) -> float:
    """Mean -log P(true bucket) of `model` on rows (x, y, context): a proper score of the whole
    predicted distribution, which is what the routing rule consumes."""
    beta = np.asarray(model.beta)
    yhat = x @ beta
    final = c * np.exp(y)
    truth = np.searchsorted(np.asarray(caps[:-1], dtype=float), final, side="left")
    k = np.searchsorted(np.asarray(model.edges), yhat, side="left")
    cdf = np.zeros((len(y), len(caps)))
    cdf[:, -1] = 1.0
    for j, cap in enumerate(caps[:-1]):
        u = np.log(cap / np.maximum(c, 1.0)) - yhat
        for b, resid in enumerate(model.resid):
            rows = k == b
            r = np.asarray(resid)
            cdf[rows, j] = np.searchsorted(r, u[rows], side="right") / len(r)
        cdf[c > cap, j] = 0.0
    cdf = np.maximum.accumulate(cdf, axis=1)
    probs = np.diff(np.concatenate([np.zeros((len(y), 1)), cdf], axis=1), axis=1)
    p_true = probs[np.arange(len(y)), truth]
    return float(np.mean(-np.log(np.clip(p_true, 1e-3, 1.0))))


def select_and_fit(
    x: np.ndarray,
    y: np.ndarray,
    c: np.ndarray,
    candidates: Sequence[np.ndarray],
    caps: Sequence[int],
    ridge: float,
    bins: int,
    holdout: float = 0.2,
    min_holdout: int = 200,
) -> tuple[int, LogLinearModel]:
    """Pick the candidate column set that predicts the newest rows best, then refit it on all rows.

    Candidates go from the fewest inputs to the most. The newest `holdout` share of the rows is
    scored by `bucket_log_loss` under models fit on the older rows; with fewer than `min_holdout`
    newest rows there is too little evidence that anything beats the simplest, so that is used.
    """
    n_new = int(len(y) * holdout)
    best = 0
    if len(candidates) > 1 and n_new >= min_holdout:
        old, new = slice(0, len(y) - n_new), slice(len(y) - n_new, len(y))
        problem = RidgeProblem(x[old], y[old], ridge)
        scores = [
            bucket_log_loss(fit_columns(problem, cols, x[old], y[old], bins), x[new], y[new], c[new], caps)
            for cols in candidates
        ]
        best = min(range(len(scores)), key=scores.__getitem__)
    return best, fit_columns(RidgeProblem(x, y, ridge), candidates[best], x, y, bins)

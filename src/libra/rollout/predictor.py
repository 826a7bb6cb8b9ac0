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
        """Column 0 of `x` must be the bias (all ones); it is neither centred nor penalised."""
        beta = ridge_fit(x, y, ridge)
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
        yhat = 0.0
        for b, v in zip(self.beta, x, strict=True):
            yhat += b * v
        k = bisect.bisect_left(self.edges, yhat)
        return Prediction(context, yhat, self.mexp[k], self.resid[k])


def ridge_fit(x: np.ndarray, y: np.ndarray, ridge: float) -> np.ndarray:
    """Ridge regression on centred, standardised columns; constant columns get coefficient 0.

    Centring matters: a column that happens to be constant in the data (every prompt of a trace
    with the same length) would otherwise be collinear with the bias.
    """
    mu = x.mean(axis=0)
    sd = x.std(axis=0)
    mu[0], sd[0] = 0.0, 1.0
    live = sd > 1e-9
    live[0] = True
    safe_sd = np.where(live, sd, 1.0)
    xs = np.where(live, (x - mu) / safe_sd, 0.0)
    reg = ridge * len(y) * np.eye(x.shape[1])
    reg[0, 0] = 0.0
    reg[~live, ~live] = 1.0  # keeps the system regular; these columns are all zero anyway
    a, b = xs.T @ xs + reg, xs.T @ y
    try:
        beta_s = np.linalg.solve(a, b)
    except np.linalg.LinAlgError:  # numerically singular: the least-squares solution instead
        beta_s = np.linalg.lstsq(a, b, rcond=None)[0]
    beta = np.where(live, beta_s / safe_sd, 0.0)
    beta[0] = beta_s[0] - float(np.dot(beta[1:], mu[1:]))
    return beta


def _order_stats(values: np.ndarray, n: int) -> list[float]:
    s = np.sort(values)
    return s[np.linspace(0, len(s) - 1, min(len(s), n)).astype(int)].tolist()


class RowBuffer:
    """The most recent decisions and their outcomes, as a ring of fixed-width float rows."""

    __slots__ = ("x", "y", "n", "head")

    def __init__(self, capacity: int, width: int):
        self.x = np.zeros((capacity, width))
        self.y = np.zeros(capacity)
        self.n = self.head = 0

    def add(self, x: Sequence[float], y: float) -> None:
        self.x[self.head] = x
        self.y[self.head] = y
        self.head = (self.head + 1) % len(self.y)
        self.n = min(self.n + 1, len(self.y))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.x[: self.n], self.y[: self.n]

"""Quota manager: concurrency caps and tokens per period for named external APIs.

Web search, a hosted judge model or any paid API limits how many calls run at once and how much
can be spent per period (requests or tokens per minute). Each quota is a non-key resource: an
action needs one concurrency slot and its tokens to be admitted, and nothing to split. Periods are
fixed windows aligned to t = 0; the caller passes the time in, so the same object runs on the
simulated clock and the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from libra.core.errors import ConfigError


class QuotaSpec(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    max_concurrency: int | None = Field(None, ge=1, description="calls in flight at once")
    tokens_per_period: float | None = Field(None, gt=0, description="tokens (or requests) per period")
    period_s: float = Field(60.0, gt=0)


@dataclass(slots=True)
class _State:
    in_flight: int = 0
    used: float = 0.0
    window: int = 0


class QuotaManager:
    def __init__(self, specs: Mapping[str, QuotaSpec]):
        self.specs = dict(specs)
        self._state = {name: _State() for name in self.specs}
        self._held: dict[str, tuple[tuple[str, float], ...]] = {}

    def _roll(self, name: str, now: float) -> _State:
        st, spec = self._state[name], self.specs[name]
        w = int(math.floor(now / spec.period_s))
        if w != st.window:
            st.window, st.used = w, 0.0
        return st

    def check(self, name: str, tokens: float) -> None:
        """Reject at submission what could never be admitted (unknown quota, tokens over budget)."""
        if name not in self.specs:
            raise ConfigError("quota", name, sorted(self.specs) or ["a quota defined in the configuration"])
        budget = self.specs[name].tokens_per_period
        if budget is not None and tokens > budget:
            raise ConfigError(f"quota:{name}", tokens, f"<= tokens_per_period ({budget:g})")

    def acquire(self, holder: str, needs: tuple[tuple[str, float], ...], now: float) -> None:
        for name, tokens in needs:
            st = self._roll(name, now)
            st.in_flight += 1
            st.used += tokens
        self._held[holder] = needs

    def release(self, holder: str) -> None:
        for name, _ in self._held.pop(holder, ()):
            self._state[name].in_flight -= 1

    def next_window(self, name: str, now: float) -> float:
        """When the token budget of `name` refills (the start of the next period)."""
        p = self.specs[name].period_s
        return (math.floor(now / p) + 1) * p

    def in_flight(self, name: str) -> int:
        return self._state[name].in_flight

    def used(self, name: str, now: float) -> float:
        return self._roll(name, now).used

    def scratch(self, now: float) -> QuotaScratch:
        return QuotaScratch(self, now)


class QuotaScratch:
    """A throw-away copy the scheduler admits against, so a decision never mutates the manager."""

    def __init__(self, mgr: QuotaManager, now: float):
        self.mgr, self.now = mgr, now
        self.extra_flight: dict[str, int] = {}
        self.extra_used: dict[str, float] = {}

    def fits(self, needs: tuple[tuple[str, float], ...]) -> bool:
        for name, tokens in needs:
            spec = self.mgr.specs[name]
            st = self.mgr._roll(name, self.now)
            if spec.max_concurrency is not None:
                if st.in_flight + self.extra_flight.get(name, 0) >= spec.max_concurrency:
                    return False
            if spec.tokens_per_period is not None:
                if st.used + self.extra_used.get(name, 0.0) + tokens > spec.tokens_per_period:
                    return False
        return True

    def take(self, needs: tuple[tuple[str, float], ...]) -> None:
        for name, tokens in needs:
            self.extra_flight[name] = self.extra_flight.get(name, 0) + 1
            self.extra_used[name] = self.extra_used.get(name, 0.0) + tokens

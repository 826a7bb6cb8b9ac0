"""A small deterministic discrete-event kernel.

A heap of (time, seq, event). `seq` is a global tie-break counter, so two events at the same time
run in the order they were scheduled, and a run is reproducible bit for bit. Events are plain
callbacks; a handle lets the scheduler cancel one lazily (it is skipped when popped). There is no
wall clock anywhere: time only moves when an event is popped, and never backwards.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Any

from libra.core.errors import SimulationError

__all__ = ["Handle", "Kernel", "SimulationError"]


class Handle:
    """A scheduled event. `cancel()` makes the kernel skip it."""

    __slots__ = ("time", "fn", "args", "cancelled")

    def __init__(self, time: float, fn: Callable[..., Any], args: tuple):
        self.time, self.fn, self.args, self.cancelled = time, fn, args, False

    def cancel(self) -> None:
        self.cancelled = True


class Kernel:
    def __init__(self, seed: int = 0):
        self.now = 0.0
        self.rng = random.Random(seed)
        self.events_run = 0
        self._heap: list[tuple[float, int, Handle]] = []
        self._seq = 0
        self._stopped = False

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> Handle:
        """Run `fn(*args)` at absolute simulated `time` (not before now)."""
        if time < self.now:
            raise SimulationError(f"event scheduled in the past: {time} < now {self.now}")
        h = Handle(time, fn, args)
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, h))
        return h

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> Handle:
        """Run `fn(*args)` after `delay` simulated seconds."""
        return self.at(self.now + max(0.0, delay), fn, *args)

    def stop(self) -> None:
        """Stop `run` after the current event."""
        self._stopped = True

    @property
    def pending(self) -> int:
        return sum(1 for _, _, h in self._heap if not h.cancelled)

    def peek(self) -> float:
        """Time of the next live event, or inf."""
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else float("inf")

    def run(self, until: float | None = None, max_events: int | None = None) -> float:
        """Run events in (time, seq) order until the heap empties, `until`, `stop()` or `max_events`."""
        self._stopped = False
        limit = float("inf") if until is None else until
        heap, pop = self._heap, heapq.heappop
        n = 0
        while heap and not self._stopped:
            time, _, h = heap[0]
            if time > limit:
                break
            pop(heap)
            if h.cancelled:
                continue
            self.now = time
            h.fn(*h.args)
            n += 1
            if max_events is not None and n >= max_events:
                break
        self.events_run += n
        if until is not None and not self._stopped and self.now < until and (not heap or heap[0][0] > until):
            self.now = until
        return self.now

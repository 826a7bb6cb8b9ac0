"""The batching rules of a vLLM-style engine step, shared by the simulated and the live engine.

Each step vLLM's scheduler decides who runs and how many tokens each gets (`schedule()`); the model
runs; the outputs are applied (`update_from_output()`). Libra's two engines keep that split: the
simulated engine (`libra.sim.engine`) and the live built-in engine
(`libra.runtime.engine.scheduler`) each return a step plan that their mechanism carries out. The
rules they have in common live here, as pure functions of numbers and lists, so the two cannot
drift apart:

- chunked prefill: a prefill takes the least of what it has left, the per-request cap, and what is
  left of the step's token budget;
- recompute preemption: when the KV cache cannot grow, the most recently admitted running request
  is the victim; it loses its KV and goes back to the front of the waiting queue, to be recomputed;
- FCFS admission: the head of the queue is admitted only if the KV it needs fits beside a reserve
  (a watermark the engine keeps free for the running requests' growth).

No clock, no I/O: the engines call these from their own scheduling code.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def prefill_chunk(remaining: int, budget: int, cap: int) -> int:
    """Tokens of a prefill that run this step (vLLM's chunked prefill under a token budget)."""
    return min(remaining, cap, budget)


def preemption_victim(running: list[T]) -> T:
    """The request to preempt: the newest admitted, the last of `running` (vLLM's FCFS policy)."""
    return running[-1]


def admits(free: int, need: int, reserve: int) -> bool:
    """Whether a request needing `need` units of KV fits in `free` while keeping `reserve` free."""
    return free - need >= reserve

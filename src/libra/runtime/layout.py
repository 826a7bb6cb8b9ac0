"""The training layout: which trainer rank owns which sample of a step, balanced by tokens.

Both the elastic data-parallel layer (which samples a joining replica computes) and the data
dispatcher (where a sample's per-token tensors are sent) must agree on it, so it is one pure,
deterministic function: every process that knows the step's token counts and the member count
computes the same layout without talking to anyone.

Longest-processing-time-first: samples in decreasing token order (ties by index) go to the rank
with the fewest tokens so far (ties by rank). Within a rank, samples keep their batch order.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balance_by_tokens(tokens: Sequence[int], ranks: int) -> list[list[int]]:
    """`ranks` lists of sample indices; the heaviest rank holds at most the lightest plus one sample."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    heap = [(0, r) for r in range(ranks)]
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        load, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (load + tokens[i], r))
    return [sorted(s) for s in shares]


def owner_of(shares: Sequence[Sequence[int]]) -> dict[int, int]:
    """Sample index -> rank, the inverse of a layout."""
    return {i: r for r, share in enumerate(shares) for i in share}

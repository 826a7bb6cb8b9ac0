"""Gradient reduction across the core trainer replicas, behind one small object.

The trainer computes local gradients with the loss already divided by the step's global token
count and then calls `reducer.reduce(model)`; the plain reducer sums every gradient over the fixed
core gloo group, in one flat buffer (one collective per step, not one per tensor). The elastic
layer swaps in a reducer that also adds gradients received from joining replicas before this sum;
nothing else in the trainer changes.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn


class Reducer(Protocol):
    def reduce(self, model: nn.Module) -> None: ...


class SumAllReduce:
    """Sum gradients over `group` (the default group when None)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    def reduce(self, model: nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class LocalReducer:
    """One replica: its gradients are already the sum."""

    def reduce(self, model: nn.Module) -> None:
        return None

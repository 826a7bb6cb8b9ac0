"""Training samples: what the driver sends each trainer replica, padded into tensors there.

A sample is one trajectory's token ids, its loss mask, the behaviour log-probabilities of its
model tokens and its advantage. The driver splits a step's samples over replicas by tokens
(largest first onto the lightest replica), so replicas finish their forward and backward at about
the same time; the split never changes the update (see `grpo`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor


class TrainSample(BaseModel):
    """One trajectory for the trainer (JSON between driver and replicas)."""

    model_config = ConfigDict(frozen=True)

    ids: list[int]
    mask: list[int]  # 1 where ids[t] was sampled by the model
    logprobs: list[float]  # behaviour log-prob of ids[t] where mask is 1
    advantage: float = 0.0

    @property
    def n_model_tokens(self) -> int:
        return sum(self.mask)


def sample_tokens(samples: list[TrainSample]) -> list[int]:
    """What a step's layout balances: each sample's length (its forward and backward cost)."""
    return [len(s.ids) for s in samples]


@dataclass(slots=True)
class Padded:
    """Right-padded tensors; position t of mask/old/targets describes token t + 1."""

    tokens: Tensor  # [B, T]
    mask: Tensor  # [B, T - 1]
    old: Tensor  # [B, T - 1]
    adv: Tensor  # [B]

    def to(self, device: torch.device) -> Padded:
        if device.type == "cpu":
            return self
        return Padded(self.tokens.to(device), self.mask.to(device), self.old.to(device), self.adv.to(device))


def pad(samples: list[TrainSample]) -> Padded:
    t = max(len(s.ids) for s in samples)
    tokens = torch.zeros(len(samples), t, dtype=torch.long)
    mask = torch.zeros(len(samples), t - 1)
    old = torch.zeros(len(samples), t - 1)
    for i, s in enumerate(samples):
        n = len(s.ids)
        tokens[i, :n] = torch.tensor(s.ids)
        mask[i, : n - 1] = torch.tensor(s.mask[1:], dtype=torch.float32)
        old[i, : n - 1] = torch.tensor(s.logprobs[1:])
    return Padded(tokens, mask, old, torch.tensor([s.advantage for s in samples]))


def micro_batches(samples: list[TrainSample], max_tokens: int) -> list[list[TrainSample]]:
    """Consecutive runs of samples whose padded size stays within `max_tokens` (at least one)."""
    out: list[list[TrainSample]] = []
    cur: list[TrainSample] = []
    width = 0
    for s in sorted(samples, key=lambda s: len(s.ids)):
        if cur and max(width, len(s.ids)) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, width = [], 0
        cur.append(s)
        width = max(width, len(s.ids))
    if cur:
        out.append(cur)
    return out


def shard(samples: list[TrainSample], n: int) -> list[list[TrainSample]]:
    """Split over n replicas, balanced by token count (longest first onto the lightest)."""
    parts: list[list[TrainSample]] = [[] for _ in range(n)]
    loads = [0] * n
    for s in sorted(samples, key=lambda s: -len(s.ids)):
        i = loads.index(min(loads))
        parts[i].append(s)
        loads[i] += len(s.ids)
    return parts

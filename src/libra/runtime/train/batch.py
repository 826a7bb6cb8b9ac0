"""Training samples: what the driver sends each trainer replica, padded into tensors there.

A sample is one trajectory's token ids, its loss mask, the behaviour log-probabilities of its
model tokens, the weight version each was sampled with, its advantage and the sampling parameters
it was drawn with (the trainer scores tokens under the same processed distribution). The driver splits a step's samples over replicas by tokens
(largest first onto the lightest replica), so replicas finish their forward and backward at about
the same time; the split never changes the update (see `grpo`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor


class TrainSample(BaseModel):
    """One trajectory for the trainer (JSON between driver and replicas)."""

    model_config = ConfigDict(frozen=True)

    ids: list[int]
    mask: list[int]  # 1 where ids[t] is trained: sampled by the model, not forced by the grammar
    logprobs: list[float]  # behaviour log-prob of ids[t] where mask is 1
    advantage: float = 0.0
    # The one weight version ids[t] was sampled with (its KV cache's too); -1 where there is none:
    # not sampled, or sampled over a cache of older weights (an in-place update). Empty: all -1.
    versions: list[int] = []
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def n_model_tokens(self) -> int:
        """The tokens the loss trains (the model's, less those the grammar forced)."""
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
    versions: Tensor  # [B, T - 1] long, -1 where a token has no single version
    temperature: Tensor  # [B]
    top_p: Tensor  # [B]
    top_k: Tensor  # [B]

    def to(self, device: torch.device) -> Padded:
        if device.type == "cpu":
            return self
        return Padded(*(getattr(self, f.name).to(device) for f in fields(self)))


def pad(samples: list[TrainSample]) -> Padded:
    t, b = max(len(s.ids) for s in samples), len(samples)
    tokens = torch.zeros(b, t, dtype=torch.long)
    mask, old = torch.zeros(b, t - 1), torch.zeros(b, t - 1)
    versions = torch.full((b, t - 1), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.ids)
        tokens[i, :n] = torch.tensor(s.ids)
        mask[i, : n - 1] = torch.tensor(s.mask[1:], dtype=torch.float32)
        old[i, : n - 1] = torch.tensor(s.logprobs[1:])
        if s.versions:
            versions[i, : n - 1] = torch.tensor(s.versions[1:])
    col = lambda f: torch.tensor([getattr(s, f) for s in samples])  # noqa: E731
    return Padded(
        tokens, mask, old, col("advantage"), versions, col("temperature"), col("top_p"), col("top_k")
    )


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

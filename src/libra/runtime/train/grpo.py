"""Token-level GRPO: group-normalised advantages and the clipped policy loss.

The loss of a step is a sum over every model token of every trained trajectory, divided by the
step's *global* model-token count (all replicas together), as DAPO's token-level loss does. Each
replica divides its own part by that same global count and the replicas' gradients are summed, so
the update is the same however samples are spread over replicas: the property the elastic join
(a replica that joins mid-run and contributes zero gradients while it catches up) relies on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(
    rewards: list[float], normalize_std: bool = True, negative_weight: float = 1.0, eps: float = 1e-6
) -> list[float]:
    """GRPO's advantage of each sample of one group: reward minus the group mean, over the
    group's standard deviation when `normalize_std` (Dr. GRPO leaves that division out), and a
    below-mean sample's advantage scaled by `negative_weight` (1: plain GRPO; 0: only the samples
    that beat their group's mean are reinforced, as in positive-sample reinforcement)."""
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if normalize_std:
        std = math.sqrt(sum(c * c for c in centred) / len(rewards))
        centred = [c / (std + eps) for c in centred]
    return [c if c >= 0 else c * negative_weight for c in centred]


@dataclass(frozen=True, slots=True)
class Clip:
    low: float = 0.2
    high: float = 0.28  # DAPO's clip-higher: more room for raising unlikely tokens


@dataclass(slots=True)
class LossParts:
    """Sums over this replica's model tokens (divide by the global count to get means)."""

    loss: Tensor
    clipped: float
    ratio: float
    kl: float  # k3 estimator of KL(behaviour || current)
    logprob_diff: float  # max |current - behaviour| log-prob, a check of trainer/engine agreement


def policy_loss(new_lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, clip: Clip, global_tokens: int) -> LossParts:  # fmt: skip
    """new_lp, old_lp, mask: [B, T]; adv: [B]. Returns the loss already divided by global_tokens."""
    log_ratio = (new_lp - old_lp) * mask
    ratio = log_ratio.exp()
    a = adv[:, None]
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip.low, 1 + clip.high) * a
    per_token = -torch.minimum(unclipped, clipped) * mask
    with torch.no_grad():
        was_clipped = ((unclipped != clipped) & (mask > 0)).sum().item()
        kl = ((ratio - 1 - log_ratio) * mask).sum().item()
        diff = log_ratio.abs().max().item() if mask.any() else 0.0
    return LossParts(per_token.sum() / global_tokens, was_clipped, (ratio * mask).sum().item(), kl, diff)

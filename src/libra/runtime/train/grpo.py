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

from libra.runtime.train.config import Correction


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
class Objective:
    """The clipped policy loss and its off-policy correction.

    `correction`: what the ratio is taken against.
    - "none": the engine's behaviour log-probabilities (PPO's ratio pi_theta / pi_behaviour,
      clipped to [1 - clip_low, 1 + clip_high]): clipping is the only correction;
    - "tis": truncated importance sampling, as verl and slime do: the ratio is against the
      trainer's own log-probabilities at the step's weights (pi_prox; with one update per batch it
      equals 1 and the PPO clip stays inactive), and each token's loss is weighted by
      min(pi_prox / pi_behaviour, tis_cap), computed from the engine's per-token behaviour
      log-probabilities. Those are what the engine sampled with, whatever weight version or mix of
      versions produced each token, so a stale or mid-update token is weighted by its own policy.
    `dual_clip`: verl's clip_ratio_c (slime's eps_clip_c): for a negative advantage the loss of a
    token is at most dual_clip * |advantage|, however large its ratio (None: off).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO's clip-higher: more room for raising unlikely tokens
    dual_clip: float | None = 3.0
    correction: Correction = "none"
    tis_cap: float = 2.0


@dataclass(slots=True)
class LossParts:
    """Sums over this replica's trained tokens (divide by the global count to get means)."""

    loss: Tensor
    clipped: float  # tokens whose ratio left the clip range
    dual_clipped: float  # tokens whose loss the dual clip bounded
    ratio: float  # sum of pi_theta / pi_behaviour
    kl: float  # k3 estimator of KL(behaviour || current)
    logprob_diff: float  # max |current - behaviour| log-prob over every trained token (off-policy gap)
    same_version_gap: float  # the same over tokens sampled with these very weights (a consistency check)
    same_version_tokens: int
    is_weight: float  # sum of the importance weights (1 per token without a correction)
    is_truncated: float  # tokens whose weight the cap truncated


def policy_loss(new_lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, obj: Objective, global_tokens: int, same_version: Tensor | None = None) -> LossParts:  # fmt: skip
    """new_lp, old_lp (behaviour), mask: [B, T]; adv: [B]; same_version: bool [B, T], the tokens
    sampled with the weights being trained. Returns the loss already divided by global_tokens."""
    behaviour_gap = (new_lp - old_lp) * mask
    if obj.correction == "tis":
        prox = new_lp.detach()
        raw_weight = ((prox - old_lp) * mask).exp()
        weight = raw_weight.clamp(max=obj.tis_cap)
    else:
        prox, raw_weight = old_lp, torch.ones_like(new_lp)
        weight = raw_weight
    log_ratio = (new_lp - prox) * mask
    ratio = log_ratio.exp()
    a = adv[:, None]
    unclipped = ratio * a
    clipped = ratio.clamp(1 - obj.clip_low, 1 + obj.clip_high) * a
    surrogate = torch.minimum(unclipped, clipped)
    bounded = surrogate
    if obj.dual_clip is not None:
        bounded = torch.where(a < 0, torch.maximum(surrogate, obj.dual_clip * a), surrogate)
    loss = (-bounded * weight * mask).sum() / global_tokens
    with torch.no_grad():
        on = mask > 0
        same = on if same_version is None else same_version & on
        gap = behaviour_gap.abs()
        return LossParts(
            loss=loss,
            clipped=((unclipped != clipped) & on).sum().item(),
            dual_clipped=((bounded != surrogate) & on).sum().item(),
            ratio=(behaviour_gap.exp() * mask).sum().item(),
            kl=((behaviour_gap.exp() - 1 - behaviour_gap) * mask).sum().item(),
            logprob_diff=gap[on].max().item() if on.any() else 0.0,
            same_version_gap=gap[same].max().item() if same.any() else 0.0,
            same_version_tokens=int(same.sum().item()),
            is_weight=(weight * mask).sum().item(),
            is_truncated=((raw_weight > weight) & on).sum().item(),
        )

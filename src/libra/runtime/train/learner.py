"""One trainer replica's model and optimizer: the engine's own model class, trained.

`Learner` does the arithmetic of a step and nothing else (no HTTP, no processes), so the trainer
worker, the in-process learning loop and the tests all train through the same code:

- `rl_step`: token-level GRPO over this replica's samples in micro-batches, the loss divided by
  the step's global token count, gradients reduced by the reducer (summed over replicas), clipped
  by global norm, one AdamW step;
- `sft_step`: the supervised warm-start, with the same normalisation and reduction;
- `state` / `load`: weights, optimizer, step and version, for checkpoints and `--resume`.

Replicas start from the same seed, receive the same reduced gradients and run the same
deterministic optimizer, so they stay bitwise equal without any broadcast of weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from libra.runtime.engine.config import ModelPreset
from libra.runtime.engine.distribution import sampled_logprobs
from libra.runtime.engine.model import TRAIN_EMBED_STD, TinyTransformer
from libra.runtime.train.batch import Padded, TrainSample, micro_batches, pad
from libra.runtime.train.grpo import Objective, policy_loss
from libra.runtime.train.reducer import Reducer


@dataclass(frozen=True, slots=True)
class OptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192


@dataclass(slots=True)
class StepStats:
    """One replica's figures for one step (sums over its tokens; the driver adds replicas up)."""

    loss: float = 0.0
    tokens: int = 0
    samples: int = 0
    clipped: float = 0.0
    dual_clipped: float = 0.0
    ratio_sum: float = 0.0
    kl_sum: float = 0.0
    logprob_diff_max: float = 0.0
    same_version_gap_max: float = 0.0  # |trainer - engine| log-prob of tokens of these weights
    same_version_tokens: int = 0
    is_weight_sum: float = 0.0
    is_truncated: float = 0.0
    grad_norm: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class Learner:
    def __init__(self, preset: ModelPreset | None, seed: int, optim: OptimConfig, reducer: Reducer, model: torch.nn.Module | None = None):  # fmt: skip
        """Trains `model` (a checkpoint's `LlamaFamily`, `models.train_model`), or the built-in
        model of `preset` from `seed`. Only parameters that require gradients train (LoRA)."""
        self.model = (
            model if model is not None else TinyTransformer(preset, seed, embed_std=TRAIN_EMBED_STD).train()
        )
        self.device = next(self.model.parameters()).device
        self.optim_cfg, self.reducer = optim, reducer
        self.opt = self._new_optimizer()
        self.step, self.version = 0, 0

    def _new_optimizer(self) -> torch.optim.AdamW:
        o = self.optim_cfg
        return torch.optim.AdamW(self.trainable(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def reset_optimizer(self, optim: OptimConfig | None = None) -> None:
        """Fresh AdamW moments, optionally new settings (the warm-start and RL differ in both)."""
        self.optim_cfg = optim or self.optim_cfg
        self.opt = self._new_optimizer()

    def rl_step(self, samples: list[TrainSample], global_tokens: int, obj: Objective) -> StepStats:
        self.opt.zero_grad(set_to_none=False)
        st = self.accumulate(samples, global_tokens, obj)
        st.grad_norm = self._apply()
        self.step, self.version = self.step + 1, self.version + 1
        return st

    def accumulate(self, samples: list[TrainSample], global_tokens: int, obj: Objective) -> StepStats:
        """Add these samples' GRPO gradients (loss over the step's global tokens) to the model's;
        no reduction, no update (an elastic partner also calls it for a replica's missing share)."""
        st = StepStats(samples=len(samples))
        for mb in micro_batches(samples, self.optim_cfg.micro_batch_tokens):
            b = pad(mb).to(self.device)
            new = self.sampled_logprobs(b, b.mask > 0)
            same = b.versions == self.version  # sampled with the weights this step starts from
            parts = policy_loss(new, b.old, b.adv, b.mask, obj, global_tokens, same)
            parts.loss.backward()
            st.loss += parts.loss.item()
            st.tokens += int(b.mask.sum().item())
            st.clipped += parts.clipped
            st.dual_clipped += parts.dual_clipped
            st.ratio_sum += parts.ratio
            st.kl_sum += parts.kl
            st.logprob_diff_max = max(st.logprob_diff_max, parts.logprob_diff)
            st.same_version_gap_max = max(st.same_version_gap_max, parts.same_version_gap)
            st.same_version_tokens += parts.same_version_tokens
            st.is_weight_sum += parts.is_weight
            st.is_truncated += parts.is_truncated
        return st

    def sampled_logprobs(self, b: Padded, where: torch.Tensor) -> torch.Tensor:
        """[B, T - 1]: each token's log-prob under the processed distribution it was sampled from
        (its sample's temperature, top_p, top_k), where `where` is true; 0 elsewhere."""
        rows = where.nonzero(as_tuple=True)
        logits = self.model.forward_train(b.tokens[:, :-1], rows)
        return sampled_logprobs(logits, b.tokens[:, 1:], rows, b.temperature, b.top_p, b.top_k)

    def sft_step(self, batch: list[tuple[list[int], list[int]]], global_tokens: int) -> float:
        """Cross-entropy on the masked tokens of (ids, mask) demonstrations; returns this
        replica's share of the global mean loss."""
        self.opt.zero_grad(set_to_none=False)
        samples = [TrainSample(ids=ids, mask=mask, logprobs=[0.0] * len(ids)) for ids, mask in batch]
        total = 0.0
        for mb in micro_batches(samples, self.optim_cfg.micro_batch_tokens):
            b = pad(mb).to(self.device)
            logits = self.model.forward_train(b.tokens[:, :-1])
            nll = F.cross_entropy(logits.flatten(0, 1).float(), b.tokens[:, 1:].flatten(), reduction="none")
            loss = (nll * b.mask.flatten()).sum() / global_tokens
            loss.backward()
            total += loss.item()
        self._apply()
        return total

    def _apply(self) -> float:
        """Reduce, clip, step. Replicas with no samples still take part with zero gradients."""
        for p in self.trainable():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.reducer.reduce(self.model)
        return self.update()

    def update(self) -> float:
        """Clip the reduced gradients by global norm and take the AdamW step (a hybrid replica
        applies the partner's summed gradients through this very call, so it stays bitwise equal)."""
        norm = torch.nn.utils.clip_grad_norm_(self.trainable(), self.optim_cfg.grad_clip)
        self.opt.step()
        return float(norm)

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        """The current model's log-prob of every token (position 0 gets 0.0) under each sample's
        processed distribution, without gradients."""
        with torch.no_grad():
            b = pad(samples).to(self.device)
            lp = self.sampled_logprobs(b, torch.ones_like(b.mask, dtype=torch.bool))
        return [[0.0, *lp[i, : len(s.ids) - 1].tolist()] for i, s in enumerate(samples)]

    # ---- checkpoints -------------------------------------------------------------------------------

    def load(self, weights: dict, optimizer: dict | None, step: int, version: int) -> None:
        """Resume: weights, AdamW's moments (fresh when the checkpoint has none), step, version."""
        self.model.load_state_dict(weights, strict=True)
        self.opt = self._new_optimizer()
        if optimizer is not None:
            self.opt.load_state_dict(optimizer)
        self.step, self.version = step, version

    def fingerprint(self) -> str:
        """A digest of every parameter's bytes: replicas that agree bit for bit print the same."""
        return weights_digest(self.model)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes, in order (16 hex digits)."""
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach()
        h.update(
            (t if t.dtype == torch.float32 and t.device.type == "cpu" else t.float().cpu()).numpy().tobytes()
        )
    return h.hexdigest()[:16]

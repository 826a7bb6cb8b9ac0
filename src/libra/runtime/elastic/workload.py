"""A small, deterministic language-modelling workload for elastic runs, tests and benchmarks.

Every process derives the same batch for a step from the seed alone, so a core replica, a joiner
and a partner computing a failed joiner's share all see identical samples without a data server.
Samples have different lengths (the layout balances tokens, not samples); each follows a simple
affine pattern modulo the vocabulary with some noise, so the loss falls visibly as the model
learns. The loss is next-token cross-entropy summed over the batch and divided by the step's
*global* count of predicted tokens, as `libra train` normalises, so gradients add up exactly
across any split of the samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SyntheticLM:
    def __init__(self, vocab: int, batch: int, min_len: int, max_len: int, seed: int):
        if not 2 <= min_len <= max_len:
            raise ValueError(f"need 2 <= min_len <= max_len, got {min_len}, {max_len}")
        self.vocab, self.batch_size, self.min_len, self.max_len, self.seed = (
            vocab,
            batch,
            min_len,
            max_len,
            seed,
        )
        self._batch = lru_cache(maxsize=4)(self._make)

    def _make(self, step: int) -> tuple[Tensor, ...]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        out = []
        for _ in range(self.batch_size):
            n = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
            a, b = (int(x) for x in torch.randint(1, self.vocab, (2,), generator=g))
            seq = (torch.arange(n) * a + b) % self.vocab
            noise = torch.rand(n, generator=g) < 0.1
            seq[noise] = torch.randint(0, self.vocab, (int(noise.sum()),), generator=g)
            out.append(seq)
        return tuple(out)

    def samples(self, step: int) -> tuple[Tensor, ...]:
        return self._batch(step)

    def tokens(self, step: int) -> Sequence[int]:
        """Predicted tokens per sample (a sample of n tokens predicts n - 1)."""
        return [len(s) - 1 for s in self._batch(step)]

    def backward(self, model: nn.Module, step: int, indices: list[int]) -> None:
        seqs, total = self._batch(step), sum(self.tokens(step))
        for i in indices:
            logits = model.forward_train(seqs[i][None, :-1])[0]
            (F.cross_entropy(logits.float(), seqs[i][1:], reduction="sum") / total).backward()

    @torch.no_grad()
    def loss(self, model: nn.Module, step: int) -> float:
        seqs, total = self._batch(step), sum(self.tokens(step))
        s = sum(
            float(F.cross_entropy(model.forward_train(x[None, :-1])[0], x[1:], reduction="sum")) for x in seqs
        )
        return s / total

"""Tensors in, tokens out: turns a `StepPlan` into one model forward pass and samples from it.

The runner keeps a block table tensor, one row per running sequence, mirrored incrementally from
each sequence's block list (only new blocks are copied), so building a step's cache addresses is
a handful of vectorised ops instead of Python loops over every cached token.

Sampling is batched but per-sequence reproducible: greedy rows take the masked argmax, and random
rows draw their uniform number from the sequence's own seeded generator, so a sequence's output
does not depend on what else shared its batch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from libra.runtime.engine.kv_cache import NULL_BLOCK, KVCache
from libra.runtime.engine.model import PrefillChunk, StepBatch
from libra.runtime.engine.scheduler import Chunk, StepPlan
from libra.runtime.engine.sequence import Sequence, TokenLogprob


class MaskTable:
    """Boolean vocabulary masks for the allowed sets constraints return, cached by set."""

    def __init__(self, vocab_size: int, capacity: int = 4096):
        self.vocab_size, self.capacity = vocab_size, capacity
        self._ids: OrderedDict[frozenset[int], int] = OrderedDict()
        self._rows = torch.zeros(64, vocab_size, dtype=torch.bool)

    def rows(self, sets: Seq[frozenset[int] | None]) -> Tensor | None:
        """One mask row per set (None: every token), or None when no row masks anything."""
        if all(s is None for s in sets):
            return None
        if len(self._ids) + len(sets) > self.capacity:  # tool names vary by request: bound growth
            self._ids.clear()
        ids = [self._id(s) for s in sets]
        return self._rows[torch.tensor(ids, dtype=torch.long)]

    def _id(self, s: frozenset[int] | None) -> int:
        i = self._ids.get(s)
        if i is None:
            i = self._ids[s] = len(self._ids)
            if i >= self._rows.shape[0]:
                grown = torch.zeros(2 * self._rows.shape[0], self.vocab_size, dtype=torch.bool)
                grown[: self._rows.shape[0]] = self._rows
                self._rows = grown
            if s is None:
                self._rows[i].fill_(True)
            else:
                self._rows[i].zero_()
                self._rows[i, list(s)] = True
        return i


# Below this temperature sampling is greedy, as in vLLM: dividing logits by 1e-300 overflows to
# inf, and softmax of inf is NaN.
SAMPLING_EPS = 1e-5


def sample(
    logits: Tensor, seqs: Seq[Sequence], masks: MaskTable
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of `logits` [S, V], under each sequence's constraint and parameters.
    Sampling runs on the CPU in float32 whatever device and dtype the model ran in."""
    logits = logits.float().cpu()
    allowed = masks.rows([s.allowed() for s in seqs])
    masked = logits.clone() if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    masked = _biased(masked, seqs)
    picked = masked.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(seqs) if s.params.temperature >= SAMPLING_EPS]
    if random_rows:
        picked[random_rows] = _sample_random(masked[random_rows], [seqs[i] for i in random_rows])
    tokens = picked.tolist()
    return tokens, _logprobs(logits, tokens, seqs)


def _biased(masked: Tensor, seqs: Seq[Sequence]) -> Tensor:
    """`logit_bias` added after the constraint mask, so a bias never unmasks a forbidden token
    (-inf plus any finite bias stays -inf) and a grammar's output stays well formed."""
    for i, s in enumerate(seqs):
        if s.params.logit_bias:
            ids, vals = zip(*s.params.logit_bias, strict=True)
            masked[i, list(ids)] += torch.tensor(vals, dtype=masked.dtype)
    return masked


def _sample_random(masked: Tensor, seqs: Seq[Sequence]) -> Tensor:
    temps = torch.tensor([s.params.temperature for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs])
    probs = torch.softmax(masked / temps[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    keep = (cum - sorted_p) < top_p[:, None]  # the nucleus
    _keep_top_k_and_min_p(keep, sorted_p, seqs)
    keep[:, 0] = True  # the top token always stays, even for a top_p that rounds to 0 in float32
    sorted_p = sorted_p * keep
    cdf = sorted_p.cumsum(dim=-1)
    u = torch.tensor([[s.rng.random()] for s in seqs], dtype=cdf.dtype) * cdf[:, -1:]
    last_kept = (sorted_p > 0).sum(dim=-1, keepdim=True) - 1
    pick = torch.searchsorted(cdf, u, right=True).clamp(max=last_kept)
    return order.gather(1, pick).squeeze(1)


def _keep_top_k_and_min_p(keep: Tensor, sorted_p: Tensor, seqs: Seq[Sequence]) -> None:
    """Narrow `keep` (over probabilities sorted high to low) to each row's `top_k` most likely
    tokens and to those at least `min_p` times as likely as the most likely one."""
    if any(s.params.top_k for s in seqs):
        k = torch.tensor([s.params.top_k or sorted_p.shape[1] for s in seqs])
        keep &= torch.arange(sorted_p.shape[1])[None, :] < k[:, None]
    if any(s.params.min_p for s in seqs):
        min_p = torch.tensor([s.params.min_p for s in seqs], dtype=sorted_p.dtype)
        keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]


def _logprobs(logits: Tensor, tokens: list[int], seqs: Seq[Sequence]) -> list[TokenLogprob | None]:
    """Log-probabilities under the model's raw distribution, for sequences that asked for them."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not want:
        return out
    logp = torch.log_softmax(logits[want].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in want])).squeeze(1).tolist()
    for j, i in enumerate(want):
        k = seqs[i].params.top_logprobs
        top = ()
        if k:
            vals, idx = logp[j].topk(k)
            top = tuple(zip(idx.tolist(), vals.tolist(), strict=True))
        out[i] = TokenLogprob(tokens[i], chosen[j], top)
    return out


def _to_device(b: StepBatch, device: str) -> StepBatch:
    """The step's index tensors on the model's device (CUDA): one code path, moved at the end."""
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    out = StepBatch(move(b.tokens), move(b.prev_tokens), move(b.positions), move(b.slots), b.n_decode,
                    move(b.decode_blocks), move(b.decode_mask), block_size=b.block_size)  # fmt: skip
    out.prefills = [PrefillChunk(c.row0, c.n, c.pos0, move(c.blocks), move(c.mask)) for c in b.prefills]
    out.sample_rows = move(b.sample_rows)
    return out


class ModelRunner:
    def __init__(self, model, cache: KVCache, max_rows: int, blocks_per_seq: int):
        """`model`: the built-in `TinyTransformer` or a checkpoint's `LlamaFamily` (the same
        `forward(StepBatch, KVCache)`); the step's tensors go to the cache's device."""
        self.model, self.cache, self.bs = model, cache, cache.block_size
        self.device = cache.device
        self.table = torch.full((max_rows, blocks_per_seq), NULL_BLOCK, dtype=torch.long)
        self.masks = MaskTable(model.preset.vocab_size)
        self._ar = torch.arange(max(blocks_per_seq * self.bs, 1))
        self._touched = torch.zeros(cache.num_blocks, dtype=torch.bool)
        self._touched[NULL_BLOCK] = True

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[list[Chunk], list[int], list[TokenLogprob | None]]:
        """Run one step; returns the chunks that sampled, their tokens and their log-probs."""
        batch, sampling = self.build(plan)
        logits = self.model(batch, self.cache)
        tokens, logprobs = sample(logits, [c.seq for c in sampling], self.masks)
        return sampling, tokens, logprobs

    def build(self, plan: StepPlan) -> tuple[StepBatch, list[Chunk]]:
        chunks = plan.chunks
        self._sync_block_tables(chunks)
        tokens, prev, positions, rows, sample_rows, sampling = [], [], [], [], [], []
        first = [self.model.preset.vocab_size]  # embed_prev's row for "no token before"
        for c in chunks:
            tokens += c.seq.tokens[c.start : c.start + c.n]
            prev += first * (c.start == 0) + c.seq.tokens[max(c.start - 1, 0) : c.start + c.n - 1]
            positions += range(c.start, c.start + c.n)
            rows += [c.seq.row] * c.n
            if c.samples:
                sample_rows.append(len(tokens) - 1)
                sampling.append(c)
        pos, row = torch.tensor(positions), torch.tensor(rows)
        slots = self.table[row, pos // self.bs] * self.bs + pos % self.bs
        nd = len(plan.decodes)
        blocks, mask = self._decode_context(row[:nd], pos[:nd]) if nd else (None, None)
        batch = StepBatch(
            torch.tensor(tokens), torch.tensor(prev), pos, slots, nd, blocks, mask, block_size=self.bs
        )
        batch.prefills = self._prefill_chunks(plan.prefills, nd)
        batch.sample_rows = torch.tensor(sample_rows, dtype=torch.long)
        return (batch if self.device == "cpu" else _to_device(batch, self.device)), sampling

    def _sync_block_tables(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            s = c.seq
            if s.synced < len(s.blocks):
                new = s.blocks[s.synced :]
                self.table[s.row, s.synced : len(s.blocks)] = torch.tensor(new)
                s.synced = len(s.blocks)
                self._zero_fresh(new)

    def forget_blocks(self) -> None:
        """After the cache's memory was given back and taken anew: every block is fresh again."""
        self._touched.zero_()
        self._touched[NULL_BLOCK] = True

    def _zero_fresh(self, blocks: list[int]) -> None:
        """Zero blocks on their first use. Attention reads whole blocks and masks the unused
        tail; a masked score weighs 0, but 0 * NaN is NaN, so never-written memory (the cache is
        allocated with `empty`) must not hold NaN bit patterns. Reused blocks hold finite keys."""
        fresh = [b for b in blocks if not self._touched[b]]
        if fresh:
            idx = torch.tensor(fresh)
            self._touched[idx] = True
            for t in (self.cache.k, self.cache.v):
                t.view(t.shape[0], -1, self.bs, *t.shape[2:])[:, idx] = 0.0

    def _blocks(self, rows: Tensor, n_blocks: Tensor) -> Tensor:
        """Block ids of each row, the null block past each row's first `n_blocks`."""
        width = int(n_blocks.max())
        valid = self._ar[None, :width] < n_blocks[:, None]
        return torch.where(valid, self.table[rows, :width], NULL_BLOCK)

    def _decode_context(self, rows: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        lens = pos + 1
        blocks = self._blocks(rows, (lens + self.bs - 1) // self.bs)
        valid = self._ar[None, : blocks.shape[1] * self.bs] < lens[:, None]
        return blocks, valid[:, None, None, :]

    def _prefill_chunks(self, prefills: list[Chunk], row0: int) -> list[PrefillChunk]:
        out = []
        for c in prefills:
            if c.start == 0:
                out.append(PrefillChunk(row0, c.n, 0, None, None))
            else:
                length = c.start + c.n
                nb = -(-length // self.bs)
                blocks = self.table[c.seq.row, :nb][None]
                mask = self._ar[None, : nb * self.bs] <= (c.start + self._ar[: c.n])[:, None]
                out.append(PrefillChunk(row0, c.n, c.start, blocks, mask))
            row0 += c.n
        return out

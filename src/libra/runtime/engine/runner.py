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

from libra.runtime.engine.distribution import (
    LOGPROB_FLOOR,
    SAMPLING_EPS,
    filters,
    kept_set,
    processed_logprobs,
)
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


def sample(
    logits: Tensor, seqs: Seq[Sequence], masks: MaskTable, processed: bool = False
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of `logits` [S, V], under each sequence's constraint and parameters.
    Sampling runs on the CPU in float32 whatever device and dtype the model ran in."""
    logits = logits.float().cpu()
    sets = [s.allowed() for s in seqs]
    allowed = masks.rows(sets)
    masked = logits.clone() if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    masked = _biased(masked, seqs)
    picked = masked.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(seqs) if s.params.temperature >= SAMPLING_EPS]
    if random_rows:
        picked[random_rows] = _sample_random(masked[random_rows], [seqs[i] for i in random_rows])
    tokens = picked.tolist()
    return tokens, _logprobs(logits, tokens, seqs, [a is not None and len(a) == 1 for a in sets], processed)


def _biased(masked: Tensor, seqs: Seq[Sequence]) -> Tensor:
    """`logit_bias` added after the constraint mask, so a bias never unmasks a forbidden token
    (-inf plus any finite bias stays -inf) and a grammar's output stays well formed."""
    for i, s in enumerate(seqs):
        if s.params.logit_bias:
            ids, vals = zip(*s.params.logit_bias, strict=True)
            masked[i, list(ids)] += torch.tensor(vals, dtype=masked.dtype)
    return masked


def _sample_random(masked: Tensor, seqs: Seq[Sequence]) -> Tensor:
    """Draw from each row's constrained distribution, narrowed by its top_k, top_p and min_p (as
    vLLM does: the constraint first, so a narrow nucleus never leaves nothing to sample). The
    uniform number comes from the sequence's own generator, over tokens sorted by probability."""
    p = _params(seqs)
    probs = torch.softmax(masked / p[0][:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    if filters(*p[1:]):
        sorted_p = sorted_p * kept_set(probs, *p[1:]).gather(1, order)
    cdf = sorted_p.cumsum(dim=-1)
    u = torch.tensor([[s.rng.random()] for s in seqs], dtype=cdf.dtype) * cdf[:, -1:]
    last_kept = (sorted_p > 0).sum(dim=-1, keepdim=True) - 1
    pick = torch.searchsorted(cdf, u, right=True).clamp(max=last_kept)
    return order.gather(1, pick).squeeze(1)


def _params(seqs: Seq[Sequence]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each row's temperature, top_p, top_k and min_p."""
    ps = [s.params for s in seqs]
    return (torch.tensor([x.temperature for x in ps]), torch.tensor([x.top_p for x in ps]),
            torch.tensor([x.top_k for x in ps]), torch.tensor([x.min_p for x in ps]))  # fmt: skip


def _logprobs(logits: Tensor, tokens: list[int], seqs: Seq[Sequence], forced: list[bool], processed: bool) -> list[TokenLogprob | None]:  # fmt: skip
    """Log-probabilities, for the sequences that asked for them, under the model's raw
    distribution, or (`processed`) under the policy's processed one (`distribution`: temperature,
    top_k, top_p, min_p; never the constraint). A token the constraint chose alone (it allowed
    one token, or none the processed distribution keeps) is marked `forced`."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not want:
        return out
    logp = processed_logprobs(logits[want], *(_params([seqs[i] for i in want]) if processed else ()))
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in want])).squeeze(1).tolist()
    for j, i in enumerate(want):
        k = seqs[i].params.top_logprobs
        top = ()
        if k:
            vals, idx = logp[j].topk(k)
            top = tuple(zip(idx.tolist(), [max(v, LOGPROB_FLOOR) for v in vals.tolist()], strict=True))
        lp = chosen[j]
        out[i] = TokenLogprob(tokens[i], max(lp, LOGPROB_FLOOR), top, forced[i] or lp == float("-inf"))
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
    def __init__(self, model, cache: KVCache, max_rows: int, blocks_per_seq: int, processed: bool = False):
        """`model`: the built-in `TinyTransformer` or a checkpoint's `LlamaFamily` (the same
        `forward(StepBatch, KVCache)`); the step's tensors go to the cache's device."""
        self.model, self.cache, self.bs = model, cache, cache.block_size
        self.device = cache.device
        self.processed = processed  # report log-probs of the processed distribution (logprobs_mode)
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
        tokens, logprobs = sample(logits, [c.seq for c in sampling], self.masks, self.processed)
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

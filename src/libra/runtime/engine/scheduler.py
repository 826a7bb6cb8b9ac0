"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step every running sequence that has caught up decodes one token, sequences still reading
their prompt get a chunk of it (so a long prompt never stalls everyone else's decoding for long),
and waiting sequences are admitted while there is room: a free row (at most `max_num_seqs`
running), token budget, and KV blocks. When the cache runs out, the most recently admitted
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later. That is vLLM's recompute policy; it keeps the oldest requests moving.

Plain Python with no torch and no clock, so it is property-tested directly (nothing lost,
capacity never exceeded). The rules it shares with the simulated engine (chunk size, preemption
victim, admission against a reserve) are in `libra.rollout.batching`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from libra.rollout.batching import admits, preemption_victim, prefill_chunk
from libra.runtime.engine.kv_cache import BlockAllocator
from libra.runtime.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class Chunk:
    seq: Sequence
    start: int
    n: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so its last logits pick a token."""
        return self.start + self.n == len(self.seq.tokens)


@dataclass(slots=True)
class StepPlan:
    decodes: list[Chunk] = field(default_factory=list)  # single-token chunks, batched attention
    prefills: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def chunks(self) -> list[Chunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.n for c in self.prefills)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_batched_tokens: int, chunk: int):
        self.alloc, self.max_num_seqs = allocator, max_num_seqs
        self.max_batched_tokens, self.chunk = max_batched_tokens, chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._rows = list(range(max_num_seqs - 1, -1, -1))
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self._plan_running(plan, self.max_batched_tokens)
        self._admit(plan, budget)
        return plan

    def _plan_running(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = prefill_chunk(len(seq.tokens) - seq.num_computed, budget, self.chunk)
            if not self._make_room(seq, seq.num_computed + n, plan):
                break  # `seq` itself was preempted; everything after it already was
            (plan.decodes if n == 1 else plan.prefills).append(Chunk(seq, seq.num_computed, n))
            budget -= n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, n_tokens: int, plan: StepPlan) -> bool:
        """Blocks for `n_tokens` of `seq`, preempting from the back of the running list."""
        while not self.alloc.ensure(seq.blocks, n_tokens):
            victim = preemption_victim(self.running)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and self._rows and not plan.preempted:
            seq = self.waiting[0]
            n = prefill_chunk(len(seq.tokens), budget, self.chunk)
            # Keep one free block per running sequence so admitting does not force a preemption
            # on the very next decode step.
            if not admits(self.alloc.free_count, self.alloc.blocks_needed(0, n), len(self.running)):
                break
            self.alloc.ensure(seq.blocks, n)
            self.waiting.popleft()
            seq.admit(self._rows.pop())
            self.running.append(seq)
            (plan.decodes if n == 1 else plan.prefills).append(Chunk(seq, 0, n))
            budget -= n

    def retract(self, seq: Sequence) -> None:
        """A pause in mode `retract`: like a preemption, asked for rather than forced."""
        self._preempt(seq)
        self.preemptions -= 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._rows.append(seq.row)
        self.alloc.free(seq.blocks)
        seq.preempt()
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` wherever it is (running, waiting) and give back its row and blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self._rows.append(seq.row)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.alloc.free(seq.blocks)
        seq.finish(reason)

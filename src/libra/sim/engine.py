"""A simulated inference-engine instance that schedules like vLLM.

- Continuous batching with `max_num_seqs` and a `max_num_batched_tokens` budget per step;
  prefills are chunked into that budget, decodes take one token each.
- A KV cache of the cost model's capacity, at token granularity. When a decode cannot grow, cached
  prefixes are evicted first (LRU), then the most recently admitted sequence is preempted and
  recomputed later (vLLM's recompute preemption).
- Prefix reuse: a finished turn leaves its KV cached under the trajectory's key, so the next turn
  on the same instance prefills only the new tokens. On another instance it prefills everything
  (or receives the KV by transfer, see `submit(..., kv_ready=...)`).
- During a tool call a trajectory's KV is `resident` (kept as an evictable cached prefix),
  `offload`ed to host memory (reloaded over PCIe when the next turn arrives), or `drop`ped.
- Priority: requests wait in order of `Seq.priority` (lower first; FCFS among equals, and all
  equal by default), and admitted requests get their prefill chunks in that order (a prefill
  under way keeps its place), so a scheduler that ranks requests (Seer's longest-first, Heddle's
  progressive priority) is carried out by the queue that admits them.
- Interruption (`interrupt` / `resume`): at the end of the iteration now running, every request
  the engine holds is aborted and handed back with the tokens it produced, the whole KV cache is
  dropped, and the engine stays paused until resumed. This is a weight update that interrupts
  generation (AReaL) and the abort of a rollout that reached its target count (APRIL): aborted
  requests recompute their KV wherever they resume.

Speed: while only decodes run, the batch composition is fixed until a sequence finishes, the KV
cache fills, or an arrival can be admitted. Step time is exactly A + B * ctx_sum (see
`RolloutCostModel.decode_coeffs`), and ctx_sum grows by n per step, so K steps take
K*A + B*(K*C0 + n*K*(K-1)/2): one event per segment, not per iteration. Each sequence's context is
derived from a global step counter, so advancing K steps costs O(1) plus heap pops.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from enum import IntEnum

from libra.costmodel.rollout import KV_BLOCK, RolloutCostModel
from libra.rollout.batching import admits, preemption_victim, prefill_chunk
from libra.sim.kernel import Handle, Kernel


class KVPolicy(IntEnum):
    RESIDENT = 0
    OFFLOAD = 1
    DROP = 2

    @classmethod
    def parse(cls, text: str) -> KVPolicy:
        return cls[text.upper()]


class SeqState(IntEnum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    DONE = 3
    ABORTED = 4


class Seq:
    """One request (one turn of a trajectory) on one engine."""

    __slots__ = ("key", "ctx", "done_tokens", "out_total", "out_left", "keep_kv", "state", "admit_step",
                 "ctx_at_admit", "finish_step", "t_submit", "t_first", "t_done", "on_first", "on_done",
                 "order", "prefilled", "owner", "priority")  # fmt: skip

    def __init__(self, key, ctx: int, out_tokens: int, on_done: Callable[[Seq], None] | None = None,
                 keep_kv: bool = False, on_first: Callable[[Seq], None] | None = None, owner=None,
                 priority: float = 0.0):  # fmt: skip
        self.key, self.ctx, self.out_total, self.out_left = key, ctx, out_tokens, out_tokens
        self.keep_kv, self.on_done, self.on_first, self.owner = keep_kv, on_done, on_first, owner
        self.priority = priority  # lower is admitted first (FCFS among equals)
        self.state = SeqState.WAITING
        self.done_tokens = 0  # tokens of `ctx` whose KV is on this engine
        self.prefilled = 0  # tokens this engine actually prefilled for this seq (incl. recompute)
        self.admit_step = self.ctx_at_admit = self.finish_step = self.order = 0
        self.t_submit = self.t_first = self.t_done = -1.0

    def current_ctx(self, step_no: int) -> int:
        return self.ctx_at_admit + (step_no - self.admit_step)

    def produced(self, step_no: int) -> int:
        """Output tokens this submission has produced so far (at engine step `step_no`)."""
        if self.state == SeqState.DECODE:
            return self.out_total - (self.finish_step - step_no)
        return self.out_total - self.out_left


class StepPlan:
    """One scheduling decision (vLLM's SchedulerOutput): what the next step runs.

    Either one iteration of prefill `chunks` (sequence, tokens) beside every running decode, or,
    with no chunks, a segment of `decode_steps` decode-only iterations of a fixed batch. `preempted`
    lists the sequences the decision sent back to the queue. Empty when there is nothing to run.
    """

    __slots__ = ("chunks", "prefill_tokens", "prefill_attn", "decode_seqs", "decode_ctx", "decode_steps",
                 "preempted")  # fmt: skip

    def __init__(self) -> None:
        self.chunks: list[tuple[Seq, int]] = []
        self.prefill_tokens = 0
        self.prefill_attn = 0.0
        self.decode_seqs = 0
        self.decode_ctx = 0
        self.decode_steps = 0
        self.preempted: list[Seq] = []

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.decode_seqs


class Engine:
    """One instance: `cost.tp` GPUs running one model replica."""

    def __init__(self, kernel: Kernel, iid: str, cost: RolloutCostModel, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, kv_policy: KVPolicy = KVPolicy.RESIDENT,
                 tracer=None, pcie_gbps: float = 25.0, max_segment_steps: int | None = None):  # fmt: skip
        self.k, self.id, self.cost = kernel, iid, cost
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.kv_policy, self.tracer = kv_policy, tracer
        self.kv_cap = cost.kv_capacity_tokens()
        self.pcie_bytes_s = pcie_gbps * 1e9
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.heap: list[tuple[int, int, Seq]] = []
        self.order: list[Seq] = []  # decoding seqs by admission, for preemption (lazy)
        self.n_dec = self.ctx_sum = self.kv_pref = self.step_no = self.cache_tokens = 0
        self.cache: OrderedDict[object, int] = OrderedDict()
        self.host: dict[object, int] = {}
        self._busy: Handle | None = None
        self._seg: tuple | None = None  # (t0, K, A, B, C0, n) of the running decode segment
        self._counter = 0
        self.busy_s: float = 0.0
        self.prefill_tokens = self.decode_tokens = self.preemptions = 0
        self.evicted_tokens = 0
        self.healthy = True
        self._stepping = False
        self.paused = False
        self._on_abort: Callable[[Seq, int], None] | None = None
        self._arriving: dict[Seq, None] = {}  # reloading from host memory: in no queue yet
        self._prioritized = False  # whether any request had a non-default priority
        self.aborted = 0
        # Tests set 1 to step iteration by iteration and check the closed form against it.
        self.max_segment_steps = max_segment_steps

    # ---- queries ------------------------------------------------------------------------------

    @property
    def tp(self) -> int:
        return self.cost.tp

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.prefilling) + self.n_dec

    @property
    def running(self) -> int:
        return len(self.prefilling) + self.n_dec

    def kv_used(self) -> int:
        return self.ctx_sum + self.kv_pref + self.cache_tokens

    def busy_until(self) -> float:
        """When the iteration now running ends (now, if idle)."""
        return self.k.now if self._busy is None else self._busy.time

    def cached(self, key) -> int:
        return self.cache.get(key, 0) or self.host.get(key, 0)

    # ---- submission ---------------------------------------------------------------------------

    def submit(self, seq: Seq, kv_ready: int = 0) -> None:
        """Queue a turn. `kv_ready` tokens of its context arrived by KV transfer (no prefill)."""
        seq.t_submit = self.k.now
        self._counter += 1
        seq.order = self._counter
        reload = 0
        if seq.key in self.cache:
            seq.done_tokens = min(seq.ctx, self._take_cache(seq.key))
        elif seq.key in self.host:
            seq.done_tokens = reload = min(seq.ctx, self.host.pop(seq.key))
        else:
            seq.done_tokens = min(seq.ctx, kv_ready)
        if seq.done_tokens >= seq.ctx:  # a turn always prefills at least one token
            seq.done_tokens = seq.ctx - 1
        if reload:
            delay = reload * self.cost.model.kv_bytes_per_token / self.pcie_bytes_s
            self._arriving[seq] = None
            self.k.after(delay, self._enqueue, seq)
        else:
            self._enqueue(seq)

    def _enqueue(self, seq: Seq) -> None:
        if seq.state == SeqState.ABORTED:
            return  # interrupted while its KV was reloading
        self._arriving.pop(seq, None)
        if seq.priority != 0.0:
            self._prioritized = True
        if self._prioritized:
            self._insert_by_priority(seq)
        else:
            self.waiting.append(seq)
        self._poke()

    def _insert_by_priority(self, seq: Seq) -> None:
        """Behind every waiting request of the same or a lower priority value (FCFS among equals)."""
        w = self.waiting
        i = len(w)
        while i > 0 and w[i - 1].priority > seq.priority:
            i -= 1
        w.insert(i, seq)

    def adopt(self, key, tokens: int) -> None:
        """A trajectory's KV arrived by transfer while it waits on a tool: keep it as its prefix."""
        self._keep(key, tokens)

    # ---- interruption (weight updates, aborted rollouts) ------------------------------------------

    def interrupt(self, on_abort: Callable[[Seq, int], None]) -> None:
        """Abort every request at the end of the iteration now running (at once if idle), drop
        the whole KV cache and pause until `resume`. `on_abort(seq, produced)` is called once per
        aborted request, in admission order, with the output tokens it produced. Requests
        submitted while paused wait for `resume`."""
        self.paused = True
        self._on_abort = on_abort
        if self._stepping:
            return  # called from a step's own callbacks: the step handler aborts when it is done
        if self._busy is None:
            self._abort_all()
        elif self._seg is not None:
            self._cut_at_next_step()

    def resume(self) -> None:
        self.paused = False
        self._poke()

    def _abort_all(self) -> None:
        on_abort, self._on_abort = self._on_abort, None
        victims = [*self.prefilling, *self.waiting, *self._arriving]
        victims += [e[2] for e in self.heap if _live(e)]
        victims.sort(key=_order_of)
        produced = [seq.produced(self.step_no) for seq in victims]
        self.waiting.clear()
        self.prefilling.clear()
        self.heap.clear()
        self.order.clear()
        self._arriving.clear()
        self.n_dec = self.ctx_sum = self.kv_pref = 0
        self.cache.clear()
        self.host.clear()
        self.cache_tokens = 0
        self.aborted += len(victims)
        for seq in victims:
            seq.state = SeqState.ABORTED
        if on_abort is not None:
            for seq, n in zip(victims, produced, strict=True):
                on_abort(seq, n)

    def release(self, key) -> None:
        """The trajectory ended (or moved away): forget its cached prefix here."""
        self._take_cache(key)
        self.host.pop(key, None)

    def _take_cache(self, key) -> int:
        tokens = self.cache.pop(key, 0)
        self.cache_tokens -= tokens
        return tokens

    # ---- the scheduling loop: schedule() decides, _execute() times it, _end_*() apply it ---------

    def _poke(self) -> None:
        """Something changed: start work if idle, or cut a decode segment at the next step."""
        if self._stepping or self.paused:
            return  # the step handler schedules the next step when it is done
        if self._busy is None:
            self._schedule_next()
        elif self._seg is not None and self.waiting and self.running < self.max_num_seqs:
            self._cut_segment()

    def _schedule_next(self) -> None:
        if self.paused:
            if self._on_abort is not None:
                self._abort_all()
            return
        plan = self.schedule()
        if not plan.empty:
            self._execute(plan)

    def schedule(self) -> StepPlan:
        """The batching decision for the next step, like vLLM's `schedule()`.

        Like vLLM: the running requests first (preempting the newest when the KV cache cannot
        grow), then, only in a step that preempted nothing, waiting requests in FCFS order while
        each fits beside a reserve of one block per running request; then the prefill chunks.
        With no chunk to run, it plans a decode segment: the number of identical decode-only
        iterations until the batch changes. Queue and KV bookkeeping move with the decision; time
        does not (that is `_execute`)."""
        plan = StepPlan()
        self._room_for_decode(plan)
        if not plan.preempted:
            self._admit()
        if self.prefilling and self._plan_chunks(plan):
            return plan
        if self.n_dec:
            self._plan_segment(plan)
        return plan

    def _admit(self) -> None:
        """FCFS admission while a sequence slot is free and the whole prefill fits in free and
        evictable KV, keeping one block per running request free for its growth (the rule the
        live engine's scheduler shares, `libra.rollout.batching`)."""
        while self.waiting and self.running < self.max_num_seqs:
            seq = self.waiting[0]
            reserve = KV_BLOCK * self.running
            if self.running and not admits(
                self._free() + self.cache_tokens, seq.ctx - seq.done_tokens, reserve
            ):
                break
            self.waiting.popleft()
            seq.state = SeqState.PREFILL
            if self._prioritized:
                self._insert_prefill(seq)
            else:
                self.prefilling.append(seq)
            self.kv_pref += seq.done_tokens

    def _insert_prefill(self, seq: Seq) -> None:
        """Prefill chunks go by priority too, as vLLM's priority scheduler admits a waiting request
        only into the token budget left: ahead of every admitted request of a higher priority
        value that has not had a chunk yet (a prefill under way keeps its place)."""
        p = self.prefilling
        i = len(p)
        while i > 0 and p[i - 1].prefilled == 0 and p[i - 1].priority > seq.priority:
            i -= 1
        p.insert(i, seq)

    def _free(self) -> int:
        return self.kv_cap - self.ctx_sum - self.kv_pref - self.cache_tokens

    def _evict(self, need: int) -> bool:
        """Evict cached prefixes (LRU) until `need` tokens are free."""
        while self._free() < need and self.cache:
            _, tokens = self.cache.popitem(last=False)
            self.cache_tokens -= tokens
            self.evicted_tokens += tokens
        return self._free() >= need

    def _room_for_decode(self, plan: StepPlan) -> None:
        """Decodes must grow by one token each: evict, then preempt the newest (vLLM recompute)."""
        if self.kv_cap - self.ctx_sum - self.kv_pref - self.cache_tokens >= self.n_dec:
            return  # the common case, without a call
        while not self._evict(self.n_dec) and self.n_dec > 1:
            plan.preempted.append(self._preempt_newest())

    def _preempt_newest(self) -> Seq:
        while self.order and self.order[-1].state != SeqState.DECODE:
            self.order.pop()
        seq = preemption_victim(self.order)
        self.order.pop()
        ctx = seq.current_ctx(self.step_no)
        seq.state = SeqState.WAITING
        self.n_dec -= 1
        self.ctx_sum -= ctx
        seq.out_left = seq.finish_step - self.step_no
        seq.ctx, seq.done_tokens = ctx, 0
        self.preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def _plan_chunks(self, plan: StepPlan) -> bool:
        """Prefill chunks beside every running decode, for one iteration. False if no chunk fits."""
        self._room_for_decode(plan)
        budget = self.budget - self.n_dec
        chunks = plan.chunks
        for seq in self.prefilling:
            if budget <= 0:
                break
            c = prefill_chunk(seq.ctx - seq.done_tokens, budget, budget)
            if not self._evict(c):
                c = self._free()  # a prefill never preempts running work: take what is free
                if c <= 0:
                    break
            chunks.append((seq, c))
            self.kv_pref += c
            plan.prefill_tokens += c
            plan.prefill_attn += c * seq.done_tokens + c * (c + 1) / 2
            budget -= c
        if not chunks:
            if not self.n_dec:
                self._stall(plan)
                return True
            return False
        plan.decode_seqs, plan.decode_ctx, plan.decode_steps = self.n_dec, self.ctx_sum, 1
        return True

    def _stall(self, plan: StepPlan) -> None:
        """Partial prefills fill the cache and nothing decodes: requeue the newest and retry."""
        seq = self.prefilling.pop()
        if not self.prefilling:
            raise RuntimeError(
                f"{self.id}: a request of {seq.ctx} tokens exceeds the KV cache ({self.kv_cap})"
            )
        self.kv_pref -= seq.done_tokens
        seq.done_tokens, seq.state = 0, SeqState.WAITING
        self.preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        self._plan_chunks(plan)

    def _plan_segment(self, plan: StepPlan) -> None:
        """Decode-only: the batch stays fixed until a sequence finishes or the cache fills."""
        self._room_for_decode(plan)
        n, free = self.n_dec, self._free()
        top = self._top_live()
        assert top is not None  # a decode segment runs only with live decodes
        k_fin = top[0] - self.step_no
        k = max(1, min(k_fin, free // n))
        if self.max_segment_steps:
            k = min(k, self.max_segment_steps)
        plan.decode_seqs, plan.decode_ctx, plan.decode_steps = n, self.ctx_sum, k

    def _execute(self, plan: StepPlan) -> None:
        """Time the plan with the cost model and schedule its end (the model run, simulated)."""
        if plan.chunks:
            dt = self.cost.step_time(
                plan.prefill_tokens, plan.prefill_attn, plan.decode_seqs, plan.decode_ctx
            )
            self.busy_s += dt
            self._busy = self.k.after(dt, self._end_mixed, plan)
            if self.tracer is not None:
                self.tracer.engine_span(
                    self, self.k.now, self.k.now + dt, plan.decode_seqs, plan.prefill_tokens
                )
            return
        k, n, c0 = plan.decode_steps, plan.decode_seqs, plan.decode_ctx
        a, b = self.cost.decode_coeffs(n)
        dt = k * a + b * (k * c0 + n * k * (k - 1) / 2)
        self._seg = (self.k.now, k, a, b, c0, n)
        self.busy_s += dt
        self._busy = self.k.after(dt, self._end_segment, k)

    def _top_live(self) -> tuple[int, int, Seq] | None:
        heap = self.heap
        while heap and not _live(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _cut_segment(self) -> None:
        """An admissible request arrived mid-segment: stop after the step now running."""
        self._cut_at_next_step()

    def _cut_at_next_step(self) -> None:
        """End the running decode segment after the iteration now in progress."""
        assert self._seg is not None and self._busy is not None
        t0, k, a, b, c0, n = self._seg
        qa, qb = b * n / 2, a + b * c0 - b * n / 2  # S(j) = qa j^2 + qb j
        el = self.k.now - t0
        j = int((-qb + math.sqrt(qb * qb + 4 * qa * el)) / (2 * qa)) if qa > 0 else int(el / qb)
        j = min(k, j + 1)
        if j >= k:
            return
        self._busy.cancel()
        t_end = max(self.k.now, t0 + qa * j * j + qb * j)
        self.busy_s -= (t0 + qa * k * k + qb * k) - t_end
        self._seg = (t0, j, a, b, c0, n)
        self._busy = self.k.at(t_end, self._end_segment, j)

    # ---- applying a step's outputs (vLLM's update_from_output) -------------------------------------

    def _end_mixed(self, plan: StepPlan) -> None:
        self._busy, self._stepping = None, True
        self._advance(1)
        self.prefill_tokens += plan.prefill_tokens
        for seq, c in plan.chunks:
            seq.done_tokens += c
            seq.prefilled += c
            if seq.done_tokens >= seq.ctx:
                self._prefill_done(seq)
        self._stepping = False
        self._schedule_next()

    def _prefill_done(self, seq: Seq) -> None:
        """The last chunk's step also samples the sequence's next token."""
        self.prefilling.remove(seq)
        self.kv_pref -= seq.done_tokens
        if seq.out_left > 0:
            if seq.t_first < 0:
                seq.t_first = self.k.now
                if seq.on_first:
                    seq.on_first(seq)
            seq.out_left -= 1
            seq.ctx += 1
            self.decode_tokens += 1
        if seq.out_left <= 0:
            self._finish(seq, seq.ctx)
            return
        seq.state = SeqState.DECODE
        seq.admit_step, seq.ctx_at_admit = self.step_no, seq.ctx
        seq.finish_step = self.step_no + seq.out_left
        self.n_dec += 1
        self.ctx_sum += seq.ctx
        heapq.heappush(self.heap, (seq.finish_step, seq.order, seq))
        self.order.append(seq)
        if len(self.order) > 4 * self.n_dec + 64:
            self.order = [s for s in self.order if s.state == SeqState.DECODE]

    def _end_segment(self, k: int) -> None:
        self._busy, seg = None, self._seg
        assert seg is not None
        self._seg, self._stepping = None, True
        if self.tracer is not None:
            self.tracer.engine_span(self, seg[0], self.k.now, seg[5], 0)
        self._advance(k)
        self._stepping = False
        self._schedule_next()

    def _advance(self, k: int) -> None:
        """k decode steps happened: contexts grow, finished sequences leave."""
        self.step_no += k
        self.ctx_sum += self.n_dec * k
        self.decode_tokens += self.n_dec * k
        heap = self.heap
        while heap and heap[0][0] <= self.step_no:
            entry = heapq.heappop(heap)
            if not _live(entry):
                continue
            seq = entry[2]
            ctx = seq.current_ctx(self.step_no)
            self.n_dec -= 1
            self.ctx_sum -= ctx
            self._finish(seq, ctx)

    def _finish(self, seq: Seq, ctx: int) -> None:
        seq.state, seq.t_done, seq.ctx = SeqState.DONE, self.k.now, ctx
        if seq.keep_kv:
            self._keep(seq.key, ctx)
        if seq.on_done:
            seq.on_done(seq)

    def _keep(self, key, tokens: int) -> None:
        if self.kv_policy == KVPolicy.DROP:
            return
        if self.kv_policy == KVPolicy.OFFLOAD:
            self.host[key] = tokens
            return
        self._take_cache(key)
        if self._free() < tokens:
            self._evict(tokens)
        if self._free() >= tokens:
            self.cache[key] = tokens
            self.cache_tokens += tokens


def _order_of(seq: Seq) -> int:
    return seq.order


def _live(entry: tuple[int, int, Seq]) -> bool:
    """Heap entries are removed lazily: an entry is live if its sequence still finishes then."""
    seq = entry[2]
    return seq.state == SeqState.DECODE and seq.finish_step == entry[0]

"""A simulated inference-engine instance that schedules like vLLM.

- Continuous batching with `max_num_seqs` and a `max_num_batched_tokens` budget per step;
  prefills are chunked into that budget, decodes take one token each.
- A KV cache of the cost model's capacity (or the one a measured run allocated), at token
  granularity. Admission, preemption and prefix caching follow the engine preset's rules (vLLM
  V1's by default: a request is admitted when its whole sequence fits, the newest running request
  is preempted when the cache cannot grow and recomputed later, and its freed KV stays cached, so
  it recomputes only what was evicted meanwhile). Cached KV is evicted least recently cached
  first, from the tail.
- Prefix reuse: a finished turn leaves its KV cached under the trajectory's key, so the next turn
  on the same instance prefills only the new tokens. On another instance it prefills everything
  (or receives the KV by transfer, see `submit(..., kv_ready=...)`).
- During a tool call a trajectory's KV is `resident` (kept as an evictable cached prefix),
  `offload`ed to host memory (reloaded over PCIe when the next turn arrives), or `drop`ped.
- Priority: requests wait in order of `Seq.priority` (lower first; FCFS among equals, and all
  equal by default), and a request is admitted only into the token budget a step has left (vLLM
  V1), so a scheduler that ranks requests (Seer's longest-first, Heddle's progressive priority)
  is carried out by the queue that admits them.
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
                 tracer=None, pcie_gbps: float = 25.0, max_segment_steps: int | None = None,
                 kv_capacity: int | None = None):  # fmt: skip
        self.k, self.id, self.cost = kernel, iid, cost
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.kv_policy, self.tracer = kv_policy, tracer
        # The cache the cost model computes, or the one a measured run allocated (the replay).
        self.kv_cap = cost.kv_capacity_tokens() if kv_capacity is None else kv_capacity
        rules = cost.overhead
        self.watermark = int(rules.kv_watermark * self.kv_cap)
        self.reserve_per_running = KV_BLOCK * rules.reserve_blocks_per_running
        self.full_sequence = rules.admit_full_sequence
        self.prefix_caching = rules.prefix_caching
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
        # Tests set 1 to step iteration by iteration and check the closed form against it.
        self.max_segment_steps = max_segment_steps
        # Data-parallel ranks of an MoE model step together (`LockstepGroup`); None: on its own.
        self.group: LockstepGroup | None = None
        self.paused = False
        self._on_abort: Callable[[Seq, int], None] | None = None
        self._arriving: dict[Seq, None] = {}  # reloading from host memory: in no queue yet
        self._prioritized = False  # whether any request had a non-default priority
        self.aborted = 0

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
        if seq.key in self.host:
            seq.done_tokens = reload = min(seq.ctx, self.host.pop(seq.key))
        elif seq.key not in self.cache:  # a cached prefix is looked up at admission (`_admit_one`)
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
        if self._stepping or self._in_group_step():
            return  # the step's handler (or its group's) aborts when the step is done
        if self._busy is None:
            self._abort_all()
        elif self._seg is not None:
            self._cut_at_next_step()

    def _in_group_step(self) -> bool:
        return self.group is not None and (self.group.busy or self.group.stepping)

    def resume(self) -> None:
        self.paused = False
        self._poke()

    def _abort_pending(self) -> None:
        """Carry out an interrupt that waited for the end of a step."""
        if self._on_abort is not None:
            self._abort_all()

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
        if self.group is not None:
            self.group.poke()
        elif self._busy is None:
            self._schedule_next()
        elif self._seg is not None and self.waiting and self.running < self.max_num_seqs:
            self._cut_segment()

    def _schedule_next(self) -> None:
        self._abort_pending()
        if self.paused:
            return
        if self.group is not None:
            self.group.poke()
            return
        plan = self.schedule()
        if not plan.empty:
            self._execute(plan)

    def schedule(self) -> StepPlan:
        """The batching decision for the next step, like vLLM V1's `schedule()`.

        The running requests first: every decode grows by a token, then the partial prefills
        take their next chunk from what is left of the token budget, in admission order; when the
        KV cache cannot hold that, the newest running request is preempted (recomputed later),
        down to the request being scheduled itself. Then, only in a step that preempted nothing,
        waiting requests in FCFS order while a slot and budget are left and each fits (the
        preset's rule: its whole sequence, beside the watermark); each takes its first chunk at
        once, so the next one sees the cache that chunk used. With no chunk to run, it plans a
        decode segment: the number of identical decode-only iterations until the batch changes.
        Queue and KV bookkeeping move with the decision; time does not (that is `_execute`)."""
        plan = StepPlan()
        for _ in range(2):  # a step that preempted every running request retries with admission
            self._room_for_decode(plan)
            budget = self._plan_running_chunks(plan, self.budget - self.n_dec)
            if not plan.preempted:
                self._admit(plan, budget)
            if plan.chunks:
                plan.decode_seqs, plan.decode_ctx, plan.decode_steps = self.n_dec, self.ctx_sum, 1
                return plan
            if self.n_dec:
                self._plan_segment(plan)
                return plan
            if not (plan.preempted and self.waiting):
                break
            plan.preempted = []
        return plan

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """FCFS admission while a sequence slot and token budget are free and the head of the
        queue fits in free and evictable KV beside the reserve (`libra.rollout.batching.admits`)."""
        while self.waiting and budget > 0 and self.running < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.ctx > self.kv_cap:
                raise RuntimeError(
                    f"{self.id}: a request of {seq.ctx} tokens exceeds the KV cache ({self.kv_cap})"
                )
            need = seq.ctx if self.full_sequence else min(seq.ctx - seq.done_tokens, budget)
            reserve = self.watermark + self.reserve_per_running * self.running if self.running else 0
            if not admits(self._free() + self.cache_tokens, need, reserve):
                break
            self.waiting.popleft()
            budget -= self._admit_one(seq, plan, budget)

    def _admit_one(self, seq: Seq, plan: StepPlan, budget: int) -> int:
        """Admit `seq` with what is left of its cached prefix here, and plan its first chunk."""
        hit = self._take_cache(seq.key)
        if hit > seq.done_tokens:
            seq.done_tokens = min(hit, seq.ctx - 1)
        seq.state = SeqState.PREFILL
        self._counter += 1
        seq.order = self._counter  # admission order: the newest is the preemption victim
        self.prefilling.append(seq)
        self.kv_pref += seq.done_tokens
        c = prefill_chunk(seq.ctx - seq.done_tokens, budget, budget)
        self._evict(c)
        c = min(c, self._free())
        if c > 0:
            self._add_chunk(plan, seq, c)
        return c

    def _add_chunk(self, plan: StepPlan, seq: Seq, c: int) -> None:
        plan.chunks.append((seq, c))
        self.kv_pref += c
        plan.prefill_tokens += c
        plan.prefill_attn += c * seq.done_tokens + c * (c + 1) / 2

    def _free(self) -> int:
        return self.kv_cap - self.ctx_sum - self.kv_pref - self.cache_tokens

    def _evict(self, need: int) -> bool:
        """Evict cached KV until `need` tokens are free: the least recently cached prefix first,
        from its tail (vLLM frees a request's blocks tail first, and reuses the oldest freed)."""
        while self._free() < need and self.cache:
            key, tokens = next(iter(self.cache.items()))
            take = min(tokens, need - self._free())
            if take == tokens:
                del self.cache[key]
            else:
                self.cache[key] = tokens - take
            self.cache_tokens -= take
            self.evicted_tokens += take
        return self._free() >= need

    def _room_for_decode(self, plan: StepPlan) -> None:
        """Decodes must grow by one token each: evict, then preempt the newest running request
        (vLLM's recompute preemption). The last decoding request is never preempted for itself."""
        if self.kv_cap - self.ctx_sum - self.kv_pref - self.cache_tokens >= self.n_dec:
            return  # the common case, without a call
        while not self._evict(self.n_dec) and (self.n_dec > 1 or self.prefilling):
            plan.preempted.append(self._preempt_newest())

    def _plan_running_chunks(self, plan: StepPlan, budget: int) -> int:
        """The partial prefills' next chunks, oldest admitted first, preempting the newest running
        request while a chunk does not fit; a request that preempted itself ends the pass."""
        i = 0
        while i < len(self.prefilling) and budget > 0:
            seq = self.prefilling[i]
            c = prefill_chunk(seq.ctx - seq.done_tokens, budget, budget)
            while not self._evict(c):
                victim = self._preempt_newest()
                plan.preempted.append(victim)
                if victim is seq:
                    return budget
            self._add_chunk(plan, seq, c)
            budget -= c
            i += 1
        return budget

    def _newest_decoder(self) -> Seq | None:
        while self.order and self.order[-1].state != SeqState.DECODE:
            self.order.pop()
        return preemption_victim(self.order) if self.order else None

    def _preempt_newest(self) -> Seq:
        """Preempt the most recently admitted running request (decoding or prefilling): its KV is
        freed, and kept as an evictable cached prefix where the engine caches prefixes."""
        dec = self._newest_decoder()
        pre = self.prefilling[-1] if self.prefilling else None
        if pre is not None and (dec is None or pre.order > dec.order):
            self.prefilling.pop()
            self.kv_pref -= pre.done_tokens
            held, seq = pre.done_tokens, pre
        else:
            assert dec is not None
            self.order.pop()
            held = dec.current_ctx(self.step_no)
            self.n_dec -= 1
            self.ctx_sum -= held
            dec.out_left = dec.finish_step - self.step_no
            dec.ctx, seq = held, dec
        seq.state, seq.done_tokens = SeqState.WAITING, 0
        if self.prefix_caching and held:
            self._take_cache(seq.key)
            self.cache[seq.key] = held
            self.cache_tokens += held
        self.preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def _plan_segment(self, plan: StepPlan) -> None:
        """Decode-only: the batch stays fixed until a sequence finishes or the cache fills."""
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
        self._apply_mixed(plan)
        self._stepping = False
        self._schedule_next()

    def _apply_mixed(self, plan: StepPlan) -> None:
        self._advance(1)
        self.prefill_tokens += plan.prefill_tokens
        for seq, c in plan.chunks:
            seq.done_tokens += c
            seq.prefilled += c
            if seq.done_tokens >= seq.ctx:
                self._prefill_done(seq)

    def step_seconds(self, plan: StepPlan, pad_to: int = 0) -> float:
        """One iteration of `plan`, its linear layers run on at least `pad_to` tokens."""
        return self.cost.step_time(
            plan.prefill_tokens, plan.prefill_attn, plan.decode_seqs, plan.decode_ctx, pad_to
        )

    def apply(self, plan: StepPlan) -> None:
        """A lockstep group's step of this rank ended: its outputs apply (no next step here)."""
        self._stepping = True
        if plan.chunks:
            self._apply_mixed(plan)
        else:
            self._advance(plan.decode_steps)
        self._stepping = False

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


class LockstepGroup:
    """The data-parallel ranks of a mixture-of-experts model, stepping together.

    Every MoE layer gathers the tokens of all ranks (the experts are split over them, or sharded
    across the data-parallel group), so vLLM runs each forward pass on every rank at once: a rank
    pads its batch to the largest rank's tokens, and one with nothing to do runs a dummy batch
    while any other has work. Each rank keeps its own queue and its own scheduler (vLLM's
    data-parallel engines behind one load balancer); a step ends on all of them when the slowest
    is done, so one rank's prefill chunk holds up the other's decodes, and the padded tokens pay
    for the experts' all-gather too (`RolloutCostModel.step_time(..., pad_to)`)."""

    def __init__(self, kernel: Kernel, engines: list[Engine]):
        self.k, self.engines = kernel, engines
        self.busy = self.stepping = False
        self.steps = 0
        for e in engines:
            e.group = self
            e.max_segment_steps = 1  # decode segments would let the ranks drift apart

    def poke(self) -> None:
        """Start the group's next step, unless one is running or being applied. A rank that was
        interrupted during the step aborts now; a paused rank plans nothing (others go on)."""
        if self.busy or self.stepping:
            return
        for e in self.engines:
            e._abort_pending()
        plans = [StepPlan() if e.paused else e.schedule() for e in self.engines]
        if all(p.empty for p in plans):
            return
        pad = max(max(1, p.prefill_tokens + p.decode_seqs) for p in plans)
        dt = max(e.step_seconds(p, pad) for e, p in zip(self.engines, plans, strict=True))
        for e, p in zip(self.engines, plans, strict=True):
            if not p.empty:
                e.busy_s += dt
                if e.tracer is not None:
                    e.tracer.engine_span(e, self.k.now, self.k.now + dt, p.decode_seqs, p.prefill_tokens)
        self.busy = True
        self.steps += 1
        self.k.after(dt, self._end, plans)

    def _end(self, plans: list[StepPlan]) -> None:
        self.busy, self.stepping = False, True
        for e, p in zip(self.engines, plans, strict=True):
            if not p.empty:
                e.apply(p)
        self.stepping = False
        self.poke()


def _order_of(seq: Seq) -> int:
    return seq.order


def _live(entry: tuple[int, int, Seq]) -> bool:
    """Heap entries are removed lazily: an entry is live if its sequence still finishes then."""
    seq = entry[2]
    return seq.state == SeqState.DECODE and seq.finish_step == entry[0]

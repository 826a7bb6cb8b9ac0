"""The engine loop: one thread that owns the model, the KV cache and the scheduler.

Why a thread: torch releases the GIL inside its kernels, so the HTTP event loop keeps accepting
and streaming while a step runs, and nothing in the model or cache needs a lock because only this
thread touches them. Everything crosses the boundary through two doors:

- in: a queue of commands (add sequences, abort a request, stop), drained before every step;
- out: `publish(events)`, called once per step with every sequence's `SeqEvent`, so the server
  wakes its event loop once per step, not once per token.

A step that raises (a bug, or memory) fails every in-flight sequence with an error event instead
of killing the thread, so clients get a 500 rather than a request that never answers; and if the
thread does die, `/health` says so (503) so that a gateway stops sending it work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.kv_cache import BlockAllocator, KVCache
from libra.runtime.engine.metrics import EngineMetrics
from libra.runtime.engine.model import TinyTransformer
from libra.runtime.engine.runner import ModelRunner
from libra.runtime.engine.scheduler import Scheduler, StepPlan
from libra.runtime.engine.sequence import FinishReason, SeqEvent, SeqStatus, Sequence

log = logging.getLogger("libra.engine")

Publish = Callable[[list[tuple[object, SeqEvent]]], None]


class EngineCore:
    def __init__(self, cfg: EngineConfig, model: TinyTransformer, publish: Publish, metrics: EngineMetrics | None = None):  # fmt: skip
        self.cfg, self.publish, self.metrics = cfg, publish, metrics or EngineMetrics()
        self.alloc = BlockAllocator(cfg.num_blocks(), cfg.block_size)
        self.cache = KVCache(cfg.preset, cfg.num_blocks(), cfg.block_size)
        self.sched = Scheduler(self.alloc, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefill_chunk)
        self.runner = ModelRunner(model, self.cache, cfg.max_num_seqs, cfg.blocks_per_seq())
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, list[Sequence]] = {}
        self._thread: threading.Thread | None = None
        self.steps, self.peak_batch = 0, 0

    # ---- the thread-safe doors ------------------------------------------------------------------

    def submit(self, seqs: list[Sequence]) -> None:
        self._inbox.put(("add", seqs))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="libra-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def run_sync(self, seqs: list[Sequence]) -> None:
        """Run `seqs` to completion on the calling thread (tests, benchmarks); never with start()."""
        self._apply("add", seqs)
        while self.sched.has_work:
            self.step()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    @property
    def num_waiting(self) -> int:
        return len(self.sched.waiting)

    # ---- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.cfg.threads)
        wait = 1.0
        while self._drain(wait):
            computed = self._step_safely()
            # Busy while there is work; a short nap if nothing could run (never expected, but a
            # spin would starve the HTTP thread); a long wait for the next request when idle.
            wait = 0.0 if computed else (0.005 if self.sched.has_work else 1.0)

    def _step_safely(self) -> int:
        try:
            return self.step()
        except Exception:  # a failed step must not strand its requests: fail them loudly
            log.exception("engine step failed")
            self.publish(self._fail_all("engine step failed; see the engine log"))
            return 0

    def _drain(self, wait: float) -> bool:
        """Apply queued commands, waiting up to `wait` seconds for one. False once asked to stop."""
        try:
            cmd = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._apply(*cmd):
                return False
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, kind: str, arg) -> bool:
        if kind == "add":
            for seq in arg:
                self._live.setdefault(seq.rid, []).append(seq)
                self.sched.add(seq)
                self.metrics.prompt_tokens.inc(seq.n_prompt)
        elif kind == "abort":
            for seq in self._live.pop(arg, ()):
                if seq.status != SeqStatus.FINISHED:
                    self.sched.finish(seq, FinishReason.ABORT)
                    self.metrics.seqs_finished.labels(FinishReason.ABORT).inc()
        return kind != "stop"

    def step(self) -> int:
        """One scheduling step; returns how many sequences it computed."""
        t0 = time.perf_counter()
        plan = self.sched.schedule()
        if plan.preempted:
            self.metrics.preemptions.inc(len(plan.preempted))
        if plan.empty:
            return 0
        self.publish(self._execute(plan))
        self._observe(plan, time.perf_counter() - t0)
        return len(plan.chunks)

    def _execute(self, plan: StepPlan) -> list[tuple[object, SeqEvent]]:
        sampling, tokens, logprobs = self.runner.execute(plan)
        for c in plan.chunks:
            c.seq.num_computed += c.n
        now = time.monotonic()
        events = []
        for chunk, tok, lp in zip(sampling, tokens, logprobs, strict=True):
            events.append((chunk.seq.sink, self._accept(chunk.seq, tok, lp, now)))
        self.metrics.generation_tokens.inc(len(tokens))
        return events

    def _accept(self, seq: Sequence, token: int, lp, now: float) -> SeqEvent:
        ev = SeqEvent(seq.index)
        seq.tokens.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft.observe(max(0.0, now - seq.arrived))
        if lp is not None:
            ev.logprobs.append(lp)
        reason = seq.output.feed(token, ev)
        if reason is None and seq.budget() <= 0:
            seq.output.flush(ev)
            reason = FinishReason.LENGTH
        if reason is not None:
            self._retire(seq, reason, ev)
        return ev

    def _retire(self, seq: Sequence, reason: str, ev: SeqEvent) -> None:
        self.sched.finish(seq, reason)
        self.metrics.seqs_finished.labels(reason).inc()
        ev.finish, ev.prompt_tokens, ev.completion_tokens = reason, seq.n_prompt, seq.n_generated
        siblings = self._live.get(seq.rid, ())
        if all(s.status == SeqStatus.FINISHED for s in siblings):
            self._live.pop(seq.rid, None)

    def _fail_all(self, message: str) -> list[tuple[object, SeqEvent]]:
        events = []
        for seqs in list(self._live.values()):
            for seq in seqs:
                if seq.status != SeqStatus.FINISHED:
                    ev = SeqEvent(seq.index, error=message)
                    self._retire(seq, FinishReason.ABORT, ev)
                    events.append((seq.sink, ev))
        return events

    def _observe(self, plan: StepPlan, seconds: float) -> None:
        m, n = self.metrics, len(plan.chunks)
        self.steps += 1
        m.step_seconds.observe(seconds)
        m.step_batch.observe(n)
        m.running.set(self.num_running)
        m.waiting.set(self.num_waiting)
        m.kv_usage.set(self.alloc.used_count / max(1, self.alloc.num_blocks - 1))
        if n > self.peak_batch:
            self.peak_batch = n
            m.peak_running.set(n)

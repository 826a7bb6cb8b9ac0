"""The engine loop: one thread that owns the model, the KV cache and the scheduler.

Why a thread: torch releases the GIL inside its kernels, so the HTTP event loop keeps accepting
and streaming while a step runs, and nothing in the model or cache needs a lock because only this
thread touches them. Everything crosses the boundary through two doors:

- in: a queue of commands (add sequences, abort a request, pause, continue, new weights, stop),
  drained before every step, so a control command always lands between two steps;
- out: `publish(events)`, called once per step with every sequence's `SeqEvent`, so the server
  wakes its event loop once per step, not once per token.

The control plane an RL trainer drives lives here because only this thread may touch the model
and the scheduler. Pausing follows SGLang's modes (plus vLLM's `wait`): `abort` finishes every
request in flight with what it has (finish reason `abort`); `in_place` stops stepping and keeps
every request with its KV cache; `retract` stops stepping and sends running requests back to the
queue, their cache freed, to be recomputed on continue (so with new weights if new weights came in
between); `wait` lets everything already submitted finish. Requests that arrive while paused are
held and join at continue. New weights are copied into the live model between two steps, and
every sampled token is tagged with the weight version that produced it.

Sleeping follows vLLM's levels: level 1 gives the KV cache back (a CPU engine has no device to
offload its weights from, so they stay); level 2 also discards the weights (zeroed in place: their
memory stays allocated, their values are gone). After a level-2 sleep the engine runs nothing,
awake or not, until every parameter has been loaded again: requests are held, never served by
discarded weights.

A step that raises (a bug, or memory) fails every in-flight sequence with an error event instead
of killing the thread, so clients get a 500 rather than a request that never answers; and if the
thread does die, `/health` says so (503) so that a gateway stops sending it work.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from enum import Enum

import torch
from torch import Tensor

from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.kv_cache import BlockAllocator, KVCache
from libra.runtime.engine.metrics import EngineMetrics
from libra.runtime.engine.runner import ModelRunner
from libra.runtime.engine.scheduler import Scheduler, StepPlan
from libra.runtime.engine.sequence import FinishReason, SeqEvent, SeqStatus, Sequence

log = logging.getLogger("libra.engine")

Publish = Callable[[list[tuple[object, SeqEvent]]], None]


class PauseMode(str, Enum):
    """How a pause treats the requests in flight (SGLang's three, and vLLM's `wait`)."""

    ABORT = "abort"
    IN_PLACE = "in_place"
    RETRACT = "retract"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computed, as the cost model prices it (`libra costmodel calibrate --data`):
    prompt tokens and their attention pairs, decoding sequences and their context."""

    prefill_tokens: int
    prefill_attn: float
    decode_seqs: int
    decode_ctx: float

    @classmethod
    def of(cls, plan: StepPlan) -> StepShape:
        pre = plan.prefills
        return cls(sum(c.n for c in pre), float(sum(c.n * c.start + c.n * (c.n + 1) / 2 for c in pre)),
                   len(plan.decodes), float(sum(c.start + 1 for c in plan.decodes)))  # fmt: skip


class ControlError(Exception):
    """A control command the engine's state does not allow (the server answers 400)."""


class EngineCore:
    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, publish: Publish, metrics: EngineMetrics | None = None):  # fmt: skip
        """`model` is the built-in `TinyTransformer` or a checkpoint's `LlamaFamily`: both step
        through `forward(StepBatch, KVCache)` (`runner`), so nothing here depends on which."""
        self.cfg, self.publish, self.metrics = cfg, publish, metrics or EngineMetrics()
        self.alloc = BlockAllocator(cfg.num_blocks(), cfg.block_size)
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(cfg.preset, cfg.num_blocks(), cfg.block_size, dtype, cfg.device)
        self.sched = Scheduler(self.alloc, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefill_chunk)
        self.runner = ModelRunner(model, self.cache, cfg.max_num_seqs, cfg.blocks_per_seq())
        self.model = model
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, list[Sequence]] = {}
        self._thread: threading.Thread | None = None
        self.steps, self.peak_batch = 0, 0
        self.weight_version = cfg.weight_version
        self.paused: PauseMode | None = None
        self._held: dict[Sequence, None] = {}  # submitted while paused (in order): join at continue
        self._drained: list[Future] = []  # `wait` pauses that answer once what ran has finished
        self.discarded: set[str] = set()  # parameters a level-2 sleep zeroed and no update rewrote yet
        # `--step-log`: written by the engine thread only, after each step's CPU is read.
        self._step_log = open(cfg.step_log, "a", buffering=1, encoding="utf-8") if cfg.step_log else None  # noqa: SIM115

    # ---- the thread-safe doors ------------------------------------------------------------------

    def submit(self, seqs: list[Sequence]) -> None:
        self._inbox.put(("add", seqs))

    def abort(self, rid: str) -> None:
        """The client left: drop its sequences silently (nobody reads their events)."""
        self._inbox.put(("abort", rid))

    def control(self, kind: str, arg: object = None) -> Future:
        """Queue a control command; the future holds its result (a dict) or a ControlError."""
        fut: Future = Future()
        self._inbox.put((kind, (arg, fut)))
        return fut

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="libra-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)
        if self._step_log is not None and not self.alive:
            self._step_log.close()

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
        return len(self.sched.waiting) + len(self._held)

    @property
    def sleeping(self) -> bool:
        return self.cache.released

    @property
    def can_step(self) -> bool:
        """Not paused, or pausing with `wait` while what was submitted before still runs; and the
        KV cache is there."""
        if self.cache.released or self.discarded:
            return False
        return self.paused is None or (self.paused == PauseMode.WAIT and self.sched.has_work)

    # ---- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.cfg.threads)
        wait = 1.0
        while self._drain(wait):
            computed = self._step_safely() if self.can_step else 0
            self._answer_drained()
            # Busy while there is work; a short nap if nothing could run (never expected, but a
            # spin would starve the HTTP thread); a long wait for the next command when idle or
            # paused.
            wait = 0.0 if computed else (0.005 if self.can_step and self.sched.has_work else 1.0)

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
                if self.paused or self.sleeping or self.discarded:
                    self._held[seq] = None
                else:
                    self.sched.add(seq)
                self.metrics.prompt_tokens.inc(seq.n_prompt)
        elif kind == "abort":
            for seq in self._live.pop(arg, ()):
                if seq.status != SeqStatus.FINISHED:
                    self._finish(seq, FinishReason.ABORT)
                    self.metrics.seqs_finished.labels(FinishReason.ABORT).inc()
        elif kind != "stop":
            arg, fut = arg
            try:
                if kind == "pause" and arg == PauseMode.WAIT:
                    self._pause_wait(fut)
                else:
                    fut.set_result(getattr(self, "_do_" + kind)(arg))
            except ControlError as e:
                fut.set_exception(e)
            except Exception as e:  # a bug in a control command must not kill the engine thread
                log.exception("engine control %s failed", kind)
                fut.set_exception(e)
        return kind != "stop"

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq in self._held:  # it never reached the scheduler
            del self._held[seq]
            seq.finish(reason)
        else:
            self.sched.finish(seq, reason)

    # ---- control commands (engine thread; each returns the JSON the server answers) -------------

    def _do_pause(self, mode: PauseMode) -> dict:
        out: dict = {"paused": mode.value}
        if mode == PauseMode.ABORT:
            out["aborted"] = self._abort_all("paused with mode abort")
        elif mode == PauseMode.RETRACT:
            out["retracted"] = self._retract_all()
        self.paused = mode
        return out

    def _pause_wait(self, fut: Future) -> None:
        """Hold new requests; answer `fut` once everything submitted before has finished."""
        if self.paused is None:
            self.paused = PauseMode.WAIT
        self._drained.append(fut)

    def _answer_drained(self) -> None:
        if self._drained and not self.sched.has_work:
            for fut in self._drained:
                fut.set_result({"paused": PauseMode.WAIT.value, "drained": True})
            self._drained.clear()

    def _do_continue(self, _arg) -> dict:
        was = self.paused
        self.paused = None
        released = self._release_held()
        for fut in self._drained:  # a wait cut short by continue still answers
            fut.set_result({"paused": PauseMode.WAIT.value, "drained": False})
        self._drained.clear()
        return {"resumed": True, "was": was.value if was else None, "released": released}

    def _release_held(self) -> int:
        """Held requests join the scheduler, unless the cache is still given back or the weights
        are still discarded."""
        if self.sleeping or self.discarded:
            return 0
        for seq in self._held:
            self.sched.add(seq)
        released, self._held = len(self._held), {}
        return released

    def _do_release_memory(self, discard_weights: bool = False) -> dict:
        """Give the KV cache's memory back (vLLM's sleep); requests that arrive meanwhile are held.
        `discard_weights` (level 2): the weights go too, until every parameter is loaded again."""
        live = sum(1 for group in self._live.values() for s in group if s.status != SeqStatus.FINISHED)
        if live:
            raise ControlError(f"{live} requests are in flight or held; let them finish or pause with mode abort first")  # fmt: skip
        released = ["kv_cache", "weights"] if discard_weights else ["kv_cache"]
        if discard_weights:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    param.zero_()
                    self.discarded.add(name)
        freed = 0 if self.sleeping else self.cache.release()
        return {
            "released": released,
            "freed_mb": round(freed / 2**20, 1),
            "weights_discarded": bool(self.discarded),
        }

    def _do_resume_memory(self, _arg) -> dict:
        if self.sleeping:
            self.cache.restore()
            self.runner.forget_blocks()
        released = self._release_held() if self.paused is None else 0
        return {"resumed": ["kv_cache"], "released": released, "weights_discarded": bool(self.discarded)}

    def _do_abort_requests(self, rid: str | None) -> dict:
        """SGLang's /abort_request: one request (by id) or all, answered with what they have."""
        if rid is None:
            return {"aborted": self._abort_all("aborted by /abort_request")}
        seqs = [s for s in self._live.get(rid, ()) if s.status != SeqStatus.FINISHED]
        self.publish([self._abort_one(s, "aborted by /abort_request") for s in seqs])
        return {"aborted": len(seqs)}

    def _do_flush(self, _arg) -> dict:
        """There is no prefix cache to drop (blocks are freed when a request finishes), so a flush
        only checks SGLang's rule: nothing may hold KV blocks (in-place paused requests do)."""
        holding = len(self.sched.running)
        if holding:
            raise ControlError(f"{holding} requests hold KV blocks (running or paused in place); pause with mode abort or retract first")  # fmt: skip
        return {"flushed": True, "kv_blocks_in_use": self.alloc.used_count}

    def _do_weights(self, arg: tuple[dict[str, Tensor], str | None, bool]) -> dict:
        """Copy new weights into the live model between two steps; optionally abort first."""
        tensors, version, abort_first = arg
        aborted = self._abort_all("aborted for a weight update") if abort_first else 0
        if "lora.scale" in tensors:  # an adapter: merged onto the kept base weights
            self.model.apply_adapter(tensors)
        else:
            params = self.model.state_dict()
            with torch.no_grad():
                for name, t in tensors.items():
                    params[name].copy_(t)  # cast to the model's dtype and device
        if version is not None:
            self.weight_version = version
        out = {"weight_version": self.weight_version, "updated": len(tensors), "aborted": aborted}
        if self.discarded:
            self.discarded.difference_update(tensors)
            out["weights_missing"] = len(self.discarded)
            if not self.discarded and self.paused is None:
                out["released"] = self._release_held()
        return out

    def _do_version(self, version: str) -> dict:
        self.weight_version = version
        return {"weight_version": version}

    def _abort_all(self, why: str) -> int:
        """Finish every live sequence now, each answered with what it has (finish: abort)."""
        seqs = [s for group in self._live.values() for s in group if s.status != SeqStatus.FINISHED]
        self.publish([self._abort_one(s, why) for s in seqs])
        return len(seqs)

    def _abort_one(self, seq: Sequence, why: str) -> tuple[object, SeqEvent]:
        ev = SeqEvent(seq.index, matched=why)
        seq.output.flush(ev)
        self._retire(seq, FinishReason.ABORT, ev)
        return seq.sink, ev

    def _retract_all(self) -> int:
        """Running sequences back to the front of the queue, their blocks freed (recomputed on
        continue, with whatever weights the engine has then)."""
        running = list(self.sched.running)
        for seq in reversed(running):
            self.sched.retract(seq)
        self.metrics.preemptions.inc(len(running))
        return len(running)

    def step(self) -> int:
        """One scheduling step; returns how many sequences it computed."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        plan = self.sched.schedule()
        if plan.preempted:
            self.metrics.preemptions.inc(len(plan.preempted))
        if plan.empty:
            return 0
        self.publish(self._execute(plan))
        self._observe(plan, time.perf_counter() - t0)
        cpu = time.thread_time() - cpu0
        self.metrics.step_cpu.inc(cpu)
        if self._step_log is not None:
            # Its wall time and when it ended (the epoch) beside its CPU: what share of a core the
            # engine got, step by step (docs/fidelity.md, "The live run").
            wall = {"wall_s": round(time.perf_counter() - t0, 6), "at": round(time.time(), 4)}
            self._step_log.write(
                json.dumps({**asdict(StepShape.of(plan)), "step_time_s": cpu, **wall}) + "\n"
            )
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
        ev = SeqEvent(seq.index, token_ids=[token], versions=[self.weight_version])
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
        self._finish(seq, reason)
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

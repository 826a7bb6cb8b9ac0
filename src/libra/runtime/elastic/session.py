"""A core partner's side of one joining replica: its join state machine, inbox and outbox.

Threads only move bytes: a reader thread appends what arrives to the inbox, a writer thread sends
what the partner queued (serialising the snapshot there, off the training thread). Every decision
and every state transition happens on the partner's training thread, inside `reduce`, at a step
boundary, through the planner's `HybridReplica` state machine; so the join's state is a plain,
single-threaded value, and a late message can only be looked at, counted as stale and dropped.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from libra.planner import HybridReplica, JoinState
from libra.runtime.elastic.config import ElasticRuntimeConfig
from libra.runtime.elastic.wire import Channel, ChannelClosed, Kind, Msg

log = logging.getLogger(__name__)

Outgoing = Msg | Callable[[], Msg]


@dataclass(slots=True)
class SlotRecord:
    """What a partner keeps about one hybrid slot across all its joins."""

    slot: int
    replica: HybridReplica
    joins: int = 0
    releases: int = 0
    rejected: int = 0
    session: Session | None = None
    reasons: list[str] = field(default_factory=list)  # why each rollback happened, for the log


class Session:
    """One join attempt of one slot, from HELLO to goodbye or rollback."""

    def __init__(self, rec: SlotRecord, chan: Channel, cfg: ElasticRuntimeConfig):
        self.rec, self.chan, self.cfg = rec, chan, cfg
        self.gen = rec.replica.request_join()  # ROLLOUT -> REQUESTED
        self.since = time.monotonic()  # when the current stage began
        self.snapshot_step: int | None = None
        self.streak = 0
        self.proposal: int | None = None  # the step from which it would count
        self.proposal_epoch = -1
        self.acked = False
        self.tries = 0
        self.zeros: dict[int, bytes] = {}
        self.grads: dict[int, bytes] = {}
        self.dead: str | None = None
        self._cv = threading.Condition()
        self._inbox: deque[Msg] = deque()
        self._out: queue.Queue[Outgoing | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._read, name=f"elastic-rx-{rec.slot}", daemon=True),
            threading.Thread(target=self._write, name=f"elastic-tx-{rec.slot}", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self.send(Msg(Kind.WELCOME, rec.slot, self.gen, 0))

    @property
    def state(self) -> JoinState:
        return self.rec.replica.state

    # ---- the byte-moving threads ---------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                m = self.chan.recv()
                with self._cv:
                    self._inbox.append(m)
                    self._cv.notify_all()
        except (ChannelClosed, OSError) as e:
            self._mark_dead(f"channel closed ({e})")

    def _write(self) -> None:
        try:
            while (item := self._out.get()) is not None:
                self.chan.send(item() if callable(item) else item)
        except (ChannelClosed, OSError) as e:
            self._mark_dead(f"send failed ({e})")

    def _mark_dead(self, reason: str) -> None:
        with self._cv:
            self.dead = self.dead or reason
            self._cv.notify_all()

    def send(self, item: Outgoing) -> None:
        self._out.put(item)

    def backlog(self) -> int:
        return self._out.qsize()

    # ---- on the training thread ------------------------------------------------------------------

    def absorb(self, step: int, epoch: int) -> None:
        """Handle everything that has arrived, as of training step `step` under membership `epoch`."""
        with self._cv:
            msgs, self._inbox = list(self._inbox), deque()
        for m in msgs:
            self._handle(m, step, epoch)

    def wait_grad(self, step: int, epoch: int, timeout_s: float) -> bytes | None:
        """The gradients of `step` from an ACTIVE joiner, or None if it died or ran out of time."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.absorb(step, epoch)
            if step in self.grads:
                return self.grads.pop(step)
            with self._cv:
                left = deadline - time.monotonic()
                if self.dead or left <= 0:
                    return None
                if not self._inbox:
                    self._cv.wait(left)

    def _handle(self, m: Msg, step: int, epoch: int) -> None:
        if m.generation != self.gen or m.slot != self.rec.slot or not self._accept(m, step, epoch):
            self.rec.rejected += 1
            log.debug("slot %d: rejected %s step=%d epoch=%d", self.rec.slot, m.kind.name, m.step, m.epoch)

    def _accept(self, m: Msg, step: int, epoch: int) -> bool:
        r, s = self.rec.replica, self.state
        if m.kind == Kind.RESTORED and s == JoinState.FETCHING_STATE and m.step == self.snapshot_step:
            r.state_fetched(self.gen)
            self.since, self.streak = time.monotonic(), 0
            return True
        if m.kind == Kind.ZERO and r.sends_zero_gradients and m.step == step and step not in self.zeros:
            self.zeros[step] = m.payload
            return True
        if m.kind == Kind.GRAD and s == JoinState.ACTIVE and (m.step, m.epoch) == (step, epoch):
            if step in self.grads:
                return False  # a duplicate: counted once
            self.grads[step] = m.payload
            return True
        if (
            m.kind == Kind.ACK
            and s == JoinState.ACTIVATING
            and (m.step, m.epoch)
            == (
                self.proposal,
                self.proposal_epoch,
            )
        ):
            self.acked = True
            return True
        if m.kind == Kind.BYE and s == JoinState.RELEASING:
            r.released(self.gen)
            self.close()
            return True
        return False

    def take_zero(self, step: int) -> bytes | None:
        self.zeros = {k: v for k, v in self.zeros.items() if k >= step}
        return self.zeros.pop(step, None)

    def overdue(self) -> str | None:
        """Why this join should be rolled back now, if it should (death, a stage's timeout, lag)."""
        if self.dead and self.state != JoinState.ROLLOUT:
            return self.dead
        c, age = self.cfg, time.monotonic() - self.since
        limits = {
            JoinState.FETCHING_STATE: c.fetch_timeout_s,
            JoinState.ZERO_SYNC: c.sync_timeout_s,
            JoinState.RELEASING: c.release_timeout_s,
        }
        if self.state in limits and age > limits[self.state]:
            return f"{self.state.name} took more than {limits[self.state]:g} s"
        if self.backlog() > c.max_lag_steps:
            return f"fell {self.backlog()} messages behind"
        return None

    def fail(self, reason: str) -> None:
        """Roll the whole replica back to rollout and end the join (the joiner sees the stream end)."""
        was = self.state
        if self.rec.replica.fail(self.gen):
            self.rec.reasons.append(f"{was.name}: {reason}")
            log.warning("slot %d: join rolled back: %s", self.rec.slot, reason)
        self.close()

    def close(self) -> None:
        self._out.put(None)
        self.chan.close()
        if self.rec.session is self:
            self.rec.session = None


def snapshot_bytes(model_state: dict, optim_state: dict, step: int) -> bytes:
    """What SNAPSHOT carries: the weights and the optimizer after `step` (plain tensors only)."""
    buf = io.BytesIO()
    torch.save({"step": step, "model": model_state, "optimizer": optim_state}, buf)
    return buf.getvalue()


def load_snapshot(payload: bytes) -> dict:
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)

"""The hybrid replica's side of a join: connect to its core partner, restore, catch up, count, leave.

A joiner never takes part in a core collective. It holds its own copy of the model and optimizer,
restored from the partner's snapshot; for every later step it receives the step's summed gradient
and applies the same update the core applies (so it is bitwise equal to the core after each
step), and answers with zeros (ZERO_SYNC, ACTIVATING) or, once the partner has committed it,
with the gradients of its own samples of the next step (ACTIVE). It acknowledges an activation
proposal only for a step it has not yet computed, and tags everything with the step, the
membership epoch and its join generation, so nothing it sends late can be counted twice.

`Faults` injects what the fault-injection tests need: a real SIGKILL of this process at a named
point, and delayed or duplicated messages of chosen kinds.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from libra.runtime.elastic.config import ElasticRuntimeConfig
from libra.runtime.elastic.membership import Membership, partner_of
from libra.runtime.elastic.reducer import ADDR_KEY, flat_grads, set_grads, trainable
from libra.runtime.elastic.session import load_snapshot
from libra.runtime.elastic.wire import Channel, ChannelClosed, Kind, Msg, tensor_bytes
from libra.runtime.layout import balance_by_tokens


class StepWork(Protocol):
    """The trainer's data, as a joiner and a core replica both see it."""

    def tokens(self, step: int) -> Sequence[int]:
        """Token counts of the step's samples (what the layout balances)."""
        ...

    def backward(self, model: nn.Module, step: int, indices: list[int]) -> None:
        """Accumulate the gradients of these samples, loss divided by the step's global tokens."""
        ...


Update = Callable[[nn.Module, torch.optim.Optimizer], None]


def default_update(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class KillPoint(str, Enum):
    """Where a fault-injected joiner SIGKILLs itself, and the partner's join state at that moment."""

    HELLO = "hello"  # after HELLO: REQUESTED (or still ROLLOUT if the partner has not admitted it)
    FETCHING = "fetching"  # the snapshot has arrived, not restored: FETCHING_STATE
    ZERO_SYNC = "zero_sync"  # after `after` zero-gradient messages: ZERO_SYNC
    ACTIVATING = "activating"  # a proposal arrived, before the acknowledgement: ACTIVATING
    ACKED = "acked"  # acknowledged, before the commit: ACTIVATING
    ACTIVE = "active"  # after `after` gradient messages: ACTIVE
    RELEASING = "releasing"  # told to leave, before the goodbye: RELEASING


@dataclass(slots=True)
class Faults:
    kill_at: KillPoint | None = None
    after: int = 1  # for ZERO_SYNC / ACTIVE: how many messages of that kind first
    delay_s: dict[Kind, float] = field(default_factory=dict)  # sleep before sending these kinds
    delay_times: int = 1  # how many messages of each delayed kind are delayed
    duplicate: frozenset[Kind] = frozenset()  # send these kinds twice

    def maybe_kill(self, point: KillPoint, count: int = 0) -> None:
        if self.kill_at == point and (
            point not in (KillPoint.ZERO_SYNC, KillPoint.ACTIVE) or count >= self.after
        ):
            os.kill(os.getpid(), signal.SIGKILL)


class Joiner:
    def __init__(
        self,
        slot: int,
        core: int,
        slots: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        work: StepWork,
        store: dist.Store,
        *,
        update: Update = default_update,
        config: ElasticRuntimeConfig | None = None,
        faults: Faults | None = None,
        on_step: Callable[[int], None] | None = None,
    ):
        self.slot, self.core, self.slots = slot, core, slots
        self.model, self.optimizer, self.work, self.store = model, optimizer, work, store
        self.update, self.cfg, self.faults = update, config or ElasticRuntimeConfig(), faults or Faults()
        self.on_step = on_step or (lambda step: None)
        self.params = trainable(model)
        self.gen = 0
        self.applied: int | None = None  # the last step whose update this replica has applied
        self.sent: dict[Kind, int] = {}
        self._zero: bytes | None = None

    def run(self) -> str:
        """Join, train while counted, and return "released" (left cleanly after a RELEASE) or
        "rolled back" (the partner ended the join; this slot goes back to rollout)."""
        host, port = (
            self.store.get(ADDR_KEY.format(rank=partner_of(self.slot, self.core))).decode().rsplit(":", 1)
        )
        try:
            chan = Channel.connect(host, int(port), self.cfg.connect_timeout_s)
        except OSError:
            return "rolled back"  # the partner is gone (the core finished or failed)
        try:
            self._send(chan, Msg(Kind.HELLO, self.slot, 0, -1))
            self.faults.maybe_kill(KillPoint.HELLO)
            while True:
                m = chan.recv()
                if m.kind == Kind.WELCOME:
                    self.gen = m.generation
                elif m.generation != self.gen:
                    continue  # not for this join
                elif m.kind == Kind.RELEASE:
                    self.faults.maybe_kill(KillPoint.RELEASING)
                    self._send(chan, Msg(Kind.BYE, self.slot, self.gen, m.step, m.epoch))
                    return "released"
                else:
                    self._handle(chan, m)
        except ChannelClosed:
            return "rolled back"
        finally:
            chan.close()

    def _handle(self, chan: Channel, m: Msg) -> None:
        if m.kind == Kind.SNAPSHOT:
            self.faults.maybe_kill(KillPoint.FETCHING)
            self._restore(m)
            self._send(chan, Msg(Kind.RESTORED, self.slot, self.gen, m.step))
        elif m.kind == Kind.REDUCED and self.applied is not None and m.step == self.applied + 1:
            self._apply(m)
            self._answer(chan, m)
        elif m.kind == Kind.PROPOSE and self.applied is not None and m.step > self.applied + 1:
            self.faults.maybe_kill(KillPoint.ACTIVATING)
            self._send(chan, Msg(Kind.ACK, self.slot, self.gen, m.step, m.epoch))
            self.faults.maybe_kill(KillPoint.ACKED)

    def _restore(self, m: Msg) -> None:
        snap = load_snapshot(m.payload)
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(snap["optimizer"])
        self.optimizer.zero_grad(set_to_none=True)
        self.applied = int(snap["step"])
        self.on_step(self.applied)

    def _apply(self, m: Msg) -> None:
        """The step's summed gradient, and the same update the core replicas apply."""
        flat = torch.frombuffer(bytearray(m.payload), dtype=self.params[0].dtype)
        set_grads(self.params, flat)
        self.update(self.model, self.optimizer)
        self.applied = m.step
        self.on_step(m.step)

    def _answer(self, chan: Channel, m: Msg) -> None:
        """Zeros, or this replica's gradients of the next step if the membership counts it."""
        nxt, members = m.step + 1, Membership.from_mask(self.core, self.slots, m.epoch, m.arg)
        if self.slot not in members.active:
            self._send(chan, Msg(Kind.ZERO, self.slot, self.gen, nxt, m.epoch, 0, self._zeros()))
            self.faults.maybe_kill(KillPoint.ZERO_SYNC, self.sent[Kind.ZERO])
            return
        mine = balance_by_tokens(self.work.tokens(nxt), members.size)[members.index_of(self.slot)]
        self.optimizer.zero_grad(set_to_none=True)
        self.work.backward(self.model, nxt, mine)
        self._send(
            chan, Msg(Kind.GRAD, self.slot, self.gen, nxt, m.epoch, 0, tensor_bytes(flat_grads(self.params)))
        )
        self.faults.maybe_kill(KillPoint.ACTIVE, self.sent[Kind.GRAD])

    def _zeros(self) -> bytes:
        if self._zero is None:
            self._zero = tensor_bytes(
                torch.zeros(sum(p.numel() for p in self.params), dtype=self.params[0].dtype)
            )
        return self._zero

    def _send(self, chan: Channel, m: Msg) -> None:
        n = self.sent[m.kind] = self.sent.get(m.kind, 0) + 1
        f = self.faults
        if m.kind in f.delay_s and n <= f.delay_times:
            time.sleep(f.delay_s[m.kind])
        chan.send(m)
        if m.kind in f.duplicate:
            chan.send(m)

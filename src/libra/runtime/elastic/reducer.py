"""Gradient reduction for data-parallel trainers: the plain sum and the elastic drop-in.

The trainer computes local gradients with the loss already divided by the step's *global* token
count and calls `reducer.reduce(model)`; afterwards every parameter's `.grad` holds the sum over
all replicas, identical on every replica. With that normalisation the update does not depend on
how samples are spread over replicas, which is what lets a replica join without changing the run.

`SumAllReduce` is one flat sum all-reduce over the fixed core gloo group. `ElasticReducer` does the
same all-reduce over the same fixed group, and around it runs the hybrid replicas' joins:
- before the all-reduce, a core partner adds what its joiners sent: zeros from one in ZERO_SYNC
  or ACTIVATING (only if they arrived in time: the core never waits for them), the gradients of
  one that is ACTIVE (it waits up to `grad_timeout_s` for those, as DP waits for any member; if
  they do not come, the partner computes that replica's samples itself, so nothing is lost);
- after it, a small control all-reduce makes every core rank apply the same membership changes
  (see `membership.py`), and the partner sends each joiner the summed gradient of the step (so a
  joiner applies the very update the core applies and stays bitwise equal), a snapshot when a
  join starts, the activation proposal, or the release.
"""

from __future__ import annotations

import copy
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from libra.planner import HybridReplica, JoinState
from libra.runtime.elastic.config import ElasticRuntimeConfig
from libra.runtime.elastic.membership import CONTROL_FIELDS, ElasticStatus, Field, Membership, Op, partner_of
from libra.runtime.elastic.session import Session, SlotRecord, snapshot_bytes
from libra.runtime.elastic.wire import Channel, ChannelClosed, Kind, Msg, bytes_tensor, tensor_bytes
from libra.runtime.layout import balance_by_tokens

log = logging.getLogger(__name__)

ADDR_KEY = "elastic/addr/{rank}"
FEEDING = (JoinState.FETCHING_STATE, JoinState.ZERO_SYNC, JoinState.ACTIVATING, JoinState.ACTIVE)


class GradientReducer(Protocol):
    def reduce(self, model: nn.Module) -> None: ...


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def flat_grads(params: Sequence[nn.Parameter]) -> Tensor:
    """All gradients in one float buffer (a missing gradient counts as zeros)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def set_grads(params: Sequence[nn.Parameter], flat: Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        chunk = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += n


class SumAllReduce:
    """The plain reducer: one flat sum all-reduce over the fixed core group."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    def reduce(self, model: nn.Module) -> None:
        params = trainable(model)
        buf = flat_grads(params)
        dist.all_reduce(buf, group=self.group)
        set_grads(params, buf)


class ElasticReducer:
    """The elastic drop-in for `SumAllReduce` on core rank `rank` of `core` fixed replicas.

    `recompute(indices)` must accumulate, into the model's gradients, the gradients of those
    samples of the current step (loss over the global token count, as the trainer does): the
    partner calls it for an ACTIVE joiner whose gradients did not arrive.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        rank: int,
        core: int,
        slots: int,
        store: dist.Store,
        recompute: Callable[[list[int]], None],
        group: dist.ProcessGroup | None = None,
        config: ElasticRuntimeConfig | None = None,
    ):
        self.model, self.optimizer, self.params = model, optimizer, trainable(model)
        self.rank, self.group, self.recompute = rank, group, recompute
        self.cfg = config or ElasticRuntimeConfig()
        self.membership = Membership(core, slots)
        self.records = {
            s: SlotRecord(s, HybridReplica(f"hybrid-{s}", gpus=1))
            for s in range(slots)
            if partner_of(s, core) == rank
        }
        self.step = 0
        self.layout: list[list[int]] = []
        self.status = ElasticStatus(0, 0, 0, 0, 0, 0, tuple(JoinState.ROLLOUT for _ in range(slots)))
        self._release_requests: set[int] = set()
        self._received: list[Tensor] = []
        self._hellos: queue.Queue[tuple[int, Channel]] = queue.Queue()
        self._closed = False
        self._listener = self._listen(store) if self.records else None

    # ---- the side channels' front door -----------------------------------------------------------

    def _listen(self, store: dist.Store) -> socket.socket:
        sock = socket.create_server((self.cfg.host, 0))
        store.set(ADDR_KEY.format(rank=self.rank), f"{self.cfg.host}:{sock.getsockname()[1]}")
        threading.Thread(target=self._accept, args=(sock,), name="elastic-accept", daemon=True).start()
        return sock

    def _accept(self, sock: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn,), daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        chan = Channel(conn)
        try:
            m = chan.recv(self.cfg.connect_timeout_s)
        except (TimeoutError, ChannelClosed):
            chan.close()
            return
        if m.kind != Kind.HELLO:
            chan.close()
            return
        self._hellos.put((m.slot, chan))

    def _admit(self) -> None:
        """New joiners become sessions (REQUESTED) at a step boundary; others are turned away."""
        while not self._hellos.empty():
            slot, chan = self._hellos.get_nowait()
            rec = self.records.get(slot)
            if rec is None or rec.session is not None or rec.replica.state != JoinState.ROLLOUT:
                if rec is not None:
                    rec.rejected += 1
                chan.close()
                continue
            rec.session = Session(rec, chan, self.cfg)
            log.info("slot %d: join requested (generation %d)", slot, rec.session.gen)

    # ---- the trainer's interface -----------------------------------------------------------------

    def begin_step(self, step: int, tokens: Sequence[int]) -> list[int]:
        """This rank's samples of `step`: the token-balanced layout over this step's members."""
        self.step = step
        self.layout = balance_by_tokens(tokens, self.membership.size)
        return self.layout[self.rank]

    def request_release(self, slot: int) -> None:
        """Ask for `slot` to leave at the next step boundary (any core rank may ask)."""
        self._release_requests.add(slot)

    def reduce(self, model: nn.Module) -> None:
        s, m = self.step, self.membership
        self._admit()
        sessions = [r.session for r in self.records.values() if r.session is not None]
        for sess in sessions:
            sess.absorb(s, m.epoch)
        failed = self._gather_active(s, sessions)
        buf = flat_grads(self.params)
        failed |= self._add_received(s, sessions, buf)
        failed |= self._roll_back_overdue(sessions)
        dist.all_reduce(buf, group=self.group)
        set_grads(self.params, buf)
        was = set(m.active)
        table = self._control(s, failed)
        m.apply(table)
        self.status = _status(m, table, was)
        self._after_step(s, buf, table)

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        for rec in self.records.values():
            if rec.session is not None:
                rec.session.close()

    # ---- before the all-reduce -------------------------------------------------------------------

    def _gather_active(self, s: int, sessions: list[Session]) -> set[int]:
        """Wait for the gradients of slots that count at `s`; compute a missing one's share here."""
        self._received = []
        failed: set[int] = set()
        for slot in self.membership.active:
            rec = self.records.get(slot)
            if rec is None:
                continue  # another rank's joiner
            sess = rec.session
            got = sess.wait_grad(s, self.membership.epoch, self.cfg.grad_timeout_s) if sess else None
            grad = self._as_grad(got, rec.slot)
            if grad is not None:
                self._received.append(grad)
                continue
            # Its gradients did not come: this partner computes its samples, so nothing is lost.
            self.recompute(self.layout[self.membership.index_of(slot)])
            failed.add(slot)
            if sess is not None:
                sess.fail(sess.dead or f"no gradients for step {s} within {self.cfg.grad_timeout_s:g} s")
        return failed

    def _as_grad(self, payload: bytes | None, slot: int) -> Tensor | None:
        if payload is None:
            return None
        try:
            return bytes_tensor(payload, self.params[0].new_empty(sum(p.numel() for p in self.params)))
        except ChannelClosed as e:
            log.warning("slot %d: %s", slot, e)
            return None

    def _add_received(self, s: int, sessions: list[Session], buf: Tensor) -> set[int]:
        for grad in self._received:
            buf += grad
        failed = set()
        for sess in sessions:
            if not sess.rec.replica.sends_zero_gradients:
                continue
            payload = sess.take_zero(s)
            zero = self._as_grad(payload, sess.rec.slot) if payload is not None else None
            if payload is not None and zero is None:
                failed.add(sess.rec.slot)
                sess.fail("corrupt zero gradients")
                continue
            if zero is not None:
                buf += zero  # zeros: changes nothing, proves the joiner keeps pace
            if sess.state == JoinState.ZERO_SYNC:
                sess.streak = sess.streak + 1 if zero is not None else 0
        return failed

    def _roll_back_overdue(self, sessions: list[Session]) -> set[int]:
        failed = set()
        for sess in sessions:
            if sess.rec.session is sess and (why := sess.overdue()):
                failed.add(sess.rec.slot)
                sess.fail(why)
        return failed

    # ---- the membership exchange -----------------------------------------------------------------

    def _control(self, s: int, failed: set[int]) -> Tensor:
        m = self.membership
        table = torch.zeros(m.slots, CONTROL_FIELDS, dtype=torch.int64)
        for slot, rec in self.records.items():
            row, sess = table[slot], rec.session
            if sess is not None and sess.state == JoinState.ACTIVATING and self._ready(sess, s):
                row[Field.OP] = Op.ACTIVATE
            if slot in m.active and (slot in failed or rec.replica.state != JoinState.ACTIVE):
                row[Field.OP] = Op.REMOVE
            row[Field.STATE], row[Field.GENERATION] = int(rec.replica.state), rec.replica.generation
            row[Field.JOINS], row[Field.RELEASES] = rec.joins, rec.releases
            row[Field.ROLLBACKS], row[Field.REJECTED] = rec.replica.rollbacks, rec.rejected
        for slot in self._release_requests:
            if 0 <= slot < m.slots:
                table[slot, Field.RELEASE_REQUEST] += 1
        self._release_requests.clear()
        if m.slots:
            dist.all_reduce(table, group=self.group)
        return table

    def _ready(self, sess: Session, s: int) -> bool:
        return sess.acked and sess.proposal == s + 1 and sess.proposal_epoch == self.membership.epoch

    # ---- after the all-reduce: what each joiner is sent --------------------------------------------

    def _after_step(self, s: int, buf: Tensor, table: Tensor) -> None:
        m, reduced = self.membership, None
        for slot, rec in self.records.items():
            sess = rec.session
            if sess is None:
                continue
            requested = int(table[slot, Field.RELEASE_REQUEST]) > 0
            if sess.state == JoinState.REQUESTED:
                self._start_fetch(sess, s)
            if sess.state == JoinState.ACTIVATING and slot in m.active:
                rec.replica.activate(sess.gen)
                rec.joins += 1
                log.info("slot %d: ACTIVE from step %d (epoch %d)", slot, s + 1, m.epoch)
            if sess.state not in FEEDING:
                continue
            if requested and sess.state != JoinState.ACTIVE:
                sess.fail("released before it was active")
                continue
            reduced = reduced or tensor_bytes(buf)
            sess.send(Msg(Kind.REDUCED, slot, sess.gen, s, m.epoch, m.mask(), reduced))
            if sess.state == JoinState.ACTIVE and slot not in m.active:
                self._release(rec, sess, s)
            else:
                self._pace_activation(sess, s)

    def _start_fetch(self, sess: Session, s: int) -> None:
        """Copy the state as of the end of step s - 1 (a memcpy on this thread); the writer thread
        serialises and sends it while training goes on, followed by every later step's gradient."""
        model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        optim_state = copy.deepcopy(self.optimizer.state_dict())
        sess.rec.replica.begin_fetch(sess.gen)
        sess.snapshot_step, sess.since = s - 1, time.monotonic()
        slot, gen = sess.rec.slot, sess.gen
        sess.send(
            lambda: Msg(
                Kind.SNAPSHOT, slot, gen, s - 1, 0, 0, snapshot_bytes(model_state, optim_state, s - 1)
            )
        )

    def _release(self, rec: SlotRecord, sess: Session, s: int) -> None:
        rec.replica.release(sess.gen)
        rec.releases += 1
        sess.since = time.monotonic()
        sess.send(Msg(Kind.RELEASE, rec.slot, sess.gen, s, self.membership.epoch))
        log.info("slot %d: released after step %d", rec.slot, s)

    def _pace_activation(self, sess: Session, s: int) -> None:
        """Propose (or re-propose) the step from which the joiner counts: two steps ahead, so its
        acknowledgement can arrive before the next step's membership exchange."""
        state, cfg = sess.state, self.cfg
        if state == JoinState.ZERO_SYNC and sess.streak >= cfg.sync_steps:
            sess.rec.replica.propose_activation(sess.gen)
            sess.tries = 0
        elif not (state == JoinState.ACTIVATING and sess.proposal is not None and sess.proposal <= s + 1):
            return
        if sess.tries >= cfg.activation_tries:
            sess.fail(f"no acknowledgement after {sess.tries} proposals")
            return
        sess.tries += 1
        sess.proposal, sess.proposal_epoch, sess.acked = s + 2, self.membership.epoch, False
        sess.send(Msg(Kind.PROPOSE, sess.rec.slot, sess.gen, s + 2, self.membership.epoch))


def _status(m: Membership, table: Tensor, was: set[int]) -> ElasticStatus:
    """The pool after this step's exchange (the table holds each slot's state before it)."""
    st = ElasticStatus.from_table(m, table)
    states, joins, releases = list(st.states), st.joins, st.releases
    for slot in range(m.slots):
        if slot in m.active and slot not in was:
            states[slot], joins = JoinState.ACTIVE, joins + 1
        elif slot in was and slot not in m.active and int(table[slot, Field.OP]) != Op.REMOVE:
            states[slot], releases = JoinState.RELEASING, releases + 1
    return ElasticStatus(
        st.epoch, st.hybrid_active, joins, releases, st.rollbacks, st.rejected, tuple(states), st.active
    )

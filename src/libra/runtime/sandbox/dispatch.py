"""The live mechanism around the orchestrator: wall-clock time in, real work out.

Requests become `Action`s submitted to the same `Orchestrator` the simulator drives. Whenever
something changes (a submission, a completion, a quota window opening) one decision is taken
(coalesced per loop iteration), and each `Start` it returns runs its work as a task with the
cores it was granted. The HTTP handler awaits a future; if its client goes away while the action
is still queued the action is withdrawn, and if it is already running it finishes and its
resources come back as usual (the handler waits for that, so a session's lock is held until then):
nothing is dropped and nothing leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from libra.actions import Action, ActionRecord, ActionState, Orchestrator, Start
from libra.core.errors import LibraError

log = logging.getLogger("libra.actions")

Work = Callable[[Start], Awaitable[tuple[object, ActionState]]]


@dataclass(slots=True)
class Outcome:
    result: object
    state: ActionState
    queue_s: float
    exec_s: float
    act_s: float
    units: int
    cores: tuple[int, ...]


class Dispatcher:
    def __init__(self, orch: Orchestrator, on_change: Callable[[], None] = lambda: None):
        self.orch = orch
        self.t0 = time.monotonic()
        self.on_change = on_change
        self._work: dict[str, tuple[Work, asyncio.Future, bool]] = {}
        self._scheduled = False
        self._wake: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, action: Action, work: Work, one_shot: bool = False) -> Outcome:
        """Submit, wait for the grant, run `work`, and report. `one_shot`: the action is its own
        trajectory (no session), so its memory reservation ends with it."""
        fut = asyncio.get_running_loop().create_future()
        self.orch.submit(action, self.now())
        self._work[action.id] = (work, fut, one_shot)
        self.poke()
        try:
            return await asyncio.shield(fut)  # the caller's cancellation must not cancel the work
        except asyncio.CancelledError:
            rec = self.orch.records.get(action.id)
            if rec is not None and rec.state == ActionState.QUEUED:
                self.orch.cancel(action.id, self.now())
                self._work.pop(action.id, None)
                self._end(action, one_shot)
                self.poke()
            elif not fut.done():  # running: it finishes, and the caller's locks (a session's) hold
                with contextlib.suppress(Exception):  # until it has, so no two overlap
                    await fut
            raise

    def poke(self) -> None:
        """Ask for a decision soon; many changes in one loop iteration share one decision."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._scheduled = False
        now = self.now()
        for start in self.orch.decide(now):
            task = asyncio.get_running_loop().create_task(self._execute(start))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._arm_wake(now)
        self.on_change()

    def _arm_wake(self, now: float) -> None:
        """A quota window that opens later is a change nothing else would announce."""
        wake = self.orch.wake_at(now)
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if wake is not None:
            self._wake = asyncio.get_running_loop().call_later(max(0.0, wake - now) + 1e-3, self.poke)

    async def _execute(self, start: Start) -> None:
        a = start.action
        work, fut, one_shot = self._work.pop(a.id)
        result: object = None
        state = ActionState.FAILED
        try:
            result, state = await work(start)
        except LibraError as e:  # the request's own fault (a file the work dir cannot hold): a 4xx
            result = e
        except Exception as e:  # a bug in a work function must not take the service down
            log.exception("action %s failed in the service", a.id)
            result = e
        finally:
            rec = self.orch.complete(a.id, self.now(), state)
            self._end(a, one_shot)
            self.poke()
        outcome = _outcome(rec, result, start)
        self.orch.forget(a.id)
        if not fut.done():
            if isinstance(result, Exception):
                fut.set_exception(result)
            else:
                fut.set_result(outcome)

    def _end(self, a: Action, one_shot: bool) -> None:
        if one_shot:
            self.orch.end_trajectory(a.traj)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


def _outcome(rec: ActionRecord, result: object, start: Start) -> Outcome:
    return Outcome(
        result, rec.state, rec.queue_s, rec.ended - rec.started, rec.act_s, start.units, start.cores
    )

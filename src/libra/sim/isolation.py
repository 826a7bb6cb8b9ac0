"""Run one system's simulation in a forked child process, one system at a time.

Why: a simulation allocates and frees millions of small objects. Run one after another in one
process, every system after the first ran 10-20% slower than the very same simulation run first
(the allocator's arenas are fragmented by then, and the collector walks whatever earlier systems
left), so the default job's eight systems took ~130 s on one core instead of ~105 s. A forked
child starts from the parent's state (the batches, generated once before forking), simulates,
sends its results back through a pipe and exits, and the OS frees its heap in one go. It is still
one core: the parent only waits, relaying the child's progress.

An error in the child comes back as the same exception (a `LibraError` keeps its exit code 2);
one that cannot be pickled comes back as a `SimulationError` carrying the child's traceback. Only
on Linux: on macOS, system frameworks (Accelerate's BLAS among them) are not safe to use after a
fork, and Windows has none. There, or with LIBRA_NO_FORK=1, or `isolate=False`, the work runs in
this process, with identical results.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from libra.core.errors import SimulationError

NO_FORK_ENV = "LIBRA_NO_FORK"
Progress = Callable[[str, float], None]
T = TypeVar("T")


def forking() -> bool:
    return os.environ.get(NO_FORK_ENV, "") in ("", "0") and sys.platform.startswith("linux")


def call(fn: Callable[[Progress], T], progress: Progress, isolate: bool = True) -> T:
    """`fn(progress)`, run in a forked child when `isolate` (and fork is available)."""
    if not (isolate and forking()):
        return fn(progress)
    ctx = mp.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(fn, sender), daemon=True)
    child.start()
    sender.close()
    try:
        while True:
            try:
                kind, *payload = receiver.recv()
            except EOFError:
                child.join()
                raise SimulationError(f"the simulation process died (exit code {child.exitcode})") from None
            if kind == "progress":
                progress(*payload)
            elif kind == "ok":
                return payload[0]
            else:
                raise payload[0]
    finally:
        receiver.close()
        child.join()


def _child(fn: Callable[[Progress], Any], sender) -> None:
    try:
        result = fn(lambda label, frac: sender.send(("progress", label, frac)))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        sender.send(("error", _portable(e)))
    else:
        sender.send(("ok", result))
    finally:
        sender.close()


def _portable(e: BaseException) -> BaseException:
    """`e` itself if it survives pickling, else a SimulationError with the child's traceback."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        text = "".join(traceback.format_exception(e))
        return SimulationError(f"{type(e).__name__} in the simulation process:\n{text}")

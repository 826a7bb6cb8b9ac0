"""The gains map's scale-out path: each cell of `libra explore` as a Ray task.

Why here: Ray is a heavy, optional dependency, imported only inside `libra.runtime`. The cell
function is the simulator's own (`libra.sim.explore.sweep.run_cell`), so a cell run on a Ray
cluster gives exactly the figures a local process gives. Each task asks for one CPU; a task
simulates its systems one after another in forked children, as `libra simulate` does.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator


def ray_available(require_address: bool = False) -> bool:
    """Whether Ray is installed (and, with `require_address`, RAY_ADDRESS names a cluster)."""
    if importlib.util.find_spec("ray") is None:
        return False
    return bool(os.environ.get("RAY_ADDRESS")) or not require_address


def ray_map(num_cpus: int | None = None):
    """A mapper for `sweep`: cells as Ray tasks on the cluster at RAY_ADDRESS, or a local one."""

    def run(fn, grid, cells) -> Iterator:
        import ray

        started = not ray.is_initialized()
        if started:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        try:
            task = ray.remote(num_cpus=1)(fn)
            pending = [task.remote(grid, c) for c in cells]
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                yield ray.get(done[0])
        finally:
            if started:
                ray.shutdown()

    return run

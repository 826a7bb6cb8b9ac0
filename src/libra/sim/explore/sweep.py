"""Sweep a grid: simulate every cell's systems, then each mechanism's gain and the distance to the limit.

A cell runs the ablation ladder (`sim.rl.planned.LADDER`), `static-optimal` and the peers a team
would pick instead (`sim.rl.peers`: AReaL, APRIL, Seer, Heddle) through the same path as `libra
simulate` (`load_scenario` with the cell's overrides, then `run_scenario`), so a cell's figures are
exactly what `libra simulate` prints for the same settings. Every system of a cell runs at the
cell's staleness bound, and the cell reports each system's version lag of trained tokens (mean
and max), so asynchronous systems are compared at an equal bound and it shows what each keeps; a
system that needs a larger bound than the cell's (`System.min_staleness`) is left out of the cell
and said so (`skipped`). A grid may replay a trace (`Grid.trace`) instead of the scenario's
workload: cells built from real trajectories.

What a mechanism gains in a cell:
- `gain`: its rung over the rung below, as in the ladder (the planner's over `static-uniform`,
  the scenario's own split, what a user would set by hand): what turning it on adds to
  everything under it;
- `vs_static`: its rung over the *best static configuration*, the faster of `static-uniform` and
  the planner's one-shot homogeneous plan (`static-optimal`): the mechanisms up to it together.

Cells run in parallel: one process per cell on local cores (each simulates its systems one after
another, in forked children as `libra simulate` does), or, given a `map` function, anywhere
(`libra.runtime.sweep` runs them as Ray tasks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context

from libra.core.errors import ConfigError
from libra.sim.explore.grid import Cell, Grid
from libra.sim.rl.peers import PEERS
from libra.sim.rl.planned import LADDER

STATIC = ("static-uniform", "static-optimal")
# What each rung adds, by a short name for tables and plots: (mechanism, its rung, the rung below).
MECHANISMS = tuple((r.mechanism, r.system, LADDER[i - 1].system) for i, r in enumerate(LADDER) if i)
TOP = LADDER[-1].system  # the ladder's top rung: its distance to the limit is the map's
LIBRA = "libra"
PEER_SYSTEMS = tuple(cls.name for cls in PEERS)


def cell_systems(grid: Grid | None = None) -> list[str]:
    """The systems every cell of `grid` runs: its `systems` when it names them, else the static
    configurations, the ladder above its base and the peers."""
    if grid is not None and grid.systems is not None:
        return list(grid.systems)
    return [*STATIC, *(system for _, system, _ in MECHANISMS if system not in STATIC), *PEER_SYSTEMS]


def check_systems(names: list[str], field: str = "grid.systems") -> None:
    """Every name a known system (`libra simulate --systems` names), at least one, none twice; else
    one error naming `field`, before any cell runs."""
    from libra.sim.rl.systems import known_systems, make_system

    if not names:
        raise ConfigError(field, names, "a comma-separated list of at least one system")
    for name in names:
        try:
            make_system(name)
        except ConfigError:
            raise ConfigError(field, name, known_systems()) from None
    if len(set(names)) != len(names):
        raise ConfigError(field, ",".join(names), "each system once")


def _runnable(names: list[str], staleness: int) -> tuple[list[str], dict[str, str]]:
    """The systems that keep this staleness bound, and why each other one is left out."""
    from libra.sim.rl.systems import make_system

    keep, skipped = [], {}
    for name in names:
        system = make_system(name)
        if staleness < system.min_staleness:
            skipped[name] = f"needs pipeline.staleness >= {system.min_staleness}: {system.needs_staleness}"
        else:
            keep.append(name)
    return keep, skipped


@dataclass(slots=True)
class CellResult:
    """One cell: its settings, the command that reproduces it, and what each system measured."""

    index: int
    settings: dict[str, str]
    overrides: list[str]
    command: str
    throughput: dict[str, float] = field(default_factory=dict)  # tokens/s per system
    distance_to_limit: dict[str, float] = field(default_factory=dict)  # per system
    gains: dict[str, float] = field(default_factory=dict)  # per mechanism, over the rung below
    vs_static: dict[str, float] = field(default_factory=dict)  # per mechanism, over the best static
    best_static: str = ""
    # Per system: [mean, max] version lag of its trained tokens (training steps between the
    # weights that wrote a token and the step that trains it).
    token_lag: dict[str, list[float]] = field(default_factory=dict)
    best_peer: str = ""  # the fastest peer in the cell
    libra_vs_best_peer: float | None = None  # libra's throughput over the best peer's, minus one
    libra_vs_best_static: float | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # systems left out of the cell, and why
    error: str | None = None  # a cell whose settings cannot run (e.g. a model that does not fit)

    def as_dict(self) -> dict:
        return asdict(self)


def gains_of(throughput: dict[str, float]) -> tuple[str, dict[str, float], dict[str, float]]:
    """(best static system, gain per mechanism over the rung below, gain over the best static).
    A cell that ran only some systems (`--systems`) has the gains of the mechanisms whose rung and
    rung below both ran, and a best static of "" when neither static configuration ran."""
    ran = [s for s in STATIC if s in throughput]
    best = max(ran, key=lambda s: throughput[s]) if ran else ""
    gains = {m: throughput[system] / throughput[below] - 1 for m, system, below in MECHANISMS
             if system in throughput and below in throughput}  # fmt: skip
    vs = (
        {m: throughput[system] / throughput[best] - 1 for m, system, _ in MECHANISMS if system in throughput}
        if best
        else {}
    )
    return best, gains, vs


def run_cell(grid: Grid, cell: Cell) -> CellResult:
    """Simulate one cell's systems (in this process; each system in a forked child)."""
    from libra.core.errors import LibraError
    from libra.sim.scenarios import load_scenario, run_scenario

    res = CellResult(cell.index, cell.settings, cell.overrides, cell.command(grid, cell_systems(grid)))
    try:
        sc = load_scenario(grid.scenario, cell.overrides)
        systems, res.skipped = _runnable(cell_systems(grid), sc.pipeline.staleness)
        res.command = cell.command(grid, systems)
        options = {"trace": grid.trace} if grid.trace else {}
        out = run_scenario(sc, systems, grid.steps, grid.seed, None, lambda label, frac: None, **options)
    except LibraError as e:  # an impossible cell is reported, not fatal to the map
        res.error = str(e)
        return res
    for name, m in out["systems"].items():
        res.throughput[name] = m["throughput_tokens_per_s"]
        res.distance_to_limit[name] = m["distance_to_limit"]
        res.token_lag[name] = [m["mean_token_lag"], m["max_token_lag"]]
    res.best_static, res.gains, res.vs_static = gains_of(res.throughput)
    _against_peers(res)
    return res


def _against_peers(res: CellResult) -> None:
    """Libra over the best peer of the cell, and over the best static configuration."""
    peers = [p for p in PEER_SYSTEMS if p in res.throughput]
    if peers:
        res.best_peer = max(peers, key=lambda p: res.throughput[p])
    if LIBRA in res.throughput:
        mine = res.throughput[LIBRA]
        if peers:
            res.libra_vs_best_peer = mine / res.throughput[res.best_peer] - 1
        if res.best_static:
            res.libra_vs_best_static = mine / res.throughput[res.best_static] - 1


Mapper = Callable[[Callable[[Grid, Cell], CellResult], Grid, list[Cell]], Iterable[CellResult]]


def local_map(workers: int | None = None) -> Mapper:
    """Cells in parallel over local processes (forked: the workers start from this process)."""

    def run(fn, grid: Grid, cells: list[Cell]) -> Iterator[CellResult]:
        n = max(1, min(workers or os.cpu_count() or 1, len(cells)))
        if n == 1:
            yield from (fn(grid, c) for c in cells)
            return
        with ProcessPoolExecutor(n, mp_context=get_context("fork")) as pool:
            futures = [pool.submit(fn, grid, c) for c in cells]
            for f in as_completed(futures):
                yield f.result()

    return run


def sweep(
    grid: Grid,
    mapper: Mapper | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_cell: Callable[[CellResult], None] | None = None,
) -> dict:
    """Run every cell; return {"grid", "systems", "cells", "best_gain"} (see `best_gain`).
    `on_cell` sees each cell as it finishes (the CLI appends it to cells.jsonl, so a long sweep
    that is stopped keeps what it measured)."""
    if grid.systems is not None:
        check_systems(grid.systems)
    cells = grid.cells()
    done: list[CellResult] = []
    for r in (mapper or local_map())(run_cell, grid, cells):
        done.append(r)
        if on_cell is not None:
            on_cell(r)
        if progress is not None:
            progress(len(done), len(cells))
    done.sort(key=lambda r: r.index)
    return {
        "grid": grid.model_dump(),
        "systems": cell_systems(grid),
        "top": TOP,
        "peers": list(PEER_SYSTEMS),
        "mechanisms": [m for m, _, _ in MECHANISMS],
        "cells": [r.as_dict() for r in done],
        "best_gain": best_gain(done),
    }


def best_gain(cells: list[CellResult]) -> dict[str, dict]:
    """Per mechanism: its largest gain over the grid and the cell where it occurs."""
    out = {}
    for mech, _, _ in MECHANISMS:
        ok = [c for c in cells if c.error is None and mech in c.gains]
        if not ok:
            continue
        top = max(ok, key=lambda c: c.gains[mech])
        out[mech] = {
            "gain": top.gains[mech],
            "cell": top.settings,
            "index": top.index,
            "command": top.command,
        }
    return out

"""`libra explore`: sweep the regime grid and map where each mechanism pays."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from libra.sim import native

# A simulator entry point: use the compiled hot modules when a build of these sources exists.
native.activate()

from libra.cli.common import console, emit_json, err_console, json_option, table, writable_dir  # noqa: E402
from libra.core.errors import ConfigError  # noqa: E402
from libra.sim.explore.grid import load_grid  # noqa: E402
from libra.sim.explore.sweep import check_systems, local_map, sweep  # noqa: E402

EXECUTORS = ("auto", "local", "ray")


@click.command()
@click.option("--scenario", default=None, help="Base scenario name or YAML path (default: the grid's).")
@click.option("--grid", "grid_name", default=None, help="Grid name or YAML path [default: default].")
@click.option(
    "--steps", type=click.IntRange(min=2), default=None, help="RL steps per cell (default: the grid's)."
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=None, help="Local processes [default: all cores]."
)
@click.option(
    "--executor",
    type=click.Choice(EXECUTORS),
    default="auto",
    show_default=True,
    help="Where cells run: local processes, or Ray tasks (auto: Ray when it is installed and RAY_ADDRESS names a cluster).",
)
@click.option(
    "--systems",
    default=None,
    help="Comma-separated systems every cell runs (`libra simulate --systems` names) "
    "[default: the grid's, else the static configurations, the ladder and the peers].",
)
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False), default=None, help="[default: runs/explore-GRID]"
)
@json_option
def explore(scenario, grid_name, steps, workers, executor, systems, out_dir, as_json):
    """Sweep a grid of regimes; per cell, each mechanism's gain and the distance to the limit.

    Writes explore.json and a heatmap PNG per mechanism to --out, and each cell to cells.jsonl
    as it finishes.
    """
    grid = load_grid(grid_name)
    if systems is not None:
        names = [n.strip() for n in systems.split(",") if n.strip()]
        check_systems(names, "--systems")  # exit 2 naming the flag, before any cell runs
        systems = names
    updates = {
        k: v for k, v in (("scenario", scenario), ("steps", steps), ("systems", systems)) if v is not None
    }
    grid = grid.model_copy(update=updates)
    out = writable_dir(Path(out_dir or Path("runs") / f"explore-{grid.name}"))
    mapper = _mapper(executor, workers)
    t0 = time.perf_counter()
    result = _run_with_progress(grid, mapper, out / "cells.jsonl")
    elapsed = time.perf_counter() - t0
    from libra.sim.explore.report import write_outputs

    write_outputs(result, out)
    if as_json:
        emit_json(result)
        return
    console.print(cells_table(result))
    for line in best_lines(result):
        console.print(line, soft_wrap=True)
    err_console.print(f"explored {len(result['cells'])} cells in {elapsed:.1f} s; results in {out}/")


def _mapper(executor: str, workers: int | None):
    if executor == "local":
        return local_map(workers)
    from libra.runtime.sweep import ray_available, ray_map

    if executor == "ray":
        if not ray_available():
            raise ConfigError("--executor", "ray", "local (Ray is not installed: pip install 'libra[ray]')")
        return ray_map()
    return ray_map() if ray_available(require_address=True) else local_map(workers)


def _run_with_progress(grid, mapper, log: Path) -> dict:
    cols = [TextColumn("cells"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    log.write_text("", encoding="utf-8")

    def keep(cell) -> None:
        with log.open("a", encoding="utf-8") as f:
            f.write(json.dumps(cell.as_dict()) + "\n")

    with Progress(*cols, console=err_console, transient=True) as bar:
        task = bar.add_task("cells", total=len(grid.cells()))
        return sweep(grid, mapper, lambda done, total: bar.update(task, completed=done), keep)


def cells_table(result: dict):
    mechs = result["mechanisms"]
    top = result.get("top", result["systems"][-1])
    rows = []
    for c in result["cells"]:
        where = ", ".join(f"{k}={v}" for k, v in c["settings"].items())
        if c["error"] is not None:
            rows.append([where, c["error"], *["-"] * (len(mechs) + 3)])
            continue
        static = c["best_static"]
        peer = c.get("best_peer") or ""
        vs = c.get("libra_vs_best_peer")
        limit = c["distance_to_limit"].get(top)
        rows.append([where, f"{c['throughput'][static]:,.0f} ({static})" if static else "-",
                     *(f"{100 * c['gains'][m]:+.1f}%" if m in c["gains"] else "-" for m in mechs),
                     "-" if limit is None else f"{100 * limit:.0f}%",
                     f"{c['throughput'][peer]:,.0f} ({peer})" if peer else "-",
                     "-" if vs is None else f"{100 * vs:+.1f}%"])  # fmt: skip
    cols = ["cell", "best static tok/s", *mechs, f"{top} to limit", "best peer tok/s", "libra vs best peer"]
    return table(f"Gains map: {result['grid']['name']} on {result['grid']['scenario']}", cols, rows)


def best_lines(result: dict) -> list[str]:
    out = []
    for mech, b in result["best_gain"].items():
        where = ", ".join(f"{k}={v}" for k, v in b["cell"].items())
        out.append(f"{mech}: at most {100 * b['gain']:+.1f}% ({where})")
    return out

"""`libra trace`: write workload traces, print their statistics, list a family's parameters.

Why: the simulator replays traces, and a generated trace is only useful if its statistics match
real agents. `generate` writes the JSONL trace of any family (from a scenario or by name);
`stats` prints the rows of the real-trajectory README for one or more traces side by side, so a
generated trace and a real one can be compared directly; `params` documents every parameter.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from libra.cli.common import (
    console,
    emit_json,
    err_console,
    fmt,
    json_option,
    set_option,
    table,
    writable_file,
)
from libra.core.config import apply_overrides, build
from libra.core.errors import ConfigError
from libra.core.trace import read_trace
from libra.core.trajectory import Trajectory
from libra.sim.workloads import FAMILIES, WorkloadConfig, family_class, make_workload, step_rng
from libra.sim.workloads.stats import ROWS, features, summarize, summarize_features


@click.group()
def trace() -> None:
    """Generate and inspect trajectory traces (one JSON trajectory per line)."""


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, transient=True, disable=not err_console.is_terminal,
    )  # fmt: skip


def workload_config(family, scenario, flags: dict, overrides) -> WorkloadConfig:
    """The workload of `scenario` (or of `family` alone), with flags and `--set workload.*` applied."""
    if family is None and scenario is None:
        raise ConfigError("--family", None, [*FAMILIES, "or --scenario NAME"])
    data: dict = {}
    if scenario is not None:
        from libra.sim.scenarios import read_scenario

        wl = read_scenario(scenario).get("workload")
        if not isinstance(wl, dict):
            raise ConfigError("--scenario", scenario, "a scenario with a `workload:` mapping")
        data = dict(wl)
    data.update({k: v for k, v in {"family": family, **flags}.items() if v is not None})
    for text in overrides:
        if not text.startswith("workload."):
            raise ConfigError("--set", text, "a key under workload., e.g. workload.params.drift_steps=50")
    data = apply_overrides({"workload": data}, list(overrides))["workload"]
    return build(WorkloadConfig, data, "workload")


def _write_steps(cfg: WorkloadConfig, steps: range, seed: int, out: Path) -> Iterator[Trajectory]:
    writable_file(out)  # it is renamed over `out` at the end: never over a device
    wl = make_workload(cfg)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh, _progress() as bar:
            task = bar.add_task(f"generating {cfg.family}", total=len(steps))
            for step in steps:
                for t in wl.generate(step, step_rng(seed, step)):
                    fh.write(json.dumps(t.to_dict(), separators=(",", ":")) + "\n")
                    yield t
                bar.advance(task)
        os.replace(tmp, out)  # a failed run never leaves a half-written trace under the real name
    except OSError as e:
        raise ConfigError("--out", str(out), f"a writable file path ({e.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)  # after an error or Ctrl-C; a no-op once renamed


@trace.command()
@click.option(
    "--family", default=None, help=f"Workload family: {', '.join(FAMILIES)} (or package.module:Class)."
)
@click.option("--scenario", default=None, help="Take the workload from this scenario (name or YAML path).")
@click.option(
    "--steps", type=click.IntRange(min=1), default=1, show_default=True, help="RL steps to generate."
)
@click.option("--start-step", type=click.IntRange(min=0), default=0, show_default=True, help="First RL step.")
@click.option("--prompts", type=click.IntRange(min=1), default=None, help="Prompts per step (GRPO groups).")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="Samples per prompt.")
@click.option("--max-length", type=click.IntRange(min=256), default=None, help="Context limit, tokens.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed; same seed, same trace.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to write the JSONL trace.")
@set_option
@json_option
def generate(
    family, scenario, steps, start_step, prompts, samples, max_length, seed, out, overrides, as_json
):
    """Write a JSONL trace of STEPS RL steps of a workload family, then print its statistics."""
    flags = {"prompts_per_step": prompts, "samples_per_prompt": samples, "max_length": max_length}
    cfg = workload_config(family, scenario, flags, overrides)
    f = features(_write_steps(cfg, range(start_step, start_step + steps), seed, Path(out)))
    summary = summarize_features(f)
    if as_json:
        emit_json(
            {
                "out": out,
                "seed": seed,
                "start_step": start_step,
                "workload": cfg.model_dump(),
                "stats": summary,
            }
        )
        return
    console.print(
        _stats_table(f"{cfg.family}: {summary['trajectories']} trajectories -> {out}", [("value", summary)])
    )


def _cell(v: object) -> object:
    if v is None:
        return "n/a"
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1:
        v = int(v)
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else v


def _stats_table(title: str, columns: list[tuple[str, dict]]):
    rows = [[label, *(_cell(s.get(key)) for _, s in columns)] for key, label in ROWS.items()]
    return table(title, ["statistic", *(name for name, _ in columns)], rows)


def _by_step(trajs: list[Trajectory]) -> list[dict]:
    steps: dict[int, list[Trajectory]] = {}
    for t in trajs:
        steps.setdefault(t.step, []).append(t)
    out = []
    for step in sorted(steps):
        s = summarize(steps[step])
        out.append({"step": step, **{k: s[k] for k in ("trajectories", "context_mean", "context_p90",
                                                       "turns_p50", "tail10_time_share")}})  # fmt: skip
    return out


@trace.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--by-step", is_flag=True, help="Also print the mean final context and tail share per RL step.")
@json_option
def stats(files, by_step, as_json):
    """Statistics of one or more traces, in the rows of the real-trajectory README, side by side."""
    results = []
    with _progress() as bar:
        task = bar.add_task("reading", total=len(files))
        for path in files:
            trajs = read_trace(path)
            res = {"file": path, "stats": summarize(trajs)}
            if by_step:
                res["by_step"] = _by_step(trajs)
            results.append(res)
            bar.advance(task)
    if as_json:
        emit_json({"traces": results})
        return
    console.print(_stats_table("Trace statistics", [(Path(r["file"]).name, r["stats"]) for r in results]))
    for r in results if by_step else ():
        cols = list(r["by_step"][0])
        console.print(
            table(f"{r['file']}: by RL step", cols, [[row[c] for c in cols] for row in r["by_step"]])
        )


@trace.command()
@click.argument("family")
@json_option
def params(family, as_json):
    """Every parameter of a workload family: default and meaning (set with --set workload.params.X=...)."""
    model = family_class(family).Params
    defaults = model().model_dump()
    rows = [(name, defaults[name], f.description or "") for name, f in model.model_fields.items()]
    if as_json:
        emit_json(
            {
                "family": family,
                "params": [{"name": n, "default": d, "description": desc} for n, d, desc in rows],
            }
        )
        return
    tools = defaults.get("tools")
    t = Table(title=f"{family} parameters (set with --set workload.params.NAME=VALUE)", title_justify="left")
    for col, justify in (("name", "left"), ("default", "right"), ("description", "left")):
        t.add_column(col, justify=justify)
    for n, d, desc in rows:
        t.add_row(n, "see below" if n == "tools" else fmt(d), desc)
    console.print(t)
    if tools:
        cols = list(next(iter(tools.values())))
        console.print(table("tools (set with --set workload.params.tools.NAME.FIELD=...)", ["tool", *cols],
                            [[name, *(spec[c] for c in cols)] for name, spec in tools.items()]))  # fmt: skip

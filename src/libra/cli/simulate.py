"""`libra simulate`: run systems on a scenario, print a comparison table, write results."""

from __future__ import annotations

import time
from pathlib import Path

import click
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from libra.sim import native

# A simulator entry point: use the compiled hot modules when a build of these sources exists.
# Before anything below imports the simulator, since a module already imported stays Python.
native.activate()

from libra.cli.common import (  # noqa: E402
    console,
    curve_options,
    curves_of,
    emit_json,
    err_console,
    json_option,
    profile_option,
    set_option,
    table,
    writable_dir,
)
from libra.core.errors import ConfigError  # noqa: E402
from libra.costmodel.efficiency import load_profile  # noqa: E402
from libra.sim.rl.report import write_curves  # noqa: E402
from libra.sim.rl.systems import known_systems  # noqa: E402
from libra.sim.scenarios import list_scenarios, load_scenario, run_scenario  # noqa: E402

DEFAULT_SCENARIO = "libra-r2e-48gpu"

# Columns of the comparison table: (header, path into a system's metrics).
COLUMNS = [
    ("tok/s", ("throughput_tokens_per_s",)),
    ("rollout tok/s", ("rollout_throughput_tokens_per_s",)),
    ("step s", ("mean_step_time_s",)),
    ("rollout s", ("mean_rollout_makespan_s",)),
    ("limit s", ("makespan_lower_bound_s",)),
    ("to limit", ("distance_to_limit",)),
    ("tail s", ("mean_tail_s",)),
    ("lag mean", ("mean_token_lag",)),
    ("lag max", ("max_token_lag",)),
    ("train s", ("mean_train_time_s",)),
    ("GPU util", ("gpu_utilization",)),
    ("route acc", ("routing", "accuracy")),
    ("migrated", ("routing", "migrated_token_ratio")),
    ("mean ACT s", ("actions", "mean_act_s")),
    ("p99 ACT s", ("actions", "p99_act_s")),
    ("ideal ACT s", ("actions", "ideal_mean_act_s")),
    ("to limit", ("actions", "distance_to_limit")),
]


def _get(d: dict, path: tuple) -> object:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def comparison_table(summary: dict):
    systems = summary["systems"]
    cols = [(h, p) for h, p in COLUMNS if any(_get(m, p) is not None for m in systems.values())]
    rows = [
        [name] + [_get(m, p) if _get(m, p) is not None else "-" for _, p in cols]
        for name, m in systems.items()
    ]
    title = f"{summary['scenario']}: {summary.get('steps', '?')} steps, seed {summary.get('seed')}"
    return table(title, ["system"] + [h for h, _ in cols], rows)


def ladder_table(summary: dict):
    """The ablation ladder's rungs present in `summary`, each against the one below; None if < 2.

    A rung whose lower neighbour did not run is compared with the nearest lower rung that did, and
    the cell names it, since the difference then spans more than one mechanism."""
    from libra.sim.rl.planned import LADDER

    systems = summary.get("systems", {})
    rows, prev = [], None
    for k, rung in enumerate(LADDER):
        name, adds = rung.system, rung.adds
        if name not in systems:
            continue
        tput = systems[name]["throughput_tokens_per_s"]
        change = "-"
        if prev is not None:
            change = f"{100 * (tput / prev[1] - 1):+.1f}%"
            if prev[0] != k - 1:
                change += f" (vs {LADDER[prev[0]].system})"
        rows.append([name, adds, f"{tput:,.0f}", change])
        prev = (k, tput)
    if len(rows) < 2:
        return None
    cols = ["system", "adds", "tok/s", "vs rung below"]
    return table("Ablation ladder (each rung adds one mechanism)", cols, rows, left=2)


def libra_ratios(summary: dict) -> str | None:
    """`libra`'s throughput over the baselines it is judged against, as one line."""
    systems = summary.get("systems", {})
    if "libra" not in systems:
        return None
    mine = systems["libra"]["throughput_tokens_per_s"]
    parts = [
        f"{mine / systems[b]['throughput_tokens_per_s']:.2f}x {b}"
        for b in ("verl-colocated", "static-optimal", "static-uniform")
        if b in systems and systems[b].get("throughput_tokens_per_s")
    ]
    return f"libra: {', '.join(parts)}" if parts else None


def trade_off_lines(summary: dict) -> list[str]:
    """Below the ladder: where each mechanism pays on the shipped map, and libra's distance to the
    limit in this run (its rollout makespan over the makespan's lower bound)."""
    from libra.sim.explore.atlas import load_map, pays_lines

    systems = summary.get("systems", {})
    atlas = load_map()
    lines = pays_lines(atlas) if atlas is not None else []
    for name in ("libra", "libra+tail"):
        m = systems.get(name)
        if m is not None and "distance_to_limit" in m:
            lines.append(f"{name}: rollout makespan {m['mean_rollout_makespan_s']:.0f} s, "
                         f"{m['distance_to_limit']:.0%} above its lower bound ({m['makespan_lower_bound_s']:.0f} s)")  # fmt: skip
    return lines


def ladder_notes(summary: dict) -> list[str]:
    """Why a rung may add nothing: the planner chose one bucket, or the pool lent nothing."""
    from libra.sim.rl.planned import BUCKETED, LADDER

    systems, notes = summary.get("systems", {}), []
    single = [r.system for r in LADDER if r.system in BUCKETED and r.system in systems]
    single = [n for n in single if "routing" not in systems[n]]
    if single:
        notes.append(
            f"{', '.join(single)}: the planner chose one bucket (it predicted no split by length would be faster), so nothing was routed"
        )
    pool = systems.get("libra", {}).get("elastic")
    if pool:
        notes.append(
            f"libra's hybrid pool: {pool['hybrid_replicas']} replicas, {pool['joins']} joins, "
            f"{pool['releases']} releases; last decision: {pool['last_decision']}"
        )
    return notes


def print_list() -> None:
    """The shipped scenarios with their descriptions, and the systems each kind can run."""
    for name in list_scenarios():
        sc = load_scenario(name)
        console.print(f"{name:<22} {sc.description}", highlight=False, soft_wrap=True)
        if sc.kind == "tangram":
            console.print(f"{'':<22} systems: {', '.join(sc.systems)}", highlight=False)
    rl = ", ".join(known_systems())
    console.print(f"\nsystems of the rl scenarios (--systems A,B): {rl}", highlight=False, soft_wrap=True)


@click.command()
@click.option("--scenario", default=DEFAULT_SCENARIO, show_default=True, help="Scenario name or YAML path.")
@click.option(
    "--trace",
    "trace_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Replay this JSONL trace as the workload.",
)
@click.option("--systems", default=None, help="Comma-separated systems (default: the scenario's list).")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="RL steps (default: the scenario's).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder [default: runs/SCENARIO].",
)
@click.option(
    "--list", "list_only", is_flag=True, help="List the shipped scenarios and the systems, and exit."
)
@click.option("--live", "live_run", type=click.Path(file_okay=False), default=None,
              help="Predict this `libra train` run folder (save_trajectories: true) instead of a scenario.")  # fmt: skip
@click.option("--cores", type=click.FloatRange(min=1, max=4096), default=None,
              help="With --live: the host's cores (default: RUN/host.json's, else no sharing).")  # fmt: skip
@click.option("--background", type=click.FloatRange(min=0, max=1e5), default=None,
              help="With --live: runnable processes of other work on the host (default: RUN/host.json's, else 0).")  # fmt: skip
@click.option("--host-speed", is_flag=True,
              help="With --live: the engines' CPU times the host's speed probe during the run over the profile's (docs/fidelity.md).")  # fmt: skip
@click.option("--oracle-cpu", is_flag=True,
              help="With --live: the engines' and trainers' CPU seconds scaled to those measured (RUN/host.json).")  # fmt: skip
@set_option
@profile_option
@json_option
@curve_options
def simulate(scenario, trace_file, systems, steps, seed, out_dir, list_only, live_run, cores, background,
             host_speed, oracle_cpu, overrides, profile, as_json, tensorboard, wandb_on, wandb_project):  # fmt: skip
    """Simulate agentic RL post-training systems on a scenario and compare them.

    Writes summary.json, steps.json, PNG plots and a Perfetto trace.json to --out. With --live RUN,
    predicts a live `libra train` run's step, rollout and train time instead (docs/fidelity.md).
    """
    if list_only:
        print_list()
        return
    if live_run is not None:
        predict_live_run(live_run, cores, background, profile, as_json, oracle_cpu, host_speed)
        return
    sc = load_scenario(scenario, overrides)
    names = [s.strip() for s in systems.split(",") if s.strip()] if systems else None
    if systems is not None and not names:
        raise ConfigError("--systems", systems, "a comma-separated list of system names")
    out = writable_dir(Path(out_dir or Path("runs") / sc.name))
    curves = curves_of(tensorboard, wandb_on, wandb_project)
    kwargs = {}
    if trace_file:
        if sc.kind != "rl":
            raise ConfigError("--trace", trace_file, "only RL scenarios replay trajectory traces")
        kwargs["trace"] = trace_file
    if profile:
        kwargs["profile"] = load_profile(profile)
    t0 = time.perf_counter()
    result = _run_with_progress(sc, names, steps, seed, out, kwargs)
    result.setdefault("scenario", sc.name)
    elapsed = time.perf_counter() - t0
    writers = write_curves(result["per_step"], out, curves) if "per_step" in result else []
    if as_json:
        emit_json({k: v for k, v in result.items() if k != "per_step"})
        return
    console.print(comparison_table(result))
    ladder, ratios = ladder_table(result), libra_ratios(result)
    if ladder is not None:
        console.print(ladder)
        for note in ladder_notes(result):
            console.print(note, soft_wrap=True)
        for line in trade_off_lines(result):
            console.print(line, soft_wrap=True)
    if ratios is not None:
        console.print(ratios, soft_wrap=True)
    compiled = native.active()
    why = native.status()[1]
    err_console.print(
        f"simulated in {elapsed:.1f} s ({'compiled' if compiled else 'pure Python: ' + why}); "
        f"results in {out}/ (summary.json, steps.json, *.png, trace.json"
        + "".join(f", {'tb/' if w == 'tensorboard' else 'wandb/'}" for w in writers)
        + ")"
    )


def predict_live_run(
    run: str, cores, background, profile, as_json: bool, oracle: bool = False, speed: bool = False
) -> None:
    """`--live RUN`: the run replayed on the simulated clock, measured against predicted."""
    from libra.sim.rl.live import Host, load_host, predict_live

    known = load_host(run) or Host()
    # Either figure given replaces what live_cpu.py measured (its share table included).
    host = known if cores is None and background is None else Host(
        cores if cores is not None else known.cores, background if background is not None else known.background)  # fmt: skip
    errs = predict_live(run, profile, host, oracle, speed).errors()
    if as_json:
        emit_json(errs)
        return
    rows = [[name, f"{errs['measured'][k]:.2f}", f"{errs['predicted'][k]:.2f}", f"{errs[e]:+.1%}"]
            for name, k, e in (("step", "step_s", "step_err"), ("rollout (a batch)", "rollout_s", "rollout_err"),
                               ("train", "train_s", "train_err"))]  # fmt: skip
    other = "other work as measured during the run" if host.shares else f"background {host.background:g}"
    shared = "no CPU sharing" if host.cores is None else f"{host.cores:g} cores, {other}"
    shared += "; the measured CPU seconds" if oracle else ""
    console.print(
        table(
            f"{run}: {errs['steps']} steps predicted ({shared})",
            ["mean", "measured s", "predicted s", "error"],
            rows,
        )
    )


def _run_with_progress(sc, names, steps, seed, out, kwargs) -> dict:
    cols = [
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
    ]
    bar = Progress(*cols, console=err_console, transient=True)
    tasks: dict[str, TaskID] = {}

    def progress(label: str, frac: float) -> None:
        if not tasks:  # shown from the first report on, so an input error prints nothing but itself
            bar.start()
        if label not in tasks:
            tasks[label] = bar.add_task(label, total=1.0)
        bar.update(tasks[label], completed=min(1.0, frac))

    try:
        return run_scenario(sc, names, steps, seed, out, progress, **kwargs)
    finally:
        if tasks:
            bar.stop()

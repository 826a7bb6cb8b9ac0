"""`libra plan`: run the global resource planner on a scenario and print the plan.

The planner reads statistics of *past* steps only, so the command first produces that history:
the scenario's workload generator for steps [--at-step, --at-step + --history-steps), or a recorded
trace (--trace). It then searches, timing the search from outside (the policy never reads a
clock), and prints the split, the training parallelism, the buckets, the predicted stage times and
`search_time_s`, as a table or as JSON.
"""

from __future__ import annotations

import time

import click

from libra.cli.common import (
    catalog_option,
    console,
    emit_json,
    fmt,
    json_option,
    profile_option,
    set_option,
    table,
)
from libra.core.errors import ConfigError
from libra.core.trace import read_trace
from libra.costmodel.catalog import load_catalog
from libra.costmodel.efficiency import load_profile
from libra.planner import WorkloadStats, make_planner
from libra.sim.rl.config import MAX_NODES

# The planner reads a window of recent steps; 1000 steps of a 512-trajectory batch take ~30 s to
# generate, and more would only be read to be outweighed by the latest ones.
MAX_HISTORY = 1000


@click.command()
@click.option("--scenario", default="libra-r2e-48gpu", show_default=True, help="Scenario name or YAML path.")
@click.option(
    "--gpus", type=int, default=None, help="Cluster size override: a multiple of the GPUs per node."
)
@click.option(
    "--planner",
    "planner_name",
    default="libra",
    show_default=True,
    help="libra (heterogeneous buckets) | homogeneous | greedy | package.module:Class.",
)
@click.option("--at-step", type=int, default=0, show_default=True, help="First RL step of the history.")
@click.option(
    "--history-steps", type=int, default=1, show_default=True, help="Steps of history to plan from."
)
@click.option(
    "--trace", type=click.Path(dir_okay=False), default=None, help="Plan from a recorded trace instead."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the workload generator.")
@set_option
@catalog_option
@profile_option
@json_option
def plan(
    scenario, gpus, planner_name, at_step, history_steps, trace, seed, overrides, catalogs, profile, as_json
):
    """Plan the train/rollout split, training parallelism and rollout buckets for a scenario."""
    from libra.sim.rl.config import RLScenario, problem_of
    from libra.sim.scenarios import load_scenario  # the CLI may import sim; the planner may not

    cat = load_catalog(catalogs)
    # The split is not checked: the planner chooses it, and --gpus may resize the cluster under it.
    sc = load_scenario(scenario, overrides, cat, split=False)
    if not isinstance(sc, RLScenario):
        raise ConfigError("--scenario", scenario, "an RL scenario (kind: rl), such as libra-r2e-48gpu")
    hw = cat.hardware(sc.cluster.hardware, "cluster.hardware")
    problem = problem_of(sc, hw, cat, _nodes(gpus, hw), load_profile(profile))
    planner = make_planner(planner_name, problem, sc.planner, elastic=sc.elastic, selector=sc.selector)
    stats = history(sc, trace, at_step, history_steps, seed)
    t0 = time.perf_counter()
    result = planner.plan(stats)
    search_s = time.perf_counter() - t0
    out = {
        "scenario": sc.name, "hardware": problem.hw.name, "model": problem.model.name,
        "gpus": problem.gpus, "nodes": problem.nodes, "planner": planner.name,
        "history": _history_summary(stats),
        **result.to_dict(),
        "search_time_s": round(search_s, 4),
    }  # fmt: skip
    if as_json:
        emit_json(out)
    else:
        _print(out)


def _nodes(gpus: int | None, hw) -> int | None:
    """--gpus as a node count (None: the scenario's)."""
    if gpus is None:
        return None
    if not 1 <= gpus <= MAX_NODES * hw.gpus_per_node or gpus % hw.gpus_per_node:
        raise ConfigError("--gpus", gpus, f"a positive multiple of {hw.gpus_per_node} (GPUs per {hw.name} node), at most {MAX_NODES * hw.gpus_per_node}")  # fmt: skip
    return gpus // hw.gpus_per_node


def history(sc, trace: str | None, at_step: int, steps: int, seed: int) -> WorkloadStats:
    """Finished trajectories of past steps: from a trace, or from the scenario's generator (the
    same per-step streams `libra simulate --seed` runs)."""
    if not 1 <= steps <= MAX_HISTORY:
        raise ConfigError("--history-steps", steps, f"an integer from 1 to {MAX_HISTORY}")
    if at_step < 0:
        raise ConfigError("--at-step", at_step, "an integer >= 0")
    if trace is not None:
        return WorkloadStats.from_trajectories(read_trace(trace))
    from libra.sim.workloads import make_workload, step_rng

    wl = make_workload(sc.workload)
    trajs = []
    for step in range(at_step, at_step + steps):
        trajs += wl.generate(step, step_rng(seed, step))
    return WorkloadStats.from_trajectories(trajs)


def _history_summary(stats: WorkloadStats) -> dict:
    lens = sorted(stats.final_tokens)
    n = len(lens)
    return {
        "trajectories": n,
        "mean_tokens": round(sum(lens) / n, 1) if n else 0,
        "p90_tokens": lens[int(0.9 * (n - 1))] if n else 0,
        "max_tokens": lens[-1] if n else 0,
    }


def _print(out: dict) -> None:
    s, t, h = out["split"], out["train"], out["history"]
    rows = [
        ("cluster", f"{out['gpus']} x {out['hardware']} ({out['nodes']} nodes), {out['model']}"),
        (
            "history",
            f"{h['trajectories']} trajectories, mean {h['mean_tokens']:.0f}, max {h['max_tokens']} tokens",
        ),
        ("split", f"{s['train_gpus']} train / {s['rollout_gpus']} rollout / {s['idle_gpus']} idle GPUs"),
        ("training", f"tp={t['tp']} pp={t['pp']} dp={t['dp']} cp={t['cp']} micro_batch={t['micro_batch']}"),
        ("context bound", out["context_bound"]),
        ("hybrid replicas", out["hybrid_replicas"]),
        ("t_train_s", out["t_train_s"]),
        ("t_rollout_s", out["t_rollout_s"]),
        ("rollout_wait_s", out["rollout_wait_s"]),
        ("step_time_s", out["step_time_s"]),
        ("search_time_s", out["search_time_s"]),
    ]
    console.print(table(f"Plan for {out['scenario']} ({out['planner']})", ["", "value"], rows))
    cols = ["bucket", "tp", "instances", "gpus", "context range", "predicted_s"]
    brows = [
        (k, b["tp"], b["instances"], b["tp"] * b["instances"], f"({b['min_context']}, {b['max_context']}]",
         fmt(b["predicted_s"]))
        for k, b in enumerate(out["buckets"])
    ]  # fmt: skip
    console.print(table("Rollout buckets", cols, brows))

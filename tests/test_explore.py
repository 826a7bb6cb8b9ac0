"""`libra explore`: the grid, the gains, and cells that agree with `libra simulate` run directly."""

import json
import shlex

import pytest
import yaml

from libra.core.errors import ConfigError
from libra.sim.explore.grid import Grid, load_grid
from libra.sim.explore.sweep import MECHANISMS, cell_systems, gains_of, local_map, sweep
from tests.conftest import run_cli

# One small cell: 4 prompts x 4 samples of Search-R1 for 3 steps.
TINY = {
    "name": "tiny",
    "scenario": "libra-searchr1-48gpu",
    "steps": 3,
    "set": ["workload.prompts_per_step=4", "workload.samples_per_prompt=4"],
    "axes": [{"name": "staleness", "key": "pipeline.staleness", "values": [1, 2]}],
}


def test_cells_are_the_product_of_the_axes_in_order():
    g = Grid.model_validate(
        {**TINY, "axes": [{"name": "k", "key": "pipeline.staleness", "values": [1, 2]},
                          {"name": "phase", "sets": {"early": {}, "late": {"workload.first_step": 100}}}]}
    )  # fmt: skip
    cells = g.cells()
    assert [c.settings for c in cells] == [
        {"k": "1", "phase": "early"}, {"k": "1", "phase": "late"},
        {"k": "2", "phase": "early"}, {"k": "2", "phase": "late"},
    ]  # fmt: skip
    assert cells[3].overrides == [*TINY["set"], "pipeline.staleness=2", "workload.first_step=100"]
    assert "--set workload.first_step=100" in cells[3].command(g, ["libra"])


@pytest.mark.parametrize(
    "axis",
    [
        {"name": "a"},
        {"name": "a", "key": "x.y", "values": []},
        {"name": "a", "key": "x", "values": [1], "sets": {"b": {}}},
    ],
)
def test_an_axis_needs_one_form(axis):
    with pytest.raises(ValueError):
        Grid.model_validate({**TINY, "axes": [axis]})


def test_bad_grid_is_one_error(tmp_path):
    with pytest.raises(ConfigError, match="--grid"):
        load_grid("no-such-grid")
    p = tmp_path / "g.yaml"
    p.write_text(yaml.safe_dump({**TINY, "steps": 0}))
    with pytest.raises(ConfigError, match="grid.steps"):
        load_grid(str(p))
    assert load_grid(None).name == "default"


def test_gains_are_each_rung_over_the_one_below():
    tput = {s: 100.0 for s in cell_systems()}
    tput["static-uniform"], tput["static-optimal"] = 90.0, 100.0
    tput["ablation:planner"], tput["ablation:hetero-tp"] = 110.0, 99.0
    best, gains, vs = gains_of(tput)
    assert best == "static-optimal"
    assert gains["planner"] == pytest.approx(110 / 90 - 1) and vs["planner"] == pytest.approx(0.10)
    assert gains["hetero-tp"] == pytest.approx(99 / 110 - 1) and vs["hetero-tp"] == pytest.approx(-0.01)
    assert [m for m, _, _ in MECHANISMS][:4] == ["planner", "hetero-tp", "cmlfq", "elastic"]


def test_a_cell_is_exactly_what_libra_simulate_prints(tmp_path):
    """The map's cell, swept in parallel, against the printed command run on its own."""
    grid = Grid.model_validate(TINY)
    result = sweep(grid, local_map(2))
    assert len(result["cells"]) == 2 and set(result["best_gain"]) == {m for m, _, _ in MECHANISMS}
    cell = result["cells"][1]
    args = shlex.split(cell["command"])[1:] + ["--json", "--out", str(tmp_path / "direct")]
    proc = run_cli(*args, timeout=600)
    assert proc.returncode == 0, proc.stderr
    direct = json.loads(proc.stdout)["systems"]
    for name, tput in cell["throughput"].items():
        assert direct[name]["throughput_tokens_per_s"] == pytest.approx(tput, rel=1e-12), name
        assert direct[name]["distance_to_limit"] == pytest.approx(cell["distance_to_limit"][name], rel=1e-12)


def test_cli_writes_json_and_a_heatmap_per_mechanism(tmp_path):
    p = tmp_path / "g.yaml"
    p.write_text(
        yaml.safe_dump({**TINY, "axes": [{"name": "k", "key": "pipeline.staleness", "values": [1]}]})
    )
    out = tmp_path / "out"
    proc = run_cli(
        "explore", "--grid", str(p), "--json", "--out", str(out), "--executor", "local", timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["cells"][0]["settings"] == {"k": "1"}
    for m, _, _ in MECHANISMS:
        assert (out / f"gain_{m}.png").stat().st_size > 0
    assert (out / "distance_to_limit.png").exists() and (out / "explore.json").exists()
    logged = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    assert logged == result["cells"]


def test_an_impossible_cell_is_reported_not_fatal():
    grid = Grid.model_validate({**TINY, "axes": [{"name": "m", "key": "model", "values": ["no-such-model"]}]})
    result = sweep(grid, local_map(1))
    assert "model" in result["cells"][0]["error"] and result["best_gain"] == {}


def test_cells_built_from_real_trajectories_run_every_system(shared_data):
    """A grid that replays the tau-bench trace: the peers run beside the ladder, each with its
    trained tokens' lag, and the cell's command replays the same trace."""
    trace = shared_data / "trajectories" / "tau-bench-airline.jsonl"
    grid = Grid.model_validate(
        {"name": "tau", "scenario": "libra-r2e-48gpu", "steps": 2, "trace": str(trace),
         "set": ["model=qwen3-8b", "train.tp=2", "cluster.nodes=1", "split.train_gpus=4", "split.rollout_gpus=4"],
         "axes": [{"name": "staleness", "key": "pipeline.staleness", "values": [0]}]}
    )  # fmt: skip
    (cell,) = sweep(grid, local_map(1))["cells"]
    assert cell["error"] is None and f"--trace {trace}" in cell["command"]
    assert set(cell["skipped"]) == {"areal", "april"}  # they need a bound of at least 1
    assert {"seer", "heddle", "libra"} <= set(cell["throughput"]) and cell["best_peer"] in ("seer", "heddle")
    assert all(lag == [0.0, 0] for name, lag in cell["token_lag"].items() if name in ("seer", "heddle"))


@pytest.mark.parametrize("systems", ["static-optimal,no-such-system", "", "libra,libra"])
def test_explore_systems_must_be_known_systems(systems, tmp_path):
    proc = run_cli(
        "explore", "--grid", "default", "--systems", systems, "--out", str(tmp_path / "o"), timeout=120
    )
    assert proc.returncode == 2 and "--systems" in proc.stderr, proc.stderr
    assert not (tmp_path / "o" / "cells.jsonl").exists()  # nothing ran


def test_explore_runs_only_the_systems_asked_for(tmp_path):
    """`--systems`: every cell runs those systems only; gains need both rungs, so none here, and
    libra is still set against the best peer and the best static configuration that ran."""
    p = tmp_path / "g.yaml"
    p.write_text(
        yaml.safe_dump(
            {**TINY, "steps": 2, "axes": [{"name": "k", "key": "pipeline.staleness", "values": [1]}]}
        )
    )
    out = tmp_path / "out"
    proc = run_cli("explore", "--grid", str(p), "--systems", "static-optimal, libra,april", "--out", str(out),
                   "--executor", "local", timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "explore.json").read_text())
    (cell,) = result["cells"]
    assert result["systems"] == ["static-optimal", "libra", "april"]
    assert set(cell["throughput"]) == {"static-optimal", "libra", "april"} and cell["gains"] == {}
    assert cell["best_static"] == "static-optimal" and cell["best_peer"] == "april"
    assert cell["libra_vs_best_peer"] == pytest.approx(
        cell["throughput"]["libra"] / cell["throughput"]["april"] - 1
    )
    assert "--systems static-optimal,libra,april" in cell["command"]
    assert (out / "libra_vs_best_peer.png").exists() and not list(out.glob("gain_*.png"))

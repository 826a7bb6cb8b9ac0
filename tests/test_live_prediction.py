"""The simulator predicts a live `libra train` run from what the run wrote (tests/data/live-mini)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from libra.core.errors import ConfigError
from libra.sim.rl.live import load_run, measured_makespan, predict_live
from tests.conftest import run_cli

LIVE = Path(__file__).parent / "data" / "live-mini"
ROOT = Path(__file__).parents[1]


def test_the_run_folder_reads_turn_by_turn():
    run = load_run(LIVE)
    assert len(run.trajs) == 24 and {t.batch for t in run.trajs} == {0, 1}
    for t in run.trajs:
        assert all(x.end > x.start > 0 and x.prompt > 0 for x in t.turns)
        assert all(t.turns[i + 1].start >= t.turns[i].end for i in range(len(t.turns) - 1))
    assert measured_makespan([t for t in run.trajs if t.batch == 0]) > 0


def test_prediction_from_the_engines_own_profile(tmp_path):
    """The built-in engine's steps fitted with calibrate --data, then the run predicted: every
    figure positive, and errors computed against the run's own steps.json."""
    prof = tmp_path / "cpu.yaml"
    r = run_cli(
        "costmodel", "calibrate", "--data", str(LIVE / "builtin-tiny-steps.jsonl"), "--out", str(prof)
    )
    assert r.returncode == 0, r.stderr
    errs = predict_live(LIVE, prof).errors()
    assert set(errs) >= {"step_err", "rollout_err", "train_err"} and errs["steps"] == 2
    assert all(v > 0 for v in errs["predicted"].values())


def test_a_folder_without_trajectories_is_one_line(tmp_path):
    (tmp_path / "trace.json").write_text("{}")
    with pytest.raises(ConfigError):
        load_run(tmp_path)


def test_bench_fidelity_json_has_the_issue_keys():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fidelity.py"), "--json", "--live", str(LIVE)],
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-500:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"public_mape", "shipped_traces", "live"} <= set(d)
    assert set(d["live"]) >= {"step_err", "rollout_err", "train_err"}

"""`libra trace` as a user runs it: real subprocesses, real files, exit codes and one-line errors.

Each behaviour is shown by a real process; a test's further cases of it go through the same
`libra.cli.main` in the test process (conftest.run_main: a new interpreter is ~0.5 CPU s)."""

from __future__ import annotations

import json

import pytest

from libra.core.trace import read_trace
from libra.core.trajectory import ToolStatus
from libra.sim.workloads.stats import summarize
from tests.conftest import run_cli, run_main


def test_generate_writes_a_valid_trace_and_its_stats(tmp_path):
    out = tmp_path / "r2e.jsonl"
    r = run_cli("trace", "generate", "--family", "r2e-gym", "--steps", "3", "--start-step", "10",
                "--prompts", "4", "--samples", "8", "--seed", "5", "--out", str(out), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    trajs = read_trace(out)
    assert len(trajs) == 3 * 4 * 8 == res["stats"]["trajectories"]
    assert sorted({t.step for t in trajs}) == [10, 11, 12]
    assert res["stats"] == pytest.approx(summarize(trajs))
    assert res["workload"]["family"] == "r2e-gym" and res["workload"]["max_length"] == 40960
    assert not (tmp_path / "r2e.jsonl.tmp").exists()


def test_same_seed_same_file_and_steps_regenerate_alone(tmp_path):
    a, b, c = (tmp_path / f"{n}.jsonl" for n in "abc")
    common = ("trace", "generate", "--family", "search-r1", "--prompts", "3", "--samples", "2", "--seed", "9")
    assert run_cli(*common, "--steps", "2", "--out", str(a)).returncode == 0
    assert run_main(*common, "--steps", "2", "--out", str(b)).returncode == 0
    assert run_main(*common, "--steps", "1", "--start-step", "1", "--out", str(c)).returncode == 0
    assert a.read_bytes() == b.read_bytes()
    step1 = [t.to_dict() for t in read_trace(a) if t.step == 1]
    assert step1 == [t.to_dict() for t in read_trace(c)]


def test_the_trace_generate_writes_is_the_batches_simulate_runs(tmp_path):
    """One per-step random stream for `trace generate --seed S` and `simulate --seed S`."""
    from libra.sim.rl.pipeline import Batches
    from libra.sim.scenarios import load_scenario

    out = tmp_path / "t.jsonl"
    r = run_cli("trace", "generate", "--scenario", "libra-searchr1-48gpu", "--steps", "2", "--seed", "7",
                "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    batches = Batches(load_scenario("libra-searchr1-48gpu"), 7)
    expected = [t.to_dict() for step in range(2) for t in batches.get(step)]
    assert [t.to_dict() for t in read_trace(out)] == expected


def test_scenario_workload_with_overrides(tmp_path):
    out = tmp_path / "dapo.jsonl"
    r = run_cli("trace", "generate", "--scenario", "libra-dapo-48gpu", "--prompts", "2", "--out", str(out),
                "--set", "workload.params.max_turns=1", "--set", "workload.samples_per_prompt=3", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["workload"]["family"] == "dapo-math" and res["workload"]["params"] == {"max_turns": 1}
    trajs = read_trace(out)
    assert len(trajs) == 6 and all(len(t.turns) == 1 for t in trajs)


def test_one_tool_field_from_the_command_line(tmp_path):
    out = tmp_path / "r2e.jsonl"
    r = run_cli("trace", "generate", "--family", "r2e-gym", "--start-step", "100", "--prompts", "4",
                "--out", str(out), "--set", "workload.params.tools.execute_bash.latency_median_s=40",
                "--set", "workload.params.tools.execute_bash.latency_sigma=0")  # fmt: skip
    assert r.returncode == 0, r.stderr
    turns = [u for t in read_trace(out) for u in t.turns if u.has_tool]
    bash = [
        u.tool_latency_s for u in turns if u.tool == "execute_bash" and u.tool_status != ToolStatus.TIMEOUT
    ]
    assert bash and all(x == 40 for x in bash)
    assert {u.tool for u in turns} >= {"execute_bash", "file_editor"}


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--family", "swe-smith"), "workload.family"),
        (("--family", "r2e-gym", "--set", "workload.params.drift=3"), "drift_steps"),
        (("--family", "r2e-gym", "--set", "workload.params.output_tokens_sigma=-1"), "output_tokens_sigma"),
        (("--family", "r2e-gym", "--set", "model=qwen3-32b"), "workload."),
        (("--family", "r2e-gym", "--steps", "0"), "--steps"),
        (("--scenario", "no-such-scenario"), "scenario"),
        ((), "--family"),
    ],
)
def test_generate_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    out = tmp_path / "x.jsonl"
    cli = run_cli if needle == "workload.family" else run_main  # the first case in a real process
    r = cli("trace", "generate", *args, "--out", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert not out.exists()


def test_generate_unwritable_out_is_exit_2(tmp_path):
    r = run_cli("trace", "generate", "--family", "dapo-math", "--out", str(tmp_path / "missing" / "t.jsonl"))
    assert r.returncode == 2 and "--out" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_stats_of_the_real_tau_bench_trace(shared_data):
    path = shared_data / "trajectories" / "tau-bench-airline.jsonl"
    r = run_cli("trace", "stats", str(path), "--json", "--by-step")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["traces"][0]
    s = res["stats"]
    # The README's figures for this file (turns and final context, in this trace format).
    assert (s["trajectories"], s["turns_p50"], s["turns_p90"], s["turns_max"]) == (200, 11, 20, 30)
    assert (
        round(s["context_p50"], -2) == 4100
        and round(s["context_p90"], -2) == 5900
        and s["context_max"] == 8445
    )
    assert s["trajectories_with_failure"] == pytest.approx(0.18)
    assert s["spearman_failures_length"] == pytest.approx(0.40, abs=0.01)
    assert s["spearman_tool_return_length"] == pytest.approx(0.96, abs=0.01)
    assert s["spearman_turns_length"] == pytest.approx(0.91, abs=0.01)
    assert [row["step"] for row in res["by_step"]] == [0, 1, 2, 3, 4]


def test_stats_table_compares_files_side_by_side(tmp_path, shared_data):
    gen = tmp_path / "gen.jsonl"
    assert (
        run_main("trace", "generate", "--family", "search-r1", "--prompts", "4", "--out", str(gen)).returncode
        == 0
    )
    r = run_cli("trace", "stats", str(gen), str(shared_data / "trajectories" / "tau-bench-airline.jsonl"))
    assert r.returncode == 0, r.stderr
    assert "gen.jsonl" in r.stdout and "tau-bench-airline.jsonl" in r.stdout
    assert "Spearman: failures vs total length" in r.stdout


def test_stats_bad_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "a", "prompt_id": "p", "prompt_tokens": 10, "turns": [{"output_tokens": 5}]}\n{"id": 3}\n'
    )
    r = run_cli("trace", "stats", str(bad))
    assert r.returncode == 2 and f"{bad}:2" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_main("trace", "stats", str(tmp_path / "absent.jsonl"))
    assert r.returncode == 2 and "absent.jsonl" in r.stderr


def test_params_documents_every_parameter():
    from click.testing import CliRunner

    from libra.cli.trace import trace
    from libra.sim.workloads import FAMILIES
    from libra.sim.workloads.agent import ToolSpec

    for family, cls in FAMILIES.items():  # in-process: the subprocess path is covered below
        res = CliRunner().invoke(trace, ["params", family, "--json"])
        assert res.exit_code == 0, res.output
        rows = json.loads(res.output)["params"]
        assert [row["name"] for row in rows] == list(cls.Params.model_fields)
        assert all(row["description"] for row in rows)
    assert all(f.description for f in ToolSpec.model_fields.values())
    r = run_cli("trace", "params", "r2e-gym")
    assert r.returncode == 0 and "finish_failure_penalty" in r.stdout and "execute_bash" in r.stdout
    r = run_main("trace", "params", "nope")
    assert r.returncode == 2 and "search-r1" in r.stderr

"""The simulator predicts a live `libra train` run from what the run wrote (tests/data/live-mini: a
whole 3-step run, README there)."""

import itertools
import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libra.core.errors import ConfigError, LibraError
from libra.costmodel.catalog import load_catalog
from libra.costmodel.efficiency import load_profile, save_profile
from libra.sim.rl.live import (
    Host,
    LivePipeline,
    fair_share,
    load_host,
    load_run,
    measured_makespan,
    predict_live,
)
from tests.conftest import run_cli, run_main

LIVE = Path(__file__).parent / "data" / "live-mini"
ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, dict]:
    """The built-in engine's and trainer's own CPU-second steps (the fixture's profile), fitted
    with `libra costmodel calibrate` as a user would; the profile and the fit it printed."""
    prof = tmp_path_factory.mktemp("prof") / "cpu.yaml"
    r = run_cli("costmodel", "calibrate", "--data", str(LIVE / "builtin-tiny-steps.jsonl"),
                "--train-data", str(LIVE / "builtin-tiny-train.jsonl"),
                "--serving-data", str(LIVE / "builtin-tiny-serving.jsonl"), "--out", str(prof), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    fit = json.loads(r.stdout)
    assert fit["records"] > 100 and fit["train"]["records"] > 10 and 0 < fit["train"]["mfu"] < 1
    # The steps timed beside busy processes cost more CPU seconds the smaller their share of a core.
    factors = [f for _, f in fit["contention"]]
    assert factors == sorted(factors, reverse=True) and factors[0] > 1
    assert fit["serving"]["weight_load_cpu_s"] > 0 and 0 < fit["serving"]["outside_steps"] < 0.5
    return prof, fit


@pytest.fixture(scope="module")
def cpu_profile(calibrated) -> Path:
    return calibrated[0]


def test_calibrate_pools_several_profiles(calibrated, tmp_path):
    """--data, --train-data and --serving-data repeat (several profiles of one host fitted
    together): the same profile twice is twice the records and the same fit. `calibrated` is
    the same three files given once."""
    cpu_profile, once = calibrated
    out = tmp_path / "pooled.yaml"
    files = [(f"--{opt}", str(LIVE / f"builtin-tiny-{name}.jsonl"))
             for opt, name in (("data", "steps"), ("train-data", "train"), ("serving-data", "serving"))]  # fmt: skip
    r = run_cli(
        "costmodel", "calibrate", *[a for pair in files * 2 for a in pair], "--out", str(out), "--json"
    )
    assert r.returncode == 0, r.stderr
    pooled = json.loads(r.stdout)
    assert (
        pooled["records"] == 2 * once["records"]
        and pooled["train"]["records"] == 2 * once["train"]["records"]
    )
    a, b = (load_profile(p).rollout.engine("libra-builtin") for p in (out, cpu_profile))
    for term in ("base_overhead_s", "per_seq_overhead_s", "token_cpu_s", "weight_load_cpu_s"):
        assert getattr(a, term) == pytest.approx(getattr(b, term), rel=1e-3, abs=1e-9), term
    assert load_profile(out).train.mfu == pytest.approx(load_profile(cpu_profile).train.mfu, rel=1e-3)


def test_the_run_folder_reads_turn_by_turn():
    run, cfg = load_run(LIVE), json.loads((LIVE / "config.json").read_text())
    per_step = cfg["rollout"]["groups_per_step"] * cfg["rollout"]["group_size"]
    assert len(run.steps) == cfg["steps"] and len(run.trajs) == per_step * cfg["steps"]
    instances = {f"engine-{b['name']}-{i}" for b in cfg["buckets"] for i in range(b["instances"])}
    for b, trajs in run.batches().items():
        groups = {t.group for t in trajs}
        assert len(groups) == cfg["rollout"]["groups_per_step"], b
        assert measured_makespan(trajs) > 0
    for t in run.trajs:
        assert all(x.end > x.start > 0 and x.prompt > 0 and x.instance in instances for x in t.turns)
        assert all(t.turns[i + 1].start >= t.turns[i].end for i in range(len(t.turns) - 1))
        assert all(t.turns[i + 1].prompt > t.turns[i].prompt for i in range(len(t.turns) - 1))
    assert load_host(LIVE).cores >= 1


def test_prediction_trains_every_step_against_the_runs_own_steps(cpu_profile):
    """Every step of the run is trained on the simulated clock, and the measured side of each
    error is the run's own steps.json and timeline."""
    errs = predict_live(LIVE, cpu_profile).errors()
    steps = json.loads((LIVE / "steps.json").read_text())
    assert errs["steps"] == len(steps)
    assert errs["measured"]["step_s"] == pytest.approx(statistics.fmean(s["step_time_s"] for s in steps))
    assert errs["measured"]["train_s"] == pytest.approx(statistics.fmean(s["train_s"] for s in steps))
    for k, e in (("step_s", "step_err"), ("rollout_s", "rollout_err"), ("train_s", "train_err")):
        m, p = errs["measured"][k], errs["predicted"][k]
        assert p > 0 and errs[e] == pytest.approx((p - m) / m)


def _timeline(profile: Path, host: Host):
    sim = LivePipeline(load_run(LIVE), host, load_profile(profile), load_catalog())
    return sim, sim.run_all()


def test_the_staleness_gate_and_step_order_hold(cpu_profile):
    sim, tl = _timeline(cpu_profile, load_host(LIVE))
    k = sim.run.layout.staleness
    assert tl.step_end == sorted(tl.step_end) and len(tl.step_end) == len(sim.run.steps)
    for b, (start, end) in tl.batch_span.items():
        assert end > start
        if b > k:  # batch b may start once b - k steps are trained
            assert start >= tl.step_end[b - k - 1]


def test_more_load_is_never_faster(cpu_profile):
    """Processor sharing: more other work, or fewer cores, never predicts a faster run, and a
    core for every process is the fastest."""
    free = predict_live(LIVE, cpu_profile, Host()).errors()["predicted"]
    last = free
    for cores, background in ((16, 0), (2, 0), (2, 4), (2, 12), (1, 12)):
        now = predict_live(LIVE, cpu_profile, Host(cores, background)).errors()["predicted"]
        assert all(now[k] >= last[k] - 1e-9 for k in now), (cores, background)
        last = now
    assert last["step_s"] > 2 * free["step_s"]


@given(st.integers(1, 64), st.floats(0.5, 12), st.lists(st.integers(1, 8), max_size=20), st.integers(1, 8))
def test_fair_share_between_sessions(cores, own, others, extra):
    """The kernel's fair share between sessions: never more than a core a process, never more
    than the cores in all, the run's group never loses by running more, and one more session of
    other work never gives the run more."""
    s = fair_share(cores, own, others)
    assert 0 < s <= 1 and own * s <= cores + 1e-9
    assert (own + 1) * fair_share(cores, own + 1, others) >= own * s - 1e-9
    assert fair_share(cores, own, [*others, extra]) <= s + 1e-9
    if own + sum(others) <= cores:
        assert s == 1


def test_the_measured_share_table_is_read_between_its_points():
    h = Host(2, 0, (0.3, 0.15, 0.1))
    assert h.share(1) == 0.3 and h.share(0.2) == 0.3 and h.share(2) == 0.15
    assert h.share(1.5) == pytest.approx(0.225) and h.share(6) == pytest.approx(0.05)  # past it: 0.3 cores


def test_the_sampled_other_sessions_and_the_sandboxes_share_the_cores():
    """With the other sessions as sampled (host.json's `others`), a busy process's share is the
    fair share averaged over the samples; each running tool sandbox is one more session."""
    h = Host(2, 0, (), None, (((), 0.5), ((1, 1), 0.5)))
    assert h.share(2) == pytest.approx(0.5 * 1.0 + 0.5 * fair_share(2, 2, [1, 1]))
    one = Host(1, 0)  # one core: the run's busy process and one sandbox get half of it each
    assert one.share(1, 1) == pytest.approx(0.5) and one.sandbox_share(1, 1) == pytest.approx(0.5)
    for busy in (0.5, 1, 2.7, 6):
        shares = [h.share(busy, k) for k in range(4)]
        assert shares == sorted(shares, reverse=True)  # more sandboxes never give the run more
        assert all(0 < h.sandbox_share(busy, k) <= 1 for k in range(1, 4))


def test_tool_sandboxes_cost_their_cpu_and_only_slow_the_run(cpu_profile):
    """Each tool call's sandbox adds its CPU seconds (in a session of its own, beside the run's);
    the trajectories wait as long as they did live, so the sandboxes can only slow the rollouts
    and the run (a training step may come out faster: it overlaps a later, different moment)."""
    run, prof, cat = load_run(LIVE), load_profile(cpu_profile), load_catalog()
    calls = sum(len(t.turns) - 1 for t in run.trajs)
    assert calls > 0
    times = []
    for cpu in (0.0, 0.05, 0.5):
        sim = LivePipeline(run, Host(2, 0), prof, cat, tool_cpu_s=cpu)
        tl = sim.run_all()
        assert sim.tools.cpu_total == pytest.approx(cpu * calls)
        times.append((tl.step_end[-1], statistics.fmean(b - a for a, b in tl.batch_span.values())))
    assert all(a[0] <= b[0] + 1e-9 and a[1] <= b[1] + 1e-9 for a, b in itertools.pairwise(times))
    assert times[2][0] > times[0][0]


def test_a_training_step_gets_the_share_of_each_moment(cpu_profile):
    """Processor sharing: a training step advances at the share of a core of each moment, so an
    engine that goes idle during it speeds up the rest of it. One core, no other work: 4 busy
    processes for the first second (a quarter of a core each), then the 2 replicas alone (half a
    core each); 1 CPU second takes 1 s for 0.25 of it and 1.5 s for the rest."""
    sim = LivePipeline(load_run(LIVE), Host(1, 0), load_profile(cpu_profile), load_catalog())
    sim.next_batch = sim.trained = len(sim.run.steps)  # no batches, no further steps
    sim._busy = lambda: 4.0 if sim.k.now < 1.0 else 2.0
    sim.training = True
    sim._train(1.0)
    sim.k.run()
    assert sim.out.train_s == [pytest.approx(2.5, abs=1e-6)]  # at the share of its start: 4 s


def test_a_slice_without_every_steps_groups_is_refused(tmp_path):
    """A run whose last batch is missing cannot be predicted: one clear error, no partial figures."""
    for name in ("config.json", "steps.json", "trace.json"):
        shutil.copy(LIVE / name, tmp_path / name)
    lines = (LIVE / "trajectories.jsonl").read_text().splitlines()
    (tmp_path / "trajectories.jsonl").write_text("\n".join(x for x in lines if '"batch": 2' not in x) + "\n")
    with pytest.raises(ConfigError, match="fill every step"):
        predict_live(tmp_path)


def simulate_live(run: Path, real: bool) -> subprocess.CompletedProcess:
    """`libra simulate --live RUN`: one case of each bad-input table in a real process, as a user
    runs it, the others through the same `libra.cli.main` in this one (conftest.run_main)."""
    args = ("simulate", "--live", str(run))
    return run_cli(*args) if real else run_main(*args)


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ({}, "trajectories.jsonl"),
        ({"trajectories.jsonl": "{}\n", "trace.json": '{"traceEvents": []}'}, "trajectories.jsonl:1"),
        ({"trajectories.jsonl": "[1]\n", "trace.json": '{"traceEvents": []}'}, "JSON object"),
        ({"trajectories.jsonl": "x\n", "trace.json": "{}"}, "traceEvents"),
        (
            {"trajectories.jsonl": "x\n", "trace.json": '{"traceEvents": [{"ph": "X", "name": "a turn 0"}]}'},
            "ts",
        ),
    ],
)
def test_simulate_live_on_a_bad_folder_exits_2(tmp_path, files, says):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    r = simulate_live(tmp_path, real=not files)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(LibraError):
        predict_live(tmp_path)


@pytest.mark.parametrize(
    "host",
    [
        '{"cores": 0, "background": 1}',
        '{"cores": 2, "background": 1, "shares": [2]}',
        "[]",
        '{"cores": 2, "background": 1, "others": [[[0], 1.0]]}',
        '{"cores": 2, "background": 1, "others": [[[1], "x"]]}',
    ],
)
def test_a_bad_host_json_exits_2(tmp_path, host):
    for name in ("config.json", "steps.json", "trace.json", "trajectories.jsonl"):
        shutil.copy(LIVE / name, tmp_path / name)
    (tmp_path / "host.json").write_text(host)
    r = simulate_live(tmp_path, real=host == "[]")
    assert r.returncode == 2 and "host.json" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_simulate_live_prints_the_three_errors(cpu_profile):
    r = run_cli("simulate", "--live", str(LIVE), "--profile", str(cpu_profile), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    host = json.loads((LIVE / "host.json").read_text())  # RUN/host.json is the default host
    assert {k: d["host"][k] for k in ("cores", "background", "shares")} == {
        k: host[k] for k in ("cores", "background", "shares")
    }
    assert d["steps"] == 3 and d["host_speed"] == 1.0  # the fixture's run timed no speed probe
    assert {"step_err", "rollout_err", "train_err"} <= set(d)
    r = run_main(  # the flags' case in this process (conftest.run_main): the real one is above
        "simulate", "--live", str(LIVE), "--profile", str(cpu_profile), "--cores", "4", "--background", "0"
    )
    # The table's title wraps at the terminal's width: compare with whitespace folded.
    assert r.returncode == 0 and "4 cores, background 0" in " ".join(r.stdout.split()), r.stderr


def test_bench_fidelity_json_has_the_issue_keys(cpu_profile):
    """The bench's JSON keeps in-sample and out-of-sample errors apart (--no-fits skips the
    in-sample and leave-one-source-out refits, minutes of Nelder-Mead, not what is checked here)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fidelity.py"), "--json", "--no-fits",
                        "--live", str(LIVE), "--live-profile", str(cpu_profile)],
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-500:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert {
        "public_mape",
        "public",
        "traces_in_sample",
        "traces_out_of_sample",
        "kv_out_of_sample",
        "live",
    } <= set(d)
    assert d["public_mape"] == d["public"]["out_of_sample"]["mape"]
    assert set(d["live"]) >= {"step_err", "rollout_err", "train_err"}


def test_the_engines_cpu_outside_steps_only_adds_and_contention_is_not_applied(cpu_profile, tmp_path):
    """The preset's serving terms add their own CPU (requests, tokens, one weight update per step
    and engine) and never predict a faster run; the profile's contention factors are not applied
    (docs/fidelity.md: the live runs' steps cost no more with a smaller share of a core)."""
    prof = load_profile(cpu_profile)
    eng = prof.rollout.engine("libra-builtin")
    none = {"request_cpu_s": 0.0, "token_cpu_s": 0.0, "weight_load_cpu_s": 0.0, "contention": ()}
    terms = {**none, "request_cpu_s": 2e-3, "token_cpu_s": 1e-4, "weight_load_cpu_s": 0.01}
    bare, with_terms, shared = tmp_path / "bare.yaml", tmp_path / "terms.yaml", tmp_path / "shared.yaml"
    for path, upd in (
        (bare, none),
        (with_terms, terms),
        (shared, {**terms, "contention": ((0.2, 1.3), (0.6, 1.0))}),
    ):
        engines = {**prof.rollout.engines, "libra-builtin": eng.model_copy(update=upd)}
        save_profile(
            prof.model_copy(update={"rollout": prof.rollout.model_copy(update={"engines": engines})}), path
        )
    run = load_run(LIVE)
    turns = [x for t in run.trajs for x in t.turns]
    sim = LivePipeline(run, load_host(LIVE), load_profile(with_terms), load_catalog())
    sim.run_all()
    costs = [e.cost for e in sim.engines.values()]
    serving = sum(c.serving_cpu_s for c in costs)
    assert serving == pytest.approx(2e-3 * len(turns) + 1e-4 * sum(x.sampled for x in turns))
    loads = sim.engine_cpu_s() - sum(c.cpu_s + c.serving_cpu_s for c in costs)
    assert loads == pytest.approx(0.01 * len(run.steps) * len(costs))
    base, more, most = (predict_live(LIVE, p).errors() for p in (bare, with_terms, shared))
    assert more["cpu_s"]["predicted"]["engine"] > base["cpu_s"]["predicted"]["engine"]
    assert most["cpu_s"]["predicted"] == more["cpu_s"]["predicted"] and most["predicted"] == more["predicted"]
    for k in ("rollout_s", "step_s"):
        assert base["predicted"][k] <= more["predicted"][k] + 1e-9


def test_the_hosts_speed_prices_the_engines_not_the_trainers(cpu_profile, tmp_path):
    """Asked for (`--host-speed`), the speed probe timed during the run (host.json's probe_cpu_s)
    over the profile's is the prediction's `host_speed`: the engines' steps cost that many times
    their price (the probe is a forward pass like theirs), the trainers' steps do not
    (docs/fidelity.md); a bad one exits 2."""
    prof = load_profile(cpu_profile)
    eng = prof.rollout.engine("libra-builtin").model_copy(update={"probe_cpu_s": 0.02})
    engines = {**prof.rollout.engines, "libra-builtin": eng}
    probed = tmp_path / "probed.yaml"
    save_profile(
        prof.model_copy(update={"rollout": prof.rollout.model_copy(update={"engines": engines})}), probed
    )
    host = load_host(LIVE)
    same, slow = (predict_live(LIVE, probed, replace(host, probe_cpu_s=p), speed=True) for p in (0.02, 0.04))
    assert predict_live(LIVE, probed, replace(host, probe_cpu_s=0.04)).speed == 1.0  # only when asked
    assert same.speed == 1.0 and slow.errors()["host_speed"] == pytest.approx(2.0)
    fast, twice = same.errors(), slow.errors()
    assert twice["cpu_s"]["predicted"]["engine"] > 1.5 * fast["cpu_s"]["predicted"]["engine"]
    assert twice["cpu_s"]["predicted"]["trainer"] == pytest.approx(fast["cpu_s"]["predicted"]["trainer"])
    assert twice["predicted"]["rollout_s"] > fast["predicted"]["rollout_s"]
    (tmp_path / "run").mkdir()
    for f in LIVE.iterdir():
        shutil.copy(f, tmp_path / "run" / f.name)
    host_json = json.loads((LIVE / "host.json").read_text())
    (tmp_path / "run" / "host.json").write_text(json.dumps({**host_json, "probe_cpu_s": -1}))
    r = run_cli("simulate", "--live", str(tmp_path / "run"), "--profile", str(probed), "--host-speed")
    assert r.returncode == 2 and "probe_cpu_s" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_oracle_replays_the_measured_cpu(cpu_profile, tmp_path):
    """`oracle=True` scales the engines' and trainers' CPU seconds to those live_cpu.py measured,
    leaving the sharing model alone; the prediction's own CPU is far from it, and a run without
    host.json has nothing to replay (exit 2 on the CLI)."""
    measured = json.loads((LIVE / "host.json").read_text())["cpu_s_in_rl_phase"]
    own, oracle = (
        predict_live(LIVE, cpu_profile, oracle=o).errors()["cpu_s"]["predicted"] for o in (False, True)
    )
    assert oracle["engine"] == pytest.approx(measured["engine"], rel=0.03)
    assert oracle["trainer"] == pytest.approx(measured["trainer"], rel=0.03)
    assert abs(own["engine"] / measured["engine"] - 1) > 0.05  # so the test can tell the two apart
    (tmp_path / "run").mkdir()
    for f in LIVE.iterdir():
        if f.name != "host.json":
            shutil.copy(f, tmp_path / "run" / f.name)
    r = run_cli("simulate", "--live", str(tmp_path / "run"), "--profile", str(cpu_profile), "--oracle-cpu")
    assert r.returncode == 2 and "host.json" in r.stderr and "Traceback" not in r.stderr, r.stderr

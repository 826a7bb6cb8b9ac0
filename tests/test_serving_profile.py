"""The built-in engine profiled through its real HTTP server (`libra.runtime.serving_profile`), and
`libra costmodel calibrate --serving-data` fitting the engine's CPU outside its steps."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.costmodel.calibrate import (
    ServingMeasurement,
    _predict,
    fit_contention,
    fit_serving,
    read_serving_measurements,
)
from libra.costmodel.catalog import load_catalog
from libra.costmodel.efficiency import RolloutEfficiency, load_profile
from libra.runtime.serving_profile import profile_builtin_serving
from libra.sim.rl.live import profile_step_cpu_s
from tests.conftest import run_cli, run_main

COMMON = {"hardware": "cpu-host", "model": "builtin-tiny", "engine": "libra-builtin", "max_num_seqs": 64,
          "kv_cache_mb": 32}  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """A real `libra serve engine` on loopback (port 0), driven with the calculator's turns."""
    out = tmp_path_factory.mktemp("served")
    profile_builtin_serving("tiny", out, threads=1, quick=True)
    return out


def test_the_profile_writes_workloads_weight_updates_and_the_steps_it_served(served):
    recs = read_serving_measurements(served / "builtin-tiny-serving.jsonl")
    chats = [r for r in recs if r.kind == "chat"]
    assert chats and [r for r in recs if r.kind == "weights" and r.loads >= 1 and r.cpu_s > 0]
    for r in chats:
        # Two turns a trajectory (the tool call, then the answer), each with its prompt and sample.
        assert all(1 <= len(t) <= 2 and all(p > 0 for p, _ in t) for t in r.trajectories)
        assert 0 < r.step_cpu_s <= r.cpu_s  # the steps are part of the process's CPU
    steps = [json.loads(x) for x in (served / "builtin-tiny-served-steps.jsonl").read_text().splitlines()]
    assert steps and all(s["engine"] == "libra-builtin" and s["step_time_s"] > 0 for s in steps)
    # Every sampled token came out of a logged step: a request's first from its prefill, the rest
    # from decodes (the warm-up workload's steps, 2 trajectories of 16 tokens a turn, are logged too).
    sampled = sum(s for r in chats for t in r.trajectories for _, s in t)
    requests = sum(r.requests for r in chats)
    assert sampled - requests <= sum(s["decode_seqs"] for s in steps) <= sampled - requests + 2 * 2 * 16


def test_calibrate_fits_the_served_terms_into_the_preset(served, tmp_path):
    out = tmp_path / "cpu.yaml"
    r = run_cli("costmodel", "calibrate", "--data", str(served / "builtin-tiny-served-steps.jsonl"),
                "--serving-data", str(served / "builtin-tiny-serving.jsonl"), "--out", str(out), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    fit = json.loads(r.stdout)["serving"]
    eng = load_profile(out).rollout.engine("libra-builtin")
    assert eng.weight_load_cpu_s == pytest.approx(fit["weight_load_cpu_s"]) and eng.weight_load_cpu_s > 0
    assert eng.request_cpu_s == pytest.approx(fit["request_cpu_s"]) and eng.request_cpu_s >= 0
    assert eng.token_cpu_s == pytest.approx(fit["token_cpu_s"]) and eng.token_cpu_s >= 0
    # Serving costs CPU outside the steps, but the steps are most of it.
    assert 0 < fit["outside_steps"] < 0.5 and fit["steps_measured_vs_priced"] > 0


@given(req=st.floats(0, 0.01), tok=st.floats(0, 1e-3), seed=st.integers(0, 1000))
@settings(max_examples=25, deadline=None)
def test_fit_serving_recovers_the_terms_it_was_made_with(req, tok, seed):
    """CPU = the steps' + req * requests + tok * tokens, on workloads of the profile's shapes; the
    steps priced as measured, so the whole process's CPU is priced exactly."""
    import random

    rng, recs, priced = random.Random(seed), [], []
    for n, gen in ((1, 64), (8, 64), (32, 64), (8, 12), (32, 12), (16, 24)):
        trajs = [[[139, rng.randint(1, gen)], [243, rng.randint(1, gen)]] for _ in range(n)]
        steps = 0.01 * n * rng.uniform(0.5, 2.0)
        m = ServingMeasurement(kind="chat", trajectories=trajs, cpu_s=1.0, step_cpu_s=steps, **COMMON)
        recs.append(m.model_copy(update={"cpu_s": steps + req * m.requests + tok * m.tokens}))
        priced.append(steps)
    recs.append(ServingMeasurement(kind="weights", loads=4, cpu_s=0.04, **COMMON))
    fit = fit_serving(recs, priced)
    assert fit.request_cpu_s == pytest.approx(req, abs=1e-7) and fit.token_cpu_s == pytest.approx(
        tok, abs=1e-8
    )
    assert fit.weight_load_cpu_s == pytest.approx(0.01) and fit.mape < 1e-6
    assert fit.steps_measured_vs_priced == pytest.approx(1.0)


def test_contention_is_fitted_by_share_and_never_cheaper_when_busier(catalog):
    """Steps timed beside more busy processes at a smaller share cost more CPU seconds; points that
    say otherwise (the host's other work varies) are pooled, and they must rise in share."""
    base = RolloutEfficiency()
    cm_recs = []
    for k, share, factor in ((0, 0.7, 1.0), (1, 0.34, 1.4), (2, 0.22, 1.2), (3, 0.16, 1.5)):
        for n in (4, 32):
            r = {**COMMON, "tp": 1, "prefill_tokens": 0, "decode_seqs": n, "decode_ctx": 200.0 * n,
                 "co_runners": k, "share": share}  # fmt: skip
            priced = _predict([r], catalog, base)[0]
            cm_recs.append({**r, "step_time_s": priced * factor})
    pts = fit_contention(cm_recs, catalog, base)
    assert [s for s, _ in pts] == [0.16, 0.22, 0.34, 0.7]
    assert [f for _, f in pts] == pytest.approx([1.5, 1.3, 1.3, 1.0])  # 1.4 and 1.2 pooled
    eng = base.engine("libra-builtin").model_copy(update={"contention": pts})
    with pytest.raises(ValueError):
        eng.model_validate({**eng.model_dump(), "contention": [(0.5, 1.2), (0.3, 1.4)]})


def test_the_terms_add_exactly_what_they_price():
    """The simulated engine's steps cost the same with the terms; what they add is kept apart."""
    cat, base = load_catalog(), RolloutEfficiency()
    trajs = [[(139, 40), (243, 3)] for _ in range(16)]
    steps = profile_step_cpu_s(trajs, base, 64, 32, "builtin-tiny", cat)
    more = base.updated("cpu-host", "libra-builtin", {"request_cpu_s": 2e-3, "token_cpu_s": 1e-4})
    assert profile_step_cpu_s(trajs, more, 64, 32, "builtin-tiny", cat) == pytest.approx(steps)


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


CHAT = {**COMMON, "kind": "chat", "trajectories": [[[139, 40], [243, 3]]], "cpu_s": 0.1, "step_cpu_s": 0.09}
WEIGHTS = {**COMMON, "kind": "weights", "loads": 2, "cpu_s": 0.02}


@pytest.mark.parametrize(
    "lines,says",
    [
        (["{not json"], "line 1"),
        ([{**CHAT, "trajectories": []}, WEIGHTS], "trajectories"),
        ([{**CHAT, "cpu_s": -1}, WEIGHTS], "cpu_s"),
        ([{**CHAT, "kind": "stream"}, WEIGHTS], "kind"),
        ([CHAT], "weights record"),
        ([CHAT, {**WEIGHTS, "loads": 0}], "loads"),
        ([CHAT, {**WEIGHTS, "model": "builtin-small"}], "one hardware, model and engine"),
        ([{**CHAT, "trajectories": [[[139, -4]]]}, WEIGHTS], "trajectories"),
        ([{**CHAT, "step_cpu_s": 0.2}, WEIGHTS], "step_cpu_s"),
    ],
)
def test_a_bad_serving_file_exits_2(tmp_path, lines, says):
    data = _write(tmp_path / "serving.jsonl", lines)
    args = ("costmodel", "calibrate", "--serving-data", str(data), "--out", str(tmp_path / "p.yaml"))
    # The first case in a real process, as a user runs it; the others through the same
    # libra.cli.main in this one (conftest.run_main: no new interpreter's imports each).
    r = run_cli(*args) if says == "line 1" else run_main(*args)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr

import json

import numpy as np
import pytest

from libra.costmodel.calibrate import fit_rollout, nelder_mead, read_measurements
from libra.costmodel.efficiency import RolloutEfficiency, load_profile
from libra.costmodel.rollout import RolloutCostModel
from tests.conftest import run_cli, run_main


def test_nelder_mead_quadratic():
    x = nelder_mead(lambda v: float(np.sum((v - np.array([1.0, -2.0])) ** 2)), np.zeros(2))
    assert x == pytest.approx([1.0, -2.0], abs=1e-3)


def _synthetic(catalog, truth: RolloutEfficiency, n: int = 60) -> list[dict]:
    """Measurements made by the model itself with known coefficients, spanning the regimes."""
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(n):
        tp = int(rng.choice([1, 2, 4, 8]))
        cm = RolloutCostModel(catalog.hardware("a800-80g"), catalog.model("qwen3-14b"), tp, truth)
        b = int(rng.integers(1, 256))
        ctx = int(rng.integers(256, 16384))
        p = int(rng.choice([0, 0, 512, 2048, 8192]))
        t = cm.step_time(p, p * (p + 1) / 2, b, b * ctx)
        recs.append({"hardware": "a800-80g", "model": "qwen3-14b", "tp": tp, "prefill_tokens": p,
                     "decode_seqs": b, "decode_ctx": b * ctx, "step_time_s": t})  # fmt: skip
    return recs


def _truth(**values) -> RolloutEfficiency:
    return RolloutEfficiency().updated("a800-80g", "vllm-v1", values)


def _value(eff: RolloutEfficiency, field: str) -> float:
    gpu, eng = eff.gpu("a800-80g"), eff.engine("vllm-v1")
    return getattr(gpu, field) if field in type(gpu).model_fields else getattr(eng, field)


def test_fit_recovers_known_coefficients(catalog):
    truth = _truth(bw=0.62, compute=0.41, base_overhead_s=4e-3, per_seq_overhead_s=35e-6)
    fitted, mape = fit_rollout(_synthetic(catalog, truth), catalog)
    assert mape < 0.01
    for f in ("bw", "compute", "base_overhead_s", "per_seq_overhead_s"):
        assert _value(fitted, f) == pytest.approx(_value(truth, f), rel=0.05), f


def test_calibrate_cli_writes_loadable_profile(tmp_path, catalog):
    truth = _truth(bw=0.6, compute=0.45, base_overhead_s=3e-3, per_seq_overhead_s=25e-6)
    data = tmp_path / "m.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _synthetic(catalog, truth, 40)))
    out = tmp_path / "profile.yaml"
    r = run_cli("costmodel", "calibrate", "--data", str(data), "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    prof = load_profile(out)
    assert prof.rollout.gpu("a800-80g").bw == pytest.approx(0.6, rel=0.05)
    # The profile is used downstream: a query with it differs from the defaults.
    q1 = json.loads(run_main("costmodel", "rollout", "--json").stdout)  # in-process: the baseline
    q2 = json.loads(run_cli("costmodel", "rollout", "--json", "--profile", str(out)).stdout)
    assert q1["step_time_s"] != q2["step_time_s"]


def test_bad_measurements_name_line_and_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"hardware": "a800-80g", "model": "qwen3-14b", "tp": 1, "decode_seqs": 1, "step_time_s": 0.01}\n'
                 '{"hardware": "a800-80g", "tp": 1}\n')  # fmt: skip
    with pytest.raises(Exception) as e:
        read_measurements(f)
    assert ":2:" in str(e.value) and "model" in str(e.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("tp", "x"),
        ("tp", 0),
        ("decode_seqs", 1e308),
        ("hardware", 5),
        ("prefill_tokens", -1),
        ("decode_ctx", "nan"),
    ],
)
def test_a_bad_value_in_a_measurement_names_line_and_field(tmp_path, field, value):
    """Only `step_time_s` was checked: a TP of 'x' or 0, or 1e308 sequences, reached int() or the
    cost model and raised there."""
    rec = {
        "hardware": "a800-80g",
        "model": "qwen3-14b",
        "tp": 1,
        "decode_seqs": 1,
        "step_time_s": 0.01,
        field: value,
    }
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    # The first case in a real process, as a user runs it; the others through the same
    # libra.cli.main in this one (conftest.run_main: no new interpreter's imports each).
    cli = run_cli if value == "x" else run_main
    r = cli("costmodel", "calibrate", "--data", str(f), "--out", str(tmp_path / "p.yaml"))
    assert r.returncode == 2 and f"m.jsonl:1: field '{field}'" in r.stderr, r.stderr


def test_the_training_fit_recovers_known_coefficients(catalog):
    """Training steps made by the training cost model with known `mfu` and per-micro-batch
    overhead (a CPU replica's shapes) are fitted back."""
    from libra.costmodel.calibrate import TrainMeasurement, fit_train, predict_train
    from libra.costmodel.efficiency import TrainEfficiency

    truth = TrainEfficiency(mfu=0.03, per_microbatch_overhead_s=0.04)
    shapes = [(4, 128), (8, 280), (32, 280), (32, 140), (48, 200), (16, 600), (4, 1500)]
    recs = [TrainMeasurement(hardware="cpu-host", model="builtin-tiny", seq_lens=[n] * k, micro_batch_tokens=1024,
                             step_time_s=1.0) for k, n in shapes]  # fmt: skip
    recs = [
        r.model_copy(update={"step_time_s": float(t)})
        for r, t in zip(recs, predict_train(recs, catalog, truth), strict=True)
    ]
    got, mape = fit_train(recs, catalog)
    assert mape < 0.01
    assert got.mfu == pytest.approx(0.03, rel=0.05)
    assert got.per_microbatch_overhead_s == pytest.approx(0.04, rel=0.05)


def test_bad_train_data_is_one_line(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"hardware": "cpu-host", "model": "builtin-tiny", "seq_lens": [], "step_time_s": 1}\n')
    r = run_cli("costmodel", "calibrate", "--train-data", str(bad), "--out", str(tmp_path / "p.yaml"))
    assert r.returncode == 2 and "t.jsonl:1" in r.stderr and "seq_lens" in r.stderr, r.stderr

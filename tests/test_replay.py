"""Fidelity of the simulated engine against real vLLM measurements (shared/data/vllm-bench)."""

import json

import pytest

from libra.sim.replay import calibrate, compare, load_bench
from tests.conftest import run_cli

TRACES = ["RTXPRO6000_Llama-3.1-8B", "RTXPRO6000_Qwen3-32B"]


@pytest.mark.parametrize("name", TRACES)
def test_default_constants_fidelity(shared_data, catalog, name):
    """Spec-sheet hardware and the default efficiency constants, nothing fitted to the trace."""
    err = compare(load_bench(shared_data / "vllm-bench" / name, catalog), catalog)["error"]
    assert abs(err["latency_mean"]) <= 0.25 and abs(err["latency_p90"]) <= 0.25
    assert abs(err["ttft_mean"]) <= 0.35


def test_calibrate_on_llama_transfer_to_qwen(shared_data, catalog):
    llama = load_bench(shared_data / "vllm-bench" / TRACES[0], catalog)
    qwen = load_bench(shared_data / "vllm-bench" / TRACES[1], catalog)
    eff, fit_err = calibrate(llama, catalog)
    assert abs(fit_err["latency_mean"]) < 0.05
    err = compare(qwen, catalog, eff)["error"]
    assert abs(err["latency_mean"]) <= 0.12 and abs(err["latency_p90"]) <= 0.12


def test_cli_json_shape(shared_data):
    r = run_cli("replay-vllm", str(shared_data / "vllm-bench" / TRACES[0]), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d["error"]) == {"ttft_mean", "latency_mean", "latency_p90", "tpot_mean"}
    for k in ("ttft_mean", "tpot_p99", "latency_median"):
        assert d["measured"][k] > 0 and d["simulated"][k] > 0


def test_bad_folder(tmp_path):
    (tmp_path / "meta.json").write_text("{broken")
    r = run_cli("replay-vllm", str(tmp_path))
    assert r.returncode == 2 and "meta.json" in r.stderr and "Traceback" not in r.stderr

"""Fidelity of the simulated engine against real vLLM measurements (shared/data/vllm-bench)."""

import json

import pytest

from libra.sim.replay.vllm import calibrate, compare, load_bench
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


def _mutated(tmp_path, shared_data, meta=None, instance=None, request=None):
    """A copy of the Llama folder with one value changed in meta.json, config.json or a request."""
    import copy
    import shutil

    src = shared_data / "vllm-bench" / TRACES[0]
    m = json.loads((src / "meta.json").read_text())
    c = json.loads((src / "config.json").read_text())
    reqs = [json.loads(line) for line in (src / "requests.jsonl").read_text().splitlines()[:20]]
    for key, value in (meta or {}).items():
        m["engine_kwargs"][key] = value
    for key, value in (instance or {}).items():
        c["nodes"][0]["instances"][0]["npu_mem"][key] = value
    if request is not None:
        reqs = [copy.deepcopy({**r, **request}) for r in reqs]
    shutil.copytree(src, tmp_path / "b")
    (tmp_path / "b" / "meta.json").write_text(json.dumps(m))
    (tmp_path / "b" / "config.json").write_text(json.dumps(c))
    (tmp_path / "b" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return tmp_path / "b"


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"meta": {"model": 5}}, "meta.json.engine_kwargs.model"),  # AttributeError
        ({"meta": {"tensor_parallel_size": 0}}, "tensor_parallel_size"),  # ZeroDivisionError
        ({"meta": {"tensor_parallel_size": 64}}, "gpus_per_node"),  # accepted before
        ({"meta": {"max_num_batched_tokens": 1e308}}, "max_num_batched_tokens"),  # OverflowError
        ({"instance": {"mem_util": 0.01}}, "mem_util"),  # the engine stalled: RuntimeError
        ({"request": {"input_toks": 2**24}}, "KV cache"),  # the same
        ({"request": {"output_toks": 1}}, "output_toks"),  # no TPOT to measure: IndexError
        ({"request": {"queued_ts": None}}, "queued_ts"),  # KeyError / TypeError
    ],
)
def test_a_folder_with_one_bad_value_is_one_line_exit_2(tmp_path, shared_data, change, needle):
    r = run_cli("replay-vllm", str(_mutated(tmp_path, shared_data, **change)))
    assert r.returncode == 2 and needle in r.stderr, r.stderr[-400:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1

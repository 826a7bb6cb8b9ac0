"""The engine's control plane, for real: a `libra serve engine` subprocess is paused with requests
in flight in each of SGLang's modes (and vLLM's `wait`), gets new weights from a checkpoint file
and over a gloo group that this test process hosts as the trainer (rank 0), and continues.

What is checked is what a trainer relies on: no request is lost or answered twice; an aborted
request comes back with the tokens it had; a request kept through the pause continues and tags
each token with the weight version that produced it; after a `retract` pause the tokens sampled
after the update have exactly the new model's logprobs (recomputed from scratch), and those before
it the old model's; control calls need the admin token when one is set.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.model import build_model, save_checkpoint
from libra.runtime.engine.tokenizer import encode
from libra.runtime.engine.weight_sync import WeightUpdateError, open_group, push_weights
from tests.conftest import wait_for
from tests.engine_fixtures import start_engine
from tests.test_engine_tokens import assert_close, post, reference_logprobs

PRESET = EngineConfig().preset


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {0: build_model(PRESET, seed=0), 7: build_model(PRESET, seed=7)}


TOKEN = "s3cret"  # the module's engine guards its control plane; `control` sends it unless told not to


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory):
    eng = start_engine(
        "--max-num-seqs", "8", "--admin-token", TOKEN, log_dir=tmp_path_factory.mktemp("engine")
    )
    yield eng
    eng.stop()


@pytest.fixture
def eng(shared_engine, models, tmp_path):
    """One engine for the module, back in its starting state before each test: generating, its
    KV cache resident, seed-0 weights at version "0", nothing queued (through the control API)."""
    url = shared_engine.url
    control(url, "/continue_generation")
    control(url, "/resume_memory_occupation")
    path = save_checkpoint(models[0], tmp_path / "v0.pt")
    assert (
        control(url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "0"})[0] == 200
    )
    h = health(shared_engine)
    assert h["paused"] is None and not h["sleeping"] and h["weight_version"] == "0"
    assert h["running"] == h["waiting"] == 0, h
    return shared_engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stream(threading.Thread):
    """A streamed /generate request read in the background; `started` is set at its first chunk."""

    def __init__(self, url: str, prompt: list[int], max_new_tokens: int = 600, headers: dict | None = None):
        super().__init__(daemon=True)
        body = {"input_ids": prompt, "stream": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        self.req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
        self.prompt, self.started, self.last, self.chunks, self.error = (
            prompt,
            threading.Event(),
            None,
            0,
            None,
        )
        self.start()

    def run(self) -> None:
        try:
            with urllib.request.urlopen(self.req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        self.last, self.chunks = json.loads(line[6:]), self.chunks + 1
                        self.started.set()
        except Exception as e:  # reported by the test
            self.error = e
        self.started.set()

    def result(self) -> dict:
        self.join(120)
        assert not self.is_alive() and self.error is None, self.error
        return self.last


def control(url: str, path: str, body: dict | None = None, token: str | None = TOKEN, method: str = "POST") -> tuple[int, dict]:  # fmt: skip
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps(body or {}).encode() if method == "POST" else None
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(eng) -> dict:
    return eng.get("/health")


def start_streams(eng, n: int = 3, max_new_tokens: int = 600) -> list[Stream]:
    streams = [Stream(eng.url, encode(f"prompt number {i}"), max_new_tokens) for i in range(n)]
    for s in streams:
        assert s.started.wait(60)
    return streams


def versions_of(out: dict) -> list[str]:
    meta = out["meta_info"]
    return meta.get("output_token_weight_versions") or [meta["weight_version"]] * len(out["output_ids"])


# ---- pause modes ----------------------------------------------------------------------------------


def test_pause_abort_answers_in_flight_requests_with_what_they_have_and_holds_new_ones(eng):
    streams = start_streams(eng)
    status, out = control(eng.url, "/pause_generation", {"mode": "abort"})
    assert status == 200 and out["success"] and out["aborted"] == 3
    for s in streams:
        res = s.result()
        assert res["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(res["output_ids"]) < 600
    late = Stream(eng.url, encode("late"), 5)
    wait_for(lambda: health(eng)["waiting"] == 1, "the late request held")
    assert health(eng)["paused"] == "abort" and late.is_alive()
    status, out = control(eng.url, "/continue_generation")
    assert status == 200 and out["released"] == 1
    assert late.result()["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert health(eng)["paused"] is None


def test_pause_in_place_keeps_requests_and_their_tokens_switch_version(eng, models, tmp_path):
    path = save_checkpoint(models[7], tmp_path / "v1.pt")
    streams = start_streams(eng)
    status, out = control(eng.url, "/pause_generation", {"mode": "in_place"})
    assert status == 200 and out["paused"] == "in_place"
    steps = health(eng)["steps"]
    time.sleep(0.5)
    h = health(eng)
    assert h["steps"] == steps and h["running"] == 3  # nothing computed, nothing dropped
    assert control(eng.url, "/flush_cache")[0] == 400  # SGLang's rule: not while requests hold KV
    status, out = control(
        eng.url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "1"}
    )
    assert status == 200 and out["weight_version"] == "1" and out["num_paused_requests"] == 3
    assert control(eng.url, "/continue_generation")[0] == 200
    for s in streams:
        res = s.result()
        v = versions_of(res)
        assert len(res["output_ids"]) == 600 and v[0] == "0" and v[-1] == "1" and v == sorted(v)
        assert res["meta_info"]["weight_version"] == "1"
    assert control(eng.url, "/get_weight_version", method="GET")[1] == {"weight_version": "1"}
    assert control(eng.url, "/flush_cache")[0] == 200


def test_pause_retract_recomputes_with_the_new_weights(eng, models, tmp_path):
    path = save_checkpoint(models[7], tmp_path / "v1.pt")
    (stream,) = start_streams(eng, n=1, max_new_tokens=300)
    status, out = control(eng.url, "/pause_generation", {"mode": "retract"})
    assert status == 200 and out["retracted"] == 1
    assert health(eng)["running"] == 0 and health(eng)["waiting"] == 1
    assert control(eng.url, "/flush_cache")[0] == 200  # retracted requests hold no KV
    assert (
        control(eng.url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "1"})[0]
        == 200
    )
    control(eng.url, "/continue_generation")
    res = stream.result()
    ids, v = res["output_ids"], versions_of(res)
    k = v.index("1")
    assert 0 < k < len(ids) == 300 and v[k:] == ["1"] * (len(ids) - k)
    lps = [e[0] for e in res["meta_info"]["output_token_logprobs"]]
    # before the update: the old weights; after: the new weights over the whole recomputed context
    assert_close(lps[:k], reference_logprobs(models[0], stream.prompt, ids[:k]))
    new = reference_logprobs(models[7], stream.prompt, ids)
    assert_close(lps[k:], new[k:])


def test_pause_wait_lets_in_flight_requests_finish(eng):
    streams = start_streams(eng, n=2, max_new_tokens=120)
    status, out = control(eng.url, "/pause_generation", {"mode": "wait"})
    assert status == 200 and out["drained"] is True
    for s in streams:
        assert s.result()["meta_info"]["finish_reason"]["type"] == "length"
    late = Stream(eng.url, encode("late"), 4)
    wait_for(lambda: health(eng)["waiting"] == 1, "the late request held")
    assert late.is_alive() and health(eng)["paused"] == "wait"
    control(eng.url, "/continue_generation")
    assert len(late.result()["output_ids"]) == 4


def test_vllm_names_and_abort_request(eng):
    status, out = control(eng.url, "/pause?mode=keep")
    assert status == 200 and out == {"status": "paused"} and health(eng)["paused"] == "in_place"
    assert control(eng.url, "/is_paused", method="GET")[1] == {"is_paused": True}
    assert control(eng.url, "/pause?mode=bogus")[1]["param"] == "mode"
    assert control(eng.url, "/resume")[1] == {"status": "resumed"}
    assert control(eng.url, "/is_paused", method="GET")[1] == {"is_paused": False}
    out = {}
    t = threading.Thread(target=lambda: out.update(r=post(eng.url + "/generate", {"input_ids": [1, 2], "rid": "job-1", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})))  # fmt: skip
    t.start()
    while health(eng)["running"] == 0:
        time.sleep(0.02)
    assert control(eng.url, "/abort_request", {"rid": "job-1"})[1]["aborted"] == 1
    t.join(60)
    status, body = out["r"]
    assert status == 200 and body["meta_info"]["id"] == "job-1"
    assert body["meta_info"]["finish_reason"]["type"] == "abort" and len(body["output_ids"]) < 3000


# ---- weights ----------------------------------------------------------------------------------------


def test_update_from_disk_without_a_pause_and_bad_files(eng, models, tmp_path):
    path = save_checkpoint(models[7], tmp_path / "w.pt")
    body = {
        "input_ids": [1, 2, 3],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }
    status, out = control(
        eng.url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "step-7"}
    )
    assert status == 200 and out["success"] and out["updated"] == len(models[7].state_dict())
    res = post(eng.url + "/generate", body)[1]
    assert res["meta_info"]["weight_version"] == "step-7" and health(eng)["weight_version"] == "step-7"
    lps = [e[0] for e in res["meta_info"]["output_token_logprobs"]]
    assert_close(lps, reference_logprobs(models[7], [1, 2, 3], res["output_ids"]))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    small = save_checkpoint(build_model(EngineConfig(model="small").preset), tmp_path / "small.pt")
    for bad in ("/nonexistent.pt", str(tmp_path / "junk.pt"), str(small), str(tmp_path)):
        status, out = control(
            eng.url, "/update_weights_from_disk", {"model_path": bad, "weight_version": "x"}
        )
        assert status == 400 and out["success"] is False and out["param"] == "model_path", out
    assert health(eng)["weight_version"] == "step-7"  # a refused update changes nothing


def test_distributed_update_over_a_gloo_group_hosted_by_the_trainer(eng, models):
    port = free_port()
    group = open_group(eng.url, "127.0.0.1", port, world_size=2, group_name="g1", token=TOKEN)
    try:
        answer = push_weights(group, eng.url, models[7].state_dict(), "2", token=TOKEN)
        assert answer["success"] and answer["weight_version"] == "2"
        res = post(eng.url + "/generate", {"input_ids": [9, 8], "return_logprob": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})[1]  # fmt: skip
        assert_close(
            [e[0] for e in res["meta_info"]["output_token_logprobs"]],
            reference_logprobs(models[7], [9, 8], res["output_ids"]),
        )
        # a subset of tensors, in another dtype: only those change (back to the seed-0 values)
        part = {
            k: v.to(torch.bfloat16) for k, v in models[0].state_dict().items() if k.startswith("layers.0.")
        }
        assert push_weights(group, eng.url, part, "3", token=TOKEN)["updated"] == len(part)
        bad = {"names": ["nope"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g1"}
        status, out = control(eng.url, "/update_weights_from_distributed", bad)
        assert status == 400 and out["param"] == "names[0]"
        status, out = control(eng.url, "/update_weights_from_distributed", {**bad, "group_name": "other"})
        assert status == 400 and out["param"] == "group_name"
        assert control(eng.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": "g1"})[0] == 400  # fmt: skip
        nccl = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": "g2", "backend": "nccl"}  # fmt: skip
        assert control(eng.url, "/init_weights_update_group", nccl)[1]["param"] == "backend"
    finally:
        status, out = control(eng.url, "/destroy_weights_update_group", {"group_name": "g1"})
        group.close()
    assert status == 200 and out["success"]
    assert health(eng)["weight_version"] == "3"


# ---- the admin token --------------------------------------------------------------------------------


def test_control_needs_the_admin_token_generation_does_not(eng):
    for path in (
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/update_weights_from_disk",
        "/pause",
    ):
        status, out = control(eng.url, path, {"mode": "abort"}, token=None)
        assert status == 401 and out["success"] is False
    assert control(eng.url, "/pause_generation", {"mode": "abort"}, token="wrong")[0] == 401
    assert control(eng.url, "/get_weight_version", token=None, method="GET")[0] == 401
    assert control(eng.url, "/pause_generation", {"mode": "in_place"}, token="s3cret")[0] == 200
    assert control(eng.url, "/continue_generation", token="s3cret")[0] == 200
    assert post(eng.url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})[0] == 200
    with pytest.raises(WeightUpdateError, match="401"):
        open_group(eng.url, "127.0.0.1", free_port(), world_size=2, timeout_s=5)  # no token


def test_release_and_resume_the_kv_cache_memory(eng):
    status, out = control(eng.url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 200 and out["freed_mb"] > 0 and health(eng)["sleeping"] is True
    late = Stream(eng.url, encode("asleep"), 5)  # held while the cache is gone
    wait_for(lambda: health(eng)["waiting"] == 1, "the request held while asleep")
    assert late.is_alive()
    assert control(eng.url, "/release_memory_occupation")[0] == 400  # a request is held
    assert control(eng.url, "/resume_memory_occupation", {"tags": ["cuda_graph"]})[1]["param"] == "tags"
    assert control(eng.url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200  # not the cache
    assert late.is_alive() and health(eng)["sleeping"] is True
    assert control(eng.url, "/resume_memory_occupation")[0] == 200
    assert len(late.result()["output_ids"]) == 5 and health(eng)["sleeping"] is False
    # vLLM's names (level 2, which discards the weights too, in tests/test_frameworks.py)
    assert control(eng.url, "/sleep?level=3")[1]["param"] == "level"
    assert control(eng.url, "/sleep?level=1")[0] == 200 and control(eng.url, "/is_sleeping", method="GET")[1] == {"is_sleeping": True}  # fmt: skip
    assert control(eng.url, "/wake_up")[0] == 200 and health(eng)["sleeping"] is False
    res = post(eng.url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
    assert res[0] == 200 and len(res[1]["output_ids"]) == 3

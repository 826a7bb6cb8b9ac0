"""The control plane through the gateway, over three real engines: routes are per request, control
is broadcast.

Three `libra serve engine` processes behind one `libra serve gateway` with an admin token. With
requests in flight on every engine (SGLang /generate streams routed by slime's routing key), the
gateway pauses all of them in each mode, loads new weights from disk into every engine and over a
gloo group this test hosts as the trainer (ranks assigned by the gateway), and resumes. Every
request sent comes back exactly once (aborted ones with what they had); requests sent while
paused are held and answered after the resume; the weight versions change on every engine and
each token carries the version that produced it. A second gateway speaks vLLM's dialect to one of
the engines, which serves vLLM's names too.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.model import build_model, save_checkpoint
from libra.runtime.engine.tokenizer import decode, encode, render_prompt
from libra.runtime.engine.weight_sync import open_group, push_weights
from tests.conftest import wait_for
from tests.engine_fixtures import start_engine
from tests.test_engine_control import free_port, versions_of
from tests.test_engine_tokens import assert_close, reference_logprobs
from tests.test_gateway_fixtures import backend_arg, gateway_factory  # noqa: F401

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("engines")
    with ThreadPoolExecutor(3) as pool:
        started = list(pool.map(lambda _: start_engine("--admin-token", TOKEN, log_dir=log_dir), range(3)))
    yield started
    for e in started:
        e.stop()


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {seed: build_model(EngineConfig().preset, seed=seed) for seed in (0, 5, 7)}


@pytest.fixture
def gw(engines, gateway_factory):  # noqa: F811
    args = [a for i, e in enumerate(engines) for a in backend_arg(e.url, "b", 1, 8192, name=f"e{i}")]
    return gateway_factory(*args, "--set", f"admin_token={TOKEN}", "--router", "least-loaded")


class Call(threading.Thread):
    """One streamed /generate through the gateway; `result` is its last (cumulative) chunk."""

    def __init__(self, url: str, key: str, n: int):
        super().__init__(daemon=True)
        self.prompt = encode(f"request {key}")
        body = {"input_ids": self.prompt, "stream": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        headers = {"Content-Type": "application/json", "X-SMG-Routing-Key": key}
        self.req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), headers=headers)
        self.started, self.out, self.engine, self.answers = threading.Event(), None, None, 0
        self.start()

    def run(self) -> None:
        with urllib.request.urlopen(self.req, timeout=180) as r:
            self.engine = r.headers["X-Libra-Instance"]
            for line in r:
                if line.startswith(b"data: {"):
                    self.out = json.loads(line[6:])
                    self.started.set()
                elif line.startswith(b"data: [DONE]"):
                    self.answers += 1
        self.started.set()

    def result(self) -> dict:
        self.join(180)
        assert not self.is_alive() and self.answers == 1 and self.out is not None
        return self.out


def in_flight(gw, n_tokens: int = 300) -> list[Call]:
    calls = [Call(gw.url, f"k{i}-{time.monotonic_ns()}", n_tokens) for i in range(3)]
    for c in calls:
        assert c.started.wait(60)
    return calls


def broadcast(gw, path: str, body: dict | None = None, method: str = "POST", headers: dict = AUTH) -> tuple[int, dict]:  # fmt: skip
    status, out, _ = gw.request(
        method, path, body if method == "POST" else None, headers=headers, timeout=180
    )
    return status, out


def engine_state(engines, key: str) -> list:
    return [e.get("/health")[key] for e in engines]


def test_broadcast_pause_in_each_mode_weights_and_versions_over_three_engines(gw, engines, models, tmp_path):
    ckpt = {v: save_checkpoint(models[seed], tmp_path / f"{v}.pt") for v, seed in (("1", 7), ("2", 5))}
    status, out = broadcast(gw, "/pause_generation", {"mode": "abort"}, headers={})
    assert status == 401  # control needs the admin token; generation does not

    # abort: every in-flight request comes back once, with what it had
    calls = in_flight(gw)
    assert len({c.engine for c in calls}) == 3  # least-loaded spread them over the three engines
    status, out = broadcast(gw, "/pause_generation", {"mode": "abort"})
    assert status == 200 and out["ok"] and sorted(out["results"]) == ["e0", "e1", "e2"]
    assert sum(r["aborted"] for r in out["results"].values()) == 3
    assert all(c.result()["meta_info"]["finish_reason"]["type"] == "abort" for c in calls)
    held = Call(gw.url, "held", 5)  # sent while paused: held, then answered after the resume
    wait_for(lambda: sum(engine_state(engines, "waiting")) == 1, "the request held by a paused engine")
    assert held.is_alive() and engine_state(engines, "paused") == ["abort"] * 3
    assert broadcast(gw, "/continue_generation")[1]["ok"]
    assert len(held.result()["output_ids"]) == 5

    # in_place: kept, new weights from disk on every engine, continue: tokens switch version
    calls = in_flight(gw)
    assert broadcast(gw, "/pause_generation", {"mode": "in_place"})[1]["ok"]
    assert sum(engine_state(engines, "running")) == 3
    status, out = broadcast(
        gw, "/update_weights_from_disk", {"model_path": str(ckpt["1"]), "weight_version": "1"}
    )
    assert status == 200 and out["ok"] and {r["weight_version"] for r in out["results"].values()} == {"1"}
    broadcast(gw, "/continue_generation")
    for c in calls:
        v = versions_of(c.result())
        assert len(v) == 300 and v[0] == "0" and v[-1] == "1"

    # retract: recomputed with the weights loaded meanwhile; their logprobs are the new model's
    calls = in_flight(gw)
    assert sum(r["retracted"] for r in broadcast(gw, "/pause_generation", {"mode": "retract"})[1]["results"].values()) == 3  # fmt: skip
    broadcast(gw, "/update_weights_from_disk", {"model_path": str(ckpt["2"]), "weight_version": "2"})
    broadcast(gw, "/continue_generation")
    for c in calls:
        out = c.result()
        v, ids = versions_of(out), out["output_ids"]
        k = v.index("2")
        lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert_close(lps[k:], reference_logprobs(models[5], c.prompt, ids)[k:])

    # wait: in-flight requests finish, then the engines hold new ones
    calls = in_flight(gw, 60)
    status, out = broadcast(gw, "/pause_generation", {"mode": "wait"})
    assert status == 200 and all(r["drained"] for r in out["results"].values())
    assert all(c.result()["meta_info"]["finish_reason"]["type"] == "length" for c in calls)
    broadcast(gw, "/continue_generation")

    # over a gloo group the trainer hosts: the gateway gives each engine its rank
    group = open_group(gw.url, "127.0.0.1", free_port(), world_size=4, group_name="train", token=TOKEN)
    try:
        answer = push_weights(group, gw.url, models[0].state_dict(), "3", token=TOKEN)
        assert answer["ok"] and {r["weight_version"] for r in answer["results"].values()} == {"3"}
    finally:
        assert broadcast(gw, "/destroy_weights_update_group", {"group_name": "train"})[1]["ok"]
        group.close()
    status, out = broadcast(gw, "/get_weight_version", method="GET")
    assert out["results"] == {f"e{i}": {"weight_version": "3"} for i in range(3)}
    res = gw.request("POST", "/generate", {"input_ids": [4, 2], "return_logprob": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}})[1]  # fmt: skip
    assert res["meta_info"]["weight_version"] == "3"
    assert_close([e[0] for e in res["meta_info"]["output_token_logprobs"]], reference_logprobs(models[0], [4, 2], res["output_ids"]))  # fmt: skip


def test_one_engine_by_id_errors_per_engine_and_admin_routes(gw, engines):
    status, out = broadcast(gw, "/pause_generation?engine=e1", {"mode": "in_place"})
    assert status == 200 and list(out["results"]) == ["e1"]
    assert engine_state(engines, "paused") == [None, "in_place", None]
    assert broadcast(gw, "/continue_generation?engine=e1")[1]["ok"]
    assert broadcast(gw, "/pause_generation?engine=nope", {})[0] == 404
    status, out = broadcast(gw, "/update_weights_from_disk", {"model_path": "/no/such.pt"})
    assert (
        status == 400 and not out["ok"] and all(r["param"] == "model_path" for r in out["results"].values())
    )
    status, out = broadcast(gw, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 3})  # fmt: skip
    assert status == 400 and "world_size" in json.dumps(out)  # three engines need 1 + 3 ranks
    assert gw.get("/admin/instances")[0] == 401 and gw.get("/admin/instances", headers=AUTH)[0] == 200
    status, body = gw.post("/tokenize", {"prompt": "hi"})  # proxied to an engine
    assert status == 200 and body["tokens"] == render_prompt("hi")
    assert gw.post("/detokenize", {"tokens": [104, 105]})[1] == {"prompt": "hi"}


def test_vllm_dialect_backends_get_vllm_calls(engines, gateway_factory):  # noqa: F811
    e = engines[0]
    version = e.get("/health")["weight_version"]
    gw = gateway_factory(*backend_arg(e.url, "b", 1, 8192, name="v", control="vllm", admin_token=TOKEN), "--router", "least-loaded")  # fmt: skip
    status, out = gw.post("/pause_generation", {"mode": "in_place"})  # -> POST /pause?mode=keep
    assert (
        status == 200
        and out["results"]["v"] == {"status": "paused"}
        and e.get("/health")["paused"] == "in_place"
    )
    assert gw.get("/is_paused")[1]["results"]["v"] == {"is_paused": True}
    status, out = gw.post("/resume")  # vLLM's name at the gateway too
    assert status == 200 and e.get("/health")["paused"] is None
    status, out = gw.post("/update_weights_from_disk", {"model_path": "/x.pt"})
    assert status == 502 and out["status"]["v"] == 501  # vLLM has no HTTP load from disk
    assert (
        gw.post("/release_memory_occupation")[0] == 200 and e.get("/health")["sleeping"]
    )  # -> /sleep?level=1
    assert gw.post("/wake_up")[0] == 200 and not e.get("/health")["sleeping"]  # vLLM's name -> /wake_up
    group_port = free_port()
    group = open_group(gw.url, "127.0.0.1", group_port, world_size=2)  # -> /init_weight_transfer_engine
    try:
        state = build_model(EngineConfig().preset, seed=9).state_dict()
        answer = push_weights(group, gw.url, state, "9")  # -> /update_weights
        assert answer["ok"] and answer["results"]["v"] == {"message": "Weights updated"}
    finally:
        e_body = json.dumps({"group_name": "weight_update_group"}).encode()
        req = urllib.request.Request(e.url + "/destroy_weights_update_group", data=e_body, headers={**AUTH, "Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(req, timeout=30).read()
        group.close()
    assert e.get("/health")["weight_version"] == version  # vLLM's update carries no version


def test_token_ids_pass_through_the_gateway_to_the_official_client(gw, models, tmp_path):
    """vLLM's return_token_ids through the gateway: what the engine sampled, and its logprobs."""
    path = save_checkpoint(models[0], tmp_path / "w.pt")  # every engine serves known weights
    assert broadcast(gw, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "tok"})[1][
        "ok"
    ]
    with openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=60) as client:
        r = client.completions.create(model="tiny", prompt=[1, 72, 105], max_tokens=12, logprobs=0, seed=4,
                                      extra_body={"return_token_ids": True, "trajectory_id": "sky-tok"})  # fmt: skip
    c = r.choices[0]
    assert c.prompt_token_ids == [1, 72, 105] and decode(c.token_ids) == c.text
    assert_close(c.logprobs.token_logprobs, reference_logprobs(models[0], [1, 72, 105], c.token_ids))
    assert r.model_extra["weight_version"] == "tok"
    assert gw.get("/sessions/sky-tok")[1]["turns"][0]["context_tokens"] == 3

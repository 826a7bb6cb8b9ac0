"""slime, SkyRL and verl against Libra, unchanged: each framework's own client code against the
gateway (two engines in two buckets) and the actions service, real processes on loopback.

- SkyRL: its `RemoteInferenceClient` as PyPI's `skyrl` 0.3.0 ships it (installed without its
  dependencies; two package `__init__`s that fail on Python 3.11 are skipped, see `skyrl_client`),
  with `proxy_url` and `server_urls` set to the gateway.
- slime (not on PyPI) and verl (PyPI's 0.9.1 pulls transformers, fastapi and more into its client's
  import chain): their code is followed call for call, each request quoting the file and function
  it reproduces (slime 624b824, verl 0.9.1 with b178a3c's differences noted).
- Weight sync: the trainer is a second process (`tests/framework_trainer.py`) that joins through
  torch.distributed's own calls, as slime's trainer does.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import time
import types
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from libra.integrations import verl as libra_verl
from libra.integrations.verl import LibraLoadBalancer
from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.model import build_model, save_checkpoint
from libra.runtime.engine.tokenizer import decode, encode, render_prompt
from libra.runtime.sandbox.client import ServiceProcess
from tests.engine_fixtures import start_engine
from tests.test_actions_service import sandbox_available, unavailable
from tests.test_engine_control import free_port
from tests.test_engine_tokens import assert_close, reference_logprobs
from tests.test_gateway_fixtures import backend_arg, start_gateway

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "fw-admin"
# SkyRL's own client reads aiohttp's deprecated `session.loop`; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:client.loop property is deprecated:DeprecationWarning")


@dataclass
class Stack:
    gw: object
    engines: dict  # bucket name -> EngineProcess
    actions: ServiceProcess | None
    log_dir: Path
    trainer: Trainer

    @property
    def url(self) -> str:
        return self.gw.url


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("frameworks")
    stops: list = []  # every service started, stopped together at the end (each waits for its exit)
    with ThreadPoolExecutor(3) as pool:
        try:
            trainer = Trainer()  # imports torch while the services start
            stops.append(trainer.quit)
            starting = [pool.submit(start_engine, "--tp-label", tp, log_dir=log_dir) for tp in ("tp1", "tp2")]
            acts = pool.submit(start_actions, log_dir) if sandbox_available() is None else None
            short, long = (started(f, stops, lambda e: e.stop) for f in starting)
            actions = started(acts, stops, lambda a: lambda: a.__exit__(None, None, None)) if acts else None
            gw = started(pool.submit(start_gateway, *backend_arg(short.url, "short", 1, 4096, name="e0"),
                                     *backend_arg(long.url, "long", 2, 8192, name="e1"),
                                     "--set", "health.interval_s=0.5", log_dir=log_dir), stops, lambda g: g.stop)  # fmt: skip
            trainer.expect("ready")
            yield Stack(gw, {"short": short, "long": long}, actions, log_dir, trainer)
        finally:
            http.close()  # its keep-alive connections would hold the servers' shutdown
            with ThreadPoolExecutor(len(stops) or 1) as stopping:  # the gateway first, then the rest at once
                list(stopping.map(lambda stop: stop(), reversed(stops)))


def start_actions(log_dir: Path) -> ServiceProcess:
    cfg = log_dir / "actions.json"
    cfg.write_text(json.dumps({"warm_pool": 1, "sandbox": {"uid_count": 16}}))
    return ServiceProcess(str(cfg)).__enter__()


def started(fut, stops: list, stopper):
    """A service started in the pool, and how to stop it (even if another one failed to start)."""
    proc = fut.result()
    stops.append(stopper(proc))
    return proc


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {seed: build_model(EngineConfig().preset, seed=seed) for seed in (0, 5, 7)}


http = httpx.Client(timeout=120.0)


def sessions(stack, sid: str) -> tuple[int, dict]:
    r = http.get(f"{stack.url}/sessions/{sid}")
    return r.status_code, r.json()


class Trainer:
    """`tests/framework_trainer.py`, one process for the module: rank 0 of each group in turn."""

    def __init__(self):
        cmd = [sys.executable, "-m", "tests.framework_trainer"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip

    def expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()
        assert line == word, f"trainer said {line!r}, exit code {self.proc.poll()}"

    def command(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def leave(self) -> None:
        self.command("leave")
        self.expect("left")

    def quit(self) -> None:
        if self.proc.poll() is None:
            self.command("quit")
            self.proc.wait(timeout=60)


def while_trainer(call, trainer: Trainer, line: str, word: str):
    """Send an HTTP call from a thread (as slime's Ray calls and SkyRL's tasks run beside the
    trainer's collective) while the trainer does its side; the call's result."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(call)
        trainer.command(line)
        trainer.expect(word)
        return fut.result(timeout=120)


def manifest(seed: int, models) -> dict:
    """names/dtypes/shapes as slime's `update_weights_from_distributed` sends them
    (dtypes as str(dtype) without "torch.")."""
    state = models[seed].state_dict()
    return {"names": list(state), "dtypes": [str(t.dtype).replace("torch.", "") for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()]}  # fmt: skip


def greedy_matches(stack, model, prompt: list[int]) -> str:
    """A greedy /generate through the gateway scores like `model` (the weights it now serves)."""
    res = http.post(stack.url + "/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()  # fmt: skip
    assert_close([e[0] for e in res["meta_info"]["output_token_logprobs"]], reference_logprobs(model, prompt, res["output_ids"]))  # fmt: skip
    return res["meta_info"]["weight_version"]


# ---- slime (THUDM/slime 624b824), followed call for call ------------------------------------------


def slime_generate(url: str, prompt_ids: list[int], max_new_tokens: int = 8, headers: dict | None = None) -> tuple[dict, dict]:  # fmt: skip
    """slime/rollout/sglang_rollout.py `generate`: POST router/generate with `input_ids`,
    `return_logprob`, no header unless the router policy is consistent_hashing; the response's
    tokens are read from meta_info.output_token_logprobs."""
    payload = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1},
               "return_logprob": True, "input_ids": prompt_ids}  # fmt: skip
    r = http.post(url + "/generate", json=payload, headers=headers)
    r.raise_for_status()
    return r.json(), dict(r.headers)


def busy(stack) -> int:
    return sum(e.get("/health")["running"] for e in stack.engines.values())


def slime_num_requests(load) -> int:
    """slime/backends/sglang_utils/server_control.py `num_requests_from_load`."""
    if isinstance(load, list):
        return sum(slime_num_requests(x) for x in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return slime_num_requests(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    return (load.get("num_running_reqs") or 0) + (load.get("num_waiting_reqs") or 0)


def test_slime_external_engine_rollout_and_abort(stack):
    gw = stack.url
    # slime/backends/sglang_utils/external.py `discover_external_engines`: the gateway given as the
    # one external engine; get_server_info tries /server_info first
    info = http.get(gw + "/server_info").json()
    tp = int(info.get("tp_size") or info.get("tensor_parallel_size") or 1)
    num_gpus = int(info.get("num_gpus") or info.get("num_gpus_per_engine") or tp)
    assert num_gpus == 2 and info.get("disaggregation_mode") not in ("prefill", "decode")
    assert (
        info.get("enable_memory_saver") is False
    )  # sglang_engine.py `_init_external`'s check (offload_rollout off)
    # sglang_engine.py `_register_to_router`: POST router/workers, raise_for_status
    http.post(gw + "/workers", json={"url": gw, "worker_type": "regular"}).raise_for_status()
    # sglang_engine.py `_wait_server_healthy` / `health_generate`
    http.get(gw + "/health_generate", timeout=30).raise_for_status()
    # a rollout: sglang_rollout.py `generate`
    prompt = render_prompt("slime rollout")
    out, headers = slime_generate(gw, prompt)
    tokens = [item[1] for item in out["meta_info"]["output_token_logprobs"]]
    assert tokens == out["output_ids"] and len(tokens) >= 1 and isinstance(out["text"], str)
    # abort while requests run: sglang_rollout.py `abort` -> GET router/workers, then
    # server_control.py `abort_servers_until_idle` on each worker URL
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(slime_generate, gw, render_prompt(f"long {i}"), 4000) for i in range(2)]
        deadline = time.monotonic() + 60
        while busy(stack) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy(stack) == 2
        urls = [w["url"] for w in http.get(gw + "/workers").json()["workers"]]
        assert sorted(urls) == sorted(e.url for e in stack.engines.values())
        for url in urls:
            http.post(url + "/abort_request", json={"abort_all": True})  # `_abort_server_once`
            assert slime_num_requests(http.get(url + "/v1/loads?include=core").json()) == 0
        for fut in running:  # each comes back with what it had
            assert fut.result(timeout=60)[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert slime_num_requests(http.get(gw + "/v1/loads").json()) == 0


def test_slime_registration_and_its_bad_input(stack):
    gw, eng = stack.url, stack.engines["long"]
    # sglang_engine.py `shutdown`: GET router/workers, find its URL, DELETE router/workers/{id}
    workers = http.get(gw + "/workers").json()["workers"]
    wid = next(w["id"] for w in workers if w["url"] == eng.url)
    http.delete(f"{gw}/workers/{wid}").raise_for_status()
    assert eng.url not in [w["url"] for w in http.get(gw + "/workers").json()["workers"]]
    # sglang_engine.py `_register_to_router`: the engine registers itself; it lands in its bucket
    http.post(gw + "/workers", json={"url": eng.url, "worker_type": "regular"}).raise_for_status()
    (back,) = [w for w in http.get(gw + "/workers").json()["workers"] if w["url"] == eng.url]
    assert back["bucket"] == "long" and back["is_healthy"]
    # bad input: a 4xx naming the field, and the gateway keeps serving
    for body, status, param in [
        ({"url": eng.url, "worker_type": "regular"}, 409, "url"),  # a second registration
        ({"url": f"http://127.0.0.1:{free_port()}"}, 400, "url"),  # nobody answers there
        ({"url": "not a url"}, 400, "url"),
        ({"url": eng.url, "worker_type": "prefill"}, 400, "worker_type"),
    ]:
        r = http.post(gw + "/workers", json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
    assert http.delete(gw + "/workers/nobody").json()["error"]["param"] == "worker_id"
    assert (
        slime_generate(gw, render_prompt("still serving"))[0]["meta_info"]["finish_reason"]["type"]
        == "length"
    )


def test_slime_update_weights_distributed_and_from_disk(stack, models, tmp_path):
    gw = stack.url
    # update_weight_from_distributed.py `connect_rollout_engines_from_distributed`: world size from
    # the engines' GPU counts (external.py: /server_info num_gpus) + 1 for the trainer's rank 0
    world = int(http.get(gw + "/server_info").json()["num_gpus"]) + 1
    port, group, trainer = free_port(), "slime-pp_0", stack.trainer
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world, "group_name": group, "backend": "gloo"}  # fmt: skip
    # slime posts the engines' init first, then its trainer joins: each waits for the other
    answer = while_trainer(lambda: http.post(gw + "/init_weights_update_group", json=init), trainer, f"join {port} {world} {group}", "joined")  # fmt: skip
    try:
        answer.raise_for_status()
        # `UpdateWeightFromDistributed.update_weights`: pause, flush (GET, as `flush_cache` sends it)
        http.post(gw + "/pause_generation", json={}).raise_for_status()
        assert http.get(gw + "/flush_cache").status_code == 200  # slime retries 60 times a second apart
        body = {**manifest(5, models), "group_name": group, "flush_cache": False, "weight_version": "1"}
        r = while_trainer(lambda: http.post(gw + "/update_weights_from_distributed", json=body), trainer, "send 5", "done")  # fmt: skip
        assert r.status_code == 200 and r.json()["success"] is True
        http.post(gw + "/continue_generation", json={}).raise_for_status()
        # sglang_engine.py `get_weight_version`: response.json()["weight_version"]
        assert http.get(gw + "/get_weight_version").json()["weight_version"] == "1"
        assert greedy_matches(stack, models[5], [4, 2]) == "1"
    finally:  # `disconnect_rollout_engines_from_distributed`
        http.post(gw + "/destroy_weights_update_group", json={"group_name": group}).raise_for_status()
        trainer.leave()
    # actor_group.py `_reload_rollout_weights_from_disk`: pause, flush, update_weights_from_disk, continue
    path = save_checkpoint(models[7], tmp_path / "weight_v000002.pt")
    http.post(gw + "/pause_generation", json={}).raise_for_status()
    assert http.get(gw + "/flush_cache").status_code == 200
    http.post(
        gw + "/update_weights_from_disk", json={"model_path": str(path), "weight_version": "2"}
    ).raise_for_status()
    assert http.get(gw + "/get_weight_version").json()["weight_version"] == "2"
    http.post(gw + "/continue_generation", json={}).raise_for_status()
    assert greedy_matches(stack, models[7], [4, 2]) == "2"
    # sglang_engine.py `release_memory_occupation` (flush, then release) and `resume_memory_occupation`
    assert http.get(gw + "/flush_cache").status_code == 200
    http.post(gw + "/release_memory_occupation", json={}).raise_for_status()
    assert http.get(gw + "/is_sleeping").json()["is_sleeping"] is True
    http.post(gw + "/resume_memory_occupation", json={"tags": None}).raise_for_status()
    assert greedy_matches(stack, models[7], [9]) == "2"


def test_keyless_turns_follow_their_prefix_and_a_key_wins(stack):
    """slime sends no session key unless its router policy is consistent_hashing. A keyless turn
    that extends an earlier turn's prompt and response stays where that turn ran, although C-MLFQ
    starts every new trajectory in the smallest bucket; a GRPO sibling (same prompt) does not
    follow; a session key wins."""
    gw = stack.url
    short_id = next(w["id"] for w in http.get(gw + "/workers").json()["workers"] if w["bucket"] == "short")
    http.post(f"{gw}/admin/instances/{short_id}/drain").raise_for_status()
    try:
        prompt = render_prompt("solve it step by step")
        out, headers = slime_generate(gw, prompt)  # only the long bucket takes turns now
        assert headers["x-libra-bucket"] == "long"
    finally:
        http.post(f"{gw}/admin/instances/{short_id}/resume").raise_for_status()
    turn2 = prompt + out["output_ids"] + encode("\ntool: 42\n")
    assert slime_generate(gw, turn2)[1]["x-libra-bucket"] == "long"  # follows its prefix
    assert slime_generate(gw, prompt)[1]["x-libra-bucket"] == "short"  # a sibling starts fresh
    assert slime_generate(gw, turn2, headers={"X-SMG-Routing-Key": "keyed"})[1]["x-libra-bucket"] == "short"
    # the same with chat: the next turn resends the assistant's reply and a tool message
    msgs = [{"role": "user", "content": "hello there, what is 6 * 7?"}]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    http.post(f"{gw}/admin/instances/{short_id}/drain").raise_for_status()
    try:
        r = http.post(
            gw + "/v1/chat/completions",
            json={"model": "tiny", "messages": msgs, "tools": tools, "max_tokens": 64},
        )
        assert r.headers["x-libra-bucket"] == "long"
    finally:
        http.post(f"{gw}/admin/instances/{short_id}/resume").raise_for_status()
    reply = r.json()["choices"][0]["message"]
    msgs += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "42"}]
    r = http.post(
        gw + "/v1/chat/completions",
        json={"model": "tiny", "messages": msgs, "tools": tools, "max_tokens": 64},
    )
    assert r.status_code == 200 and r.headers["x-libra-bucket"] == "long"


# ---- SkyRL: the real client from PyPI's skyrl 0.3.0 ---------------------------------------------------


def skyrl_client():
    """skyrl 0.3.0's RemoteInferenceClient and BroadcastInitInfo, unchanged. Importing them runs
    `skyrl/backends/__init__.py` (Tinker's pydantic types: a typing.TypedDict that pydantic refuses
    below Python 3.12) and `weight_sync/__init__.py` (the CUDA IPC strategy: loguru, training
    utilities); neither is the client, so those two packages are entered without their __init__."""
    spec = importlib.util.find_spec("skyrl")
    if spec is None:
        unavailable("skyrl==0.3.0 is not installed (make: pip install --no-deps skyrl==0.3.0)")
    root = spec.submodule_search_locations[0]
    for name, sub in (("skyrl.backends", "backends"), ("skyrl.backends.skyrl_train.weight_sync", "backends/skyrl_train/weight_sync")):  # fmt: skip
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(root, sub)]
            sys.modules[name] = pkg
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from skyrl.backends.skyrl_train.weight_sync.broadcast_strategy import BroadcastInitInfo

    return RemoteInferenceClient, BroadcastInitInfo


def skyrl_sampling_params(max_generate_length: int) -> dict:
    """skyrl/backends/skyrl_train/inference_servers/engine_utils.py `get_vllm_sampling_params` on
    SkyRL's default SamplingParams (temperature 1, top_p 1, top_k -1, min_p 0, logprobs 1), with
    the generation length a config sets."""
    return {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
            "max_tokens": max_generate_length, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "logprobs": 1, "stop": None}  # fmt: skip


def test_skyrl_generate_sample_completion_chat_and_finish(stack):
    Client, _ = skyrl_client()
    client = Client(proxy_url=stack.url, server_urls=[stack.url], data_parallel_size=1, model_name="tiny")

    async def main():
        try:
            prompts = [render_prompt("SkyRL one"), render_prompt("SkyRL two")]
            out = await client.generate({"prompt_token_ids": prompts, "sampling_params": skyrl_sampling_params(8), "session_ids": ["sk-0", "sk-1"]})  # fmt: skip
            assert [len(r) for r in out["response_logprobs"]] == [len(r) for r in out["response_ids"]]
            assert all(r for r in out["response_ids"]) and out["responses"] == [
                decode(r) for r in out["response_ids"]
            ]
            assert sessions(stack, "sk-0")[1]["turns"][0]["context_tokens"] == len(prompts[0])
            await client.finish_session("sk-0")  # ends the gateway's session at once (not after 600 s idle)
            assert sessions(stack, "sk-0")[0] == 404 and sessions(stack, "sk-1")[0] == 200
            tinker = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": prompts[1]}]}, "num_samples": 2,
                      "sampling_params": {"temperature": 1.0, "max_tokens": 6, "seed": 3}, "session_id": "tk-1"}  # fmt: skip
            sample = await client.sample({"json": tinker})
            assert sample["type"] == "sample" and len(sample["sequences"]) == 2
            assert all(len(s["tokens"]) == len(s["logprobs"]) for s in sample["sequences"])
            comp = await client.completion(
                {"json": {"prompt": "Once", "max_tokens": 6, "session_id": "cp-1"}}
            )
            chat = await client.chat_completion({"json": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "session_id": "ch-1"}})  # fmt: skip
            assert (
                comp["choices"][0]["text"] is not None
                and chat["choices"][0]["message"]["role"] == "assistant"
            )
            assert sessions(stack, "cp-1")[0] == 200 and sessions(stack, "ch-1")[0] == 200
            assert await client.get_world_size() == (2, 2)
        finally:
            await client.teardown()

    asyncio.run(main())


def test_skyrl_sleep_wake_and_weight_sync_packed_and_not(stack, models):
    Client, BroadcastInitInfo = skyrl_client()
    client = Client(proxy_url=stack.url, server_urls=[stack.url], data_parallel_size=1, model_name="tiny")
    port, trainer = free_port(), stack.trainer
    loop = asyncio.new_event_loop()

    def run(coro):
        return loop.run_until_complete(coro)

    try:
        # colocated SkyRL: sleep (level 2 by default) frees the weights, wake weights, sync, wake KV
        run(client.pause())  # keep mode
        run(client.sleep())
        health = [e.get("/health") for e in stack.engines.values()]
        assert all(h["sleeping"] for h in health)
        run(client.wake_up(tags=["weights"]))
        _, per_server = run(client.get_world_size())
        init = BroadcastInitInfo(master_addr="127.0.0.1", master_port=port, rank_offset=1, world_size=per_server + 1, override_existing_receiver=True)  # fmt: skip
        world = init.world_size
        while_trainer(lambda: asyncio.run(_fresh(stack, Client).init_weight_update_communicator(init)), trainer, f"join {port} {world} weight_update_group", "joined")  # fmt: skip
        # unpacked: `update_named_weights` (vLLM's /update_weights)
        m = manifest(5, models)
        info = {"names": m["names"], "dtype_names": m["dtypes"], "shapes": m["shapes"], "packed": False}
        answers = while_trainer(lambda: asyncio.run(_fresh(stack, Client).update_named_weights(info)), trainer, "send 5", "done")  # fmt: skip
        assert list(answers) == [stack.url] and answers[stack.url]["status"] == 200
        run(client.wake_up(tags=["kv_cache"]))
        run(client.resume())
        assert greedy_matches(stack, models[5], [3, 1]) is not None
        # packed, as `BroadcastWeightTransferSender.send_chunks` drives it: start, update_weights_nccl
        # with packed=True beside the trainer's packed broadcast, finish
        m = manifest(7, models)
        info = {"names": m["names"], "dtype_names": m["dtypes"], "shapes": m["shapes"], "packed": True, "packed_buffer_size_bytes": 4096}  # fmt: skip
        run(client.pause())
        run(client.start_weight_update(is_checkpoint_format=True))
        while_trainer(lambda: asyncio.run(_fresh(stack, Client).update_weights_nccl(info)), trainer, "send-packed 7 4096", "done")  # fmt: skip
        run(client.finish_weight_update())
        run(client.resume())
        assert greedy_matches(stack, models[7], [3, 1]) is not None
    finally:
        run(client.teardown())
        loop.close()
        for e in stack.engines.values():  # vLLM has no call to leave the group; the engines' SGLang one
            http.post(e.url + "/destroy_weights_update_group", json={"group_name": "weight_update_group"})
        trainer.leave()


def _fresh(stack, Client):
    """A client for a call made from another thread's event loop (SkyRL's clients are picklable and
    rebuilt per process/loop the same way)."""
    return Client(proxy_url=stack.url, server_urls=[stack.url], data_parallel_size=1)


# ---- verl: its server client, followed call for call, through the adapter ----------------------------


class RayActorStandIn:
    """verl's client calls its load balancer as a Ray actor: `await lb.method.remote(...)`. Ray's
    transport is not what is tested here, so calls run in process; what crosses Ray (the handle the
    balancer returns) is pickled both ways as Ray would."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        fn = getattr(self.obj, name)

        async def call(*args, **kwargs):
            return pickle.loads(pickle.dumps(fn(*args, **kwargs)))

        return types.SimpleNamespace(remote=call)


async def verl_generate(lb, request_id: str, prompt_ids: list[int], sampling_params: dict):
    """verl 0.9.1 verl/workers/rollout/llm_server.py `LLMServerClient.generate`: acquire a server for
    the trajectory's request_id, call it with a fresh uuid4 per turn, release it. (b178a3c's
    `AsyncLLMServerManager.generate` is the same call after its own `_choose_server(request_id)`.)"""
    acquire, release = await asyncio.gather(
        lb.require_acquire_fields.remote(), lb.require_release_fields.remote()
    )
    extra = {"prompt_ids": prompt_ids, "sampling_params": sampling_params}
    server_id, server = await lb.acquire_server.remote(
        request_id=request_id, **{k: extra[k] for k in acquire if k in extra}
    )
    try:
        return await server.generate.remote(request_id=uuid.uuid4().hex, prompt_ids=prompt_ids,
                                            sampling_params=sampling_params, image_data=None, video_data=None)  # fmt: skip
    finally:
        await lb.release_server.remote(server_id=server_id, **({"request_id": request_id} if "request_id" in release else {}))  # fmt: skip


def verl_sandbox_call(url: str, code: str) -> dict:
    """verl/utils/reward_score/sandbox_fusion/utils.py `call_sandbox_api`'s payload to /run_code."""
    payload = {"compile_timeout": 10, "run_timeout": 10, "code": code, "stdin": "", "memory_limit_MB": 1024,
               "language": "python", "files": {}, "fetch_files": []}  # fmt: skip
    r = http.post(url + "/run_code", content=json.dumps(payload), headers={"Content-Type": "application/json", "Accept": "application/json"})  # fmt: skip
    r.raise_for_status()
    return r.json()


def test_verl_multi_turn_agent_loop_one_session_per_trajectory(stack):
    unavailable(sandbox_available())
    lb = RayActorStandIn(
        LibraLoadBalancer({}, {"gateway_url": stack.url, "response_length": 8, "prompt_length": 512})
    )
    # AgentLoopWorker.generate_sequences' sampling params (calculate_log_probs on)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def trajectory(i: int) -> tuple[str, int]:
        # tool_agent_loop.py `ToolAgentLoop.run`: one request_id for the whole trajectory
        request_id = uuid.uuid4().hex
        prompt_ids = render_prompt(f"user: compute {i} + {i}\nassistant:")
        for turn in range(3):
            out = await verl_generate(lb, request_id, prompt_ids, dict(sampling))
            assert out.stop_reason == "completed" and len(out.log_probs) == len(out.token_ids) >= 1
            tool = await asyncio.to_thread(verl_sandbox_call, stack.actions.url, f"print({i} + {i} + {turn})")
            assert tool["status"] == "Success" and tool["run_result"]["stdout"].strip() == str(2 * i + turn)
            # the next prompt: prompt + response + the tool's answer (response_mask 0)
            prompt_ids = prompt_ids + out.token_ids + encode(f"\ntool: {tool['run_result']['stdout']}")
        return request_id, len(prompt_ids)

    async def main():
        try:
            return await asyncio.gather(*(trajectory(i) for i in range(2)))
        finally:
            await libra_verl.aclose()

    done = asyncio.run(main())
    for request_id, _ in done:
        status, s = sessions(stack, request_id)
        assert status == 200 and len(s["turns"]) == 3  # one gateway session per trajectory, every turn in it
    assert len({rid for rid, _ in done}) == 2


def test_sleep_level_2_serves_nothing_until_every_weight_is_back(stack, models, tmp_path):
    """vLLM's level 2 (SkyRL's default sleep) discards the weights: a request that arrives after
    the wake-up is held, not served from discarded weights, until an update brings them all back."""
    e = stack.engines["short"]
    assert http.post(e.url + "/sleep?level=2").status_code == 200
    assert http.post(e.url + "/wake_up").status_code == 200 and e.get("/health")["sleeping"] is False
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(http.post, e.url + "/generate", json={"input_ids": [4, 2], "return_logprob": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}})  # fmt: skip
        deadline = time.monotonic() + 30
        while e.get("/health")["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.get("/health")["waiting"] == 1 and not held.done()
        path = save_checkpoint(models[0], tmp_path / "back.pt")
        r = http.post(
            e.url + "/update_weights_from_disk", json={"model_path": str(path), "weight_version": "9"}
        )
        assert r.json()["weights_missing"] == 0 and r.json()["released"] == 1
        out = held.result(timeout=60).json()
    assert out["meta_info"]["weight_version"] == "9"
    assert_close([x[0] for x in out["meta_info"]["output_token_logprobs"]], reference_logprobs(models[0], [4, 2], out["output_ids"]))  # fmt: skip


# ---- bad input and the admin token ----------------------------------------------------------------------


def test_bad_group_and_rpc_input_is_a_4xx_or_a_bounded_timeout_and_serving_continues(stack):
    gw = stack.url
    base = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "group_name": "bad"}
    r = http.post(gw + "/init_weights_update_group", json={**base, "world_size": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "world_size"
    # a rank that never joins (no trainer at rank 0): each engine gives up after timeout_s
    t0 = time.monotonic()
    r = http.post(gw + "/init_weights_update_group", json={**base, "world_size": 3, "timeout_s": 1})
    assert r.status_code == 400 and all(
        "could not join group" in a["message"] for a in r.json()["results"].values()
    )
    assert time.monotonic() - t0 < 60  # bounded (by timeout_s), not a hang
    r = http.post(
        gw + "/collective_rpc", json={"method": "update_weights_nccl", "kwargs": {"update_info": {}}}
    )
    assert r.status_code == 400  # no update started
    r = http.post(gw + "/collective_rpc", json={"method": "update_weights_ipc", "kwargs": {}})
    assert r.status_code == 400 and all(a["param"] == "method" for a in r.json()["engines"].values())
    r = http.post(gw + "/inference/v1/generate", json={"token_ids": [1, 10**6], "sampling_params": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids"
    r = http.post(gw + "/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"min_tokens": 9, "max_tokens": 2}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.min_tokens"
    assert http.post(gw + "/sleep?level=3").json()["error"]["param"] == "level"
    # serving continues
    ok = http.post(gw + "/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 3, "min_tokens": 3}})  # fmt: skip
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3


def test_new_state_changing_endpoints_need_the_admin_token(stack):
    e = stack.engines["short"]
    gw = start_gateway(*backend_arg(e.url, "short", 1, 4096, name="e0"), "--set", f"admin_token={TOKEN}", log_dir=stack.log_dir)  # fmt: skip
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        calls = [("POST", "/workers", {"url": e.url}), ("DELETE", "/workers/e0", None),
                 ("POST", "/finish_session?session_id=x", None), ("GET", "/get_world_size", None),
                 ("POST", "/collective_rpc", {"method": "skyrl_finish_weight_update"}), ("GET", "/flush_cache", None)]  # fmt: skip
        for method, path, body in calls:
            r = http.request(method, gw.url + path, json=body)
            assert r.status_code == 401 and r.json()["error"]["param"] == "Authorization", path
        assert http.post(gw.url + "/finish_session?session_id=x", headers=auth).json()["finished"] is False
        assert http.get(gw.url + "/get_world_size", headers=auth).json()["world_size"] == 1
        assert http.get(gw.url + "/workers").status_code == 200  # reading is open
    finally:
        gw.stop()

"""The built-in engine profiled through its real HTTP server, in CPU seconds of its process.

`libra costmodel profile --model builtin-M --device cpu` times `EngineCore.step` in process; a live
`libra train` engine also parses each request, renders its chat template, carries every token
across threads to its response (with its logprob and token id) and loads each step's weights.
This starts a real `libra serve engine` on loopback, with the arguments `libra train` starts it
with, and drives it as the train driver does through the gateway: the calculator task's
trajectories (ask with the `calc` tool; the tool's answer, computed here; ask again), each turn
a non-streamed chat request with `logprobs` and `return_token_ids`, a batch of trajectories at
once. Each workload records the engine process's CPU seconds (`libra_engine_process_cpu_seconds`,
the process's CPU clock: /proc/PID/stat counts in 10 ms ticks), the engine thread's CPU seconds
inside steps (`libra_engine_step_cpu_seconds`) and every turn's
(prompt, sampled) tokens, so `libra costmodel calibrate --serving-data` can price the same turns
with the fitted step terms and fit what is left per request and per token. Weight updates are
timed the way `libra train` publishes (pause, `/update_weights_from_disk`, continue).

Needs the `serve` extra (aiohttp).
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import aiohttp

from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.server import write_checkpoint
from libra.runtime.launch.base import LISTENING, wait_for_line
from libra.runtime.launch.local import LocalHandle
from libra.runtime.profiler import STEP_KEYS, write_jsonl
from libra.runtime.train.cluster import MODEL_NAME, engine_specs
from libra.runtime.train.config import load_train_config
from libra.runtime.train.task import TOOL_SCHEMA, ProblemStream, evaluate

# (trajectories at once, max_tokens of a turn): the live default runs up to 32 at once on each of
# its two engines with max_tokens 64; fewer tokens a turn tell the per-request cost from the
# per-token one.
SERVING_GRID = ((1, 64), (4, 64), (16, 64), (32, 64), (48, 64), (4, 12), (16, 12), (32, 12), (32, 24))
SERVING_QUICK = ((2, 12), (4, 32))
REPEATS = 2
WEIGHT_LOADS = 6
_CPU = re.compile(rb"^libra_engine_(step_cpu_seconds_total|process_cpu_seconds) ([0-9.eE+-]+)$", re.M)


class ServingProbe:
    """One live engine and a client that drives it (module docstring)."""

    def __init__(self, url: str, http: aiohttp.ClientSession, token: str | None):
        self.url, self.http = url, http
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.problems = ProblemStream(7)

    async def cpu_s(self) -> tuple[float, float]:
        """(the engine process's CPU seconds, its engine thread's in steps) so far."""
        async with self.http.get(self.url + "/metrics") as r:
            found = {k: float(v) for k, v in _CPU.findall(await r.read())}
        return found[b"process_cpu_seconds"], found[b"step_cpu_seconds_total"]

    async def _turn(self, messages: list[dict], max_tokens: int) -> dict:
        body = {"model": MODEL_NAME, "messages": messages, "tools": [TOOL_SCHEMA], "temperature": 1.0,
                "top_p": 1.0, "max_tokens": max_tokens, "logprobs": True, "return_token_ids": True}  # fmt: skip
        async with self.http.post(self.url + "/v1/chat/completions", json=body) as r:
            data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"engine answered HTTP {r.status}: {json.dumps(data)[:300]}")
        return data

    async def trajectory(self, max_tokens: int) -> list[list[int]]:
        """One calculator episode; its turns as [prompt tokens, sampled tokens]."""
        messages, turns = self.problems.next().messages(), []
        for _ in range(2):
            data = await self._turn(messages, max_tokens)
            choice = data["choices"][0]
            turns.append([len(data["prompt_token_ids"]), len(choice["token_ids"])])
            calls = (choice.get("message") or {}).get("tool_calls")
            if not calls:
                break
            call = calls[0]
            try:
                result = evaluate(json.loads(call["function"]["arguments"])["expr"])
            except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError):
                result = "error"  # the model wrote arguments that are not an expression
            messages = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": result}]  # fmt: skip
        return turns

    async def chat_workload(self, n: int, max_tokens: int) -> dict:
        (cpu0, step0), t0 = await self.cpu_s(), time.monotonic()
        trajs = await asyncio.gather(*(self.trajectory(max_tokens) for _ in range(n)))
        wall, (cpu, step) = time.monotonic() - t0, await self.cpu_s()
        return {"kind": "chat", "max_tokens": max_tokens, "trajectories": trajs, "cpu_s": cpu - cpu0,
                "step_cpu_s": step - step0, "wall_s": wall}  # fmt: skip

    async def _control(self, path: str, body: dict) -> None:
        async with self.http.post(self.url + path, json=body, headers=self.headers) as r:
            data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"engine {path}: HTTP {r.status}: {json.dumps(data)[:300]}")

    async def weight_loads(self, checkpoint: Path, loads: int, pause_mode: str) -> dict:
        (cpu0, _), t0 = await self.cpu_s(), time.monotonic()
        for v in range(loads):
            await self._control("/pause_generation", {"mode": pause_mode})
            await self._control("/update_weights_from_disk", {"model_path": str(checkpoint), "weight_version": str(v + 1)})  # fmt: skip
            await self._control("/continue_generation", {})
        wall, (cpu, _) = time.monotonic() - t0, await self.cpu_s()
        return {"kind": "weights", "loads": loads, "cpu_s": cpu - cpu0, "wall_s": wall}


def profile_builtin_serving(model: str, out: Path, threads: int = 1, quick: bool = False) -> Path:
    """Start the engine as `libra train` does, drive it, write OUT/builtin-MODEL-serving.jsonl
    (the JSONL `libra costmodel calibrate --serving-data` reads)."""
    cfg = load_train_config(None, [f"engine.model={model}", f"engine.threads={threads}"])
    with tempfile.TemporaryDirectory() as tmp:
        spec, _ = engine_specs(cfg, Path(tmp))[0]
        steps_log = Path(tmp) / "steps.jsonl"
        spec = replace(spec, args=(*spec.args, "--step-log", str(steps_log)))
        ckpt, _ = write_checkpoint(EngineConfig(model=model, seed=cfg.seed + 1), str(Path(tmp) / "model.pt"))
        handle = LocalHandle(spec)
        try:
            url = wait_for_line(handle, LISTENING, 120.0).group(1)
            rows = asyncio.run(_drive(url, ckpt, cfg.publish.pause_mode, quick))
        finally:
            handle.stop()
        served = [
            {**STEP_KEYS, "model": f"builtin-{model}", **json.loads(x)}
            for x in steps_log.read_text().splitlines()
        ]
    write_jsonl(out / f"builtin-{model}-served-steps.jsonl", served)
    common = {"hardware": "cpu-host", "model": f"builtin-{model}", "engine": "libra-builtin",
              "max_num_seqs": cfg.engine.max_num_seqs, "kv_cache_mb": cfg.engine.kv_cache_mb}  # fmt: skip
    return write_jsonl(out / f"builtin-{model}-serving.jsonl", [{**common, **r} for r in rows])


async def _drive(url: str, checkpoint: Path, pause_mode: str, quick: bool) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        probe = ServingProbe(url, http, None)
        await probe.chat_workload(2, 16)  # warms torch and the server up
        rows = [await probe.weight_loads(checkpoint, 2 if quick else WEIGHT_LOADS, pause_mode)]
        for _ in range(1 if quick else REPEATS):
            for n, max_tokens in SERVING_QUICK if quick else SERVING_GRID:
                rows.append(await probe.chat_workload(n, max_tokens))
    return rows

"""The engine's HTTP front: the OpenAI API over aiohttp, `/health` and Prometheus `/metrics`.

Each request becomes one or more `Sequence`s handed to the engine thread, plus an asyncio queue
(its sink) that the engine's per-step `publish` fills through `call_soon_threadsafe`. A handler
only waits on its queue, so thousands of open requests cost no threads. Streaming handlers drain
everything queued before writing, so a slow client gets fewer, larger chunks instead of falling
behind. A client that disconnects cancels its handler (aiohttp's handler cancellation), and the
handler's `finally` aborts its sequences, which frees their KV blocks at the next step.

Every error is JSON in OpenAI's shape: 400 for bad fields, 404 for an unknown model or route,
413 for an oversize body, 503 for requests still running when a shutdown's grace period ends,
500 only for a bug (logged with its traceback).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from aiohttp import web

from libra.core.errors import ConfigError, LibraError
from libra.runtime.admin_guard import admin_middleware
from libra.runtime.engine import control
from libra.runtime.engine import protocol as p
from libra.runtime.engine.codec import BYTES, Codec
from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.core import EngineCore
from libra.runtime.engine.lm import load_lm
from libra.runtime.engine.metrics import EngineMetrics
from libra.runtime.engine.model import save_checkpoint
from libra.runtime.engine.native import GenerateFormat, GenerateRequest
from libra.runtime.engine.sequence import (
    HermesOutput,
    SamplingParams,
    SeqEvent,
    Sequence,
    TextOutput,
    ToolOutput,
)
from libra.runtime.engine.tokens_api import TokensFormat, TokensRequest, loads
from libra.runtime.http_limits import batch_size
from libra.runtime.openai_errors import ApiError, json_error, read_json_object
from libra.runtime.serving import limited_runner, serve_until_signalled

log = logging.getLogger("libra.engine")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# On SIGTERM, requests in flight get this long to finish; then they are failed with a 503.
DRAIN_SECONDS = 5.0
# How often a request waiting for its tokens checks that the engine thread is still alive.
ENGINE_CHECK_S = 5.0
# The shortest tool call plus this many tokens is the budget of a tool turn with no max_tokens.
TOOL_HEADROOM = 16
# SGLang's /health_generate waits this long for its one-token generation.
HEALTH_GENERATE_S = 20.0


@dataclass(slots=True, eq=False)
class Job:
    """One HTTP request in flight: its sequences report to `sink`."""

    rid: str
    sink: asyncio.Queue
    n: int
    done: bool = False


class ChatFormat:
    """Chunks and bodies of /v1/chat/completions."""

    object_chunk = "chat.completion.chunk"

    def __init__(self, rid: str, model: str, opts: p.ReplyOptions, prompts: list[list[int]], version: Callable[[], str], n: int = 1):  # fmt: skip
        self.rid, self.model, self.opts, self.prompts, self.version = rid, model, opts, prompts, version
        self.n = n  # choices per prompt: choice i answers prompt i // n
        self.created = int(time.time())
        self._prompt_sent: set[int] = set()

    def head(self, index: int) -> dict | None:
        chunk = self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})  # fmt: skip
        if self.opts.token_ids and not self._prompt_sent:  # vLLM: the first chunk only
            chunk["prompt_token_ids"] = self.prompts[0]
            self._prompt_sent.add(index)
        return chunk

    def chunk(self, ev: SeqEvent) -> dict | None:
        delta: dict = {}
        if ev.text:
            delta["content"] = ev.text
        if ev.tool_call:
            delta["tool_calls"] = [p.tool_call(ev.tool_call, ev.tool_args, index=0)]
        elif ev.tool_args:
            delta["tool_calls"] = [{"index": 0, "function": {"arguments": ev.tool_args}}]
        if not delta and not ev.finish and not self._has_extra(ev):
            return None  # e.g. bytes held back as a possible stop string: nothing to send yet
        lps = p.chat_logprobs(ev.logprobs, self.opts.as_ids) if self.opts.logprobs and ev.logprobs else None
        choice = {
            "index": ev.index,
            "delta": delta,
            "logprobs": lps,
            "finish_reason": ev.finish,
            **self._ids(ev),
        }
        return self._chunk(choice, ev)

    def chunks(self, events: list[SeqEvent], states: list[p.ChoiceState]) -> list[dict]:
        return [c for c in map(self.chunk, events) if c]

    def _has_extra(self, ev: SeqEvent) -> bool:
        return bool((self.opts.logprobs and ev.logprobs) or (self.opts.token_ids and ev.token_ids))

    def _ids(self, ev: SeqEvent) -> dict:
        if not self.opts.token_ids:
            return {}
        out: dict = {"token_ids": ev.token_ids}
        if len(set(ev.versions)) > 1:
            out["token_weight_versions"] = ev.versions
        return out

    def body(self, states: list[p.ChoiceState]) -> dict:
        version = p.last_version(states, self.version())
        return p.chat_body(self.rid, self.created, self.model, states, self.prompts[0], self.opts, version)

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._chunk({}), "choices": [], "usage": usage}

    def _chunk(self, choice: dict, ev: SeqEvent | None = None) -> dict:
        version = ev.versions[-1] if ev is not None and ev.versions else self.version()
        return {"id": self.rid, "object": self.object_chunk, "created": self.created, "model": self.model,
                "choices": [choice], "weight_version": version}  # fmt: skip


class CompletionFormat(ChatFormat):
    """Chunks and bodies of /v1/completions; `prompts[i]` is the prompt of choice i // n."""

    object_chunk = "text_completion"

    def head(self, index: int) -> dict | None:
        return None

    def chunk(self, ev: SeqEvent) -> dict | None:
        if not ev.text and not ev.finish and not self._has_extra(ev):
            return None
        lps = (
            p.completion_logprobs(ev.logprobs, self.opts.as_ids)
            if self.opts.logprobs and ev.logprobs
            else None
        )
        choice = {
            "index": ev.index,
            "text": ev.text,
            "logprobs": lps,
            "finish_reason": ev.finish,
            **self._ids(ev),
        }
        if self.opts.token_ids and ev.index not in self._prompt_sent:  # vLLM: a choice's first chunk
            choice["prompt_token_ids"] = self.prompts[ev.index // self.n]
            self._prompt_sent.add(ev.index)
        return self._chunk(choice, ev)

    def body(self, states: list[p.ChoiceState]) -> dict:
        version = p.last_version(states, self.version())
        return p.completion_body(self.rid, self.created, self.model, states, self.prompts, self.opts, version)


class GenerateStream:
    """SGLang's /generate chunks: each holds everything its sequence has produced so far."""

    def __init__(self, fmt: GenerateFormat):
        self.fmt = fmt

    def head(self, index: int) -> dict | None:
        return None

    def chunks(self, events: list[SeqEvent], states: list[p.ChoiceState]) -> list[dict]:
        return [self.fmt.item(states[ev.index]) for ev in events]

    def body(self, states: list[p.ChoiceState]) -> dict | list:
        return self.fmt.body(states)


def merge(events: list[SeqEvent]) -> list[SeqEvent]:
    """Fold queued events into one per choice, in order (a slow reader gets bigger chunks)."""
    out: dict[int, SeqEvent] = {}
    for ev in events:
        m = out.get(ev.index)
        if m is None:  # a copy, merged into below
            out[ev.index] = replace(ev, logprobs=list(ev.logprobs), token_ids=list(ev.token_ids), versions=list(ev.versions))  # fmt: skip
            continue
        m.text += ev.text
        m.tool_call = m.tool_call or ev.tool_call
        m.tool_args += ev.tool_args
        m.logprobs += ev.logprobs
        m.token_ids += ev.token_ids
        m.versions += ev.versions
        m.finish, m.error, m.matched = ev.finish or m.finish, ev.error or m.error, ev.matched or m.matched
        m.prompt_tokens, m.completion_tokens = ev.prompt_tokens or m.prompt_tokens, ev.completion_tokens or m.completion_tokens  # fmt: skip
    return list(out.values())


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


class EngineServer:
    def __init__(self, cfg: EngineConfig, model, codec: Codec = BYTES):
        """`model`: the built-in `TinyTransformer` or a checkpoint's `LlamaFamily`; `codec` its
        tokenizer and chat template (`lm.load_lm` gives both)."""
        self.cfg, self.metrics, self.model, self.codec = cfg, EngineMetrics(), model, codec
        self.core = EngineCore(cfg, model, self._publish, self.metrics)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seeds = random.Random(cfg.seed)
        self.started = int(time.time())
        self._jobs: dict[str, Job] = {}
        self._closing = False

    def app(self) -> web.Application:
        guard = admin_middleware(lambda: self.cfg.admin_token, _unauthorized)
        app = web.Application(
            client_max_size=int(self.cfg.max_body_mb * 2**20), middlewares=[self._errors, guard]
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/inference/v1/generate", self.tokens_generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id}", self.model_card)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/v1/loads", self.loads)
        app.router.add_get("/metrics", self.prometheus)
        control.register(app, self)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.start()

    async def _on_shutdown(self, app: web.Application) -> None:
        """Drain: let requests in flight finish for DRAIN_SECONDS, then fail the rest (503)."""
        deadline = time.monotonic() + DRAIN_SECONDS
        while self._jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._closing = True
        for job in list(self._jobs.values()):
            self.core.abort(job.rid)
            job.sink.put_nowait(SeqEvent(0, error="the engine is shutting down"))

    async def _on_cleanup(self, app: web.Application) -> None:
        await asyncio.to_thread(self.core.stop)
        control.close_groups(self)

    def _publish(self, events: list[tuple[object, SeqEvent]]) -> None:
        """Called by the engine thread once per step (and by control commands)."""
        if events and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_deliver, events)

    def version(self) -> str:
        return self.core.weight_version

    # ---- generation endpoints -------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await self._parse(request, p.ChatRequest)
        schemas = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt = self.codec.chat([m.to_template() for m in req.messages], schemas)
        self._check_prompt(len(prompt), "messages")
        make, tools = self._chat_output(req)
        max_tokens = self._max_tokens(req.token_limit(), tools)
        self._check_queue([prompt], req.token_limit(), max_tokens, req.n, "messages", "max_tokens")
        top = req.top_logprobs or 0
        specs = [(prompt, self._params(req, max_tokens, i, req.logprobs, top), make()) for i in range(req.n)]
        job = self._start("chatcmpl-", specs)
        opts = p.ReplyOptions(req.logprobs, req.return_token_ids, req.return_tokens_as_token_ids)
        fmt = ChatFormat(job.rid, req.model, opts, [prompt], self.version)
        return await self._respond(request, job, fmt, req.stream, _include_usage(req))

    def _chat_output(self, req: p.ChatRequest) -> tuple[Callable, dict | None]:
        """How a chat turn's tokens become a message: the built-in model's calls are written under
        the grammar when the tool rule says so (`tool_mode`); a checkpoint's model writes its own
        Hermes calls in its text whenever tools are offered (tool_choice "none": plain text)."""
        if self.codec.tool_format == "hermes":
            if req.tools and req.tool_choice != "none":
                return (lambda: HermesOutput(req.text_output())), None
            return req.text_output, None
        tools = p.tool_mode(req, self.cfg.tool_rounds)
        return ((lambda: ToolOutput(tools)) if tools else req.text_output), tools

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._parse(request, p.CompletionRequest, batch="prompt")
        prompts = [self.codec.prompt(x) if isinstance(x, str) else list(x) for x in req.prompts()]
        for ids in prompts:
            self._check_prompt(len(ids), "prompt")
        max_tokens = self._max_tokens(req.max_tokens, None)
        self._check_queue(prompts, req.max_tokens, max_tokens, req.n, "prompt", "max_tokens")
        lp = req.logprobs is not None
        specs = [(ids, self._params(req, max_tokens, k * req.n + i, lp, req.logprobs or 0), req.text_output())
                 for k, ids in enumerate(prompts) for i in range(req.n)]  # fmt: skip
        job = self._start("cmpl-", specs)
        opts = p.ReplyOptions(lp, req.return_token_ids, req.return_tokens_as_token_ids)
        fmt = CompletionFormat(job.rid, req.model, opts, prompts, self.version, req.n)
        return await self._respond(request, job, fmt, req.stream, _include_usage(req))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native API (see `native`)."""
        data, _ = await read_json_object(request)
        field = "input_ids" if data.get("input_ids") is not None else "text"
        self._check_count(data.get(field), field)
        req = p.parse(GenerateRequest, data)
        prompts = req.prompts()
        for ids in prompts:
            self._check_prompt(len(ids), field)
        sp = req.sampling_params
        asked = sp.max_new_tokens if "max_new_tokens" in sp.model_fields_set else None
        self._check_queue(prompts, asked, sp.max_new_tokens, 1, field, "sampling_params.max_new_tokens")
        base = req.params(0)
        specs = []
        for ids in prompts:
            seed = req.sampling_params.sampling_seed
            prm = replace(base, seed=seed if seed is not None else self._seeds.getrandbits(63))
            specs.append((ids, prm, req.text_output()))
        if req.rid is not None and req.rid in self._jobs:
            raise ApiError(400, f"rid {req.rid!r} is already in flight", param="rid", code="duplicate_rid")
        job = self._start("gen-", specs, rid=req.rid)
        fmt = GenerateFormat(job.rid, req, prompts, self.version)
        return await self._respond(request, job, GenerateStream(fmt), req.stream, False)

    async def tokens_generate(self, request: web.Request) -> web.Response:
        """vLLM's token-in/token-out API (see `tokens_api`)."""
        data, _ = await read_json_object(request)
        req = p.parse(TokensRequest, data)
        comp = req.completion(self.cfg.served_name)
        self._check_model(comp.model)
        self._check_prompt(len(req.token_ids), "token_ids")
        lp = comp.logprobs is not None
        max_tokens = self._max_tokens(comp.max_tokens, None)
        specs = [(list(req.token_ids), self._params(comp, max_tokens, i, lp, comp.logprobs or 0), comp.text_output()) for i in range(comp.n)]  # fmt: skip
        if req.request_id is not None and req.request_id in self._jobs:
            raise ApiError(400, f"request_id {req.request_id!r} is already in flight", param="request_id", code="duplicate_request_id")  # fmt: skip
        job = self._start("gen-", specs, rid=req.request_id)
        return await self._respond(request, job, TokensFormat(job.rid, lp, self.version), False, False)

    # ---- models and tokens ------------------------------------------------------------------------

    def _card(self) -> dict:
        return {
            "id": self.cfg.served_name,
            "object": "model",
            "created": self.started,
            "owned_by": "libra",
            "root": self.cfg.model if self.cfg.source.builtin else self.cfg.preset.arch,
            "max_model_len": self.cfg.preset.max_model_len,
            "tp_label": self.cfg.tp_label,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model_id"])
        return web.json_response(self._card())

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a `prompt` (with the BOS token unless add_special_tokens is false)
        or chat `messages` (rendered with the chat template, as /v1/chat/completions does)."""
        req = p.parse(p.TokenizeRequest, (await read_json_object(request))[0])
        if req.model is not None:
            self._check_model(req.model)
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = self.codec.chat([m.to_template() for m in req.messages], tools)
        else:
            ids = self.codec.prompt(req.prompt) if req.add_special_tokens else self.codec.encode(req.prompt)
        limit = self.cfg.preset.max_model_len
        return web.json_response(
            {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        req = p.parse(p.DetokenizeRequest, (await read_json_object(request))[0])
        if req.model is not None:
            self._check_model(req.model)
        return web.json_response({"prompt": self.codec.render(req.tokens)})

    async def health(self, request: web.Request) -> web.Response:
        core = self.core
        return web.json_response(
            status=200 if core.alive else 503,
            data={
                "status": "ok" if core.alive else "engine thread stopped",
                "name": self.cfg.served_name,
                "model": self.cfg.model,
                "tp_label": self.cfg.tp_label,
                "weight_version": core.weight_version,
                "paused": core.paused.value if core.paused else None,
                "sleeping": core.sleeping,
                "running": core.num_running,
                "waiting": core.num_waiting,
                "max_num_seqs": self.cfg.max_num_seqs,
                "max_model_len": self.cfg.preset.max_model_len,
                "kv_cache_usage": round(core.alloc.used_count / (core.alloc.num_blocks - 1), 4),
                "steps": core.steps,
            },
        )

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's /health_generate: one greedy token through the engine. A paused, sleeping or
        weightless engine answers at once (it is alive; it is not meant to generate now)."""
        core = self.core
        if not core.alive:
            raise ApiError(503, "the engine thread stopped", code="engine_dead")
        if core.paused or core.sleeping or core.discarded:
            return web.json_response({"status": "ok", "generated": False, "paused": core.paused is not None, "sleeping": core.sleeping})  # fmt: skip
        seed = self._seeds.getrandbits(63)
        probe = self.codec.prompt("") or [0]  # a tokenizer may add nothing to an empty text
        job = self._start(
            "health-", [(probe, SamplingParams(1, 0.0, seed=seed), TextOutput(codec=self.codec))]
        )
        try:
            await asyncio.wait_for(self._collect(job), HEALTH_GENERATE_S)
        except asyncio.TimeoutError:
            raise ApiError(503, f"no token within {HEALTH_GENERATE_S:g} s", code="engine_stalled") from None
        finally:
            self._jobs.pop(job.rid, None)
            if not job.done:
                self.core.abort(job.rid)
        return web.json_response({"status": "ok", "generated": True})

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's /server_info (/get_server_info), in the fields frameworks read: slime infers
        an external engine's GPUs and checks its settings from it (slime/backends/sglang_utils/
        external.py). One process, so one rank: tp_size 1 whatever bucket label it carries."""
        cfg, core = self.cfg, self.core
        return web.json_response({
            "model_path": cfg.model, "served_model_name": cfg.served_name, "tp_size": 1, "pp_size": 1,
            "dp_size": 1, "ep_size": 1, "tp_label": cfg.tp_label,
            "context_length": cfg.preset.max_model_len, "max_running_requests": cfg.max_num_seqs,
            "disaggregation_mode": "null", "enable_memory_saver": False, "version": "libra-builtin",
            "weight_version": core.weight_version, "world_size": 1,
        })  # fmt: skip

    async def loads(self, request: web.Request) -> web.Response:
        core = self.core
        usage = round(core.alloc.used_count / (core.alloc.num_blocks - 1), 4)
        return web.json_response(loads(core.num_running, core.num_waiting, usage))

    async def prometheus(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return resp

    # ---- request plumbing -----------------------------------------------------------------------

    async def _parse(self, request: web.Request, model: type[p.SamplingRequest], batch: str | None = None) -> p.SamplingRequest:  # fmt: skip
        data, _ = await read_json_object(request)
        if batch is not None:  # counted before validation, which would copy every prompt
            self._check_count(data.get(batch), batch)
        req = p.parse(model, data)
        self._check_model(req.model)
        return req

    def _check_model(self, name: str) -> None:
        if name != self.cfg.served_name:
            msg = f"model {p.clip(name)!r} does not exist here; this engine serves {self.cfg.served_name!r}"
            raise ApiError(404, msg, param="model", code="model_not_found")

    def _check_prompt(self, n_tokens: int, param: str) -> None:
        limit = self.cfg.preset.max_model_len
        if n_tokens >= limit:
            msg = f"the prompt is {n_tokens} tokens; this engine's context is {limit} tokens (prompt must be shorter)"  # fmt: skip
            raise ApiError(400, msg, param=param, code="context_length_exceeded")

    def _check_count(self, value: object, param: str) -> None:
        """A batch of more prompts than `max_prompts_per_request` is refused before any is read."""
        n = batch_size(value)
        cap = self.cfg.max_prompts_per_request
        if n > cap:
            msg = f"{param!r} holds {n} prompts; this engine takes at most {cap} per request (max_prompts_per_request)"  # fmt: skip
            raise ApiError(400, msg, param=param, code="too_many_prompts")

    def _check_queue(self, prompts: list[list[int]], asked: int | None, max_tokens: int, n: int, param: str, tokens_param: str) -> None:  # fmt: skip
        """vLLM's rule for an explicit max_tokens (prompt + max_tokens within the context, else a
        400 naming max_tokens, never a silent clamp), then the request's whole queue: over its
        sequences, prompt tokens plus the tokens each may generate, at most `max_request_tokens`."""
        limit = self.cfg.preset.max_model_len
        total = 0
        for ids in prompts:
            if asked is not None and len(ids) + asked > limit:
                msg = (f"'{tokens_param}' is too large: {asked}. This model's maximum context length is {limit} tokens "
                       f"and your request has {len(ids)} input tokens ({asked} > {limit} - {len(ids)})")  # fmt: skip
                raise ApiError(400, msg, param=tokens_param, code="context_length_exceeded")
            total += (len(ids) + min(max_tokens, limit - len(ids))) * n
        cap = self.cfg.max_request_tokens
        if total > cap:
            msg = f"this request would queue {total} tokens ({len(prompts)} prompts x n={n}, prompt plus {tokens_param} each); this engine takes at most {cap} (max_request_tokens)"  # fmt: skip
            raise ApiError(400, msg, param=param, code="request_too_large")

    def _max_tokens(self, asked: int | None, tools: dict | None) -> int:
        if asked is not None:
            return asked
        if tools is None:
            return self.cfg.max_tokens_default
        return max(self.cfg.max_tokens_default, ToolOutput(tools).constraint.min_left() + TOOL_HEADROOM)

    def _params(self, req: p.SamplingRequest, max_tokens: int, i: int, logprobs: bool, top: int) -> SamplingParams:  # fmt: skip
        seed = req.seed + i if req.seed is not None else self._seeds.getrandbits(63)
        return req.params(max_tokens, seed, logprobs, top)

    def _start(self, prefix: str, specs: list, rid: str | None = None) -> Job:
        job = Job(rid or prefix + secrets.token_hex(12), asyncio.Queue(), len(specs))
        now, max_len = time.monotonic(), self.cfg.preset.max_model_len
        seqs = [Sequence(job.rid, i, ids, prm, out, job.sink, max_len, now) for i, (ids, prm, out) in enumerate(specs)]  # fmt: skip
        self.core.submit(seqs)
        self._jobs[job.rid] = job
        return job

    async def _respond(self, request: web.Request, job: Job, fmt, stream: bool, usage: bool) -> web.StreamResponse:  # fmt: skip
        try:
            if stream:
                return await self._stream(request, job, fmt, usage)
            states = await self._collect(job)
            return web.json_response(fmt.body(states))
        finally:
            self._jobs.pop(job.rid, None)
            if not job.done:
                self.core.abort(job.rid)

    async def _collect(self, job: Job) -> list[p.ChoiceState]:
        states = [p.ChoiceState(i) for i in range(job.n)]
        left = job.n
        while left:
            ev = (await self._events(job, one=True))[0]
            if ev.error:
                job.done = True
                raise ApiError(503 if self._closing else 500, ev.error, code="engine_error")
            states[ev.index].add(ev)
            left -= ev.finish is not None
        job.done = True
        return states

    async def _stream(self, request: web.Request, job: Job, fmt, usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        states = [p.ChoiceState(i) for i in range(job.n)]
        try:
            heads = [fmt.head(i) for i in range(job.n)]
            await resp.write(b"".join(sse(h) for h in heads if h))
            left = job.n
            while left:
                events = merge(await self._events(job))
                if any(ev.error for ev in events):
                    job.done = True
                    await resp.write(sse({"error": {"message": events[0].error or "engine error", "type": "server_error"}}))  # fmt: skip
                    break
                for ev in events:
                    states[ev.index].add(ev)
                    left -= ev.finish is not None
                await resp.write(b"".join(sse(c) for c in fmt.chunks(events, states)))
            job.done = True
            if usage:
                prompt_tokens = sum(len(x) for x in fmt.prompts)
                await resp.write(sse(fmt.usage_chunk(p.usage(states, prompt_tokens))))
            await resp.write(sse("[DONE]"))
            await resp.write_eof()
        except ConnectionResetError:  # the client left; `_respond` aborts the sequences
            pass
        return resp

    async def _events(self, job: Job, one: bool = False) -> list[SeqEvent]:
        """What the engine thread has published for `job` (at least one event); an error event
        instead of a wait forever if that thread has stopped (a bug: its log says why)."""
        while True:
            try:
                async with asyncio.timeout(ENGINE_CHECK_S):
                    return [await job.sink.get()] if one else await _drain(job.sink)
            except TimeoutError:
                if not self.core.alive and job.sink.empty():
                    return [SeqEvent(0, error="the engine thread has stopped; see the engine log")]

    # ---- errors ---------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        p.CODEC.set(self.codec)  # this request's task parses and answers with this engine's tokenizer
        try:
            resp = await handler(request)
        except ApiError as e:
            resp = json_error(e.status, e.message, e.param, e.code)
        except ConfigError as e:
            resp = json_error(400, str(e), e.field, "invalid_value")
        except LibraError as e:
            resp = json_error(400, str(e))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            resp = json_error(e.status, _http_message(e, request, self.cfg.max_body_mb), code=e.reason.lower().replace(" ", "_"))  # fmt: skip
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            resp = json_error(500, "internal server error; see the engine log")
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        self.metrics.http_requests.labels(endpoint, str(resp.status)).inc()
        return resp


# Messages for the HTTP errors aiohttp raises itself (routing, body size), by status.
_HTTP_MESSAGES = {
    404: "no such endpoint: {method} {path}",
    405: "method {method} not allowed on {path}",
    413: "request body too large; the limit is {max_body_mb:g} MiB (--max-body-mb)",
}


def _http_message(e: web.HTTPException, request: web.Request, max_body_mb: float) -> str:
    template = _HTTP_MESSAGES.get(e.status)
    if template is None:
        return e.text or e.reason
    return template.format(method=request.method, path=request.path, max_body_mb=max_body_mb)


def _unauthorized(request: web.Request) -> web.Response:
    """The admin token's refusal, in SGLang's shape (every guarded engine route is a control call)."""
    msg = "control calls need 'Authorization: Bearer <admin token>' (--admin-token)"
    return web.json_response({"success": False, "message": msg, "param": "Authorization"}, status=401)


def _include_usage(req: p.SamplingRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _deliver(events: list[tuple[asyncio.Queue, SeqEvent]]) -> None:
    for sink, ev in events:
        sink.put_nowait(ev)


async def _drain(q: asyncio.Queue) -> list[SeqEvent]:
    items = [await q.get()]
    while not q.empty():
        items.append(q.get_nowait())
    return items


# ---- running it -------------------------------------------------------------------------------------


def write_checkpoint(cfg: EngineConfig, path: str) -> tuple[Path, int]:
    """Write the weights the config would serve (random from its seed, or its checkpoint) to
    `path`: (the file, the parameter count)."""
    model, _ = load_lm(cfg)
    try:
        out = save_checkpoint(model, path)
    except OSError as e:
        raise ConfigError("--save-checkpoint", path, f"a writable path ({e.strerror})") from None
    return out, sum(t.numel() for t in model.state_dict().values())


def serve(cfg: EngineConfig, sock: socket.socket, access_log: bool = False) -> None:
    """Build the model, start the engine thread and serve on `sock` until SIGINT or SIGTERM."""
    model, codec = load_lm(cfg)
    asyncio.run(_serve(EngineServer(cfg, model, codec), sock, access_log))


async def _serve(server: EngineServer, sock: socket.socket, access_log: bool) -> None:
    kwargs = {} if access_log else {"access_log": None}
    runner = limited_runner(server.app(), server.cfg.http_limits(), handler_cancellation=True, shutdown_timeout=2.0, **kwargs)  # fmt: skip
    await runner.setup()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    cfg = server.cfg
    print(f"libra engine {cfg.served_name!r} (model {cfg.model}, {cfg.tp_label}) listening on http://{host}:{port}", flush=True)  # fmt: skip
    await serve_until_signalled(runner)

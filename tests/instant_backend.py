"""A minimal OpenAI-compatible backend that answers at once: no model, no generation.

It exists to time the gateway itself. Put a router in front of a real engine and the engine's
milliseconds of generation drown the router's microseconds; put it in front of this backend and
what is measured is the router. The benchmark uses it for both the Libra gateway and
`sglang-router`, and tests use it where they need many sessions quickly (hundreds at once)
rather than real tokens.

It speaks enough of the API to be a faithful stand-in:

- `POST /v1/chat/completions` and `/v1/completions`, non-streaming and streaming (SSE, with
  `stream_options.include_usage`), with `usage` estimated at 4 characters a token (a token-id
  prompt counts its ids);
- SGLang's `POST /generate` (`text` or `input_ids`), answering in its shape with `meta_info`;
- tool calls by the built-in engine's rule: with `tools` and `tool_choice` auto, a turn calls the
  first tool while fewer than `--tool-rounds` (or the body's `libra_tool_rounds`) assistant tool
  calls follow the last user message, then answers in text; `required` or a named tool always calls;
- `GET /v1/models`, `/health`, and the SGLang worker endpoints `sglang-router` probes
  (`/health_generate`, `/get_model_info`, `/get_server_info`);
- `GET /stats`: how many requests it answered (and, with a delay, the most it held at once), and
  the last `X-Request-Id` it was sent, so tests can count and check what reached the backends;
- `--delay-ms` holds every answer that long;
- a gate, to make requests overlap in tests whatever the machine's pace: with `--hold-until N` the
  first requests wait until N of them are held together, then all go on (the gate stays open);
  `POST /gate {"open": false}` closes it again (requests wait until `{"open": true}`), and `/stats`
  says how many wait (`held`). A held request goes on after HOLD_LIMIT_S whatever happens, so a
  test that expects more requests than come fails on its assertion instead of hanging;
- `--exit-mid-stream` makes the process crash after the first event of a chat stream, so tests
  can see a backend die halfway through a response.

Run: `python -m tests.instant_backend --port 0 [--port 0 ...] --model NAME`. One process
can listen on several ports (each prints `listening on http://HOST:PORT`), which saves a core when
a benchmark needs several backends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import time

import click
from aiohttp import web

from libra.runtime.serving import serve_until_signalled

CHARS_PER_TOKEN = 4
HOLD_LIMIT_S = 600.0  # only stops a test whose requests never all arrive from hanging the suite


def _tokens(chars: int) -> int:
    return max(1, -(-chars // CHARS_PER_TOKEN))


def _prompt_tokens(prompt: object) -> int:
    """A prompt's tokens: its ids when it is token ids (the longest list of a batch), else its
    characters at 4 a token."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return max(len(p) for p in prompt if isinstance(p, list))
    chars = len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt if isinstance(p, str))
    return _tokens(chars)


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return web.json_response(body, status=status)


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _calls_since_user(messages: list) -> int:
    n = 0
    for m in reversed(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "user":
            break
        if m.get("role") == "assistant" and m.get("tool_calls"):
            n += 1
    return n


def _tool_to_call(data: dict, rounds: int) -> str | None:
    """The tool this turn calls, or None for a text answer (the built-in engine's rule)."""
    tools = data.get("tools")
    choice = data.get("tool_choice")
    if not isinstance(tools, list) or not tools or choice == "none":
        return None
    names = [t["function"]["name"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)]  # fmt: skip
    if not names:
        return None
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name") or names[0]
    if choice == "required":
        return names[0]
    r = data.get("libra_tool_rounds", rounds)
    r = r if isinstance(r, int) else rounds
    return names[0] if _calls_since_user(data.get("messages") or []) < r else None


class InstantBackend:
    def __init__(self, model: str, reply: str, delay_s: float, tool_rounds: int, max_context: int, exit_mid_stream: bool = False, hold_until: int = 0):  # fmt: skip
        self.model, self.reply, self.delay_s, self.exit_mid_stream = model, reply, delay_s, exit_mid_stream
        self.tool_rounds, self.max_context = tool_rounds, max_context
        self.ids = itertools.count()
        self.counts = {
            "chat": 0,
            "completions": 0,
            "generate": 0,
            "inflight": 0,
            "peak_inflight": 0,
            "held": 0,
            "last_request_id": None,
        }
        self.created = int(time.time())
        self.hold_until, self.gate = hold_until, asyncio.Event()
        if hold_until == 0:
            self.gate.set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/gate", self.set_gate)
        return app

    async def _wait_at_gate(self) -> None:
        if self.gate.is_set():
            return
        c = self.counts
        c["held"] += 1
        if self.hold_until and c["held"] >= self.hold_until:
            self.gate.set()
        try:
            await asyncio.wait_for(self.gate.wait(), HOLD_LIMIT_S)
        except asyncio.TimeoutError:
            pass
        finally:
            c["held"] -= 1

    async def _parse(self, request: web.Request) -> dict | web.Response:
        try:
            data = json.loads(await request.read())
        except ValueError:
            return _error(400, "request body is not valid JSON", code="invalid_json")
        if not isinstance(data, dict):
            return _error(400, "request body must be a JSON object", code="invalid_json")
        self.counts["last_request_id"] = request.headers.get("X-Request-Id")
        if request.path != "/generate" and data.get("model") != self.model:
            return _error(404, f"model {data.get('model')!r} does not exist; this backend serves {self.model!r}", "model", "model_not_found")  # fmt: skip
        c = self.counts
        c["inflight"] += 1
        c["peak_inflight"] = max(c["peak_inflight"], c["inflight"])
        try:
            await self._wait_at_gate()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        finally:
            c["inflight"] -= 1
        return data

    async def chat(self, request: web.Request) -> web.StreamResponse:
        data = await self._parse(request)
        if isinstance(data, web.Response):
            return data
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "'messages' is required", "messages", "invalid_value")
        self.counts["chat"] += 1
        prompt = _tokens(sum(len(_text(m.get("content"))) for m in messages if isinstance(m, dict)))
        tool = _tool_to_call(data, self.tool_rounds)
        rid = f"chatcmpl-instant-{next(self.ids)}"
        if tool is not None:
            call = {
                "id": f"call_{rid[9:]}",
                "type": "function",
                "function": {"name": tool, "arguments": "{}"},
            }
            msg, finish, completion = (
                {"role": "assistant", "content": None, "tool_calls": [call]},
                "tool_calls",
                4,
            )
        else:
            msg, finish, completion = (
                {"role": "assistant", "content": self.reply},
                "stop",
                _tokens(len(self.reply)),
            )
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if data.get("stream") is True:
            return await self._stream_chat(request, data, rid, msg, finish, usage)
        body = {"id": rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}], "usage": usage}  # fmt: skip
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        data = await self._parse(request)
        if isinstance(data, web.Response):
            return data
        prompt = data.get("prompt")
        if not isinstance(prompt, (str, list)) or not prompt:
            return _error(400, "'prompt' is required", "prompt", "invalid_value")
        self.counts["completions"] += 1
        p, c = _prompt_tokens(prompt), _tokens(len(self.reply))
        usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        rid = f"cmpl-instant-{next(self.ids)}"
        choice = {"index": 0, "text": self.reply, "logprobs": None, "finish_reason": "stop"}
        body = {"id": rid, "object": "text_completion", "created": self.created, "model": self.model, "choices": [choice], "usage": usage}  # fmt: skip
        if data.get("stream") is True:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(_sse({**body, "usage": None}) + _sse({**body, "choices": [], "usage": usage}) + b"data: [DONE]\n\n")  # fmt: skip
            await resp.write_eof()
            return resp
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        data = await self._parse(request)
        if isinstance(data, web.Response):
            return data
        prompt = data.get("input_ids", data.get("text"))
        if not isinstance(prompt, (str, list)) or not prompt:
            return _error(400, "'text' or 'input_ids' is required", "input_ids", "invalid_value")
        self.counts["generate"] += 1
        ids = list(self.reply.encode())
        meta = {"id": f"gen-instant-{next(self.ids)}", "finish_reason": {"type": "stop", "matched": 0},
                "prompt_tokens": _prompt_tokens(prompt), "completion_tokens": len(ids), "cached_tokens": 0,
                "weight_version": "0"}  # fmt: skip
        if data.get("return_logprob"):
            meta["output_token_logprobs"] = [[-1.0, t, None] for t in ids]
        body = {"text": self.reply, "output_ids": ids, "meta_info": meta}
        if data.get("stream") is True:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(_sse(body) + b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    async def _stream_chat(self, request, data, rid, msg, finish, usage) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        base = {"id": rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

        def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
            return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]})  # fmt: skip

        parts = [chunk({"role": "assistant", "content": ""})]
        if msg.get("tool_calls"):
            call = msg["tool_calls"][0]
            parts.append(chunk({"tool_calls": [{"index": 0, **call}]}))
        else:
            half = len(self.reply) // 2
            parts += [chunk({"content": self.reply[:half]}), chunk({"content": self.reply[half:]})]
        parts.append(chunk({}, finish))
        opts = data.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            parts.append(_sse({**base, "choices": [], "usage": usage}))
        parts.append(b"data: [DONE]\n\n")
        for k, p in enumerate(parts):  # one write per event, as a real server streams them
            await resp.write(p)
            if self.exit_mid_stream and k == 0:
                await asyncio.sleep(0.05)  # let the first event leave, then die as a crash would
                os._exit(1)
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "libra-instant", "max_model_len": self.max_context}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model, "tokenizer_path": None, "is_generation": True})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model, "dp_size": 1, "tp_size": 1, "max_total_num_tokens": self.max_context})  # fmt: skip

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.counts)

    async def set_gate(self, request: web.Request) -> web.Response:
        data = await self._parse_gate(request)
        if isinstance(data, web.Response):
            return data
        if data["open"]:
            self.gate.set()
        else:
            self.hold_until = 0  # closed by hand: opened by hand
            self.gate.clear()
        return web.json_response({"open": self.gate.is_set(), "held": self.counts["held"]})

    async def _parse_gate(self, request: web.Request) -> dict | web.Response:
        try:
            data = json.loads(await request.read())
        except ValueError:
            return _error(400, "request body is not valid JSON", code="invalid_json")
        if not isinstance(data, dict) or not isinstance(data.get("open"), bool):
            return _error(400, "'open' must be true or false", "open", "invalid_value")
        return data


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _serve(backend: InstantBackend, socks: list[socket.socket]) -> None:
    runner = web.AppRunner(backend.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    for sock in socks:
        await web.SockSite(runner, sock, backlog=4096).start()
        host, port = sock.getsockname()[:2]
        print(f"libra instant backend {backend.model!r} listening on http://{host}:{port}", flush=True)
    await serve_until_signalled(runner)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", "ports", multiple=True, type=click.IntRange(0, 65535), default=(0,), show_default=True, help="Port to listen on (repeatable; 0 picks a free one).")  # fmt: skip
@click.option("--model", default="instant", show_default=True, help="Model name served and expected.")
@click.option("--reply", default="Done.", show_default=True, help="The text every answer holds.")
@click.option("--delay-ms", default=0.0, show_default=True, type=click.FloatRange(min=0), help="Hold every answer this long.")  # fmt: skip
@click.option("--tool-rounds", default=1, show_default=True, type=click.IntRange(min=0), help="Tool calls an 'auto' turn makes before answering.")  # fmt: skip
@click.option("--hold-until", default=0, show_default=True, type=click.IntRange(min=0), help="Hold the first requests until this many are held together (0: no gate).")  # fmt: skip
@click.option("--exit-mid-stream", is_flag=True, help="Crash (exit at once) after the first event of a chat stream, to test failures.")  # fmt: skip
@click.option("--max-context", default=32768, show_default=True, type=click.IntRange(min=1), help="Reported in /v1/models.")  # fmt: skip
def main(host: str, ports: tuple[int, ...], model: str, reply: str, delay_ms: float, tool_rounds: int, hold_until: int, exit_mid_stream: bool, max_context: int) -> None:  # fmt: skip
    """A minimal, instant OpenAI-compatible backend (for benchmarks and tests)."""
    try:
        socks = [socket.create_server((host, p), backlog=4096) for p in ports]
    except OSError as e:
        raise click.BadParameter(
            f"cannot listen on {host}:{ports} ({e.strerror})", param_hint="--port"
        ) from None
    backend = InstantBackend(
        model, reply, delay_ms / 1000.0, tool_rounds, max_context, exit_mid_stream, hold_until
    )
    asyncio.run(_serve(backend, socks))


if __name__ == "__main__":
    main()

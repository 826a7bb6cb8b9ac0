"""Where a tool call runs: the actions service's sandbox (SandboxFusion `/run_code`), or in process.

The calculator's expression is text the model wrote, so by default it runs in the sandbox like any
model-written code. `in_process` calls the same pure function directly (for the in-process
learning test and laptops without bubblewrap). Both return the same output for the same call.

An actions service that cannot be reached is not a tool failure: no trajectory could get a tool
result, so the runner raises `ActionsUnreachable`, which stops the run with a clear error instead
of dropping every trajectory one by one (or waiting forever).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Protocol

import aiohttp

from libra.runtime.train.task import TOOL_NAME, evaluate, sandbox_program
from libra.runtime.train.trajectory import ToolResult


class ActionsUnreachable(RuntimeError):
    """The actions service did not answer at all (refused, reset, or no answer in time)."""


class ToolFailed(RuntimeError):
    """The service answered, but not with a result (a 4xx/5xx, or a sandbox error)."""


class ToolRunner(Protocol):
    async def call(self, name: str, arguments: str, session: str) -> ToolResult: ...


def expression_of(name: str, arguments: str) -> str | None:
    """The calculator's `expr` argument, or None when the call is not a well-formed calc call."""
    if name != TOOL_NAME:
        return None
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    expr = args.get("expr") if isinstance(args, dict) else None
    return expr if isinstance(expr, str) else None


def _status(output: str) -> str:
    return "failure" if output.startswith("error") else "success"


class InProcessTools:
    """The pure function, called directly."""

    async def call(self, name: str, arguments: str, session: str) -> ToolResult:
        t0 = time.perf_counter()
        expr = expression_of(name, arguments)
        out = "error: unknown tool or bad arguments" if expr is None else evaluate(expr)
        return ToolResult(out, _status(out), time.perf_counter() - t0)


class SlowFrom:
    """A workload shift: from the `from_step`-th trained step on, every tool call also waits
    `delay_s` (the tool became a slow external API), so rollout becomes the slower stage. The
    elastic demo uses it to show a release; `trained` says how many steps have trained."""

    def __init__(self, inner: ToolRunner, delay_s: float, from_step: int, trained=lambda: 0):
        self.inner, self.delay_s, self.from_step, self.trained = inner, delay_s, from_step, trained

    async def call(self, name: str, arguments: str, session: str) -> ToolResult:
        if self.delay_s and self.trained() >= self.from_step:
            await asyncio.sleep(self.delay_s)
        return await self.inner.call(name, arguments, session)


class SandboxTools:
    """POST /run_code to the actions service with the calculator's source as the program."""

    def __init__(
        self, url: str, http: aiohttp.ClientSession, timeout_s: float = 30.0, run_timeout_s: float = 5.0
    ):
        self.url, self.http = url.rstrip("/") + "/run_code", http
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.run_timeout_s = run_timeout_s

    async def call(self, name: str, arguments: str, session: str) -> ToolResult:
        t0 = time.perf_counter()
        expr = expression_of(name, arguments)
        if expr is None:
            return ToolResult("error: unknown tool or bad arguments", "failure", 0.0)
        body = {"code": sandbox_program(expr), "language": "python", "run_timeout": self.run_timeout_s}
        try:
            async with self.http.post(self.url, json=body, timeout=self.timeout) as r:
                data = await r.json(content_type=None)
                status = r.status
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
            raise ActionsUnreachable(f"{self.url}: {type(e).__name__}: {e}") from None
        except ValueError as e:
            raise ToolFailed(f"{self.url} answered {e}") from None
        return ToolResult(*_output(status, data), time.perf_counter() - t0)


def _output(status: int, data: object) -> tuple[str, str]:
    if status != 200 or not isinstance(data, dict):
        raise ToolFailed(f"actions service answered HTTP {status}: {str(data)[:200]}")
    run = data.get("run_result") or {}
    if data.get("status") == "SandboxError":
        raise ToolFailed(f"sandbox error: {data.get('message', '')[:200]}")
    if run.get("status") == "TimeLimitExceeded":
        return "error: timed out", "timeout"
    out = str(run.get("stdout", "")).strip()
    if run.get("return_code") not in (0, None) or not out:
        return f"error: {str(run.get('stderr', '')).strip()[-200:] or 'no output'}", "failure"
    return out, _status(out)

"""Ready-made tools: the sandboxed python test runner, and a quota-limited HTTP tool type.

- `python_tests` runs pytest on a test file of a session, sharded over the cores the scheduler
  grants (see `pytest_runner.py`); its JSON summary (tests, passed, failures ...) is returned.
- An HTTP tool (configured under `http_tools`) POSTs the caller's JSON payload to a fixed URL on
  the service's side; each call is an action that holds one concurrency slot and its tokens of
  the tool's quota, so a paid API or a shared judge model is never asked for more than it allows.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from libra.actions import ActionState
from libra.runtime.sandbox.config import HttpToolConfig

RUNNER_SOURCE = (Path(__file__).parent / "pytest_runner.py").read_text(encoding="utf-8")


def python_tests_argv(python: str, path: str, workers: int, args: list[str]) -> list[str]:
    return [python, "-c", RUNNER_SOURCE, path, "--workers", str(workers), "--", *args]


def parse_summary(stdout: str) -> dict | None:
    """The runner's last stdout line is its JSON summary (absent if it was killed)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
        if line.strip():
            return None
    return None


async def call_http_tool(session, tool: HttpToolConfig, payload: object) -> tuple[dict, ActionState]:
    """POST the payload; the result carries the upstream status and body, never raises for it."""
    import aiohttp

    try:
        timeout = aiohttp.ClientTimeout(total=tool.timeout_s)
        async with session.post(tool.url, json=payload, timeout=timeout) as r:
            raw = await r.content.read(tool.max_response_bytes + 1)
            truncated = len(raw) > tool.max_response_bytes
            text = raw[: tool.max_response_bytes].decode("utf-8", errors="replace")
            body: object = text
            if not truncated and "json" in r.headers.get("Content-Type", ""):
                try:
                    body = json.loads(text)
                except json.JSONDecodeError:
                    body = text
            ok = 200 <= r.status < 300
            res = {"status": "Success" if ok else "Failed", "status_code": r.status, "body": body,
                   "truncated": truncated, "message": "" if ok else f"upstream answered {r.status}"}  # fmt: skip
            return res, ActionState.SUCCEEDED if ok else ActionState.FAILED
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        kind = "timed out" if isinstance(e, asyncio.TimeoutError) else f"failed: {type(e).__name__}: {e}"
        state = ActionState.TIMED_OUT if isinstance(e, asyncio.TimeoutError) else ActionState.FAILED
        return {"status": "Failed", "status_code": None, "body": None, "truncated": False,
                "message": f"the call to {tool.url} {kind}"}, state  # fmt: skip

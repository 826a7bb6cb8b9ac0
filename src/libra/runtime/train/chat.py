"""How the agent loop talks to a model: one `ChatClient.turn` per model call.

Two clients, one protocol, so the very same agent loop runs live and in process:

- `GatewayChat`: the live path. `POST /v1/chat/completions` to the gateway with the trajectory's
  `X-Session-ID` (one session per trajectory, so C-MLFQ routes it at each tool return),
  `X-Prompt-ID` (its GRPO group: siblings share a prompt) and `X-Libra-Step`, asking for token ids
  and log-probabilities (`return_token_ids`, `logprobs`). The gateway's own failover retries a turn
  whose engine died before answering; an error after that drops the trajectory.
- `LocalChat` (`inprocess.py`): the engine's core in this process, for the learning test.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from libra.runtime.train.trajectory import DropReason, Turn


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    prompt_id: str
    step: int


@dataclass(frozen=True, slots=True)
class RouteSummary:
    """What the gateway did with a finished session: its moves between instances."""

    migrations: int = 0
    failovers: int = 0


class TurnFailed(RuntimeError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class ChatClient(Protocol):
    async def turn(self, s: SessionInfo, messages: list[dict], tools: list[dict], sampling: Sampling) -> Turn: ...  # fmt: skip

    async def finish(self, s: SessionInfo, final_tokens: int) -> RouteSummary: ...


def chat_body(model: str, messages: list[dict], tools: list[dict], sampling: Sampling) -> dict:
    return {
        "model": model,
        "messages": messages,
        "tools": tools,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "logprobs": True,
        "return_token_ids": True,
    }


def version_number(v: object) -> int:
    """`libra train` publishes versions "0", "1", ...; anything else (an engine's initial
    "default") is -1, older than every published one."""
    return int(v) if isinstance(v, str) and v.isdigit() else v if isinstance(v, int) else -1


def parse_choice(data: dict) -> Turn:
    """A chat response (non-streamed, n=1) with token ids and logprobs as a `Turn`."""
    choice = data["choices"][0]
    ids = [int(t) for t in choice["token_ids"]]
    lps = [float(e["logprob"]) for e in (choice.get("logprobs") or {}).get("content") or []]
    version = version_number(data.get("weight_version"))
    versions = choice.get("token_weight_versions")
    msg = choice.get("message") or {}
    call = None
    if msg.get("tool_calls"):
        c = msg["tool_calls"][0]
        call = (c.get("id", ""), c["function"]["name"], c["function"].get("arguments", ""))
    return Turn(
        prompt_ids=[int(t) for t in data["prompt_token_ids"]],
        token_ids=ids,
        logprobs=lps,
        weight_versions=[version_number(v) for v in versions] if versions else [version] * len(ids),
        finish_reason=str(choice.get("finish_reason")),
        text=msg.get("content") or "",
        tool_call=call,
        raw=msg.get("raw_content"),
    )


class GatewayChat:
    def __init__(self, url: str, model: str, http: aiohttp.ClientSession, timeout_s: float = 300.0, admin_token: str | None = None):  # fmt: skip
        self.url, self.model, self.http = url.rstrip("/"), model, http
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        # Finishing a session feeds the router's tree: with the gateway's admin token set, it
        # needs it (turns never carry it: the gateway passes a client's Authorization upstream).
        self.admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    async def turn(self, s: SessionInfo, messages: list[dict], tools: list[dict], sampling: Sampling) -> Turn:  # fmt: skip
        headers = {"X-Session-ID": s.session_id, "X-Prompt-ID": s.prompt_id}
        if s.step >= 0:  # a measurement outside training (the base model's) belongs to no step
            headers["X-Libra-Step"] = str(s.step)
        body = chat_body(self.model, messages, tools, sampling)
        t0 = time.time()
        try:
            async with self.http.post(self.url + "/v1/chat/completions", json=body, headers=headers, timeout=self.timeout) as r:  # fmt: skip
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise TurnFailed(DropReason.ENGINE, f"HTTP {r.status}: {json.dumps(data)[:300]}")
                turn = parse_choice(data)
                turn.bucket = r.headers.get("X-Libra-Bucket", "")
                turn.instance = r.headers.get("X-Libra-Instance", "")
        except asyncio.TimeoutError:
            raise TurnFailed(
                DropReason.TIMEOUT, f"no answer from the gateway in {self.timeout.total:g} s"
            ) from None
        except aiohttp.ClientError as e:
            raise TurnFailed(DropReason.UNREACHABLE, f"{type(e).__name__}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise TurnFailed(DropReason.ENGINE, f"malformed response: {type(e).__name__}: {e}") from None
        turn.started, turn.ended = t0, time.time()
        return turn

    async def finish(self, s: SessionInfo, final_tokens: int) -> RouteSummary:
        """End the gateway session, so its path feeds the router's tree; what the gateway did with
        it comes back. Best effort: a session the gateway no longer has (it restarted) is no loss."""
        try:
            async with self.http.post(f"{self.url}/sessions/{s.session_id}/finish", json={"final_tokens": final_tokens}, headers=self.admin, timeout=self.timeout) as r:  # fmt: skip
                data = await r.json(content_type=None)
            turns = data["session"]["turns"] if r.status == 200 else []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
            return RouteSummary()
        return RouteSummary(
            sum(bool(t.get("migrated")) for t in turns), sum(bool(t.get("failover_to")) for t in turns)
        )

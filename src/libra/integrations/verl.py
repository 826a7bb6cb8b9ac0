"""verl's rollout server, over HTTP to Libra's gateway, one gateway session per trajectory.

verl's agent loop never sees a URL: each turn goes through its server client (verl 0.9.1:
`LLMServerClient.generate` in verl/workers/rollout/llm_server.py; January 2026's b178a3c:
`AsyncLLMServerManager.generate` in verl/experimental/agent_loop/agent_loop.py), which picks a
server handle for the trajectory's `request_id` and awaits
`handle.generate.remote(request_id=<a fresh uuid4 per turn>, prompt_ids=..., sampling_params=...)`.
The fresh id is why the gateway never saw a session. Two pieces fix that without touching verl:

- `LibraServer` is a server handle: `generate.remote(...)` posts the turn to the gateway's
  `/inference/v1/generate` (vLLM's token-in/token-out API) and returns verl's `TokenOutput`. It
  translates verl's sampling parameters as verl's own vLLM server does (`max_tokens` from the
  rollout's lengths, `logprobs` as a flag) and sends its `session` as `X-Session-ID`;
- `LibraLoadBalancer` is verl 0.9.1's load balancer (its `RequestLoadBalancer` protocol): for a
  trajectory's `request_id` it returns the handle bound to that id as the session, so every turn
  of a trajectory is one gateway session and Libra's router decides where it runs. It plugs in
  as a router plugin: `actor_rollout_ref.rollout.router_config_path=libra_router.yaml` with
  `router_class: libra.integrations.verl.LibraLoadBalancer` and the gateway's URL in that file.

For verl b178a3c (`AsyncLLMServerManager`), bind per trajectory the same way by overriding its
`_choose_server(request_id)` to `return libra_server.for_session(request_id)`; docs/integrations.md
has the lines. verl's own weight synchronisation still targets verl's replicas: publishing
weights to Libra's engines goes through the gateway's control plane (see the doc).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from dataclasses import dataclass, field
from typing import Any

import aiohttp

GENERATE_PATH = "/inference/v1/generate"
# One HTTP connection pool per event loop, shared by every handle in the process: verl makes a
# handle per trajectory (and Ray copies it), so a pool per handle would leak one per trajectory.
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pool() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None or pool.closed:
        pool = _POOLS[loop] = aiohttp.ClientSession()
    return pool


async def aclose() -> None:
    """Close this event loop's connection pool (at the end of a run; handles stay usable)."""
    pool = _POOLS.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.close()


@dataclass(slots=True)
class TokenOutput:
    """verl's `TokenOutput` fields, returned when verl itself is not importable (tests, tools)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


def _token_output_cls():
    try:
        from verl.workers.rollout.replica import TokenOutput as VerlTokenOutput
    except ImportError:
        return TokenOutput
    return VerlTokenOutput


class _Remote:
    """`handle.generate.remote(...)`, as verl calls a Ray actor's method: an awaitable result."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class LibraServer:
    """A verl rollout-server handle that generates through Libra's gateway.

    `response_length` and `prompt_length` are the rollout's (`actor_rollout_ref.rollout.*`): a turn
    without `max_tokens` gets min(response_length, prompt_length + response_length - prompt), as
    verl's vLLM server computes it. Plain data, so it pickles (it crosses Ray as verl's handles
    do); the HTTP connections are the event loop's (`_pool`).
    """

    def __init__(self, gateway_url: str, *, response_length: int, prompt_length: int | None = None,
                 session: str | None = None, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0):  # fmt: skip
        if response_length < 1:
            raise ValueError(f"response_length must be at least 1, got {response_length}")
        self.url = gateway_url.rstrip("/").removesuffix("/v1")
        self.response_length, self.prompt_length = response_length, prompt_length
        self.session, self.model, self.api_key, self.timeout_s = session, model, api_key, timeout_s

    def for_session(self, session: str) -> LibraServer:
        """The same server, naming `session` (verl's trajectory id) on every turn."""
        out = LibraServer(self.url, response_length=self.response_length, prompt_length=self.prompt_length,
                          session=str(session), model=self.model, api_key=self.api_key, timeout_s=self.timeout_s)  # fmt: skip
        return out

    @property
    def generate(self) -> _Remote:
        return _Remote(self._generate)

    async def _generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                        image_data: Any = None, video_data: Any = None, **_: Any):  # fmt: skip
        if image_data is not None or video_data is not None:
            raise ValueError("LibraServer sends token ids only: image_data and video_data are not supported")
        body = {
            "token_ids": list(prompt_ids),
            "sampling_params": self.vllm_params(len(prompt_ids), sampling_params),
        }
        if self.model:
            body["model"] = self.model
        answer = await self._post(body)
        return self.token_output(answer, body["sampling_params"].get("logprobs") is not None)

    def vllm_params(self, prompt_len: int, sampling_params: dict[str, Any]) -> dict[str, Any]:
        """verl's sampling parameters as its vLLM server turns them into vLLM's."""
        sp = dict(sampling_params)
        max_tokens = sp.pop("max_tokens", sp.pop("max_new_tokens", None))
        if max_tokens is None:
            room = self.response_length if self.prompt_length is None else self.prompt_length + self.response_length - prompt_len  # fmt: skip
            max_tokens = min(self.response_length, room)
        sp["max_tokens"] = max(1, int(max_tokens))
        sp["logprobs"] = 0 if sp.pop("logprobs", False) else None
        sp.setdefault("repetition_penalty", 1.0)
        return sp

    def token_output(self, answer: dict, logprobs: bool):
        choice = answer["choices"][0]
        ids = list(choice.get("token_ids") or [])
        lps = None
        if logprobs and isinstance(choice.get("logprobs"), dict):
            lps = [c["logprob"] for c in choice["logprobs"].get("content", [])]
        reason = choice.get("finish_reason")
        stop = "aborted" if reason == "abort" else "completed" if reason in ("stop", "length") else reason
        version = answer.get("weight_version")
        steps = int(version) if isinstance(version, str) and version.isdigit() else None
        extra = {"global_steps": steps, "weight_version": version, "session": self.session}
        return _token_output_cls()(token_ids=ids, log_probs=lps, routed_experts=None, stop_reason=stop,
                                   num_preempted=None, extra_fields=extra)  # fmt: skip

    async def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.session:
            headers["X-Session-ID"] = self.session
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with _pool().post(
            self.url + GENERATE_PATH, data=json.dumps(body), headers=headers, timeout=timeout
        ) as r:
            raw = await r.read()
        if r.status != 200:
            raise RuntimeError(f"Libra gateway {self.url}{GENERATE_PATH} answered {r.status}: {raw[:500].decode(errors='replace')}")  # fmt: skip
        return json.loads(raw)


class LibraLoadBalancer:
    """verl 0.9.1's `RequestLoadBalancer` (verl/workers/rollout/router.py) with one "server": the
    gateway. Each trajectory's `request_id` gets the gateway handle bound to it as the session.

    Built by verl from a router YAML (`LibraLoadBalancer(servers, yaml_config)`): the YAML gives
    `gateway_url`, `response_length` and optionally `prompt_length`, `model`, `api_key`. The
    servers verl launched are not used.
    """

    SERVER_ID = "libra-gateway"

    def __init__(self, servers: dict | None = None, config: dict | None = None, **kwargs: Any):
        cfg = {**(config or {}), **kwargs}
        keys = ("response_length", "prompt_length", "model", "api_key", "timeout_s")
        if not cfg.get("gateway_url"):
            raise ValueError(
                "LibraLoadBalancer needs gateway_url (the Libra gateway's base URL) in its router YAML"
            )
        self.server = LibraServer(cfg["gateway_url"], **{k: cfg[k] for k in keys if cfg.get(k) is not None})
        self.inflight = 0

    def acquire_server(self, request_id: str, **_: Any) -> tuple[str, LibraServer]:
        self.inflight += 1
        return self.SERVER_ID, self.server.for_session(request_id)

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        self.inflight = max(0, self.inflight - 1)

    def require_acquire_fields(self) -> list[str]:
        return []

    def require_release_fields(self) -> list[str]:
        return []

    def add_servers(self, servers: dict) -> None:
        """verl's own replicas are not routed to: the gateway has the engines."""

    def remove_servers(self, server_ids: list[str]) -> None:
        """As add_servers."""

    def get_all_servers(self) -> list[str]:
        return [self.SERVER_ID]

    def get_status(self) -> dict:
        return {"servers": [self.SERVER_ID], "total_inflight": self.inflight, "active_servers": 1}

    def clear_sticky_cache(self) -> dict:
        """Stickiness is the gateway's (its sessions); nothing is cached here."""
        return {"cleared_entries": 0, "server_loads": {self.SERVER_ID: self.inflight}}

    def get_total_inflight(self) -> int:
        return self.inflight

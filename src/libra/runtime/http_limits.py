"""What one client may hold of a live service: settings shared by the engine, the gateway and the
actions service (pydantic only, so configs import it without aiohttp).

A server that waits without a bound on its clients can be held by any of them: 300 connections
that each sent half a request line kept all three services' sockets and memory for over a minute,
and one request with 400k prompts queued 2 GB in an engine. So every service has:

- `header_timeout_s`: from the first byte of a request to the end of its headers; a connection
  still sending headers then is answered 408 and closed;
- `body_timeout_s`: reading a request's body (after its headers); then a 408 naming the setting;
- `idle_timeout_s`: a keep-alive connection with no request in it is closed after this long (above
  the 60 s the gateway's own client keeps idle connections, so the gateway never races a close);
- `max_connections_per_client`: open connections from one IP address; one more is answered 503
  and closed at once.

and the generation services (engine, gateway) bound one request's work:

- `max_prompts_per_request`: prompts in one batched /v1/completions or /generate request;
- `max_request_tokens`: tokens one request may queue, over all its sequences (prompts x n): each
  sequence's prompt tokens plus its max_tokens.

Each is a 4xx naming the field when exceeded. Defaults are in this one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

# Defaults (docs/gateway.md, docs/engine.md and docs/actions.md list them).
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 75.0
MAX_CONNECTIONS_PER_CLIENT = 4096  # a gateway is one client of each engine: room for its requests in flight
MAX_PROMPTS_PER_REQUEST = 4096
MAX_REQUEST_TOKENS = 2**22


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The connection limits one server enforces (`serving.limited_runner`)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT


class HttpLimitFields(BaseModel):
    """The connection settings, as fields of a service's config (a mixin)."""

    header_timeout_s: float = Field(
        HEADER_TIMEOUT_S, gt=0, le=3600, description="From a request's first byte to its headers' end."
    )
    body_timeout_s: float = Field(BODY_TIMEOUT_S, gt=0, le=3600, description="Reading one request's body.")
    idle_timeout_s: float = Field(
        IDLE_TIMEOUT_S, gt=0, le=86400, description="An idle keep-alive connection is closed after this."
    )
    max_connections_per_client: int = Field(
        MAX_CONNECTIONS_PER_CLIENT, ge=1, le=1_000_000, description="Open connections from one IP address."
    )

    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.header_timeout_s, self.body_timeout_s, self.idle_timeout_s, self.max_connections_per_client
        )


class RequestCapFields(BaseModel):
    """What one generation request may ask for, as fields of a service's config (a mixin)."""

    max_prompts_per_request: int = Field(
        MAX_PROMPTS_PER_REQUEST, ge=1, le=1_000_000, description="Prompts in one batched request."
    )
    max_request_tokens: int = Field(
        MAX_REQUEST_TOKENS,
        ge=1,
        le=2**40,
        description="Tokens one request may queue: over its sequences, prompt tokens plus max_tokens.",
    )


def batch_size(prompt: object) -> int:
    """How many prompts a `prompt` (or SGLang's `text`/`input_ids`) holds: a list of texts or of
    token-id lists is a batch; anything else is one prompt. Reads only the outer list."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1

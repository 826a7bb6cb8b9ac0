"""What every live server does around listening: take its port, bound what each client may hold,
then wait for SIGINT or SIGTERM.

The engine, the gateway, the instant backend and the actions service all run on aiohttp's
`AppRunner`; a signal ends the wait and `cleanup()` closes the sites and drains the handlers.

aiohttp itself bounds neither how long a client may take to send its headers nor how many
connections one client may open (its keep-alive timeout only covers a connection that sent
nothing). `limited_runner` adds both (`http_limits.HttpLimits`): a request whose headers are not
complete `header_timeout_s` after its first byte is answered 408 and its connection closed; a
client past `max_connections_per_client` open connections gets 503 and a close at once. The body
is read by the handlers, through `read_body`, within `body_timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import socket
from collections import Counter

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from libra.core.errors import ConfigError
from libra.runtime.http_limits import HttpLimits

HTTP_LIMITS = web.AppKey("http_limits", HttpLimits)


async def serve_until_signalled(runner: web.AppRunner) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def bind(host: str, port: int, field: str = "port") -> socket.socket:
    """The listening socket, taken before heavy imports (torch) so a busy port fails at once."""
    try:
        return socket.create_server((host, port), backlog=4096, dualstack_ipv6=False)
    except OSError as e:
        raise ConfigError(field, port, f"a free port on {host} ({e.strerror})") from None


def raise_fd_limit() -> None:
    """Each client holds a connection (a proxy two); the default 1024 fds is too few for the
    per-client limit to matter before the process runs out of descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def limited_runner(app: web.Application, limits: HttpLimits, **kwargs) -> web.AppRunner:
    """An `AppRunner` whose connections obey `limits` (module docstring); `kwargs` as AppRunner's."""
    app[HTTP_LIMITS] = limits
    raise_fd_limit()
    # After answering a request whose body did not all arrive, aiohttp reads on for its lingering
    # time before closing: no longer than a body may take.
    linger = min(10.0, limits.body_timeout_s)
    return _LimitedRunner(
        app, limits, keepalive_timeout=limits.idle_timeout_s, lingering_time=linger, **kwargs
    )


async def read_body(request: web.Request) -> bytes:
    """The request's whole body within the app's `body_timeout_s`; `BodyTimeout` past it."""
    limits = request.app.get(HTTP_LIMITS)
    if limits is None:
        return await request.read()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout(limits.body_timeout_s) from None


class BodyTimeout(Exception):
    """The body did not arrive in time: each service answers 408 naming `body_timeout_s`."""

    def __init__(self, seconds: float):
        super().__init__(f"the request body did not arrive within {seconds:g} s (body_timeout_s)")
        self.seconds = seconds


def _raw_response(status: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": None}}).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"  # fmt: skip
    return head.encode() + body


class _Clients:
    """Open connections per client address, shared by one server's connections."""

    def __init__(self, limit: int):
        self.limit, self.open = limit, Counter()

    def admit(self, addr: str) -> bool:
        if self.open[addr] >= self.limit:
            return False
        self.open[addr] += 1
        return True

    def release(self, addr: str) -> None:
        self.open[addr] -= 1
        if self.open[addr] <= 0:
            del self.open[addr]


class _LimitedHandler(RequestHandler):
    """aiohttp's connection handler with a header deadline and the per-client count."""

    __slots__ = ("_limits", "_clients", "_addr", "_header_timer")

    def __init__(self, manager, limits: HttpLimits, clients: _Clients, **kwargs):
        super().__init__(manager, **kwargs)
        self._limits, self._clients = limits, clients
        self._addr: str | None = None
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
        if not self._clients.admit(addr):
            limit = self._limits.max_connections_per_client
            msg = f"too many open connections from {addr} (max_connections_per_client = {limit})"
            transport.write(_raw_response("503 Service Unavailable", msg))
            transport.close()
            self._manager = None  # never started: connection_lost has nothing to undo
            return
        self._addr = addr
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_header_timer()
        if self._addr is not None:
            self._clients.release(self._addr)
            self._addr = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Waiting for the next request (no request in hand, none queued): its first byte starts
        # the header deadline; the request's headers completing (a queued message) stop it.
        waiting = self._waiter is not None and not self._waiter.done() and not self._messages
        if waiting and self._header_timer is None:
            self._header_timer = self._loop.call_later(self._limits.header_timeout_s, self._headers_late)
        super().data_received(data)
        if self._messages:
            self._stop_header_timer()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._messages or self.transport is None:
            return
        msg = f"the request headers did not arrive within {self._limits.header_timeout_s:g} s (header_timeout_s)"  # fmt: skip
        self.transport.write(_raw_response("408 Request Timeout", msg))
        self.force_close()


class _LimitedRunner(web.AppRunner):
    def __init__(self, app: web.Application, limits: HttpLimits, **kwargs):
        super().__init__(app, **kwargs)
        self._limits = limits

    async def _make_server(self):
        server = await super()._make_server()
        clients, limits = _Clients(self._limits.max_connections_per_client), self._limits

        def factory() -> RequestHandler:
            return _LimitedHandler(server, limits, clients, loop=server._loop, **server._kwargs)

        return _Factory(server, factory)


class _Factory:
    """The server, whose protocol factory makes `_LimitedHandler`s (sites call `runner.server()`)."""

    def __init__(self, server, factory):
        self._server, self._factory = server, factory

    def __call__(self) -> RequestHandler:
        return self._factory()

    def __getattr__(self, name: str):
        return getattr(self._server, name)

"""What every live server does around listening: take its port, then wait for SIGINT or SIGTERM.

The engine, the gateway, the instant backend and the actions service all run on aiohttp's
`AppRunner`; a signal ends the wait and `cleanup()` closes the sites and drains the handlers.
"""

from __future__ import annotations

import asyncio
import signal
import socket

from aiohttp import web

from libra.core.errors import ConfigError


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

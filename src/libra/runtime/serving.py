"""What every live server does once it is listening: wait for SIGINT or SIGTERM, then shut down.

The engine, the gateway, the instant backend and the actions service all run on aiohttp's
`AppRunner`; a signal ends the wait and `cleanup()` closes the sites and drains the handlers.
"""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web


async def serve_until_signalled(runner: web.AppRunner) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()

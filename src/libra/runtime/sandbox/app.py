"""Start the sandboxed actions service from its validated config.

The CLI parses arguments into a `ServiceConfig`; deciding the isolation (bubblewrap, or an explicit
opt-out) and running the HTTP server live here, so launchers and tests start the same service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import TYPE_CHECKING

from libra.core.errors import LibraError
from libra.runtime.sandbox.config import ServiceConfig

if TYPE_CHECKING:
    from libra.runtime.sandbox.sandbox import Isolation
    from libra.runtime.sandbox.uidrange import UidRange


def isolation(cfg: ServiceConfig, insecure_no_sandbox: bool) -> tuple[Isolation, UidRange | None]:
    """bubblewrap when the host allows it, under a uid range this service owns alone; without it,
    only on the caller's explicit opt-out."""
    from libra.runtime.sandbox import uidrange
    from libra.runtime.sandbox.sandbox import Isolation, contain, host_problem, probe

    reason = host_problem()
    if reason is None:
        uids = uidrange.acquire(cfg.sandbox.uid_base, cfg.sandbox.uid_count)
        iso = probe(cfg.sandbox, uids.base)
        if iso.sandboxed:
            cores = sorted(cfg.cores if cfg.cores is not None else os.sched_getaffinity(0))
            contain(iso, cfg.sandbox, f"libra-actions-{uids.base}", cores)
            return iso, uids
        uids.release()
        reason = iso.reason
    if not insecure_no_sandbox:
        raise LibraError(
            f"sandbox unavailable: {reason}. Install bubblewrap (Debian: apt-get install bubblewrap) "
            "and run the service as root, or pass --insecure-no-sandbox to run actions without isolation."
        )
    print(f"warning: running actions WITHOUT a sandbox ({reason})", file=sys.stderr)
    return Isolation(False, reason), None


def run(cfg: ServiceConfig, insecure_no_sandbox: bool = False) -> None:
    iso, uids = isolation(cfg, insecure_no_sandbox)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(cfg, iso, uids))
    finally:
        if uids is not None:
            uids.release()


async def serve(cfg: ServiceConfig, iso: Isolation, uids: UidRange | None) -> None:
    from aiohttp import web

    from libra.runtime.sandbox.service import ActionsService
    from libra.runtime.serving import limited_runner, serve_until_signalled

    service = ActionsService(cfg, iso, uids)
    # A client that goes away cancels its handler: a queued action is withdrawn (dispatch.py).
    runner = limited_runner(service.app(), cfg.http_limits(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    kind = "bwrap" if iso.sandboxed else "NONE"
    owned = f", uids: {uids.base}-{uids.base + uids.count - 1}" if uids is not None else ""
    limits = "".join(f"\n  {k}: {v}" for k, v in iso.notes.items())
    found = service.toolchains
    missing = "".join(f"\n  {k}: {v}" for k, v in found.missing.items())
    print(f"languages: {', '.join(found.available)}" + (f"\nmissing languages:{missing}" if missing else "")
          + (f"\nlimits:{limits}" if limits else ""), file=sys.stderr)  # fmt: skip
    print(f"libra actions service listening on http://{cfg.host}:{port} "
          f"(isolation: {kind}, cores: {len(service.cores)}{owned})", file=sys.stderr, flush=True)  # fmt: skip
    await serve_until_signalled(runner)

"""`libra serve actions`: start the sandboxed actions service (see `libra.runtime.actions`)."""

from __future__ import annotations

import asyncio
import logging

import click

from libra.commands.common import set_option_for
from libra.core.config import load_model
from libra.core.errors import LibraError
from libra.runtime.actions.config import ServiceConfig


@click.command()
@click.option("--host", default=None, help="Address to listen on [default: 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port to listen on; 0 picks a free one [default: 8080].")
@click.option("--config", type=click.Path(dir_okay=False), default=None, help="Service configuration YAML.")
@click.option(
    "--insecure-no-sandbox",
    is_flag=True,
    help="Run actions without bubblewrap isolation (rlimits and affinity only). Never on shared machines.",
)
@set_option_for("warm_pool=8")
def actions(host, port, config, insecure_no_sandbox, overrides):
    """Sandboxed actions service: SandboxFusion /run_code, sessions, quota-limited tools."""
    flags = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    cfg = load_model(ServiceConfig, config, [*overrides, *(f"{k}={v}" for k, v in flags.items())])
    from libra.runtime.actions.sandbox import Isolation, probe

    iso = probe(cfg.sandbox)
    if not iso.sandboxed:
        if not insecure_no_sandbox:
            raise LibraError(
                f"sandbox unavailable: {iso.reason}. Install bubblewrap (Debian: apt-get install bubblewrap) "
                "and run the service as root, or pass --insecure-no-sandbox to run actions without isolation."
            )
        click.echo(f"warning: running actions WITHOUT a sandbox ({iso.reason})", err=True)
        iso = Isolation(False, iso.reason)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(cfg, iso))


async def serve(cfg: ServiceConfig, iso) -> None:
    from aiohttp import web

    from libra.runtime.actions.service import ActionsService
    from libra.runtime.serving import serve_until_signalled

    service = ActionsService(cfg, iso)
    # A client that goes away cancels its handler: a queued action is withdrawn (dispatch.py).
    runner = web.AppRunner(service.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    isolation = "bwrap" if iso.sandboxed else "NONE"
    click.echo(f"libra actions service listening on http://{cfg.host}:{port} "
               f"(isolation: {isolation}, cores: {len(service.cores)})", err=True)  # fmt: skip
    await serve_until_signalled(runner)

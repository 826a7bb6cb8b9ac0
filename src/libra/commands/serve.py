"""`libra serve`: live services. Each lives in `libra.runtime` and needs the `serve` extra.

Subcommands are imported only when invoked, so a missing optional dependency gives one clear line
instead of breaking `libra --help`.
"""

from __future__ import annotations

import importlib
import importlib.util

import click

from libra.core.errors import ConfigError

# name -> ("module:attribute", help). One line per service.
SERVICES = {
    "gateway": ("libra.runtime.gateway.cli:gateway", "OpenAI-compatible gateway that routes with C-MLFQ."),
    "engine": ("libra.runtime.engine.cli:engine", "Built-in CPU inference engine (small torch transformer)."),
    "actions": ("libra.runtime.actions.cli:actions", "Sandboxed actions service (SandboxFusion-compatible)."),
}


class _ServeGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(
            n for n in SERVICES if importlib.util.find_spec(SERVICES[n][0].split(":")[0].rsplit(".", 1)[0])
        )

    def get_command(self, ctx, name):
        if name not in SERVICES:
            return None
        module, attr = SERVICES[name][0].split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            raise ConfigError(
                "serve",
                name,
                f"the 'serve' extra installed (missing module {e.name!r}): pip install 'libra[serve,train]'",
            ) from None


@click.group(cls=_ServeGroup)
def serve() -> None:
    """Run a live service: gateway, engine or actions."""

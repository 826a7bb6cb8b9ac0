"""The `libra` command.

Subcommands live in `libra.cli.*`, one module each, imported only when used, so `libra --help` and
`libra costmodel ...` stay fast and never import heavy optional dependencies. Every error a user
can cause becomes one line on stderr and exit code 2; no traceback reaches a user.
"""

from __future__ import annotations

import importlib.util
import sys

import click

from libra.core.errors import LibraError
from libra.core.registry import Registry

# name -> ("module:attribute", help). One line per command: this is the only place a command is
# registered. The help is here so that `libra --help` imports no command module.
LISTED = {
    "costmodel": ("libra.cli.costmodel:costmodel", "Query and calibrate the cost model."),
    "simulate": ("libra.cli.simulate:simulate", "Simulate agentic RL post-training systems."),
    "explore": ("libra.cli.explore:explore", "Map where each mechanism pays over a grid of regimes."),
    "trace": ("libra.cli.trace:trace", "Generate and inspect trajectory traces."),
    "replay-vllm": (
        "libra.cli.replay:replay_vllm",
        "Replay a real vLLM benchmark on the simulated engine.",
    ),
    "plan": ("libra.cli.plan:plan", "Run the global resource planner on a scenario."),
    "native": ("libra.cli.native:native", "Build or check the compiled simulator modules."),
    "serve": ("libra.cli.serve:serve", "Run a live service: gateway, engine or actions."),
    "route": ("libra.cli.route:route", "Score routers offline on a trajectory trace."),
    "train": ("libra.cli.train:train", "Train live: agentic GRPO through the gateway and actions service."),
}


COMMANDS: Registry[click.Command] = Registry(
    "command", "command", {name: target for name, (target, _) in LISTED.items()}, outside=False
)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if _available(name))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not _available(name):
            return None
        return COMMANDS[name]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(n, LISTED[n][1]) for n in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _available(name: str) -> bool:
    spec = COMMANDS.spec(name)
    return spec is None or importlib.util.find_spec(spec.split(":")[0]) is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="libra")
def cli() -> None:
    """Libra: C-MLFQ routing, a global planner, an elastic pool and action-level orchestration
    for agentic RL post-training, in simulation and live."""


def main(argv: list[str] | None = None) -> None:
    try:
        rv = cli.main(args=argv, prog_name="libra", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:
        where = f" (in '{e.ctx.command_path}')" if e.ctx else ""
        click.echo(f"error: {e.format_message()}{where}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code if e.exit_code else 2)
    except LibraError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    sys.exit(rv if isinstance(rv, int) else 0)

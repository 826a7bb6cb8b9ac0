"""`libra native`: build the compiled simulator modules, or say whether they are in use."""

from __future__ import annotations

import sys

import click

from libra import native as nat


@click.group()
def native() -> None:
    """Compiled (mypyc) builds of the simulator's hot modules: ~1.4x faster, identical results."""


@native.command()
@click.option("--if-stale", is_flag=True, help="Do nothing when the build is up to date.")
def build(if_stale: bool) -> None:
    """Compile the modules in place. Needs mypy (`pip install -e .[native]`) and a C compiler."""
    sys.exit(nat.build(if_stale))


@native.command()
def status() -> None:
    """Print whether the compiled modules are used, and why; exit 1 when they are not."""
    ok, why = nat.status()
    click.echo(why)
    sys.exit(0 if ok else 1)

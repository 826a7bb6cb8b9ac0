"""The README's commands run as written.

Every command the README shows is checked here, one of three ways:
- run for real, as shown (the cheap ones);
- run by its own test (the Serve block: tests/test_gateway_readme.py; the `libra train` example is
  the smoke run of tests/test_train_live.py, same sizes), and parsed here;
- parsed by the real command, flag by flag, where running it takes too long for CI (`make demo`,
  `libra explore` on the default grid): every option must exist and every value must be allowed.
A command the README adds is caught by the count at the end, so nothing shown goes unchecked.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import warnings
from pathlib import Path

import click
import pytest

from libra.cli import cli
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


def commands() -> list[str]:
    """Each shell command the README shows: `$ ` lines of plain blocks, every line of bash blocks."""
    text = (ROOT / "README.md").read_text()
    out = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        body = body.replace("\\\n", " ")
        for line in body.splitlines():
            line = line.split("  #")[0].strip()
            if lang == "bash" and line:
                out.append(line)
            elif line.startswith("$ "):
                out.append(line[2:])
    return out


def libra_args(cmd: str) -> list[str] | None:
    """The arguments of a `libra ...` command (`.venv/bin/libra`, `sudo` and redirections dropped)."""
    words = shlex.split(cmd.split(">")[0].split("&")[0])
    words = words[1:] if words and words[0] == "sudo" else words
    if not words or Path(words[0]).name != "libra":
        return None
    return words[1:]


def parse(args: list[str]) -> click.Context:
    """Parse `args` with the real command tree, as `libra` would, without running anything."""
    ctx = cli.make_context("libra", list(args), resilient_parsing=False)
    while isinstance(ctx.command, click.Group) and _rest(ctx):
        name, cmd, rest = ctx.command.resolve_command(ctx, _rest(ctx))
        ctx = cmd.make_context(name, rest, parent=ctx)
    return ctx


def _rest(ctx: click.Context) -> list[str]:
    """A group's unparsed words (click 8.2 deprecates `protected_args`, 9 folds it into `args`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return [*getattr(ctx, "protected_args", []), *ctx.args]


LIBRA = [a for a in map(libra_args, commands()) if a is not None]


@pytest.mark.parametrize("args", LIBRA, ids=[" ".join(a[:2]) for a in LIBRA])
def test_every_libra_command_parses(args):
    parse(args)  # raises click's UsageError on an unknown option or a value it does not allow


def test_the_simulate_example_runs(tmp_path):
    args = next(a for a in LIBRA if a[0] == "simulate")
    r = run_cli(*args, "--out", str(tmp_path), "--no-tensorboard")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "libra:" in r.stdout and "x static-optimal" in r.stdout


@pytest.mark.parametrize("target", ["demo", "test"])
def test_the_quick_start_targets_exist(target):
    r = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_parse_error_is_caught():
    """The parse check can fail: a flag no command has."""
    with pytest.raises(click.UsageError):
        parse(["simulate", "--no-such-flag"])
    with pytest.raises(click.BadParameter):
        parse(["train", "--launcher", "slurm"])


def test_every_command_shown_is_checked():
    """make demo and make test, the libra commands above, and the Serve block's own test."""
    cmds = commands()
    other = [c for c in cmds if libra_args(c) is None and not c.startswith("make ")]
    serve_block = [c for c in other if c.startswith(("until ", "curl ", "kill "))]
    assert other == serve_block, other  # anything else would go unchecked
    assert {"make demo", "make test"} <= {c.split("  ")[0] for c in cmds}
    assert {a[0] for a in LIBRA} >= {"simulate", "explore", "train", "serve"}

"""Options and output helpers shared by every subcommand: --json, --set, --catalog, tables."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from libra.core.errors import ConfigError

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table."
)


def set_option_for(example: str):
    """`--set KEY=VALUE`, with an example key of the command's own config."""
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help=f"Override one config value (repeatable), e.g. {example}.",
    )


set_option = set_option_for("split.train_gpus=32")  # a scenario's
catalog_option = click.option(
    "--catalog",
    "catalogs",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Extra hardware/model catalog YAML (repeatable).",
)
profile_option = click.option(
    "--profile",
    type=click.Path(dir_okay=False),
    default=None,
    help="Calibration profile YAML (from `libra costmodel calibrate`).",
)


def writable_dir(path: Path, field: str = "--out") -> Path:
    """Create `path` if needed and prove a file can be written there, before long work that would
    otherwise be lost at its end."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise ConfigError(field, str(path), f"a directory this user can write ({e.strerror})") from None
    return path


def writable_file(path: Path, field: str = "--out") -> Path:
    """Prove `path` can be written (its directory exists and takes files), before long work.

    An existing path must be a regular file: outputs are written beside it and renamed over it,
    which would replace a device such as /dev/null with a regular file."""
    if path.is_dir():
        raise ConfigError(field, str(path), "a file path, not a directory")
    if path.exists() and not path.is_file():
        raise ConfigError(field, str(path), "a regular file path (this is a device or special file)")
    try:
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        raise ConfigError(field, str(path), f"a writable file path ({e.strerror})") from None
    return path


# Piped output gets a wide console so tables are not squeezed into 80 columns.
console = Console(stderr=False, highlight=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False)


def emit_json(obj: object, out: str | Path | None = None) -> None:
    text = json.dumps(obj, indent=2, sort_keys=False, default=_json_default)
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")
    else:
        sys.stdout.write(text + "\n")


def _json_default(o: object):
    if hasattr(o, "model_dump"):
        return o.model_dump()
    if hasattr(o, "__float__"):
        return float(o)
    return str(o)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> Table:
    """A rich table: the first `left` columns (labels) left-justified, the rest (figures) right."""
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i < left else "right")
    for r in rows:
        t.add_row(*[fmt(v) for v in r])
    return t


def fmt(v: object) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.4g}"
    return str(v)


def curve_options(fn):
    """`--tensorboard/--no-tensorboard` and `--wandb`: where the per-step curves go
    (`libra.core.curves`); TensorBoard is on by default when its extra is installed."""
    fn = click.option("--wandb", "wandb_on", is_flag=True, help="Also log to W&B, offline, in OUT/wandb (needs libra[wandb]).")(fn)  # fmt: skip
    fn = click.option("--wandb-project", default="libra", show_default=True, help="The W&B project name.")(fn)
    return click.option(
        "--tensorboard/--no-tensorboard", "tensorboard", default=None,
        help="TensorBoard event files in OUT/tb [default: on when libra[tensorboard] is installed].",
    )(fn)  # fmt: skip


def curves_of(tensorboard: bool | None, wandb_on: bool, wandb_project: str):
    """The `CurveOptions` of those flags, checked now (a missing extra is exit 2 before the run)."""
    from libra.core.curves import CurveOptions, Toggle

    tb = Toggle.AUTO if tensorboard is None else Toggle.ON if tensorboard else Toggle.OFF
    opts = CurveOptions(tb, Toggle.ON if wandb_on else Toggle.OFF, wandb_project)
    opts.resolve()
    return opts

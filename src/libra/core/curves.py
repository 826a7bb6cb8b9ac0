"""Per-step curves where RL users look: TensorBoard event files, and W&B in offline mode.

verl, slime, SkyRL, OpenRLHF and TRL all log their curves there, so `libra train` and `libra
simulate` do too, beside their own steps.json. Both writers are optional extras (`tensorboard`:
tensorboardX, a few hundred kB; `wandb`), imported only when a run asks for them, so the core
stays light. TensorBoard is on by default when its extra is installed (`auto`); asking for a
writer whose extra is missing is an error that names the extra, before the run starts.

A run writes under its own folder: `tb/` (one subfolder per series, e.g. one per simulated
system, so TensorBoard overlays them as runs) and `wandb/` (offline runs; `wandb sync` uploads
them later).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from libra.core.errors import ConfigError


class Toggle(str, Enum):
    AUTO = "auto"  # on when the extra is installed
    ON = "on"  # required: missing extra is an error
    OFF = "off"


EXTRAS = {"tensorboard": ("tensorboardX", "libra[tensorboard]"), "wandb": ("wandb", "libra[wandb]")}


def installed(writer: str) -> bool:
    return importlib.util.find_spec(EXTRAS[writer][0]) is not None


@dataclass(frozen=True, slots=True)
class CurveOptions:
    """Which writers a run uses; `resolve` turns `auto` into on or off and checks the extras."""

    tensorboard: Toggle = Toggle.AUTO
    wandb: Toggle = Toggle.OFF
    wandb_project: str = "libra"

    def resolve(self) -> tuple[bool, bool]:
        return _want("tensorboard", self.tensorboard), _want("wandb", self.wandb)


def _want(writer: str, toggle: Toggle) -> bool:
    if toggle == Toggle.OFF:
        return False
    if installed(writer):
        return True
    if toggle == Toggle.ON:
        module, extra = EXTRAS[writer]
        raise ConfigError(f"--{writer}", "on", f"the {module} package: pip install '{extra}'")
    return False


@dataclass(slots=True)
class Curves:
    """Scalars per step for one run, in every writer the options resolve to (possibly none)."""

    folder: Path
    options: CurveOptions = field(default_factory=CurveOptions)
    name: str = "run"
    config: Mapping[str, object] = field(default_factory=dict)
    _tb: dict[str, object] = field(default_factory=dict, repr=False)
    _wandb: object | None = field(default=None, repr=False)
    _enabled: tuple[bool, bool] = (False, False)

    def __post_init__(self) -> None:
        self._enabled = self.options.resolve()

    @property
    def writers(self) -> list[str]:
        return [w for w, on in zip(("tensorboard", "wandb"), self._enabled, strict=True) if on]

    def log(self, step: int, scalars: Mapping[str, float], series: str = "") -> None:
        """Write `scalars` (tag -> value; `None` values skipped) at `step`, in the series' run."""
        values = {k: float(v) for k, v in scalars.items() if v is not None}
        if self._enabled[0]:
            writer = self._tensorboard(series)
            for tag, v in values.items():
                writer.add_scalar(tag, v, step)  # type: ignore[attr-defined]
            writer.flush()  # type: ignore[attr-defined]
        if self._enabled[1]:
            prefix = f"{series}/" if series else ""
            self._run().log({prefix + k: v for k, v in values.items()}, step=step)  # type: ignore[attr-defined]

    def close(self) -> None:
        for w in self._tb.values():
            w.close()  # type: ignore[attr-defined]
        self._tb.clear()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()  # type: ignore[attr-defined]
            # finish() can return before the offline writer has flushed the run file; tearing
            # the service down waits for it (a run's Curves is closed once, at its end).
            wandb.teardown()
            self._wandb = None

    def _tensorboard(self, series: str):
        if series not in self._tb:
            writer = _summary_writer()
            self._tb[series] = writer(str(self.folder / "tb" / (series or self.name)), flush_secs=5)
        return self._tb[series]

    def _run(self):
        if self._wandb is None:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=self.options.wandb_project, name=self.name, dir=str(self.folder), mode="offline",
                config=dict(self.config), reinit="finish_previous",
            )  # fmt: skip
        return self._wandb


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without pulling torch in when torch is not loaded yet.

    tensorboardX's writer module imports torch if it is installed, only to name `torch.Tensor` in
    its type hints (turning a tensor into numbers imports torch itself, when one is given). That
    import is ~2 CPU seconds, most of a short `libra simulate`, which logs plain floats and has no
    other use for torch. A `None` in `sys.modules` makes `import torch` raise ImportError, the
    writer's own fallback; the entry is removed at once, so a later `import torch` works as usual.
    """
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def flatten(prefix: str, obj: object, out: dict[str, float] | None = None) -> dict[str, float]:
    """The numbers of a nested JSON-like object as `prefix/a/b` tags (bools as 0/1, rest skipped)."""
    out = {} if out is None else out
    if isinstance(obj, bool):
        out[prefix] = float(obj)
    elif isinstance(obj, int | float):
        out[prefix] = float(obj)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    return out

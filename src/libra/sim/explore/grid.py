"""The regime grid `libra explore` sweeps: a base scenario and axes of `--set` overrides.

Why overrides: a cell must be exactly what `libra simulate --scenario S --set k=v ...` runs, so
that a user can rerun any cell of the map on its own and get the same figures. An axis is either
one dotted key with a list of values (`key: workload.prompts_per_step, values: [16, 32, 64]`) or
named sets of overrides (`sets: {late: {workload.first_step: 100}, early: {}}`), for a regime
that needs several keys at once (a larger model and its training layout). Cells are the product of
the axes, in the order the file lists them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from libra.core.config import build, load_yaml
from libra.core.errors import ConfigError

GRID_DIR = Path(__file__).resolve().parents[2] / "scenarios" / "grids"
MAX_CELLS = 4096  # a grid this large is a typo (each cell is a simulation of several systems)


class Axis(BaseModel):
    """One dimension of the regime: a key and its values, or labelled sets of overrides."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    name: str = Field(min_length=1, max_length=40)
    key: str | None = Field(None, description="the dotted scenario key this axis sets")
    values: list[Any] = Field(default_factory=list, description="the key's values, one per point")
    sets: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="label -> {dotted key: value}, one per point"
    )

    @model_validator(mode="after")
    def _one_form(self) -> Axis:
        if (self.key is None) == (not self.sets):
            raise ValueError(f"axis {self.name}: give either key and values, or sets")
        if self.key is not None and not self.values:
            raise ValueError(f"axis {self.name}: values must list at least one value")
        return self

    def points(self) -> list[tuple[str, list[str]]]:
        """(label, overrides) per point, overrides as `--set` strings."""
        if self.key is not None:
            return [(_label(v), [f"{self.key}={_yaml(v)}"]) for v in self.values]
        return [(label, [f"{k}={_yaml(v)}" for k, v in over.items()]) for label, over in self.sets.items()]


class Grid(BaseModel):
    """A sweep: the base scenario, how long each cell runs, common overrides and the axes."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    name: str = "grid"
    description: str = ""
    scenario: str = "libra-r2e-48gpu"
    steps: int = Field(12, ge=2, le=1000, description="RL steps each cell simulates")
    seed: int = 0
    set: list[str] = Field(default_factory=list, description="overrides every cell applies first")
    trace: str | None = Field(
        None, description="a JSONL trajectory trace every cell replays instead of the scenario's workload"
    )
    systems: list[str] | None = Field(
        None,
        description="the systems every cell runs (`libra explore --systems`); default: the static "
        "configurations, the ladder and the peers (`sim.explore.sweep.cell_systems`)",
    )
    axes: list[Axis] = Field(min_length=1, max_length=6)

    @model_validator(mode="after")
    def _size(self) -> Grid:
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"axis names must be unique: {names}")
        n = 1
        for a in self.axes:
            n *= len(a.points())
        if n > MAX_CELLS:
            raise ValueError(f"the grid has {n} cells; at most {MAX_CELLS}")
        return self

    def cells(self) -> list[Cell]:
        pts = [a.points() for a in self.axes]
        out = []
        for combo in itertools.product(*pts):
            settings = {a.name: label for a, (label, _) in zip(self.axes, combo, strict=True)}
            overrides = [*self.set, *(o for _, over in combo for o in over)]
            out.append(Cell(len(out), settings, overrides))
        return out


@dataclass(frozen=True, slots=True)
class Cell:
    """One point of the grid: its label per axis and the overrides that make it."""

    index: int
    settings: dict[str, str]
    overrides: list[str]

    def command(self, grid: Grid, systems: list[str]) -> str:
        """The `libra simulate` command that runs exactly this cell."""
        sets = " ".join(f"--set {o}" for o in self.overrides)
        trace = f"--trace {grid.trace} " if grid.trace else ""
        return (f"libra simulate --scenario {grid.scenario} {trace}--steps {grid.steps} --seed {grid.seed} "
                f"--systems {','.join(systems)} {sets}").strip()  # fmt: skip


def _yaml(v: Any) -> str:
    """A value as `--set` parses it back (YAML flow style, one line)."""
    return yaml.safe_dump(v, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _label(v: Any) -> str:
    return str(v) if not isinstance(v, dict | list) else _yaml(v)


def list_grids() -> list[str]:
    return sorted(p.stem for p in GRID_DIR.glob("*.yaml"))


def load_grid(name_or_path: str | None) -> Grid:
    """A shipped grid by name (default: `default`), or a YAML file by path, validated."""
    name_or_path = name_or_path or "default"
    p = Path(name_or_path)
    if not (p.suffix in (".yaml", ".yml") and p.exists()):
        p = GRID_DIR / f"{name_or_path}.yaml"
        if not p.exists():
            raise ConfigError("--grid", name_or_path, list_grids() + ["a path to a grid YAML"])
    data = load_yaml(p)
    if isinstance(data, dict):
        data.setdefault("name", p.stem)
    return build(Grid, data, prefix="grid")

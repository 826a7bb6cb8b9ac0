"""Scenario files: loading them into typed models, and the program that simulates each kind.

A scenario is a YAML file shipped in `libra/scenarios/` (or given by path). Its `kind` picks the
model and the program: `rl` (`RLScenario`, the RL post-training pipeline in `libra.sim.rl`) or
`tangram` (`TangramScenario`, action-level orchestration in `libra.sim.tangram`). Loading applies
`--set` overrides to the file's mapping and then validates it, so every default comes from the
model and a bad or missing value is one line naming the field. A program is a function

    run(scenario, systems: list[str] | None, steps: int | None, seed: int, out_dir: Path | None,
        progress: Callable[[str, float], None], **options) -> dict

returning {"systems": {NAME: {...metrics...}}, ...}. `libra simulate` writes it to summary.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from pydantic import Field

from libra.core.config import apply_overrides, build, load_yaml
from libra.core.errors import ConfigError
from libra.core.registry import Registry
from libra.costmodel.catalog import Catalog, load_catalog
from libra.sim.rl.config import RLScenario, parse_rl
from libra.sim.tangram.config import TangramScenario

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "scenarios"

# Discriminated on `kind`; a file without one is an RL scenario.
Scenario = Annotated[RLScenario | TangramScenario, Field(discriminator="kind")]
MODELS: dict[str, type[RLScenario] | type[TangramScenario]] = {"rl": RLScenario, "tangram": TangramScenario}
PROGRAMS = Registry(
    "scenario kind",
    "scenario.kind",
    {"rl": "libra.sim.rl.pipeline:run", "tangram": "libra.sim.tangram.runner:run"},
    outside=False,
)


def list_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def scenario_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    p = SCENARIO_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        raise ConfigError("scenario", name_or_path, list_scenarios() + ["a path to a scenario YAML"])
    return p


def read_scenario(name_or_path: str, overrides: Sequence[str] = ()) -> dict:
    """The scenario's mapping with `--set` overrides applied, `name` and `kind` filled in."""
    p = scenario_path(name_or_path)
    data = apply_overrides(load_yaml(p), list(overrides))
    data.setdefault("name", p.stem)
    data.setdefault("kind", "rl")
    if data["kind"] not in MODELS:
        raise ConfigError("scenario.kind", data["kind"], sorted(MODELS))
    return data


def parse_scenario(data: dict, catalog: Catalog | None = None, split: bool = True) -> Scenario:
    """Validate a scenario mapping into its kind's model (RL scenarios are also checked against the
    catalog: hardware, model, TP degrees; and, unless `split=False`, the GPU split)."""
    kind = data.get("kind", "rl")
    if kind not in MODELS:
        raise ConfigError("scenario.kind", kind, sorted(MODELS))
    if kind == "rl":
        return parse_rl({**data, "kind": kind}, catalog or load_catalog(), split)
    return build(MODELS[kind], {**data, "kind": kind}, prefix="scenario")


def load_scenario(
    name_or_path: str, overrides: Sequence[str] = (), catalog: Catalog | None = None, split: bool = True
) -> Scenario:
    """A shipped scenario by name, or a YAML file by path, with overrides, validated."""
    return parse_scenario(read_scenario(name_or_path, overrides), catalog, split)


def run_scenario(sc: Scenario, *args, **options) -> dict:
    """Simulate the scenario with its kind's program."""
    return PROGRAMS[sc.kind](sc, *args, **options)

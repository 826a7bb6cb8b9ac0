"""Scenario files and the runners that simulate them.

A scenario is a YAML file shipped in `libra/scenarios/` (or given by path). Its `kind` picks the
runner: `rl` (the RL post-training pipeline, `libra.sim.rl.pipeline`) or `tangram` (action-level
orchestration of external resources, `libra.sim.tangram.runner`). A runner is a function

    run(scenario: dict, systems: list[str] | None, steps: int | None, seed: int,
        out_dir: Path | None, progress: Callable[[str, float], None]) -> dict

returning {"systems": {NAME: {...metrics...}}, ...}. `libra simulate` writes it to summary.json.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from libra.core.config import load_yaml
from libra.core.errors import ConfigError

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "scenarios"

RUNNERS = {
    "rl": "libra.sim.rl.pipeline:run",
    "tangram": "libra.sim.tangram.runner:run",
}


def list_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def load_scenario(name_or_path: str) -> dict:
    p = Path(name_or_path)
    if not (p.suffix in (".yaml", ".yml") and p.exists()):
        p = SCENARIO_DIR / f"{name_or_path}.yaml"
        if not p.exists():
            raise ConfigError("scenario", name_or_path, list_scenarios() + ["a path to a scenario YAML"])
    data = load_yaml(p)
    data.setdefault("name", p.stem)
    kind = data.get("kind", "rl")
    if kind not in RUNNERS:
        raise ConfigError("scenario.kind", kind, RUNNERS.keys())
    data["kind"] = kind
    return data


def runner_for(kind: str):
    module, attr = RUNNERS[kind].split(":")
    return getattr(importlib.import_module(module), attr)

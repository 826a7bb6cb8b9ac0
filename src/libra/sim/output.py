"""What every simulation program writes the same way: summary.json and steps.json.

`summary.json` holds the run's result without its per-step rows and nothing that depends on the
wall clock, so the same seed gives a byte-identical file; `steps.json` holds the per-step rows.
Each program adds its own plots; timelines go through `libra.sim.tracing`.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_json(obj: object, path: Path) -> Path:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def write_results(out: dict, out_dir: Path) -> list[Path]:
    """summary.json (everything but `per_step`) and steps.json (`per_step`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {k: v for k, v in out.items() if k != "per_step"}
    return [
        write_json(summary, out_dir / "summary.json"),
        write_json(out["per_step"], out_dir / "steps.json"),
    ]

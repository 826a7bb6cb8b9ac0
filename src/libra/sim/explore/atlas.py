"""The shipped map: where each mechanism pays, as `libra simulate` prints it below the ladder.

`scenarios/grids/default.map.json` is the `explore.json` of the default grid, measured and
committed (`libra explore --out DIR`, then copy DIR/explore.json there), so that every run of
`libra simulate` can say what the map found without sweeping it again. A mechanism *pays* in a
cell when its rung adds at least `PAYS` (5%) over the rung below.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from libra.sim.explore.grid import GRID_DIR

MAP_FILE = GRID_DIR / "default.map.json"
PAYS = 0.05


def load_map(path: Path = MAP_FILE) -> dict | None:
    """The shipped map, or None if it is missing or unreadable (the lines are then left out)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def pays_lines(result: dict, threshold: float = PAYS) -> list[str]:
    """One line per mechanism: in how many cells it pays, its best gain, and where."""
    ok = [c for c in result["cells"] if c.get("error") is None]
    name, lines = result["grid"]["name"], []
    for mech in result["mechanisms"]:
        best = result["best_gain"].get(mech)
        if best is None:
            continue
        where = ", ".join(f"{k}={v}" for k, v in best["cell"].items())
        paying = sum(
            1 for c in ok if c["gains"].get(mech, -math.inf) >= threshold
        )  # `--systems` maps lack some
        if paying:
            lines.append(f"{mech}: pays >= {threshold:.0%} in {paying} of {len(ok)} cells of the {name} map, "
                         f"most {best['gain']:+.1%} ({where})")  # fmt: skip
        else:
            lines.append(f"{mech}: under {threshold:.0%} in every cell of the {name} map "
                         f"(best {best['gain']:+.1%}, {where})")  # fmt: skip
    return lines

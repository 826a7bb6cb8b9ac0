"""What `libra explore` writes: explore.json and one heatmap PNG per mechanism (and the limit).

A heatmap's columns are the grid's last axis and its rows every combination of the others, so a
grid of any number of axes reads as one picture per mechanism: a cell's colour is the mechanism's
gain over the rung below it (percent), and its text the figure itself.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from libra.sim.output import write_json  # noqa: E402


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [write_json(result, out_dir / "explore.json")]
    ok = [c for c in result["cells"] if c["error"] is None]
    if not ok:
        return paths
    for mech in result["mechanisms"]:
        values = {c["index"]: 100 * c["gains"][mech] for c in ok if mech in c["gains"]}
        if not values:  # a rung of it, or the rung below, was not run (`--systems`)
            continue
        title = f"{mech}: gain over the rung below, % ({result['grid']['name']})"
        paths.append(heatmap(result, values, title, out_dir / f"gain_{mech}.png", diverging=True))
    top = result.get("top", result["systems"][-1])
    values = {c["index"]: 100 * c["distance_to_limit"][top] for c in ok if top in c["distance_to_limit"]}
    if values:
        title = f"{top}: rollout makespan over its lower bound, % above ({result['grid']['name']})"
        paths.append(heatmap(result, values, title, out_dir / "distance_to_limit.png", diverging=False))
    peers = {c["index"]: 100 * c["libra_vs_best_peer"] for c in ok if c.get("libra_vs_best_peer") is not None}
    if peers:
        title = f"libra over the best peer, % ({result['grid']['name']})"
        paths.append(heatmap(result, peers, title, out_dir / "libra_vs_best_peer.png", diverging=True))
    return paths


def _layout(result: dict) -> tuple[list[str], list[str], dict[int, tuple[int, int]]]:
    """Row labels, column labels, and each cell's (row, column)."""
    axes = result["grid"]["axes"]
    last = axes[-1]["name"]
    rows: list[str] = []
    cols: list[str] = []
    where = {}
    for c in result["cells"]:
        s = c["settings"]
        row = ", ".join(f"{k}={v}" for k, v in s.items() if k != last) or "-"
        col = s[last]
        if row not in rows:
            rows.append(row)
        if col not in cols:
            cols.append(col)
        where[c["index"]] = (rows.index(row), cols.index(col))
    return rows, [f"{last}={c}" for c in cols], where


def heatmap(result: dict, values: dict[int, float], title: str, path: Path, diverging: bool) -> Path:
    rows, cols, where = _layout(result)
    grid = np.full((len(rows), len(cols)), np.nan)
    for idx, v in values.items():
        grid[where[idx]] = v
    fig, ax = plt.subplots(figsize=(2.0 + 1.3 * len(cols), 1.2 + 0.45 * len(rows)))
    finite = grid[np.isfinite(grid)]
    span = max(5.0, float(np.max(np.abs(finite)))) if finite.size else 5.0
    if diverging:
        im = ax.imshow(grid, cmap="RdBu", vmin=-span, vmax=span, aspect="auto")
    else:
        im = ax.imshow(grid, cmap="viridis_r", vmin=0, vmax=span, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        ax.text(j, i, "-" if np.isnan(v) else f"{v:+.1f}" if diverging else f"{v:.0f}",
                ha="center", va="center", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(cols)), cols, fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

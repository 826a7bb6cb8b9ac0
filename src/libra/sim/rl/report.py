"""What `libra simulate` writes for an RL scenario: summary.json and steps.json (`sim.output`),
the PNG plots, and a Perfetto trace of one step (`sim.tracing`).

`summary.json` holds {"scenario", "seed", "steps", "systems": {NAME: metrics}}.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from libra.core.curves import CurveOptions, Curves, flatten  # noqa: E402
from libra.sim.output import write_results  # noqa: E402
from libra.sim.rl.records import StepRecord  # noqa: E402


def write_outputs(out: dict, records: dict, out_dir: Path) -> list[Path]:
    """`records`: each system's `pipeline.SimRecord`, in the order the systems ran."""
    paths = write_results(out, out_dir)
    paths.append(plot_steps(out["per_step"], out_dir / "steps.png"))
    last = list(records.values())[-1]
    paths.append(plot_lengths(last.history, last.name, out_dir / "lengths.png"))
    focus = records.get("libra", last)
    paths.append(plot_split(focus.history, focus.name, out_dir / "split.png"))
    paths.append(plot_layout(focus.history, focus.name, out_dir / "layout.png"))
    paths.append(last.tracer.write(last.name, out_dir / "trace.json"))
    return paths


def write_curves(per_step: dict, out_dir: Path, options: CurveOptions) -> list[str]:
    """Every system's steps as TensorBoard/W&B curves, one series (a TensorBoard run) per system:
    step time, throughput, rollout makespan and its lower bound, train time, lengths, staleness and
    the GPU split the controller chose. Returns the writers used."""
    curves = Curves(out_dir, options, name=out_dir.name)
    for system, rows in per_step.items():
        for row in rows:
            curves.log(row["step"], flatten("", {k: v for k, v in row.items() if k != "step"}), series=system)
    curves.close()
    return curves.writers


def plot_steps(per_step: dict, path: Path) -> Path:
    """Step time (a 4-step moving average: with k-step staleness consecutive steps overlap, so raw
    step times alternate) and cumulative throughput, which ends at the summary's figure."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in per_step.items():
        steps = [r["step"] for r in rows]
        times = [r["step_time_s"] for r in rows]
        tokens = np.cumsum([r["throughput_tokens_per_s"] * r["step_time_s"] for r in rows])
        ax1.plot(steps, _moving_mean(times, 4), label=name, lw=1.2)
        ax2.plot(steps, tokens / np.maximum(np.cumsum(times), 1e-9), label=name, lw=1.2)
    ax1.set(title="Step time (4-step moving average)", xlabel="RL step", ylabel="seconds")
    ax2.set(title="Throughput so far", xlabel="RL step", ylabel="generated tokens / wall second")
    ax2.legend(fontsize=7, loc="best")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _moving_mean(xs: list[float], k: int) -> np.ndarray:
    c = np.cumsum(np.insert(np.asarray(xs, dtype=float), 0, 0.0))
    n = np.arange(1, len(xs) + 1)
    lo = np.maximum(0, n - k)
    return (c[n] - c[lo]) / (n - lo)


def plot_lengths(history: list[StepRecord], system: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = [r.step for r in history]
    qs = np.array([np.percentile(r.lengths, [10, 50, 90, 99]) for r in history])
    ax.fill_between(steps, qs[:, 0], qs[:, 2], alpha=0.25, label="p10-p90")
    ax.plot(steps, qs[:, 1], label="median")
    ax.plot(steps, qs[:, 3], ls="--", label="p99")
    ax.plot(steps, [np.mean(r.lengths) for r in history], label="mean")
    ax.set(title=f"Trajectory length over steps ({system})", xlabel="RL step", ylabel="final context, tokens")
    ax.legend()
    return _save(fig, path)


def plot_split(history: list[StepRecord], system: str, path: Path) -> Path:
    """Training and rollout GPUs at each step (hybrid replicas move whole DP replicas)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r.step for r in history]
    ax.stackplot(steps, [r.train_gpus for r in history], [r.rollout_gpus for r in history],
                 labels=["training", "rollout"], alpha=0.8, step="post")  # fmt: skip
    ax.set(title=f"GPU split over steps ({system})", xlabel="RL step", ylabel="GPUs")
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_layout(history: list[StepRecord], system: str, path: Path) -> Path:
    """Rollout GPUs per bucket at each step, labelled by TP and the bucket's max context."""
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r.step for r in history]
    width = max(len(r.layout) for r in history)
    for k in range(width):
        gpus = [r.layout[k][0] * r.layout[k][1] if k < len(r.layout) else 0 for r in history]
        bottom = [sum(b[0] * b[1] for b in r.layout[:k]) for r in history]
        tp = next((r.layout[k][0] for r in history if k < len(r.layout)), 0)
        ax.bar(steps, gpus, bottom=bottom, width=1.0, label=f"bucket {k} (TP{tp})")
    last = history[-1].layout
    ax.set(title=f"Rollout buckets over steps ({system}); last: " + ", ".join(f"<= {b[2] // 1024}K" for b in last),
           xlabel="RL step", ylabel="rollout GPUs")  # fmt: skip
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)

"""`libra train`: live agentic GRPO on Libra's own engines, gateway and actions service.

Arguments only: the configuration is built here (embedded default, `--config`, `--set`), the run
itself is `libra.runtime.train.driver`. Output: a progress bar per step, the final table, and the
run folder (`--out`, default runs/train/).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from libra.cli.common import (
    console,
    curve_options,
    curves_of,
    err_console,
    set_option_for,
    table,
    writable_dir,
)


class _Bar:
    """The per-step progress bar: shown once the first step is done (start-up prints notes)."""

    def __init__(self, first: int, steps: int):
        cols = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]  # fmt: skip
        self.bar = Progress(*cols, console=err_console, transient=False)
        self.task = self.bar.add_task("warm-start and start-up", total=steps, completed=first)
        self.bar.start()

    def note(self, text: str) -> None:
        self.bar.console.print(text)

    def step(self, rec) -> None:
        desc = f"step {rec.step}: success {rec.success:.2f}, reward {rec.reward:.2f}, v{rec.weight_version}, {rec.step_time_s:.1f} s"  # fmt: skip
        if rec.elastic:
            desc += f", hybrid active {rec.elastic['hybrid_active']}"
        self.bar.update(self.task, completed=rec.step + 1, description=desc)

    def stop(self) -> None:
        self.bar.stop()


@click.command("train")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help="TrainConfig YAML, merged over the embedded default.")  # fmt: skip
@click.option("--steps", type=click.IntRange(1, 100_000), default=None, help="Training steps [default: the config's, 100].")  # fmt: skip
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None, help="Run folder [default: runs/train].")  # fmt: skip
@click.option("--launcher", type=click.Choice(["local", "ray"]), default="local", show_default=True, help="Start processes as subprocesses, or as Ray actors in a placement group.")  # fmt: skip
@set_option_for("trainer.replicas=4")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --out (verified; exit 2 if it cannot be used).")  # fmt: skip
@click.option("--overwrite", is_flag=True, help="Start over in an --out that holds an earlier run (its steps and checkpoints are removed).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of a table.")
@curve_options
def train(config_path, steps, out_dir, launcher, overrides, resume, overwrite, as_json, tensorboard, wandb_on, wandb_project) -> None:  # fmt: skip
    """Train the built-in model with agentic GRPO, live: engines in C-MLFQ buckets behind the
    gateway, tool calls in the sandboxed actions service, data-parallel trainer replicas.

    \b
    Example (a few minutes on a laptop):
        libra train --steps 60 --out runs/calc
    """
    from libra.runtime.train.config import load_train_config

    cfg = load_train_config(config_path, [*overrides, *([f"steps={steps}"] if steps else [])])
    out = writable_dir(Path(out_dir or "runs/train"))
    point = _start_point(out, cfg.steps, resume, overwrite, cfg.engine.model)
    curves = curves_of(tensorboard, wandb_on, wandb_project)
    from libra.runtime.launch import make_launcher
    from libra.runtime.train.driver import train as run_train

    lau = make_launcher(launcher, cfg.ray_address, cpus=_cpus(cfg))
    bar = None if as_json else _Bar(0, cfg.steps)
    from libra.runtime.train.driver import RunStopped

    t0 = time.perf_counter()
    try:
        summary = asyncio.run(run_train(cfg, out, lau, point, bar, curves))
    except RunStopped as e:
        if bar is not None:
            bar.stop()
        click.echo(f"error: {e}", err=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # asyncio.run has cancelled the run: its processes are stopped
        if bar is not None:
            bar.stop()
        click.echo(interrupted_message(out), err=True)
        raise SystemExit(130) from None
    finally:
        if bar is not None:
            bar.stop()
    if as_json:
        click.echo(json.dumps(summary))
        return
    console.print(summary_table(summary))
    err_console.print(f"trained in {time.perf_counter() - t0:.0f} s; run folder {out}/ (steps.json, reward.png, trace.json, checkpoints/, logs/)")  # fmt: skip


def _start_point(out: Path, steps: int, resume: bool, overwrite: bool, model: str | None = None):
    """The checkpoint to resume (verified), or None for a new run; a CheckpointError (exit 2)
    when --resume has nothing usable, or when a new run would overwrite an earlier one."""
    from libra.runtime.train import checkpoint as ckpt

    if resume and overwrite:
        raise ckpt.CheckpointError("--resume and --overwrite: give one (continue the run in --out, or start it over)")  # fmt: skip
    if resume:
        return ckpt.resume_point(out, steps, model)
    earlier = ckpt.earlier_run(out)
    if earlier is not None and not overwrite:
        raise ckpt.CheckpointError(f"--out {out} holds an earlier run ({earlier}): pass --resume to continue it, --overwrite to start it over, or another --out")  # fmt: skip
    if earlier is not None:
        for name in ("steps.json", "summary.json", "trajectories.jsonl"):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return None


def interrupted_message(out: Path) -> str:
    """What an interrupted run says: how far it got, and the command that continues it."""
    from libra.runtime.train import checkpoint as ckpt

    found = ckpt.latest(out / "checkpoints")
    if found is None:
        return f"interrupted before the first checkpoint; nothing to resume in {out}/"
    args = [a for a in sys.argv[1:] if a != "--resume"]
    command = shlex.join(["libra", *args, "--resume"])
    return (f"interrupted: the newest checkpoint is step {found.step} ({found.path}); "
            f"resume with: {command}")  # fmt: skip


def _cpus(cfg) -> float:
    """Logical CPUs a local Ray instance needs: one bundle per process."""
    return sum(b.instances for b in cfg.buckets) + cfg.trainer.replicas + 2


def summary_table(s: dict):
    rows = [
        ("steps", s.get("steps")),
        ("success, first step", s.get("first_success")),
        ("success, last 5 steps", s.get("final_success")),
        (
            "steps to success >= 0.8 (5-step mean)",
            s.get("steps_to_success_0_8") if s.get("steps_to_success_0_8") is not None else "never",
        ),  # fmt: skip
        ("mean step s", s.get("mean_step_s")),
        ("  waiting for rollouts s", s.get("mean_rollout_wait_s")),
        ("  train s", s.get("mean_train_s")),
        ("  publish weights s", s.get("mean_publish_s")),
        ("tokens/s", s.get("tokens_per_s")),
        ("control share (publication / step)", s.get("control_share")),
        ("trajectories trained", s.get("trained")),
        ("trajectories dropped", s.get("dropped")),
        ("final weight version", s.get("final_weight_version")),
    ]
    if "elastic" in s:  # the hybrid pool (elastic.enabled)
        e = s["elastic"]
        rows += [
            ("hybrid pool: joins / releases / rollbacks", f"{e['joins']} / {e['releases']} / {e['rollbacks']}"),
            ("  steps with a hybrid replica active", e["hybrid_active_steps"]),
            ("  mean step s, hybrid active", e["mean_step_s_hybrid_active"] if e["hybrid_active_steps"] else "-"),
            ("  mean step s, no hybrid", e["mean_step_s_no_hybrid"] if e["mean_step_s_no_hybrid"] is not None else "-"),
        ]  # fmt: skip
    return table("libra train", ["", "value"], rows)

"""What GRPO itself adds: the seeded in-process learning curves of `libra train`'s default config.

    python benchmarks/bench_learning.py [--seed S | --seeds 0-9] [--steps N] [--jobs J] [--out DIR]
                                        [--warm-cache DIR] [--until-goal] [--set KEY=VALUE ...]

Runs `runtime.train.inprocess.quick_grpo` (the live task, agent loop, engine core, learner and
GRPO loss, without HTTP or separate processes; one torch thread per process): the warm-start to
its probe's target, then N synchronous GRPO steps.

One seed (`--seed`) prints one JSON object: `first_success` (the sampled success of RL step 0,
right after the warm-start), `final_success` (mean of the last 5 steps), `best_5step`,
`grpo_rise` (mean of the last 5 steps minus the first 5), `steps_to_success_0_8` (the first step
whose 5-step mean, over steps s-4..s, reaches 0.8; null if never), the warm-start's steps and
probe, the wall seconds of each phase and the per-step success list.

Several seeds (`--seeds 0-9`, or `0,3,5`) run as child processes, `--jobs` at a time (2 by
default: a shared 2-core machine), and print one JSON object: every seed's object, `reached`
(how many reached 0.8), and the `median` and `worst` seed (the worst: never reached, or latest,
then the lowest best 5-step mean). `--warm-cache DIR` keeps each seed's warm-start in DIR and
reuses it (comparing RL settings on the same warm-starts); `--until-goal` stops a seed once it
reaches 0.8 (its curve ends there). `--out DIR` writes each seed's object to DIR/seed-S.json and
skips a seed whose file is there with the same settings: a long sweep can be resumed. `--plot
FILE` draws every seed's 5-step mean success per GRPO step on one figure (the README's picture).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import report  # noqa: E402
from libra.runtime.train.config import TrainConfig, load_train_config  # noqa: E402
from libra.runtime.train.inprocess import quick_grpo, warm_digest  # noqa: E402
from libra.runtime.train.report import MOVING  # noqa: E402

GOAL = 0.8


def _progress(rec: dict) -> None:
    print(f"step {rec['step']}: success {rec['success']:.3f}", file=sys.stderr, flush=True)


def windows(succ: list[float]) -> list[float]:
    """The 5-step mean ending at each step from step 4 on (full windows only)."""
    return [sum(succ[i - MOVING + 1 : i + 1]) / MOVING for i in range(MOVING - 1, len(succ))]


def warm_file(cache: str | None, cfg: TrainConfig) -> Path | None:
    """Where this config's warm-start is kept: keyed by what the warm-start depends on."""
    return None if cache is None else Path(cache) / f"warm-seed{cfg.seed}-{warm_digest(cfg)}.pt"


def one_seed(a: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    cfg = load_train_config(None, [f"seed={a.seed}", f"steps={a.steps}", *a.overrides])
    t0 = time.time()
    sft_done: list[float] = []
    run = asyncio.run(
        quick_grpo(
            cfg,
            on_step=_progress,
            on_sft=lambda i, loss: sft_done.append(time.time()),
            warm=warm_file(a.warm_cache, cfg),
            until=GOAL if a.until_goal else None,
        )  # fmt: skip
    )
    wall = time.time() - t0
    succ = [r["success"] for r in run.steps]
    win = windows(succ)
    ws_s = (sft_done[-1] - t0) if sft_done else 0.0
    return {
        "seed": a.seed,
        "task": cfg.task.model_dump(include={"lo", "hi", "ops"}),
        "trainer": cfg.trainer.model_dump(include={"lr", "negative_weight", "normalize_std", "correction"}),
        "warmstart_steps": run.warmstart.steps,
        "warmstart_probe": run.warmstart.success,
        "final_probe": run.probe,
        "first_success": succ[0],
        "final_success": sum(succ[-MOVING:]) / len(succ[-MOVING:]),
        "best_5step": max(win, default=None),
        "grpo_rise": sum(succ[-MOVING:]) / MOVING - sum(succ[:MOVING]) / MOVING,
        "steps": len(succ),
        "steps_to_success_0_8": next((i + MOVING - 1 for i, v in enumerate(win) if v >= GOAL), None),
        "same_version_gap_max": max(r["same_version_gap"] for r in run.steps),
        "warmstart_s": round(ws_s, 1),
        "rl_s": round(wall - ws_s, 1),
        "wall_s": round(wall, 1),
        "success": [round(s, 3) for s in succ],
    }


def seeds_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def settings(a: argparse.Namespace) -> dict:
    """What a seed's result depends on besides the seed (the code aside)."""
    return {"steps": a.steps, "overrides": a.overrides, "until_goal": a.until_goal}


def many_seeds(a: argparse.Namespace, seeds: list[int]) -> dict:
    """Each seed in its own process (one torch thread), `a.jobs` at a time."""

    def run(seed: int) -> dict:
        done = Path(a.out) / f"seed-{seed}.json" if a.out else None
        if done is not None and done.exists():
            rec = json.loads(done.read_text())
            if rec.get("settings") == settings(a):
                return rec
        cmd = [sys.executable, __file__, "--seed", str(seed), "--steps", str(a.steps), "--json"]
        cmd += [x for o in a.overrides for x in ("--set", o)]
        cmd += ["--warm-cache", a.warm_cache] if a.warm_cache else []
        cmd += ["--until-goal"] if a.until_goal else []
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)  # progress: our stderr
        if out.returncode != 0:
            return {"seed": seed, "error": f"exit {out.returncode} (its stderr is above)"}
        rec = {**json.loads(out.stdout.strip().splitlines()[-1]), "settings": settings(a)}
        if done is not None:
            done.parent.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(rec))
        print(f"seed {seed}: 0.8 at {rec['steps_to_success_0_8']}, best {rec['best_5step']}", file=sys.stderr, flush=True)  # fmt: skip
        return rec

    with ThreadPoolExecutor(a.jobs) as pool:
        recs = list(pool.map(run, seeds))
    ok = [r for r in recs if "error" not in r]
    late = sorted(ok, key=lambda r: (r["steps_to_success_0_8"] is None, r["steps_to_success_0_8"] or 0, -(r["best_5step"] or 0)))  # fmt: skip
    reached = [r["steps_to_success_0_8"] for r in ok if r["steps_to_success_0_8"] is not None]
    return {
        "seeds": recs,
        "reached": f"{len(reached)}/{len(recs)}",
        "median": {
            "steps_to_success_0_8": statistics.median(reached) if len(reached) == len(recs) else None,
            "best_5step": statistics.median(r["best_5step"] or 0 for r in ok) if ok else None,
            "warmstart_steps": statistics.median(r["warmstart_steps"] for r in ok) if ok else None,
        },
        "worst": {k: late[-1][k] for k in ("seed", "steps_to_success_0_8", "best_5step", "first_success")}
        if late
        else None,  # fmt: skip
    }


def plot(result: dict, path: str) -> None:
    """Every seed's 5-step mean success over its GRPO steps, the goal as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for r in sorted((r for r in result["seeds"] if "error" not in r), key=lambda r: r["seed"]):
        w = windows(r["success"])
        ax.plot(range(MOVING - 1, MOVING - 1 + len(w)), w, lw=1.2, label=f"seed {r['seed']}")
    ax.axhline(GOAL, color="k", ls="--", lw=0.8)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("success, 5-step mean")
    ax.set_title(f"in-process GRPO from each seed's warm-start ({result['reached']} reach {GOAL})")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default=None, help="0-9 or 0,3,5: several seeds, each in its own process")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None, help="Write each seed's result here; skip seeds already there.")
    ap.add_argument(
        "--warm-cache", default=None, help="Keep and reuse each seed's warm-start in this folder."
    )
    ap.add_argument("--until-goal", action="store_true", help="Stop a seed once its 5-step mean reaches 0.8.")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--plot", default=None, help="With --seeds: draw every seed's curve to this PNG.")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.seeds:
        result = many_seeds(a, seeds_of(a.seeds))
        if a.plot:
            plot(result, a.plot)
        report("learning", result)
    else:
        report("learning", one_seed(a))


if __name__ == "__main__":
    main()

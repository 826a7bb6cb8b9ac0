"""The model learns: from a shipped warm-start, GRPO in process raises the probability of success.

The task, agent loop, engine core (scheduler, grammar, sampler), learner and GRPO loss are the
live ones (`runtime/train/inprocess.py`); only HTTP and the separate processes are left out, which
the live smoke tests cover. Seeded, so it is the same run on every machine (one torch thread).

The warm-start is shipped (`tests/data/warm-seed0.pt`, float16 weights and the warm-start's
record): running it takes minutes, and what this test checks is what GRPO adds. It is the one
`libra train`'s default config makes from seed 0 (the config digest is checked below); after a
change to the warm-start or the model, make it anew with

    python benchmarks/bench_learning.py --seed 0 --steps 1 --warm-cache /tmp/warm && cp /tmp/warm/warm-seed0-*.pt tests/data/warm-seed0.pt

`benchmarks/bench_learning.py --seeds 0-9` measures the whole curves (docs/train.md).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from libra.core.config import build
from libra.runtime.engine.config import PRESETS
from libra.runtime.train.config import TaskConfig, TrainConfig, WarmStartConfig
from libra.runtime.train.inprocess import quick_grpo, warm_digest
from libra.runtime.train.learner import Learner, OptimConfig
from libra.runtime.train.reducer import LocalReducer
from libra.runtime.train.warmstart import probe_success, warm_start

torch.set_num_threads(1)

WARM = Path(__file__).parent / "data" / "warm-seed0.pt"
RL_STEPS = 10


def test_grpo_raises_the_probability_of_success_from_the_warm_start():
    """Ten GRPO steps of the default config from seed 0's warm-start: the probe (the probability
    that the engine samples a correct episode, on 64 held-out problems: a smooth measure, where
    the sampled success of one step of 64 episodes moves by 0.1 from step to step) rises by at
    least 0.1, and sampled success rises with it. Measured (`tiny8`): probe 0.341 -> 0.468 after
    10 steps. (With the 4-head `tiny` before it: 0.357 -> 0.518, 0.69 after 25; plain GRPO 0.41
    after 10, then a collapse to 0.07 by step 20.)"""
    cfg = build(TrainConfig, {"seed": 0, "steps": RL_STEPS})
    shipped = torch.load(WARM, weights_only=True)["digest"]
    assert shipped == warm_digest(cfg), "the shipped warm-start is not the default config's: make it anew (module docstring)"  # fmt: skip
    run = asyncio.run(quick_grpo(cfg, warm=WARM))
    before = run.warmstart.success
    assert before is not None and before >= cfg.warmstart.target_success
    success = [r["success"] for r in run.steps]
    assert run.probe - before >= 0.1, f"probe {before:.3f} -> {run.probe:.3f}; success {success}"
    assert sum(success[-3:]) / 3 > sum(success[:3]) / 3, success


def test_the_warm_start_stops_at_the_probe_or_at_its_cap():
    """The probe reads only the weights, which replicas hold bit for bit (test_train_dist), so
    every replica stops at the same step; here: the first probe at or above target stops it."""
    task, ws = TaskConfig(), WarmStartConfig(steps=6, target_success=1e-300, probe_every=3, batch=4)
    learner = Learner(PRESETS["tiny"], 0, OptimConfig(lr=1e-3), LocalReducer())
    out = warm_start(learner, ws, task, seed=0)
    assert out.steps == 3 and out.probes == [(3, out.success)] and out.success >= ws.target_success
    capped = warm_start(Learner(PRESETS["tiny"], 0, OptimConfig(lr=1e-3), LocalReducer()), ws.model_copy(update={"target_success": 1.0}), task, seed=0)  # fmt: skip
    assert capped.steps == 6 and [s for s, _ in capped.probes] == [3, 6]
    assert 0.0 <= probe_success(learner.model, task, 0) <= 1.0

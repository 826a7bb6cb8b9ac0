"""The model learns: after a seeded warm-start, GRPO in process raises success by at least 0.3.

The task, agent loop, engine core (scheduler, grammar, sampler), learner and GRPO loss are the
live ones (`runtime/train/inprocess.py`); only HTTP and the separate processes are left out, which
the live smoke tests cover. Seeded, so it is the same run on every machine (one torch thread).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from libra.core.config import build
from libra.runtime.engine.config import PRESETS
from libra.runtime.train.config import TaskConfig, TrainConfig, WarmStartConfig
from libra.runtime.train.inprocess import quick_grpo
from libra.runtime.train.learner import Learner, OptimConfig
from libra.runtime.train.reducer import LocalReducer
from libra.runtime.train.warmstart import probe_success, warm_start

torch.set_num_threads(1)

# `libra train`'s default task and RL settings (sums and differences of two-digit numbers; GRPO at
# lr 3e-4 with below-mean advantages weighted 0.25), seeded. 50 GRPO steps fit CI's budget: about
# 2.5 minutes of warm-start and 5 of GRPO on an idle 2-core machine. Seed 0 measured 0.26 -> 0.68
# over these 50 steps (benchmarks/bench_learning.py --seed 0); after 40 the rise was only 0.35, too
# near the bar for a test.
RL_STEPS = 50
WINDOW = 5


@pytest.mark.slow
@pytest.mark.timeout(2400)  # about 8 minutes on an idle 2-core machine, 25 under heavy load
def test_grpo_raises_success_by_at_least_0_3():
    """The warm-start stops at its probe's target (sampled success about 0.1), then GRPO itself
    raises success: the mean of its last five steps beats the mean of its first five by 0.3 or
    more (the issue's CI criterion; benchmarks/bench_learning.py measures the 150-step curve)."""
    cfg = build(TrainConfig, {"seed": 0, "steps": RL_STEPS})
    run = asyncio.run(quick_grpo(cfg))
    assert run.warmstart.success is not None and run.warmstart.success >= cfg.warmstart.target_success
    success = [r["success"] for r in run.steps]
    first, last = sum(success[:WINDOW]) / WINDOW, sum(success[-WINDOW:]) / WINDOW
    assert first < 0.4, f"the warm-start left little for GRPO to add: {success}"
    assert last - first >= 0.3, f"success {first:.2f} -> {last:.2f}: {success}"


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

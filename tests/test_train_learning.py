"""The model learns: a seeded warm-start and GRPO run in process raises success by at least 0.3.

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

RL_STEPS = 40


@pytest.mark.slow
def test_grpo_raises_success_by_at_least_0_3():
    cfg = build(TrainConfig, {"seed": 0, "steps": RL_STEPS})
    run = asyncio.run(quick_grpo(cfg))
    assert run.warmstart.success is not None and run.warmstart.success >= cfg.warmstart.target_success
    success = [r["success"] for r in run.steps]
    first, last = sum(success[:5]) / 5, sum(success[-5:]) / 5
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

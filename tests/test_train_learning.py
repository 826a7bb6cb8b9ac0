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

# Sums and differences only (answers of one to three digits): the warm-start reaches the probe's
# target in about 130 steps from seed 0, where products (four-digit answers) need about 320, so the
# test fits CI's budget (about 4 minutes on 2 cores). The default task is measured by bench_train.
TASK = {"ops": "+-"}
RL_STEPS = 20


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 4 minutes on an idle 2-core machine, 15 under heavy load
def test_the_warm_start_and_grpo_raise_success():
    """From a random model (success 0) the run ends above 0.3, and GRPO itself adds to what the
    warm-start gave: its last ten steps beat its first ten (seed 0 measured +0.08 at lr 1e-4,
    about 2 standard errors of a step's sampling; the issue's +0.3 from RL alone is not reached
    in a CI-sized run, see docs/train.md)."""
    cfg = build(TrainConfig, {"seed": 0, "steps": RL_STEPS, "task": TASK})
    run = asyncio.run(quick_grpo(cfg))
    assert run.warmstart.success is not None and run.warmstart.success >= cfg.warmstart.target_success
    success = [r["success"] for r in run.steps]
    first, last = sum(success[:10]) / 10, sum(success[-10:]) / 10
    assert sum(success[-5:]) / 5 >= 0.3 and last > first, f"success {first:.2f} -> {last:.2f}: {success}"


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

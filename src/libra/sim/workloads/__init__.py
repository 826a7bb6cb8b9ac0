"""Workload generators: the trajectory families the simulator replays and `libra trace` writes.

Three families reproduce the published traits of the Libra paper's tasks: `search-r1` (short
multi-turn search), `dapo-math` (long single-turn reasoning with validator feedback) and
`r2e-gym` (long-tailed, drifting software-engineering agents). Each is a small class registered
by name in `FAMILIES`; outside code plugs in a family as "package.module:Class".

    wl = make_workload(WorkloadConfig(family="r2e-gym", prompts_per_step=32, samples_per_prompt=16,
                                      max_length=40960, params={"drift_steps": 200}))
    trajectories = wl.generate(step, step_rng(seed, step))
"""

from __future__ import annotations

from libra.core.config import build
from libra.core.registry import Registry
from libra.sim.workloads.base import Workload, WorkloadConfig, step_rng
from libra.sim.workloads.dapo_math import DapoMathWorkload
from libra.sim.workloads.r2e_gym import R2EGymWorkload
from libra.sim.workloads.search_r1 import SearchR1Workload

FAMILIES: Registry[type] = Registry(
    "workload family", "workload.family", (SearchR1Workload, DapoMathWorkload, R2EGymWorkload)
)

__all__ = ["FAMILIES", "Workload", "WorkloadConfig", "family_class", "make_workload", "step_rng"]


def family_class(name: str) -> type:
    """The class of a registered family, or of 'package.module:Class'; ConfigError otherwise."""
    return FAMILIES.get_entry(name)


def make_workload(cfg: WorkloadConfig | dict) -> Workload:
    """Build a configured family. A dict is validated as the scenario's `workload:` mapping."""
    if not isinstance(cfg, WorkloadConfig):
        cfg = build(WorkloadConfig, cfg, "workload")
    return family_class(cfg.family)(cfg)

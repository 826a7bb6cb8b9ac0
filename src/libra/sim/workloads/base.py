"""The workload interface: the scenario's `workload:` mapping, the `Workload` protocol, validation.

A workload family turns one RL step into trajectories (prompts x GRPO samples). The simulator
and the planner call only what is here, so a family is swappable by name in the scenario YAML.
Family parameters arrive as a free mapping (`workload.params`) and are validated by the family's
own pydantic model, so a typo is reported with the list of parameters that family accepts.
"""

from __future__ import annotations

import random
from typing import Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from libra.core.config import build
from libra.core.errors import ConfigError
from libra.core.trajectory import Trajectory

P = TypeVar("P", bound=BaseModel)


class WorkloadConfig(BaseModel):
    """The scenario's `workload:` mapping."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    family: str = Field(description="Workload family: a registered name or 'package.module:Class'.")
    # Bounded so a typo cannot make one step take hours: 4096 x 1024 is 8x the 1024-GPU scenario.
    prompts_per_step: int = Field(32, ge=1, le=4096, description="Prompts per RL step (GRPO groups).")
    samples_per_prompt: int = Field(16, ge=1, le=1024, description="GRPO samples per prompt.")
    max_length: int = Field(40960, ge=256, description="Context limit in tokens; longer rollouts are cut.")
    params: dict = Field(default_factory=dict, description="Family parameters; see `libra trace params`.")
    # Late training without simulating the steps before it: R2E-Gym's mean length is 2.5K at step 0
    # and 11.5K after 100 steps (the Libra paper), and a run of its late steps starts there.
    first_step: int = Field(
        0, ge=0, le=1_000_000, description="The training step this run's step 0 stands for (length drift)."
    )


def step_rng(seed: int, step: int) -> random.Random:
    """The random stream of RL step `step` of a run seeded `seed`: the one derivation `libra
    simulate`, `libra plan` and `libra trace generate` share, so the trace `trace generate --seed S`
    writes is exactly the batches `simulate --seed S` runs, and any step can be regenerated alone."""
    return random.Random(seed * 1_000_003 + step)


@runtime_checkable
class Workload(Protocol):
    """One family, configured. `generate` returns one RL step: prompts x samples trajectories."""

    def generate(self, step: int, rng: random.Random) -> list[Trajectory]: ...


def validate_params(model: type[P], data: dict, prefix: str) -> P:
    """Validate family params; an unknown name is reported with the names that are allowed."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, data, "a mapping of parameter names to values")
    return build(model, data, prefix)  # any other problem: the shared one-line field/value message

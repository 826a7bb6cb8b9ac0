"""What a local elastic run does (`RunSpec`, `JoinSpec`) and how its processes follow the core.

Shared by the parent (`local.run_local`) and every process it starts (`worker`), so neither has
to import the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from libra.runtime.elastic.config import ElasticRuntimeConfig
from libra.runtime.elastic.joiner import KillPoint

STEP_KEY = "elastic/step"  # rank 0 sets it to the last finished step


class JoinSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    slot: int = Field(0, ge=0)
    at_step: int = Field(1, ge=0, description="Join once the core has finished this step")
    # A prestarted joiner process is up (torch imported, model built) and connects when the core
    # reaches `at_step`, as a trainer already started in a drained engine's slot would; otherwise
    # the parent starts the process at that step, and the join's time includes its start.
    prestart: bool = True
    release_after: int | None = Field(
        None, ge=1, description="Rank 0 asks for its release after N active steps"
    )
    kill_at: KillPoint | None = None
    kill_after: int = Field(1, ge=1)
    delay_s: dict[str, float] = Field(
        default_factory=dict, description="Message kind -> delay before sending"
    )
    delay_times: int = Field(1, ge=1)
    duplicate: list[str] = Field(default_factory=list, description="Message kinds sent twice")


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    core: int = Field(2, ge=1)
    slots: int = Field(1, ge=0, le=62)
    steps: int = Field(12, ge=1)
    preset: str = "tiny"
    seed: int = 0
    lr: float = Field(1e-3, gt=0)
    batch: int = Field(8, ge=1)
    min_len: int = Field(8, ge=2)
    max_len: int = Field(48, ge=2)
    hashes: bool = Field(True, description="Hash the parameters after every step (the bitwise check)")
    joins: list[JoinSpec] = Field(default_factory=list)
    runtime: ElasticRuntimeConfig = Field(default_factory=ElasticRuntimeConfig)
    timeout_s: float = Field(600.0, gt=0)
    # A core step takes at least this long (the rest is slept). The tiny model's steps take
    # milliseconds, a real trainer's seconds; fault tests pace the core so that a join's messages
    # (and their injected delays) land within the run on a loaded machine too. Results unchanged.
    step_min_s: float = Field(0.0, ge=0)


def ready_key(index: int) -> str:
    """Set by prestarted joiner INDEX once its model is built; the core starts after all of them."""
    return f"elastic/ready/{index}"


def wait_step(store: dist.Store, step: int, ended: Callable[[], bool], deadline: float) -> bool:
    """Until rank 0 has finished `step` (False if `ended()` or time ran out first)."""
    while time.monotonic() < deadline:
        if store.check([STEP_KEY]) and int(store.get(STEP_KEY)) >= step:
            return True
        if ended():
            return False
        time.sleep(0.02)
    return False

"""The typed action-orchestration scenario: what a `kind: tangram` YAML file holds.

Validated when loaded (`libra.sim.scenarios.load_scenario`), like the RL scenario, so a bad value is
one line naming the field before anything runs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from libra.actions.quota import QuotaSpec
from libra.sim.tangram.workloads import CodingParams, MopdParams


class ClusterParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    # Bounded so a typo cannot allocate the world; both are far past the setting (4 nodes x 32 cores).
    nodes: int = Field(4, ge=1, le=4096)
    cores_per_node: int = Field(32, ge=1, le=1024)
    numa_per_node: int = Field(2, ge=1)
    memory_gib_per_node: float = Field(512.0, gt=0)
    hardware: str = Field(
        "a800-80g", description="GPU type of GPU scenarios (see `libra costmodel catalog`)."
    )
    gpus: int | None = Field(
        None, ge=1, le=65536, description="GPUs in the pooled system (default: the static system's)."
    )


class EqualActParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    system: str = "tangram"
    baseline: str = "static-services"
    step: int = Field(4, ge=1, description="Pool sizes tried: step, 2 step, ... up to the baseline's GPUs.")


class TangramScenario(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    kind: Literal["tangram"] = "tangram"
    name: str = "tangram"
    description: str = ""
    workload: str = Field(pattern="^(coding|mopd)$")
    steps: int = Field(2, ge=1)
    cluster: ClusterParams = ClusterParams()
    profiles: dict = Field(default_factory=dict, description="Efficiency profiles by name.")
    quotas: dict[str, QuotaSpec] = Field(default_factory=dict)
    coding: CodingParams | None = None
    mopd: MopdParams | None = None
    systems: dict[str, dict]
    default_systems: list[str] | None = None
    equal_act: EqualActParams | None = None

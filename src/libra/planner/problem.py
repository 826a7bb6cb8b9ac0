"""The fixed facts a plan is made for: cluster, model, GRPO batch shape and engine settings.

Everything here stays constant across steps of one run, while `WorkloadStats` is the part that
changes. Keeping the two apart lets the planner cache cost models and search tables per problem
and re-use them step after step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libra.core.errors import ConfigError
from libra.core.specs import HardwareSpec, ModelSpec
from libra.costmodel.efficiency import DEFAULT_ENGINE, Profile
from libra.costmodel.rollout import RolloutCostModel
from libra.costmodel.training import TrainCostModel

CONSUME = ("completion", "batch")  # see PlanningProblem.consume


@dataclass(frozen=True, slots=True)
class PlanningProblem:
    hw: HardwareSpec
    nodes: int
    model: ModelSpec
    prompts_per_step: int
    samples_per_prompt: int
    max_length: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    profile: Profile = field(default_factory=Profile)
    staleness: int = 1  # rollout may run this many steps ahead of training (scenario pipeline.staleness)
    # What a training step takes (scenario pipeline.consume): the first groups to finish, or its batch.
    consume: str = "completion"
    engine: str = DEFAULT_ENGINE  # the engine preset (scenario rollout.engine)

    def __post_init__(self) -> None:
        for name in ("nodes", "prompts_per_step", "samples_per_prompt", "max_length", "max_num_seqs",
                     "max_num_batched_tokens"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(name, v, "an integer >= 1")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ConfigError("staleness", self.staleness, "an integer >= 0")
        if self.consume not in CONSUME:
            raise ConfigError("consume", self.consume, list(CONSUME))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", self.gpu_memory_utilization, "a number in (0, 1]")

    @property
    def gpus(self) -> int:
        return self.nodes * self.hw.gpus_per_node

    @property
    def batch_size(self) -> int:
        """Trajectories per RL step: GRPO groups x samples."""
        return self.prompts_per_step * self.samples_per_prompt

    def rollout_model(self, tp: int) -> RolloutCostModel:
        return RolloutCostModel(
            self.hw,
            self.model,
            tp,
            self.profile.rollout,
            self.gpu_memory_utilization,
            self.max_num_batched_tokens,
            self.engine,
            self.max_num_seqs,
        )

    def train_model(self) -> TrainCostModel:
        return TrainCostModel(self.hw, self.model, self.profile.train)

    def tp_allowed(self, tp: int) -> bool:
        """TP inside one node, a power of two dividing it (so groups pack), dividing the heads."""
        per_node = self.hw.gpus_per_node
        return tp >= 1 and not tp & (tp - 1) and per_node % tp == 0 and self.model.heads % tp == 0

"""The typed RL scenario: what a `kind: rl` YAML file holds, validated when it is loaded.

Shallow on purpose: one level of sections (cluster, split, train, rollout, pipeline, and the
sections other packages own: workload, planner, elastic, selector), each a small model whose
fields and defaults are documented where it is defined. Every default lives in exactly one model:
code reads `sc.workload.prompts_per_step`, never a mapping with a fallback of its own.
`problem_of` is the one way to turn a scenario into the planner's `PlanningProblem`, for the
simulator and for `libra plan` alike.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from libra.core.config import build
from libra.core.errors import ConfigError
from libra.core.specs import HardwareSpec
from libra.costmodel.catalog import Catalog
from libra.costmodel.efficiency import DEFAULT_ENGINE, EngineName, Profile
from libra.planner.config import ElasticConfig, PlannerConfig, SelectorConfig
from libra.planner.problem import PlanningProblem
from libra.rollout.tail import TailConfig
from libra.sim.workloads.base import WorkloadConfig


class _Strict(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")


MAX_NODES = 8192  # 65536 GPUs of 8: the planner takes about a minute there, and more exhausts memory


class ClusterCfg(_Strict):
    nodes: int = Field(ge=1, le=MAX_NODES)
    hardware: str


class SplitCfg(_Strict):
    train_gpus: int = Field(ge=1)
    rollout_gpus: int = Field(ge=1)


class TrainCfg(_Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    micro_batch: int = Field(1, ge=1)
    recompute: bool = True


class BucketCfg(_Strict):
    name: str
    tp: int = Field(ge=1)
    max_context: int = Field(ge=1)


class RolloutCfg(_Strict):
    # Upper bounds well past any real engine's (vLLM's defaults are 256 / 8192); beyond them the
    # simulator would spend minutes per step on a value that is surely a typo.
    max_num_seqs: int = Field(256, ge=1, le=16384)
    max_num_batched_tokens: int = Field(8192, ge=64, le=1 << 20)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_during_tool: Literal["resident", "offload", "drop"] = "resident"
    homogeneous_tp: int = Field(4, ge=1, description="TP of every instance in homogeneous layouts")
    layout_per_node: list[PositiveInt] = Field(
        default_factory=lambda: [1, 1, 2, 4],
        min_length=1,
        description="heterogeneous layout: the TP of each instance on a rollout node",
    )
    buckets: list[BucketCfg]
    # Far below max_num_seqs on purpose: at 256 no instance ever filled, so a length-aware router
    # left a bucket idle while another queued (docs/rollout.md, "Spill-over").
    instance_cap: int = Field(
        48, ge=1, description="outstanding requests per instance before new work spills to a neighbour bucket"
    )
    router_params: dict = Field(default_factory=dict)
    engine: EngineName = Field(
        DEFAULT_ENGINE, description="engine preset for the CPU overhead: vllm-v1 or vllm-v0"
    )

    @model_validator(mode="after")
    def _sorted(self) -> RolloutCfg:
        caps = [b.max_context for b in self.buckets]
        if not caps or caps != sorted(caps):
            raise ValueError("buckets must be a non-empty list ordered by max_context")
        return self


class PipelineCfg(_Strict):
    staleness: int = Field(1, ge=0, le=64, description="rollout may run at most k steps ahead of training")
    consume: Literal["completion", "batch"] = Field(
        "completion",
        description="disaggregated systems: training step s takes the first GRPO groups to finish "
        "(completion, as AReaL does) or exactly the groups of batch s (batch)",
    )
    strict_staleness: bool = Field(
        True,
        description="how the staleness bound is kept on trained tokens (libra.planner.staleness): true, a "
        "step first trains, and waits for, groups sampled `staleness` versions ago; false, a group that "
        "finishes older than the bound expires and a fresh group replaces it (expired_groups), the live "
        "run's rule. Strict costs less throughput on every workload measured (docs/peers.md)",
    )
    switch_s: float = Field(20.0, ge=0, description="colocated systems: switch cost per direction")
    weight_sync_s: float | None = Field(None, ge=0, description="None: computed from model size and network")
    tool_latency_default_s: float = Field(2.0, ge=0, description="for trace turns without tool_latency_s")


class ArealCfg(_Strict):
    """AReaL (arXiv 2505.24298). Its staleness bound eta is `pipeline.staleness`, shared with every
    system so that asynchronous systems are compared at one bound."""

    interrupt: bool = Field(
        True, description="weight updates interrupt the requests in flight, which recompute their KV"
    )


class AprilCfg(_Strict):
    """APRIL (arXiv 2509.18521), on slime's synchronous pipeline."""

    over_provision: float = Field(
        2.0, ge=1, le=8, description="GRPO groups kept in flight per step, over its target"
    )


class SeerCfg(_Strict):
    """Seer (arXiv 2511.14617), synchronous."""

    chunk_tokens: int = Field(
        8192, ge=0, le=1 << 20, description="divided rollout: output tokens per chunk; 0: off"
    )
    context_aware: bool = Field(True, description="probe each group, then longest estimated first; off: FCFS")
    speculative: bool = Field(True, description="grouped speculative decoding")
    # Stated, not derived (the simulator has no tokens): 0.5 yields about two tokens per
    # verification at the longest draft, what suffix-tree drafting from sibling responses gives.
    acceptance_rate: float = Field(
        0.5, gt=0, lt=1, description="per draft token, drafts from the group's other responses"
    )
    max_draft: int = Field(4, ge=1, le=16, description="the longest draft; the length adapts to the batch")


class HeddleCfg(_Strict):
    """Heddle (arXiv 2603.28101), on a synchronous pipeline."""

    priority: bool = Field(True, description="progressive priority: longest predicted remaining first")
    migrate_in_tool: bool = Field(True, description="move a trajectory's KV while its tool runs")
    oracle: bool = Field(
        False, description="the ceiling of its mechanisms: predictions are the true final lengths"
    )
    per_trajectory_tp: bool = Field(
        True,
        description="engines of several TPs from the presorted DP, each trajectory on its predicted length's; off: one TP",
    )


class PeersCfg(_Strict):
    """Options of the peer systems (`sim.rl.peers`), one section each; defaults are the papers'."""

    areal: ArealCfg = ArealCfg()
    april: AprilCfg = AprilCfg()
    seer: SeerCfg = SeerCfg()
    heddle: HeddleCfg = HeddleCfg()


class RLScenario(_Strict):
    kind: Literal["rl"] = "rl"
    name: str
    description: str = ""
    cluster: ClusterCfg
    model: str
    workload: WorkloadConfig
    split: SplitCfg
    train: TrainCfg = TrainCfg()
    rollout: RolloutCfg
    pipeline: PipelineCfg = PipelineCfg()
    steps: int = Field(100, ge=1)
    systems: list[str] | None = None
    planner: PlannerConfig = PlannerConfig()
    elastic: ElasticConfig = ElasticConfig()
    selector: SelectorConfig = SelectorConfig()
    tail: TailConfig = TailConfig()
    peers: PeersCfg = PeersCfg()
    trace_step: int | None = Field(None, ge=0, description="the step drawn in trace.json")

    def check(self, catalog: Catalog, split: bool = True) -> None:
        """Cross-field rules the catalog decides. `split=False` for `libra plan`, which chooses
        the split itself (and may resize the cluster under it)."""
        from libra.sim.workloads import make_workload

        make_workload(self.workload)  # the family exists and its params validate
        hw = catalog.hardware(self.cluster.hardware, "cluster.hardware")
        model = catalog.model(self.model, "model")
        total = self.cluster.nodes * hw.gpus_per_node
        if split and self.split.train_gpus + self.split.rollout_gpus != total:
            raise ConfigError("split", self.split.model_dump(), f"train_gpus + rollout_gpus == {total} GPUs")
        if sum(self.rollout.layout_per_node) > hw.gpus_per_node:
            raise ConfigError(
                "rollout.layout_per_node",
                self.rollout.layout_per_node,
                f"TPs summing to <= {hw.gpus_per_node}",
            )
        for t in [
            *self.rollout.layout_per_node,
            self.rollout.homogeneous_tp,
            *(b.tp for b in self.rollout.buckets),
        ]:
            if t > hw.gpus_per_node or model.heads % t:
                raise ConfigError(
                    "rollout tp", t, f"<= {hw.gpus_per_node} and a divisor of {model.heads} heads"
                )


def problem_of(
    sc: RLScenario,
    hw: HardwareSpec,
    catalog: Catalog,
    nodes: int | None = None,
    profile: Profile | None = None,
) -> PlanningProblem:
    """The planner's problem for a scenario (on `nodes` nodes, default the scenario's)."""
    w, r = sc.workload, sc.rollout
    return PlanningProblem(hw, nodes or sc.cluster.nodes, catalog.model(sc.model, "model"), w.prompts_per_step,
                           w.samples_per_prompt, w.max_length, r.max_num_seqs, r.max_num_batched_tokens,
                           r.gpu_memory_utilization, profile=profile or Profile(),
                           staleness=sc.pipeline.staleness, consume=sc.pipeline.consume,
                           engine=r.engine)  # fmt: skip


def parse_rl(data: dict, catalog: Catalog, split: bool = True) -> RLScenario:
    """Validate an RL scenario mapping, then check it against the catalog."""
    sc = build(RLScenario, data, prefix="scenario")
    sc.check(catalog, split=split)
    return sc

"""Workloads of the action-orchestration scenarios: what trajectories ask of external resources.

A plan is, per trajectory, a list of segments "generate for g seconds, then run this action (or
end)". Generation is not what these scenarios study (no rollout engine is modelled): its time is
output tokens / decode rate plus a per-turn overhead, identical for every system compared.

- `coding`: AI-coding agents with one sandbox per trajectory. Turn structure (turns, output
  tokens, which tool, the tool's latency) comes from the RL workload families (`r2e-gym` by
  default), so agents behave like the rest of the simulator's agents. Each tool call becomes a
  CPU action by the scenario's `tools` table: test runs are elastic (pytest -n {parallel}), the
  rest run on one core.
- `mopd`: multi-teacher on-policy distillation / multi-reward RL. Each GRPO group, once its last
  sample is generated, is scored by the teacher or reward service of its prompt's domain: one GPU
  action whose one-GPU time and TP efficiency come from the cost model (prefill of the group's
  tokens on that service's model and hardware).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from libra.actions.profiles import EfficiencyProfile, lookup
from libra.actions.resources import Discrete, ResourceVector, parse_feasible
from libra.core.errors import ConfigError
from libra.costmodel.catalog import Catalog
from libra.costmodel.efficiency import RolloutEfficiency
from libra.costmodel.rollout import RolloutCostModel
from libra.sim.workloads import make_workload
from libra.sim.workloads.sampling import LogSpread, WeightedChoice


@dataclass(slots=True)
class ActionSpec:
    kind: str
    t1: float  # true one-unit duration; what a scheduler is told is an estimate
    demand: ResourceVector
    profile: EfficiencyProfile | None = None
    service: str | None = None


@dataclass(slots=True)
class TrajPlan:
    id: str
    segments: list[tuple[float, ActionSpec | None]] = field(default_factory=list)
    tokens: int = 0


# ---- coding ------------------------------------------------------------------------------------


class ToolAction(BaseModel):
    """How one tool call becomes an action: its kind, cores, profile and one-core duration."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    kind: str
    share: float = Field(1.0, gt=0, description="Weight among the alternatives listed for the tool.")
    cpu: object = Field(1, description="Feasible cores: a number, [lo, hi] or {set: [...]}.")
    profile: str | None = Field(None, description="Efficiency profile; none means not elastic.")
    t1_median_s: float | None = Field(None, gt=0, description="One-core time; default: the trace's latency.")
    t1_sigma: LogSpread = Field(
        0.4, description="Log-space spread of one call's time around its repository's."
    )
    t1_traj_sigma: LogSpread = Field(0.9, description="Log-space spread between repositories (trajectories).")
    scale_key: str | None = Field(
        None, description="Actions with one key share a repository's scale (default: the kind)."
    )


class CodingParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    workload: dict = Field(
        default_factory=lambda: {"family": "r2e-gym", "prompts_per_step": 16, "samples_per_prompt": 16}
    )
    first_step: int = Field(100, ge=0, description="RL step the first simulated step stands for (drift).")
    decode_tok_s: float = Field(30.0, gt=0, description="Per-sequence decode rate of the policy model.")
    turn_overhead_s: float = Field(1.0, ge=0, description="Prefill and queueing per turn, seconds.")
    env_memory_gib: float = Field(4.0, ge=0, description="Memory a trajectory's sandbox holds.")
    default_latency_s: float = Field(
        1.0, gt=0, description="One-core time of a call with no recorded latency."
    )
    tools: dict[str, list[ToolAction]] = Field(default_factory=dict, description="Tool name -> actions.")
    default_tool: list[ToolAction] = Field(default_factory=lambda: [ToolAction(kind="shell")])
    reward: ToolAction | None = Field(
        None,
        description="The reward call after the last turn, in the trajectory's sandbox (a SWE "
        "verifier runs the repository's tests); none: trajectories end at their last turn.",
    )


class CodingWorkload:
    def __init__(self, params: CodingParams, profiles: Mapping[str, EfficiencyProfile]):
        self.p = params
        self.family = make_workload(params.workload)
        self.choices = {
            tool: self._compile(f"coding.tools.{tool}", alts, profiles) for tool, alts in params.tools.items()
        }
        self.default = self._compile("coding.default_tool", params.default_tool, profiles)
        self.reward = (
            self._compile("coding.reward", [params.reward], profiles, one=True) if params.reward else None
        )

    def _compile(
        self, field: str, alts: list[ToolAction], profiles, one: bool = False
    ) -> tuple[WeightedChoice, dict]:
        """Alternatives listed under `field` (errors name it; `one`: a single action, not a list)."""
        if not alts:
            raise ConfigError(field, alts, "at least one action")
        table = {}
        for i, a in enumerate(alts):
            where = field if one else f"{field}[{i}]"
            cpu = parse_feasible(a.cpu, f"{where}.cpu")
            demand = ResourceVector.from_mapping({"cpu": cpu, "memory": self.p.env_memory_gib}, key="cpu")
            table[str(i)] = (a, demand, lookup(profiles, a.profile, f"{where}.profile"))
        return WeightedChoice({str(i): a.share for i, a in enumerate(alts)}), table

    def step(self, index: int, rng: random.Random) -> list[TrajPlan]:
        trajs = self.family.generate(self.p.first_step + index, rng)
        return [self._plan(t, index, rng) for t in trajs]

    def _plan(self, traj, index: int, rng: random.Random) -> TrajPlan:
        """One trajectory. Its repository sets a scale for each kind of action (a big test suite
        is big every time the agent runs it), and each call varies around that."""
        plan = TrajPlan(f"s{index}-{traj.id}", tokens=traj.generated_tokens)
        scale: dict[str, float] = {}
        for turn in traj.turns:
            gen = self.p.turn_overhead_s + turn.output_tokens / self.p.decode_tok_s
            act = (
                self._action(self.choices.get(turn.tool, self.default), turn, rng, scale)
                if turn.has_tool
                else None
            )
            plan.segments.append((gen, act))
        if self.reward is not None:  # the verifier runs once the agent has finished
            # A trajectory cut off on a tool call (at max length) is scored too.
            gen = plan.segments.pop()[0] if plan.segments and plan.segments[-1][1] is None else 0.0
            plan.segments += [(gen, self._action(self.reward, None, rng, scale)), (0.0, None)]
        return plan

    def _action(self, compiled, turn, rng: random.Random, scale: dict[str, float]) -> ActionSpec:
        choice, table = compiled
        alt, demand, profile = table[choice.pick(rng)]
        if alt.t1_median_s is not None:
            key = alt.scale_key or alt.kind
            repo = scale.setdefault(key, rng.lognormvariate(0.0, alt.t1_traj_sigma))
            t1 = repo * rng.lognormvariate(0.0, alt.t1_sigma) * alt.t1_median_s
        elif turn is not None and turn.tool_latency_s is not None:
            t1 = turn.tool_latency_s
        else:
            t1 = self.p.default_latency_s
        return ActionSpec(alt.kind, t1, demand, profile)


# ---- mopd --------------------------------------------------------------------------------------


class ServiceParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    name: str
    model: str = Field(description="A catalog model (see `libra costmodel catalog`).")
    share: float = Field(1.0, gt=0, description="Share of prompts whose domain this service scores.")


class MopdParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    # Bounded so a typo cannot make one step take hours (the setting is 512 x 8, 1K + 4K tokens).
    prompts_per_step: int = Field(64, ge=1, le=4096)
    samples_per_prompt: int = Field(16, ge=1, le=1024)
    prompt_tokens_median: float = Field(1024, gt=0, le=1 << 20)
    response_tokens_median: float = Field(4096, gt=0, le=1 << 20)
    response_tokens_sigma: LogSpread = Field(0.8)
    max_response_tokens: int = Field(32768, ge=1)
    decode_tok_s: float = Field(30.0, gt=0, description="Per-sequence decode rate of the policy model.")
    workspace_gib: float = Field(6.0, ge=0, description="Per-GPU memory a service needs beyond its weights.")
    restore_gbps: float = Field(24.0, gt=0, description="Host-to-GPU copy rate per GPU (PCIe Gen4 x16).")
    restore_fixed_s: float = Field(1.0, ge=0, description="Engine re-initialisation after a restore.")
    services: list[ServiceParams]


class MopdWorkload:
    def __init__(self, params: MopdParams, catalog: Catalog, hardware: str, eff: RolloutEfficiency | None):
        if not params.services:
            raise ConfigError("mopd.services", [], "at least one service")
        self.p = params
        self.hw = catalog.hardware(hardware, "cluster.hardware")
        self.domains = WeightedChoice({s.name: s.share for s in params.services})
        self.models = {
            s.name: catalog.model(s.model, f"mopd.services.{s.name}.model") for s in params.services
        }
        self._cm = {s: RolloutCostModel(self.hw, m, 1, eff) for s, m in self.models.items()}
        self._eff = eff
        self.profiles = {s: self._profile(s) for s in self.models}

    def state_gib(self, service: str) -> float:
        return self.models[service].weight_bytes / 2**30

    def _profile(self, service: str) -> EfficiencyProfile:
        """TP efficiency of prefilling a typical sample: E(d) = T(1) / (d T(d)), by the cost model."""
        tokens = int(self.p.prompt_tokens_median + self.p.response_tokens_median)
        t1 = self._cm[service].prefill_time(tokens)
        pts = []
        for d in (1, 2, 4, 8):
            if d > self.hw.gpus_per_node or self.models[service].heads % d:
                continue
            td = RolloutCostModel(self.hw, self.models[service], d, self._eff).prefill_time(tokens)
            pts.append((d, min(1.0, t1 / (d * td))))
        return EfficiencyProfile(f"{service}-tp", tuple(pts), "cost model: prefill at TP d")

    def step(self, index: int, rng: random.Random, dops: Mapping[str, tuple[int, ...]]) -> list[TrajPlan]:
        return [self._group(index, k, rng, dops) for k in range(self.p.prompts_per_step)]

    def _group(self, index: int, k: int, rng: random.Random, dops) -> TrajPlan:
        p = self.p
        service = self.domains.pick(rng)
        prompt = int(rng.lognormvariate(0.0, 0.3) * p.prompt_tokens_median)
        responses = [
            min(
                p.max_response_tokens,
                int(rng.lognormvariate(0.0, p.response_tokens_sigma) * p.response_tokens_median),
            )
            for _ in range(p.samples_per_prompt)
        ]
        gen = max(responses) / p.decode_tok_s
        t1 = sum(self._cm[service].prefill_time(prompt + r) for r in responses)
        demand = ResourceVector.from_mapping({"gpu": Discrete(dops[service])}, key="gpu")
        act = ActionSpec(f"score:{service}", t1, demand, self.profiles[service], service)
        return TrajPlan(f"s{index}-g{k}", [(gen, act), (0.0, None)], tokens=sum(responses))

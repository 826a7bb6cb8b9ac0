"""The tool-using agent process shared by `search-r1` and `r2e-gym`.

Why a generative process and not sampled lengths: routers (C-MLFQ) learn from what a trajectory
has shown so far (tool type, return size, failures) to predict how long it will go on. That only
means something if those signals *cause* the length here as they do in real agents. So a
trajectory is produced turn by turn:

1. The model writes a turn: lognormal output tokens whose median drifts over training, differs
   from prompt to prompt and sample to sample (output_prompt_sigma, output_sample_sigma), is longer on hard
   prompts (output_difficulty_gain) and after a large tool return (output_return_gain: a long log
   or file takes longer to reason about).
2. It either answers (ends) or calls a tool. The log-odds of answering after turn k is
       finish_logit(step) + finish_turn_slope * k
       - finish_difficulty_gain * difficulty
       - finish_failure_penalty * recent_failures
       - finish_return_penalty * max(0, ln(last_return / return_ref_tokens))
   so failures and large returns keep the agent going, and hard prompts run longer.
3. The tool fails with log-odds fail_logit + tool offset + fail_difficulty_gain * difficulty
   + a per-sample deviation (fail_sample_sigma: some rollouts are sloppier than others)
   (+ fail_repeat_gain right after a failure: errors come in streaks). A failure is a timeout
   with the tool's timeout_share.
4. Stuck loops: `stuck_after` consecutive failures put the agent in a loop (it cannot get the
   tests to run, an edit keeps failing): while stuck it fails more (stuck_fail_gain) and rarely
   answers (stuck_finish_penalty), and it leaves the loop with `stuck_recover` per tool call.
   This is how repeated failures run a rollout to the length limit, while an isolated failure
   changes little, as in real SWE traces.
5. The return's size is lognormal around the tool's median times the environment's verbosity
   (a per-prompt latent: a repository with huge test logs is huge for every GRPO sample).

Difficulty and verbosity are drawn per prompt and perturbed per sample, so siblings in a GRPO
group are informative about each other, but not perfectly. The strength of every effect is a
parameter; the defaults of each family are calibrated to real traces (see docs/workloads.md).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.fields import FieldInfo

from libra.core.trajectory import ToolStatus, Trajectory
from libra.sim.workloads.base import WorkloadConfig, validate_params
from libra.sim.workloads.sampling import (
    LogSpread,
    TrajectoryBuilder,
    WeightedChoice,
    drift_fraction,
    lerp,
    log_lerp,
    lognormal_int,
    sigmoid,
)


class ToolSpec(BaseModel):
    """One tool an agent can call: how often, how big its returns are, how it fails, how slow it is."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    weight: float = Field(gt=0, description="Relative frequency of this tool among tool calls.")
    return_median: float = Field(gt=0, description="Median tokens of a successful return (verbosity 1).")
    return_sigma: LogSpread = Field(description="Log-space spread of a return's size.")
    failure_return_median: float = Field(gt=0, description="Median tokens of an error return (traceback).")
    fail_logit_offset: float = Field(0.0, description="Added to fail_logit for this tool.")
    timeout_share: float = Field(0.0, ge=0, le=1, description="Share of this tool's failures that time out.")
    latency_median_s: float = Field(gt=0, description="Median wall time of a call, seconds.")
    latency_sigma: LogSpread = Field(0.5, description="Log-space spread of the call's wall time.")


class AgentParams(BaseModel):
    """Parameters of the agent process. Families subclass this to set calibrated defaults."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    max_turns: int = Field(ge=1, description="Turn limit; the last allowed turn never calls a tool.")
    min_turns: int = Field(1, ge=1, description="The agent cannot answer before this turn.")
    drift_steps: int = Field(100, ge=1, description="RL steps over which the *_start values reach *_end.")
    prompt_tokens_median: float = Field(gt=0, description="Median prompt length (shared by a group).")
    prompt_tokens_sigma: LogSpread = Field(description="Log-space spread of prompt length.")
    difficulty_prompt_sigma: LogSpread = Field(description="Spread of the per-prompt difficulty latent.")
    difficulty_sample_sigma: LogSpread = Field(
        description="Per-sample deviation from the prompt's difficulty."
    )
    verbosity_prompt_sigma: LogSpread = Field(description="Log-spread of the per-prompt tool-return scale.")
    verbosity_sample_sigma: LogSpread = Field(description="Per-sample log-deviation of that scale.")
    output_tokens_start: float = Field(gt=0, description="Median output tokens per turn at step 0.")
    output_tokens_end: float = Field(gt=0, description="Median output tokens per turn from drift_steps on.")
    output_tokens_sigma: LogSpread = Field(description="Log-space spread of a turn's output tokens.")
    output_prompt_sigma: LogSpread = Field(0.0, description="Per-prompt log-spread of output per turn.")
    output_sample_sigma: LogSpread = Field(0.0, description="Per-sample log-spread of output per turn.")
    output_difficulty_gain: LogSpread = Field(
        0.0, description="Log output per turn added per unit difficulty."
    )
    output_return_gain: LogSpread = Field(0.0, description="Log output added per e-fold of the last return.")
    finish_logit_start: float = Field(description="Base log-odds of answering after a turn, at step 0.")
    finish_logit_end: float = Field(description="Base log-odds of answering, from drift_steps on.")
    finish_turn_slope: float = Field(0.0, description="Added to the log-odds of answering per turn taken.")
    finish_difficulty_gain: float = Field(ge=0, description="Log-odds of answering lost per unit difficulty.")
    finish_failure_penalty: float = Field(ge=0, description="Log-odds lost per recent failure.")
    failure_memory: float = Field(0.5, ge=0, le=1, description="Decay per turn of the recent-failure count.")
    finish_return_penalty: float = Field(ge=0, description="Log-odds lost per e-fold of the last return.")
    return_ref_tokens: float = Field(gt=0, description="Returns above this size delay the answer.")
    fail_logit: float = Field(description="Base log-odds that a tool call fails.")
    fail_difficulty_gain: float = Field(ge=0, description="Log-odds of failing added per unit difficulty.")
    fail_sample_sigma: LogSpread = Field(0.0, description="Per-sample spread of the log-odds of failing.")
    fail_repeat_gain: float = Field(ge=0, description="Log-odds of failing added right after a failure.")
    stuck_after: int = Field(3, ge=1, description="Consecutive failures that put the agent in a loop.")
    stuck_finish_penalty: float = Field(0.0, ge=0, description="Log-odds of answering lost while stuck.")
    stuck_fail_gain: float = Field(0.0, ge=0, description="Log-odds of failing added while stuck.")
    stuck_recover: float = Field(0.1, ge=0, le=1, description="Chance per tool call of leaving the loop.")
    timeout_s: float = Field(gt=0, description="Latency of a call that times out, seconds.")
    timeout_return_tokens: float = Field(gt=0, description="Median tokens returned by a timeout.")
    tools: dict[str, ToolSpec] = Field(description="The tools, by name.")

    @model_validator(mode="after")
    def _consistent(self) -> AgentParams:
        if self.min_turns > self.max_turns:
            raise ValueError(f"min_turns ({self.min_turns}) must be <= max_turns ({self.max_turns})")
        if not self.tools:
            raise ValueError("tools must name at least one tool")
        return self


def with_defaults(name: str, doc: str, **defaults) -> type[AgentParams]:
    """A subclass of AgentParams with other defaults; descriptions and bounds stay the base's."""
    fields = {}
    for key, value in defaults.items():
        base = AgentParams.model_fields[key]
        info = FieldInfo.merge_field_infos(base, default_factory=value) if callable(value) else (
            FieldInfo.merge_field_infos(base, default=value))  # fmt: skip
        fields[key] = (base.annotation, info)
    return create_model(name, __base__=AgentParams, __doc__=doc, **fields)


@dataclass(slots=True)
class PromptTraits:
    """What the GRPO samples of one prompt share."""

    id: str
    tokens: int
    difficulty: float
    log_verbosity: float
    log_output_scale: float = 0.0


@dataclass(slots=True)
class _StepKnobs:
    """Parameters that drift with the RL step, resolved once per step."""

    output_median: float
    finish_logit: float


@dataclass(slots=True)
class _AgentState:
    """One sample's latents and what its history so far does to the next decision."""

    difficulty: float
    verbosity: float
    finish_base: float
    fail_base: float
    out_median: float
    recent: float = 0.0  # decayed count of failures
    streak: int = 0  # consecutive failures
    stuck: bool = False
    return_excess: float = 0.0  # ln(last return / return_ref_tokens), at least 0

    @classmethod
    def draw(cls, p: AgentParams, prompt: PromptTraits, knobs: _StepKnobs, rng: random.Random) -> _AgentState:
        difficulty = prompt.difficulty + rng.gauss(0.0, p.difficulty_sample_sigma)
        return cls(
            difficulty=difficulty,
            verbosity=math.exp(prompt.log_verbosity + rng.gauss(0.0, p.verbosity_sample_sigma)),
            finish_base=knobs.finish_logit - p.finish_difficulty_gain * difficulty,
            fail_base=p.fail_logit
            + p.fail_difficulty_gain * difficulty
            + rng.gauss(0.0, p.fail_sample_sigma),
            out_median=knobs.output_median
            * math.exp(
                prompt.log_output_scale
                + p.output_difficulty_gain * difficulty
                + rng.gauss(0.0, p.output_sample_sigma)
            ),
        )

    def output_median(self, p: AgentParams) -> float:
        return self.out_median * math.exp(p.output_return_gain * self.return_excess)

    def finish_logit(self, p: AgentParams, turns: int) -> float:
        logit = self.finish_base + p.finish_turn_slope * turns
        logit -= p.finish_failure_penalty * self.recent + p.finish_return_penalty * self.return_excess
        return logit - p.stuck_finish_penalty if self.stuck else logit

    def fail_logit(self, p: AgentParams, tool: ToolSpec) -> float:
        logit = self.fail_base + tool.fail_logit_offset + (p.fail_repeat_gain if self.streak else 0.0)
        return logit + p.stuck_fail_gain if self.stuck else logit

    def after_tool(self, p: AgentParams, failed: bool, tokens: int, rng: random.Random) -> None:
        self.recent = self.recent * p.failure_memory + failed
        self.streak = self.streak + 1 if failed else 0
        self.return_excess = max(0.0, math.log(max(tokens, 1) / p.return_ref_tokens))
        if self.stuck:
            self.stuck = rng.random() >= p.stuck_recover
        elif self.streak >= p.stuck_after:
            self.stuck = True


class AgentWorkload:
    """A tool-using agent family. Subclasses set `name`, `Params` and the docstring."""

    name: ClassVar[str] = "agent"
    Params: ClassVar[type[AgentParams]] = AgentParams

    def __init__(self, cfg: WorkloadConfig):
        self.cfg = cfg
        self.params = validate_params(self.Params, self._with_default_tools(cfg.params), "workload.params")
        self._tools = self.params.tools
        self._choice = WeightedChoice({k: t.weight for k, t in self._tools.items()})

    @classmethod
    def _with_default_tools(cls, params: object) -> object:
        """`tools` given in params are merged over the family's default tools, field by field, so
        `--set workload.params.tools.execute_bash.latency_median_s=5` changes one field and keeps
        the rest; a tool set to null is removed; a new tool must give every required field."""
        given = params.get("tools") if isinstance(params, dict) else None
        if not isinstance(given, dict):
            return params
        tools = {name: spec.model_dump() for name, spec in cls.Params().tools.items()}
        for name, spec in given.items():
            if spec is None:
                tools.pop(name, None)
            elif isinstance(spec, dict) and name in tools:
                tools[name] = {**tools[name], **spec}
            else:
                tools[name] = spec
        return {**params, "tools": tools}

    def generate(self, step: int, rng: random.Random) -> list[Trajectory]:
        knobs = self._knobs(step)
        out: list[Trajectory] = []
        for i in range(self.cfg.prompts_per_step):
            prompt = self.prompt(step, i, rng)
            out.extend(
                self._trajectory(prompt, step, j, knobs, rng) for j in range(self.cfg.samples_per_prompt)
            )
        return out

    def _knobs(self, step: int) -> _StepKnobs:
        p, f = self.params, drift_fraction(step + self.cfg.first_step, self.params.drift_steps)
        return _StepKnobs(
            log_lerp(p.output_tokens_start, p.output_tokens_end, f),
            lerp(p.finish_logit_start, p.finish_logit_end, f),
        )

    def prompt(self, step: int, i: int, rng: random.Random) -> PromptTraits:
        p = self.params
        # A prompt may take at most half the context, so every sample has room to act.
        tokens = min(
            lognormal_int(rng, p.prompt_tokens_median, p.prompt_tokens_sigma), self.cfg.max_length // 2
        )
        return PromptTraits(
            f"s{step}-p{i}",
            tokens,
            rng.gauss(0.0, p.difficulty_prompt_sigma),
            rng.gauss(0.0, p.verbosity_prompt_sigma),
            rng.gauss(0.0, p.output_prompt_sigma),
        )

    def _trajectory(self, prompt: PromptTraits, step: int, j: int, knobs: _StepKnobs, rng: random.Random):
        p = self.params
        traj = Trajectory(f"{prompt.id}-{j}", prompt.id, step, prompt.tokens)
        builder = TrajectoryBuilder(traj, self.cfg.max_length, p.max_turns)
        agent = _AgentState.draw(p, prompt, knobs, rng)
        while builder.add_output(lognormal_int(rng, agent.output_median(p), p.output_tokens_sigma)):
            if builder.turns >= p.min_turns and rng.random() < sigmoid(agent.finish_logit(p, builder.turns)):
                break
            name = self._choice.pick(rng)
            tool = self._tools[name]
            status = self._status(tool, agent.fail_logit(p, tool), rng)
            tokens, latency = self._tool_return(tool, status, agent.verbosity, rng)
            if not builder.add_tool(name, tokens, status, latency):
                break
            agent.after_tool(p, status != ToolStatus.SUCCESS, tokens, rng)
        return traj

    @staticmethod
    def _status(tool: ToolSpec, fail_logit: float, rng: random.Random) -> ToolStatus:
        if rng.random() >= sigmoid(fail_logit):
            return ToolStatus.SUCCESS
        return ToolStatus.TIMEOUT if rng.random() < tool.timeout_share else ToolStatus.FAILURE

    def _tool_return(self, tool: ToolSpec, status: ToolStatus, verbosity: float, rng: random.Random):
        p = self.params
        if status == ToolStatus.TIMEOUT:
            return lognormal_int(rng, p.timeout_return_tokens, 0.5), p.timeout_s
        median = tool.return_median if status == ToolStatus.SUCCESS else tool.failure_return_median
        tokens = lognormal_int(rng, median * verbosity, tool.return_sigma, minimum=0)
        return tokens, tool.latency_median_s * math.exp(rng.gauss(0.0, tool.latency_sigma))

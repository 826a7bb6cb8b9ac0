"""`dapo-math`: long single-turn reasoning, with answer-validator feedback turns.

Shape and sources (there is no real trace of this family in shared/data, so the choices are
written down here and in docs/workloads.md):
- DAPO (Yu et al., arXiv 2503.14476) trains on DAPO-Math-17K: short problem statements, one long
  chain-of-thought response per sample, a rule-based answer check, and a mean response length that
  grows steadily over training. Libra runs it on Qwen3-14B with a 40960-token limit, so responses
  are several thousand tokens long. We take a median first response of 3K tokens at step 0
  growing to 6.5K at the end of the horizon.
- Validator feedback: the answer goes to a validator. A correct answer ends the trajectory; a wrong
  or unparsable one gets a short feedback message (a tool turn with status `failure`, or `timeout`
  when the checker times out, as math-verify can on pathological expressions) and the model tries
  again, up to `max_turns` attempts. Most trajectories are therefore one turn.
- Causality: a per-prompt difficulty (perturbed per sample) raises both the chance of a wrong
  answer and the length of the reasoning, so failures and length are correlated through the
  process itself. Per-prompt difficulty is wide because GRPO groups are often all-right or
  all-wrong (the reason DAPO's dynamic sampling exists).
"""

from __future__ import annotations

import math
import random
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from libra.core.trajectory import ToolStatus, Trajectory
from libra.sim.workloads.agent import PromptTraits
from libra.sim.workloads.base import WorkloadConfig, validate_params
from libra.sim.workloads.sampling import (
    LogSpread,
    TrajectoryBuilder,
    drift_fraction,
    lerp,
    log_lerp,
    lognormal_int,
    sigmoid,
)

VALIDATOR = "validator"


class DapoMathParams(BaseModel):
    """Parameters of the reasoning-with-validator process; the defaults are the choices above."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    max_turns: int = Field(3, ge=1, description="Answer attempts; the validator answers all but the last.")
    drift_steps: int = Field(100, ge=1, description="RL steps over which the *_start values reach *_end.")
    prompt_tokens_median: float = Field(200, gt=0, description="Problem statement plus instruction, tokens.")
    prompt_tokens_sigma: LogSpread = Field(0.4, description="Log-space spread of prompt length.")
    difficulty_prompt_sigma: LogSpread = Field(1.5, description="Spread of the per-prompt difficulty latent.")
    difficulty_sample_sigma: LogSpread = Field(
        0.4, description="Per-sample deviation from the prompt's difficulty."
    )
    wrong_logit_start: float = Field(
        -0.8, description="Log-odds of a wrong first answer at step 0 (difficulty 0)."
    )
    wrong_logit_end: float = Field(-2.0, description="Log-odds of a wrong first answer from drift_steps on.")
    retry_wrong_gain: float = Field(0.5, ge=0, description="Log-odds of being wrong added on every retry.")
    output_tokens_start: float = Field(3000, gt=0, description="Median first-response tokens at step 0.")
    output_tokens_end: float = Field(
        6500, gt=0, description="Median first-response tokens from drift_steps on."
    )
    output_tokens_sigma: LogSpread = Field(0.5, description="Log-space spread of a response's length.")
    output_difficulty_gain: LogSpread = Field(0.25, description="Log-length added per unit difficulty.")
    retry_output_ratio: float = Field(0.5, gt=0, description="A retry's median length relative to the first.")
    feedback_tokens_median: float = Field(40, gt=0, description="Median tokens of the validator's feedback.")
    feedback_tokens_sigma: LogSpread = Field(0.4, description="Log-space spread of the feedback's length.")
    validator_latency_median_s: float = Field(0.05, gt=0, description="Median validator time, seconds.")
    validator_latency_sigma: LogSpread = Field(0.5, description="Log-space spread of validator time.")
    validator_timeout_share: float = Field(0.01, ge=0, le=1, description="Share of checks that time out.")
    validator_timeout_s: float = Field(10.0, gt=0, description="Latency of a check that times out, seconds.")


class DapoMathWorkload:
    """Single-turn long reasoning; a wrong answer earns a validator feedback turn and a retry."""

    name: ClassVar[str] = "dapo-math"
    Params: ClassVar[type[DapoMathParams]] = DapoMathParams

    def __init__(self, cfg: WorkloadConfig):
        self.cfg = cfg
        self.params = validate_params(self.Params, cfg.params, "workload.params")

    def generate(self, step: int, rng: random.Random) -> list[Trajectory]:
        p, f = self.params, drift_fraction(step + self.cfg.first_step, self.params.drift_steps)
        median = log_lerp(p.output_tokens_start, p.output_tokens_end, f)
        wrong = lerp(p.wrong_logit_start, p.wrong_logit_end, f)
        out: list[Trajectory] = []
        for i in range(self.cfg.prompts_per_step):
            prompt = self.prompt(step, i, rng)
            out.extend(
                self._trajectory(prompt, step, j, median, wrong, rng)
                for j in range(self.cfg.samples_per_prompt)
            )
        return out

    def prompt(self, step: int, i: int, rng: random.Random) -> PromptTraits:
        p = self.params
        tokens = min(
            lognormal_int(rng, p.prompt_tokens_median, p.prompt_tokens_sigma), self.cfg.max_length // 2
        )
        return PromptTraits(f"s{step}-p{i}", tokens, rng.gauss(0.0, p.difficulty_prompt_sigma), 0.0)

    def _trajectory(self, prompt: PromptTraits, step: int, j: int, median: float, wrong: float, rng):
        p = self.params
        difficulty = prompt.difficulty + rng.gauss(0.0, p.difficulty_sample_sigma)
        median *= math.exp(p.output_difficulty_gain * difficulty)
        traj = Trajectory(f"{prompt.id}-{j}", prompt.id, step, prompt.tokens)
        builder = TrajectoryBuilder(traj, self.cfg.max_length, p.max_turns)
        attempt = 0
        while builder.add_output(lognormal_int(rng, median, p.output_tokens_sigma)):
            if rng.random() >= sigmoid(wrong + difficulty + p.retry_wrong_gain * attempt):
                break  # correct: the answer ends the trajectory
            if not builder.add_tool(VALIDATOR, *self._feedback(rng)):
                break
            attempt += 1
            median *= p.retry_output_ratio if attempt == 1 else 1.0
        return traj

    def _feedback(self, rng: random.Random) -> tuple[int, ToolStatus, float]:
        p = self.params
        if rng.random() < p.validator_timeout_share:
            return (
                lognormal_int(rng, p.feedback_tokens_median, p.feedback_tokens_sigma),
                ToolStatus.TIMEOUT,
                p.validator_timeout_s,
            )
        tokens = lognormal_int(rng, p.feedback_tokens_median, p.feedback_tokens_sigma)
        latency = p.validator_latency_median_s * math.exp(rng.gauss(0.0, p.validator_latency_sigma))
        return tokens, ToolStatus.FAILURE, latency

"""`r2e-gym`: software-engineering agents that edit a repository and run bash/python.

What it must reproduce (Libra paper and the held-out SWE-agent statistics in
shared/data/trajectories/README.md):
- long, heavy-tailed trajectories: the longest 10% take more than half of the rollout time;
- drift: mean final length about 2.5K tokens at step 0 and 11.5K at the end of `drift_steps`,
  as the policy learns to explore, reproduce and test before submitting;
- the causal structure of real SWE agents: failures come in streaks and keep the agent going,
  large tool returns (test logs, file views) grow the context and delay the answer, and the
  Spearman correlations of failures / tool-return size / turns with total length sit between the
  Gemini 3 Pro and gpt-5-mini columns.

The tools mirror R2E-Gym's agent scaffold: `execute_bash` (run tests and commands), `file_editor`
(view and edit files), `search` (grep the repository) and `python` (run a reproduction script).
"""

from __future__ import annotations

from pydantic import Field

from libra.sim.workloads.agent import AgentParams, AgentWorkload, ToolSpec


def _default_tools() -> dict[str, ToolSpec]:
    return {
        "execute_bash": ToolSpec(weight=0.40, return_median=220, return_sigma=1.2, failure_return_median=600,
                                 fail_logit_offset=0.5, timeout_share=0.05, latency_median_s=2.0,
                                 latency_sigma=0.8),
        "file_editor": ToolSpec(weight=0.35, return_median=350, return_sigma=1.0, failure_return_median=80,
                                latency_median_s=0.1),
        "search": ToolSpec(weight=0.15, return_median=150, return_sigma=1.0, failure_return_median=40,
                           fail_logit_offset=-1.0, latency_median_s=0.3),
        "python": ToolSpec(weight=0.10, return_median=120, return_sigma=1.0, failure_return_median=500,
                           fail_logit_offset=0.8, timeout_share=0.10, latency_median_s=1.5, latency_sigma=0.8),
    }  # fmt: skip


class R2EGymParams(AgentParams):
    """Defaults calibrated to the SWE-agent columns of the real-trajectory statistics."""

    max_turns: int = Field(100, ge=1, description="Turn limit (R2E-Gym / DeepSWE use 40-100 steps).")
    min_turns: int = Field(3, ge=1, description="The agent explores for at least this many turns.")
    drift_steps: int = Field(100, ge=1, description="RL steps over which the *_start values reach *_end.")
    prompt_tokens_median: float = Field(1500, gt=0, description="System prompt plus issue text, tokens.")
    prompt_tokens_sigma: float = Field(0.3, ge=0, description="Log-space spread of prompt length.")
    difficulty_prompt_sigma: float = Field(
        0.8, ge=0, description="Spread of the per-prompt difficulty latent."
    )
    difficulty_sample_sigma: float = Field(
        0.6, ge=0, description="Per-sample deviation from the prompt's difficulty."
    )
    verbosity_prompt_sigma: float = Field(
        0.6, ge=0, description="Log-spread of the per-repository return scale."
    )
    verbosity_sample_sigma: float = Field(0.3, ge=0, description="Per-sample log-deviation of that scale.")
    output_tokens_start: float = Field(120, gt=0, description="Median output tokens per turn at step 0.")
    output_tokens_end: float = Field(
        200, gt=0, description="Median output tokens per turn from drift_steps on."
    )
    output_tokens_sigma: float = Field(0.7, ge=0, description="Log-space spread of a turn's output tokens.")
    finish_logit_start: float = Field(-1.0, description="Base log-odds of answering after a turn, at step 0.")
    finish_logit_end: float = Field(-3.2, description="Base log-odds of answering, from drift_steps on.")
    finish_turn_slope: float = Field(0.03, description="Added to the log-odds of answering per turn taken.")
    finish_difficulty_gain: float = Field(
        0.6, ge=0, description="Log-odds of answering lost per unit difficulty."
    )
    finish_failure_penalty: float = Field(0.6, ge=0, description="Log-odds lost per recent failure.")
    failure_memory: float = Field(0.6, ge=0, le=1, description="Decay per turn of the recent-failure count.")
    finish_return_penalty: float = Field(
        0.3, ge=0, description="Log-odds lost per e-fold of the last return."
    )
    return_ref_tokens: float = Field(500, gt=0, description="Returns above this size delay the answer.")
    fail_logit: float = Field(-2.6, description="Base log-odds that a tool call fails.")
    fail_difficulty_gain: float = Field(
        0.5, ge=0, description="Log-odds of failing added per unit difficulty."
    )
    fail_repeat_gain: float = Field(1.0, ge=0, description="Log-odds of failing added right after a failure.")
    timeout_s: float = Field(90.0, gt=0, description="Latency of a call that times out, seconds.")
    timeout_return_tokens: float = Field(40, gt=0, description="Median tokens returned by a timeout.")
    tools: dict[str, ToolSpec] = Field(default_factory=_default_tools, description="The tools, by name.")


class R2EGymWorkload(AgentWorkload):
    """SWE agents with bash/python tools: long-tailed, drifting, failure-driven."""

    name = "r2e-gym"
    Params = R2EGymParams

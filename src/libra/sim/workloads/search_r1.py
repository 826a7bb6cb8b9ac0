"""`search-r1`: short-to-medium multi-turn search agents.

Search-R1 interleaves reasoning with retrieval calls; the trajectories are short to medium and
most of the context is the prompt and the model's own text. The defaults reproduce the real
tau-bench airline trace (shared/data/trajectories/tau-bench-airline.jsonl), the closest real
short multi-turn tool-use set we have: turn counts, final context, failure rates, tool-return
share and the Spearman correlations with total length, as `libra trace stats` computes them.

The tools: `search` (top-k passages from a retriever), `fetch` (one whole document or record)
and `ask_user` (a clarifying question; the answer is short, like tau-bench's user replies).
"""

from __future__ import annotations

from pydantic import Field

from libra.sim.workloads.agent import AgentParams, AgentWorkload, ToolSpec


def _default_tools() -> dict[str, ToolSpec]:
    return {
        "search": ToolSpec(weight=0.35, return_median=110, return_sigma=1.0, failure_return_median=30,
                           latency_median_s=0.3),
        "fetch": ToolSpec(weight=0.15, return_median=200, return_sigma=0.7, failure_return_median=25,
                          fail_logit_offset=0.5, latency_median_s=0.6),
        "ask_user": ToolSpec(weight=0.50, return_median=20, return_sigma=0.8, failure_return_median=20,
                             fail_logit_offset=-3.0, latency_median_s=2.0),
    }  # fmt: skip


class SearchR1Params(AgentParams):
    """Defaults calibrated to the tau-bench airline column of the real-trajectory statistics."""

    max_turns: int = Field(30, ge=1, description="Turn limit (tau-bench's environment stops at 30).")
    min_turns: int = Field(4, ge=1, description="The agent cannot answer before this turn.")
    drift_steps: int = Field(100, ge=1, description="RL steps over which the *_start values reach *_end.")
    prompt_tokens_median: float = Field(2500, gt=0, description="System prompt, policy and question, tokens.")
    prompt_tokens_sigma: float = Field(0.05, ge=0, description="Log-space spread of prompt length.")
    difficulty_prompt_sigma: float = Field(
        0.7, ge=0, description="Spread of the per-prompt difficulty latent."
    )
    difficulty_sample_sigma: float = Field(
        0.5, ge=0, description="Per-sample deviation from the prompt's difficulty."
    )
    verbosity_prompt_sigma: float = Field(0.4, ge=0, description="Log-spread of the per-prompt return scale.")
    verbosity_sample_sigma: float = Field(0.2, ge=0, description="Per-sample log-deviation of that scale.")
    output_tokens_start: float = Field(50, gt=0, description="Median output tokens per turn at step 0.")
    output_tokens_end: float = Field(
        50, gt=0, description="Median output tokens per turn from drift_steps on."
    )
    output_tokens_sigma: float = Field(0.8, ge=0, description="Log-space spread of a turn's output tokens.")
    finish_logit_start: float = Field(-3.0, description="Base log-odds of answering after a turn, at step 0.")
    finish_logit_end: float = Field(-3.0, description="Base log-odds of answering, from drift_steps on.")
    finish_turn_slope: float = Field(0.2, description="Added to the log-odds of answering per turn taken.")
    finish_difficulty_gain: float = Field(
        0.5, ge=0, description="Log-odds of answering lost per unit difficulty."
    )
    finish_failure_penalty: float = Field(0.5, ge=0, description="Log-odds lost per recent failure.")
    failure_memory: float = Field(0.5, ge=0, le=1, description="Decay per turn of the recent-failure count.")
    finish_return_penalty: float = Field(
        0.2, ge=0, description="Log-odds lost per e-fold of the last return."
    )
    return_ref_tokens: float = Field(200, gt=0, description="Returns above this size delay the answer.")
    fail_logit: float = Field(-3.5, description="Base log-odds that a tool call fails.")
    fail_difficulty_gain: float = Field(
        0.8, ge=0, description="Log-odds of failing added per unit difficulty."
    )
    fail_repeat_gain: float = Field(0.5, ge=0, description="Log-odds of failing added right after a failure.")
    timeout_s: float = Field(10.0, gt=0, description="Latency of a call that times out, seconds.")
    timeout_return_tokens: float = Field(20, gt=0, description="Median tokens returned by a timeout.")
    tools: dict[str, ToolSpec] = Field(default_factory=_default_tools, description="The tools, by name.")


class SearchR1Workload(AgentWorkload):
    """Short multi-turn search agents, shaped like the real tau-bench airline trace."""

    name = "search-r1"
    Params = SearchR1Params

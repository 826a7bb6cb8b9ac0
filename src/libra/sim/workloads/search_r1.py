"""`search-r1`: short-to-medium multi-turn search agents.

Search-R1 interleaves reasoning with retrieval calls; the trajectories are short to medium and
most of the context is the prompt and the model's own text. The defaults reproduce the real
tau-bench airline trace (shared/data/trajectories/tau-bench-airline.jsonl), the closest real
short multi-turn tool-use set we have: turn counts, final context, failure rates, tool-return
share and the Spearman correlations with total length, as `libra trace stats` computes them.
That trace comes from one fixed policy, so by default nothing drifts (set the *_end values to
make it drift).

The tools: `search` (top-k passages from a retriever), `fetch` (one whole document or record)
and `ask_user` (a clarifying question; the answer is short, like tau-bench's user replies).
"""

from __future__ import annotations

from libra.sim.workloads.agent import AgentWorkload, ToolSpec, with_defaults


def _default_tools() -> dict[str, ToolSpec]:
    return {
        "search": ToolSpec(weight=0.35, return_median=110, return_sigma=0.7, failure_return_median=30,
                           latency_median_s=0.3),
        "fetch": ToolSpec(weight=0.15, return_median=200, return_sigma=0.5, failure_return_median=25,
                          fail_logit_offset=0.5, latency_median_s=0.6),
        "ask_user": ToolSpec(weight=0.50, return_median=20, return_sigma=0.6, failure_return_median=20,
                             fail_logit_offset=-3.0, latency_median_s=2.0),
    }  # fmt: skip


SearchR1Params = with_defaults(
    "SearchR1Params",
    "Defaults calibrated to the tau-bench airline trace (docs/workloads.md).",
    max_turns=30,  # tau-bench's environment stops at 30 turns
    min_turns=5,
    drift_steps=100,
    prompt_tokens_median=2500,  # system prompt, policy and question, as in the tau-bench trace
    prompt_tokens_sigma=0.05,
    difficulty_prompt_sigma=0.8,
    difficulty_sample_sigma=0.3,
    verbosity_prompt_sigma=0.2,
    verbosity_sample_sigma=0.1,
    output_tokens_start=50,
    output_tokens_end=50,
    output_tokens_sigma=0.5,
    finish_logit_start=-3.7,
    finish_logit_end=-3.7,
    finish_turn_slope=0.16,
    finish_difficulty_gain=0.8,
    finish_failure_penalty=2.5,
    failure_memory=0.5,
    finish_return_penalty=0.2,
    return_ref_tokens=200,
    fail_logit=-4.2,
    fail_difficulty_gain=1.5,
    fail_repeat_gain=2.0,
    timeout_s=10.0,
    timeout_return_tokens=20,
    tools=_default_tools,
)


class SearchR1Workload(AgentWorkload):
    """Short multi-turn search agents, shaped like the real tau-bench airline trace."""

    name = "search-r1"
    Params = SearchR1Params

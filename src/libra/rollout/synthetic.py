"""Seeded synthetic trajectory families for router tests and the router benchmark.

The simulator has its own calibrated workload generators; these two exist so that `libra.rollout`
can be tested and benchmarked on its own, on two regimes that matter for C-MLFQ:

- `search_like`: Search-R1-style agents with two tools. Paths repeat across prompts, and the
  path says where the agent is: its first call reveals a short or a multi-hop plan, and a whole
  document (a large return) means the answer comes next. The exact path is informative, and the
  published C-MLFQ works here.
- `swe_like`: long software-engineering agents (tens of turns, a dozen tools, large and varied
  returns). Paths are unique after a few turns, and the final length depends on how hard the task
  is and how verbose the repository is, which shows up in the context's growth rather than in the
  exact sequence of states. It follows the public statistics of real SWE traces (README of the
  shared trajectories): turns p50/p90 ~ 36/66, final context p50/p90 ~ 20K/35K, ~11% of tool
  turns fail, and the mean length drifts upward over steps as the policy learns to explore.

Neither is tuned to make any router look good; tests use them to check *directions* (the exact
path stops helping when paths become unique) and real traces to check numbers.
"""

from __future__ import annotations

import math
import random

from libra.core.trajectory import ToolStatus, Trajectory, Turn

SEARCH_TOOLS = ("search", "lookup")
SWE_TOOLS = (
    "bash", "view", "edit", "create", "search_dir", "find_file", "run_tests", "python", "grep",
    "git_diff", "scroll", "submit_check",
)  # fmt: skip
# Typical return size in tokens per SWE tool (median of a lognormal).
_SWE_RETURN = {
    "bash": 150, "view": 900, "edit": 250, "create": 40, "search_dir": 400, "find_file": 60,
    "run_tests": 1100, "python": 200, "grep": 350, "git_diff": 500, "scroll": 800, "submit_check": 120,
}  # fmt: skip


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def search_like(
    steps: int = 10, prompts: int = 16, samples: int = 8, seed: int = 0, prompt_pool: int | None = None
) -> list[Trajectory]:
    """Search-R1-style trajectories: `steps` x `prompts` x `samples` (GRPO groups).

    A question needs some number of retrieval hops (more for harder prompts). The agent's first
    call reveals its plan: `lookup` (snippets) for one- or two-hop questions, `search` (result
    pages) for multi-hop ones; every hop but the last returns snippets or a page, the last returns
    the whole document (a large return) and the agent answers next; a failed call is retried. So
    the path of states says how far along the agent is. Prompts come from a pool of `prompt_pool`
    (default 4x prompts per step), so some recur in later steps, as in multi-epoch training.
    """
    rng = random.Random(seed)
    pool = prompt_pool or 4 * prompts
    hardness = [rng.random() for _ in range(pool)]
    plen = [int(_lognormal(rng, 300, 0.4)) + 50 for _ in range(pool)]
    out = []
    for step in range(steps):
        for p in rng.sample(range(pool), min(prompts, pool)):
            for s in range(samples):
                turns = _search_turns(rng, hardness[p])
                out.append(Trajectory(f"s{step}-p{p}-{s}", f"p{p}", step, plen[p], turns))
    return out


def _search_turns(rng: random.Random, hard: float) -> list[Turn]:
    hops = max(1, min(6, round(1 + 5 * hard + rng.gauss(0.0, 0.8))))
    tool = SEARCH_TOOLS[1] if hops <= 2 else SEARCH_TOOLS[0]
    hop_return = 250 if tool == "lookup" else 1000
    turns: list[Turn] = []
    done = 0
    while done < hops and len(turns) < 12:
        think = int(_lognormal(rng, 200, 0.4))
        if rng.random() < 0.1:  # the retriever errored out: the agent retries the hop
            turns.append(Turn(think, tool, int(_lognormal(rng, 30, 0.3)), ToolStatus.FAILURE))
            continue
        done += 1
        size = 6500 if done == hops else hop_return
        turns.append(Turn(think, tool, int(_lognormal(rng, size, 0.15)), ToolStatus.SUCCESS))
    turns.append(Turn(int(_lognormal(rng, 300, 0.4))))
    return turns


def swe_like(
    steps: int = 8,
    prompts: int = 8,
    samples: int = 4,
    seed: int = 0,
    drift: float = 0.08,
    prompt_pool: int | None = None,
) -> list[Trajectory]:
    """SWE-agent-style trajectories; the expected number of turns grows by `drift` per step."""
    rng = random.Random(seed)
    pool = prompt_pool or 4 * prompts
    # A task has a difficulty (how long agents keep trying) and a repository verbosity (how big
    # every tool return is); both are per prompt, so GRPO siblings share them.
    difficulty = [_lognormal(rng, 1.0, 0.25) for _ in range(pool)]
    verbosity = [_lognormal(rng, 1.0, 0.3) for _ in range(pool)]
    plen = [int(_lognormal(rng, 3000, 0.3)) for _ in range(pool)]
    out = []
    for step in range(steps):
        grow = 1.0 + drift * step
        for p in rng.sample(range(pool), min(prompts, pool)):
            for s in range(samples):
                turns = _swe_turns(rng, difficulty[p] * grow, verbosity[p])
                out.append(Trajectory(f"w{step}-p{p}-{s}", f"p{p}", step, plen[p], turns))
    return out


def _swe_turns(rng: random.Random, difficulty: float, verbosity: float) -> list[Turn]:
    n_turns = max(3, int(_lognormal(rng, 30 * difficulty, 0.3)))
    fail_p = min(0.3, 0.04 + 0.06 * difficulty)
    own = _lognormal(rng, 1.0, 0.15)  # this sample's own style, on top of the repository's
    turns = []
    for _ in range(n_turns - 1):
        tool = rng.choice(SWE_TOOLS)
        size = int(_lognormal(rng, _SWE_RETURN[tool] * verbosity * own, 0.8))
        r = rng.random()
        status = ToolStatus.TIMEOUT if r < 0.005 else ToolStatus.FAILURE if r < fail_p else ToolStatus.SUCCESS
        turns.append(Turn(int(_lognormal(rng, 120, 0.6)), tool, size, status))
    turns.append(Turn(int(_lognormal(rng, 200, 0.5))))
    return turns

"""Router decision latency: `route()` runs on every tool return of every trajectory.

Goal: one C-MLFQ decision <= 50 us median with a causal tree of 100k nodes.

Each router is first warmed up by replaying long SWE-like trajectories (unique paths, so the tree
grows by tens of nodes per trajectory) through the offline evaluator until its tree holds at least
100k nodes; then every `route()` call of a further 64 trajectories, turn by turn, is timed against
the 48-GPU scenarios' rollout layout (24 GPUs: three nodes of TP1, TP1, TP2, TP4 instances). Each
router has the scenarios' cost model (qwen3-14b on A800s), as in the simulator, so a decision
includes pricing the migration and `spill: cost`'s pricing of the candidate instances. Baselines are
timed the same way, side by side in one run.

Run: .venv/bin/python benchmarks/bench_router.py [--nodes 100000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from libra.costmodel.catalog import load_catalog  # noqa: E402
from libra.costmodel.rollout import RolloutCostModel  # noqa: E402
from libra.rollout.base import Bucket, InstanceView, RouteRequest  # noqa: E402
from libra.rollout.evaluate import evaluate  # noqa: E402
from libra.rollout.placement import CostModelCoster  # noqa: E402
from libra.rollout.registry import ROUTERS, make_router  # noqa: E402
from libra.rollout.synthetic import swe_like  # noqa: E402
from libra.rollout.tool_state import trajectory_path  # noqa: E402

BUCKETS = [Bucket("short", 1, 4096), Bucket("medium", 2, 12288), Bucket("long", 4, 40960)]
LAYOUT = [(1, 0), (1, 0), (2, 1), (4, 2)]  # (tp, bucket) of each instance on a rollout node


def instances() -> list[InstanceView]:
    return [
        InstanceView(f"n{node}-i{k}", bucket, tp, outstanding=(node * 7 + k * 3) % 40, cap=256, node=node)
        for node in range(3)
        for k, (tp, bucket) in enumerate(LAYOUT)
    ]


def coster() -> CostModelCoster:
    cat = load_catalog()
    hw, model = cat.hardware("a800-80g"), cat.model("qwen3-14b")
    return CostModelCoster([RolloutCostModel(hw, model, b.tp) for b in BUCKETS])


def warm(name: str, min_nodes: int, seed: int, steps: int | None = None):
    """A router after learning from `steps` batches of 256 SWE-like trajectories, or (steps None)
    from as many as its tree needs to hold `min_nodes` nodes (global and per-prompt together)."""
    router = make_router(name, BUCKETS, cost=coster(), seed=0)
    tree = getattr(router, "tree", None)
    step = 0
    while True:
        batch = swe_like(steps=1, prompts=32, samples=8, seed=seed + step, drift=0.0)
        for t in batch:
            t.step = step
        evaluate(router, batch, BUCKETS)
        step += 1
        done = step >= steps if steps is not None else (tree is None or tree.node_count() >= min_nodes)
        if done or step > 400:
            return router, step


def time_routes(router, insts: list[InstanceView], seed: int) -> list[float]:
    """Seconds per `route()` call, every turn of 64 fresh trajectories, in lockstep."""
    trajs = swe_like(steps=1, prompts=16, samples=4, seed=seed, drift=0.0)
    samples = []
    for t in trajs:
        t.step = 10_000
    paths = [trajectory_path(t) for t in trajs]
    current: dict[str, tuple[int, str]] = {}
    for k in range(max(len(t.turns) for t in trajs)):
        for t, path in zip(trajs, paths, strict=True):
            if k >= len(t.turns):
                continue
            prev = current.get(t.id)
            req = RouteRequest(
                t.id, t.prompt_id, t.step, k, t.prompt_tokens, t.context_before_turn(k),
                sum(u.output_tokens for u in t.turns[:k]), path[:k],
                None if prev is None else prev[0], None if prev is None else prev[1],
                t.total_tokens,
            )  # fmt: skip
            t0 = time.perf_counter()
            d = router.route(req, insts)
            samples.append(time.perf_counter() - t0)
            current[t.id] = (d.bucket, d.instance)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100_000, help="Tree size to reach before timing.")
    args = ap.parse_args()
    insts = instances()
    figures: dict[str, float] = {"goal_cmlfq_median_us": 50.0}
    router, steps = warm("cmlfq", args.nodes, seed=1000)
    figures["tree_nodes"] = router.tree.node_count()
    figures["warmup_trajectories"] = steps * 256
    for name in ["cmlfq", "cmlfq-paper", *sorted(set(ROUTERS) - {"cmlfq", "cmlfq-paper"})]:
        if name != "cmlfq":  # every router learns from the same trajectories
            router, _ = warm(name, args.nodes, seed=1000, steps=steps)
        samples = sorted(time_routes(router, insts, seed=99))
        key = name.replace("-", "_")
        figures[f"{key}_median_us"] = round(1e6 * statistics.median(samples), 2)
        figures[f"{key}_p99_us"] = round(1e6 * samples[int(0.99 * (len(samples) - 1))], 2)
    figures["decisions_timed_per_router"] = len(samples)
    report("router", figures)


if __name__ == "__main__":
    main()

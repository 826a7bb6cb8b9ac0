"""The real tau-bench trace replayed in the simulator, over several orderings of its tasks into steps.

Issue 4 asks that `router:cmlfq` beat classic MLFQ and a prior that uses only the current length,
on accuracy and on rollout throughput, on real traces replayed with `libra simulate --trace`. The
trace has 200 trajectories (50 tasks x 4 trials) dealt to 5 steps, and which tasks share a step
moves the figures by several percent. So, as the offline evaluation does (tests/
test_rollout_evaluate.py), this replays the trace in its own order and with its tasks dealt to the
5 steps in `--orderings - 1` other random orders, and reports each router's mean, minimum and
maximum over them, and against each rival the paired difference (wins, mean, standard error).

The engines are `libra-searchr1-48gpu`'s, with buckets suited to the trace's 2.7K-8.4K lengths
(4096 / 6144 / rest), as in docs/rollout.md.

Run: .venv/bin/python benchmarks/bench_tau_replay.py [--orderings 40] [--set split.rollout_gpus=8 ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from libra.core.errors import LibraError  # noqa: E402
from libra.core.trace import deal_prompts, read_trace, write_trace  # noqa: E402
from libra.core.trajectory import Trajectory  # noqa: E402
from libra.costmodel.catalog import load_catalog  # noqa: E402
from libra.sim.rl.config import RLScenario, parse_rl  # noqa: E402
from libra.sim.rl.pipeline import run  # noqa: E402
from libra.sim.scenarios import read_scenario  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "tau-bench-airline.jsonl"
ROUTERS = [
    "cmlfq",
    "cmlfq-paper",
    "classic-mlfq",
    "context-prior",
    "length-predictor",
    "least-loaded",
    "oracle",
]
BUCKETS = (
    "rollout.buckets=[{name: a, tp: 1, max_context: 4096}, {name: b, tp: 2, max_context: 6144},"
    " {name: c, tp: 4, max_context: 40960}]"
)


def replay(trajs: list[Trajectory], path: Path, scenario: RLScenario) -> dict[str, dict]:
    write_trace(trajs, path)
    systems = [f"router:{r}" for r in ROUTERS]
    out = run(scenario, systems, None, 0, None, lambda *a: None, trace=str(path))["systems"]
    return {
        r: {"tok_s": out[f"router:{r}"]["rollout_throughput_tokens_per_s"],
            "accuracy": out[f"router:{r}"]["routing"]["accuracy"]}
        for r in ROUTERS
    }  # fmt: skip


def summarise(runs: list[dict[str, dict]]) -> dict:
    out = {}
    for r in ROUTERS:
        for key in ("tok_s", "accuracy"):
            xs = [run_[r][key] for run_ in runs]
            out.setdefault(r, {})[key] = {"mean": round(sum(xs) / len(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}  # fmt: skip
    for rival in ("classic-mlfq", "context-prior", "cmlfq-paper"):
        for key in ("tok_s", "accuracy"):
            diffs = [run_["cmlfq"][key] - run_[rival][key] for run_ in runs]
            out["cmlfq"][f"{key}_vs_{rival}"] = paired(diffs)
    return out


def paired(diffs: list[float]) -> dict:
    """cmlfq minus a rival over the same orderings: wins, the mean difference and its standard error.

    The orderings are paired (every router replays the same deal), so the spread that matters is
    that of the differences, not of each router's figures; |mean| under 2 standard errors is a tie.
    """
    n = len(diffs)
    mean = sum(diffs) / n
    se = round((sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) ** 0.5, 4) if n > 1 else None
    return {"wins": f"{sum(d > 0 for d in diffs)}/{n}", "mean_diff": round(mean, 4), "stderr": se}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--orderings", type=int, default=40, help="The trace's own order plus N-1 reshuffles.")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A scenario override, as libra simulate --set.",
    )
    args = ap.parse_args()
    if args.orderings < 1:
        ap.error(f"--orderings must be an integer >= 1, got {args.orderings}")
    if not args.trace.is_file():
        ap.error(f"--trace: no such file {args.trace}")
    try:
        trajs = read_trace(args.trace)
    except LibraError as e:  # a malformed line: FILE:LINE: field ...
        ap.error(f"--trace: {e}")
    try:
        scenario = parse_rl(read_scenario("libra-searchr1-48gpu", [BUCKETS, *args.set]), load_catalog())
    except LibraError as e:
        ap.error(f"--set: {e}")
    with tempfile.TemporaryDirectory() as tmp:
        runs = [
            replay(deal_prompts(trajs, seed), Path(tmp) / f"order{seed}.jsonl", scenario)
            for seed in range(args.orderings)
        ]
    report("tau_replay", {"orderings": args.orderings, **summarise(runs)})


if __name__ == "__main__":
    main()

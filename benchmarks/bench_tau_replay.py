"""The real tau-bench trace replayed in the simulator, over several orderings of its tasks into steps.

Issue 4 asks that `router:cmlfq` beat classic MLFQ and a prior that uses only the current length,
on accuracy and on rollout throughput, on real traces replayed with `libra simulate --trace`. The
trace has 200 trajectories (50 tasks x 4 trials) dealt to 5 steps, and which tasks share a step
moves the figures by several percent. So, as the offline evaluation does (tests/
test_rollout_evaluate.py), this replays the trace in its own order and with its tasks dealt to the
5 steps in `--orderings - 1` other random orders, and reports each router's mean, minimum and
maximum over them, and how many orderings `cmlfq` wins against each rival.

The engines are `libra-searchr1-48gpu`'s, with buckets suited to the trace's 2.7K-8.4K lengths
(4096 / 6144 / rest), as in docs/rollout.md.

Run: .venv/bin/python benchmarks/bench_tau_replay.py [--orderings 6]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from libra.core.config import apply_overrides  # noqa: E402
from libra.sim.pipeline import run  # noqa: E402
from libra.sim.scenarios import load_scenario  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "tau-bench-airline.jsonl"
ROUTERS = ["cmlfq", "classic-mlfq", "context-prior", "least-loaded", "oracle"]
BUCKETS = (
    "rollout.buckets=[{name: a, tp: 1, max_context: 4096}, {name: b, tp: 2, max_context: 6144},"
    " {name: c, tp: 4, max_context: 40960}]"
)


def reordered(rows: list[dict], seed: int) -> list[dict]:
    """The trace with its tasks dealt to its steps in a random order (seed 0: the trace's own)."""
    if seed == 0:
        return rows
    tasks = sorted({r["prompt_id"] for r in rows})
    n_steps = len({r["step"] for r in rows})
    random.Random(seed).shuffle(tasks)
    step = {p: i * n_steps // len(tasks) for i, p in enumerate(tasks)}
    return sorted(({**r, "step": step[r["prompt_id"]]} for r in rows), key=lambda r: r["step"])


def replay(rows: list[dict], path: Path) -> dict[str, dict]:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scenario = apply_overrides(load_scenario("libra-searchr1-48gpu"), [BUCKETS])
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
    for rival in ("classic-mlfq", "context-prior"):
        for key in ("tok_s", "accuracy"):
            wins = sum(run_["cmlfq"][key] > run_[rival][key] for run_ in runs)
            out["cmlfq"][f"{key}_wins_vs_{rival}"] = f"{wins}/{len(runs)}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--orderings", type=int, default=6, help="The trace's own order plus N-1 reshuffles.")
    ap.add_argument("--trace", type=Path, default=TRACE)
    args = ap.parse_args()
    if args.orderings < 1:
        ap.error(f"--orderings must be an integer >= 1, got {args.orderings}")
    if not args.trace.is_file():
        ap.error(f"--trace: no such file {args.trace}")
    rows = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [
            replay(reordered(rows, seed), Path(tmp) / f"order{seed}.jsonl") for seed in range(args.orderings)
        ]
    report("tau_replay", {"orderings": args.orderings, **summarise(runs)})


if __name__ == "__main__":
    main()

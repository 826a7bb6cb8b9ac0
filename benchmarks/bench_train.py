"""The full `libra train` stack: learning curve, step time split, tokens/s, control-plane share.

    python benchmarks/bench_train.py [--json] [--steps N] [--launcher local|ray] [--inprocess]
                                     [--set KEY=VALUE ...]

Runs `libra train` as a user does (real engines, gateway, actions service, trainer replicas) into a
temporary folder and reads its summary.json and steps.json. With --json it prints one object with
`first_success`, `final_success` (5-step mean at the end), `steps`, `steps_to_success_0_8` (first
step whose 5-step mean reaches 0.8; null if never), `mean_step_s`, `control_share` (weight
publication's share of step time), `gateway_share` (the gateway's own time as a share of each
request's time, from its Prometheus histograms), the rollout/train/publish split, tokens/s, the
curve itself, and what the pipeline did to the data: `staleness` (trained groups and model tokens
by age in steps, and the groups that expired past the bound) and `same_version_gap_max` (the
largest |trainer - engine| log-prob of a token sampled with the very weights the trainer held:
the two must agree, whatever the staleness of the rest).

`--inprocess` also runs the in-process loop on the same seed and config (`bench_learning.py`,
synchronous: staleness 0) and reports its `steps_to_success_0_8` and the ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine  # noqa: E402


def gateway_share(log_dir: Path) -> float | None:
    """Overhead / (overhead + upstream) from the gateway's last /metrics scrape, if saved."""
    f = log_dir / "gateway-metrics.prom"
    if not f.exists():
        return None
    text = f.read_text()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}_sum{{[^}}]*}} (\S+)$", text, re.M))

    over, up = total("libra_gateway_overhead_seconds"), total("libra_gateway_upstream_seconds")
    return over / (over + up) if over + up > 0 else None


def inprocess(a: argparse.Namespace) -> dict:
    """The in-process loop on the same seed and settings (bench_learning.py, one JSON object)."""
    seed = next((o.split("=", 1)[1] for o in a.overrides if o.startswith("seed=")), "0")
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("bench_learning.py")),
        "--seed",
        seed,
        "--steps",
        str(a.steps),
    ]
    for o in a.overrides:
        cmd += ["--set", o]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"bench_learning failed ({r.returncode}): {r.stderr[-2000:]}")
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    return {
        k: rec[k]
        for k in ("steps_to_success_0_8", "first_success", "final_success", "best_5step", "warmstart_steps")
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--launcher", default="local")
    ap.add_argument("--inprocess", action="store_true", help="Also run the in-process loop on the same seed.")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-train-"))
    cmd = [sys.executable, "-m", "libra", "train", "--out", str(out), "--steps", str(a.steps), "--launcher", a.launcher, "--json"]  # fmt: skip
    for o in a.overrides:
        cmd += ["--set", o]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"libra train failed ({r.returncode}): {r.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    steps = json.loads((out / "steps.json").read_text())
    result = {
        "benchmark": "train",
        "machine": machine(),
        **{
            k: summary[k]
            for k in (
                "first_success",
                "final_success",
                "steps",
                "steps_to_success_0_8",
                "mean_step_s",
                "control_share",
            )
        },  # fmt: skip
        "gateway_share": gateway_share(out),
        "mean_rollout_wait_s": summary["mean_rollout_wait_s"],
        "mean_train_s": summary["mean_train_s"],
        "mean_publish_s": summary["mean_publish_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "dropped": summary["dropped"],
        "staleness": summary["staleness"],
        "same_version_gap_max": summary["same_version_gap_max"],
        "same_version_tokens": summary["same_version_tokens"],
        "curve": [round(s["success"], 3) for s in steps],
        "run": str(out),
    }
    if a.inprocess:
        result["inprocess"] = inprocess(a)
        live, local = result["steps_to_success_0_8"], result["inprocess"]["steps_to_success_0_8"]
        result["steps_ratio_vs_inprocess"] = live / local if live is not None and local else None
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:24s} {v}")


if __name__ == "__main__":
    main()

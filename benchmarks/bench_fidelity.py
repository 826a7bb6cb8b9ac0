"""Fidelity of the simulator against measurements: public vLLM figures, the shipped traces, a live run.

- Public figures (src/libra/sim/replay/public_figures.yaml: vLLM issue 16300, PR 2192, LambdaLabs
  vllm-benchmark): each run replayed on the simulated engine with the vllm-v0 preset. The GPU terms
  were fitted to kernel measurements only; the preset's four CPU terms were fitted to these very
  figures, so the leave-one-source-out error (fit on two sources, predict the third) is reported
  beside the in-sample one.
- The shipped vLLM 0.19 traces (../shared/data/vllm-bench) with the default constants (vllm-v1 was
  fitted to them), and the held-out data-parallel expert-parallel run in tests/data.
- The KV cache vLLM allocated, where a run recorded it (tests/data/vllm-bench/kv-*).
- The live run (`--live DIR`, a `libra train` output folder): `libra simulate` replays its
  trajectories on the built-in engine's CPU profile (its steps and its HTTP serving, calibrated
  on one profile or several pooled; the run's tool sandboxes as sessions of their own) and
  predicts its step, rollout and train time, with the CPU seconds measured and
  predicted by role (`live.cpu_s`; the measured side from live_cpu.py's RUN/host.json), and the
  errors with those measured CPU seconds replayed (`live.oracle_cpu`: the sharing model alone).

Goals (issue 29): public mean absolute error <= 12%; shipped traces mean latency error <= 12%;
live step, rollout and train time each within 15%.
Run: .venv/bin/python benchmarks/bench_fidelity.py [--json] [--live DIR] [--fit vllm-v0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import report  # noqa: E402
from libra.costmodel.catalog import load_catalog  # noqa: E402
from libra.costmodel.efficiency import RolloutEfficiency  # noqa: E402
from libra.sim.replay import public  # noqa: E402
from libra.sim.replay.vllm import compare, cost_models, kv_capacity, load_bench  # noqa: E402

SHARED = ROOT.parent / "shared" / "data" / "vllm-bench"
FIXTURES = ROOT / "tests" / "data" / "vllm-bench"
TRACES = ("RTXPRO6000_Llama-3.1-8B", "RTXPRO6000_Qwen3-32B")
V0_FIT = ("base_overhead_s", "per_seq_overhead_s", "tp_overhead_s", "tp_seq_overhead_s")


def public_figures(cat) -> dict:
    results = public.replay_all(cat)
    by_source: dict[str, list] = {}
    for r in results:
        by_source.setdefault(r.figure.source, []).append(r)
    return {
        "public_mape": public.mape(results),
        "public": {
            r.figure.id: {
                "measured_s": r.figure.value,
                "simulated_s": round(r.simulated, 4),
                "error": round(r.error, 4),
            }
            for r in results
        },  # fmt: skip
        "public_mape_by_source": {s: round(public.mape(rs), 4) for s, rs in by_source.items()},
    }


def leave_one_source_out(cat) -> dict:
    """Fit vllm-v0's CPU terms on the other sources, predict each source: out-of-sample error."""
    figs = public.load_figures()
    out = {}
    for source in sorted({f.source for f in figs}):
        train = [f for f in figs if f.source != source]
        eff = public.fit_engine(cat, "vllm-v0", V0_FIT, figures=train)
        out[source] = round(
            public.mape(public.replay_all(cat, eff, [f for f in figs if f.source == source])), 4
        )
    out["mean"] = round(sum(out.values()) / len(out), 4)
    return out


def traces(cat) -> dict:
    shipped = {}
    for name in TRACES:
        if (SHARED / name).is_dir():
            shipped[name] = round(compare(load_bench(SHARED / name, cat), cat)["error"]["latency_mean"], 4)
    held_out = {}
    for folder in sorted(FIXTURES.glob("RTXPRO6000_*")):
        held_out[folder.name] = round(compare(load_bench(folder, cat), cat)["error"]["latency_mean"], 4)
    kv = {}
    for folder in sorted(FIXTURES.glob("kv-*")):
        bench = load_bench(folder, cat)
        kv[folder.name] = round(kv_capacity(bench, cost_models(bench, cat))["error"], 4)
    return {"shipped_traces": shipped, "held_out_traces": held_out, "kv_capacity_error": kv}


def live(folder: str | None, profile: str | None) -> dict:
    if folder is None:
        return {"step_err": None, "rollout_err": None, "train_err": None, "note": "give --live DIR"}
    from libra.sim.rl.live import predict_live

    out = predict_live(folder, profile).errors()
    if out["cpu_s"]["measured"]:  # the sharing model alone: the measured CPU seconds replayed
        errs = predict_live(folder, profile, oracle=True).errors()
        out["oracle_cpu"] = {k: errs[k] for k in ("step_err", "rollout_err", "train_err")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--live", default=None, help="a `libra train` output folder to predict")
    ap.add_argument(
        "--live-profile",
        default=None,
        help="the CPU profile YAML (calibrate --data --train-data --serving-data of `costmodel profile --model builtin-tiny --device cpu`)",
    )
    ap.add_argument(
        "--fit", choices=["vllm-v0"], default=None, help="fit a preset's CPU terms and print them"
    )
    args = ap.parse_args()
    cat = load_catalog()
    if args.fit:
        eng = public.fit_engine(cat, args.fit, V0_FIT).engine(args.fit)
        print({f: float(f"{getattr(eng, f):.3g}") for f in V0_FIT})
        return
    figures = {**public_figures(cat), "public_mape_leave_one_source_out": leave_one_source_out(cat)}
    figures.update(traces(cat))
    figures["live"] = live(args.live, args.live_profile)
    figures["goals"] = {"public_mape": 0.12, "shipped_traces": 0.12, "live": 0.15}
    if not args.json:
        _print_tables(figures)
    figures["public_mape"] = round(figures["public_mape"], 4)
    report("fidelity", figures)


def _print_tables(f: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Public vLLM figures (seconds), vllm-v0 preset")
    for c in ("figure", "measured", "simulated", "error"):
        t.add_column(c)
    for k, v in f["public"].items():
        t.add_row(k, f"{v['measured_s']:.3f}", f"{v['simulated_s']:.3f}", f"{v['error']:+.1%}")
    Console().print(t)
    print(
        f"public MAPE {f['public_mape']:.1%}; leave one source out: {f['public_mape_leave_one_source_out']}"
    )
    print(f"shipped traces (mean latency error): {f['shipped_traces']}; held out: {f['held_out_traces']}")
    print(f"KV capacity error: {f['kv_capacity_error']}; live: {f['live']}")


if __name__ == "__main__":
    RolloutEfficiency()  # fail early if the shipped constants do not load
    main()

"""`libra replay-vllm DIR`: replay a real vLLM benchmark on simulated engines and compare."""

from __future__ import annotations

import click

from libra.cli.common import catalog_option, console, emit_json, json_option, profile_option, table
from libra.costmodel.catalog import load_catalog
from libra.costmodel.efficiency import DEFAULT_ENGINE, load_profile
from libra.sim.replay.vllm import compare, load_bench


@click.command("replay-vllm")
@click.argument("folder", type=click.Path())
@click.option(
    "--engine", default=DEFAULT_ENGINE, show_default=True, help="Engine preset: vllm-v1 or vllm-v0."
)
@json_option
@profile_option
@catalog_option
def replay_vllm(folder, engine, as_json, profile, catalogs):
    """Replay FOLDER (meta.json, config.json, requests.jsonl) and compare TTFT, TPOT, latency.

    Every instance of the layout is simulated (data-parallel ranks behind vLLM's load balancer,
    expert parallelism for MoE models); each one's share is listed after the comparison."""
    cat = load_catalog(catalogs)
    eff = load_profile(profile).rollout
    eff.engine(engine, "--engine")
    bench = load_bench(folder, cat)
    res = compare(bench, cat, eff, engine)
    res["engine"] = {"preset": engine, "hardware": bench.hardware, "model": bench.model, "dtype": bench.dtype or "bf16",
                     "ranks": len(bench.ranks), "tp": bench.tp, "ep": bench.ranks[0].ep,
                     "max_num_seqs": bench.max_num_seqs, "max_num_batched_tokens": bench.max_num_batched_tokens,
                     "requests": len(bench.requests)}  # fmt: skip
    if as_json:
        emit_json(res)
        return
    rows = []
    for key, real in res["measured"].items():
        sim = res["simulated"][key]
        rows.append([key, real, sim, f"{(sim - real) / real:+.1%}"])
    e = res["engine"]
    layout = f"{e['ranks']} x TP{e['tp']}" + (f" (EP{e['ep']})" if e["ep"] > 1 else "")
    title = (
        f"{folder}: {e['model']} on {layout} {e['hardware']}, {e['requests']} requests, {engine} (seconds)"
    )
    console.print(table(title, ["metric", "measured", "simulated", "error"], rows))
    kv = res["kv_capacity"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in kv["breakdown_gib"].items())
    if kv["vllm"] is not None:
        console.print(f"KV cache per instance: vLLM allocated {kv['vllm']:,} tokens (replayed); computed "
                      f"{kv['computed']:,} ({kv['error']:+.2%}): {parts} GiB")  # fmt: skip
    else:
        console.print(f"KV cache per instance: computed {kv['computed']:,} tokens: {parts} GiB")
    cols = list(res["instances"][0].keys())
    rows = [[("not recorded" if c == "vllm_preemptions" and r.get(c) is None else r.get(c, "")) for c in cols]
            for r in res["instances"]]  # fmt: skip
    console.print(
        table("Per instance (simulated; vLLM's preemptions where the run recorded them)", cols, rows)
    )

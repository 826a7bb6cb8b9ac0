"""`libra replay-vllm DIR`: replay a real vLLM benchmark on the simulated engine and compare."""

from __future__ import annotations

import click

from libra.cli.common import catalog_option, console, emit_json, json_option, profile_option, table
from libra.costmodel.catalog import load_catalog
from libra.costmodel.efficiency import load_profile
from libra.sim.replay.vllm import compare, load_bench


@click.command("replay-vllm")
@click.argument("folder", type=click.Path())
@json_option
@profile_option
@catalog_option
def replay_vllm(folder, as_json, profile, catalogs):
    """Replay FOLDER (meta.json, config.json, requests.jsonl) and compare TTFT, TPOT, latency."""
    cat = load_catalog(catalogs)
    bench = load_bench(folder, cat)
    res = compare(bench, cat, load_profile(profile).rollout)
    res["engine"] = {"hardware": bench.hardware, "model": bench.model, "tp": bench.tp,
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
    title = f"{folder}: {e['model']} on {e['tp']} x {e['hardware']}, {e['requests']} requests (seconds)"
    console.print(table(title, ["metric", "measured", "simulated", "error"], rows))

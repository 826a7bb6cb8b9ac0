"""`libra costmodel`: query the rollout and training cost models, list the catalog, calibrate, profile."""

from __future__ import annotations

from pathlib import Path

import click
from pydantic import BaseModel, ConfigDict, Field

from libra.cli.common import (
    catalog_option,
    console,
    emit_json,
    json_option,
    profile_option,
    set_option,
    table,
    writable_dir,
    writable_file,
)
from libra.core.config import load_model
from libra.core.errors import ConfigError
from libra.core.trace import MAX_TOKENS
from libra.costmodel.calibrate import fit_rollout, read_measurements
from libra.costmodel.catalog import Catalog, load_catalog
from libra.costmodel.efficiency import DEFAULT_ENGINE, Profile, RolloutEfficiency, load_profile, save_profile
from libra.costmodel.rollout import RolloutCostModel
from libra.costmodel.training import TrainCostModel, TrainParallel


class RolloutQuery(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    hardware: str = "a800-80g"
    model: str = "qwen3-14b"
    tp: int = Field(1, ge=1, le=64)
    batch: int = Field(64, ge=1, le=1 << 16)
    context: int = Field(1024, ge=1, le=MAX_TOKENS)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_batched_tokens: int = Field(8192, ge=1, le=1 << 20)
    max_num_seqs: int = Field(256, ge=1, le=16384)
    engine: str = DEFAULT_ENGINE


class TrainQuery(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    hardware: str = "a800-80g"
    model: str = "qwen3-14b"
    # Bounds far beyond any real job, so a typo is an error rather than an hour of arithmetic.
    tp: int = Field(1, ge=1, le=64)
    pp: int = Field(1, ge=1, le=1024)
    dp: int = Field(1, ge=1, le=1 << 16)
    cp: int = Field(1, ge=1, le=64)
    micro_batch: int = Field(1, ge=1, le=4096)
    seq_len: int = Field(4096, ge=1, le=MAX_TOKENS)
    num_seqs: int = Field(64, ge=1, le=1 << 16)
    recompute: bool = True


def _query(cls, config, overrides, flags: dict):
    base = {k: v for k, v in flags.items() if v is not None}
    q = load_model(cls, config, overrides, base={})
    # Flags given explicitly win over the file; the file wins over defaults.
    return q.model_copy(update=load_model(cls, None, [], base={**q.model_dump(), **base}).model_dump())


def check_tp(cat_hw, cat_model, tp: int) -> None:
    if tp > cat_hw.gpus_per_node:
        raise ConfigError("tp", tp, f"<= gpus_per_node ({cat_hw.gpus_per_node}) of {cat_hw.name}")
    if cat_model.heads % tp:
        raise ConfigError("tp", tp, f"a divisor of {cat_model.name}'s {cat_model.heads} attention heads")


@click.group()
def costmodel() -> None:
    """Query and calibrate the analytic cost model."""


engine_option = click.option(
    "--engine",
    default=None,
    help=f"Engine preset for the CPU overhead: vllm-v1 or vllm-v0 (default {DEFAULT_ENGINE}).",
)
max_num_seqs_option = click.option(
    "--max-num-seqs", type=int, default=None, help="Engine's running-sequence cap (256)."
)


def _common(f):
    for deco in reversed([catalog_option, profile_option, set_option, json_option,
                          click.option("--config", type=click.Path(dir_okay=False), help="Query as YAML.")]):  # fmt: skip
        f = deco(f)
    return f


@costmodel.command()
@click.option("--hardware", default=None, help="Hardware profile name (see `libra costmodel catalog`).")
@click.option("--model", default=None, help="Model name (see `libra costmodel catalog`).")
@click.option("--tp", type=int, default=None, help="Tensor-parallel degree of the instance.")
@click.option("--batch", type=int, default=None, help="Sequences decoding together.")
@click.option("--context", type=int, default=None, help="Context length of each sequence, tokens.")
@max_num_seqs_option
@engine_option
@_common
def rollout(hardware, model, tp, batch, context, max_num_seqs, engine, config, overrides, as_json, catalogs, profile):  # fmt: skip
    """One decode iteration of BATCH sequences at CONTEXT tokens on a TP instance."""
    flags = dict(hardware=hardware, model=model, tp=tp, batch=batch, context=context, max_num_seqs=max_num_seqs,
                 engine=engine)  # fmt: skip
    q = _query(RolloutQuery, config, overrides, flags)
    cat = load_catalog(catalogs)
    res = rollout_report(cat, q, load_profile(profile))
    if as_json:
        emit_json(res)
        return
    console.print(table(f"{q.model} on {q.tp} x {q.hardware}", ["metric", "value"], list(res.items())))


def rollout_report(cat: Catalog, q: RolloutQuery, prof: Profile) -> dict:
    hw, m = cat.hardware(q.hardware), cat.model(q.model)
    check_tp(hw, m, q.tp)
    prof.rollout.engine(q.engine, "engine")
    cm = RolloutCostModel(hw, m, q.tp, prof.rollout, q.gpu_memory_utilization, q.max_num_batched_tokens, q.engine,
                          q.max_num_seqs)  # fmt: skip
    cap = cm.kv_capacity_tokens()
    if cap == 0:
        raise ConfigError(
            "tp",
            q.tp,
            f"a degree at which {q.model}'s weights fit on {q.hardware} (they do not at tp={q.tp})",
        )
    running = cm.max_batch(q.context, q.batch)
    step = cm.decode_time(running, q.context) if running else float("inf")
    return {
        "hardware": q.hardware, "model": q.model, "tp": q.tp, "engine": q.engine, "batch": q.batch,
        "context": q.context, "max_num_seqs": q.max_num_seqs, "running_batch": running,
        "step_time_s": step,
        "tokens_per_s": running / step if running else 0.0,
        "kv_capacity_tokens": cap,
        "fits": q.batch * q.context <= cap and q.batch <= q.max_num_seqs,
        "weights_gib_per_gpu": cm.weight_bytes_per_gpu() / 2**30,
    }  # fmt: skip


@costmodel.command()
@click.option("--hardware", default=None)
@click.option("--model", default=None)
@click.option("--tp", type=int, default=None)
@click.option("--pp", type=int, default=None)
@click.option("--dp", type=int, default=None)
@click.option("--cp", type=int, default=None)
@click.option("--micro-batch", type=int, default=None)
@click.option("--seq-len", type=int, default=None, help="Length of every sequence in the batch.")
@click.option("--num-seqs", type=int, default=None, help="Sequences in the global batch.")
@click.option("--recompute/--no-recompute", default=None, help="Full activation recompute (default on).")
@_common
def train(hardware, model, tp, pp, dp, cp, micro_batch, seq_len, num_seqs, recompute, config, overrides, as_json, catalogs, profile):  # fmt: skip
    """One training step: time and per-GPU memory for a TP/PP/DP/CP layout."""
    flags = dict(hardware=hardware, model=model, tp=tp, pp=pp, dp=dp, cp=cp, micro_batch=micro_batch,
                 seq_len=seq_len, num_seqs=num_seqs, recompute=recompute)  # fmt: skip
    q = _query(TrainQuery, config, overrides, flags)
    cat = load_catalog(catalogs)
    res = train_report(cat, q, load_profile(profile))
    if as_json:
        emit_json(res)
        return
    console.print(
        table(f"{q.model} training on {res['gpus']} x {q.hardware}", ["metric", "value"], list(res.items()))
    )


def train_report(cat: Catalog, q: TrainQuery, prof: Profile) -> dict:
    hw, m = cat.hardware(q.hardware), cat.model(q.model)
    par = TrainParallel(q.tp, q.pp, q.dp, q.cp, q.micro_batch, q.recompute)
    est = TrainCostModel(hw, m, prof.train).step(par, [q.seq_len] * q.num_seqs)
    mem = est.memory
    return {
        "hardware": q.hardware, "model": q.model, "gpus": par.gpus,
        "tp": q.tp, "pp": q.pp, "dp": q.dp, "cp": q.cp, "micro_batch": q.micro_batch,
        "step_time_s": est.step_time_s, "compute_s": est.compute_s, "tp_comm_s": est.tp_comm_s,
        "pp_bubble_s": est.pp_bubble_s, "dp_comm_s": est.dp_comm_s,
        "memory_gib_per_gpu": mem.total / 2**30, "capacity_gib": mem.capacity / 2**30,
        "fits": mem.fits,
    }  # fmt: skip


@costmodel.command()
@json_option
@catalog_option
def catalog(as_json, catalogs):
    """List the known hardware profiles and models."""
    cat = load_catalog(catalogs)
    hw = [h.model_dump() for h in cat.hardware_specs.values()]
    ms = [{**m.model_dump(), "params_b": m.total_params / 1e9} for m in cat.model_specs.values()]
    engines = {name: e.model_dump() for name, e in Profile().rollout.engines.items()}
    if as_json:
        emit_json({"hardware": hw, "models": ms, "engines": engines})
        return
    cols = [
        "name",
        "memory_gib",
        "memory_bw_gbps",
        "bf16_tflops",
        "intra_node_link",
        "intra_node_bw_gbps",
        "gpus_per_node",
    ]
    console.print(table("Hardware", cols, [[h[c] for c in cols] for h in hw]))
    mcols = ["name", "params_b", "layers", "hidden", "heads", "kv_heads", "experts"]
    console.print(table("Models", mcols, [[m[c] for c in mcols] for m in ms]))
    ecols = [
        "base_overhead_s",
        "per_seq_overhead_s",
        "tp_overhead_s",
        "tp_seq_overhead_s",
        "custom_allreduce",
    ]
    console.print(
        table("Engine presets", ["name", *ecols], [[n, *(e[c] for c in ecols)] for n, e in engines.items()])
    )


@costmodel.command()
@click.option("--hardware", default="a800-80g", show_default=True)
@click.option("--model", default="qwen3-14b", show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(1, 16384), default=256, show_default=True,
              help="Each instance's running-sequence cap, as vLLM's.")  # fmt: skip
@click.option(
    "--engine", default=DEFAULT_ENGINE, show_default=True, help="Engine preset: vllm-v1 or vllm-v0."
)
@json_option
@catalog_option
@profile_option
def report(hardware, model, max_num_seqs, engine, as_json, catalogs, profile):
    """The TP crossover: 8 x TP1 against one TP8 instance, across context lengths.

    512 sequences per node are asked for; each instance runs at most max_num_seqs of them and as
    many as its KV cache holds."""
    cat = load_catalog(catalogs)
    hw, m = cat.hardware(hardware), cat.model(model)
    eff = load_profile(profile).rollout
    eff.engine(engine, "--engine")
    per_node = hw.gpus_per_node
    rows = []
    for ctx in (1024, 2048, 4096, 8192, 16384, 24576, 32768):
        row: dict = {"context": ctx}
        for tp in (1, 2, 4, 8):
            if tp > per_node or m.heads % tp:
                continue
            cm = RolloutCostModel(hw, m, tp, eff, engine=engine, max_num_seqs=max_num_seqs)
            row[f"tp{tp}_node_tok_s"] = per_node // tp * cm.throughput(512 * tp // per_node, ctx)
        rows.append(row)
    if as_json:
        emit_json(
            {
                "hardware": hardware,
                "model": model,
                "engine": engine,
                "max_num_seqs": max_num_seqs,
                "rows": rows,
            }
        )
        return
    cols = list(rows[0].keys())
    title = (
        f"Decode throughput of one {per_node}-GPU {hardware} node, {model}, 512 sequences per node ({engine})"
    )
    console.print(table(title, cols, [[r.get(c, "") for c in cols] for r in rows]))


@costmodel.command()
@click.option("--data", type=click.Path(dir_okay=False), multiple=True,
              help="JSONL of measured iterations (repeatable: several profiles of one host, pooled).")  # fmt: skip
@click.option("--vllm-bench", type=click.Path(file_okay=False), multiple=True,
              help="A vLLM benchmark folder (repeatable): fit the engine preset's CPU terms so the simulated replays match its latencies.")  # fmt: skip
@click.option("--vidur", type=click.Path(file_okay=False), default=None,
              help="Measured kernel and NCCL times (Vidur's layout, or `libra costmodel profile`'s): fit the GPU terms.")  # fmt: skip
@click.option(
    "--engine",
    default=DEFAULT_ENGINE,
    show_default=True,
    help="Engine preset whose CPU terms --vllm-bench fits.",
)
@click.option("--train-data", type=click.Path(dir_okay=False), multiple=True,
              help="JSONL of measured training steps (with or without one of the above; repeatable): fit the training terms.")  # fmt: skip
@click.option("--serving-data", type=click.Path(dir_okay=False), multiple=True,
              help="JSONL of the built-in engine served over HTTP (`profile`'s OUT/builtin-MODEL-serving.jsonl; repeatable): fit its CPU beyond the priced steps.")  # fmt: skip
@click.option(
    "--out", required=True, type=click.Path(dir_okay=False), help="Where to write the profile YAML."
)
@json_option
@catalog_option
@profile_option
def calibrate(data, vllm_bench, vidur, engine, train_data, serving_data, out, as_json, catalogs, profile):
    """Fit efficiency terms to measurements; write a profile YAML.

    Give at most one of --data (measured iteration times), --vllm-bench (a real serving trace,
    fitted through the simulated engine) or --vidur (per-layer kernel and all-reduce times: the GPU
    terms of every GPU type measured there), and --train-data (measured training steps) or
    --serving-data (the built-in engine's CPU beyond its steps priced with the step terms of
    --data when given) beside it or alone. --data, --train-data and --serving-data repeat: the
    files of several profiles of one host are fitted together (a shared host's speed drifts by
    the minute; docs/fidelity.md).
    """
    given = [x for x in (", ".join(data) or None, ", ".join(vllm_bench) or None, vidur) if x is not None]
    if len(given) > 1 or not (given or train_data or serving_data):
        raise ConfigError("--data/--vllm-bench/--vidur", ", ".join(given) or "none",
                          "one of the three, or --train-data or --serving-data, or one of the three with them")  # fmt: skip
    base, cat = load_profile(profile), load_catalog(catalogs)
    base.rollout.engine(engine, "--engine")
    writable_file(Path(out))  # before the fit, which takes a while
    eff, note, fit = base.rollout, "", {}
    if data:
        eff, note, fit = _fit_data(data, cat, base)
    elif vidur is not None:
        eff, note, fit = _fit_vidur(vidur, cat, base)
    elif vllm_bench:
        eff, note, fit = _fit_bench(vllm_bench, cat, base, engine)
    if serving_data:
        eff, serving_note, fit["serving"] = _fit_serving_data(serving_data, cat, eff)
        note = f"{note}; {serving_note}" if note else serving_note
    train = base.train
    if train_data:
        train, train_note, fit["train"] = _fit_train_data(train_data, cat, base)
        note = f"{note}; {train_note}" if note else train_note
    save_profile(base.model_copy(update={"rollout": eff, "train": train, "note": note}), out)
    if as_json:
        emit_json({"profile": out, **fit})
        return
    console.print(table(f"Calibrated profile -> {out} ({note})", ["fit", "value"], _flat(fit)))


def _fit_data(data: tuple[str, ...], cat: Catalog, base: Profile):
    """The step terms from the uncontended steps; from the contended ones (the built-in engine's
    profile), the CPU factor by share of a core."""
    from libra.costmodel.calibrate import fit_contention

    every = [r for path in data for r in read_measurements(path)]
    recs = [r for r in every if not r["co_runners"]]
    source = ", ".join(data)
    if not recs:
        raise ConfigError("data", source, "steps timed alone (co_runners 0) beside any contended ones")
    eff, mape = fit_rollout(recs, cat, base.rollout)
    hw = sorted({r["hardware"] for r in recs})
    terms = {h: eff.gpu(h).model_dump(include={"bw", "compute"}) for h in hw}
    fit = {"records": len(recs), "mape": mape, "gpus": terms}
    upd: dict = {}
    contention = fit_contention(every, cat, eff)
    if contention:
        upd["contention"] = fit["contention"] = contention
    probes = sorted(r["probe_s"] for r in recs if r["probe_s"] is not None)
    if probes:
        upd["probe_cpu_s"] = fit["probe_cpu_s"] = probes[len(probes) // 2]
    if upd:
        engine = recs[0]["engine"]
        eff = eff.model_copy(update={"engines": {**eff.engines, engine: eff.engine(engine).model_copy(update=upd)}})  # fmt: skip
    return eff, f"fitted to {len(recs)} iterations from {source}; MAPE {mape:.3f}", fit


def _fit_train_data(paths: tuple[str, ...], cat: Catalog, base: Profile):
    from libra.costmodel.calibrate import fit_train, read_train_measurements

    recs, path = [r for p in paths for r in read_train_measurements(p)], ", ".join(paths)
    eff, mape = fit_train(recs, cat, base.train)
    terms = eff.model_dump(include={"mfu", "per_microbatch_overhead_s"})
    return eff, f"training terms fitted to {len(recs)} steps from {path}; MAPE {mape:.3f}", {"records": len(recs), "mape": mape, **terms}  # fmt: skip


def _fit_serving_data(paths: tuple[str, ...], cat: Catalog, eff: RolloutEfficiency):
    from dataclasses import asdict

    from libra.costmodel.calibrate import SERVING_FIT, fit_serving, read_serving_measurements
    from libra.sim.rl.live import profile_step_cpu_s

    recs, path = [r for p in paths for r in read_serving_measurements(p)], ", ".join(paths)
    if len({(r.hardware, r.model, r.engine) for r in recs}) > 1:
        raise ConfigError("serving-data", path, "one hardware, model and engine in every file")
    r0 = recs[0]
    cat.hardware(r0.hardware)
    eff.engine(r0.engine, "serving-data: engine")
    priced = [profile_step_cpu_s([[tuple(t) for t in traj] for traj in r.trajectories], eff, r.max_num_seqs,
                                 r.kv_cache_mb, r.model, cat) for r in recs if r.kind == "chat"]  # fmt: skip
    fit = fit_serving(recs, priced)
    eff = eff.updated(r0.hardware, r0.engine, {f: getattr(fit, f) for f in SERVING_FIT})
    note = (f"{r0.engine} CPU beyond its priced steps fitted to {fit.workloads} workloads served over HTTP from {path}; "
            f"MAPE {fit.steps_only_mape:.3f} -> {fit.mape:.3f}")  # fmt: skip
    return eff, note, asdict(fit)


def _fit_vidur(folder, cat: Catalog, base: Profile):
    from libra.costmodel.vidur import fit_vidur

    gpus, report = fit_vidur(folder, cat)
    eff = base.rollout.model_copy(update={"gpus": {**base.rollout.gpus, **gpus}})
    fit = {"samples": report.samples, "layer_median_abs_err": report.layers, "allreduce_median_abs_err": report.allreduce,
           "gpus": {n: g.model_dump(include={"bw", "compute", "layer_fixed_s", "norm_s"}) for n, g in gpus.items()}}  # fmt: skip
    return eff, f"GPU terms fitted to the measurements in {folder}", fit


BENCH_FIT = ("base_overhead_s", "per_seq_overhead_s", "tp_overhead_s")


def _fit_bench(folders, cat: Catalog, base: Profile, engine: str):
    from libra.sim.replay.vllm import calibrate as fit_replay
    from libra.sim.replay.vllm import load_bench

    benches = [load_bench(f, cat) for f in folders]
    eff, err = fit_replay(benches, cat, base.rollout, BENCH_FIT, engine)
    terms = eff.engine(engine).model_dump(include=set(BENCH_FIT))
    return (
        eff,
        f"{engine} CPU terms fitted by replaying {', '.join(folders)}",
        {"replay_error": err, "engine": terms},
    )


def _flat(d: dict, prefix: str = "") -> list[list]:
    rows: list[list] = []
    for k, v in d.items():
        if isinstance(v, dict):
            rows += _flat(v, f"{prefix}{k}.")
        else:
            rows.append([f"{prefix}{k}", v])
    return rows


@costmodel.command()
@click.option(
    "--model",
    required=True,
    help="A catalog model (its layer shape is timed), e.g. qwen3-8b or builtin-tiny.",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="profiles", show_default=True,
              help="Folder to write compute/<device>/<org>/<model>/{mlp,attention}.csv into.")  # fmt: skip
@click.option("--threads", type=click.IntRange(1, 256), default=1, show_default=True,
              help="torch CPU threads (the built-in engine's --threads).")  # fmt: skip
@click.option("--quick", is_flag=True, help="A small grid of sizes (seconds instead of minutes).")
@catalog_option
def profile(model, device, out, threads, quick, catalogs):
    """Time one layer of MODEL's shape with torch on this machine, for `calibrate --vidur OUT`.

    bf16 on a GPU; on the CPU the dtype of the model's weights (fp32 for the built-in engine's).
    One device, so TP1 only. For the built-in engine's models on the CPU, the engine and a trainer
    replica are also timed step by step, in CPU seconds (OUT/builtin-MODEL-steps.jsonl for
    `calibrate --data`, OUT/builtin-MODEL-train.jsonl for `calibrate --train-data`), and a real
    `libra serve engine` on loopback is driven with the calculator task's turns, its process's CPU
    seconds by workload and by weight update (OUT/builtin-MODEL-serving.jsonl for
    `calibrate --serving-data`)."""
    import torch

    from libra.runtime.profiler import QUICK, Grid, Shape
    from libra.runtime.profiler import profile as run_profile

    m = load_catalog(catalogs).model(model)
    org, _, name = (m.source or f"libra/{m.name}").rpartition("/")
    bpp = 2 if device == "cuda" else m.bytes_per_param
    shape = Shape(
        org or "libra", name, m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate, m.vocab, bpp
    )
    torch.set_num_threads(threads)
    folder = run_profile(shape, device, writable_dir(Path(out)), QUICK if quick else Grid())
    console.print(f"{model}: layer kernels and attention timed on {device} -> {folder}")
    if device == "cpu" and model.startswith("builtin-"):
        from libra.runtime.profiler import profile_builtin_engine, profile_builtin_trainer

        steps = profile_builtin_engine(model.removeprefix("builtin-"), Path(out), threads, quick)
        console.print(f"the built-in engine's steps (CPU seconds) -> {steps} (for `calibrate --data`)")
        train = profile_builtin_trainer(model.removeprefix("builtin-"), Path(out), threads, quick)
        console.print(f"the built-in trainer's steps (CPU seconds) -> {train} (for `calibrate --train-data`)")
        from libra.runtime.serving_profile import profile_builtin_serving

        served = profile_builtin_serving(model.removeprefix("builtin-"), Path(out), threads, quick)
        console.print(
            f"the built-in engine served over HTTP (CPU seconds) -> {served} (for `calibrate --serving-data`)"
        )

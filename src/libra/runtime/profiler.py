"""Time the kernels of one transformer layer with torch, on the machine at hand.

`libra costmodel profile` runs this over a catalog model's shape (or the built-in engine's model):
every linear and elementwise kernel of a layer at a grid of token counts, and attention at a grid
of batch sizes and contexts (decode) and chunk sizes (prefill). It writes the layout Vidur's
profiles use, so `libra costmodel calibrate --vidur DIR` fits GPU terms to it:

    DIR/compute/<device>/<org>/<model>/mlp.csv        per layer, per token count (ms)
    DIR/compute/<device>/<org>/<model>/attention.csv  per batch x context, and per prefill chunk

One device, so TP1 only. The module needs only torch and the standard library, so it also runs as
a script on a machine where Libra is not installed (`python profiler.py --shape '{...}' --out D`).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")  # fmt: skip
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DECODE = ((1, 512), (1, 8192), (8, 2048), (32, 2048), (32, 8192), (128, 1024), (128, 4096), (256, 2048))
PREFILL = (128, 512, 2048, 8192)


@dataclass(frozen=True, slots=True)
class Shape:
    """A decoder layer, as the catalog gives it."""

    org: str
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 2


@dataclass(frozen=True, slots=True)
class Grid:
    tokens: tuple[int, ...] = TOKENS
    decode: tuple[tuple[int, int], ...] = DECODE
    prefill: tuple[int, ...] = PREFILL
    repeats: int = 10


QUICK = Grid(tokens=(1, 4, 16, 64, 256), decode=((1, 256), (8, 256), (32, 512)), prefill=(64, 256), repeats=3)


def device_name(device: str) -> str:
    """The folder name for the device: Vidur's `a100`/`h100`, or `cpu`."""
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((g for g in ("h200", "h100", "a100", "a800", "l40s") if g in name), name.split()[-1])


def _timer(device: str, repeats: int) -> Callable[[Callable[[], object]], list[float]]:
    """Seconds of each of `repeats` calls after three warm-up calls (CUDA events on a GPU)."""

    def run(fn: Callable[[], object]) -> list[float]:
        for _ in range(3):
            fn()
        out = []
        for _ in range(repeats):
            if device == "cpu":
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return out

    return run


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def layer_ops(s: Shape, t: int, device: str, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """Each kernel of one layer at `t` tokens, on freshly allocated tensors."""
    mk = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
    x, w_norm = mk(t, s.hidden), torch.ones(s.hidden, device=device, dtype=dtype)
    w_qkv, w_o = mk(s.hidden, q_out + 2 * kv_out), mk(q_out, s.hidden)
    w_up, w_down = mk(s.hidden, 2 * s.intermediate), mk(s.intermediate, s.hidden)
    qk = mk(t, s.heads + s.kv_heads, s.head_dim)
    cos, sin = mk(t, 1, s.head_dim // 2), mk(t, 1, s.head_dim // 2)
    attn_out, gate_up, act = mk(t, q_out), mk(t, 2 * s.intermediate), mk(t, s.intermediate)
    return {
        "input_layernorm": lambda: F.rms_norm(x, (s.hidden,), w_norm, 1e-6),
        "attn_pre_proj": lambda: x @ w_qkv,
        "attn_rope": lambda: _rope(qk, cos, sin),
        "attn_post_proj": lambda: attn_out @ w_o,
        "post_attention_layernorm": lambda: F.rms_norm(x, (s.hidden,), w_norm, 1e-6),
        "mlp_up_proj": lambda: x @ w_up,
        "mlp_act": lambda: F.silu(gate_up[:, : s.intermediate]) * gate_up[:, s.intermediate :],
        "mlp_down_proj": lambda: act @ w_down,
        "add": lambda: x + x,
    }


def _stats(op: str, secs: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in secs]
    return {f"time_stats.{op}.min": min(ms), f"time_stats.{op}.max": max(ms), f"time_stats.{op}.mean": statistics.fmean(ms),
            f"time_stats.{op}.median": statistics.median(ms), f"time_stats.{op}.std": statistics.pstdev(ms)}  # fmt: skip


def profile_layers(s: Shape, device: str, grid: Grid) -> list[dict]:
    dtype = torch.bfloat16 if s.bytes_per_param == 2 else torch.float32
    timer, rows = _timer(device, grid.repeats), []
    for t in grid.tokens:
        row: dict = {}
        for op, fn in layer_ops(s, t, device, dtype).items():
            row.update(_stats(op, timer(fn)))
        row.update({"n_head": s.heads, "n_kv_head": s.kv_heads, "n_embd": s.hidden, "n_expanded_embd": s.intermediate,
                    "vocab_size": s.vocab, "use_gated_mlp": True, "num_tokens": t,
                    "num_tensor_parallel_workers": 1, "bytes_per_param": s.bytes_per_param})  # fmt: skip
        rows.append(row)
    return rows


def profile_attention(s: Shape, device: str, grid: Grid) -> list[dict]:
    """Decode: `batch` queries of one token over `context` keys each; prefill: a causal chunk."""
    dtype = torch.bfloat16 if s.bytes_per_param == 2 else torch.float32
    timer, rows = _timer(device, grid.repeats), []
    mk = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    gqa = s.heads != s.kv_heads
    for batch, ctx in grid.decode:
        q, k, v = (
            mk(batch, s.heads, 1, s.head_dim),
            mk(batch, s.kv_heads, ctx, s.head_dim),
            mk(batch, s.kv_heads, ctx, s.head_dim),
        )
        secs = timer(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa))
        rows.append(
            {
                "kind": "decode",
                "batch": batch,
                "context": ctx,
                "tokens": batch,
                "median_ms": statistics.median(secs) * 1e3,
            }
        )
        del q, k, v
    for t in grid.prefill:
        q, k, v = (
            mk(1, s.heads, t, s.head_dim),
            mk(1, s.kv_heads, t, s.head_dim),
            mk(1, s.kv_heads, t, s.head_dim),
        )
        secs = timer(
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        )
        rows.append(
            {
                "kind": "prefill",
                "batch": 1,
                "context": t,
                "tokens": t,
                "median_ms": statistics.median(secs) * 1e3,
            }
        )
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def profile(shape: Shape, device: str, out: Path, grid: Grid = Grid()) -> Path:
    """Profile one shape; return the folder holding its mlp.csv and attention.csv."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible to torch")
    folder = out / "compute" / device_name(device) / shape.org / shape.name
    write_csv(folder / "mlp.csv", profile_layers(shape, device, grid))
    write_csv(folder / "attention.csv", profile_attention(shape, device, grid))
    (folder / "device.json").write_text(json.dumps({"device": device, "name": _full_name(device),
                                                   "torch": torch.__version__, "shape": asdict(shape)}))  # fmt: skip
    return folder


def _full_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Time one transformer layer's kernels (see the module docstring)."
    )
    ap.add_argument("--shape", required=True, help="JSON of Shape's fields")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="a small grid (tests)")
    args = ap.parse_args()
    folder = profile(
        Shape(**json.loads(args.shape)), args.device, Path(args.out), QUICK if args.quick else Grid()
    )
    print(folder)


# ---- the built-in engine and its trainer, step by step (CPU) -----------------------------------------
#
# Timed in CPU seconds of this process (time.process_time), not wall time: on a shared host the
# wall time of a step depends on what else runs, which the live-run prediction models itself
# (processor sharing, `libra.sim.rl.live`). One torch thread, as the engine and trainer run live.

ENGINE_GRID = ((1, 32, 48), (4, 64, 48), (16, 128, 48), (32, 64, 32), (64, 200, 24), (8, 1500, 8))
ENGINE_QUICK = ((1, 32, 8), (8, 64, 8))
# The contended runs: batches shaped like a live run's turns, beside 1..3 busy processes.
CONTENDED_GRID = ((16, 128, 48), (32, 160, 32), (64, 200, 24))
CO_RUNNERS = (0, 1, 2, 3)
CONTENDED_ROUNDS = 2
STEP_KEYS = {"hardware": "cpu-host", "tp": 1, "engine": "libra-builtin"}  # what a step line is of
# (samples, tokens each) of one trainer replica's GRPO step; the live default splits 64 samples of
# about 200-300 tokens over two replicas.
TRAIN_GRID = ((4, 128), (8, 280), (16, 280), (32, 280), (32, 140), (48, 200), (16, 600), (4, 1500))
TRAIN_QUICK = ((2, 64), (4, 96))
TRAIN_REPEATS = 3


def profile_builtin_engine(model: str, out: Path, threads: int = 1, quick: bool = False) -> Path:
    """Time every step of the built-in engine (scheduler, model, sampling; no HTTP) over batches of
    (sequences, prompt tokens, output tokens), each step with its batch's composition, as the JSONL
    `libra costmodel calibrate --data` reads (hardware `cpu-host`, engine preset `libra-builtin`).

    Then batches shaped like a live run's turns, alone and beside 1..3 busy processes that share
    this process's session (as a live run's engines, trainers and serving path share theirs): a
    step takes more CPU seconds when its core is time-shared, and those lines are what calibrate
    fits that by (`EngineOverhead.contention`, by the share of a core the process got, `share`)."""
    from libra.runtime.engine.config import EngineConfig
    from libra.runtime.engine.model import build_model

    torch.set_num_threads(threads)
    cfg = EngineConfig(model=model, max_num_seqs=64, kv_cache_mb=256, threads=threads)
    net = build_model(cfg.preset, cfg.seed)
    _engine_batches(cfg, net, model, ((2, 16, 4),))  # warms torch up
    rows = _engine_batches(cfg, net, model, ENGINE_QUICK if quick else ENGINE_GRID)
    # Rounds of 0..3 co-runners in turn, so that the host's other work, which changes by the
    # minute, weighs on every count alike.
    for _ in range(1 if quick else CONTENDED_ROUNDS):
        for k in (0, 1) if quick else CO_RUNNERS:
            rows += _engine_batches(cfg, net, model, ENGINE_QUICK if quick else CONTENDED_GRID, co_runners=k)
    return write_jsonl(out / f"builtin-{model}-steps.jsonl", rows)


def _engine_batches(cfg, net, model: str, grid, co_runners: int = 0) -> list[dict]:
    """Each batch of `grid` run to completion on a fresh engine core, step by step, beside
    `co_runners` busy processes; each step's line says how many, and the share of a core this
    process got meanwhile (its CPU seconds over the wall time); alone, also the host's speed
    measured just before its batch (`probe_s`, `cpu_probe`)."""
    from libra.runtime.engine.core import EngineCore
    from libra.runtime.engine.sequence import SamplingParams, Sequence, TextOutput

    rows: list[dict] = []
    probe = probe_model(model)
    with busy_processes(co_runners, model):
        w0, c0 = time.perf_counter(), time.process_time()
        for n, prompt, gen in grid:
            speed = {"probe_s": round(cpu_probe(probe), 6)} if not co_runners else {}
            core = EngineCore(cfg, net, publish=lambda events: None)
            seqs = [Sequence(f"p{i}", 0, [65 + (i + j) % 26 for j in range(prompt)], SamplingParams(gen, 1.0, seed=i),
                             TextOutput(ignore_eos=True), None, cfg.preset.max_model_len) for i in range(n)]  # fmt: skip
            rows += [{**r, **speed} for r in _timed_steps(core, seqs, f"builtin-{model}")]
        share = (time.process_time() - c0) / (time.perf_counter() - w0)
    return [{**r, "co_runners": co_runners, "share": round(share, 4)} for r in rows]


@contextmanager
def busy_processes(n: int, model: str = "tiny"):
    """`n` processes busy as a live run's trainer replicas are (`train_forever`), this session's
    so they share its time, until the block ends."""
    import subprocess
    import sys

    code = f"from libra.runtime.profiler import train_forever; train_forever({model!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


PROBE_TOKENS = (4, 128)  # the probe's batch: a forward pass of the built-in model, about 20 ms
PROBE_PASSES = 5


def probe_model(model: str = "tiny"):
    """The network `cpu_probe` runs (the built-in model, seed 0)."""
    from libra.runtime.engine.config import PRESETS
    from libra.runtime.engine.model import build_model

    return build_model(PRESETS[model], 0)


def cpu_probe(net) -> float:
    """CPU seconds of this thread for one fixed forward pass of `net` (`probe_model`), the median
    of PROBE_PASSES back to back (the first runs from cold caches, one may be preempted): the
    host's speed in CPU seconds per unit of the built-in model's work, which changes with what
    else runs on it. The profile records it beside its steps and `benchmarks/live_cpu.py` around
    and during a run."""
    tokens = torch.arange(PROBE_TOKENS[0] * PROBE_TOKENS[1]).reshape(PROBE_TOKENS) % 256
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine runs: more would spin at their barriers on a busy host
    passes = []
    try:
        with torch.no_grad():
            for _ in range(PROBE_PASSES):
                t0 = time.thread_time()
                net.forward_train(tokens)
                passes.append(time.thread_time() - t0)
        return sorted(passes)[len(passes) // 2]
    finally:
        torch.set_num_threads(threads)


def train_forever(model: str) -> None:
    """The built-in model's forward and backward passes on random tokens, one torch thread, until
    killed: a busy process that uses the caches as the run's own engines and trainers do."""
    from libra.runtime.engine.config import PRESETS
    from libra.runtime.engine.model import build_model

    torch.set_num_threads(1)
    net = build_model(PRESETS[model], 0).train().requires_grad_(True)  # built frozen, for inference
    tokens = torch.randint(0, 256, (8, 256))
    while True:
        net.forward_train(tokens).float().mean().backward()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _timed_steps(core, seqs: list, model: str) -> list[dict]:
    from libra.runtime.engine.core import StepShape

    plans: list = []
    schedule = core.sched.schedule

    def capture():
        plan = schedule()
        plans.append(plan)
        return plan

    core.sched.schedule = capture
    core._apply("add", seqs)
    rows = []
    while core.sched.has_work:
        t0 = time.process_time()
        core.step()
        dt = time.process_time() - t0
        plan = plans[-1]
        if plan.empty:
            continue
        rows.append({**STEP_KEYS, "model": model, **asdict(StepShape.of(plan)), "step_time_s": max(dt, 1e-6)})
    return rows


def profile_builtin_trainer(model: str, out: Path, threads: int = 1, quick: bool = False) -> Path:
    """Time one trainer replica's GRPO step as `libra train` runs it (`Replica.train`: validate the
    samples, forward and backward in micro-batches, the gradient all-reduce, AdamW, the checkpoint
    and the fingerprint) over a grid of (samples, tokens each), in a one-rank gloo group, as the
    JSONL `libra costmodel calibrate --train-data` reads."""
    import tempfile

    import torch.distributed as dist

    from libra.runtime.train.config import load_train_config
    from libra.runtime.train.worker import Replica

    torch.set_num_threads(threads)
    cfg = load_train_config(None, [f"engine.model={model}", f"trainer.threads={threads}"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as run:
            replica = Replica(cfg, 0, 1, Path(run))
            for k, (n, length) in enumerate(((2, 32),) + (TRAIN_QUICK if quick else TRAIN_GRID)):
                body = _train_body(n, length, k)
                for _ in range(1 if k == 0 else TRAIN_REPEATS):  # the first shape warms torch up
                    t0 = time.process_time()
                    replica.train(body)
                    dt = time.process_time() - t0
                    if k:
                        rows.append({"hardware": "cpu-host", "model": f"builtin-{model}", "seq_lens": [length] * n,
                                     "micro_batch_tokens": cfg.trainer.micro_batch_tokens, "step_time_s": dt})  # fmt: skip
    finally:
        dist.destroy_process_group()
    return write_jsonl(out / f"builtin-{model}-train.jsonl", rows)


def _train_body(n: int, length: int, seed: int) -> dict:
    """`n` samples of `length` tokens, the last third sampled by the model (as a chat turn is)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, length), generator=g).tolist()
    own = length // 3
    mask = [0] * (length - own) + [1] * own
    samples = [{"ids": x, "mask": mask, "logprobs": [-1.0] * length, "advantage": 0.5} for x in ids]
    return {"step": 0, "global_tokens": n * own, "samples": samples}


if __name__ == "__main__":
    main()

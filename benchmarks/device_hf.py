"""Device script: Libra's engine and trainer on a GPU, for a Qwen2.5-0.5B-sized model.

    python benchmarks/device_hf.py --json [--device cuda] [--seqs 64] [--prompt 512] [--gen 128]

Random weights of Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads over 2 KV heads, MLP 4864,
vocabulary 151,936, tied embeddings, q/k/v biases): speed does not depend on the values, and
nothing is downloaded. It runs the very code `libra serve engine --device cuda` and a trainer
replica with `trainer.device: cuda` run (`EngineCore` on the paged KV cache, `Learner.rl_step`),
in bfloat16, and prints one JSON object:

- `engine`: `seqs` sequences of `prompt` random tokens each generating `gen` tokens at once
  (continuous batching), wall seconds, output tokens/s and total tokens/s;
- `train`: GRPO steps of `train_batch` sequences of `train_len` tokens (half of them model
  tokens), mean step seconds after one warm-up step, tokens/s, peak CUDA memory;
- the device name and torch version.

On a CPU it runs too (`--device cpu`, small sizes), which is how it is checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

QWEN25_05B = dict(
    model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip


def engine_bench(model, cfg, seqs: int, prompt: int, gen: int) -> dict:
    from libra.runtime.engine.codec import IdsOnly
    from libra.runtime.engine.core import EngineCore
    from libra.runtime.engine.sequence import SamplingParams, Sequence, TextOutput

    core = EngineCore(cfg, model, lambda events: None)
    g = torch.Generator().manual_seed(0)
    codec = IdsOnly(cfg.preset.vocab_size)

    def batch(n: int, p: int, m: int) -> list[Sequence]:
        return [Sequence(f"r{i}", 0, torch.randint(0, 150000, (p,), generator=g).tolist(),
                         SamplingParams(max_tokens=m, temperature=1.0, seed=i), TextOutput(codec=codec), None,
                         cfg.preset.max_model_len) for i in range(n)]  # fmt: skip

    core.run_sync(batch(2, 16, 4))  # warm-up (kernels, allocator)
    _sync(cfg.device)
    t0 = time.perf_counter()
    core.run_sync(batch(seqs, prompt, gen))
    _sync(cfg.device)
    wall = time.perf_counter() - t0
    return {"seqs": seqs, "prompt": prompt, "gen": gen, "wall_s": round(wall, 3), "steps": core.steps,
            "output_tokens_per_s": round(seqs * gen / wall, 1), "total_tokens_per_s": round(seqs * (prompt + gen) / wall, 1)}  # fmt: skip


def train_bench(model, device: str, batch: int, length: int, steps: int) -> dict:
    from libra.runtime.train.batch import TrainSample
    from libra.runtime.train.grpo import Clip
    from libra.runtime.train.learner import Learner, OptimConfig
    from libra.runtime.train.reducer import LocalReducer

    model.train().requires_grad_(True)
    learner = Learner(None, 0, OptimConfig(lr=1e-6, micro_batch_tokens=batch * length), LocalReducer(), model)
    g = torch.Generator().manual_seed(1)
    samples = [TrainSample(ids=torch.randint(0, 150000, (length,), generator=g).tolist(), mask=[0] * (length // 2) + [1] * (length - length // 2),
                           logprobs=[-5.0] * length, advantage=(-1.0) ** i) for i in range(batch)]  # fmt: skip
    tokens = sum(s.n_model_tokens for s in samples)
    learner.rl_step(samples, tokens, Clip())  # warm-up
    _sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        learner.rl_step(samples, tokens, Clip())
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    out = {"batch": batch, "length": length, "steps": steps, "step_s": round(step_s, 3), "tokens_per_s": round(batch * length / step_s, 1)}  # fmt: skip
    if device.startswith("cuda"):
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-len", type=int, default=1024)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=24, help="fewer for a quick CPU check")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from libra.runtime.engine.config import EngineConfig
    from libra.runtime.engine.hf_model import random_hf_model

    shape = {**QWEN25_05B, "num_hidden_layers": a.layers}
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    model = (
        random_hf_model(shape, seed=0, name="qwen2.5-0.5b-shape")
        .to(a.device, dtype)
        .eval()
        .requires_grad_(False)
    )
    kv_mb = max(64, int(a.seqs * (a.prompt + a.gen) * model.preset.kv_bytes_per_token(2 if dtype == torch.bfloat16 else 4) / 2**20 * 1.3))  # fmt: skip
    cfg = EngineConfig.model_construct(model="random", device=a.device, max_num_seqs=a.seqs,
                                       max_num_batched_tokens=max(2048, a.seqs), prefill_chunk=1024, block_size=16,
                                       kv_cache_mb=kv_mb, dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                                       weight_version="0", step_log=None, seed=0)  # fmt: skip
    from libra.runtime.engine.sources import ModelSource

    cfg._source = ModelSource("hf", "random", None, model.preset.with_context(a.prompt + a.gen + 16))
    out = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu", "torch": torch.__version__,
           "model": {"shape": "Qwen2.5-0.5B", "layers": a.layers, "params": sum(p.numel() for p in model.parameters()), "dtype": str(dtype)},
           "engine": engine_bench(model, cfg, a.seqs, a.prompt, a.gen)}  # fmt: skip
    out["train"] = train_bench(model, a.device, a.train_batch, a.train_len, a.train_steps)
    print(json.dumps(out) if a.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

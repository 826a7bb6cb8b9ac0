"""Built-in engine speed: decode tokens/s at batch 1 and 32, and time to first token.

Two views side by side, because they answer different questions:
- `core_*`: the engine loop in process (model, KV cache, scheduler, sampling), no HTTP;
- `http_*`: a real `libra serve engine` subprocess driven over loopback with streaming requests,
  which is what the gateway and the tests see (adds HTTP, JSON and SSE per token).
`batch32_speedup` = tok/s at batch 32 / tok/s at batch 1 is the continuous-batching gain; the
ratio, measured in one run, is what to compare across machines (these machines are noisy).

Every sequence runs to exactly `TOKENS` tokens (`ignore_eos`), from a 64-byte prompt, greedy.
Run: .venv/bin/python benchmarks/bench_engine.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402

TOKENS = 256
PROMPT = "Benchmark prompt: tell me about continuous batching on a CPU." + "!" * 2  # 64 bytes


def core_figures() -> dict:
    import torch

    from libra.runtime.engine.config import EngineConfig
    from libra.runtime.engine.core import EngineCore
    from libra.runtime.engine.model import build_model
    from libra.runtime.engine.sequence import SamplingParams, Sequence, TextOutput
    from libra.runtime.engine.tokenizer import render_prompt

    torch.set_num_threads(1)
    cfg = EngineConfig(max_num_seqs=64)
    model = build_model(cfg.preset, cfg.seed)
    out = {}
    for batch in (1, 32):
        core = EngineCore(cfg, model, publish=lambda events: None)
        t0, now = time.perf_counter(), time.monotonic()
        seqs = [
            Sequence(
                f"b{i}",
                0,
                render_prompt(PROMPT),
                SamplingParams(TOKENS, 0.0),
                TextOutput(ignore_eos=True),
                None,
                8192,
                now,
            )  # fmt: skip
            for i in range(batch)
        ]
        core.run_sync(seqs)
        wall = time.perf_counter() - t0
        assert all(s.n_generated == TOKENS for s in seqs)
        out[f"core_tok_s_b{batch}"] = batch * TOKENS / wall
        out[f"core_ttft_ms_b{batch}"] = 1e3 * statistics.median(s.first_token_at - s.arrived for s in seqs)
    return out


async def _stream_one(client, ttfts: list[float]) -> int:
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    n, first = 0, None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            n += len(chunk.choices[0].text.encode())
    ttfts.append(first - t0)
    return n


async def _http_batch(base_url: str, batch: int) -> tuple[float, float]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        await _stream_one(client, [])  # warm the connection and the engine
        ttfts: list[float] = []
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_stream_one(client, ttfts) for _ in range(batch)))
        wall = time.perf_counter() - t0
    return sum(counts) / wall, 1e3 * statistics.median(ttfts)


def http_figures() -> dict:
    from tests.engine_fixtures import start_engine

    engine = start_engine("--max-num-seqs", "64")
    try:
        out = {}
        for batch in (1, 32):
            tok_s, ttft = asyncio.run(_http_batch(engine.base_url, batch))
            out[f"http_tok_s_b{batch}"], out[f"http_ttft_ms_b{batch}"] = tok_s, ttft
        return out
    finally:
        engine.stop()


def main() -> None:
    # Other work on a shared machine slows everything; the load average says how much there was.
    figures = {"model": "tiny", "tokens_per_seq": TOKENS, "load_avg_1m": os.getloadavg()[0]}
    figures.update(core_figures())
    figures.update(http_figures())
    figures["batch32_speedup_core"] = figures["core_tok_s_b32"] / figures["core_tok_s_b1"]
    figures["batch32_speedup_http"] = figures["http_tok_s_b32"] / figures["http_tok_s_b1"]
    report("engine", {k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()})


if __name__ == "__main__":
    main()

"""The built-in engine's model path, in process: KV-cache correctness (chunked prefill, batched
decode, preemption and recompute all give what a cache-free full forward gives), sampling
reproducibility, and checkpoint save/load."""

from __future__ import annotations

import time

import pytest
import torch

from libra.core.errors import ConfigError
from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.core import EngineCore
from libra.runtime.engine.kv_cache import BlockAllocator, KVCache
from libra.runtime.engine.model import PrefillChunk, StepBatch, build_model, save_checkpoint
from libra.runtime.engine.runner import ModelRunner
from libra.runtime.engine.scheduler import Scheduler
from libra.runtime.engine.sequence import FinishReason, SamplingParams, Sequence, TextOutput
from libra.runtime.engine.tokenizer import ChatMessage, render_chat


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = build_model(EngineConfig().preset, seed=0)
    with torch.no_grad():  # a trained model's previous-token embedding is not zero: test the path
        m.embed_prev.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    return m


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits at every position from the trainer's cache-free causal forward: the reference."""
    with torch.inference_mode():
        return model.forward_train(torch.tensor([tokens]))[0]


def test_a_random_engine_ignores_the_previous_token_until_trained():
    """`embed_prev` starts at zero, so seeded random engines compute what they did before it."""
    m = build_model(EngineConfig().preset, seed=0)
    assert not m.embed_prev.weight.any()
    tokens = torch.tensor(prompt_of(3, 40))
    n = len(tokens)
    cache = KVCache(m.preset, -(-n // 16) + 1, 16)
    pos = torch.arange(n)
    shifted = torch.cat([tokens[:1], tokens[:-1]])  # any previous tokens: the rows are zero
    batch = StepBatch(tokens, shifted, pos, pos + 16, 0, None, None, [PrefillChunk(0, n, 0, None, None)])
    with torch.inference_mode():
        torch.testing.assert_close(m(batch, cache), m.forward_train(tokens[None])[0], atol=2e-4, rtol=1e-4)


def prompt_of(i: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (length,), generator=g).tolist()


def test_chunked_prefill_and_batched_decode_match_a_full_forward(model):
    """Every logit the cache path produces equals the reference, for two interleaved sequences."""
    alloc = BlockAllocator(64, 16)
    cache = KVCache(model.preset, 64, 16)
    # Memory from `empty` may hold anything: NaN everywhere but the null block must not leak into
    # any output (attention reads whole blocks and masks their unused tails).
    cache.k[:, 16:], cache.v[:, 16:] = float("nan"), float("nan")
    runner = ModelRunner(model, cache, 4, 32)
    sched = Scheduler(alloc, 4, 64, chunk=24)  # prompts of 70 and 37 tokens arrive in chunks
    seqs = [Sequence(f"s{i}", 0, prompt_of(i, n), SamplingParams(30, 0.0), TextOutput(), None, 512) for i, n in enumerate((70, 37))]  # fmt: skip
    for s in seqs:
        sched.add(s)
    checked = 0
    while any(s.n_generated < 20 for s in seqs):
        plan = sched.schedule()
        batch, _ = runner.build(plan)
        batch.sample_rows = None  # every row's logits
        with torch.inference_mode():
            got = model(batch, runner.cache)
        row = 0
        for c in plan.chunks:
            want = full_logits(model, c.seq.tokens[: c.start + c.n])[c.start :]
            torch.testing.assert_close(got[row : row + c.n], want, atol=2e-4, rtol=1e-4)
            row, checked = row + c.n, checked + c.n
            c.seq.num_computed += c.n
            if c.samples:
                c.seq.tokens.append(int(want[-1, :256].argmax()))
    assert checked == sum(len(s.tokens) - 1 for s in seqs)


def run(cfg: EngineConfig, model, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], EngineCore]:  # fmt: skip
    core = EngineCore(cfg, model, publish=lambda events: None)
    seqs = [Sequence(f"r{i}", 0, p, params, TextOutput(), None, cfg.preset.max_model_len) for i, p in enumerate(prompts)]  # fmt: skip
    core.run_sync(seqs)
    assert all(s.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for s in seqs)
    return [s.tokens[s.n_prompt :] for s in seqs], core


def test_greedy_output_does_not_depend_on_batching_or_preemption(model):
    prompts = [prompt_of(i, 900 + 20 * i) for i in range(10)]
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    roomy, _ = run(EngineConfig(max_num_seqs=16), model, prompts, greedy)
    # The smallest cache the config allows holds ~8.7K tokens; 10 prompts need ~10K: preemption.
    tight, core = run(EngineConfig(max_num_seqs=16, kv_cache_mb=17), model, prompts, greedy)
    alone, _ = run(EngineConfig(max_num_seqs=1), model, prompts[:3], greedy)
    assert core.sched.preemptions > 0, "the scenario must actually preempt"
    assert core.peak_batch > 1
    assert tight == roomy
    assert alone == roomy[:3]
    assert core.alloc.free_count == core.alloc.num_blocks - 1, "blocks leaked"


def test_seeded_sampling_is_reproducible_and_top_p_narrows_to_greedy(model):
    cfg = EngineConfig(max_num_seqs=8)
    prompts = [render_chat([ChatMessage("user", "hello")])] * 2
    a, _ = run(cfg, model, prompts, SamplingParams(40, temperature=1.0, seed=7))
    b, _ = run(cfg, model, prompts[:1], SamplingParams(40, temperature=1.0, seed=7))
    c, _ = run(cfg, model, prompts[:1], SamplingParams(40, temperature=1.0, seed=8))
    greedy, _ = run(cfg, model, prompts[:1], SamplingParams(40, temperature=0.0))
    nucleus, _ = run(cfg, model, prompts[:1], SamplingParams(40, temperature=1.0, top_p=1e-6, seed=3))
    assert a[0] == a[1] == b[0] and c[0] != a[0]
    assert nucleus == greedy


def test_checkpoint_round_trip_gives_identical_weights_and_output(model, tmp_path):
    path = save_checkpoint(model, tmp_path / "tiny.pt")
    loaded = build_model(model.preset, seed=123, checkpoint=path)  # the seed must not matter
    other = build_model(model.preset, seed=123)
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    prompts = [render_chat([ChatMessage("user", "same weights, same words")])]
    greedy = SamplingParams(32, temperature=0.0)
    assert run(EngineConfig(), loaded, prompts, greedy)[0] == run(EngineConfig(), model, prompts, greedy)[0]
    assert run(EngineConfig(), other, prompts, greedy)[0] != run(EngineConfig(), model, prompts, greedy)[0]


def test_bad_checkpoints_are_config_errors(model, tmp_path):
    small = build_model(EngineConfig(model="small").preset, seed=0)
    wrong = save_checkpoint(small, tmp_path / "small.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    for path, words in (
        (wrong, "wrong shape"),
        (junk, "state_dict"),
        (tmp_path / "missing.pt", "existing file"),
    ):
        with pytest.raises(ConfigError) as e:
            build_model(model.preset, checkpoint=path)
        assert e.value.field == "checkpoint" and words in str(e.value)


def test_a_failing_step_fails_its_requests_and_the_engine_carries_on(model, monkeypatch):
    events: list = []
    core = EngineCore(EngineConfig(), model, publish=events.extend)
    real = core.runner.execute

    def broken(plan):  # fault injection: nothing real fails on demand, so one step is made to
        raise RuntimeError("injected fault")

    monkeypatch.setattr(core.runner, "execute", broken)
    prompt = render_chat([ChatMessage("user", "hi")])
    doomed = [
        Sequence("bad", i, prompt, SamplingParams(8, 0.0), TextOutput(), "sink", 8192) for i in range(2)
    ]
    core.start()
    try:
        core.submit(doomed)
        deadline = time.monotonic() + 30
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(ev.index for _, ev in events) == [0, 1] and all(ev.error for _, ev in events)
        assert all(s.finish_reason == FinishReason.ABORT for s in doomed) and core.alive
        monkeypatch.setattr(core.runner, "execute", real)
        events.clear()
        core.submit([Sequence("good", 0, prompt, SamplingParams(8, 0.0), TextOutput(), "sink", 8192)])
        while not any(ev.finish for _, ev in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [ev.finish for _, ev in events if ev.finish] and not any(ev.error for _, ev in events)
    finally:
        core.stop()
    assert not core.alive and core.alloc.free_count == core.alloc.num_blocks - 1

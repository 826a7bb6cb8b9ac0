"""`libra train`'s parts, without processes: the task, the turns' tokens, GRPO, batching,
checkpoints, the configuration, and the training forward against the engine's own logprobs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.core.errors import ConfigError
from libra.runtime.engine.config import PRESETS, EngineConfig
from libra.runtime.engine.core import EngineCore
from libra.runtime.engine.model import TinyTransformer, build_model, token_logprobs
from libra.runtime.engine.sequence import SamplingParams, Sequence, TextOutput
from libra.runtime.engine.tokenizer import ChatMessage, ToolCallText, render_chat, render_prompt
from libra.runtime.train import checkpoint as ckpt
from libra.runtime.train.batch import TrainSample, micro_batches, shard
from libra.runtime.train.config import load_train_config
from libra.runtime.train.grpo import group_advantages
from libra.runtime.train.task import (  # fmt: skip
    TOOL_NAME,
    TOOL_SCHEMA,
    Problem,
    ProblemStream,
    demonstration,
    evaluate,
    reward,
    sandbox_program,
)
from libra.runtime.train.tools import expression_of
from libra.runtime.train.trajectory import TokenMismatch, Turn, assemble
from tests.conftest import run_cli

torch.set_num_threads(1)


def test_training_forward_matches_the_engines_logprobs():
    cfg = EngineConfig(kv_cache_mb=32)
    events = []
    core = EngineCore(cfg, build_model(cfg.preset, 3), events.extend)
    prompt = render_prompt("What is 12+34? ")
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, logprobs=True) for i in range(3)]
    seqs = [
        Sequence("r", i, prompt, p, TextOutput(ignore_eos=True), None, 8192) for i, p in enumerate(params)
    ]
    core.run_sync(seqs)
    model = TinyTransformer(cfg.preset, 3)
    for s in seqs:
        ours = token_logprobs(model, torch.tensor([s.tokens]))[0, len(prompt) - 1 :]
        theirs = torch.tensor([e.logprobs[0].logprob for _, e in events if e.index == s.index and e.logprobs])
        assert ours.shape == theirs.shape and (ours - theirs).abs().max() < 1e-4


def test_a_demonstration_is_the_engines_rendering_of_the_same_episode():
    p = Problem("p", 37, "*", 58)
    ids, mask = demonstration(p, "call_abc")
    call = ToolCallText(TOOL_NAME, json.dumps({"expr": "37*58"}))
    convo = [ChatMessage("user", p.question), ChatMessage("assistant", "", (call,)), ChatMessage("tool", "2146", (), "call_abc")]  # fmt: skip
    rendered = render_chat(convo, [TOOL_SCHEMA])
    assert ids[: len(rendered)] == rendered
    model_text = bytes(i for i, m in zip(ids, mask, strict=True) if m and i < 256).decode()
    assert model_text == '{"name": "calc", "arguments": {"expr": "37*58"}}2146'
    tool_output = rendered.index(ord("\n"), len(rendered) - 12) + 1  # the tool's result: never trained on
    assert not any(mask[tool_output : len(rendered)])


def test_the_calculator_and_the_reward():
    assert evaluate("2*(3+4)") == "14" and evaluate("-5+2") == "-3"
    assert evaluate("__import__('os')").startswith("error") and evaluate("1/2").startswith("error")
    assert evaluate("9" * 70).startswith("error") and evaluate("(" * 300).startswith("error")
    p = Problem("p", 12, "-", 30)
    assert reward(p, " -18 ") == 1.0 and reward(p, "18") == 0.0 and reward(p, None) == 0.0
    assert expression_of("calc", '{"expr": "1+2"}') == "1+2" and expression_of("calc", "{") is None


def test_the_sandbox_program_gives_the_pure_functions_output():
    exprs = ["12*34", "-(3-9)", "1/0", "x", "", "10**9", "99999*99999*99999"]
    for e in exprs:
        out = subprocess.run(
            [sys.executable, "-c", sandbox_program(e)], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.strip() == evaluate(e), e


def _turn(prompt, ids, version=0):
    return Turn(prompt, ids, [-0.5] * len(ids), [version] * len(ids), "stop")


def test_turns_assemble_with_a_loss_mask_over_model_tokens_only():
    t0 = _turn([1, 2, 3], [10, 11])
    t1 = _turn([1, 2, 3, 10, 11, 7, 7, 7], [12, 13], version=1)
    seq = assemble([t0, t1])
    assert seq.ids == [1, 2, 3, 10, 11, 7, 7, 7, 12, 13]
    assert seq.mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert seq.versions == [-1, -1, -1, 0, 0, -1, -1, -1, 1, 1]
    with pytest.raises(TokenMismatch):
        assemble([t0, _turn([1, 2, 3, 10, 99, 7], [12])])


def test_group_advantages():
    assert group_advantages([1, 1, 1, 1]) == [0, 0, 0, 0]
    a = group_advantages([1, 0, 0, 0])
    assert abs(sum(a)) < 1e-9 and a[0] > 0 > a[1]
    assert group_advantages([1, 0], normalize_std=False) == [0.5, -0.5]
    assert group_advantages([1, 0], normalize_std=False, negative_weight=0.25) == [0.5, -0.125]
    assert group_advantages([1, 0, 0, 0], negative_weight=0.0)[1:] == [0, 0, 0]


@given(st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=16), st.floats(0, 1))
def test_negative_weight_scales_only_below_mean_advantages(rewards, w):
    plain, weighted = group_advantages(rewards), group_advantages(rewards, negative_weight=w)
    for p, q in zip(plain, weighted, strict=True):
        assert q == (p if p >= 0 else p * w)


samples_st = st.lists(st.integers(2, 60), min_size=1, max_size=40).map(
    lambda ns: [TrainSample(ids=[1] * n, mask=[0] + [1] * (n - 1), logprobs=[0.0] * n) for n in ns]
)


@settings(max_examples=60, deadline=None)
@given(samples_st, st.integers(1, 5), st.integers(60, 500))
def test_shards_and_micro_batches_keep_every_sample_once(samples, n, budget):
    parts = shard(samples, n)
    assert len(parts) == n and sorted(map(id, sum(parts, []))) == sorted(map(id, samples))
    loads = [sum(len(s.ids) for s in p) for p in parts]
    assert max(loads) - min(loads) <= max(len(s.ids) for s in samples)
    mbs = micro_batches(samples, budget)
    assert sorted(map(id, sum(mbs, []))) == sorted(map(id, samples))
    assert all(len(mb) == 1 or max(len(s.ids) for s in mb) * len(mb) <= budget for mb in mbs)


def test_checkpoints_are_whole_or_ignored(tmp_path):
    model = TinyTransformer(PRESETS["tiny"], 0)
    for step in range(4):
        ckpt.save(tmp_path, step, step, model.state_dict(), {"x": torch.zeros(1)}, keep=2)
    (tmp_path / "step-000009").mkdir()  # an interrupted write: no state.json
    assert [c.step for c in ckpt.complete(tmp_path)] == [2, 3]
    latest = ckpt.latest(tmp_path)
    weights, opt = ckpt.load(latest)
    assert latest.step == 3 and set(weights) == set(model.state_dict()) and "x" in opt
    TinyTransformer(PRESETS["tiny"], 1).load_state_dict(torch.load(latest.model, weights_only=True))


def test_problem_streams_are_seeded():
    a, b = ProblemStream(5), ProblemStream(5)
    assert [a.next() for _ in range(5)] == [b.next() for _ in range(5)]
    assert all(10 <= p.a <= 99 for p in [ProblemStream(1).next() for _ in range(20)])


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"trainer.replicas"):
        load_train_config(None, ["trainer.replicas=0"])
    with pytest.raises(ConfigError, match=r"task.hi"):
        load_train_config(None, ["task.lo=50", "task.hi=10"])
    with pytest.raises(ConfigError, match=r"task.eval_every"):  # held-out evaluations need problems
        load_train_config(None, ["task.eval_every=5"])
    with pytest.raises(ConfigError, match=r"rollout.nonsense"):
        load_train_config(None, ["rollout.nonsense=1"])
    partial = "pipeline.mode=colocated-partial"
    with pytest.raises(ConfigError, match=r"pipeline.staleness"):  # carried groups train a step later
        load_train_config(None, [partial, "pipeline.staleness=0"])
    with pytest.raises(ConfigError, match=r"pipeline.consume"):
        load_train_config(None, [partial, "pipeline.consume=batch"])
    with pytest.raises(ConfigError, match=r"pipeline.mode"):
        load_train_config(None, [partial, "elastic.enabled=true"])
    with pytest.raises(ConfigError, match=r"pipeline.over_provision"):
        load_train_config(None, [partial, "pipeline.over_provision=0.5"])
    assert load_train_config(None, []).trainer.replicas == 2


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path):
    r = run_cli("train", "--set", "pipeline.consume=sometimes", "--out", str(tmp_path), timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: pipeline.consume"), r.stderr


def test_an_in_process_rollout_is_seeded_whatever_the_interleaving():
    """LocalChat seeds each turn (its sampling and its tool-call id) from the run's seed, the
    trajectory and the turn, so concurrent trajectories sample the same tokens however their
    turns reach the engine: here the same group run twice, in opposite orders."""
    from libra.runtime.train.agent import AgentEnv, CalcLoop
    from libra.runtime.train.chat import Sampling
    from libra.runtime.train.inprocess import LocalChat
    from libra.runtime.train.tools import InProcessTools
    from libra.runtime.train.trajectory import Trajectory

    async def group(order: list[int]) -> dict[str, list[list[int]]]:
        problem = ProblemStream(3).next()
        async with LocalChat(EngineConfig(model="tiny", kv_cache_mb=32, seed=0), seed=7) as chat:
            env = AgentEnv(chat, InProcessTools(), Sampling(max_tokens=24))
            trajs = [Trajectory(f"b0-g0-{i}", problem.id, 0, 0) for i in order]
            await asyncio.gather(*(CalcLoop().run(problem, t, env) for t in trajs))
        return {t.id: [t.turns[0].token_ids, t.turns[-1].prompt_ids, t.turns[-1].token_ids] for t in trajs}

    a, b = asyncio.run(group([0, 1, 2, 3])), asyncio.run(group([3, 2, 1, 0]))
    assert a == b and len({json.dumps(v) for v in a.values()}) == 4

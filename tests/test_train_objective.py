"""The loss's inputs and corrections: the engine and the trainer score a token under the same
processed distribution (temperature, top_p, top_k) at T != 1, the grammar's forced tokens stay out
of the loss, an in-place update's tokens are never taken for the new weights' own, and the
dual-clip and truncated importance sampling do what verl's and slime's do. Bad settings exit 2
naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from libra.core.errors import ConfigError
from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.core import EngineCore, PauseMode
from libra.runtime.engine.distribution import LOGPROB_FLOOR, processed_logprobs
from libra.runtime.engine.model import TRAIN_EMBED_STD, TinyTransformer, build_model
from libra.runtime.engine.protocol import token_fields
from libra.runtime.engine.sequence import SamplingParams, Sequence, TextOutput, ToolOutput
from libra.runtime.engine.tokenizer import ChatMessage, render_chat, render_prompt
from libra.runtime.train.batch import TrainSample
from libra.runtime.train.chat import Sampling
from libra.runtime.train.config import load_train_config
from libra.runtime.train.grpo import Objective, policy_loss
from libra.runtime.train.learner import Learner, OptimConfig
from libra.runtime.train.reducer import LocalReducer
from libra.runtime.train.samples import sample_of
from libra.runtime.train.task import TOOL_SCHEMA
from libra.runtime.train.trajectory import Turn, assemble
from tests.conftest import run_cli

torch.set_num_threads(1)

T, TOP_P, TOP_K = 0.7, 0.9, 12


def _generate(params: list[SamplingParams], tools: bool):
    """Sequences sampled by an engine with a trained-scale model (seed 3), and their events."""
    cfg = EngineConfig(kv_cache_mb=32, logprobs_mode="processed_logprobs")
    learner = Learner(cfg.preset, 3, OptimConfig(), LocalReducer())
    model = build_model(cfg.preset)
    model.load_state_dict(learner.model.state_dict())
    events: list = []
    core = EngineCore(cfg, model, events.extend)
    if tools:
        prompt = render_chat([ChatMessage("user", "What is 12+34?")], [TOOL_SCHEMA])
        out = lambda: ToolOutput({"calc": TOOL_SCHEMA["function"]["parameters"]}, "call_0")  # noqa: E731
    else:
        prompt = render_prompt("What is 12+34? ")
        out = lambda: TextOutput(ignore_eos=True)  # noqa: E731
    seqs = [Sequence("r", i, prompt, p, out(), None, 8192) for i, p in enumerate(params)]
    core.run_sync(seqs)
    lps = {s.index: [lp for _, e in events if e.index == s.index for lp in e.logprobs] for s in seqs}
    return learner, prompt, seqs, lps


@pytest.mark.parametrize("tools", [False, True])
def test_the_trainer_scores_tokens_under_the_engines_processed_distribution(tools):
    """At T=0.7, top_p=0.9, top_k=12 the trainer's log-prob of every sampled token (not forced)
    equals the engine's to float rounding; the raw distribution's differs (the test can fail).
    With a tool grammar, the forced tokens are exactly those the grammar allowed alone: the
    envelope's, never the expression's. Without a grammar, a token is forced only when the UTF-8
    rule chose it outside what the policy keeps (its log-prob is then reported as -9999)."""
    params = [
        SamplingParams(48, temperature=T, top_p=TOP_P, top_k=TOP_K, seed=i, logprobs=True) for i in range(4)
    ]
    learner, prompt, seqs, lps = _generate(params, tools)
    n, free_tokens = len(prompt), 0
    for s in seqs:
        forced = [lp.forced for lp in lps[s.index]]
        mask = [0] * n + [int(not f) for f in forced]
        sample = TrainSample(ids=s.tokens, mask=mask, logprobs=[0.0] * n + [lp.logprob for lp in lps[s.index]],
                             temperature=T, top_p=TOP_P, top_k=TOP_K)  # fmt: skip
        ours = torch.tensor(learner.logprobs([sample])[0][n:])
        raw = torch.tensor(learner.logprobs([sample.model_copy(update={"temperature": 1.0, "top_p": 1.0, "top_k": 0})])[0][n:])  # fmt: skip
        theirs = torch.tensor([lp.logprob for lp in lps[s.index]])
        free = ~torch.tensor(forced)
        free_tokens += int(free.sum())
        if free.any():  # a random model's top-k may miss every token the grammar allows
            assert (ours - theirs)[free].abs().max() < 1e-4
            assert (raw - theirs)[free].abs().max() > 1e-2
        if tools:
            text = bytes(t for t, f in zip(s.tokens[n:], forced, strict=True) if not f and t < 256).decode()
            assert sum(forced) >= 30, "the envelope and the tool's name are the grammar's"
            assert '"name"' not in text and "calc" not in text
        else:  # no grammar: only a token the UTF-8 rule chose outside the policy's top_k/top_p set
            assert forced == [lp.logprob == LOGPROB_FLOOR for lp in lps[s.index]]
    assert free_tokens > 0


def test_processed_logprobs_keep_the_sampled_token_and_renormalise():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    lp = processed_logprobs(logits, 1.0, top_p=0.5)
    assert torch.isfinite(lp[0, 0]) and lp[0, 0].item() == pytest.approx(0.0) and torch.isinf(lp[0, 1:]).all()
    kept = processed_logprobs(logits, 1.0, top_p=0.5, keep=torch.tensor([3]))  # a sampled token at the edge
    assert torch.isfinite(kept[0, 3]) and kept[0].exp().sum().item() == pytest.approx(1.0)
    t = processed_logprobs(logits, 0.5, top_k=2)
    z = math.log(math.exp(6.0) + math.exp(4.0))
    assert t[0, 0].item() == pytest.approx(6.0 - z) and torch.isinf(t[0, 2:]).all()


def test_forced_tokens_stay_out_of_the_loss_and_mixed_tokens_out_of_the_same_version_check():
    turn = Turn([1, 2], [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], [3, 3, 4, 4], "stop",
                kv_versions=[3, 3, 3, 4], forced=[True, False, False, False])  # fmt: skip
    s = sample_of(assemble([turn]), 1.0, Sampling(temperature=0.7, top_p=0.9, top_k=5))
    assert s.mask == [0, 0, 0, 1, 1, 1] and s.n_model_tokens == 3
    assert s.versions == [-1, -1, -1, 3, -1, 4]  # the token of weights 4 over a KV of 3 has no version
    assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.9, 5)


def _loss(new: float, old: float, adv: float, obj: Objective) -> tuple[float, float, object]:
    new_t = torch.tensor([[new]], requires_grad=True)
    parts = policy_loss(new_t, torch.tensor([[old]]), torch.tensor([adv]), torch.ones(1, 1), obj, 1)
    parts.loss.backward()
    return parts.loss.item(), new_t.grad.item(), parts


def test_dual_clip_bounds_a_negative_advantage_with_a_large_ratio():
    """ratio 100, advantage -1: PPO's loss is 100 (unbounded in the ratio); dual-clip c=3 caps it
    at 3 with no gradient (verl's clip_ratio_c)."""
    big = math.log(100.0)
    loss, grad, _ = _loss(big, 0.0, -1.0, Objective(dual_clip=None))
    assert loss == pytest.approx(100.0, rel=1e-4) and grad == pytest.approx(100.0, rel=1e-4)
    loss, grad, parts = _loss(big, 0.0, -1.0, Objective(dual_clip=3.0))
    assert loss == pytest.approx(3.0) and grad == 0.0 and parts.dual_clipped == 1
    loss, _, _ = _loss(big, 0.0, 1.0, Objective(dual_clip=3.0))  # a positive advantage: the usual clip
    assert loss == pytest.approx(-1.28)


def test_truncated_importance_sampling_weights_by_the_engines_behaviour_logprob():
    """correction tis: the ratio is taken against the trainer's own log-prob (1 at the step's
    weights, so the PPO clip stays inactive) and the token's gradient is weighted by
    min(pi_prox / pi_behaviour, cap): 1.5 below the cap, 2 above it."""
    for gap, weight, truncated in ((math.log(1.5), 1.5, 0), (math.log(5.0), 2.0, 1)):
        loss, grad, parts = _loss(0.0, -gap, 1.0, Objective(correction="tis", tis_cap=2.0))
        assert loss == pytest.approx(-weight, rel=1e-5) and grad == pytest.approx(-weight, rel=1e-5)
        assert parts.is_truncated == truncated and parts.clipped == 0
    _, grad, parts = _loss(0.0, -math.log(5.0), 1.0, Objective())  # no correction: the PPO clip acts
    assert grad == 0.0 and parts.clipped == 1


def test_same_version_gap_counts_only_tokens_of_the_trainers_weights():
    new, old = torch.tensor([[0.0, 0.0]]), torch.tensor([[-1e-6, -0.5]])
    same = torch.tensor([[True, False]])
    parts = policy_loss(new, old, torch.tensor([1.0]), torch.ones(1, 2), Objective(), 2, same)
    assert parts.same_version_tokens == 1 and parts.same_version_gap == pytest.approx(1e-6)
    assert parts.logprob_diff == pytest.approx(0.5)


def _engine_with_update(mode: PauseMode):
    """A sequence that is generating when an update arrives (paused with `mode`): its events."""
    cfg = EngineConfig(kv_cache_mb=32, weight_version="0")
    events: list = []
    core = EngineCore(cfg, build_model(cfg.preset, 1), events.extend)
    seq = Sequence("r", 0, render_prompt("hello"), SamplingParams(30, seed=0, logprobs=True), TextOutput(ignore_eos=True), None, 8192)  # fmt: skip
    core._apply("add", [seq])
    for _ in range(8):  # the prompt and a few tokens with version 0
        core.step()
    new = TinyTransformer(cfg.preset, 2, embed_std=TRAIN_EMBED_STD).state_dict()
    core._do_pause(mode)
    core._do_weights((new, "1", False))
    core._do_continue(None)
    while core.sched.has_work:
        core.step()
    return [(v, kv) for _, e in events for v, kv in zip(e.versions, e.kv_versions, strict=True)]


def test_an_in_place_update_marks_its_tokens_mixed_and_retract_recomputes_the_cache():
    """in_place keeps the KV of weights 0: the tokens sampled after the update read it, so their
    KV version (0) differs from their weights' (1) and the response says so; retract recomputes
    the KV with the new weights, so every token has one version."""
    kept = _engine_with_update(PauseMode.IN_PLACE)
    assert ("0", "0") in kept and ("1", "0") in kept and ("1", "1") not in kept
    fields = token_fields([v for v, _ in kept], [kv for _, kv in kept], [])
    assert fields["token_kv_versions"] == [kv for _, kv in kept]
    redone = _engine_with_update(PauseMode.RETRACT)
    assert ("1", "1") in redone and all(v == kv for v, kv in redone)
    assert "token_kv_versions" not in token_fields([v for v, _ in redone], [kv for _, kv in redone], [])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("pipeline.staleness=-1", "pipeline.staleness"),
        ("trainer.correction=importance", "trainer.correction"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.top_k=-3", "rollout.top_k"),
        ("trainer.dual_clip=0.5", "trainer.dual_clip"),
        ("trainer.tis_cap=0.5", "trainer.tis_cap"),
    ],
)
def test_bad_settings_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_train_config(None, [override])


def test_a_bad_correction_exits_2_naming_the_field(tmp_path):
    r = run_cli("train", "--set", "trainer.correction=importance", "--out", str(tmp_path), timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: trainer.correction"), (
        r.stderr
    )

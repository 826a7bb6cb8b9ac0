"""The supervised warm-start: correct episodes of the task until the model has signal for RL.

Why it stops early: GRPO learns only from groups with both successes and failures (a group that
all fails has zero advantage), and a run is meant to show what RL adds, so the warm-start stops
once a probe says the model succeeds about `target_success` of the time; `steps` caps it.

The probe is the mean probability that the engine samples a correct episode, over fixed held-out
problems, at temperature 1: each token the model chooses at its probability renormalised over
what the engine's grammar allows there, each token the grammar forces at 1 (the engine samples
exactly that). Other correct episodes also score (an expression written another way), so it is a
lower bound of sampled success, and a tight one. It is one forward pass, and every replica
computes the same number from the same weights, so all replicas stop at the same step without
exchanging anything.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from libra.runtime.engine.model import TinyTransformer
from libra.runtime.train.batch import TrainSample, pad
from libra.runtime.train.config import TaskConfig, WarmStartConfig
from libra.runtime.train.learner import Learner
from libra.runtime.train.task import ProblemStream, call_id, demonstration, demonstration_allowed

PROBE_PROBLEMS = 64
PROBE_STREAM = 1_000_001  # added to the seed: problems neither the warm-start nor RL draws


@dataclass(slots=True)
class WarmStartResult:
    losses: list[float] = field(default_factory=list)
    probes: list[tuple[int, float]] = field(default_factory=list)  # (steps done, probe success)

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
    def success(self) -> float | None:
        return self.probes[-1][1] if self.probes else None


def probe_success(model: TinyTransformer, task: TaskConfig, seed: int, n: int = PROBE_PROBLEMS) -> float:
    """Mean probability that the engine samples a correct episode, over `n` fixed held-out
    problems (the model's choices renormalised over what the grammar allows)."""
    rng, problems = random.Random(seed), ProblemStream(seed + PROBE_STREAM, task.lo, task.hi, task.ops)
    episodes = [demonstration(problems.next(), call_id(rng)) for _ in range(n)]
    b = pad([TrainSample(ids=ids, mask=mask, logprobs=[0.0] * len(ids)) for ids, mask in episodes])
    allowed = torch.ones(*b.mask.shape, model.preset.vocab_size, dtype=torch.bool)
    for i, (ids, mask) in enumerate(episodes):
        for t, a in enumerate(demonstration_allowed(ids, mask)):
            if a is not None:  # row t - 1 predicts token t
                allowed[i, t - 1] = False
                allowed[i, t - 1, list(a)] = True
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model.forward_train(
            b.tokens[:, :-1]
        ).double()  # float64: an untrained model's is tiny, not 0
    model.train(was_training)
    lp = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    chosen = lp.gather(-1, b.tokens[:, 1:, None]).squeeze(-1)
    return float((chosen * b.mask).sum(1).exp().mean())


def warm_start(
    learner: Learner,
    ws: WarmStartConfig,
    task: TaskConfig,
    seed: int,
    rank: int = 0,
    world: int = 1,
    on_step: Callable[[int, float], None] | None = None,
) -> WarmStartResult:
    """Supervised steps on seeded demonstrations, this replica training its share of each batch
    (the loss over the batch's global token count, gradients summed by the learner's reducer),
    until the probe reaches `ws.target_success` or `ws.steps` are done."""
    rng, problems = random.Random(seed), ProblemStream(seed + 1, task.lo, task.hi, task.ops)
    out = WarmStartResult()
    for i in range(ws.steps):
        if ws.target_success > 0 and i % ws.probe_every == 0 and i > 0:
            out.probes.append((i, probe_success(learner.model, task, seed)))
            if out.probes[-1][1] >= ws.target_success:
                return out
        batch = [demonstration(problems.next(), call_id(rng)) for _ in range(ws.batch)]
        total = sum(sum(m) for _, m in batch)
        out.losses.append(learner.sft_step(batch[rank::world], total))
        if on_step is not None:
            on_step(i, out.losses[-1])
    if ws.target_success > 0:
        out.probes.append((ws.steps, probe_success(learner.model, task, seed)))
    return out

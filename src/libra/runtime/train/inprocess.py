"""The engine's core in this process, behind the same `ChatClient` protocol as the gateway.

For the in-process learning test and benchmark: the agent loop, the task, the grammar, the
sampler and the model code are exactly the live ones; only HTTP, the gateway and the separate
processes are left out. Requests are parsed, templated and constrained by the engine's own
protocol code (`ChatRequest`, `tool_mode`, `render_chat`), and the engine thread batches every
concurrent trajectory's turn, as the server does.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass

import torch

from libra.core.config import build
from libra.planner.staleness import StalenessGate
from libra.runtime.engine import protocol as p
from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.core import EngineCore
from libra.runtime.engine.model import TinyTransformer, build_model
from libra.runtime.engine.sequence import SamplingParams, SeqEvent, Sequence, TextOutput, ToolOutput
from libra.runtime.engine.tokenizer import render_chat
from libra.runtime.train.agent import AgentEnv, CalcLoop
from libra.runtime.train.chat import RouteSummary, Sampling, SessionInfo, chat_body
from libra.runtime.train.grpo import Clip
from libra.runtime.train.learner import Learner, OptimConfig
from libra.runtime.train.reducer import LocalReducer
from libra.runtime.train.rollout import Rollouts, RolloutShape
from libra.runtime.train.samples import figures, to_samples
from libra.runtime.train.task import ProblemStream, call_id, demonstration
from libra.runtime.train.tools import InProcessTools
from libra.runtime.train.trajectory import Turn


class LocalChat:
    def __init__(self, cfg: EngineConfig, seed: int = 0):
        self.cfg, self.version = cfg, 0
        self.model = build_model(cfg.preset, cfg.seed)
        self.core = EngineCore(cfg, self.model, self._publish)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._seed = seed

    async def __aenter__(self) -> LocalChat:
        self._loop = asyncio.get_running_loop()
        self.core.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.core.stop)

    def load(self, model: TinyTransformer, version: int) -> None:
        """New weights, between batches (no sequence may be running: the engine thread is idle)."""
        if self.core.num_running or self.core.num_waiting:
            raise RuntimeError("weights change only while the engine is idle")
        with torch.no_grad():
            for dst, src in zip(self.model.parameters(), model.parameters(), strict=True):
                dst.copy_(src)
        self.version = version

    def _publish(self, events: list[tuple[object, SeqEvent]]) -> None:
        self._loop.call_soon_threadsafe(_deliver, events)

    async def turn(self, s: SessionInfo, messages: list[dict], tools: list[dict], sampling: Sampling) -> Turn:  # fmt: skip
        req = build(p.ChatRequest, chat_body(self.cfg.served_name, messages, tools, sampling))
        mode = p.tool_mode(req, self.cfg.tool_rounds)
        prompt = render_chat([m.to_template() for m in req.messages], [t.model_dump(exclude_none=True) for t in req.tools or ()])  # fmt: skip
        params = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                                seed=self._seed * 1_000_003 + next(self._ids), logprobs=True)  # fmt: skip
        out = ToolOutput(mode) if mode else TextOutput()
        sink: asyncio.Queue = asyncio.Queue()
        seq = Sequence(f"r{next(self._ids)}", 0, prompt, params, out, sink, self.cfg.preset.max_model_len)
        t0 = time.time()
        self.core.submit([seq])
        state = p.ChoiceState(0)
        while state.finish is None:
            ev = await sink.get()
            if ev.error:
                raise RuntimeError(ev.error)
            state.add(ev)
        ids = seq.tokens[len(prompt) :]
        call = (out.call_id, out.constraint.name, "".join(state.args)) if state.call else None
        return Turn(list(prompt), ids, [lp.logprob for lp in state.logprobs], [self.version] * len(ids),
                    state.finish, "".join(state.text), call, started=t0, ended=time.time())  # fmt: skip

    async def finish(self, s: SessionInfo, final_tokens: int) -> RouteSummary:
        return RouteSummary()


def _deliver(events: list[tuple[asyncio.Queue, SeqEvent]]) -> None:
    for sink, ev in events:
        sink.put_nowait(ev)


# ---- a quick GRPO run in this process -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuickConfig:
    """The in-process loop's knobs (the live run's come from `TrainConfig`)."""

    seed: int = 0
    sft_steps: int = 300
    sft_lr: float = 3e-3
    sft_batch: int = 32
    rl_steps: int = 150
    rl_lr: float = 1e-3
    groups: int = 8
    group_size: int = 8
    max_tokens: int = 48
    lo: int = 10
    hi: int = 99
    ops: str = "+-*"


def warm_start(learner: Learner, cfg: QuickConfig, on_step=None) -> None:
    """Supervised steps on demonstrations of the task (correct episodes, model tokens only)."""
    rng, problems = random.Random(cfg.seed), ProblemStream(cfg.seed + 1, cfg.lo, cfg.hi, cfg.ops)
    for i in range(cfg.sft_steps):
        batch = [demonstration(problems.next(), call_id(rng)) for _ in range(cfg.sft_batch)]
        loss = learner.sft_step(batch, sum(sum(m) for _, m in batch))
        if on_step is not None:
            on_step(i, loss)


async def quick_grpo(cfg: QuickConfig, on_step=None, on_sft=None) -> list[dict]:
    """Warm-start, then `rl_steps` synchronous GRPO steps (staleness 0). Returns per-step figures."""
    ecfg = EngineConfig(kv_cache_mb=64, seed=cfg.seed)
    learner = Learner(ecfg.preset, cfg.seed, OptimConfig(lr=cfg.sft_lr), LocalReducer())
    warm_start(learner, cfg, on_sft)
    learner.reset_optimizer(OptimConfig(lr=cfg.rl_lr))
    out = []
    async with LocalChat(ecfg, cfg.seed) as chat:
        chat.load(learner.model, 0)
        env = AgentEnv(chat, InProcessTools(), Sampling(1.0, 1.0, cfg.max_tokens))
        problems = ProblemStream(cfg.seed + 2, cfg.lo, cfg.hi, cfg.ops)
        ro = Rollouts(RolloutShape(cfg.groups, cfg.group_size), StalenessGate(0), problems, CalcLoop(), env)
        ro.start()
        try:
            for step in range(cfg.rl_steps):
                taken = await ro.take(step)
                samples = to_samples(taken)
                fig = figures(taken, step, samples)
                stats = learner.rl_step(samples, fig.model_tokens, Clip())
                chat.load(learner.model, learner.version)
                ro.mark_trained(step + 1)
                rec = {"step": step, "success": fig.success, "reward": fig.reward, "kl": stats.kl_sum / max(1, stats.tokens), "logprob_diff": stats.logprob_diff_max}  # fmt: skip
                out.append(rec)
                if on_step is not None:
                    on_step(rec)
        finally:
            await ro.stop()
    return out

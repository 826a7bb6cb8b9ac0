"""The engine's core in this process, behind the same `ChatClient` protocol as the gateway.

For the in-process learning test and benchmark: the agent loop, the task, the grammar, the
sampler and the model code are exactly the live ones; only HTTP, the gateway and the separate
processes are left out. Requests are parsed, templated and constrained by the engine's own
protocol code (`ChatRequest`, `tool_mode`, `render_chat`), and the engine thread batches every
concurrent trajectory's turn, as the server does.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from libra.core.config import build
from libra.planner.staleness import StalenessGate
from libra.runtime.engine import protocol as p
from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.core import EngineCore
from libra.runtime.engine.lm import load_lm
from libra.runtime.engine.sequence import (
    HermesOutput,
    SamplingParams,
    SeqEvent,
    Sequence,
    TextOutput,
    ToolOutput,
)
from libra.runtime.train.agent import AgentEnv, make_agent_loop
from libra.runtime.train.chat import RouteSummary, Sampling, SessionInfo, chat_body, sampling_of
from libra.runtime.train.config import TrainConfig
from libra.runtime.train.learner import Learner
from libra.runtime.train.models import train_model
from libra.runtime.train.reducer import LocalReducer
from libra.runtime.train.report import MOVING
from libra.runtime.train.rollout import Rollouts, RolloutShape
from libra.runtime.train.samples import figures, to_samples
from libra.runtime.train.task import ProblemStream, call_id, demonstration
from libra.runtime.train.tools import InProcessTools
from libra.runtime.train.trajectory import Turn
from libra.runtime.train.warmstart import WarmStartResult, probe_success, warm_start
from libra.runtime.train.worker import objective_of, optim_of


class LocalChat:
    def __init__(self, cfg: EngineConfig, seed: int = 0):
        self.cfg, self.version = cfg, 0
        self.model, self.codec = load_lm(cfg)
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

    def load(self, model: torch.nn.Module, version: int) -> None:
        """New weights, between batches (no sequence may be running: the engine thread is idle)."""
        if self.core.num_running or self.core.num_waiting:
            raise RuntimeError("weights change only while the engine is idle")
        with torch.no_grad():
            for dst, src in zip(self.model.parameters(), model.parameters(), strict=True):
                dst.copy_(src)
        self.version = version

    def _turn_seed(self, s: SessionInfo, messages: list[dict]) -> int:
        """The turn's sampling seed (and its call id's), from the run's seed, the trajectory and
        the turn, never from the order in which concurrent turns reach the engine: a seeded run
        samples the same tokens however the asyncio tasks interleave."""
        return self._seed * 1_000_003 + zlib.crc32(f"{s.session_id}/{len(messages)}".encode())

    def _publish(self, events: list[tuple[object, SeqEvent]]) -> None:
        self._loop.call_soon_threadsafe(_deliver, events)

    async def turn(self, s: SessionInfo, messages: list[dict], tools: list[dict], sampling: Sampling) -> Turn:  # fmt: skip
        req = build(p.ChatRequest, chat_body(self.cfg.served_name, messages, tools, sampling))
        prompt = self.codec.chat([m.to_template() for m in req.messages], [t.model_dump(exclude_none=True) for t in req.tools or ()])  # fmt: skip
        seed = self._turn_seed(s, messages)
        params = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k, seed=seed, logprobs=True)  # fmt: skip
        out = self._output(req, call_id(random.Random(seed)))
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
        call = (out.call_id, state.call[1], "".join(state.args)) if state.call else None
        return Turn(list(prompt), ids, [lp.logprob for lp in state.logprobs], [self.version] * len(ids),
                    state.finish, text="".join(state.text), tool_call=call, raw=state.raw, started=t0, ended=time.time(),
                    forced=[lp.forced for lp in state.logprobs])  # fmt: skip

    def _output(self, req: p.ChatRequest, cid: str):
        """As the server decides (`EngineServer._chat_output`): the built-in model's grammar by the
        tool rule, a checkpoint model's own Hermes calls whenever tools are offered."""
        text = TextOutput(codec=self.codec)
        if self.codec.tool_format == "hermes":
            return HermesOutput(text, cid) if req.tools else text
        mode = p.tool_mode(req, self.cfg.tool_rounds)
        return ToolOutput(mode, cid) if mode else text

    async def finish(self, s: SessionInfo, final_tokens: int) -> RouteSummary:
        return RouteSummary()


def _deliver(events: list[tuple[asyncio.Queue, SeqEvent]]) -> None:
    for sink, ev in events:
        sink.put_nowait(ev)


# ---- a quick GRPO run in this process -------------------------------------------------------------


@dataclass(slots=True)
class QuickRun:
    warmstart: WarmStartResult
    steps: list[dict]  # per RL step: step, success, reward, kl, logprob_diff
    probe: float | None = None  # the warm-start's probe on the weights RL left


def warm_learner(cfg: TrainConfig, cache: Path | None = None, on_sft=None) -> tuple[Learner, WarmStartResult]:
    """A learner after `libra train`'s warm-start for `cfg`. With `cache`: loaded from that file if
    it exists (the weights and the warm-start's record, `save_warm`), else run and written there."""
    learner = Learner(
        None, cfg.seed, optim_of(cfg, cfg.warmstart.lr), LocalReducer(), train_model(cfg, cfg.seed)
    )
    if cache is not None and cache.exists():
        saved = torch.load(cache, map_location="cpu", weights_only=True)
        learner.model.load_state_dict({k: v.float() for k, v in saved["model"].items()}, strict=True)
        ws = WarmStartResult(list(saved["losses"]), [tuple(x) for x in saved["probes"]])
    else:
        ws = warm_start(learner, cfg.warmstart, cfg.task, cfg.seed, on_step=on_sft)
        if cache is not None:
            save_warm(learner, ws, cache, warm_digest(cfg))
    learner.reset_optimizer(optim_of(cfg, cfg.trainer.lr))
    return learner, ws


def warm_digest(cfg: TrainConfig) -> str:
    """What a warm-start depends on (seed, model, task, warm-start settings), as 12 hex digits.
    The held-out evaluation's settings are left out: they measure the model, never train it."""
    task = cfg.task.model_dump(exclude={"base_eval", "eval_every"})
    episode = demonstration(ProblemStream.of(cfg.seed, cfg.task).next())[0]  # the template, as trained
    key = {"seed": cfg.seed, "model": cfg.engine.model, "task": task, "ws": cfg.warmstart.model_dump(), "episode": episode}  # fmt: skip
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def save_warm(learner: Learner, ws: WarmStartResult, path: Path, digest: str = "") -> None:
    """The warm-start's weights (float16 halves the file; loading casts back) and its record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    model = {k: v.detach().half() for k, v in learner.model.state_dict().items()}
    torch.save({"model": model, "losses": ws.losses, "probes": [list(p) for p in ws.probes], "digest": digest}, path)  # fmt: skip


async def quick_grpo(cfg: TrainConfig, on_step=None, on_sft=None, warm: Path | None = None, until: float | None = None) -> QuickRun:  # fmt: skip
    """The warm-start (to the probe's target; from the `warm` file when it exists), then
    `cfg.steps` synchronous GRPO steps, with `libra train`'s config, task, agent loop and learner;
    `until`: stop once the 5-step mean success reaches it. Synchronous (staleness 0) because this
    engine takes new weights only while idle; the live run pipelines by `pipeline.staleness`."""
    ecfg = EngineConfig(model=cfg.engine.model, max_model_len=cfg.engine.max_model_len,
                        kv_cache_mb=max(64, cfg.engine.kv_cache_mb), seed=cfg.seed,
                        max_num_seqs=cfg.engine.max_num_seqs, logprobs_mode="processed_logprobs")  # fmt: skip
    learner, ws = warm_learner(cfg, warm, on_sft)
    r, out = cfg.rollout, []
    async with LocalChat(ecfg, cfg.seed) as chat:
        chat.load(learner.model, 0)
        env = AgentEnv(chat, InProcessTools(), sampling_of(r))
        problems = ProblemStream.of(cfg.seed * 1_000_003 + 2, cfg.task)
        ro = Rollouts(
            RolloutShape(r.groups_per_step, r.group_size),
            StalenessGate(0),
            problems,
            make_agent_loop(r.agent_loop),
            env,
        )
        ro.start()
        try:
            for step in range(cfg.steps):
                taken = await ro.take(step)
                samples = to_samples(
                    taken, cfg.trainer.normalize_std, cfg.trainer.negative_weight, sampling_of(r)
                )
                fig = figures(taken, step, samples)
                stats = learner.rl_step(samples, fig.trained_tokens, objective_of(cfg))
                chat.load(learner.model, learner.version)
                ro.mark_trained(step + 1)
                rec = {"step": step, "success": fig.success, "reward": fig.reward, "kl": stats.kl_sum / max(1, stats.tokens),
                       "logprob_diff": stats.logprob_diff_max, "same_version_gap": stats.same_version_gap_max,
                       "trained_tokens": fig.trained_tokens}  # fmt: skip
                out.append(rec)
                if on_step is not None:
                    on_step(rec)
                recent = [x["success"] for x in out[-MOVING:]]
                if until is not None and len(recent) == MOVING and sum(recent) / MOVING >= until:
                    break
        finally:
            await ro.stop()
    return QuickRun(ws, out, probe_success(learner.model, cfg.task, cfg.seed))

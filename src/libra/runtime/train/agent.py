"""The agent loop: one trajectory per call, async, whatever the model, tools and transport.

`AgentLoop` is the extension point (a registry by short name, or `pkg.module:Class`): given a
problem, a chat client and a tool runner, run one episode and leave the trajectory finished with
its reward, or dropped with a reason. The shipped loop, `calc`, is the calculator task's: ask, let
the model call the tool, run the call, let the model answer, score the answer.

The loop never retries a failed model call itself (the gateway already failed over once); a
failure drops the trajectory and the rollout side counts it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

from libra.core.errors import ConfigError
from libra.runtime.train.chat import ChatClient, Sampling, SessionInfo, TurnFailed
from libra.runtime.train.task import TOOL_SCHEMA, Problem, reward
from libra.runtime.train.tools import ToolFailed, ToolRunner
from libra.runtime.train.trajectory import DropReason, Trajectory


@dataclass(frozen=True, slots=True)
class AgentEnv:
    chat: ChatClient
    tools: ToolRunner
    sampling: Sampling
    max_turns: int = 4


class AgentLoop(Protocol):
    async def run(self, problem: Problem, traj: Trajectory, env: AgentEnv) -> None:
        """Run one episode into `traj`: finished with its reward, or dropped with a reason."""


class CalcLoop:
    """Ask; the model calls `calc` (the engine's rule makes the first turn a tool call); the tool
    runs; the model answers in text. Reward: the answer equals the true value."""

    async def run(self, problem: Problem, traj: Trajectory, env: AgentEnv) -> None:
        session = SessionInfo(traj.id, problem.id, traj.batch)
        messages = problem.messages()
        try:
            for _ in range(env.max_turns):
                turn = await env.chat.turn(session, messages, [TOOL_SCHEMA], env.sampling)
                traj.turns.append(turn)
                if turn.tool_call is None:
                    traj.finish(reward(problem, turn.text if turn.finish_reason == "stop" else None))
                    return
                call_id, name, args = turn.tool_call
                result = await env.tools.call(name, args, traj.id)
                traj.tools.append(result)
                messages = [
                    *messages,
                    {
                        "role": "assistant",
                        # A checkpoint model's call goes back as it wrote it, so the next prompt
                        # holds its sampled tokens (the built-in model's is rebuilt from the call).
                        "content": turn.raw,
                        "tool_calls": [
                            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
                        ],
                    },  # fmt: skip
                    {"role": "tool", "tool_call_id": call_id, "content": result.output},
                ]
            traj.finish(0.0)  # out of turns without an answer: a valid episode that earns nothing
        except TurnFailed as e:
            traj.drop(e.reason, e.detail)
        except ToolFailed as e:
            traj.drop(DropReason.TOOL, str(e))
        finally:
            last = traj.turns[-1] if traj.turns else None
            summary = await env.chat.finish(
                session, len(last.prompt_ids) + len(last.token_ids) if last else 0
            )
            traj.migrations, traj.failovers = summary.migrations, summary.failovers


class AnswerLoop:
    """The single-turn form of the task: the question without tools, one answer, scored the same
    way (what TRL's GRPOTrainer runs in `benchmarks/bench_vs_trl.py`)."""

    async def run(self, problem: Problem, traj: Trajectory, env: AgentEnv) -> None:
        session = SessionInfo(traj.id, problem.id, traj.batch)
        try:
            turn = await env.chat.turn(session, problem.messages(), [], env.sampling)
            traj.turns.append(turn)
            traj.finish(reward(problem, turn.text if turn.finish_reason in ("stop", "length") else None))
        except TurnFailed as e:
            traj.drop(e.reason, e.detail)
        finally:
            last = traj.turns[-1] if traj.turns else None
            await env.chat.finish(session, len(last.prompt_ids) + len(last.token_ids) if last else 0)


LOOPS: dict[str, type] = {"calc": CalcLoop, "answer": AnswerLoop}


def make_agent_loop(name: str) -> AgentLoop:
    """A registered loop by name, or `pkg.module:Class` for outside code."""
    if name in LOOPS:
        return LOOPS[name]()
    module, sep, attr = name.partition(":")
    if not sep:
        raise ConfigError("rollout.agent_loop", name, f"one of {sorted(LOOPS)} or pkg.module:Class")
    try:
        return getattr(importlib.import_module(module), attr)()
    except (ImportError, AttributeError) as e:
        raise ConfigError("rollout.agent_loop", name, f"an importable class ({e})") from None

"""Trajectories and tool returns: what a rollout produces and what routers reason about.

A trajectory is a prompt followed by turns. Each turn generates output tokens; every turn but the
last ends in a tool call whose return is appended to the context. This is the unit the simulator
replays, the router routes, and the trace format stores (one trajectory per JSONL line).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class ToolStatus(IntEnum):
    SUCCESS = 0
    FAILURE = 1
    TIMEOUT = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> ToolStatus:
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"tool_status must be one of success, failure, timeout; got {text!r}") from None


@dataclass(slots=True)
class Turn:
    """One model turn, and the tool call that follows it (absent on the final turn)."""

    output_tokens: int
    tool: str | None = None
    tool_return_tokens: int = 0
    tool_status: ToolStatus = ToolStatus.SUCCESS
    tool_latency_s: float | None = None

    @property
    def has_tool(self) -> bool:
        return self.tool is not None


@dataclass(slots=True)
class Trajectory:
    """A whole multi-turn sample. `prompt_id` groups the GRPO samples of one prompt."""

    id: str
    prompt_id: str
    step: int
    prompt_tokens: int
    turns: list[Turn] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        """Final context length: prompt, every output and every tool return."""
        return self.prompt_tokens + sum(t.output_tokens + t.tool_return_tokens for t in self.turns)

    @property
    def generated_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    @property
    def tool_return_tokens(self) -> int:
        return sum(t.tool_return_tokens for t in self.turns)

    @property
    def failures(self) -> int:
        return sum(1 for t in self.turns if t.has_tool and t.tool_status != ToolStatus.SUCCESS)

    def context_before_turn(self, k: int) -> int:
        """Context length when turn k starts generating."""
        return self.prompt_tokens + sum(t.output_tokens + t.tool_return_tokens for t in self.turns[:k])

    def to_dict(self) -> dict:
        turns = []
        for t in self.turns:
            d: dict = {"output_tokens": t.output_tokens}
            if t.has_tool:
                d["tool"] = t.tool
                d["tool_return_tokens"] = t.tool_return_tokens
                d["tool_status"] = t.tool_status.label
                if t.tool_latency_s is not None:
                    d["tool_latency_s"] = round(t.tool_latency_s, 4)
            turns.append(d)
        return {
            "id": self.id,
            "prompt_id": self.prompt_id,
            "step": self.step,
            "prompt_tokens": self.prompt_tokens,
            "turns": turns,
        }

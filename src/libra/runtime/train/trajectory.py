"""What one rollout produces: each turn as the engine saw it, and the trajectory as the trainer
trains it.

Per turn the engine reports the prompt it ran (token ids, as its own template rendered the
conversation), the ids it sampled, their log-probabilities and the weight version of each sampled
token. The trajectory is the last turn's prompt plus its sampled ids; every earlier turn must be
a prefix of it, and the tokens between one turn's sampled ids and the next turn's (the template's
end token, the tool's output, the next role marker) get loss mask 0: the model is trained on
what it sampled, never on tool output. A turn whose prompt does not extend what came before is a
retokenisation bug, and the trajectory is dropped with that reason rather than trained on a
sequence the model never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class TrajState(IntEnum):
    RUNNING = 0
    FINISHED = 1
    DROPPED = 2


@dataclass(slots=True)
class Turn:
    """One model call of a trajectory."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]  # per sampled token
    finish_reason: str
    text: str = ""  # the answer text (a text turn)
    tool_call: tuple[str, str, str] | None = None  # (call id, name, arguments JSON)
    raw: str | None = None  # a checkpoint model's call as it wrote it (the engine's raw_content)
    bucket: str = ""
    instance: str = ""
    started: float = 0.0  # wall clock (time.time) for the timeline
    ended: float = 0.0


@dataclass(slots=True)
class ToolResult:
    output: str
    status: str  # success | failure
    seconds: float


class DropReason:
    """Why a trajectory was not trained (counted per step in steps.json)."""

    ENGINE = "engine_error"  # the gateway answered an error (after its own failover)
    UNREACHABLE = "gateway_unreachable"
    TIMEOUT = "timeout"
    MISMATCH = "token_mismatch"  # a turn's prompt did not extend the previous turn
    TOOL = "tool_error"  # the actions service failed the call (not the tool's own error text)
    GROUP = "group_member_dropped"  # its GRPO group lost a member, so the whole group is dropped


@dataclass(slots=True)
class Trajectory:
    id: str
    problem_id: str
    group: int  # the GRPO group (one prompt, several samples) within its batch
    batch: int
    turns: list[Turn] = field(default_factory=list)
    tools: list[ToolResult] = field(default_factory=list)
    reward: float = 0.0
    state: TrajState = TrajState.RUNNING
    drop_reason: str = ""
    drop_detail: str = ""
    migrations: int = 0
    failovers: int = 0

    def finish(self, reward: float) -> None:
        self._expect_running("finish")
        self.state, self.reward = TrajState.FINISHED, reward

    def drop(self, reason: str, detail: str = "") -> None:
        if self.state == TrajState.DROPPED:
            return
        self.state, self.drop_reason, self.drop_detail = TrajState.DROPPED, reason, detail[:300]

    def _expect_running(self, action: str) -> None:
        if self.state != TrajState.RUNNING:
            raise RuntimeError(f"trajectory {self.id}: {action} from {self.state.name}")

    @property
    def success(self) -> bool:
        return self.reward >= 1.0


@dataclass(slots=True)
class Sequence:
    """A trajectory as the trainer sees it: ids, a loss mask and the behaviour log-probabilities,
    aligned so that position t of `mask`/`logprobs`/`versions` describes token `ids[t]`."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]

    @property
    def n_model_tokens(self) -> int:
        return sum(self.mask)


class TokenMismatch(ValueError):
    """A turn's prompt ids do not start with everything the trajectory held before it."""


def assemble(turns: list[Turn]) -> Sequence:
    """Concatenate turns into one sequence; raises TokenMismatch if a prompt breaks the prefix."""
    if not turns:
        raise TokenMismatch("no turns")
    ids = list(turns[0].prompt_ids)
    mask, lps, vers = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
    for k, t in enumerate(turns):
        if t.prompt_ids[: len(ids)] != ids:
            at = next(
                (i for i, (a, b) in enumerate(zip(ids, t.prompt_ids, strict=False)) if a != b),
                len(t.prompt_ids),
            )
            raise TokenMismatch(f"turn {k}'s prompt differs from the trajectory at token {at}")
        gap = t.prompt_ids[len(ids) :]
        if len(t.logprobs) != len(t.token_ids) or len(t.weight_versions) != len(t.token_ids):
            raise TokenMismatch(f"turn {k}: {len(t.token_ids)} ids, {len(t.logprobs)} logprobs, {len(t.weight_versions)} versions")  # fmt: skip
        ids += gap + t.token_ids
        mask += [0] * len(gap) + [1] * len(t.token_ids)
        lps += [0.0] * len(gap) + list(t.logprobs)
        vers += [-1] * len(gap) + list(t.weight_versions)
    return Sequence(ids, mask, lps, vers)

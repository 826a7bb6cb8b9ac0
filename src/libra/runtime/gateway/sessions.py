"""Sessions: each trajectory's turns, path, context estimate and current instance.

A session is one trajectory as the router knows it (`RouteRequest.traj_id`). Every chat request of
a session is one turn: the tracker turns the conversation into a `RouteRequest` (turn index, path,
context, generated tokens, where the session is now), records the router's decision, and when the
session ends hands the router a `FinishedTrajectory` — the same feedback the simulator gives.

Token counts come from the backends when they report them: `usage.prompt_tokens` anchors the
context, and tokens added since are estimated at 4 characters each (the ratio the tool-state size
classes use). Without any usage yet, the whole conversation is estimated that way. Completion
tokens come from `usage` too, or from the assistant text at the next turn when a turn reported
none (a stream without `include_usage`).

A session ends when the client calls `POST /sessions/{id}/finish`, when it has been idle for
`idle_timeout_s`, or when the tracker is full and it is the least recently seen.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum

from libra.core.errors import LibraError
from libra.core.trace import MAX_TOKENS
from libra.rollout.base import FinishedTrajectory, RouteDecision, RouteRequest
from libra.rollout.tool_state import CHARS_PER_TOKEN, SizeThresholds
from libra.rollout.tree import state_key
from libra.runtime.gateway.config import SessionConfig
from libra.runtime.gateway.conversation import Scan, prompt_id_of, scan_messages


class SessionState(IntEnum):
    ACTIVE = 0
    FINISHED = 1


class SessionError(LibraError):
    """A session operation the session's state does not allow (HTTP 404/409)."""


def tokens_of_chars(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN)


@dataclass(slots=True)
class TurnRecord:
    """One routed turn: the router's inputs that vary per turn, and its decision."""

    path_len: int
    context: int
    generated: int
    bucket: int
    instance: str
    migrated: bool
    method: int
    failover_to: str | None = None

    def as_dict(self) -> dict:
        return {
            "path_len": self.path_len,
            "context_tokens": self.context,
            "generated_tokens": self.generated,
            "bucket": self.bucket,
            "instance": self.instance,
            "migrated": self.migrated,
            "method": self.method,
            "failover_to": self.failover_to,
        }


@dataclass(slots=True)
class Session:
    id: str
    prompt_id: str | None
    step: int
    last_seen: float
    scan: Scan = field(default_factory=Scan)
    turns: list[TurnRecord] = field(default_factory=list)
    instance: str | None = None
    bucket: int | None = None
    target: int | None = None  # the router's chosen bucket at the last turn (RouteDecision.target)
    prompt_tokens: int = 0
    generated: int = 0
    # The last backend-reported prompt size, and the conversation's characters at that request.
    anchor_tokens: int | None = None
    anchor_chars: int = 0
    last_final: int = 0
    last_metered: bool = False
    assistant_chars_seen: int = 0
    failed_on: str | None = None  # the instance that failed mid-response on its last turn
    state: SessionState = SessionState.ACTIVE

    def finish(self) -> None:
        if self.state != SessionState.ACTIVE:
            raise SessionError(f"session {self.id!r} is already finished")
        self.state = SessionState.FINISHED

    def context_estimate(self) -> int:
        """At least 1: every request holds some tokens (the chat template's, at the least)."""
        if self.anchor_tokens is None:
            return max(1, tokens_of_chars(self.scan.chars))
        return max(1, self.anchor_tokens + tokens_of_chars(max(0, self.scan.chars - self.anchor_chars)))

    def aligned_contexts(self) -> tuple[int, ...]:
        """Context at the start of the turn that followed each tool return (index = returns so far).

        A turn after two tool returns at once (parallel calls) stands for both depths, so the list
        always has one entry per depth from 0 to the path's length, as the causal tree expects.
        """
        out: list[int] = []
        for t in self.turns:
            while len(out) <= t.path_len:
                out.append(t.context)
        return tuple(out)

    def describe(self) -> dict:
        return {
            "id": self.id,
            "prompt_id": self.prompt_id,
            "step": self.step,
            "state": self.state.name.lower(),
            "instance": self.instance,
            "bucket": self.bucket,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated,
            "context_tokens": self.context_estimate(),
            "path": [state_key(s) for s in self.scan.path],
            "turns": [t.as_dict() for t in self.turns],
        }


class SessionTracker:
    """Active sessions in least-recently-seen order (so idle expiry and the cap are O(expired))."""

    def __init__(self, cfg: SessionConfig, thresholds: SizeThresholds, clock=time.monotonic):
        self.cfg, self.thresholds, self.clock = cfg, thresholds, clock
        self.sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, sid: str) -> Session | None:
        return self.sessions.get(sid)

    def open(self, sid: str | None, prompt_id: str | None, step: int) -> Session:
        """The active session `sid` (seen now), or a new one. `sid=None`: a one-turn session."""
        now = self.clock()
        if sid is None:
            return Session("", prompt_id, step, now)
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = Session(sid, prompt_id, step, now)
        else:
            self.sessions.move_to_end(sid)
            s.last_seen = now
        return s

    def begin_turn(self, s: Session, messages: list | None, chars: int = 0, tokens: int | None = None, key: str = "") -> RouteRequest:  # fmt: skip
        """The router's view of this turn. `messages` is None for a prompt (/v1/completions,
        /generate): then `chars` is its size in characters, or `tokens` in tokens when it came as
        token ids (exact, so it anchors the context as a backend's usage would), and `key` what
        identifies its prompt group."""
        if messages is not None:
            s.scan = scan_messages(s.scan, messages, self.thresholds)
        else:
            s.scan.chars = chars
            if tokens is not None:
                s.anchor_tokens, s.anchor_chars = min(tokens, MAX_TOKENS), chars
        self._count_unmetered_output(s)
        ctx = s.context_estimate()
        if not s.turns:
            s.prompt_tokens = ctx
        if s.prompt_id is None:
            s.prompt_id = prompt_id_of(s.scan.first_user if messages is not None else key)
        return RouteRequest(s.id, s.prompt_id, s.step, len(s.turns), s.prompt_tokens, ctx, s.generated,
                            tuple(s.scan.path), s.bucket, s.instance, target_bucket=s.target)  # fmt: skip

    def _count_unmetered_output(self, s: Session) -> None:
        # The assistant text added since the last turn is that turn's output; count it only when
        # the backend did not report the turn's completion tokens.
        added = s.scan.assistant_chars - s.assistant_chars_seen
        if s.turns and not s.last_metered and added > 0:
            s.generated += tokens_of_chars(added)
        s.assistant_chars_seen = s.scan.assistant_chars
        s.last_metered = False

    def routed(self, s: Session, req: RouteRequest, dec: RouteDecision) -> TurnRecord:
        migrated = s.instance is not None and dec.instance != s.instance
        rec = TurnRecord(len(req.path), req.context_tokens, req.generated_tokens, dec.bucket, dec.instance,
                         migrated, int(dec.method))  # fmt: skip
        s.instance, s.bucket, s.target = dec.instance, dec.bucket, dec.target
        s.last_final = max(s.last_final, req.context_tokens)
        if s.id:
            s.turns.append(rec)
        return rec

    def moved(self, s: Session, rec: TurnRecord, instance: str, bucket: int) -> None:
        """The turn was carried out on another instance than decided (the first one failed)."""
        rec.failover_to = instance
        s.instance, s.bucket = instance, bucket

    def metered(self, s: Session, usage: dict) -> None:
        """A backend's `usage` for this session's latest turn."""
        # A count outside 0..MAX_TOKENS is a backend's bug; taken as given, it reached the router's
        # features and overflowed a float for every later turn of the prompt's group.
        prompt, completion = (token_count(usage.get(k)) for k in ("prompt_tokens", "completion_tokens"))
        if prompt is not None:
            s.anchor_tokens, s.anchor_chars = prompt, s.scan.chars
            s.last_final = max(s.last_final, prompt)
        if completion is not None:
            s.generated = min(s.generated + completion, MAX_TOKENS)
            s.last_metered = True
            if prompt is not None:
                s.last_final = max(s.last_final, prompt + completion)

    def finish(self, sid: str, final_tokens: int | None = None) -> tuple[Session, FinishedTrajectory]:
        s = self.sessions.get(sid)
        if s is None:
            raise SessionError(f"no active session {sid!r}")
        return self._end(s, final_tokens)

    def _end(self, s: Session, final_tokens: int | None) -> tuple[Session, FinishedTrajectory]:
        s.finish()
        self.sessions.pop(s.id, None)
        contexts = s.aligned_contexts()
        # A trajectory never shrinks: its final length is at least every context it had.
        final = max(final_tokens if final_tokens is not None else s.last_final, max(contexts, default=1), 1)
        path = tuple(s.scan.path)[: max(0, len(contexts) - 1)]
        return s, FinishedTrajectory(s.id, s.prompt_id or "", s.step, path, contexts, int(final))

    def expire(self) -> list[tuple[str, FinishedTrajectory]]:
        """End sessions idle for longer than the timeout (reason `idle`), and the least recently
        seen ones beyond the cap (`evicted`). Returns (reason, trajectory) for each."""
        now, out = self.clock(), []
        while self.sessions:
            s = next(iter(self.sessions.values()))
            if now - s.last_seen >= self.cfg.idle_timeout_s:
                reason = "idle"
            elif len(self.sessions) > self.cfg.max_sessions:
                reason = "evicted"
            else:
                break
            out.append((reason, self._end(s, None)[1]))
        return out


def token_count(value: object) -> int | None:
    """`value` as a token count (an int from 0 to MAX_TOKENS), or None when it is not one (a bool,
    a float, 10^30): for a backend's usage and a client's final_tokens alike."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS
    return value if ok else None

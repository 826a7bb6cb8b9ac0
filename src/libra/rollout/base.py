"""The router interface shared by the simulator and the live gateway.

A router is called at the start of every turn of a trajectory (its first turn, and after every
tool return). It sees a `RouteRequest` (what is known about the trajectory now) and a list of
`InstanceView`s (the engines and their load), and returns a `RouteDecision`. It never touches a
clock, I/O, threads or HTTP: the simulator and the gateway build the snapshots and carry out the
decision, so the very same object runs in both.

Buckets are ordered by `max_context`; bucket 0 is the smallest. Every trajectory starts there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol, runtime_checkable

from libra.core.errors import LibraError

# An instance whose KV cache is this full takes no new work while another instance has room.
KV_SATURATED = 0.9


class PayloadSize(IntEnum):
    SMALL = 0
    MEDIUM = 1
    LARGE = 2


class Status(IntEnum):
    SUCCESS = 0
    FAILURE = 1
    TIMEOUT = 2


@dataclass(frozen=True, slots=True)
class ToolState:
    """What a tool return tells the router: the tool's type, the payload size class, the status."""

    tool: str
    size: PayloadSize
    status: Status


@dataclass(frozen=True, slots=True)
class Bucket:
    name: str
    tp: int
    max_context: int


@dataclass(slots=True)
class InstanceView:
    """One engine instance as a router sees it."""

    id: str
    bucket: int
    tp: int
    outstanding: int = 0
    cap: int = 256
    healthy: bool = True
    node: int = 0
    # Fraction of the instance's KV cache in use (0 when the mechanism does not report it). The
    # request cap alone cannot see that a small-TP engine is full of long contexts.
    kv_usage: float = 0.0

    @property
    def saturated(self) -> bool:
        return not self.healthy or self.outstanding >= self.cap or self.kv_usage >= KV_SATURATED


class MigrationMethod(IntEnum):
    NONE = 0
    KV_TRANSFER = 1
    REPREFILL = 2


@dataclass(slots=True)
class RouteRequest:
    """What is known about a trajectory at the start of a turn.

    `true_final_tokens` is filled only by the simulator and read only by the oracle baseline.

    `current_bucket` is where the trajectory ran its last turn; `target_bucket` is the bucket the
    router chose for it then (`RouteDecision.target`). They differ after a spill-over: the target
    bucket was full and a larger one took the trajectory. A router reasons from `level`, its own
    last choice, so a spill is not mistaken for a decision (see `placement.choose_instance`).
    Callers that do not carry the target leave it None, and `level` is the current bucket.
    """

    traj_id: str
    prompt_id: str
    step: int
    turn: int
    prompt_tokens: int
    context_tokens: int
    generated_tokens: int
    path: tuple[ToolState, ...] = ()
    current_bucket: int | None = None
    current_instance: str | None = None
    true_final_tokens: int | None = None
    target_bucket: int | None = None
    # True when asked while the trajectory waits on a tool (its next turn's context is not known
    # yet): a mechanism that moves KV during tool calls (Heddle) places the next turn early.
    in_tool: bool = False

    @property
    def level(self) -> int | None:
        """The bucket the router last chose for this trajectory (None on its first turn)."""
        return self.current_bucket if self.target_bucket is None else self.target_bucket


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """`bucket` is where the trajectory runs; `target` the bucket the router chose (None for the
    length-blind routers). They differ when the turn spilled over: the target was full, or (with
    `spill: cost` or `balance`) a larger bucket was cheaper."""

    bucket: int
    instance: str
    migrate: bool = False
    method: MigrationMethod = MigrationMethod.NONE
    predicted_final_tokens: float | None = None
    target: int | None = None
    # Where the turn waits in its engine's queue: lower is admitted first; None is FCFS (a
    # scheduler that ranks requests, e.g. longest predicted remaining first, sets it).
    priority: float | None = None

    @property
    def chosen(self) -> int:
        """The bucket this decision is scored on: the router's choice, or where it placed the turn."""
        return self.bucket if self.target is None else self.target


@dataclass(slots=True)
class FinishedTrajectory:
    """Feedback when a trajectory ends: its path and the context length at each turn start."""

    traj_id: str
    prompt_id: str
    step: int
    path: tuple[ToolState, ...]
    turn_contexts: tuple[int, ...]
    final_tokens: int
    meta: dict = field(default_factory=dict)


@runtime_checkable
class MigrationCoster(Protocol):
    """Prices the two ways of moving a trajectory's context to another instance."""

    def costs(
        self, src_bucket: int, dst_bucket: int, context_tokens: int, inter_node: bool
    ) -> tuple[float, float]:
        """(kv_transfer_s, reprefill_s) for `context_tokens` moving from src to dst bucket."""
        ...


@runtime_checkable
class TurnPricer(Protocol):
    """Prices running a turn on an instance: what `spill: cost` compares (placement.py)."""

    def turn_price(self, bucket: int, running: int, context_tokens: int) -> float:
        """Seconds of token time a turn of `context_tokens` adds on a `bucket` instance running
        `running` turns."""
        ...


@runtime_checkable
class Router(Protocol):
    """Every routing policy implements this. Registered by short name in `libra.rollout.registry`."""

    name: str

    def route(self, req: RouteRequest, instances: Sequence[InstanceView]) -> RouteDecision: ...

    def on_finish(self, traj: FinishedTrajectory) -> None: ...

    def on_step_end(self, step: int) -> None: ...

    def retune(self, buckets: Sequence[Bucket]) -> None: ...


class NoInstanceError(LibraError):
    """`route` was given no healthy instance at all, so there is nowhere to send the request.

    The caller keeps the request (queues it and retries when an instance is healthy again): a
    router never drops a request and never names an unhealthy or absent instance.
    """


def bucket_for_length(buckets: Sequence[Bucket], tokens: float) -> int:
    """The smallest bucket whose max_context holds `tokens` (the largest if none does)."""
    for i, b in enumerate(buckets):
        if tokens <= b.max_context:
            return i
    return len(buckets) - 1

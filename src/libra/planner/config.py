"""Typed configuration of the planner, the elastic pool and the parallelism selector.

These are the knobs a scenario's `planner:` / `elastic:` / `selector:` mappings (and `--set`) reach.
They are validated when built, so a bad value is one line naming the field and what is allowed,
never a crash deep inside a search. Defaults are the published values where the papers give them
(5% apply threshold, the [0.8, 1.25] balance band, 1.15 / 0.90 hysteresis, 10.8 s and 3.6 + 4.4 s
transition costs) and a written-down engineering choice elsewhere.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def _powers_of_two(values: list[int], field: str) -> list[int]:
    bad = [v for v in values if v < 1 or v & (v - 1)]
    if bad:
        raise ValueError(f"{field} must be powers of two (TP/CP groups are packed buddy-fashion into nodes)")
    return sorted(set(values))


class PlannerConfig(BaseModel):
    """The global planner: search space, pruning, and when to apply a new plan."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    # Rollout side. 32 quantile bins resolve the tail to ~3% of the batch (the longest 10% of R2E
    # trajectories take over half of rollout time, so the tail needs several bins), while the DP
    # stays at 32^2/2 ranges per GPU budget.
    bins: int = Field(32, ge=1, le=512, description="Quantile bins of recent lengths for the rollout DP")
    rollout_tp: list[int] = Field([1, 2, 4, 8], min_length=1, description="TP degrees a bucket may use")
    # A bucket is a routing target chosen by *predicted* length. Predictions (C-MLFQ's tree) are good
    # to a P90 over many trajectories, not to single ones, so a bucket narrower than ~10% of the batch
    # could not be routed to reliably; it would only fit the estimate to this sample's outliers.
    min_bucket_fraction: float = Field(0.1, ge=0, lt=1, description="Least share of the batch per bucket")
    # Adjacent buckets' max contexts at least this far apart (the paper's layout: 4K / 12K / 40K).
    # Routers predict a final length to within a spread, so closer boundaries only make them
    # migrate between buckets they cannot tell apart. 1 turns the rule off.
    min_bucket_ratio: float = Field(
        2.0, ge=1, description="Least ratio of a bucket's max context to the previous one's"
    )
    # A bucket must hold this many sequences at its max context at once; fewer would serialise the
    # tail and make the bucket's latency floor meaningless.
    min_concurrent: int = Field(4, ge=1, description="Sequences at max context a bucket's KV must hold")
    # The rollout estimate's tail: once the bulk of a bucket's work is done, stragglers run with this
    # fraction of the full batch. Calibrated against the simulator's steady-state steps, where the
    # next batch keeps the engines about half full (docs/planner.md, "Measured figures").
    tail_fraction: float = Field(0.5, gt=0, le=1)
    # The share of the KV cache a bucket's trajectories per engine may fill, each charged its final
    # context. Past it engines preempt and recompute, and the estimate grows with the fourth power
    # of the overload (see rollout_dp.EngineTables.range_cost).
    kv_headroom: float = Field(0.75, gt=0, le=1)
    # Keep the DP table across the splits of one search and across searches on the same stats.
    # Off only to measure what memoisation buys (benchmarks/bench_planner.py).
    memoise: bool = True
    # Training side.
    train_tp: list[int] = Field([1, 2, 4, 8], min_length=1)
    max_cp: int = Field(8, ge=1, description="Largest context-parallel degree (used only when needed)")
    max_pp: int = Field(16, ge=1)
    micro_batches: list[int] = Field([1, 2, 4, 8], min_length=1)
    max_bubble_fraction: float = Field(
        0.4, gt=0, le=1, description="Prune configs whose 1F1B bubble is larger"
    )
    max_comm_fraction: float = Field(0.5, gt=0, le=1, description="Prune configs spending more on comm")
    # Large batches: rank candidates on a quantile sample, estimate only the best few exactly.
    rank_sample: int = Field(1024, ge=16, description="Sequences in the ranking sample of large batches")
    exact_per_count: int = Field(3, ge=1, description="Candidates per GPU count estimated on the full batch")
    # A split by length must predict a step shorter than the best single bucket's by more than the
    # estimate's error on that comparison: it cannot see what a split costs the shared pool, and on
    # Search-R1 a split it preferred ran at 0.993x one bucket even with oracle routing (planner.md).
    split_margin: float = Field(
        0.10, ge=0, lt=1, description="Least predicted gain of a bucket split over one bucket"
    )
    # Applying a plan.
    min_gain: float = Field(0.05, ge=0, lt=1, description="Least relative step-time gain worth a switch")
    interval_steps: int = Field(10, ge=1, description="Re-plan every K steps (also the gain horizon)")
    # Pressure triggers.
    ratio_low: float = Field(0.8, gt=0, description="Re-plan when T_rollout / T_train drops below")
    ratio_high: float = Field(1.25, gt=0, description="Re-plan when T_rollout / T_train rises above")
    queue_pressure: float = Field(0.9, gt=0, le=1, description="Re-plan when the rollout queue is this full")
    stale_backlog: float = Field(0.5, gt=0, description="Re-plan when stale samples exceed this x batch")
    trigger_cooldown_steps: int = Field(2, ge=0, description="Least steps between two pressure triggers")
    # Elastic pool size: the fraction of rollout GPUs kept as whole-DP-replica hybrid workers.
    hybrid_fraction: float = Field(0.25, ge=0, le=1)
    # The `greedy` baseline: GPUs moved toward the slower stage after each step (0: one node).
    shift_gpus: int = Field(0, ge=0)

    @field_validator("rollout_tp", "train_tp", "micro_batches")
    @classmethod
    def _pow2(cls, v: list[int], info) -> list[int]:
        return _powers_of_two(v, info.field_name)

    @model_validator(mode="after")
    def _band(self) -> PlannerConfig:
        if not self.ratio_low < 1 < self.ratio_high:
            raise ValueError(f"need ratio_low < 1 < ratio_high, got {self.ratio_low} and {self.ratio_high}")
        return self

    def bucket_shape(self, bins: int) -> tuple[int, float]:
        """(least bins per bucket, least ratio between adjacent max contexts) for `bins` bins."""
        return max(1, int(self.min_bucket_fraction * bins)), self.min_bucket_ratio


class ElasticConfig(BaseModel):
    """The hybrid pool's hysteresis controller and the published transition costs."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    borrow_ratio: float = Field(1.15, gt=1, description="Borrow replicas when T_train/T_rollout >= this")
    release_ratio: float = Field(0.90, gt=0, lt=1, description="Release them when T_train/T_rollout <= this")
    high_pressure: float = Field(0.8, gt=0, le=1, description="Never borrow at this rollout pressure or more")
    # Published (Libra): training -> rollout ~10.8 s, mostly restarting the inference engine;
    # rollout -> training ~8 s = 3.6 s weight/optimizer snapshot fetch + 4.4 s restore.
    train_to_rollout_s: float = Field(10.8, ge=0)
    snapshot_s: float = Field(3.6, ge=0)
    restore_s: float = Field(4.4, ge=0)
    require_even_groups: bool = Field(True, description="Keep GRPO groups dividing evenly over DP")
    # A fixed timeline instead of the hysteresis rule: {step: how many hybrid replicas training
    # holds from that step on}. For a scripted run: the mechanism's whole cycle on a known
    # timeline, whatever the stages measure (how the live tests drive the pool deterministically).
    schedule: dict[int, int] | None = None

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, v: dict[int, int] | None) -> dict[int, int] | None:
        if v is not None and any(step < 0 or n < 0 for step, n in v.items()):
            raise ValueError(f"steps and replica counts must be >= 0, got {v}")
        return v

    def scheduled(self, step: int) -> int | None:
        """The replicas the schedule holds at `step` (None without a schedule: hysteresis)."""
        if self.schedule is None:
            return None
        return next((self.schedule[s] for s in sorted(self.schedule, reverse=True) if s <= step), 0)

    @property
    def rollout_to_train_s(self) -> float:
        return self.snapshot_s + self.restore_s


class SelectorConfig(BaseModel):
    """EARL's parallelism selector: context ranges and how eagerly to switch down."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    # Range upper edges. Contexts past the last edge get the next power of two, so a context never
    # goes without a range (and is never truncated for lack of one).
    edges: list[int] = Field([4096, 8192, 16384, 32768, 65536, 131072], min_length=1)
    # Growth switches at once (the next step must fit); shrinking waits this many steps in a
    # lower range, so one short step does not bounce the configuration.
    down_patience: int = Field(3, ge=1)

    @field_validator("edges")
    @classmethod
    def _sorted(cls, v: list[int]) -> list[int]:
        if any(e < 1 for e in v):
            raise ValueError("edges must be positive token counts")
        return sorted(set(v))

"""Instance choice inside a bucket, and the migration method: shared by every router.

A router's own logic only picks a *bucket*. Turning that into an instance is the same for all of
them, and it is where the safety rules live, so it is written once here:

- never an unhealthy instance, never one that is not in the list given;
- a request is never dropped: if every instance is saturated, the least loaded healthy one takes it
  (the engine queues it), and with no healthy instance at all `NoInstanceError` tells the caller
  to keep the request and retry;
- a bucket must hold the context: an instance's engine is started with max_model_len equal to its
  bucket's max_context, so buckets below `bucket_for_length(context)` are never chosen while a
  feasible one is healthy;
- a trajectory is not moved for load alone: its current instance holds its prefix, so it stays
  there while that is healthy and where its router wants it, spill-over included (`_keeps`);
- with a `price` (the routers' `spill: cost`, their default, or `spill: balance`), a turn may also
  run in a larger bucket than the router chose when it is cheaper there (`_balanced_up`): a larger
  bucket holds any context a smaller one does, and an engine with spare room decodes each token
  sooner at a larger TP. `cost` prices an instance by the token time the turn adds there
  (`CostModelCoster.turn_price`), `balance` by its load per GPU (`per_gpu_load`); `cost` without a
  cost model is `balance`. Without a price a turn runs above its bucket only when it is full.

The migration method (move the KV cache or re-prefill) is priced by a `MigrationCoster`; without
one the router assumes KV transfer, which the published measurements show is the cheaper method
at every context length that matters (< 330 ms at 40K tokens in a node, against seconds of
re-prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from libra.costmodel.rollout import RolloutCostModel
from libra.rollout.base import InstanceView, MigrationCoster, MigrationMethod, NoInstanceError


class CostModelCoster:
    """A `MigrationCoster` from the rollout cost model of each bucket's instances.

    KV transfer is priced on the target's model: its TP degree sets how many links the resharded
    heads arrive over. Re-prefill is the target's chunked prefill of the whole context.
    """

    __slots__ = ("models", "_cache", "_coeffs")

    def __init__(self, models_per_bucket: Sequence[RolloutCostModel]):
        if not models_per_bucket:
            raise ValueError("CostModelCoster needs one RolloutCostModel per bucket")
        self.models = list(models_per_bucket)
        self._cache: dict[tuple[int, int, bool], tuple[float, float]] = {}
        self._coeffs: dict[tuple[int, int], tuple[float, float]] = {}

    def costs(
        self, src_bucket: int, dst_bucket: int, context_tokens: int, inter_node: bool
    ) -> tuple[float, float]:
        dst = min(max(dst_bucket, 0), len(self.models) - 1)
        # Prefill time is a loop over chunks; round the context so repeated queries hit the cache.
        tokens = max(1, -(-int(context_tokens) // 64) * 64)
        key = (dst, tokens, inter_node)
        hit = self._cache.get(key)
        if hit is None:
            model = self.models[dst]
            hit = (model.kv_transfer_time(tokens, inter_node), model.prefill_time(tokens))
            if len(self._cache) > 65536:
                self._cache.clear()
            self._cache[key] = hit
        return hit

    def turn_price(self, bucket: int, running: int, context_tokens: int) -> float:
        """Seconds of token time a turn of `context_tokens` adds on an instance of `bucket` that
        already runs `running` turns: its own decode step there, plus the delay its step adds to
        each of the others (they are taken to be as long as this one; the view has no contexts).

        Decode steps cost A(n) + B * context sum (`RolloutCostModel.decode_coeffs`). Summed over
        the turns, this is the growth of their total time per token, so placing each turn where it
        is least is the greedy rule for the least total turn time.
        """
        dst = min(max(bucket, 0), len(self.models) - 1)
        a0, _ = self._decode(dst, running)
        a1, b = self._decode(dst, running + 1)
        after = a1 + b * (running + 1) * context_tokens
        before = a0 + b * running * context_tokens if running else 0.0
        return after + running * (after - before)

    def _decode(self, bucket: int, n: int) -> tuple[float, float]:
        key = (bucket, n)
        hit = self._coeffs.get(key)
        if hit is None:
            hit = self.models[bucket].decode_coeffs(n)
            if len(self._coeffs) > 65536:
                self._coeffs.clear()
            self._coeffs[key] = hit
        return hit


def healthy_exists(instances: Sequence[InstanceView]) -> bool:
    return any(i.healthy for i in instances)


def per_gpu_load(inst: InstanceView) -> float:
    """`spill: balance`'s price: outstanding requests per GPU."""
    return inst.outstanding / max(1, inst.tp)


def _bucket_order(target: int, floor: int, n_buckets: int) -> list[int]:
    """The target first, then neighbours by distance (the larger one first), never below floor."""
    order = [target]
    for d in range(1, n_buckets):
        for b in (target + d, target - d):
            if floor <= b < n_buckets:
                order.append(b)
    return order


def choose_instance(
    instances: Sequence[InstanceView],
    target: int,
    floor: int,
    n_buckets: int,
    current: str | None,
    level: int | None = None,
    price: Callable[[InstanceView], float] | None = None,
) -> InstanceView:
    """The instance for a trajectory whose router chose bucket `target` (see the module doc).

    `level` is the bucket the router chose at the trajectory's last turn (None: not known). The
    current instance holds the trajectory's prefix, so it is kept, whatever its load, while it is
    healthy, holds the context, and is where the router wants it (`_keeps`). Otherwise: inside a
    bucket, the instance with the fewest outstanding requests among those not saturated (request
    cap or KV cache), ties to the earliest in the list; the target bucket first, then its
    neighbours. When a neighbour is the bucket the trajectory already sits in, it stays on its
    own instance: a move inside a bucket gains nothing. With a `price`, the target and the larger
    buckets first compete on it (`_balanced_up`).
    """
    best: dict[int, InstanceView] = {}
    here: InstanceView | None = None
    for inst in instances:
        if inst.id == current and inst.healthy and inst.bucket >= floor:
            if _keeps(inst.bucket, target, level):
                return inst
            here = inst
        if inst.saturated:
            continue
        b = best.get(inst.bucket)
        if b is None or inst.outstanding < b.outstanding:
            best[inst.bucket] = inst
    if price is not None:
        pick = _balanced_up(best, here, target, n_buckets, price)
        if pick is not None:
            return pick
    for k in _bucket_order(target, floor, n_buckets):
        if here is not None and here.bucket == k:
            return here
        if k in best:
            return best[k]
    return least_loaded(instances, floor)


def _balanced_up(
    best: dict[int, InstanceView],
    here: InstanceView | None,
    target: int,
    n_buckets: int,
    price: Callable[[InstanceView], float],
) -> InstanceView | None:
    """The instance of the target bucket or a larger one with the lowest `price`; ties go to the
    smaller bucket, so the router's choice stands unless a larger bucket is cheaper.

    Each bucket offers the instance the plain rule would take in it, except the bucket the
    trajectory sits in, which offers its own instance (no move inside a bucket). Saturated
    instances do not compete; None when none is left, and the plain order decides.
    """
    pick: InstanceView | None = None
    pick_load = 0.0
    for k in range(target, n_buckets):
        inst = here if here is not None and here.bucket == k else best.get(k)
        if inst is None or inst.saturated:
            continue
        load = price(inst)
        if pick is None or load < pick_load:
            pick, pick_load = inst, load
    return pick


def _keeps(bucket: int, target: int, level: int | None) -> bool:
    """Whether a trajectory in `bucket` stays there when the router now chooses `target`.

    In the target bucket, yes. In a larger one, only if it got there by spill-over (the target
    was full), not against the router's will: the router's choice did not go down since the last
    turn (`level`). Moving back would pay a migration for a bucket that was full a moment ago.
    One spilled *down* moves up to its bucket once there is room there: staying would only defer
    a forced move to a larger context (measured: search-r1 lost 2% of its rollout throughput).
    """
    if bucket == target:
        return True
    return level is not None and level <= target < bucket


def least_loaded(instances: Sequence[InstanceView], floor: int = 0, per_gpu: bool = False) -> InstanceView:
    """The least loaded healthy instance, from a feasible bucket when one is healthy.

    Load is outstanding / cap, or with `per_gpu` outstanding / TP (a TP4 engine serves about four
    times the requests of a TP1 one; the request cap is usually the same for both).
    """
    pick: InstanceView | None = None
    for inst in instances:
        if not inst.healthy:
            continue
        if pick is None or _load_key(inst, floor, per_gpu) < _load_key(pick, floor, per_gpu):
            pick = inst
    if pick is None:
        raise NoInstanceError("no healthy instance to route to; keep the request and retry")
    return pick


def _load_key(inst: InstanceView, floor: int, per_gpu: bool) -> tuple[bool, bool, float]:
    load = inst.outstanding / max(1, inst.tp if per_gpu else inst.cap)
    return (inst.bucket < floor, inst.saturated, load)


def migration_method(
    coster: MigrationCoster | None,
    instances: Sequence[InstanceView],
    src_id: str | None,
    dst: InstanceView,
    context_tokens: int,
) -> MigrationMethod:
    """How to move a trajectory from its current instance to `dst`: NONE when it stays.

    Re-prefill when the source is gone or unhealthy (its KV cache cannot be read); otherwise the
    cheaper method by the coster, or KV transfer when no coster is given.
    """
    if src_id is None or src_id == dst.id:
        return MigrationMethod.NONE
    src = next((i for i in instances if i.id == src_id), None)
    if src is None or not src.healthy:
        return MigrationMethod.REPREFILL
    if coster is None:
        return MigrationMethod.KV_TRANSFER
    kv_s, prefill_s = coster.costs(src.bucket, dst.bucket, context_tokens, src.node != dst.node)
    return MigrationMethod.KV_TRANSFER if kv_s <= prefill_s else MigrationMethod.REPREFILL

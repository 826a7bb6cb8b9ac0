"""The elastic hybrid pool, carried out on the simulated clock.

The policy (`libra.planner.elastic`) decides when whole DP replicas borrow rollout GPUs and when
they give them back; this mechanism drives each replica's join state machine:

- join: the replica's engines stop taking new turns (their running turns finish), then the
  replica fetches the weight/optimizer snapshot (FETCHING_STATE, `snapshot_s`), restores and
  sends zero gradients (ZERO_SYNC, `restore_s`), passes the activation handshake (ACTIVATING, no
  modelled time) and is ACTIVE from the next training step on.
  Training never waits for it: a step that starts before ACTIVE runs without it.
- release: the replica leaves training at the next step boundary and its engines serve rollout
  again after `train_to_rollout_s` (the engine restart).
"""

from __future__ import annotations

from libra.planner import (
    ElasticConfig,
    ElasticDecision,
    EngineSlot,
    JoinState,
    Plan,
    PoolView,
    hybrid_hosts,
    make_pool,
)
from libra.sim.kernel import Kernel
from libra.sim.rl.driver import RolloutDriver


class ElasticPool:
    """The hybrid replicas of one layout: which engines each takes, and their joins and releases.
    Its inputs are narrow: the plan, the rollout driver whose engines it drains, and the kernel."""

    def __init__(self, plan: Plan | None, driver: RolloutDriver, kernel: Kernel, config: ElasticConfig):
        self.driver, self.k, self.cfg = driver, kernel, config
        replicas = make_pool(plan) if plan is not None else []
        slots = [EngineSlot(e.id, e.tp, driver.views[e.id].node) for e in driver.engines.values()]
        self.hosts = hybrid_hosts(replicas, slots)
        self.replicas = [r for r in replicas if r.id in self.hosts]
        self.joins = self.releases = 0
        self.last_reason = (
            "no step has ended yet" if self.replicas else "the plan sets aside no hybrid replica"
        )

    def carry_over(self, old: ElasticPool) -> None:
        """After a re-plan: the run's counts go on, and so does the last decision while this
        layout still has replicas to decide about."""
        self.joins, self.releases = old.joins, old.releases
        if self.replicas:
            self.last_reason = old.last_reason

    def summary(self) -> dict:
        """What `summary.json` reports: the pool's size, its moves, and why it last did what it did."""
        return {
            "hybrid_replicas": len(self.replicas),
            "joins": self.joins,
            "releases": self.releases,
            "last_decision": self.last_reason,
        }

    @property
    def active(self) -> int:
        return sum(1 for r in self.replicas if r.contributes_gradients)

    def lent_gpus(self) -> int:
        """GPUs of hybrid replicas that are not serving rollout now (joining, training, releasing)."""
        return sum(r.gpus for r in self.replicas if not r.serves_rollout)

    def view(self, core_dp: int, serving_gpus: int, prompts_per_step: int) -> PoolView:
        return PoolView(self.replicas, core_dp, serving_gpus, prompts_per_step)

    def apply(self, dec: ElasticDecision) -> None:
        """Carry out the controller's decision: start joins and releases."""
        self.last_reason = dec.reason
        for j in dec.joins:
            self._join(self._by_id(j.replica))
        for rel in dec.releases:
            self._release(self._by_id(rel.replica), rel.generation)

    def _by_id(self, rid: str):
        return next(r for r in self.replicas if r.id == rid)

    def _views(self, r):
        return [self.driver.views[eid] for eid in self.hosts[r.id]]

    def _join(self, r) -> None:
        gen = r.request_join()
        for v in self._views(r):
            v.healthy = False  # drain: no new turns; running turns finish
        self.joins += 1
        self._when_drained(r, gen)

    def _when_drained(self, r, gen: int) -> None:
        if r.state != JoinState.REQUESTED or r.generation != gen:
            return
        if any(self.driver.engines[e].outstanding for e in self.hosts[r.id]):
            self.k.after(0.5, self._when_drained, r, gen)
            return
        r.begin_fetch(gen)
        self.k.after(self.cfg.snapshot_s, self._fetched, r, gen)

    def _fetched(self, r, gen: int) -> None:
        if r.state_fetched(gen):
            self.k.after(self.cfg.restore_s, self._activate, r, gen)

    def _activate(self, r, gen: int) -> None:
        """The two-phase activation costs no modelled time: both messages ride on a step boundary."""
        if r.propose_activation(gen):
            r.activate(gen)

    def _release(self, r, gen: int) -> None:
        if not r.release(gen):
            return
        self.releases += 1
        self.k.after(self.cfg.train_to_rollout_s, self._back, r, gen)

    def _back(self, r, gen: int) -> None:
        if r.released(gen):
            for v in self._views(r):
                v.healthy = True

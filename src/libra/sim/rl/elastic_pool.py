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

from libra.planner import ElasticConfig, ElasticController, ElasticSignals, JoinState, make_pool


class ElasticPool:
    def __init__(self, sim, config: ElasticConfig | None = None):
        self.sim, self.cfg = sim, config or ElasticConfig()
        self.ctrl = ElasticController(self.cfg)
        self.replicas = make_pool(sim.setup.plan) if sim.setup.plan is not None else []
        self.hosts = self._choose_hosts()
        self.replicas = [r for r in self.replicas if r.id in self.hosts]
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

    def _choose_hosts(self) -> dict[str, list[str]]:
        """Whole replicas on whole engines of one node: largest TP first, one node per replica."""
        by_node: dict[int, list] = {}
        for e, spec in zip(self.sim.driver.engines.values(), self.sim.setup.instances, strict=True):
            by_node.setdefault(spec.node, []).append(e)
        hosts, used = {}, set()
        for r in self.replicas:
            for node in sorted(by_node, reverse=True):
                pick = _subset(sorted(by_node[node], key=lambda e: -e.tp), r.gpus, used)
                if pick:
                    hosts[r.id] = [e.id for e in pick]
                    used.update(hosts[r.id])
                    break
        return hosts

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

    def at_step_end(self, t_train: float, t_rollout: float, pressure: float) -> None:
        if not self.replicas:
            return
        setup = self.sim.setup
        roll = setup.rollout_gpus - self.lent_gpus()
        sig = ElasticSignals(t_train, t_rollout, pressure, setup.train.dp, roll, self.sim.prompts_per_step)
        dec = self.ctrl.decide(sig, self.replicas)
        self.last_reason = dec.reason
        for j in dec.joins:
            self._join(self._by_id(j.replica))
        for rel in dec.releases:
            self._release(self._by_id(rel.replica), rel.generation)

    def _by_id(self, rid: str):
        return next(r for r in self.replicas if r.id == rid)

    def _views(self, r):
        return [self.sim.driver.views[eid] for eid in self.hosts[r.id]]

    def _join(self, r) -> None:
        gen = r.request_join()
        for v in self._views(r):
            v.healthy = False  # drain: no new turns; running turns finish
        self.joins += 1
        self._when_drained(r, gen)

    def _when_drained(self, r, gen: int) -> None:
        if r.state != JoinState.REQUESTED or r.generation != gen:
            return
        if any(self.sim.driver.engines[e].outstanding for e in self.hosts[r.id]):
            self.sim.k.after(0.5, self._when_drained, r, gen)
            return
        r.begin_fetch(gen)
        self.sim.k.after(self.cfg.snapshot_s, self._fetched, r, gen)

    def _fetched(self, r, gen: int) -> None:
        if r.state_fetched(gen):
            self.sim.k.after(self.cfg.restore_s, self._activate, r, gen)

    def _activate(self, r, gen: int) -> None:
        """The two-phase activation costs no modelled time: both messages ride on a step boundary."""
        if r.propose_activation(gen):
            r.activate(gen)

    def _release(self, r, gen: int) -> None:
        if not r.release(gen):
            return
        self.releases += 1
        self.sim.k.after(self.cfg.train_to_rollout_s, self._back, r, gen)

    def _back(self, r, gen: int) -> None:
        if r.released(gen):
            for v in self._views(r):
                v.healthy = True


def _subset(engines: list, gpus: int, used: set) -> list | None:
    """Engines (largest first) whose TPs sum to exactly `gpus`, none already used."""
    pick, total = [], 0
    for e in engines:
        if e.id in used or total + e.tp > gpus:
            continue
        pick.append(e)
        total += e.tp
        if total == gpus:
            return pick
    return None

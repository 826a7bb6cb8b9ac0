"""The systems a team would pick instead of Libra, as simulated systems on the same engines,
cost model and workloads: AReaL, APRIL, Seer and Heddle.

Each is modelled from its paper's mechanisms (each class names the sections), built from pieces
any system may use: the `Mechanisms` of `sim.rl.setup` that the pipeline and the rollout driver
carry out (interruptible weight updates, partial rollouts, divided rollout, migration during tool
calls, speculative decoding), and the routing and queueing policies of `rollout.peers`. Their
options are the scenario's `peers:` section (`sim.rl.config.PeersCfg`, defaults in one place);
where a paper is vague, the choice is written down here and in docs/peers.md.

Baselines, as their papers measure against:
- AReaL against synchronous RL: `verl-colocated` (rollout, then training, on every GPU);
- APRIL against the same synchronous pipeline without partial rollouts: `verl-colocated`;
- Seer against veRL's synchronous rollout, which sends each GRPO group whole to an instance in
  turn: `colocated:group-round-robin`;
- Heddle against step-centric rollout (each turn to the least loaded instance, FCFS queues):
  `verl-colocated`.
"""

from __future__ import annotations

from libra.costmodel.speculative import SpecDecoding
from libra.planner.stats import WorkloadStats
from libra.sim.rl.planned import PEER_TAKES, PlannedSystem, profiling_sample, shared_planner
from libra.sim.rl.setup import (
    Mechanisms,
    System,
    colocated,
    packed,
)


class Areal(PlannedSystem):
    """AReaL (arXiv 2505.24298), fully asynchronous RL.

    - System design, "interruptible rollout worker": rollout and training run on separate GPUs; as
      soon as a training step ends its weights go to every engine, which aborts the requests in
      flight, loads the weights (`pipeline.weight_sync_s`, paused) and resumes them: each
      recomputes its KV with the new weights (`peers.areal.interrupt`).
    - "Continuous generation" and the rollout controller: generation never waits for a batch
      barrier; a new prompt may start while at most eta versions separate it from the trained
      policy, eta = `pipeline.staleness` (the same gate for every system, so asynchronous systems
      are compared at one bound). A prompt admitted under that rule is started at once, which is
      what the controller's per-sample admission amounts to when every sample of a batch is
      admitted on the same version. The bound is kept at admission, as AReaL keeps it: a
      straggler trained later carries older tokens (the run reports every trained token's lag;
      `pipeline.strict_staleness` keeps the bound on trained tokens, for every system).
    - The trainer takes the first whole groups to finish (`pipeline.consume: completion`).
    - The split between generation and training GPUs is set by hand in AReaL; here it is the
      planner's best static split with one TP (the `static-optimal` layout), AReaL at its best.
      Requests go to the least loaded engine.
    - Staleness-aware training (the decoupled PPO objective) is algorithmic: not simulated.

    Needs eta >= 1: an interrupted request keeps its tokens from the older weights, so a step may
    train tokens one version old (at eta 0 AReaL is synchronous RL).
    """

    name = "areal"
    planner = "homogeneous"
    replan = False
    min_staleness = 1
    needs_staleness = "interrupted requests keep tokens from older weights (eta 0 is synchronous RL)"
    takes = "interrupt"  # its interruptible updates, on every plan (`planned.PEER_TAKES`)


class April(System):
    """APRIL (arXiv 2509.18521), active partial rollouts on slime's synchronous pipeline.

    - "Active partial rollouts": each step keeps `peers.april.over_provision` times its target of
      GRPO groups in flight; once the target count has finished the rollout stops and the rest are
      aborted; the unfinished trajectories are kept with what they wrote and resume first in the
      next step, their tokens tagged with the weight version that wrote them
      (`planner.partial`). Nothing is discarded.
    - The pipeline around it is synchronous and colocated (rollout, then training, on every GPU,
      as the paper runs it in slime), each request to the least loaded engine.
    - Carried groups resume first, which is how APRIL bounds staleness; with
      `pipeline.strict_staleness` the step also waits for any running group stamped
      `pipeline.staleness` versions old, so that no trained token is older than the bound.

    Needs a staleness bound >= 1: carried trajectories are trained a step after they started.
    """

    name = "april"
    min_staleness = 1
    needs_staleness = "partial trajectories resume a step later, with tokens one version old"

    def setup(self, sc, hw):
        mech = Mechanisms(over_provision=sc.peers.april.over_provision)
        return colocated(sc, hw, self.router, dict(sc.rollout.router_params), mech)


class Seer(System):
    """Seer (arXiv 2511.14617), synchronous RL with online context learning.

    - "Divided rollout": a request is submitted at most `peers.seer.chunk_tokens` output tokens at a
      time and every chunk is placed again on the least loaded engine (per GPU), so a GRPO group's
      requests spread over the engines as they free up (Seer's global KV pool is a KV transfer
      at its cost here).
    - "Context-aware scheduling": each group's first request probes its length and runs first; once
      a member has finished, the group's requests go longest estimated first (`rollout.peers.SeerRouter`).
    - "Adaptive grouped speculative decoding": every engine drafts from the group's other responses,
      with the stated per-token `peers.seer.acceptance_rate` and a draft length that adapts to the
      batch, up to `peers.seer.max_draft` (`costmodel.speculative`).
    - Synchronous and colocated like its baseline, with the scenario's homogeneous TP.
    """

    name = "seer"
    router = "seer"

    def setup(self, sc, hw):
        cfg = sc.peers.seer
        spec = SpecDecoding(cfg.acceptance_rate, cfg.max_draft) if cfg.speculative else None
        mech = Mechanisms(chunk_tokens=cfg.chunk_tokens, speculative=spec)
        params = {**sc.rollout.router_params, "context_aware": cfg.context_aware}
        return colocated(sc, hw, self.router, params, mech)


class Heddle(System):
    """Heddle (arXiv 2603.28101), trajectory-centric orchestration of agentic rollout.

    - "Trajectory-level scheduling": a progressive runtime prediction (each trajectory's final
      length from its prompt's history, re-predicted at every turn from the context it reached),
      and the engine queues ordered by predicted remaining length, longest first
      (`peers.heddle.priority`; `rollout.peers.HeddleRouter`).
    - "Trajectory-aware placement": a presorted dynamic program lays the engines out, trajectories
      sorted by length and cut into contiguous ranges, one TP per range (the planner's bucket DP
      on all GPUs, from a profiling sample); each trajectory runs in the range of its predicted
      length, and with `peers.heddle.migrate_in_tool` its next turn is placed while its tool runs,
      the KV moving meanwhile.
    - "Trajectory-adaptive resource manager": per-trajectory model parallelism, long trajectories
      on large TP (`peers.heddle.per_trajectory_tp`; off: the scenario's homogeneous TP). Heddle
      also re-shards engines during a step; here the layout is fixed per run (written down).
    - Synchronous and colocated, like its step-centric baseline.
    """

    name = "heddle"
    router = "heddle"

    def setup(self, sc, hw):
        cfg = sc.peers.heddle
        router, params, mech = PEER_TAKES["heddle"](sc)
        base = colocated(sc, hw, router, {**sc.rollout.router_params, **params}, mech)
        if not cfg.per_trajectory_tp:
            return base
        total = sc.cluster.nodes * hw.gpus_per_node
        planner = shared_planner(self.shared, "libra", sc, hw)
        layout = planner.rollout_layout(WorkloadStats.from_trajectories(profiling_sample(sc, self)), total)
        base.instances, base.buckets = packed(layout, hw, sc.cluster.nodes)
        return base


PEERS = (Areal, April, Seer, Heddle)
# The baseline each peer's headline is measured against (docs/peers.md).
BASELINES = {
    "areal": "verl-colocated",
    "april": "verl-colocated",
    "seer": "colocated:group-round-robin",
    "heddle": "verl-colocated",
}

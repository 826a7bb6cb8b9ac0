"""Action-level orchestration of external resources (ARL-Tangram), the policy side.

Tool calls and reward calls of trajectories are *actions*: atomic calls to CPUs (sandboxes), GPU
services (reward models, teachers) and API quotas. Per-trajectory reservations (one pod per
trajectory, one GPU group per service) leave most of these resources idle; this package shares
them action by action instead:

- `resources`, `profiles`, `model`: resource vectors of feasible sets, measured efficiency
  profiles, the action and its lifecycle;
- `topology`: how units split (fungible cores, buddy-split GPU chunks), with the exact split DP;
- `scheduler`: FCFS admission at minimum units, then elastic eviction by estimated total ACT;
- `cpu`, `gpu`, `quota`: the managers' policy state (allocate on execution, evict on execution,
  concurrency and per-period quotas);
- `orchestrator`: all of it as one object that the simulator and the live service both drive.

Everything here is pure: time is an argument, and nothing reads a clock or does I/O.
"""

from libra.actions.model import Action, ActionRecord, ActionState
from libra.actions.orchestrator import Orchestrator, Start
from libra.actions.profiles import EfficiencyProfile
from libra.actions.resources import Discrete, Range, ResourceVector
from libra.actions.scheduler import Decision, ElasticScheduler, Grant, Pool, SchedulerView

__all__ = [
    "Action",
    "ActionRecord",
    "ActionState",
    "Decision",
    "Discrete",
    "EfficiencyProfile",
    "ElasticScheduler",
    "Grant",
    "Orchestrator",
    "Pool",
    "Range",
    "ResourceVector",
    "SchedulerView",
    "Start",
]

"""Live elastic data parallelism: hybrid replicas join and leave a fixed core without blocking it.

The paper's design (Libra, `DESIGN.md` 1.3), carried out with real processes: the core replicas
form one fixed gloo group whose all-reduce never changes; a hybrid replica joins as a whole
data-parallel replica through a side channel to one core partner, moving through the planner's
`HybridReplica` states REQUESTED -> FETCHING_STATE -> ZERO_SYNC -> ACTIVATING -> ACTIVE, and
leaves at a step boundary. Any failure or timeout rolls it back to rollout; the core never waits
for a replica that is still joining.

- `reducer`: `SumAllReduce` (the plain reducer) and `ElasticReducer` (its drop-in), core side;
- `joiner`: the joining replica's side; `session`: a partner's view of one join;
- `membership`: how every core rank agrees who counts in a step; `wire`: the side channel;
- `local`, `worker`, `workload`: a self-contained local run for tests and benchmarks.
"""

from libra.runtime.elastic.config import ElasticRuntimeConfig
from libra.runtime.elastic.joiner import Faults, Joiner, KillPoint, default_update
from libra.runtime.elastic.membership import ElasticStatus, Membership
from libra.runtime.elastic.reducer import ElasticReducer, GradientReducer, SumAllReduce

__all__ = [
    "ElasticReducer", "ElasticRuntimeConfig", "ElasticStatus", "Faults", "GradientReducer", "Joiner",
    "KillPoint", "Membership", "SumAllReduce", "default_update",
]  # fmt: skip

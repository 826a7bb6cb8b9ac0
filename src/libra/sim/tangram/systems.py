"""Systems compared by the action-orchestration scenarios, each a small class registered by type.

- `tangram`: every action goes through `libra.actions.Orchestrator` (the policy that also runs
  live): pooled cores allocated on execution with elastic test runs, or pooled GPUs evicted on
  execution with elastic DoP. `fixed_dop: 4` pins every elastic action to 4 units instead.
- `k8s`: one pod per trajectory with a CPU request and limit, held for the trajectory's whole
  life. Pods are placed by request; a trajectory whose pod does not fit waits for one to end.
  Running actions share a node's cores as Linux CFS shares them between cgroups: equal weights
  (equal requests), each capped by its limit and by the threads it runs (max-min fairness).
- `static-services`: every GPU service has its own always-resident TP group; its actions queue
  FCFS on it.

The simulator calls `submit(action)` and the system calls `action.done()` when it ends; a system
never reads anything but the kernel's clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from libra.actions import Action, ActionState, ElasticScheduler, Orchestrator, ResourceVector
from libra.actions.cpu import CpuManager, CpuNode
from libra.actions.gpu import GpuManager, GpuService
from libra.actions.quota import QuotaManager
from libra.actions.resources import Discrete, fixed
from libra.core.config import build
from libra.core.errors import ConfigError
from libra.core.registry import Registry
from libra.sim.kernel import Handle, Kernel
from libra.sim.tangram.workloads import ActionSpec


@dataclass(slots=True)
class SimAction:
    """One action as the simulator tracks it; a system fills start, units, restore and end."""

    id: str
    traj: str
    spec: ActionSpec
    submit: float
    done: Callable[[SimAction], None]
    start: float | None = None
    end: float | None = None
    units: float = 0.0
    restore_s: float = 0.0

    def finish(self, now: float) -> None:
        self.end = now
        self.done(self)


@dataclass(slots=True)
class Resources:
    """What the simulator knows about the hardware: CPU nodes, or GPU nodes and services."""

    cpu_nodes: list[CpuNode] | None = None
    gpu_nodes: list[int] | None = None
    gpu_memory_gib: float = 80.0
    services: dict[str, GpuService] | None = None
    quota: QuotaManager | None = None


class ActionSystem(ABC):
    """Base of the registered system types."""

    Params: type[BaseModel]

    def __init__(self, name: str, params: BaseModel, res: Resources, kernel: Kernel):
        self.name, self.params, self.res, self.k = name, params, res, kernel

    def traj_start(self, traj: str, memory_gib: float, ready: Callable[[], None]) -> None:
        """A trajectory begins; call `ready()` when it may start generating."""
        ready()

    def traj_end(self, traj: str) -> None:  # noqa: B027 - most systems keep nothing per trajectory
        """The trajectory ended: free what it held."""

    @abstractmethod
    def submit(self, a: SimAction) -> None:
        """Take an action; call `a.finish(now)` when it is done."""

    @abstractmethod
    def capacity(self) -> dict:
        """{"cpu_cores": N} or {"gpus": N}: what the system runs on."""

    def restore_busy_s(self) -> float:
        return 0.0

    def busy_unit_s(self, records: list[SimAction]) -> float:
        """Unit-seconds the system's resources were busy running actions (restores included)."""
        return sum(a.units * (a.end - a.start) for a in records)


# ---- tangram -----------------------------------------------------------------------------------


class TangramParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    depth: int = Field(2, ge=1, description="Waves of the queue the ACT estimate plays out.")
    fixed_dop: int | None = Field(None, ge=1, description="Pin elastic actions to this many units.")
    gpus: int | None = Field(None, ge=1, description="GPU pool size (default: the cluster's).")
    estimate: str = Field("learned", pattern="^(learned|oracle)$", description="T1 the scheduler sees.")
    price_load: bool = Field(True, description="Price work by the pool's occupancy when widening.")


class TangramSystem(ActionSystem):
    Params = TangramParams

    def __init__(self, name, params: TangramParams, res: Resources, kernel: Kernel):
        super().__init__(name, params, res, kernel)
        cpu = CpuManager(res.cpu_nodes) if res.cpu_nodes else None
        gpu = GpuManager(res.gpu_nodes, res.gpu_memory_gib, res.services) if res.gpu_nodes else None
        self.orch = Orchestrator(cpu, gpu, res.quota, ElasticScheduler(params.depth), params.price_load)
        self._acts: dict[str, SimAction] = {}
        self._pending = False
        self._restore_busy = 0.0
        self._first_t1: dict[str, float] = {}

    def capacity(self) -> dict:
        if self.orch.gpu is not None:
            return {"gpus": self.orch.gpu.total}
        return {"cpu_cores": sum(n.cores for n in self.orch.cpu.nodes)}

    def restore_busy_s(self) -> float:
        return self._restore_busy

    def traj_end(self, traj: str) -> None:
        self.orch.end_trajectory(traj)

    def submit(self, a: SimAction) -> None:
        spec = a.spec
        demand, profile = spec.demand, spec.profile
        if self.params.fixed_dop is not None and profile is not None:
            demand = _with_key(demand, fixed(self.params.fixed_dop))
        elif demand.key == "gpu":
            demand = _with_key(demand, Discrete(self._gpu_dops(spec)))
        act = Action(a.id, a.traj, spec.kind, self._t1(a), demand, profile, service=spec.service)
        self.orch.submit(act, self.k.now)
        self._acts[a.id] = a
        self._dispatch_soon()

    def _gpu_dops(self, spec: ActionSpec) -> tuple[int, ...]:
        """The DoPs this pool can run the service at: memory, and the largest node."""
        gpu = self.orch.gpu
        can = gpu.services[spec.service].dops(gpu.gpu_memory_gib, max(gpu.node_sizes))
        dops = tuple(int(d) for d in spec.demand.get("gpu").values() if d in can)
        if not dops:
            raise ConfigError("gpus", gpu.total, f"a pool with a node large enough for {spec.service}")
        return dops

    def _t1(self, a: SimAction) -> float:
        """What the scheduler is told: the truth (oracle), or what it learned from completions
        (before any completion of a kind: the first such call's true time, as a profiled
        default would be)."""
        spec = a.spec
        if self.params.estimate == "oracle":
            return spec.t1
        first = self._first_t1.setdefault(spec.kind, spec.t1)
        return self.orch.estimator.get(spec.kind, first, a.traj)

    def _dispatch_soon(self) -> None:
        """Coalesce everything that happens at one instant into a single decision."""
        if not self._pending:
            self._pending = True
            self.k.after(0.0, self._dispatch)

    def _dispatch(self) -> None:
        self._pending = False
        now = self.k.now
        for s in self.orch.decide(now):
            a = self._acts[s.action.id]
            a.start, a.units, a.restore_s = now, s.units, s.restore_s
            spec = a.spec
            exec_s = spec.profile.duration(spec.t1, s.units) if spec.profile is not None else spec.t1
            self._restore_busy += s.restore_s * s.units
            self.k.after(s.restore_s + exec_s, self._finish, a)
        wake = self.orch.wake_at(now)
        if wake is not None and wake > now:
            self.k.at(wake, self._dispatch_soon)

    def _finish(self, a: SimAction) -> None:
        self.orch.complete(a.id, self.k.now, ActionState.SUCCEEDED)
        self.orch.forget(a.id)
        del self._acts[a.id]
        a.finish(self.k.now)
        self._dispatch_soon()


# ---- Kubernetes, one pod per trajectory ------------------------------------------------------------


class K8sParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    cpu_request: float = Field(0.5, gt=0, description="Each pod's CPU request (what placement counts).")
    cpu_limit: float = Field(4.0, gt=0, description="Each pod's CPU limit (CFS quota).")
    pod_startup_s: float = Field(2.0, ge=0, description="Pod creation to ready (image cached).")
    sandbox_before_generation: bool = Field(
        False,
        description="Hold a trajectory's first generation until its pod is ready (pod waits then "
        "count in step time); by default generation starts at once and the first tool call waits.",
    )


@dataclass(slots=True)
class _Running:
    a: SimAction
    threads: int
    left: float  # remaining one-core work, seconds
    rate: float = 0.0


class _Node:
    """One node's CFS: running actions share its cores; rates change whenever the set does."""

    def __init__(self, cores: int, memory_gib: float):
        self.cores, self.memory_free = cores, memory_gib
        self.requested = 0.0
        self.running: dict[str, _Running] = {}
        self.last = 0.0
        self.next: Handle | None = None
        self.busy_core_s = 0.0


class K8sSystem(ActionSystem):
    Params = K8sParams

    def __init__(self, name, params: K8sParams, res: Resources, kernel: Kernel):
        super().__init__(name, params, res, kernel)
        if not res.cpu_nodes:
            raise ConfigError(
                f"systems.{name}.type", "k8s", "a CPU scenario (the k8s baseline models CPU pods)"
            )
        self.nodes = [_Node(n.cores, n.memory_gib) for n in res.cpu_nodes]
        most = max(n.cores for n in self.nodes)
        if params.cpu_request > most:  # no pod could ever be scheduled
            raise ConfigError(f"systems.{name}.cpu_request", params.cpu_request,
                              f"<= cluster.cores_per_node ({most})")  # fmt: skip
        self.pod: dict[str, int | None] = {}  # traj -> node once ready, None while pending
        self._mem: dict[str, float] = {}
        self._pending_pods: deque[str] = deque()
        self._waiting: dict[str, list[SimAction]] = {}
        self._ready: dict[str, Callable[[], None]] = {}

    def capacity(self) -> dict:
        return {"cpu_cores": sum(n.cores for n in self.nodes)}

    def busy_unit_s(self, records: list[SimAction]) -> float:
        return sum(n.busy_core_s for n in self.nodes)

    def traj_start(self, traj: str, memory_gib: float, ready: Callable[[], None]) -> None:
        self._mem[traj] = memory_gib
        self.pod[traj] = None
        self._pending_pods.append(traj)
        if self.params.sandbox_before_generation:
            self._ready[traj] = ready
        else:
            ready()
        self._schedule_pods()

    def _schedule_pods(self) -> None:
        """The default scheduler's LeastAllocated spreading, by request, in creation order."""
        req = self.params.cpu_request
        while self._pending_pods:
            traj = self._pending_pods[0]
            mem = self._mem[traj]
            fits = [
                i
                for i, n in enumerate(self.nodes)
                if n.requested + req <= n.cores + 1e-9 and n.memory_free >= mem
            ]
            if not fits:
                return
            i = min(fits, key=lambda i: (self.nodes[i].requested / self.nodes[i].cores, i))
            self._pending_pods.popleft()
            self.nodes[i].requested += req
            self.nodes[i].memory_free -= mem
            self.k.after(self.params.pod_startup_s, self._pod_ready, traj, i)

    def _pod_ready(self, traj: str, node: int) -> None:
        self.pod[traj] = node
        if traj in self._ready:
            self._ready.pop(traj)()
        for a in self._waiting.pop(traj, []):
            self._run(a, node)

    def traj_end(self, traj: str) -> None:
        node = self.pod.pop(traj)
        if node is not None:
            self.nodes[node].requested -= self.params.cpu_request
            self.nodes[node].memory_free += self._mem.pop(traj)
        self._schedule_pods()

    def submit(self, a: SimAction) -> None:
        node = self.pod.get(a.traj)
        if node is None:
            self._waiting.setdefault(a.traj, []).append(a)
        else:
            self._run(a, node)

    def _threads(self, spec: ActionSpec) -> int:
        """An elastic command is configured for the pod (pytest -n LIMIT); others use one thread."""
        f = spec.demand.get("cpu")
        return max(1, int(min(self.params.cpu_limit, f.max))) if spec.profile is not None else 1

    def _run(self, a: SimAction, node: int) -> None:
        n = self.nodes[node]
        self._advance(n)
        a.start, a.units = self.k.now, 0.0
        n.running[a.id] = _Running(a, self._threads(a.spec), a.spec.t1)
        self._reschedule(n)

    def _advance(self, n: _Node) -> None:
        dt = self.k.now - n.last
        if dt > 0:
            for r in n.running.values():
                r.left -= r.rate * dt
            n.busy_core_s += dt * sum(r.a.units for r in n.running.values())
        n.last = self.k.now

    def _reschedule(self, n: _Node) -> None:
        """CFS max-min shares, then each action's progress rate, then the next completion."""
        if n.next is not None:
            n.next.cancel()
            n.next = None
        if not n.running:
            return
        caps = {aid: min(self.params.cpu_limit, r.threads) for aid, r in n.running.items()}
        shares = max_min_fair(n.cores, caps)
        for aid, r in n.running.items():
            cores = shares[aid]
            r.a.units = cores
            prof = r.a.spec.profile
            speed = prof.speedup(r.threads) if prof is not None else 1.0
            r.rate = speed * min(1.0, cores / r.threads)
        first = min(n.running.values(), key=lambda r: (r.left / r.rate, r.a.id))
        n.next = self.k.after(max(0.0, first.left / first.rate), self._complete, n, first.a.id)

    def _complete(self, n: _Node, aid: str) -> None:
        n.next = None
        self._advance(n)
        r = n.running.pop(aid)
        self._reschedule(n)
        r.a.units = r.threads
        r.a.finish(self.k.now)


def _with_key(demand: ResourceVector, feasible) -> ResourceVector:
    return ResourceVector.from_mapping({**dict(demand.entries), demand.key: feasible}, demand.key)


def max_min_fair(capacity: float, caps: dict[str, float]) -> dict[str, float]:
    """Equal-weight water-filling: everyone gets an equal share, no one more than its cap."""
    out, left, n = {}, capacity, len(caps)
    for aid, cap in sorted(caps.items(), key=lambda kv: (kv[1], kv[0])):
        share = left / n
        out[aid] = cap if cap <= share else share
        left -= out[aid]
        n -= 1
    return out


# ---- static GPU services -----------------------------------------------------------------------------


class StaticParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    tp: int = Field(4, ge=1, description="GPUs of each service's own always-resident TP group.")


class StaticServicesSystem(ActionSystem):
    Params = StaticParams

    def __init__(self, name, params: StaticParams, res: Resources, kernel: Kernel):
        super().__init__(name, params, res, kernel)
        if not res.services:
            raise ConfigError(f"systems.{name}.type", "static-services", "a GPU-service scenario")
        self.queues: dict[str, deque[SimAction]] = {s: deque() for s in res.services}
        self.busy: dict[str, bool] = {s: False for s in res.services}
        for s, spec in res.services.items():
            if spec.gib_per_gpu(params.tp) > res.gpu_memory_gib:
                raise ConfigError(
                    f"systems.{name}.tp", params.tp, f"a TP at which service {s} fits in memory"
                )

    def capacity(self) -> dict:
        return {"gpus": self.params.tp * len(self.queues)}

    def submit(self, a: SimAction) -> None:
        self.queues[a.spec.service].append(a)
        self._next(a.spec.service)

    def _next(self, service: str) -> None:
        if self.busy[service] or not self.queues[service]:
            return
        a = self.queues[service].popleft()
        self.busy[service] = True
        a.start, a.units = self.k.now, self.params.tp
        exec_s = a.spec.profile.duration(a.spec.t1, self.params.tp)
        self.k.after(exec_s, self._done, service, a)

    def _done(self, service: str, a: SimAction) -> None:
        self.busy[service] = False
        a.finish(self.k.now)
        self._next(service)


SYSTEM_TYPES: Registry[type[ActionSystem]] = Registry(
    "action system",
    "systems.NAME.type",
    {"tangram": TangramSystem, "k8s": K8sSystem, "static-services": StaticServicesSystem},
    outside=False,
)


def make_system(
    name: str, spec: dict, res: Resources, kernel: Kernel, overrides: dict | None = None
) -> ActionSystem:
    if not isinstance(spec, dict) or "type" not in spec:
        raise ConfigError(f"systems.{name}", spec, "a mapping with `type` and that type's parameters")
    kind = spec["type"]
    if not isinstance(kind, str):
        raise ConfigError(f"systems.{name}.type", kind, SYSTEM_TYPES.allowed())
    cls = SYSTEM_TYPES.get_entry(kind, f"systems.{name}.type")
    params = {k: v for k, v in spec.items() if k != "type"} | (overrides or {})
    return cls(name, build(cls.Params, params, f"systems.{name}"), res, kernel)

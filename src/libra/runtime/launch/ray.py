"""The `ray` launcher: the same entry points, each owned by a Ray actor in a placement group.

One placement group holds a bundle per process ({"CPU": cpus} and {"GPU": gpus} where asked; on
this machine CPU bundles, on a cluster GPU bundles for engines and trainers), packed as tightly as
the cluster allows. Each actor is scheduled on its bundle and starts its process as a child (the
way slime's engine actors start SGLang servers): a service keeps its own signal handling and event
loop, and inherits the actor's resources (`CUDA_VISIBLE_DEVICES` on a GPU node). The child dies
with its actor (parent-death signal), so `ray.kill` or a lost node takes the process with it.

Without `ray_address` a local Ray instance is started with as many logical CPUs as the bundles
ask for (Ray's CPUs are a scheduling count, not a limit); with one, the run joins that cluster.
"""

from __future__ import annotations

from libra.core.errors import ConfigError
from libra.runtime.launch.base import ProcessSpec, log_size

try:
    import ray
except ModuleNotFoundError:  # an optional extra
    ray = None


class _Owner:
    """The actor body: start one process, report on it, signal it."""

    def start(self, args: list[str], log_path: str, env: dict[str, str]) -> int:
        from libra.runtime.launch.local import popen

        self.proc = popen(args, log_path, env)
        return self.proc.pid

    def returncode(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float) -> int | None:
        from libra.runtime.launch.local import stop_process

        stop_process(self.proc, timeout)
        return self.proc.returncode


class RayHandle:
    def __init__(self, actor, spec: ProcessSpec):
        self.actor, self.name, self.log = actor, spec.name, spec.log
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        self.offset = log_size(spec.log)
        self._pid = ray.get(actor.start.remote(list(spec.args), str(spec.log), spec.env))
        self._code: int | None = None

    @property
    def pid(self) -> int:
        return self._pid

    def returncode(self) -> int | None:
        if self._code is None:
            try:
                self._code = ray.get(self.actor.returncode.remote(), timeout=30)
            except Exception:  # the actor itself is gone (killed, node lost): so is its process
                self._code = -9
        return self._code

    def signal(self, sig: int) -> None:
        try:
            ray.get(self.actor.signal.remote(sig), timeout=30)
        except Exception:
            pass

    def stop(self, timeout: float = 15.0) -> None:
        try:
            self._code = ray.get(self.actor.stop.remote(timeout), timeout=timeout + 40)
        except Exception:
            pass
        ray.kill(self.actor)


class RayLauncher:
    name = "ray"

    def __init__(self, address: str | None, cpus: float):
        if ray is None:
            raise ConfigError("--launcher", "ray", "the 'ray' extra installed: pip install 'libra[ray]'")
        if not ray.is_initialized():
            kwargs = {"address": address} if address else {"num_cpus": max(1, int(cpus + 0.999))}
            ray.init(include_dashboard=False, logging_level="WARNING", log_to_driver=False, **kwargs)
        self._owner = ray.remote(_Owner)
        self._groups: list = []
        self._slots: dict[str, tuple[object, int]] = {}

    def reserve(self, specs: list[ProcessSpec]) -> None:
        """One placement group with a bundle per process, ready before any of them starts."""
        from ray.util.placement_group import placement_group

        bundles = [{"CPU": s.cpus, **({"GPU": s.gpus} if s.gpus else {})} for s in specs]
        pg = placement_group(bundles, strategy="PACK")
        ray.get(pg.ready(), timeout=300)
        self._groups.append(pg)
        self._slots.update({s.name: (pg, i) for i, s in enumerate(specs)})

    def start(self, spec: ProcessSpec) -> RayHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if spec.name not in self._slots:
            self.reserve([spec])
        group, index = self._slots[spec.name]
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)
        actor = self._owner.options(
            num_cpus=spec.cpus, num_gpus=spec.gpus, scheduling_strategy=strategy
        ).remote()
        return RayHandle(actor, spec)

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self._groups:
            remove_placement_group(pg)
        self._groups.clear()
        ray.shutdown()

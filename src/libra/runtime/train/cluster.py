"""Start every process of a run through a launcher, and stop them all, whatever happens.

The processes, each a `ProcessSpec` with its own log under `RUN/logs/`:

- one built-in engine per bucket instance (`libra serve engine`), random weights until the
  driver publishes the warm-start's;
- the gateway (`libra serve gateway`) in front of them, C-MLFQ by default, buckets from the config;
- the actions service (`libra serve actions`), unless `actions.url` names one already running or
  the task's tool runs in process;
- the trainer replicas (`python -m libra.runtime.train.worker`), rank 0 first: it prints the
  rendezvous store's address, which the other ranks are started with.

Everything that can start at once does; `RUN/processes.json` lists each running process's name,
pid, URL and log (rewritten when the pool or the fleet starts or stops one), so an operator (or a
fault test) can find any of them.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from libra.runtime.launch.base import LISTENING, Handle, Launcher, LaunchError, ProcessSpec, wait_for_line
from libra.runtime.train.config import TrainConfig

START_TIMEOUT_S = 180.0
MODEL_NAME = "tiny"


@dataclass(slots=True)
class Proc:
    role: str  # engine | gateway | actions | trainer | hybrid | standby (an engine not yet in the gateway)
    handle: Handle
    url: str = ""
    bucket: str = ""


@dataclass(slots=True)
class Cluster:
    run: Path
    launcher: Launcher
    procs: list[Proc] = field(default_factory=list)
    actions_url: str | None = None
    store: str = ""  # the trainer group's rendezvous store (hybrid replicas find their partner there)

    def of(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    @property
    def gateway_url(self) -> str:
        return self.of("gateway")[0].url

    @property
    def trainer_urls(self) -> list[str]:
        return [p.url for p in self.of("trainer")]

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if p.handle.returncode() is not None]

    def add(self, p: Proc) -> None:
        """A process started during the run (a hybrid trainer, a restarted engine): stopped with
        the run whatever happens, and listed in processes.json."""
        self.procs.append(p)
        self.write_index()

    def remove(self, p: Proc) -> None:
        self.procs.remove(p)
        self.write_index()

    def write_index(self) -> None:
        rows = [{"name": p.handle.name, "role": p.role, "pid": p.handle.pid, "url": p.url, "bucket": p.bucket, "log": str(p.handle.log)} for p in self.procs]  # fmt: skip
        (self.run / "processes.json").write_text(json.dumps(rows, indent=1) + "\n")

    def save_metrics(self) -> None:
        """The gateway's Prometheus text at the end of the run (RUN/gateway-metrics.prom), best effort."""
        try:
            with urllib.request.urlopen(self.gateway_url + "/metrics", timeout=5) as r:
                (self.run / "gateway-metrics.prom").write_bytes(r.read())
        except (OSError, IndexError):
            pass

    def stop(self) -> None:
        """Trainers and the gateway first (nothing new is asked of engines), then the rest."""
        order = {"hybrid": 0, "trainer": 0, "gateway": 1, "engine": 2, "standby": 2, "actions": 3}
        for p in sorted(self.procs, key=lambda p: order[p.role]):
            p.handle.stop(timeout=10.0)
        self.launcher.shutdown()


def _py(*args: str) -> tuple[str, ...]:
    return tuple(args)


def engine_name(bucket: str, index: int) -> str:
    """An engine's process name, which is also its instance id in the gateway."""
    return f"engine-{bucket}-{index}"


def batched_tokens(cfg: TrainConfig) -> int:
    """Each engine's --max-num-batched-tokens: the built-in engine's default 512, or more so
    that a step can hold one token of every running sequence."""
    return max(512, cfg.engine.max_num_seqs)


def engine_specs(cfg: TrainConfig, logs: Path) -> list[tuple[ProcessSpec, str]]:
    e, out = cfg.engine, []
    for b in cfg.buckets:
        for i in range(b.instances):
            name = engine_name(b.name, i)
            args = _py("-m", "libra", "serve", "engine", "--port", "0", "--model", e.model, "--name", MODEL_NAME,
                       "--tp-label", f"tp{b.tp}", "--seed", str(cfg.seed), "--max-num-seqs", str(e.max_num_seqs),
                       "--max-num-batched-tokens", str(batched_tokens(cfg)), "--kv-cache-mb", str(e.kv_cache_mb),
                       "--threads", str(e.threads), "--tool-rounds", "1")  # fmt: skip
            if e.max_model_len is not None:
                args += ("--max-model-len", str(e.max_model_len))
            if e.step_log:
                args += ("--step-log", str(logs / f"{name}-steps.jsonl"))
            out.append((ProcessSpec(name, args, logs / f"{name}.log", cpus=1.0, gpus=0.0), b.name))
    return out


def actions_spec(cfg: TrainConfig, logs: Path) -> ProcessSpec:
    args = ["-m", "libra", "serve", "actions", "--port", "0", "--set", f"warm_pool={cfg.actions.warm_pool}"]
    if cfg.actions.insecure_no_sandbox:
        args.append("--insecure-no-sandbox")
    return ProcessSpec("actions", tuple(args), logs / "actions.log", cpus=1.0)


def trainer_spec(cfg: TrainConfig, run: Path, rank: int, store: str | None) -> ProcessSpec:
    args = ["-m", "libra.runtime.train.worker", "--rank", str(rank), "--world", str(cfg.trainer.replicas),
            "--config", str(run / "config.json"), "--run", str(run)]  # fmt: skip
    if store:
        args += ["--store", store]
    return ProcessSpec(f"trainer-{rank}", tuple(args), run / "logs" / f"trainer-{rank}.log", cpus=1.0,
                       env={"OMP_NUM_THREADS": str(cfg.trainer.threads)})  # fmt: skip


def hybrid_spec(cfg: TrainConfig, run: Path, slot: int, store: str) -> ProcessSpec:
    """A hybrid trainer replica in a drained engine's slot (`libra.runtime.train.hybrid`)."""
    args = ("-m", "libra.runtime.train.hybrid", "--slot", str(slot), "--world", str(cfg.trainer.replicas),
            "--store", store, "--config", str(run / "config.json"))  # fmt: skip
    return ProcessSpec(f"hybrid-{slot}", args, run / "logs" / f"hybrid-{slot}.log", cpus=1.0,
                       env={"OMP_NUM_THREADS": str(cfg.trainer.threads)})  # fmt: skip


def gateway_spec(cfg: TrainConfig, run: Path, engines: list[Proc]) -> ProcessSpec:
    by_name = {b.name: b for b in cfg.buckets}
    backends = [{"url": p.url, "bucket": p.bucket, "tp": by_name[p.bucket].tp, "max_context": by_name[p.bucket].max_context, "name": p.handle.name} for p in engines]  # fmt: skip
    data = {"port": 0, "router": cfg.gateway.router, "router_params": cfg.gateway.router_params, "seed": cfg.seed,
            "backends": backends, "health": {"interval_s": 0.5, "timeout_s": 5.0, "failures": 2},
            "no_instance_wait_s": 10.0}  # fmt: skip
    (run / "gateway.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    args = (
        "-m",
        "libra",
        "serve",
        "gateway",
        "--config",
        str(run / "gateway.yaml"),
        "--log-level",
        "warning",
    )
    return ProcessSpec("gateway", args, run / "logs" / "gateway.log", cpus=1.0)


def start(cfg: TrainConfig, run: Path, launcher: Launcher) -> Cluster:
    """Start everything; on any failure stop what was started and raise LaunchError."""
    logs = run / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(cfg.model_dump_json(indent=1))
    if cfg.task.tool == "sandbox" and cfg.actions.url is not None:
        check_reachable(cfg.actions.url, cfg.actions.connect_timeout_s)  # before anything starts
    cluster = Cluster(run, launcher)
    try:
        _start_all(cfg, run, launcher, cluster)
    except BaseException:
        cluster.stop()
        raise
    cluster.write_index()
    return cluster


def _start_all(cfg: TrainConfig, run: Path, launcher: Launcher, cluster: Cluster) -> None:
    logs = run / "logs"
    engines = engine_specs(cfg, logs)
    want_actions = cfg.task.tool == "sandbox" and cfg.actions.url is None
    specs = [s for s, _ in engines] + [trainer_spec(cfg, run, r, None) for r in range(cfg.trainer.replicas)]
    specs += [gateway_spec_placeholder(logs)] + ([actions_spec(cfg, logs)] if want_actions else [])
    launcher.reserve(specs)
    cluster.procs += [Proc("engine", launcher.start(s), bucket=b) for s, b in engines]
    if want_actions:
        cluster.procs.append(Proc("actions", launcher.start(actions_spec(cfg, logs))))
    rank0 = Proc("trainer", launcher.start(trainer_spec(cfg, run, 0, None)))
    cluster.procs.append(rank0)
    store = cluster.store = wait_for_line(rank0.handle, r"trainer store on (\S+)", START_TIMEOUT_S).group(1)
    cluster.procs += [Proc("trainer", launcher.start(trainer_spec(cfg, run, r, store))) for r in range(1, cfg.trainer.replicas)]  # fmt: skip
    for p in cluster.of("engine"):
        p.url = wait_for_line(p.handle, LISTENING, START_TIMEOUT_S).group(1)
    gw = Proc("gateway", launcher.start(gateway_spec(cfg, run, cluster.of("engine"))))
    cluster.procs.append(gw)
    gw.url = wait_for_line(gw.handle, LISTENING, START_TIMEOUT_S).group(1)
    for p in cluster.of("trainer") + cluster.of("actions"):
        p.url = wait_for_line(p.handle, LISTENING, START_TIMEOUT_S).group(1)
    cluster.actions_url = cluster.of("actions")[0].url if want_actions else cfg.actions.url


def gateway_spec_placeholder(logs: Path) -> ProcessSpec:
    """The gateway's resources, reserved before its config (the engines' URLs) is known."""
    return ProcessSpec("gateway", (), logs / "gateway.log", cpus=1.0)


def check_reachable(url: str, timeout_s: float) -> None:
    """The actions service answers /health within `timeout_s`, or the run stops here."""
    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except OSError as e:
            last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        time.sleep(0.25)
    raise LaunchError(f"the actions service at {url} is unreachable ({last}) after {timeout_s:g} s (actions.url, actions.connect_timeout_s)")  # fmt: skip

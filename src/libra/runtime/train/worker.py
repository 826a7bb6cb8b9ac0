"""A core trainer replica: one process, one rank of the fixed gloo group, an HTTP door for the driver.

    python -m libra.runtime.train.worker --rank R --world N --config RUN/config.json --run RUN [--store HOST:PORT]

Rank 0 creates the group's rendezvous store on a free port and prints it (`trainer store on
HOST:PORT`), so the launcher starts the other ranks with it; no fixed port is ever needed. Once
every rank has joined, each serves:

- `POST /warmstart`: the supervised warm-start (every replica draws the same seeded demonstrations
  and trains its share; gradients summed; all stop at the same probe, `runtime/train/warmstart`),
  then rank 0 writes the step-0 checkpoint;
- `POST /resume {path}`: load a checkpoint (weights, optimizer, step, version);
- `POST /train {step, samples, global_tokens, micro_batch_tokens?, release?}`: one GRPO step on
  this replica's samples, the gradient sum over the group, AdamW; rank 0 writes the checkpoint
  the engines then load. With `elastic.enabled` every replica gets the whole step and its
  `ElasticReducer` picks this rank's share from the step's membership (core ranks and ACTIVE
  hybrid replicas, `libra.runtime.elastic`); `release` lists hybrid slots to let go at the end
  of the step, and the answer carries the pool's status;
- `GET /health`, `GET /metrics` (Prometheus).

The driver calls every replica at once; the collective inside each step is what keeps them in
lockstep. A replica that dies makes its peers' collective fail within `collective_timeout_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from libra.runtime.elastic import ElasticReducer
from libra.runtime.serving import bind, serve_until_signalled
from libra.runtime.train import checkpoint as ckpt
from libra.runtime.train.batch import TrainSample, sample_tokens
from libra.runtime.train.config import TrainConfig
from libra.runtime.train.grpo import Objective
from libra.runtime.train.learner import Learner, OptimConfig
from libra.runtime.train.lora import adapter_state, has_lora
from libra.runtime.train.models import train_model
from libra.runtime.train.reducer import SumAllReduce
from libra.runtime.train.warmstart import warm_start

HOST = "127.0.0.1"


def optim_of(cfg: TrainConfig, lr: float) -> OptimConfig:
    t = cfg.trainer
    return OptimConfig(lr, t.betas, t.weight_decay, t.grad_clip, t.micro_batch_tokens)


def objective_of(cfg: TrainConfig) -> Objective:
    t = cfg.trainer
    return Objective(t.clip_low, t.clip_high, t.dual_clip, t.correction, t.tis_cap)


class Replica:
    def __init__(self, cfg: TrainConfig, rank: int, world: int, run: Path, store: dist.Store | None = None):
        self.cfg, self.rank, self.world, self.run, self.store = cfg, rank, world, run, store
        self.elastic: ElasticReducer | None = None
        self.samples: list[TrainSample] = []
        self.global_tokens = 0
        model = train_model(cfg, cfg.seed)  # every replica the same weights: the seed or the checkpoint
        self.learner = Learner(None, cfg.seed, optim_of(cfg, cfg.warmstart.lr), SumAllReduce(), model)
        self.lock = asyncio.Lock()
        self.registry = CollectorRegistry()
        self.m_step = Histogram(
            "libra_trainer_step_seconds", "Wall time of one GRPO step", registry=self.registry
        )
        self.m_tokens = Counter("libra_trainer_tokens", "Model tokens trained", registry=self.registry)
        self.m_version = Gauge("libra_trainer_weight_version", "Weight version after the last step", registry=self.registry)  # fmt: skip

    # ---- the work (run in a thread: torch releases the GIL, the event loop stays responsive) ----

    def warmstart(self) -> dict:
        t0, cfg = time.perf_counter(), self.cfg
        out = warm_start(self.learner, cfg.warmstart, cfg.task, cfg.seed, self.rank, self.world)
        self.learner.reset_optimizer(optim_of(cfg, cfg.trainer.lr))
        path = self._save(0, 0, with_optimizer=False)
        return {"losses": out.losses, "probes": out.probes, "seconds": time.perf_counter() - t0, "checkpoint": path, "fingerprint": self.learner.fingerprint()}  # fmt: skip

    def resume(self, path: str) -> dict:
        """Load a checkpoint of this run, verified against its manifest (`checkpoint`)."""
        info = ckpt.open_checkpoint(Path(path), self.run)
        weights, opt = ckpt.load(info, self.run)
        try:
            self.learner.load(weights, opt, info.step, info.version)
        except (RuntimeError, ValueError, KeyError) as e:  # a state_dict of another model or optimizer
            raise ckpt.CheckpointError(f"checkpoint {path} does not fit this run's model and optimizer ({type(e).__name__}: {str(e)[:200]})") from None  # fmt: skip
        return {"step": info.step, "version": info.version, "fingerprint": self.learner.fingerprint()}

    def train(self, body: dict) -> dict:
        t0 = time.perf_counter()
        samples = [TrainSample.model_validate(s) for s in body["samples"]]
        self.global_tokens = int(body["global_tokens"])
        if body.get("micro_batch_tokens"):  # the selector's packing for this step's context range
            self.learner.optim_cfg = replace(self.learner.optim_cfg, micro_batch_tokens=int(body["micro_batch_tokens"]))  # fmt: skip
        if self.cfg.elastic.enabled:
            samples = self._elastic_share(int(body["step"]), samples, body.get("release") or [])
        stats = self.learner.rl_step(samples, self.global_tokens, objective_of(self.cfg))
        path, weights = self._after_step()
        self.m_step.observe(time.perf_counter() - t0)
        self.m_tokens.inc(stats.tokens)
        self.m_version.set(self.learner.version)
        elastic = self.elastic.status.to_json() if self.elastic is not None else None
        return {**stats.as_dict(), "rank": self.rank, "version": self.learner.version, "checkpoint": path, "weights": weights,
                "fingerprint": self.learner.fingerprint(), "seconds": time.perf_counter() - t0, "elastic": elastic,
                "memory": memory_mb(self.learner.device)}  # fmt: skip

    def _elastic_share(self, step: int, samples: list[TrainSample], release: list[int]) -> list[TrainSample]:
        """This rank's samples of the step, by the membership; the reducer is made at the first RL
        step (after the warm-start or resume), so it snapshots the optimizer RL actually uses."""
        if self.elastic is None:
            self.elastic = ElasticReducer(
                self.learner.model, self.learner.opt, rank=self.rank, core=self.world,
                slots=self.cfg.elastic.hybrid, store=self.store, recompute=self._recompute,
                config=self.cfg.elastic.runtime,
            )  # fmt: skip
            self.learner.reducer = self.elastic
        for slot in release:
            self.elastic.request_release(int(slot))
        self.samples = samples
        return [samples[i] for i in self.elastic.begin_step(step, sample_tokens(samples))]

    def _recompute(self, indices: list[int]) -> None:
        """An ACTIVE hybrid replica's gradients did not come: its share is computed here."""
        self.learner.accumulate(
            [self.samples[i] for i in indices], self.global_tokens, objective_of(self.cfg)
        )

    def _after_step(self) -> tuple[str | None, str | None]:
        """(the checkpoint folder or None, the weights file the engines load), rank 0 only: a full
        checkpoint every `checkpoint_every` steps and at the run's last step, the weights alone
        between them (`checkpoint.publish_weights`)."""
        step, version, every = self.learner.step, self.learner.version, self.cfg.trainer.checkpoint_every
        if self.rank != 0:
            return None, None
        if step % every == 0 or step >= self.cfg.steps:
            path = self._save(step, version, with_optimizer=True)
            return path, str(Path(path) / ckpt.MODEL)
        return None, str(ckpt.publish_weights(self.run / "weights", version, self._weights()))

    def _weights(self) -> dict:
        # What the engines load: the whole state_dict, or with LoRA the adapter alone (lora.py).
        model = self.learner.model
        return adapter_state(model) if has_lora(model) else model.state_dict()

    def _save(self, step: int, version: int, with_optimizer: bool) -> str | None:
        if self.rank != 0:
            return None
        opt = self.learner.opt.state_dict() if with_optimizer else None
        info = ckpt.save(self.run / "checkpoints", step, version, self._weights(), opt, self.cfg.trainer.keep_checkpoints)  # fmt: skip
        return str(info.path)

    # ---- HTTP ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=512 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/warmstart", lambda r: self._call(r, lambda body: self.warmstart()))
        app.router.add_post("/resume", lambda r: self._call(r, lambda body: self.resume(body["path"])))
        app.router.add_post("/train", lambda r: self._call(r, self.train))
        return app

    async def _call(self, request: web.Request, fn) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body must be JSON"}, status=400)
        async with self.lock:
            try:
                return web.json_response(await asyncio.to_thread(fn, body))
            except (
                ckpt.CheckpointError,
                ckpt.NonFiniteWeights,
            ) as e:  # refused: the run cannot go on this way
                return web.json_response({"error": str(e), "refused": True}, status=422)
            except (KeyError, TypeError, ValueError) as e:
                return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=400)
            except RuntimeError as e:  # a collective that failed: a peer is gone
                return web.json_response({"error": f"rank {self.rank}: {e}"}, status=503)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "rank": self.rank, "world": self.world, "step": self.learner.step, "version": self.learner.version})  # fmt: skip

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": "text/plain; version=0.0.4"}
        )


def memory_mb(device: torch.device) -> dict:
    """This process's memory: its peak resident set, and on CUDA the allocator's peak."""
    import resource

    out = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.type == "cuda":
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


def join_group(
    rank: int, world: int, store_addr: str | None, timeout_s: float, backend: str = "gloo"
) -> dist.Store:
    """Rank 0 opens the rendezvous store on a free port and says where; the others connect."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(HOST, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        print(f"trainer store on {HOST}:{store.port}", flush=True)
    else:
        host, port = store_addr.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return store


async def _serve(replica: Replica, sock: socket.socket) -> None:
    runner = web.AppRunner(replica.app(), access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    print(f"trainer rank {replica.rank}/{replica.world} listening on http://{HOST}:{sock.getsockname()[1]}", flush=True)  # fmt: skip
    await serve_until_signalled(runner)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m libra.runtime.train.worker")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--config", required=True, help="The run's TrainConfig as JSON.")
    ap.add_argument("--run", required=True, help="The run folder (checkpoints go under it).")
    ap.add_argument("--store", default=None, help="HOST:PORT of rank 0's store (ranks > 0).")
    a = ap.parse_args(argv)
    cfg = TrainConfig.model_validate(json.loads(Path(a.config).read_text()))
    torch.set_num_threads(cfg.trainer.threads)
    sock = bind(HOST, 0)
    if cfg.trainer.device.startswith("cuda"):  # one GPU per replica, by rank
        torch.cuda.set_device(a.rank % max(1, torch.cuda.device_count()))
    backend = "nccl" if cfg.trainer.device.startswith("cuda") else "gloo"
    store = join_group(a.rank, a.world, a.store, cfg.trainer.collective_timeout_s, backend)
    replica = Replica(cfg, a.rank, a.world, Path(a.run), store)
    asyncio.run(_serve(replica, sock))
    # No destroy_process_group: it waits on peers that may be gone; exiting closes the sockets.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

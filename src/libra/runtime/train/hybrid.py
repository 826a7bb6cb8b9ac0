"""A hybrid trainer replica: the process the elastic pool starts in a drained engine's slot.

    python -m libra.runtime.train.hybrid --slot S --world N --store HOST:PORT --config RUN/config.json

It starts on standby: the pool prestarts it (interpreter, imports, its model) while the slot's
engine still serves, so a borrow does not pay a process start on the critical path; it touches
nothing of the core until `POST /join`. It never joins the core gloo group. It runs
`libra.runtime.elastic.Joiner` against its core partner (found through the core's rendezvous
store): REQUESTED -> FETCHING_STATE (the partner's snapshot of weights and AdamW) -> ZERO_SYNC ->
ACTIVATING -> ACTIVE, then trains its share of each step until the partner releases it, and
exits; any failure makes it exit too (the slot goes back to rollout). It trains with the core's own `Learner` (same model class, same GRPO loss over
the step's global tokens, same clip and AdamW step), so it is bitwise equal to the core.

Its HTTP door: `POST /join` (leave standby and join), `POST /samples {step, samples,
global_tokens}` (the driver sends every step to every hybrid replica; a replica's share is decided
by the membership, as on the core) and `GET /health` (its join's outcome once it has one).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from aiohttp import web

from libra.runtime.elastic import Joiner
from libra.runtime.engine.config import PRESETS
from libra.runtime.serving import bind
from libra.runtime.train.batch import TrainSample, sample_tokens
from libra.runtime.train.config import TrainConfig
from libra.runtime.train.learner import Learner
from libra.runtime.train.reducer import LocalReducer
from libra.runtime.train.worker import HOST, objective_of, optim_of


class StepFeed:
    """Each step's samples as the driver posts them; the joiner waits for the step it computes."""

    def __init__(self, learner: Learner, cfg: TrainConfig):
        self.learner, self.cfg = learner, cfg
        self.steps: dict[int, tuple[list[TrainSample], int]] = {}
        self.cond = threading.Condition()

    def put(self, step: int, samples: list[TrainSample], global_tokens: int) -> None:
        with self.cond:
            self.steps[step] = (samples, global_tokens)
            for old in [s for s in self.steps if s < step - 4]:
                del self.steps[old]
            self.cond.notify_all()

    def _get(self, step: int) -> tuple[list[TrainSample], int]:
        with self.cond:
            self.cond.wait_for(lambda: step in self.steps)
            return self.steps[step]

    # the joiner's StepWork
    def tokens(self, step: int) -> list[int]:
        return sample_tokens(self._get(step)[0])

    def backward(self, model, step: int, indices: list[int]) -> None:
        samples, total = self._get(step)
        self.learner.accumulate([samples[i] for i in indices], total, objective_of(self.cfg))


def _update(learner: Learner):
    def update(model, optimizer) -> None:
        learner.update()
        optimizer.zero_grad(set_to_none=True)

    return update


async def _serve(feed: StepFeed, outcome: dict, slot: int, join: asyncio.Event, done: asyncio.Event) -> None:
    async def joined(request: web.Request) -> web.Response:
        join.set()
        return web.json_response({"ok": True})

    async def samples(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            feed.put(int(body["step"]), [TrainSample.model_validate(s) for s in body["samples"]], int(body["global_tokens"]))  # fmt: skip
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"{type(e).__name__}: {str(e)[:200]}"}, status=400)
        return web.json_response({"ok": True})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"slot": slot, **outcome})

    app = web.Application(client_max_size=512 * 2**20)
    app.router.add_post("/join", joined)
    app.router.add_post("/samples", samples)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = bind(HOST, 0)
    await web.SockSite(runner, sock).start()
    print(f"hybrid slot {slot} on standby, listening on http://{HOST}:{sock.getsockname()[1]}", flush=True)
    await done.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m libra.runtime.train.hybrid")
    ap.add_argument("--slot", type=int, required=True)
    ap.add_argument("--world", type=int, required=True, help="Core replicas.")
    ap.add_argument("--store", required=True, help="HOST:PORT of the core's rendezvous store.")
    ap.add_argument("--config", required=True, help="The run's TrainConfig as JSON.")
    a = ap.parse_args(argv)
    cfg = TrainConfig.model_validate(json.loads(Path(a.config).read_text()))
    torch.set_num_threads(cfg.trainer.threads)
    host, port = a.store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=cfg.elastic.runtime.connect_timeout_s)
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)
    # Its own seed: the partner's snapshot must replace these weights (a test would see if not).
    learner = Learner(PRESETS[cfg.engine.model], cfg.seed + 1000 + a.slot, optim_of(cfg, cfg.trainer.lr), LocalReducer())  # fmt: skip
    feed, outcome = StepFeed(learner, cfg), {}
    joiner = Joiner(a.slot, a.world, cfg.elastic.hybrid, learner.model, learner.opt, feed, store,
                    update=_update(learner), config=cfg.elastic.runtime,
                    on_step=lambda step: outcome.update(applied=step, weights=learner.fingerprint()))  # fmt: skip

    async def run() -> None:
        join, done = asyncio.Event(), asyncio.Event()
        server = asyncio.create_task(_serve(feed, outcome, a.slot, join, done))
        await join.wait()  # standby until the pool has drained and stopped the slot's engine
        print(f"hybrid slot {a.slot}: joining", flush=True)
        outcome["outcome"] = await asyncio.to_thread(joiner.run)
        # The weights' digest after the last step it applied: equal to the core's checkpoint of that step.
        print(f"hybrid slot {a.slot}: {outcome['outcome']} (last step applied: {outcome.get('applied')}, weights {outcome.get('weights')})", flush=True)  # fmt: skip
        done.set()
        await server

    asyncio.run(run())
    sys.stdout.flush()
    os._exit(0)  # the joiner's thread may still wait on a step that will never come


if __name__ == "__main__":
    sys.exit(main())

"""`libra train`: the driver. Its loop is the algorithm; everything else is in small modules.

start the processes (engines, gateway, actions service, trainer replicas)
warm-start the trainers (or resume a checkpoint) and publish those weights
start rollouts in the background (bounded staleness)
for each step:
    groups  <- the step's finished GRPO groups (rollouts, with rewards)
    samples <- advantages, one token sequence and loss mask per trajectory
    train the replicas on them (gradients summed over the gloo group), checkpoint
    publish the new weights through the gateway (pause, update, continue)
    decision <- the planner's controller on the step's report; carry it out (elastic pool, fleet)
    record the step and the decision (steps.json, timeline, metrics)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from libra.core.curves import CurveOptions
from libra.core.errors import InfeasibleError
from libra.planner.staleness import StalenessGate
from libra.runtime.launch.base import Launcher, LaunchError
from libra.runtime.train import checkpoint as ckpt
from libra.runtime.train import cluster as procs
from libra.runtime.train.agent import AgentEnv, make_agent_loop
from libra.runtime.train.chat import GatewayChat, sampling_of
from libra.runtime.train.config import TrainConfig
from libra.runtime.train.control import (
    Publisher,
    PublishFailed,
    TrainerLost,
    TrainerRefused,
    Trainers,
    TrainResult,
)
from libra.runtime.train.fleet import LiveFleet
from libra.runtime.train.gateway_admin import GatewayAdmin
from libra.runtime.train.metrics import DriverMetrics
from libra.runtime.train.partial import PartialRollouts
from libra.runtime.train.planning import StageLayout, decide, decision_log, make_controller, step_report
from libra.runtime.train.pool import make_pool
from libra.runtime.train.report import RunFolder, WarmStartRecord
from libra.runtime.train.rollout import RolloutFailed, Rollouts, RolloutShape
from libra.runtime.train.samples import to_samples
from libra.runtime.train.steps import StepClock, step_record, trace_step
from libra.runtime.train.task import ProblemStream
from libra.runtime.train.tools import ActionsUnreachable, InProcessTools, SandboxTools, SlowFrom
from libra.runtime.train.trajectory import Trajectory, TrajState

BASE_STREAM = 2_000_003  # added to the seed: the base measurement's problems, drawn by nothing else


class RunStopped(RuntimeError):
    """The run cannot go on; the message says why and how to resume."""


@dataclass(slots=True)
class Start:
    step: int
    version: int
    checkpoint: str


async def train(cfg: TrainConfig, run: Path, launcher: Launcher, resume: ckpt.CheckpointInfo | None, progress=None,
                curves: CurveOptions | None = None) -> dict:  # fmt: skip
    """Run `cfg` in the run folder `run`, from the verified checkpoint `resume` (`ckpt.resume_point`)
    or from a warm-start; per-step curves go where `curves` says."""
    folder, metrics = RunFolder(run, time.time(), curves), DriverMetrics()
    port = metrics.serve(cfg.metrics_port)
    if progress is not None and port:
        progress.note(f"driver metrics on http://127.0.0.1:{port}/metrics")
    try:
        cluster = await asyncio.to_thread(procs.start, cfg, run, launcher)
    except LaunchError as e:
        raise RunStopped(f"could not start the run's processes: {e}") from None
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            await _loop(cfg, cluster, http, folder, metrics, resume, progress)
    except (TrainerLost, TrainerRefused, RolloutFailed, ActionsUnreachable, PublishFailed) as e:
        raise RunStopped(stop_message(e, run)) from None
    finally:
        await asyncio.to_thread(cluster.save_metrics)
        await asyncio.to_thread(cluster.stop)
        summary = folder.finish(metrics.text())
    return summary


def stop_message(e: Exception, run: Path) -> str:
    what = {TrainerLost: "a trainer replica was lost", TrainerRefused: "a trainer refused to go on", RolloutFailed: "rollout failed",
            ActionsUnreachable: "the actions service is unreachable", PublishFailed: "weight publication failed"}[type(e)]  # fmt: skip
    found = ckpt.latest(run / "checkpoints")
    where = (f"the newest checkpoint is step {found.step} ({found.path}); resume with: libra train --out {run} --resume"
             if found else "no checkpoint was written yet")  # fmt: skip
    return f"{what}: {e}. The run stopped; {where}"


async def _loop(cfg, cluster, http, folder, metrics, resume, progress) -> None:
    trainers = Trainers(cluster.trainer_urls, http, cfg.trainer.collective_timeout_s + 60)
    publisher = Publisher(cluster.gateway_url, http, cfg.publish.pause_mode, cfg.publish.admin_token)
    start = await _guard(cluster, _prepare(cfg, trainers, folder, resume, progress))
    await publisher.publish(str(Path(start.checkpoint) / ckpt.MODEL), start.version)
    if cfg.task.base_eval and start.step == 0:
        folder.base = await _guard(cluster, held_out_success(cfg, _env(cfg, cluster, http), 0))
        _note_eval(progress, "base model", folder.base, cfg)
    rollouts = _rollouts(cfg, cluster, http, start.step)
    admin = GatewayAdmin(cluster.gateway_url, http, cfg.publish.admin_token)
    controller = make_controller(cfg)
    pool, layout = make_pool(cfg, cluster, admin, http), StageLayout(cfg)
    fleet = LiveFleet(cfg, cluster, admin, pool.slot_engines())
    pool.prestart()  # hybrid trainers on standby, so a borrow does not wait for a process start
    rollouts.start()
    try:
        for step in range(start.step, cfg.steps):
            clock = StepClock(time.time())
            groups = await _guard(cluster, rollouts.take(step))  # rollouts and rewards
            clock.mark("rollout")
            samples = to_samples(groups, cfg.trainer.normalize_std, cfg.trainer.negative_weight, sampling_of(cfg.rollout))  # fmt: skip
            packing, selected = _select(layout, samples)  # EARL: the layout for this context range
            if cfg.pipeline.colocated_partial:  # rollout and training take turns
                await publisher.pause()
            result = await _guard(
                cluster, _train(cfg, trainers, pool, step, samples, packing)
            )  # train, checkpoint
            clock.mark("train")
            model = result.weights
            pub = await publisher.publish(model, result.version)
            rollouts.mark_trained(step + 1)
            await publisher.end_step()
            await pool.boundary(model, result.version)  # engines back from training serve again
            clock.mark("publish")
            pressure = await admin.pressure(cfg.engine.max_num_seqs)
            report = step_report(step, groups, clock.seconds("train"), pressure)
            decision = decide(controller, report, fleet.plan, pool.view())
            pool.carry_out(decision.elastic)  # borrow / release in the background
            fleet.carry_out(decision.replan)  # engines change bucket, boundaries move, in the background
            rec = step_record(step, groups, samples, result, pub, clock, rollouts.drops.take())
            rec.planner, rec.elastic, rec.selector = decision_log(decision, report), pool.record(), selected
            rec.fleet, rec.carried = fleet.record(), rollouts.carried
            folder.record(rec)
            if cfg.save_trajectories:
                folder.save_trajectories(step, groups)
            trace_step(folder.timeline, step, groups, clock)
            _observe(metrics, rec)
            if progress is not None:
                progress.step(rec)
            if _evaluates(cfg, step):  # the same held-out problems as the base, with this step's weights
                folder.held_out.append(
                    await _guard(cluster, held_out_success(cfg, _env(cfg, cluster, http), step + 1))
                )
                _note_eval(progress, f"after step {step}", folder.held_out[-1], cfg)
    except asyncio.CancelledError:  # interrupted (Ctrl-C): the steps so far stay, counted as such
        folder.interrupted = True
        raise
    finally:
        folder.unfinished = rollouts.running()  # 0 after the last step; on an interrupt, counted
        await rollouts.stop()
        await pool.stop()
        await fleet.stop()


def _select(layout: StageLayout, samples) -> tuple[int, dict]:
    try:
        return layout.before(samples)
    except InfeasibleError as e:
        raise RunStopped(f"the selector refused this step: {e} (trainer.memory_budget_mb)") from None


async def _train(cfg: TrainConfig, trainers: Trainers, pool, step: int, samples, packing: int) -> TrainResult:
    """The core replicas train the step; hybrid replicas get it too (their share is decided by
    the elastic membership on the core); the pool then mirrors the core's view of each join."""
    extra = {
        "micro_batch_tokens": packing,
        **({"release": pool.take_releases()} if cfg.elastic.enabled else {}),
    }
    total = sum(s.n_model_tokens for s in samples)
    result, _ = await asyncio.gather(trainers.train(step, samples, cfg.elastic.enabled, extra), pool.feed(step, samples, total))  # fmt: skip
    pool.sync(result.replicas[0].get("elastic"))
    return result


async def _prepare(cfg: TrainConfig, trainers: Trainers, folder: RunFolder, resume: ckpt.CheckpointInfo | None, progress) -> Start:  # fmt: skip
    """Resume the checkpoint the CLI verified, or warm-start from scratch."""
    found = resume
    if found is not None:
        await trainers.resume(str(found.path))
        folder.load_previous(found.step)
        if progress is not None:
            progress.note(f"resuming from step {found.step} ({found.path})")
        return Start(found.step, found.version, str(found.path))
    out = await trainers.warmstart()
    probes = out[0]["probes"]
    ws = folder.warmstart = WarmStartRecord(len(out[0]["losses"]), probes[-1][1] if probes else None)
    if progress is not None:
        ok = f", probe success {ws.probe_success:.2f}" if ws.probe_success is not None else ""
        progress.note(f"warm-start: {ws.steps} supervised steps{ok}")
    return Start(0, 0, next(r["checkpoint"] for r in out if r.get("checkpoint")))


def _env(cfg: TrainConfig, cluster, http: aiohttp.ClientSession) -> AgentEnv:
    r = cfg.rollout
    chat = GatewayChat(cluster.gateway_url, procs.MODEL_NAME, http, r.turn_timeout_s, cfg.publish.admin_token)
    tools = SandboxTools(cluster.actions_url, http) if cfg.task.tool == "sandbox" else InProcessTools()
    tools = SlowFrom(tools, cfg.task.slow_tool_s, cfg.task.slow_tool_from)
    return AgentEnv(chat, tools, sampling_of(r))


def _evaluates(cfg: TrainConfig, step: int) -> bool:
    """After the last step, and every `task.eval_every` steps, when held-out problems are set."""
    every = cfg.task.eval_every
    return bool(cfg.task.base_eval) and (step == cfg.steps - 1 or (every > 0 and (step + 1) % every == 0))


def _note_eval(progress, what: str, out: dict, cfg: TrainConfig) -> None:
    if progress is not None:
        progress.note(f"{what}: held-out success {out['greedy']} greedy, {out['sampled']} sampled ({cfg.task.base_eval} problems)")  # fmt: skip


async def held_out_success(cfg: TrainConfig, env: AgentEnv, trained_steps: int) -> dict:
    """The model's success on `task.base_eval` held-out problems (a stream neither training nor
    the warm-start draws; the same problems every time), greedy (temperature 0) and sampled (the
    rollouts'), with the weights the engines serve after `trained_steps` steps (0: the base)."""
    out = {"problems": cfg.task.base_eval, "trained_steps": trained_steps}
    for label, temp in (("greedy", 0.0), ("sampled", cfg.rollout.temperature)):
        problems = ProblemStream.of(cfg.seed + BASE_STREAM, cfg.task)
        run_env = replace(env, sampling=replace(env.sampling, temperature=temp))
        loop = make_agent_loop(cfg.rollout.agent_loop)
        trajs = [Trajectory(f"base-{label}-{i}", f"base{i}", i, -1) for i in range(cfg.task.base_eval)]
        await asyncio.gather(*(loop.run(problems.next(), t, run_env) for t in trajs))
        done = [t for t in trajs if t.state == TrajState.FINISHED]
        out[label] = sum(t.success for t in done) / len(done) if done else None
        out[f"{label}_dropped"] = len(trajs) - len(done)
    return out


def _rollouts(cfg: TrainConfig, cluster, http: aiohttp.ClientSession, step: int) -> Rollouts:
    r = cfg.rollout
    env = _env(cfg, cluster, http)
    tools = env.tools
    p = cfg.pipeline
    # Each resumed step draws fresh problems: the stream is seeded by the step it starts at.
    problems = ProblemStream.of(cfg.seed * 1_000_003 + 2 + step, cfg.task)
    shape = RolloutShape(r.groups_per_step, r.group_size, r.max_drop_fraction)
    loop = make_agent_loop(r.agent_loop)
    if p.colocated_partial:
        rollouts: Rollouts = PartialRollouts(shape, p.staleness, p.over_provision, problems, loop, env, step, cfg.steps - 1)  # fmt: skip
    else:
        rollouts = Rollouts(shape, StalenessGate(p.staleness, p.consume), problems, loop, env, step, cfg.steps - 1)  # fmt: skip
    tools.trained = lambda: rollouts.trained
    return rollouts


async def _guard(cluster, coro):
    """Await `coro`, but stop at once if a trainer replica's process has died meanwhile (a dead
    replica's peers would otherwise wait on their collective until it times out)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            dead = [p for p in cluster.dead() if p.role == "trainer"]
            if dead:
                raise TrainerLost(f"{dead[0].handle.name} exited with code {dead[0].handle.returncode()}")
    finally:
        task.cancel()


def _observe(m: DriverMetrics, rec) -> None:
    m.step.set(rec.step + 1)
    m.version.set(rec.weight_version)
    m.success.set(rec.success)
    m.reward.set(rec.reward)
    for phase in ("rollout_wait_s", "train_s", "publish_s"):
        m.step_s.labels(phase.removesuffix("_s")).observe(getattr(rec, phase))
    m.trained.inc(rec.trained)
    for reason, n in rec.dropped["reasons"].items():
        m.dropped.labels(reason).inc(n)
    m.tokens.labels("all").inc(rec.tokens["total"])
    m.tokens.labels("model").inc(rec.tokens["model"])

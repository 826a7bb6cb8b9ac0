"""`libra train` end to end, as a user runs it: real processes (2 engines in 2 buckets behind the
C-MLFQ gateway, the bubblewrap actions service, 2 gloo trainer replicas), real HTTP, real faults.

- the smoke run (local subprocesses, and the same under Ray): every trained trajectory's model
  tokens have ids, logprobs and a weight version, the logprobs are what the checkpoint of that
  version gives, weight versions increase, replicas stay bitwise equal, nothing is lost;
- an engine SIGKILLed mid-rollout, then a trainer replica in the same run: the gateway fails the
  engine's sessions over and the run goes on, every trajectory trained or counted as dropped with
  a reason; the trainer's death stops the run with a clear message naming the checkpoint, and
  `--resume` continues from it;
- an unreachable actions service: a clear error within seconds, not a hang.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from libra.runtime.engine.config import PRESETS
from libra.runtime.engine.model import TinyTransformer, token_logprobs
from libra.runtime.train.config import load_train_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="the actions service needs bubblewrap"),
]

MODEL = PRESETS[load_train_config(None, []).engine.model]  # the runs' model: the default config's

SMALL = ["--set", "warmstart.steps=2", "--set", "warmstart.batch=4", "--set", "rollout.groups_per_step=2",
         "--set", "rollout.group_size=4", "--set", "trainer.keep_checkpoints=20", "--set", "metrics_port=-1"]  # fmt: skip


def libra_train(out: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "libra", "train", "--out", str(out), *SMALL, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def start_train(out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "libra", "train", "--out", str(out), *SMALL, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def steps_of(out: Path) -> list[dict]:
    f = out / "steps.json"
    return json.loads(f.read_text()) if f.exists() else []


def wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while len(steps_of(out)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.2)


def pid_of(out: Path, name: str) -> int:
    return next(p["pid"] for p in json.loads((out / "processes.json").read_text()) if p["name"] == name)


def check_smoke(out: Path, r: subprocess.CompletedProcess, steps: int) -> None:
    assert r.returncode == 0, r.stderr[-3000:]
    recs = steps_of(out)
    assert [x["step"] for x in recs] == list(range(steps))
    assert [x["weight_version"] for x in recs] == list(range(1, steps + 1))
    assert all(x["trained"] == 8 and x["dropped"]["trajectories"] == 0 for x in recs)
    assert all(x["replicas_equal"] for x in recs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["unfinished"] == 0 and summary["trained"] == 8 * steps
    for f in ("reward.png", "trace.json", "metrics.prom", "processes.json"):
        assert (out / f).stat().st_size > 0, f
    check_tokens(out, recs)
    check_decisions(recs)
    # the trainer's log-probs of the tokens sampled with its own weights are the engines'
    assert all(x["loss"]["same_version_gap_max"] < 1e-3 for x in recs)
    assert all(max(x["staleness"]["groups"]) <= 1 for x in recs)  # pipeline.staleness 1, kept
    check_curves(out, steps)


def check_curves(out: Path, steps: int) -> None:
    """TensorBoard has each step's reward, success, step time split, staleness and decisions."""
    from tests.test_curves import read_events

    got = read_events(out / "tb")
    for tag in ("reward", "success", "step_time_s/train", "step_time_s/rollout_wait", "tokens_per_s",
                "staleness/max", "loss/policy", "controller/replan"):  # fmt: skip
        assert [s for s, _ in got[tag]] == list(range(steps)), tag


def check_decisions(recs: list[dict]) -> None:
    """The planner's controller decided after every step, on that step's measured report, and
    said why; EARL's selector chose a packing that holds the step's longest sample."""
    decided = [[256, 8192]]  # the configured boundaries, then every re-plan's
    for x in recs:
        p, rep, sel = x["planner"], x["planner"]["report"], x["selector"]
        assert p["step"] == x["step"] and p["reason"] and p["trigger"] in ("none", "interval", "imbalance")
        if p["replan"] is not None:  # one engine per bucket: only the boundary moves, for free
            assert p["replan"]["instances"] == [1, 1] and p["replan"]["reconfig_s"] == 0.0
            decided.append(p["replan"]["boundaries"])
        # the fleet serves a decided layout (a re-plan is carried out in the background)
        fleet = x["fleet"]
        assert [b["name"] for b in fleet["buckets"]] == ["short", "long"] and fleet["moved"] == 0
        assert [b["engines"] for b in fleet["buckets"]] == [["engine-short-0"], ["engine-long-0"]]
        assert [b["max_context"] for b in fleet["buckets"]] in decided
        assert rep["t_train_s"] == pytest.approx(x["train_s"]) and rep["t_rollout_s"] > 0
        assert rep["ratio"] == pytest.approx(rep["t_train_s"] / rep["t_rollout_s"])
        assert rep["trajectories"] == x["trained"] and 0 <= rep["rollout_pressure"]
        assert sel["longest"] <= sel["context_bound"] <= sel["micro_batch_tokens"] and sel["reason"]


def check_tokens(out: Path, recs: list[dict]) -> None:
    """Every model token has an id, a logprob and a version, and the logprob is the checkpoint's."""
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == sum(x["trained"] for x in recs)
    models: dict[int, TinyTransformer] = {}
    worst = 0.0
    for t in trajs:
        for turn in t["turns"]:
            ids, lps, vers = turn["token_ids"], turn["logprobs"], turn["weight_versions"]
            assert ids and len(ids) == len(lps) == len(vers)
            assert turn["kv_versions"] == vers  # pause_mode retract: a token's KV is of its own weights
            assert all(math.isfinite(x) and x <= 0 for x in lps) and all(v >= 0 for v in vers)
            v = vers[0]
            if v not in models:
                m = models[v] = TinyTransformer(MODEL, 0)
                m.load_state_dict(torch.load(weights_file(out, v), weights_only=True))
            if len(set(vers)) == 1:
                seq = torch.tensor([turn["prompt_ids"] + ids])
                ours = token_logprobs(models[v], seq)[0, len(turn["prompt_ids"]) - 1 :]
                worst = max(worst, (ours - torch.tensor(lps)).abs().max().item())
    assert worst < 1e-3, worst


def weights_file(out: Path, version: int) -> Path:
    """Version `version`'s weights: its checkpoint's model.pt, or between two checkpoints
    (`trainer.checkpoint_every`) the weights published alone."""
    full = out / "checkpoints" / f"step-{version:06d}" / "model.pt"
    return full if full.exists() else out / "weights" / f"version-{version:06d}.pt"


def test_smoke_local(tmp_path):
    out = tmp_path / "run"
    held_out = ["--set", "task.base_eval=4", "--set", "task.eval_every=2"]
    every = ["--set", "trainer.checkpoint_every=2"]
    r = libra_train(out, "--steps", "3", "--set", "save_trajectories=true", *held_out, *every)
    check_smoke(out, r, 3)
    # full checkpoints after the warm-start, every 2 steps and at the last; step 1's weights alone
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000000", "step-000002", "step-000003"]  # fmt: skip
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["version-000001.pt"]
    assert "libra train" in r.stdout  # the final table
    # the held-out problems measured before training, after step 1 (every 2 steps) and after the last
    summary = json.loads((out / "summary.json").read_text())
    evals = [summary["base_success"], *summary["held_out"]]
    assert [e["trained_steps"] for e in evals] == [0, 2, 3]
    assert all(e["problems"] == 4 and e["greedy_dropped"] == e["sampled_dropped"] == 0 for e in evals)
    assert all(0 <= e["greedy"] <= 1 and 0 <= e["sampled"] <= 1 for e in evals)


def test_colocated_partial_rollouts(tmp_path):
    """APRIL live (`pipeline.mode: colocated-partial`): twice a step's groups in flight, the step
    stops at its target, the rest are carried (engines paused while the trainer trains) and
    resume; every trained group within the staleness bound, none left over, none lost."""
    out = tmp_path / "run"
    r = libra_train(out, "--steps", "3", "--set", "save_trajectories=true", "--set", "pipeline.mode=colocated-partial")  # fmt: skip
    check_smoke(out, r, 3)
    recs = steps_of(out)
    assert all(x["carried"] is not None and 0 <= x["carried"] <= 4 for x in recs)  # at most 2 x 2 in flight
    assert recs[-1]["carried"] == 0  # the last step leaves nothing in flight


def test_smoke_ray(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "run"
    r = libra_train(out, "--steps", "3", "--launcher", "ray", "--set", "save_trajectories=true")
    check_smoke(out, r, 3)


def test_an_engine_killed_fails_over_then_a_trainer_killed_stops_clearly_and_resumes(tmp_path):
    """Two faults in one run: an engine SIGKILLed mid-rollout (the gateway fails its sessions
    over, the run goes on, nothing is lost), then a trainer replica SIGKILLed (the run stops with
    a message naming the checkpoint), then `--resume` continues from that checkpoint: the newest
    full one (every 3 steps here), the steps after it trained again."""
    out = tmp_path / "run"
    proc = start_train(out, "--steps", "8", "--set", "trainer.checkpoint_every=3")
    wait_for_steps(out, 1, proc)
    os.kill(pid_of(out, "engine-long-0"), signal.SIGKILL)
    wait_for_steps(out, 4, proc)  # ...the run goes on without it
    os.kill(pid_of(out, "trainer-1"), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    assert "trainer" in stderr and "resume with: libra train" in stderr, stderr[-2000:]
    recs = steps_of(out)
    done = len(recs)
    assert done >= 4 and [x["weight_version"] for x in recs] == list(range(1, done + 1))
    for x in recs:  # nothing lost: trained, or dropped with a reason
        assert x["trained"] == 8
        assert sum(x["dropped"]["reasons"].values()) == x["dropped"]["trajectories"]
    assert all(
        set(x["routing"]["turns_by_bucket"]) == {"short"} for x in recs[2:]
    )  # only the survivor serves
    newest = max(int(p.name[5:]) for p in (out / "checkpoints").iterdir() if "tmp" not in p.name)
    assert newest % 3 == 0 and newest <= done, newest
    r = libra_train(out, "--steps", str(done + 1), "--resume", "--set", "trainer.checkpoint_every=3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step {newest}" in r.stdout + r.stderr, r.stdout[-2000:]
    recs = steps_of(out)
    assert [x["step"] for x in recs] == list(range(done + 1))
    assert [x["weight_version"] for x in recs] == list(range(1, done + 2))


def test_unreachable_actions_service_is_a_clear_error(tmp_path):
    """Not a hang: the start-up check gives up after `actions.connect_timeout_s` and says so
    (the subprocess timeout is only the net under a hang, not a figure)."""
    r = libra_train(tmp_path / "run", "--steps", "2", "--set", "actions.url=http://127.0.0.1:9", "--set", "actions.connect_timeout_s=2", timeout=300)  # fmt: skip
    assert r.returncode == 1 and "actions service" in r.stderr and "unreachable" in r.stderr, r.stderr[-2000:]
    assert "after 2 s (actions.url, actions.connect_timeout_s)" in r.stderr, r.stderr[-2000:]

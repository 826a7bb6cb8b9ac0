"""The hybrid pool live in `libra train` (issue 28), as a user runs it: real processes (engines
behind the gateway, gloo trainer replicas, a hybrid trainer process), real drain, real join.

One run whose pool follows a schedule (`elastic.policy.schedule`: one hybrid replica from step 1,
none from step 3), so the cycle happens in a known order however fast the machine runs: the
borrow waits for the standby trainer to start, the release for the join to be ACTIVE. The run is
interrupted (SIGINT, as Ctrl-C) once the engine is back, and must stop cleanly, saying how to
resume. The hysteresis rule that decides it in a normal run is pure and tested on given stage times
(tests/test_elastic.py), and `libra train --config elastic-demo` shows it deciding live (docs/
elastic.md). The join needs one zero-gradient step (`elastic.runtime.sync_steps`). It checks, from
what the run leaves behind: the engine was drained and the join reached ACTIVE (the borrowed
replica counted for a step at least); a release happened and the slot's engine came back (loaded
the newest weights, and the gateway lists it again, up); the hybrid replica's weights after its
last step equal the core's checkpoint of that step, bit for bit; no trajectory was lost.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from libra.runtime.engine.config import PRESETS
from libra.runtime.engine.model import TinyTransformer
from libra.runtime.train.config import load_train_config
from libra.runtime.train.learner import weights_digest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = """
steps: 60
task: {tool: in_process}
rollout: {groups_per_step: 2, group_size: 8, max_tokens: 16}
pipeline: {staleness: 1, consume: completion}
buckets:
  - {name: short, tp: 1, max_context: 256, instances: 3}
  - {name: long, tp: 2, max_context: 8192, instances: 1}
trainer: {replicas: 1, micro_batch_tokens: 1024, keep_checkpoints: 100}
warmstart: {steps: 2, batch: 4}
elastic: {enabled: true, hybrid: 1, runtime: {sync_steps: 1}, policy: {schedule: {1: 1, 3: 0}}}
metrics_port: -1
"""
TRAJECTORIES = 16  # per step


def fingerprint(model_pt: Path) -> str:
    """The trainer's weight digest (`Learner.fingerprint`) of a checkpoint."""
    m = TinyTransformer(PRESETS[load_train_config(None, []).engine.model], 0)
    m.load_state_dict(torch.load(model_pt, weights_only=True))
    return weights_digest(m)


def test_borrow_join_release_and_the_engine_comes_back(tmp_path):
    out, cfg = tmp_path / "run", tmp_path / "elastic.yaml"
    cfg.write_text(CONFIG)
    proc = subprocess.Popen([sys.executable, "-m", "libra", "train", "--config", str(cfg), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        wait_until_back(out, proc)
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert f"resume with: libra train --config {cfg} --out {out} --resume" in stderr, stderr[-2000:]
    listed = {(p["name"], p["role"]) for p in json.loads((out / "processes.json").read_text())}
    assert ("engine-short-2", "engine") in listed  # the slot's engine, restarted, is listed again
    assert not alive(out), "processes left behind after the interrupt"
    check_cycle(out)


def wait_until_back(out: Path, proc: subprocess.Popen, timeout: float = 450) -> None:
    """Until a step after the one whose record says the engine is back in rollout."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the pool did not complete its cycle"
        recs = json.loads((out / "steps.json").read_text()) if (out / "steps.json").exists() else []
        back = [x["step"] for x in recs if any("back in rollout" in e for e in x["elastic"]["events"])]
        if back and recs[-1]["step"] > back[0]:
            return
        time.sleep(0.5)


def alive(out: Path) -> list[str]:
    """The run's processes still running (a pid whose command line is still a libra process)."""
    left = []
    for p in json.loads((out / "processes.json").read_text()):
        cmd = Path(f"/proc/{p['pid']}/cmdline")
        if cmd.exists() and b"libra" in cmd.read_bytes():
            left.append(p["name"])
    return left


def check_cycle(out: Path) -> None:
    recs = json.loads((out / "steps.json").read_text())
    pool = [x["elastic"] for x in recs]
    events = [e for p in pool for e in p["events"]]
    # borrowed: drained, the standby trainer told to join, and counted (ACTIVE) for a step at least
    assert any("borrow: schedule: 1 from step" in e for e in events), [
        x["planner"]["elastic"]["reason"] for x in recs
    ]
    assert any("trainer joins in engine-short-2's slot: drained in" in e for e in events), events
    active = [x["step"] for x, p in zip(recs, pool, strict=True) if p["hybrid_active"] >= 1]
    # (the step after a release is decided, the replica still counts: RELEASING in the driver)
    assert active and all(
        p["states"]["hybrid-0"] in ("ACTIVE", "RELEASING") for p in pool if p["hybrid_active"]
    )
    # released: the core let it go, and the engine is back in rollout with the newest weights
    assert any("release: schedule: 0 from step" in e for e in events), events
    back = next(x["step"] for x, p in zip(recs, pool, strict=True) if p["releases"] >= 1)
    assert back > max(active) and pool[-1]["rollbacks"] == 0 and pool[-1]["states"]["hybrid-0"] == "ROLLOUT"
    assert any("back in rollout with the newest weights" in e for e in events)
    # ...and the gateway has it again (it was removed for the borrow), up
    prom = (out / "gateway-metrics.prom").read_text()
    assert 'libra_gateway_instance_up{bucket="short",instance="engine-short-2",state="active/up"} 1.0' in prom
    # the hybrid replica was bitwise the core: its weights after its last step are the checkpoint's
    log = (out / "logs" / "hybrid-0.log").read_text()
    m = re.search(r"hybrid slot 0: released \(last step applied: (\d+), weights (\w+)\)", log)
    assert m, log[-2000:]
    assert fingerprint(out / "checkpoints" / f"step-{int(m.group(1)) + 1:06d}" / "model.pt") == m.group(2)
    # nothing lost, every core replica equal after every step
    assert all(x["replicas_equal"] for x in recs)
    assert all(x["trained"] == TRAJECTORIES and x["dropped"]["trajectories"] == 0 for x in recs)
    summary = json.loads((out / "summary.json").read_text())  # interrupted: what was in flight is counted
    assert summary["interrupted"] and summary["unfinished"] >= 0 and summary["steps"] == len(recs)

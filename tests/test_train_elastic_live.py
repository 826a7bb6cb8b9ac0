"""The hybrid pool live in `libra train` (issue 28), as a user runs it: real processes (engines
behind the gateway, gloo trainer replicas, a hybrid trainer process), real drain, real join.

One short run of `elastic-demo`'s shape whose settings make the planner's controller borrow early
(one core replica trains 192 samples a step, so training is the slower stage) and release later
(from step 6 every tool call waits 20 s, so rollout becomes the slower stage); the join needs one
zero-gradient step (`elastic.runtime.sync_steps`) instead of two, and the controller borrows
from r >= 1.05 (the default 1.15 leaves less margin on a machine where the stages are closer). It checks, from what the run
leaves behind: the engine was drained and the join reached ACTIVE (the borrowed replica counted
for a step at least); a release happened and the slot's engine came back (loaded the newest
weights, and the gateway lists it again, up); the hybrid replica's weights after its last step
equal the core's checkpoint of that step, bit for bit; no trajectory was lost. No timing is
asserted, but the controller's decisions follow measured stage times: on a machine where rollout
stays the slower stage even here, the run does not borrow and the test says so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from libra.runtime.engine.config import PRESETS
from libra.runtime.engine.model import TinyTransformer
from libra.runtime.train.learner import weights_digest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONFIG = """
steps: 10
task: {tool: in_process, slow_tool_s: 20.0, slow_tool_from: 6}
rollout: {groups_per_step: 6, group_size: 32, max_tokens: 16}
pipeline: {staleness: 1, consume: completion}
buckets:
  - {name: short, tp: 1, max_context: 256, instances: 3}
  - {name: long, tp: 2, max_context: 8192, instances: 1}
trainer: {replicas: 1, micro_batch_tokens: 1024, keep_checkpoints: 100}
warmstart: {steps: 50, batch: 16}
elastic: {enabled: true, hybrid: 1, runtime: {sync_steps: 1}, policy: {borrow_ratio: 1.05}}
metrics_port: -1
"""


def fingerprint(model_pt: Path) -> str:
    """The trainer's weight digest (`Learner.fingerprint`) of a checkpoint."""
    m = TinyTransformer(PRESETS["tiny"], 0)
    m.load_state_dict(torch.load(model_pt, weights_only=True))
    return weights_digest(m)


def test_borrow_join_release_and_the_engine_comes_back(tmp_path):
    out, cfg = tmp_path / "run", tmp_path / "elastic.yaml"
    cfg.write_text(CONFIG)
    r = subprocess.run([sys.executable, "-m", "libra", "train", "--config", str(cfg), "--out", str(out)],
                       capture_output=True, text=True, timeout=800)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    check_cycle(out)


def check_cycle(out: Path) -> None:
    recs = json.loads((out / "steps.json").read_text())
    pool = [x["elastic"] for x in recs]
    events = [e for p in pool for e in p["events"]]
    # borrowed: drained, the standby trainer told to join, and counted (ACTIVE) for a step at least
    assert any("borrow: r=" in e for e in events), [x["planner"]["elastic"]["reason"] for x in recs]
    assert any("trainer joins in engine-short-2's slot: drained in" in e for e in events), events
    active = [x["step"] for x, p in zip(recs, pool, strict=True) if p["hybrid_active"] >= 1]
    # (the step after a release is decided, the replica still counts: RELEASING in the driver)
    assert active and all(
        p["states"]["hybrid-0"] in ("ACTIVE", "RELEASING") for p in pool if p["hybrid_active"]
    )
    # released: the core let it go, and the engine is back in rollout with the newest weights
    assert any("release: r=" in e for e in events), events
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
    assert all(x["trained"] == 192 and x["dropped"]["trajectories"] == 0 for x in recs)
    assert json.loads((out / "summary.json").read_text())["unfinished"] == 0

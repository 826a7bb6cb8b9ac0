"""The checkpoint fault suite: every way a checkpoint can be bad is refused, by name, never loaded.

Each fault is made on real checkpoints written by `checkpoint.save` (the trainer's own writer):
flipped bits, NaN weights, a truncated file, a FIFO in place of model.pt, a symlink out of the run
folder, a missing optimizer state, a missing or corrupt manifest, a step past the end. `--resume`
(`resume_point`) resumes exactly the newest checkpoint or raises a CheckpointError (exit 2 on the
CLI) that names it and what is wrong; a run folder with steps is never started over silently.
A FIFO is never opened for reading, so nothing here can hang (each read runs under a timeout).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil

import pytest
import torch

from libra.runtime.engine.config import PRESETS
from libra.runtime.engine.model import TinyTransformer
from libra.runtime.train import checkpoint as ckpt

STEPS = 10


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A run folder with checkpoints for steps 0 (warm-start: no optimizer) to 3, written once."""
    root = tmp_path_factory.mktemp("written")
    model = TinyTransformer(PRESETS["tiny"], 0)
    opt = torch.optim.AdamW(model.parameters())
    for step in range(4):
        optim = opt.state_dict() if step else None
        ckpt.save(root / "checkpoints", step, step, model.state_dict(), optim, keep=10)
    return root


@pytest.fixture
def run(written, tmp_path):
    """A fresh copy of `written` for a test to break."""
    shutil.copytree(written / "checkpoints", tmp_path / "checkpoints")
    return tmp_path


def newest(run) -> ckpt.CheckpointInfo:
    return ckpt.open_checkpoint(ckpt.folder(run / "checkpoints", 3), run)


def refused(run, *words: str, steps: int = STEPS) -> str:
    """resume_point's CheckpointError, checked to name each of `words`; within 30 s, whatever the file."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(ckpt.resume_point, run, steps)
        with pytest.raises(ckpt.CheckpointError) as e:
            fut.result(timeout=30)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


def test_a_sound_run_resumes_exactly_its_newest_checkpoint(run):
    info = ckpt.resume_point(run, STEPS)
    assert info.step == 3 and info.has_optimizer
    weights, opt = ckpt.load(info, run)
    TinyTransformer(PRESETS["tiny"], 1).load_state_dict(weights)
    manifest = json.loads((info.path / ckpt.MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.pt", "optimizer.pt"} and manifest["step"] == 3


def test_flipped_bits_are_a_digest_mismatch(run):
    model = newest(run).model
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside a tensor's bytes: torch.load would read it without complaint
    model.write_bytes(bytes(data))
    msg = refused(run, "corrupt", "model.pt does not match its manifest", "step-000003", "step 2")
    assert "move" in msg  # says how to resume from the one before


def test_a_truncated_file_is_refused(run):
    opt = newest(run).path / ckpt.OPTIM
    opt.write_bytes(opt.read_bytes()[:100])
    refused(run, "optimizer.pt does not match its manifest")


def test_nan_weights_are_never_written_nor_resumed(run, monkeypatch):
    model = TinyTransformer(PRESETS["tiny"], 0)
    bad = {k: v.clone() for k, v in model.state_dict().items()}
    next(iter(bad.values()))[0] = float("nan")
    with pytest.raises(ckpt.NonFiniteWeights, match="step 4 produced non-finite weights"):
        ckpt.save(run / "checkpoints", 4, 4, bad, None, keep=10)
    assert not ckpt.folder(run / "checkpoints", 4).exists()
    # A NaN checkpoint written by hand (digests and all) is still refused on resume.
    with monkeypatch.context() as m:
        m.setattr(ckpt, "check_finite", lambda weights, step: None)  # the writer's check bypassed
        ckpt.save(run / "checkpoints", 4, 4, bad, {"state": {}, "param_groups": []}, keep=10)
    refused(run, "non-finite", "step-000004")


def test_a_fifo_in_place_of_model_pt_is_refused_unopened(run):
    model = newest(run).model
    model.unlink()
    os.mkfifo(model)
    refused(run, "named pipe (FIFO)", "model.pt")


def test_a_symlink_out_of_the_run_folder_is_refused(run, tmp_path_factory):
    model = newest(run).model
    outside = tmp_path_factory.mktemp("elsewhere") / "model.pt"
    outside.write_bytes(model.read_bytes())
    model.unlink()
    model.symlink_to(outside)
    refused(run, "symbolic link", "model.pt")
    # The checkpoints folder itself pointing elsewhere is refused too.
    ckpts = run / "checkpoints"
    moved = tmp_path_factory.mktemp("moved") / "checkpoints"
    ckpts.rename(moved)
    ckpts.symlink_to(moved)
    refused(run, "outside the run folder")


def test_a_missing_optimizer_state_is_refused(run):
    (newest(run).path / ckpt.OPTIM).unlink()
    refused(run, "the optimizer state is missing")


def test_a_missing_or_corrupt_manifest_is_refused_not_skipped(run):
    (newest(run).path / ckpt.MANIFEST).write_text("{not json")
    refused(run, "manifest.json is corrupt", "step-000003", "step 2")
    (ckpt.folder(run / "checkpoints", 3) / ckpt.MANIFEST).unlink()
    refused(run, "no manifest.json")


def test_a_step_past_the_end_and_no_checkpoint_are_refused(run, tmp_path_factory):
    refused(run, "step 3", "the run's end already", steps=3)
    assert ckpt.resume_point(run, 4).step == 3
    refused(tmp_path_factory.mktemp("empty"), "no checkpoint to resume")


def test_only_step_folders_count_and_interrupted_writes_are_ignored(run):
    (run / "checkpoints" / "step-000009.tmp").mkdir()  # an interrupted write
    assert ckpt.resume_point(run, STEPS).step == 3
    assert [c.step for c in ckpt.complete(run / "checkpoints")] == [0, 1, 2, 3]
    assert ckpt.earlier_run(run) == "checkpoints up to step 3"


def test_the_cli_exits_2_naming_the_fault_and_never_starts_over(run, capsys):
    """`libra train --resume` on a corrupt checkpoint: exit 2 with one line, before any process
    is started (the CLI's own entry point, in this process: torch is loaded already); a new run
    into a folder with steps is refused the same way (`--overwrite` or `--resume` say what to do)."""
    from libra.cli import main
    from libra.cli.train import _start_point

    (newest(run).path / ckpt.OPTIM).unlink()
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(run), "--steps", "5", "--resume"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "optimizer state is missing" in err, err[-2000:]
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err[-2000:]
    (run / "steps.json").write_text(json.dumps([{"step": 0}]))
    with pytest.raises(ckpt.CheckpointError, match="holds an earlier run .*--resume.*--overwrite"):
        _start_point(run, 5, resume=False, overwrite=False)
    assert json.loads((run / "steps.json").read_text()) == [{"step": 0}]  # untouched
    assert _start_point(run, 5, resume=False, overwrite=True) is None  # said so: started over
    assert not (run / "steps.json").exists() and ckpt.earlier_run(run) is None


def test_a_checkpoint_of_another_model_is_refused_by_the_cli_and_the_replica(run, tmp_path_factory):
    """--resume checks the tensors against the run's model; the trainer's own resume (behind the
    CLI's check) verifies and names a wrong model too."""
    from libra.runtime.train.config import load_train_config
    from libra.runtime.train.worker import Replica

    small = TinyTransformer(PRESETS["small"], 0)
    ckpt.save(run / "checkpoints", 5, 5, small.state_dict(), {"state": {}, "param_groups": []}, keep=10)
    with pytest.raises(ckpt.CheckpointError, match="not of this run's model 'tiny'"):
        ckpt.resume_point(run, STEPS, "tiny")
    replica = Replica(load_train_config(None, ["trainer.replicas=1"]), 0, 1, run)
    with pytest.raises(ckpt.CheckpointError, match="does not fit this run's model"):
        replica.resume(str(ckpt.folder(run / "checkpoints", 5)))
    assert replica.resume(str(ckpt.folder(run / "checkpoints", 3)))["step"] == 3

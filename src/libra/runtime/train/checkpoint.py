"""Checkpoints: one folder per step, written whole or not at all, verified before anything uses them.

`checkpoints/step-000005/` holds `model.pt` (the model's `state_dict`: exactly the file format the
engines load, so weights are published from it unchanged), `optimizer.pt` (AdamW's state; absent
after the warm-start, which resets the optimizer) and `manifest.json`: the step, the weight version
and each file's size and sha256. The files are written and synced in `step-000005.tmp/`, the
manifest last (itself through a temporary name), then the folder is renamed into place: a folder
without a manifest is an interrupted write, and bits flipped later show as a digest mismatch.
Only trainer rank 0 writes (replicas are bitwise equal). With `trainer.checkpoint_every` N > 1,
the steps between two checkpoints write their weights alone to `RUN/weights/` (`publish_weights`):
a step's AdamW state is twice its weights, and writing, syncing and hashing it every step was the
largest part of a real model's step (docs/models.md).

Before a checkpoint is written its weights are checked for NaN and infinities: a step that
diverged stops the run with a message naming the tensor, and nothing is written or published.

Reading goes through `regular_file`: every file must be a regular file inside the run folder (a
FIFO, a device or a symlink out of it is refused unopened), and its bytes must match the manifest
before torch reads them. `resume_point` is what `libra train --resume` starts from: exactly the
newest checkpoint, verified, or a `CheckpointError` (exit 2) naming what is wrong.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from libra.core.errors import LibraError
from libra.runtime.regular_file import FileRefused, read_regular

MODEL, OPTIM, MANIFEST = "model.pt", "optimizer.pt", "manifest.json"
FORMAT = 1
STEP_DIR = re.compile(r"step-(\d{6,})")
MAX_MANIFEST_BYTES = 1 << 20


class CheckpointError(LibraError, ValueError):
    """A checkpoint that cannot be used, or a run folder that cannot be resumed; says which and why."""


class NonFiniteWeights(ValueError):
    """A step's weights hold NaN or an infinity: never written, never published."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    path: Path
    step: int
    version: int
    files: tuple[tuple[str, int, str], ...] = ()  # (name, bytes, sha256) from the manifest

    @property
    def model(self) -> Path:
        return self.path / MODEL

    @property
    def has_optimizer(self) -> bool:
        return any(name == OPTIM for name, _, _ in self.files)


def folder(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


# ---- writing --------------------------------------------------------------------------------------


def check_finite(weights: dict, step: int) -> None:
    import torch  # here, not at the top: the CLI refuses a bad --resume before torch loads

    for name, t in weights.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteWeights(f"step {step} produced non-finite weights ({name} holds NaN or infinity); they were neither written nor published")  # fmt: skip


def save(
    root: Path, step: int, version: int, weights: dict, optimizer: dict | None, keep: int
) -> CheckpointInfo:
    """Write step `step`'s checkpoint (module docstring) and prune old ones to `keep`."""
    check_finite(weights, step)
    final = folder(root, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = [_write(tmp / MODEL, _serialize(weights))]
    if optimizer is not None:
        files.append(_write(tmp / OPTIM, _serialize(optimizer)))
    manifest = {"format": FORMAT, "step": step, "version": version,
                "files": {name: {"bytes": size, "sha256": digest} for name, size, digest in files}}  # fmt: skip
    _write(tmp / (MANIFEST + ".tmp"), json.dumps(manifest, indent=1).encode())
    os.replace(tmp / (MANIFEST + ".tmp"), tmp / MANIFEST)
    _sync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _sync_dir(root)
    for old in complete(root)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return CheckpointInfo(final, step, version, tuple(files))


def publish_weights(root: Path, version: int, weights: dict, keep: int = 3) -> Path:
    """Write version `version`'s weights alone for the engines to load, between two full
    checkpoints (`trainer.checkpoint_every`): checked for NaN like a checkpoint, renamed into place
    whole, but neither synced nor hashed, since nothing resumes from it (a crash resumes from the
    newest checkpoint). The newest `keep` are kept: an engine that joins late loads the latest."""
    import torch

    check_finite(weights, version)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"version-{version:06d}.pt"
    tmp = final.with_name(final.name + ".tmp")
    torch.save(weights, tmp)
    os.replace(tmp, final)
    for old in sorted(root.glob("version-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def _serialize(obj: dict) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write(path: Path, data: bytes) -> tuple[str, int, str]:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return path.name, len(data), hashlib.sha256(data).hexdigest()


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- finding and verifying ------------------------------------------------------------------------


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """Every `step-N` folder (not the `.tmp` of an interrupted write), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in root.iterdir() if (m := STEP_DIR.fullmatch(d.name))]
    return sorted(found)


def open_checkpoint(path: Path, run: Path | None = None) -> CheckpointInfo:
    """The checkpoint at `path`, from its manifest (not yet its files' bytes: `read_files`)."""
    within = run if run is not None else path.parent.parent
    try:
        raw = read_regular(path / MANIFEST, within, MAX_MANIFEST_BYTES)
    except FileRefused as e:
        what = "no manifest.json (an interrupted write, or a checkpoint of an older format)" if not (path / MANIFEST).exists() else str(e)  # fmt: skip
        raise CheckpointError(f"checkpoint {path} is unusable: {what}") from None
    try:
        m = json.loads(raw)
        files = tuple((str(n), int(f["bytes"]), str(f["sha256"])) for n, f in m["files"].items())
        info = CheckpointInfo(path, int(m["step"]), int(m["version"]), files)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path} is unusable: its manifest.json is corrupt ({type(e).__name__})") from None  # fmt: skip
    if MODEL not in {n for n, _, _ in files} or any("/" in n or n.startswith(".") for n, _, _ in files):
        raise CheckpointError(f"checkpoint {path} is unusable: its manifest.json lists {[n for n, _, _ in files]}, not model.pt")  # fmt: skip
    return info


def read_files(info: CheckpointInfo, run: Path | None = None) -> dict[str, bytes]:
    """Every file the manifest lists, read as regular files inside the run folder and checked
    against its size and sha256."""
    within = run if run is not None else info.path.parent.parent
    out = {}
    for name, size, digest in info.files:
        what = "the optimizer state" if name == OPTIM else name
        try:
            data = read_regular(info.path / name, within, size)
        except FileRefused as e:
            missing = not os.path.lexists(info.path / name)
            raise CheckpointError(f"checkpoint {info.path} is unusable: {what} is missing" if missing else f"checkpoint {info.path} is unusable: {e}") from None  # fmt: skip
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointError(f"checkpoint {info.path} is corrupt: {name} does not match its manifest ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:12]}..., expected {size} bytes, {digest[:12]}...)")  # fmt: skip
        out[name] = data
    return out


def load(info: CheckpointInfo, run: Path | None = None) -> tuple[dict, dict | None]:
    """Weights and optimizer state (None after the warm-start) of a verified checkpoint."""
    raw = read_files(info, run)
    weights = _deserialize(raw[MODEL], info, MODEL)
    check_finite_loaded(weights, info)
    return weights, (_deserialize(raw[OPTIM], info, OPTIM) if OPTIM in raw else None)


def _deserialize(data: bytes, info: CheckpointInfo, name: str) -> dict:
    import torch

    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # the digest matched, so this file was written that way
        raise CheckpointError(f"checkpoint {info.path}: torch cannot read {name} ({type(e).__name__})") from None  # fmt: skip
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {info.path}: {name} is not a state_dict")
    return obj


def check_finite_loaded(weights: dict, info: CheckpointInfo) -> None:
    try:
        check_finite(weights, info.step)
    except NonFiniteWeights as e:
        raise CheckpointError(f"checkpoint {info.path} is unusable: {e}") from None


def complete(root: Path) -> list[CheckpointInfo]:
    """Checkpoints under `root` whose manifest reads, oldest first (files not read: for pruning
    and for saying where a stopped run can resume)."""
    out = []
    for _, d in step_folders(root):
        try:
            out.append(open_checkpoint(d))
        except CheckpointError:
            continue
    return sorted(out, key=lambda c: c.step)


def latest(root: Path) -> CheckpointInfo | None:
    found = complete(root)
    return found[-1] if found else None


def resume_point(run: Path, steps: int, model: str | None = None) -> CheckpointInfo:
    """What `--resume` starts from: the newest checkpoint, verified byte for byte (and, given the
    run's `model` preset, its tensors' names and shapes), if it leaves steps to train; otherwise a
    CheckpointError saying what is wrong and what to do."""
    root = run / "checkpoints"
    found = step_folders(root)
    if not found:
        raise CheckpointError(f"--resume: no checkpoint to resume in {root} (no step-N folder); start a new run without --resume")  # fmt: skip
    newest = found[-1][1]
    try:
        info = open_checkpoint(newest, run)
        weights, _ = load(info, run)
        if model is not None:
            _check_model(info, weights, model)
    except CheckpointError as e:
        older = next((c for c in reversed(complete(root)) if c.path != newest), None)
        hint = (f"; the one before it is step {older.step}: move {newest} out of {root} to resume from that"
                if older else "; no older checkpoint is left")  # fmt: skip
        raise CheckpointError(f"--resume: {e}{hint}") from None
    if info.step > 0 and not info.has_optimizer:
        raise CheckpointError(f"--resume: checkpoint {newest} has no optimizer state, which every step after the warm-start writes")  # fmt: skip
    if info.step >= steps:
        raise CheckpointError(f"--resume: the newest checkpoint is step {info.step}, which is the run's end already (steps = {steps}); pass a larger --steps to train on")  # fmt: skip
    return info


def _check_model(info: CheckpointInfo, weights: dict, model: str) -> None:
    from libra.runtime.engine.config import PRESETS
    from libra.runtime.engine.model import TinyTransformer

    want = {k: tuple(v.shape) for k, v in TinyTransformer(PRESETS[model], 0).state_dict().items()}
    got = {k: tuple(getattr(v, "shape", ())) for k, v in weights.items()}
    bad = sorted(set(want) ^ set(got)) + sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if bad:
        raise CheckpointError(f"checkpoint {info.path} is not of this run's model {model!r} (names or shapes differ: {bad[:3]})")  # fmt: skip


def earlier_run(run: Path) -> str | None:
    """What an earlier run left in `run` (steps, checkpoints), or None when there is nothing."""
    parts = []
    steps = run / "steps.json"
    if steps.is_file():
        try:
            n = len(json.loads(steps.read_text()))
        except (OSError, ValueError, TypeError):
            n = None
        if n != 0:
            parts.append(f"steps.json ({n} steps)" if n is not None else "steps.json")
    ckpts = step_folders(run / "checkpoints")
    if ckpts:
        parts.append(f"checkpoints up to step {ckpts[-1][0]}")
    return ", ".join(parts) or None

"""Checkpoints: one folder per step, written whole or not at all.

`checkpoints/step-000005/` holds `model.pt` (the model's `state_dict`: exactly the file format the
engines load, so weights are published from it unchanged), `optimizer.pt` (AdamW's state) and
`state.json` (step, weight version), written last: a folder without it is an interrupted write and
is ignored. Only trainer rank 0 writes (replicas are bitwise equal); `--resume` loads the newest
complete folder on every replica.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL, OPTIM, STATE = "model.pt", "optimizer.pt", "state.json"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    path: Path
    step: int
    version: int

    @property
    def model(self) -> Path:
        return self.path / MODEL


def folder(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save(
    root: Path, step: int, version: int, weights: dict, optimizer: dict | None, keep: int
) -> CheckpointInfo:
    """Write step `step`'s checkpoint (tmp folder, then rename) and prune old ones to `keep`."""
    final = folder(root, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(weights, tmp / MODEL)
    if optimizer is not None:
        torch.save(optimizer, tmp / OPTIM)
    (tmp / STATE).write_text(json.dumps({"step": step, "version": version}))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in complete(root)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return CheckpointInfo(final, step, version)


def complete(root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints under `root`, oldest first."""
    out = []
    for d in sorted(root.glob("step-*")):
        try:
            st = json.loads((d / STATE).read_text())
            out.append(CheckpointInfo(d, int(st["step"]), int(st["version"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda c: c.step)


def latest(root: Path) -> CheckpointInfo | None:
    found = complete(root)
    return found[-1] if found else None


def load(info: CheckpointInfo) -> tuple[dict, dict | None]:
    weights = torch.load(info.path / MODEL, map_location="cpu", weights_only=True)
    opt = info.path / OPTIM
    return weights, (torch.load(opt, map_location="cpu", weights_only=True) if opt.exists() else None)

"""Weights over a torch.distributed group: the trainer (rank 0) broadcasts, every engine receives.

This is SGLang's distributed weight update (`/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`) and vLLM's NCCL weight
transfer, with gloo standing in for NCCL on CPU. Both sides use this module, so they agree on the
rendezvous and the order of tensors:

- rank 0 (the trainer) hosts a `TCPStore` on `master_address:master_port`; engines join it at
  ranks `rank_offset ..`. The group is a `ProcessGroupGloo` built on that store under
  `group_name`, not the process's default group, so a process can hold several groups and an
  engine never calls `init_process_group` (which would claim the process for one job);
- an update is a list of (name, dtype, shape): rank 0 broadcasts each tensor in that order and
  every engine receives into a fresh tensor of that dtype and shape.

Everything here blocks (rendezvous waits for every rank), so the engine calls it from a worker
thread, never from its event loop or its engine thread.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from libra.core.errors import ConfigError

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
}


def dtype_of(name: str, field: str = "dtypes") -> torch.dtype:
    """A dtype from its name as SGLang and vLLM send it ("bfloat16" or "torch.bfloat16")."""
    dt = DTYPES.get(str(name).removeprefix("torch."))
    if dt is None:
        raise ConfigError(field, name, sorted(DTYPES))
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def manifest(named: dict[str, Tensor]) -> dict:
    """The `names`, `dtypes` and `shapes` lists of an update, in the order tensors are sent."""
    return {
        "names": list(named),
        "dtypes": [dtype_name(t.dtype) for t in named.values()],
        "shapes": [list(t.shape) for t in named.values()],
    }


class WeightGroup:
    """One member of a weight-update group (rank 0 sends, the others receive)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float = 600.0):  # fmt: skip
        timeout = datetime.timedelta(seconds=timeout_s)
        self.name, self.rank, self.world_size = group_name, rank, world_size
        self._store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(group_name, self._store), rank, world_size, timeout)

    def broadcast(self, tensors: list[Tensor]) -> None:
        """Rank 0's tensors to every rank, in order (in place on the receivers)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in tensors:
            self._pg.broadcast([t], opts).wait()

    def receive(self, specs: list[TensorSpec]) -> dict[str, Tensor]:
        """Fresh tensors of each spec, filled by rank 0's broadcast."""
        out = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs}
        self.broadcast(list(out.values()))
        return out

    def send(self, named: dict[str, Tensor]) -> None:
        """Rank 0: broadcast `named` in order (contiguous CPU copies of the trainer's tensors)."""
        self.broadcast([t.detach().to("cpu").contiguous() for t in named.values()])

    def close(self) -> None:
        try:
            self._pg.shutdown()
        except RuntimeError:  # already broken (a peer died): nothing left to release
            pass

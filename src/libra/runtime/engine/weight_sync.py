"""Weights over a torch.distributed group: the trainer (rank 0) broadcasts, every engine receives.

This is SGLang's distributed weight update (`/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`) and vLLM's NCCL weight
transfer, with gloo standing in for NCCL on CPU. Both sides use this module, so they agree on the
rendezvous and the order of tensors:

- the group is made the way torch.distributed's own `init_process_group` makes one, with a
  group name, as SGLang's engines (`init_custom_process_group`), slime's trainer and SkyRL's do:
  rank 0 (the trainer) hosts the `tcp://master_address:master_port` rendezvous store, the store is
  prefixed with `group_name`, and `_new_process_group_helper` layers the group's and the device's
  prefixes over it. So a trainer that creates its side with torch's own calls meets the engines'
  keys, and a process can hold several groups without claiming its default group;
- an update is a list of (name, dtype, shape): rank 0 broadcasts each tensor in that order and
  every engine receives into a fresh tensor of that dtype and shape. A packed update (vLLM's
  `packed: true`) broadcasts the same tensors as uint8 buffers of about `packed_buffer_size_bytes`
  each, filled in order, and the receiver cuts them apart by the same rule (`packed_chunks`).

Everything here blocks (rendezvous waits for every rank), so the engine calls it from a worker
thread, never from its event loop or its engine thread. `open_group` and `push_weights` are the
trainer's side in one call each: they POST to an engine or to a gateway (which broadcasts to every
engine of its pool) while doing the rendezvous or the broadcast that call waits for.
"""

from __future__ import annotations

import datetime
import json
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world
from torch.distributed.rendezvous import rendezvous

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


# vLLM's default packed buffer (vllm/distributed/weight_transfer/packed_tensor.py): both sides must
# cut the stream of tensors at the same places.
PACKED_BUFFER_BYTES = 1 << 30


def packed_chunks(specs: list[TensorSpec], buffer_bytes: int = PACKED_BUFFER_BYTES) -> list[list[TensorSpec]]:
    """The buffers a packed update is sent in: tensors in order, a buffer closed after the tensor
    that takes it past `buffer_bytes` (the rule of vLLM's packed_broadcast_producer/consumer)."""
    out: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        out[-1].append(s)
        size += nbytes(s)
        if size > buffer_bytes:
            out.append([])
            size = 0
    return [c for c in out if c]


def nbytes(s: TensorSpec) -> int:
    return math.prod(s.shape) * s.dtype.itemsize


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


class WeightGroup:
    """One member of a weight-update group (rank 0 sends, the others receive)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float = 600.0):  # fmt: skip
        timeout = datetime.timedelta(seconds=timeout_s)
        self.name, self.rank, self.world_size = group_name, rank, world_size
        # What torch's init_process_group does, under a name of its own (see the module's docstring).
        store, _, _ = next(rendezvous(_tcp(master_address, master_port), rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        self._pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend("gloo"), dist.PrefixStore(group_name, store),
            group_name=group_name, timeout=timeout,
        )  # fmt: skip
        _world.pg_group_ranks[self._pg] = {i: i for i in range(world_size)}

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

    def receive_packed(
        self, specs: list[TensorSpec], buffer_bytes: int = PACKED_BUFFER_BYTES
    ) -> dict[str, Tensor]:
        """A packed update: each chunk arrives as one uint8 buffer, cut into its tensors."""
        out: dict[str, Tensor] = {}
        for chunk in packed_chunks(specs, buffer_bytes):
            buf = torch.empty(sum(nbytes(s) for s in chunk), dtype=torch.uint8)
            self.broadcast([buf])
            for s, piece in zip(chunk, buf.split([nbytes(s) for s in chunk]), strict=True):
                out[s.name] = piece.clone().view(s.dtype).reshape(s.shape)  # a fresh, aligned copy
        return out

    def send(self, named: dict[str, Tensor]) -> None:
        """Rank 0: broadcast `named` in order (contiguous CPU copies of the trainer's tensors)."""
        self.broadcast([t.detach().to("cpu").contiguous() for t in named.values()])

    def close(self) -> None:
        """Leave the group and free its name in this process (a group of the same name can follow)."""
        try:
            dist.destroy_process_group(self._pg)
        except (RuntimeError, ValueError):  # already broken (a peer died) or gone: nothing to release
            pass


# ---- the trainer's side over HTTP: one call to an engine or to a gateway (which broadcasts) -------


def _post(url: str, body: dict, token: str | None, timeout_s: float) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class WeightUpdateError(RuntimeError):
    """The engines (or the gateway) refused or failed a weight-group call."""


def _call_while(url: str, body: dict, token: str | None, timeout_s: float, work) -> dict:
    """POST `body` to `url` from a helper thread while `work()` runs here (the rendezvous or the
    broadcast the engines wait for on their side); the engines' answer, or WeightUpdateError."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_post, url, body, token, timeout_s)
        try:
            result = work()
        except Exception as e:  # the engines' refusal, when they refused, says more than a timeout
            _check(url, *answer.result())
            raise WeightUpdateError(f"{url}: {type(e).__name__}: {e}") from e
        _check(url, *answer.result())
    return {"result": result, "answer": answer.result()[1]}


def _check(url: str, status: int, data: dict) -> None:
    if status != 200 or data.get("success") is False or data.get("ok") is False:
        raise WeightUpdateError(f"{url} answered {status}: {json.dumps(data)[:500]}")


def open_group(base_url: str, master_address: str, master_port: int, world_size: int, group_name: str = "weight_update_group",
               token: str | None = None, timeout_s: float = 600.0) -> WeightGroup:  # fmt: skip
    """Rank 0: ask the engines behind `base_url` (ranks 1..world_size-1) to join a new group, and
    host it. With a gateway, every engine of its pool joins (each gets its own rank)."""
    body = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
            "world_size": world_size, "group_name": group_name, "backend": "gloo"}  # fmt: skip
    make = lambda: WeightGroup(master_address, master_port, 0, world_size, group_name, timeout_s)  # noqa: E731
    return _call_while(base_url + "/init_weights_update_group", body, token, timeout_s, make)["result"]


def push_weights(group: WeightGroup, base_url: str, named: dict[str, Tensor], weight_version: str,
                 token: str | None = None, timeout_s: float = 600.0) -> dict:  # fmt: skip
    """Rank 0: send `named` to every engine of the group; they swap it in and report
    `weight_version` from their next step on. Returns the engines' (or the gateway's) answer."""
    body = {**manifest(named), "group_name": group.name, "weight_version": weight_version}
    return _call_while(base_url + "/update_weights_from_distributed", body, token, timeout_s, lambda: group.send(named))["answer"]  # fmt: skip

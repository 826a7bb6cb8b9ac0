"""A trainer's side of weight-update groups, as a real process: torch.distributed's own calls only.

    python -m tests.framework_trainer

It reads one command a line and answers each (`joined`, `done`, `left`):

- `join PORT WORLD_SIZE GROUP`: join as rank 0 the way slime's trainer does (slime/utils/
  distributed_utils.py `init_process_group`, used by `connect_rollout_engines_from_distributed` in
  slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py): torch's
  `rendezvous` on tcp://127.0.0.1:PORT, a `PrefixStore` under the group name, torch's
  `_new_process_group_helper`. SGLang's engines and SkyRL's legacy trainer make their side the
  same way; no Libra code is involved in the group;
- `send SEED`: every tensor of the built-in model's weights from SEED, in state-dict order, one
  `dist.broadcast` each (slime's `update_weights_from_distributed`);
- `send-packed SEED BYTES`: the same tensors packed into uint8 buffers that close once past BYTES,
  one broadcast per buffer (vLLM's `packed_broadcast_producer`, vllm/distributed/weight_transfer/
  packed_tensor.py, which SkyRL's sender drives with `packed: True`);
- `leave`: `destroy_process_group` (a group of the same name can be joined again); `quit`: exit.

One process serves a test module's groups one after another, so torch is imported once.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.model import build_model

TIMEOUT_S = 120.0


def init_process_group(port: int, world_size: int, group_name: str, timeout_s: float):
    """slime's `init_process_group` (rank 0, gloo), call for call."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), store, group_name=group_name, timeout=timeout)  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def send(pg, tensors: list[torch.Tensor]) -> None:
    handles = [dist.broadcast(t.data, 0, group=pg, async_op=True) for t in tensors]
    for h in handles:
        h.wait()


def send_packed(pg, tensors: list[torch.Tensor], buffer_bytes: int) -> None:
    packing, size = [], 0
    for t in tensors:
        packing.append(t.contiguous().view(torch.uint8).view(-1))
        size += packing[-1].numel()
        if size > buffer_bytes:
            dist.broadcast(torch.cat(packing), 0, group=pg)
            packing, size = [], 0
    if packing:
        dist.broadcast(torch.cat(packing), 0, group=pg)


def main() -> None:
    torch.set_num_threads(1)
    pg = None
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "join":
            pg = init_process_group(int(cmd[1]), int(cmd[2]), cmd[3], TIMEOUT_S)
            print("joined", flush=True)
        elif cmd[0] == "leave":
            dist.destroy_process_group(pg)
            pg = None
            print("left", flush=True)
        else:
            tensors = list(build_model(EngineConfig().preset, seed=int(cmd[1])).state_dict().values())
            if cmd[0] == "send":
                send(pg, tensors)
            else:
                send_packed(pg, tensors, int(cmd[2]))
            print("done", flush=True)


if __name__ == "__main__":
    main()

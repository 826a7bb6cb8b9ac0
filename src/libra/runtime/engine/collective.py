"""vLLM's `/collective_rpc`, with the worker methods SkyRL calls through it.

vLLM runs `method(*args, **kwargs)` on each of its workers and answers `{"results": [one per
worker]}`. Which methods exist depends on the worker extension the server was started with;
SkyRL starts vLLM with its `NewInferenceWorkerWrap` and drives a weight update through it
(skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py: `start_weight_update`,
`update_weights_nccl`, `finish_weight_update`, `sleep_for_weight_sync`, `wake_for_weight_sync`).
The built-in engine is one worker and implements those methods itself, with the same meaning:

- `skyrl_start_weight_update(is_checkpoint_format)` opens a chunked update;
- `update_weights_nccl(update_info)` receives one update over the weight-update group, as vLLM's
  `/update_weights` does (`names`, `dtype_names`, `shapes`, `packed`); it needs an open update;
- `skyrl_finish_weight_update()` closes it;
- `skyrl_sleep_for_weight_sync(offload_kv)` and `skyrl_wake_for_weight_sync(tags)` free and
  restore device memory around an update while paused requests stay frozen: a CPU engine has no
  device memory to free, so they check their arguments and change nothing.

Methods that need what a CPU engine lacks (`update_weights_ipc`: CUDA IPC handles from a GPU the
trainer shares; `fetch_weights`: a delta-checkpoint engine) and unknown ones are a 400 naming
`method`, as is a call out of order (an update before its start).
"""

from __future__ import annotations

from aiohttp import web
from pydantic import Field

from libra.core.errors import ConfigError
from libra.runtime.engine.core import ControlError
from libra.runtime.engine.protocol import _Model, clip, parse
from libra.runtime.openai_errors import read_json_object

LACKING = {
    "update_weights_ipc": "CUDA IPC handles (a GPU shared with the trainer); send the weights over the group (update_weights_nccl)",  # fmt: skip
    "fetch_weights": "a delta-checkpoint weight transfer engine; load from disk (/update_weights_from_disk)",
}


class RpcBody(_Model):
    method: str = Field(min_length=1, max_length=128)
    args: list = Field(default_factory=list)
    kwargs: dict = Field(default_factory=dict)
    timeout: float | None = Field(None, gt=0)


class Collective:
    def __init__(self, control) -> None:
        self.control = control
        self.updating = False  # between skyrl_start_weight_update and skyrl_finish_weight_update
        self.methods = {
            "skyrl_start_weight_update": self.start_update,
            "update_weights_nccl": self.update_weights,
            "skyrl_finish_weight_update": self.finish_update,
            "skyrl_sleep_for_weight_sync": self.sleep_for_sync,
            "skyrl_wake_for_weight_sync": self.wake_for_sync,
        }

    async def call(self, request: web.Request) -> web.Response:
        rpc = parse(RpcBody, (await read_json_object(request))[0])
        fn = self.methods.get(rpc.method)
        if fn is None:
            why = LACKING.get(rpc.method)
            allowed = f"not on this engine: it needs {why}" if why else sorted(self.methods)
            raise ConfigError("method", clip(rpc.method), allowed)
        try:
            result = await fn(*rpc.args, **rpc.kwargs)
        except TypeError as e:  # the method's own signature refused the arguments
            raise ConfigError("kwargs", clip(rpc.kwargs), f"the arguments of {rpc.method}: {e}") from None
        return web.json_response({"results": [result]})

    async def start_update(self, is_checkpoint_format: bool = True) -> None:
        self.updating = True

    async def update_weights(self, update_info: dict) -> dict:
        if not self.updating:
            raise ControlError("skyrl_start_weight_update must be called before update_weights_nccl")
        if not isinstance(update_info, dict):
            raise ConfigError(
                "kwargs.update_info", clip(update_info), "an object: names, dtype_names, shapes"
            )
        return await self.control.update_from_info(update_info, "kwargs.update_info")

    async def finish_update(self) -> None:
        self.updating = False

    async def sleep_for_sync(self, offload_kv: bool = True) -> None:
        if not isinstance(offload_kv, bool):
            raise ConfigError("kwargs.offload_kv", clip(offload_kv), "true or false")

    async def wake_for_sync(self, tags: list[str] | None = None) -> None:
        if tags is not None and (not isinstance(tags, list) or set(tags) - {"weights", "kv_cache"}):
            raise ConfigError("kwargs.tags", clip(tags), 'a subset of ["weights", "kv_cache"]')

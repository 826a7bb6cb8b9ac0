"""The engine's control plane over HTTP: what an RL trainer calls between (or during) rollouts.

SGLang's endpoints, with SGLang's request shapes and `{"success", "message", ...}` answers:

- `POST /pause_generation {"mode": "abort"|"in_place"|"retract"|"wait"}`, `POST /continue_generation`;
- `POST /flush_cache`; `POST /abort_request {"rid" | "abort_all": true}`;
- `POST /update_weights_from_disk {"model_path", "weight_version"?, "abort_all_requests"?}`;
- `POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
  "group_name", "backend": "gloo"}`, `POST /update_weights_from_distributed {"names", "dtypes",
  "shapes", "group_name", "weight_version"?}`, `POST /destroy_weights_update_group {"group_name"}`;
- `GET /get_weight_version`, `POST /update_weight_version {"new_version"}`;
- `POST /release_memory_occupation`, `POST /resume_memory_occupation` (the KV cache's memory is
  given back and taken anew; with the tag `weights` the weights are discarded too, and the engine
  serves nothing until every parameter is loaded again), `GET /is_sleeping`.

`/flush_cache` also answers `GET` (slime sends it that way). `init_weights_update_group` takes an
optional `timeout_s` (how long the rendezvous waits for every rank; default 300 s).

and vLLM's names for the same operations (its dev-mode endpoints), so a gateway that speaks vLLM's
dialect to a backend can be tested against this engine: `POST /pause?mode=abort|wait|keep`,
`POST /resume`, `GET /is_paused`, `POST /reset_prefix_cache`, `POST /sleep?level=1|2`,
`POST /wake_up[?tags=weights|kv_cache]`, `POST /init_weight_transfer_engine {"init_info"}`,
`POST /update_weights {"update_info"}` (packed or not), `GET /get_world_size`, and
`POST /collective_rpc` with the worker methods SkyRL calls (`collective`).

Every control call changes what the engine serves, so when the engine has an admin token they all
need `Authorization: Bearer <token>`; generation calls never do. Loading a file and waiting on a
process group block, so they run in worker threads; the weights themselves are swapped by the
engine thread between two steps (`EngineCore`), never while a step reads them.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from libra.core.errors import ConfigError
from libra.runtime.engine.collective import Collective
from libra.runtime.engine.core import ControlError, PauseMode
from libra.runtime.engine.model import read_checkpoint
from libra.runtime.engine.protocol import clip, parse
from libra.runtime.engine.weight_sync import PACKED_BUFFER_BYTES, TensorSpec, WeightGroup, dtype_of
from libra.runtime.openai_errors import ApiError, read_json_object

DEFAULT_GROUP = "weight_update_group"
# How long joining a group or receiving an update waits for the other ranks.
GROUP_TIMEOUT_S = 300.0
# How long reading a weights file may take (a local file takes well under a second; a hung
# network mount would block the reading thread forever).
READ_TIMEOUT_S = 120.0
# How long a control command may wait for the engine thread (a pause in "wait" mode lasts until
# the requests in flight finish).
CONTROL_TIMEOUT_S = 900.0
VLLM_MODES = {"abort": PauseMode.ABORT, "wait": PauseMode.WAIT, "keep": PauseMode.IN_PLACE}


class _Body(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class PauseBody(_Body):
    mode: Literal["abort", "in_place", "retract", "wait"] = "abort"


class AbortBody(_Body):
    rid: str | None = None
    abort_all: bool = False


class DiskUpdate(_Body):
    model_path: str = Field(min_length=1)
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    abort_all_requests: bool = False
    load_format: Literal["auto"] | None = None


class GroupInit(_Body):
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(DEFAULT_GROUP, min_length=1, max_length=256)
    backend: str = "gloo"
    # Libra's extension: how long the rendezvous waits for every rank before it gives up.
    timeout_s: float = Field(GROUP_TIMEOUT_S, gt=0, le=3600)


class DistUpdate(_Body):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    abort_all_requests: bool = False
    load_format: Literal["auto"] | None = None
    # vLLM's packed broadcast: the tensors come as uint8 buffers of about this many bytes each.
    packed: bool = False
    packed_buffer_size_bytes: int = Field(PACKED_BUFFER_BYTES, ge=1)


class GroupName(_Body):
    group_name: str = DEFAULT_GROUP


MEMORY_TAGS = ("kv_cache", "weights")


class MemoryBody(_Body):
    tags: list[str] | None = None

    def check(self) -> MemoryBody:
        if self.tags is not None and set(self.tags) - set(MEMORY_TAGS):
            raise ConfigError("tags", clip(self.tags), f"a subset of {list(MEMORY_TAGS)}, or absent (the KV cache)")  # fmt: skip
        return self

    def has(self, tag: str) -> bool:
        """Absent tags mean the KV cache only: a CPU engine has no device to offload weights from."""
        return tag == "kv_cache" if self.tags is None else tag in self.tags


class VersionBody(_Body):
    new_version: str = Field(min_length=1, max_length=256)
    abort_all_requests: bool = False


def register(app: web.Application, server) -> None:
    c = Control(server)
    server.weight_groups = c.groups
    routes = [
        ("POST", "/pause_generation", c.pause_generation),
        ("POST", "/continue_generation", c.continue_generation),
        ("POST", "/flush_cache", c.flush_cache),
        ("GET", "/flush_cache", c.flush_cache),
        ("POST", "/abort_request", c.abort_request),
        ("POST", "/update_weights_from_disk", c.update_from_disk),
        ("POST", "/init_weights_update_group", c.init_group),
        ("POST", "/update_weights_from_distributed", c.update_from_group),
        ("POST", "/destroy_weights_update_group", c.destroy_group),
        ("GET", "/get_weight_version", c.get_version),
        ("POST", "/update_weight_version", c.set_version),
        ("POST", "/release_memory_occupation", c.release_memory),
        ("POST", "/resume_memory_occupation", c.resume_memory),
        ("GET", "/is_sleeping", c.is_sleeping),
        # vLLM's names (its dev-mode endpoints)
        ("POST", "/pause", c.vllm_pause),
        ("POST", "/resume", c.vllm_resume),
        ("GET", "/is_paused", c.vllm_is_paused),
        ("POST", "/reset_prefix_cache", c.flush_cache),
        ("POST", "/init_weight_transfer_engine", c.vllm_init),
        ("POST", "/update_weights", c.vllm_update),
        ("POST", "/sleep", c.vllm_sleep),
        ("POST", "/wake_up", c.vllm_wake_up),
        ("GET", "/get_world_size", c.world_size),
        ("POST", "/collective_rpc", Collective(c).call),
    ]
    for method, path, fn in routes:
        app.router.add_route(method, path, c.guard(fn))


def close_groups(server) -> None:
    for group in getattr(server, "weight_groups", {}).values():
        group.close()


async def _within(aw, seconds: float, what: str):
    """`aw`, or a ControlError naming what did not finish within `seconds` (the thread it ran in
    may stay blocked, but the call is answered and the engine keeps serving)."""
    try:
        return await asyncio.wait_for(aw, seconds)
    except TimeoutError:
        raise ControlError(f"{what} did not finish within {seconds:g} s") from None


def _ok(message: str, **more) -> web.Response:
    return web.json_response({"success": True, "message": message, **more})


def _fail(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response({"success": False, "message": message, "param": param}, status=status)


async def _body(request: web.Request) -> dict:
    return (await read_json_object(request, {}))[0]


class Control:
    def __init__(self, server):
        self.server, self.core = server, server.core
        self.groups: dict[str, WeightGroup] = {}
        self._joining: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}

    def guard(self, fn):
        """The admin token check, and errors in SGLang's `{"success": false, "message"}` shape."""

        async def handler(request: web.Request) -> web.StreamResponse:
            if not self._authorized(request):
                return _fail(401, "control calls need 'Authorization: Bearer <admin token>' (--admin-token)")
            try:
                return await fn(request)
            except ConfigError as e:
                return _fail(400, str(e), e.field)
            except ControlError as e:
                return _fail(400, str(e))
            except ApiError as e:
                return _fail(e.status, e.message, e.param)

        return handler

    def _authorized(self, request: web.Request) -> bool:
        token = self.server.cfg.admin_token
        if token is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    async def _run(self, kind: str, arg: object = None) -> dict:
        """A command carried out by the engine thread between two steps; an error, not a wait
        forever, when that thread has stopped or does not get to it (a pause that waits for
        requests to finish takes as long as they do: CONTROL_TIMEOUT_S bounds it)."""
        fut = asyncio.wrap_future(self.core.control(kind, arg))
        deadline = asyncio.get_running_loop().time() + CONTROL_TIMEOUT_S
        while True:
            done, _ = await asyncio.wait({fut}, timeout=1.0)
            if done:
                return fut.result()
            if not self.core.alive:
                fut.cancel()
                raise ApiError(503, f"the engine thread has stopped; {kind!r} was not carried out (see the engine log)")  # fmt: skip
            if asyncio.get_running_loop().time() > deadline:
                fut.cancel()
                raise ControlError(f"the engine thread did not carry out {kind!r} within {CONTROL_TIMEOUT_S:g} s")  # fmt: skip

    # ---- pause, continue, abort, flush -----------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        req = parse(PauseBody, await _body(request))
        out = await self._run("pause", PauseMode(req.mode))
        return _ok(f"paused ({req.mode})", **out)

    async def continue_generation(self, request: web.Request) -> web.Response:
        return _ok("generation continues", **await self._run("continue"))

    async def abort_request(self, request: web.Request) -> web.Response:
        req = parse(AbortBody, await _body(request))
        if req.rid is None and not req.abort_all:
            raise ConfigError("rid", None, "a request id, or abort_all: true")
        out = await self._run("abort_requests", None if req.abort_all else req.rid)
        return _ok(f"aborted {out['aborted']} sequences", **out)

    async def flush_cache(self, request: web.Request) -> web.Response:
        return _ok("cache flushed", **await self._run("flush"))

    # ---- weights -----------------------------------------------------------------------------------

    async def update_from_disk(self, request: web.Request) -> web.Response:
        req = parse(DiskUpdate, await _body(request))
        held = self.core.num_running + self.core.num_waiting if self.core.paused else 0
        read = asyncio.to_thread(read_checkpoint, self.server.model, req.model_path, "model_path")
        tensors = await _within(read, READ_TIMEOUT_S, f"reading model_path {clip(req.model_path)!r}")
        out = await self._run("weights", (tensors, req.weight_version, req.abort_all_requests))
        return _ok(f"loaded {len(tensors)} tensors from {req.model_path}", num_paused_requests=held, **out)

    async def init_group(self, request: web.Request) -> web.Response:
        req = parse(GroupInit, await _body(request))
        rank = await self._join(req)
        return _ok(f"joined group {req.group_name!r} as rank {rank} of {req.world_size}", rank=rank)

    async def _join(self, req: GroupInit) -> int:
        if req.backend != "gloo":
            raise ConfigError("backend", clip(req.backend), "gloo (this CPU engine has no NCCL)")
        if req.rank_offset >= req.world_size:
            raise ConfigError("rank_offset", req.rank_offset, f"below world_size ({req.world_size})")
        name = req.group_name
        if name in self.groups or name in self._joining:
            raise ControlError(f"group {name!r} exists; destroy it first (/destroy_weights_update_group)")
        self._joining.add(name)
        try:
            self.groups[name] = await asyncio.to_thread(
                WeightGroup, req.master_address, req.master_port, req.rank_offset, req.world_size, name, req.timeout_s
            )  # fmt: skip
        except Exception as e:  # the store or the rendezvous failed: say so, keep serving
            raise ControlError(f"could not join group {name!r} at {req.master_address}:{req.master_port}: {type(e).__name__}: {str(e)[:200]}") from None  # fmt: skip
        finally:
            self._joining.discard(name)
        return req.rank_offset

    async def update_from_group(self, request: web.Request) -> web.Response:
        req = parse(DistUpdate, await _body(request))
        out = await self._receive(
            self._group(req.group_name), self._specs(req.names, req.dtypes, req.shapes), req
        )
        return _ok(f"received {len(req.names)} tensors over {req.group_name!r}", **out)

    def _group(self, name: str) -> WeightGroup:
        group = self.groups.get(name)
        if group is None:
            raise ConfigError("group_name", clip(name), sorted(self.groups) or "a group made by /init_weights_update_group first")  # fmt: skip
        return group

    async def _receive(self, group: WeightGroup, specs: list[TensorSpec], req: DistUpdate) -> dict:
        async with self._locks.setdefault(group.name, asyncio.Lock()):  # broadcasts are ordered
            try:
                if req.packed:
                    tensors = await asyncio.to_thread(
                        group.receive_packed, specs, req.packed_buffer_size_bytes
                    )
                else:
                    tensors = await asyncio.to_thread(group.receive, specs)
            except Exception as e:
                raise ControlError(f"receiving over {group.name!r} failed: {type(e).__name__}: {str(e)[:200]}") from None  # fmt: skip
        return await self._run("weights", (tensors, req.weight_version, req.abort_all_requests))

    def _specs(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorSpec]:
        """Checked before anything is received: known names, their shapes, known dtypes."""
        for field, values in (("dtypes", dtypes), ("shapes", shapes)):
            if len(values) != len(names):
                raise ConfigError(field, f"{len(values)} entries", f"one per name ({len(names)})")
        params = self.server.model.state_dict()
        specs = []
        for i, (name, dt, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
            if name not in params:
                raise ConfigError(
                    f"names[{i}]", clip(name), "a parameter of the engine's model (its state_dict keys)"
                )
            if tuple(shape) != tuple(params[name].shape):
                raise ConfigError(f"shapes[{i}]", shape, f"{list(params[name].shape)}, the shape of {name}")
            specs.append(TensorSpec(name, dtype_of(dt, f"dtypes[{i}]"), tuple(shape)))
        return specs

    async def destroy_group(self, request: web.Request) -> web.Response:
        req = parse(GroupName, await _body(request))
        group = self.groups.pop(req.group_name, None)
        if group is None:
            raise ConfigError("group_name", clip(req.group_name), sorted(self.groups) or "an existing group")
        await asyncio.to_thread(group.close)
        return _ok(f"left group {req.group_name!r}")

    async def get_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.core.weight_version})

    async def set_version(self, request: web.Request) -> web.Response:
        req = parse(VersionBody, await _body(request))
        if req.abort_all_requests:
            await self._run("abort_requests", None)
        return _ok("weight version updated", **await self._run("version", req.new_version))

    # ---- memory ----------------------------------------------------------------------------------------

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = parse(MemoryBody, await _body(request)).check()
        out = await self._run("release_memory", tags.has("weights"))
        return _ok(f"released {', '.join(out['released'])}", **out)

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = parse(MemoryBody, await _body(request)).check()
        if not tags.has("kv_cache"):  # weights only: they come back with the next update
            return _ok("nothing to restore: discarded weights come back with the next update", weights_discarded=bool(self.core.discarded))  # fmt: skip
        return _ok("KV cache restored", **await self._run("resume_memory"))

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.core.sleeping})

    # ---- vLLM's names --------------------------------------------------------------------------------

    async def vllm_pause(self, request: web.Request) -> web.Response:
        q = request.query
        mode = q.get("mode", "wait" if q.get("wait_for_inflight_requests", "").lower() == "true" else "abort")
        if mode not in VLLM_MODES:
            raise ConfigError("mode", clip(mode), sorted(VLLM_MODES))
        await self._run("pause", VLLM_MODES[mode])
        return web.json_response({"status": "paused"})

    async def vllm_resume(self, request: web.Request) -> web.Response:
        await self._run("continue")
        return web.json_response({"status": "resumed"})

    async def vllm_is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.core.paused is not None})

    async def vllm_sleep(self, request: web.Request) -> web.Response:
        """vLLM's levels: 1 gives the KV cache back, 2 discards the weights too (until an update)."""
        level = request.query.get("level", "1")
        if level not in ("1", "2"):
            raise ConfigError("level", clip(level), "1 (the KV cache) or 2 (the KV cache and the weights)")
        MemoryBody(tags=request.query.getall("tags", None)).check()
        await self._run("release_memory", level == "2")
        return web.json_response({})

    async def vllm_wake_up(self, request: web.Request) -> web.Response:
        tags = MemoryBody(tags=request.query.getall("tags", None)).check()
        if tags.tags is None or tags.has("kv_cache"):
            await self._run("resume_memory")
        return web.json_response({})

    async def world_size(self, request: web.Request) -> web.Response:
        """vLLM's /get_world_size: the ranks this engine takes in a weight-update group (one)."""
        return web.json_response({"world_size": 1})

    async def vllm_init(self, request: web.Request) -> web.Response:
        info = (await _body(request)).get("init_info")
        if not isinstance(info, dict):
            raise ConfigError("init_info", clip(info), "an object: master_address, master_port, rank_offset, world_size")  # fmt: skip
        await self._join(parse(GroupInit, info, "init_info"))
        return web.json_response({"message": "Weight transfer initialized"})

    async def vllm_update(self, request: web.Request) -> web.Response:
        info = (await _body(request)).get("update_info")
        if not isinstance(info, dict):
            raise ConfigError("update_info", clip(info), "an object: names, dtype_names, shapes")
        await self.update_from_info(info, "update_info")
        return web.json_response({"message": "Weights updated"})

    async def update_from_info(self, info: dict, field: str) -> dict:
        """vLLM's `update_info` (names, dtype_names, shapes, packed, ...) received over the group."""
        req = parse(DistUpdate, {**info, "dtypes": info.get("dtype_names")}, field)
        return await self._receive(
            self._group(req.group_name), self._specs(req.names, req.dtypes, req.shapes), req
        )

"""A re-plan carried out on a live fleet (issue 28 item 3): real engine processes (the instant
backend), the real gateway, real HTTP. An engine changes bucket by drain, remove and add; the
boundaries move through `POST /admin/buckets`; a move the fleet may not make, or one that fails
half way, leaves the fleet serving a layout it says, with the reason."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp

from libra.core.config import build
from libra.planner import Replan
from libra.planner.triggers import Trigger
from libra.runtime.train import cluster as procs
from libra.runtime.train.config import TrainConfig
from libra.runtime.train.fleet import LiveFleet
from libra.runtime.train.gateway_admin import GatewayAdmin
from libra.runtime.train.planning import fleet_plan
from tests.test_gateway_fixtures import backend_arg, gateway_factory, instant_factory  # noqa: F401

CFG = build(TrainConfig, {"buckets": [{"name": "short", "max_context": 256, "instances": 2},
                                      {"name": "long", "tp": 2, "max_context": 8192, "instances": 1}]})  # fmt: skip
NAMES = ["engine-short-0", "engine-short-1", "engine-long-0"]


def _fleet(tmp_path, urls: list[str]) -> procs.Cluster:
    # The engines are the fixture's processes, not a launcher's: the fleet reads only their names.
    cluster = procs.Cluster(tmp_path, launcher=None)  # type: ignore[arg-type]
    for name, url in zip(NAMES, urls, strict=True):
        bucket = name.split("-")[1]
        cluster.procs.append(procs.Proc("engine", SimpleNamespace(name=name), url, bucket))  # type: ignore[arg-type]
    return cluster


def _gateway(gateway_factory, urls):  # noqa: F811
    args = [a for name, url in zip(NAMES, urls, strict=True) for a in backend_arg(
        url, name.split("-")[1], 1 if "short" in name else 2, 256 if "short" in name else 8192, name=name)]  # fmt: skip
    return gateway_factory(*args)


def _replan(instances: list[int], tops: list[int]) -> Replan:
    return Replan(fleet_plan(CFG, instances, tops), 0.0, Trigger.INTERVAL, "test")


async def _carry_out(gw_url: str, cluster, replan: Replan, fixed=()) -> tuple[dict, list]:
    async with aiohttp.ClientSession() as http:
        admin = GatewayAdmin(gw_url, http, None)
        fleet = LiveFleet(CFG, cluster, admin, fixed)
        fleet.carry_out(replan)
        await fleet.task
        return fleet.record() | {"plan": [(b.instances, b.max_context) for b in fleet.plan.buckets]}, await admin.instances()  # fmt: skip


def test_a_replan_moves_an_engine_and_the_boundary(instant_factory, gateway_factory, tmp_path):  # noqa: F811
    urls = instant_factory(ports=3).urls
    gw = _gateway(gateway_factory, urls)
    rec, listing = asyncio.run(_carry_out(gw.url, _fleet(tmp_path, urls), _replan([1, 2], [512, 8192])))
    assert rec["replans"] == 1 and rec["moved"] == 1 and rec["plan"] == [(1, 512), (2, 8192)]
    assert rec["buckets"] == [{"name": "short", "max_context": 512, "engines": ["engine-short-0"]},
                              {"name": "long", "max_context": 8192, "engines": ["engine-long-0", "engine-short-1"]}]  # fmt: skip
    assert {i.id: (i.bucket, i.routable) for i in listing} == {
        "engine-short-0": ("short", True), "engine-short-1": ("long", True), "engine-long-0": ("long", True)}  # fmt: skip
    assert [b["max_context"] for b in gw.get("/admin/instances")[1]["buckets"]] == [512, 8192]
    assert any("engine-short-1: short -> long" in e for e in rec["events"])


def test_a_pinned_engine_is_never_moved_and_a_failed_move_keeps_a_true_layout(instant_factory, gateway_factory, tmp_path):  # noqa: F811  # fmt: skip
    urls = instant_factory(ports=3).urls
    gw = _gateway(gateway_factory, urls)
    cluster = _fleet(tmp_path, urls)
    # both short engines are hybrid slots: the move is not made, nothing changes
    rec, _ = asyncio.run(_carry_out(gw.url, cluster, _replan([1, 2], [512, 8192]), fixed=NAMES[:2]))
    assert (
        rec["replans"] == 0 and rec["plan"] == [(2, 256), (1, 8192)] and "not carried out" in rec["events"][0]
    )
    assert [b["max_context"] for b in gw.get("/admin/instances")[1]["buckets"]] == [256, 8192]
    # the engine to move is gone: the boundary moved, the engines stay, the layout says so
    cluster.procs = [p for p in cluster.procs if p.handle.name != "engine-short-1"]
    rec, listing = asyncio.run(_carry_out(gw.url, cluster, _replan([1, 2], [512, 8192])))
    assert rec["replans"] == 0 and rec["plan"] == [(2, 512), (1, 8192)]
    assert any("re-plan stopped" in e and "not running" in e for e in rec["events"])
    assert {i.id: i.bucket for i in listing}["engine-short-1"] == "short"

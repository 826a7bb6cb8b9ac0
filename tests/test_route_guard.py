"""Every route that changes a service's state is behind the admin token when one is set.

The test lists each app's routes as the app registers them (so a route added later is covered
without anyone remembering to) and calls every one over real HTTP on loopback without the token:
each must answer 401, except reads outside /admin and the data plane (`admin_guard.DATA_PLANE`:
generation and tokenizing, which clients call without a token). With the token, the guard lets
the call through. The actions service has no admin token: its routes that change state must all
be its data plane (running actions, sessions, tools), so an admin route added there fails here.
"""

from __future__ import annotations

import asyncio
import re
import socket

import aiohttp
import pytest
from aiohttp import web

from libra.runtime.admin_guard import DATA_PLANE, READS, needs_admin

TOKEN = "s3cret-token"
# The only routes a request without the token may change state through: generation and tokens.
EXPECTED_DATA_PLANE = {"/v1/chat/completions", "/v1/completions", "/generate", "/inference/v1/generate", "/tokenize", "/detokenize"}  # fmt: skip
ACTIONS_DATA_PLANE = {("POST", "/run_code"), ("POST", "/sessions"), ("POST", "/sessions/{sid}/actions"),
                      ("DELETE", "/sessions/{sid}"), ("POST", "/tools/{name}")}  # fmt: skip


def routes(app: web.Application) -> list[tuple[str, str]]:
    out = set()
    for r in app.router.routes():
        if r.method in ("HEAD", "*") or r.resource is None:
            continue
        out.add((r.method, r.resource.canonical))
    return sorted(out)


async def probe(app: web.Application) -> tuple[dict, dict]:
    """Each route's status, called with an empty JSON body: without the token (only the routes
    the guard covers: a public call may start real work), then with it (every route)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    out: tuple[dict, dict] = ({}, {})
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            for found, token in zip(out, (None, TOKEN), strict=True):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                for method, path in routes(app):
                    if token is None and not needs_admin(method, path):
                        continue
                    concrete = re.sub(r"\{[^}]+\}", "x", path)
                    async with http.request(method, url + concrete, json={}, headers=headers) as r:
                        found[(method, path)] = r.status
    finally:
        await runner.cleanup()
    return out


def check(app: web.Application) -> tuple[list[tuple[str, str]], dict]:
    """The guarded routes (all 401 without the token, none with it) and every route's status
    with the token."""
    without, with_token = asyncio.run(probe(app))
    open_ones = [k for k, status in without.items() if status != 401]
    assert not open_ones, f"state-changing routes reachable without the admin token: {open_ones}"
    assert without, "no guarded route found"
    refused = [k for k in without if with_token[k] == 401]
    assert not refused, f"refused even with the token: {refused}"
    return sorted(without), with_token


def test_the_data_plane_is_generation_only():
    assert DATA_PLANE == EXPECTED_DATA_PLANE
    assert needs_admin("POST", "/steps/end") and needs_admin("POST", "/sessions/{sid}/finish")
    assert needs_admin("GET", "/admin/instances") and not needs_admin("GET", "/health")
    assert READS == {"GET", "HEAD", "OPTIONS"}


def test_every_state_changing_engine_route_needs_the_token():
    from libra.runtime.engine.config import EngineConfig
    from libra.runtime.engine.model import build_model
    from libra.runtime.engine.server import EngineServer

    cfg = EngineConfig(admin_token=TOKEN, kv_cache_mb=20)
    guarded, statuses = check(EngineServer(cfg, build_model(cfg.preset, 0)).app())
    assert ("POST", "/update_weights_from_disk") in guarded and ("POST", "/pause_generation") in guarded
    # With the token a call gets through, then fails or not on its own merits.
    assert statuses[("POST", "/update_weights_from_disk")] == 400, statuses
    assert statuses[("POST", "/flush_cache")] == 200, statuses


def test_every_state_changing_gateway_route_needs_the_token():
    from libra.runtime.gateway.app import build_router
    from libra.runtime.gateway.config import load_gateway_config
    from libra.runtime.gateway.server import Gateway

    with socket.socket() as s:  # a closed port: the backend is down, which the guard does not care about
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_gateway_config({
        "backends": [{"url": f"http://127.0.0.1:{port}", "bucket": "only", "tp": 1, "max_context": 8192}],
        "admin_token": TOKEN, "health": {"interval_s": 60},
    })  # fmt: skip
    guarded, statuses = check(Gateway(cfg, build_router(cfg)).app())
    for route in (("POST", "/steps/end"), ("POST", "/sessions/{sid}/finish"), ("POST", "/admin/buckets"),
                  ("GET", "/admin/instances"), ("POST", "/update_weights_from_disk")):  # fmt: skip
        assert route in guarded, route
    assert statuses[("POST", "/steps/end")] == 200 and statuses[("GET", "/admin/instances")] == 200


def test_the_actions_service_changes_state_only_through_its_data_plane(tmp_path):
    from libra.runtime.sandbox.config import ServiceConfig
    from libra.runtime.sandbox.sandbox import Isolation
    from libra.runtime.sandbox.service import ActionsService

    cfg = ServiceConfig(warm_pool=0, sandbox={"workdir_root": str(tmp_path)})
    svc = ActionsService(cfg, Isolation(False, "route listing only"))
    changing = {(m, p) for m, p in routes(svc.app()) if m not in READS}
    assert changing == ACTIONS_DATA_PLANE, f"the actions service has no admin token: {changing - ACTIONS_DATA_PLANE} would be open"  # fmt: skip
    svc.boxes.storages.cleanup()


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])

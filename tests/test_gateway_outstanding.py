"""The gateway's per-instance `outstanding` count returns to zero whatever happens to a request.

`outstanding` is the load the router balances and what drain-then-delete waits on, so a request
that leaves it raised forever makes an instance look busy (after 256 such requests, full) and
makes `DELETE /admin/instances/{id}` answer 409 forever. A property test drives random mixes of
plain and streamed requests, clients that give up (cancelled mid-request, or timing out), and
backends that die mid-request and come back, against a real gateway and real backends on loopback
(in one event loop, so a backend can be killed and revived in milliseconds), and checks that once
everything settled every count is zero again. Also here: `last_error` clears when the instance is
back, and a turn retried after its engine died counts as a failover, with `failover_to`.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra.runtime.gateway.app import build_router
from libra.runtime.gateway.config import load_gateway_config
from libra.runtime.gateway.server import Gateway
from tests.instant_backend import InstantBackend

DELAY_S = 0.15
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


class Backend:
    """An instant backend that answers after DELAY_S, on a fixed port, that can die and return."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.runner: web.AppRunner | None = None

    async def up(self) -> None:
        if self.runner is None:
            app = InstantBackend("m", "a fine reply", DELAY_S, 1, 32768).app()
            self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await self.runner.setup()
            sock = self.sock if self.sock is not None else socket.create_server(("127.0.0.1", self.port), reuse_port=True)  # fmt: skip
            self.sock = None
            await web.SockSite(self.runner, sock).start()

    async def down(self) -> None:
        """Like a crash: connections in flight are cut, new ones refused."""
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()


class Stack:
    """A gateway in front of two backends, served by an event loop on its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.backends = [Backend(), Backend()]
        self.run(self._start())

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        for b in self.backends:
            await b.up()
        cfg = load_gateway_config({
            "backends": [{"url": f"http://127.0.0.1:{b.port}", "bucket": "only", "tp": 1, "max_context": 8192, "name": f"b{i}"} for i, b in enumerate(self.backends)],  # fmt: skip
            "router": "least-loaded", "no_instance_wait_s": 0.3, "health": {"interval_s": 0.05, "failures": 1},
        })  # fmt: skip
        self.gw = Gateway(cfg, build_router(cfg))
        self.runner = web.AppRunner(self.gw.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        await web.SockSite(self.runner, sock).start()
        self.client = aiohttp.ClientSession()

    def outstanding(self) -> dict[str, int]:
        return {i.id: i.view.outstanding for i in self.gw.pool.live()}

    async def settle(self) -> None:
        """Every backend up and seen healthy again, and nothing in flight."""
        for b in self.backends:
            await b.up()
        for _ in range(200):
            if all(v.healthy for v in self.gw.pool.views) and not any(self.outstanding().values()):
                return
            await asyncio.sleep(0.05)

    def close(self) -> None:
        self.run(self.client.close())
        self.run(self.runner.cleanup())
        for b in self.backends:
            self.run(b.down())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.close()


@pytest.fixture
def fresh():
    s = Stack()
    yield s
    s.close()


async def request(stack: Stack, stream: bool, give_up_after: float | None, sid: str) -> None:
    """One chat turn; a client that gives up after `give_up_after` seconds closes its connection
    (the gateway's handler is cancelled), as an agent loop's timeout does."""
    body = {**CHAT, "stream": stream}

    async def go() -> None:
        async with stack.client.post(
            stack.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": sid}
        ) as r:
            await r.read()

    try:
        await asyncio.wait_for(go(), give_up_after) if give_up_after is not None else await go()
    except (asyncio.TimeoutError, aiohttp.ClientError):
        pass


async def kill(stack: Stack, which: int, after: float, back_after: float) -> None:
    await asyncio.sleep(after)
    await stack.backends[which].down()
    await asyncio.sleep(back_after)
    await stack.backends[which].up()


ACTIONS = st.one_of(
    st.tuples(st.just("request"), st.booleans(), st.none() | st.floats(0.0, 0.3), st.integers(0, 5)),
    st.tuples(st.just("kill"), st.integers(0, 1), st.floats(0.0, 0.2), st.floats(0.0, 0.3)),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ACTIONS, min_size=1, max_size=10))
def test_outstanding_returns_to_zero_after_cancellations_timeouts_and_deaths(stack, actions):
    async def scenario() -> None:
        tasks = []
        for a in actions:
            if a[0] == "request":
                tasks.append(request(stack, a[1], a[2], f"s{a[3]}"))
            else:
                tasks.append(kill(stack, *a[1:]))
        await asyncio.gather(*tasks)
        await stack.settle()

    stack.run(scenario())
    assert stack.outstanding() == {"b0": 0, "b1": 0}


def test_the_leak_the_issue_found_three_client_timeouts(fresh):
    """Three non-streaming requests whose clients give up before the answer."""

    async def scenario() -> None:
        await asyncio.gather(*(request(fresh, False, DELAY_S / 3, f"t{i}") for i in range(3)))
        await fresh.settle()

    fresh.run(scenario())
    assert fresh.outstanding() == {"b0": 0, "b1": 0}
    assert fresh.run(_delete(fresh, "b0")) == 200  # drain-then-delete is not refused by phantoms


def test_last_error_clears_when_the_instance_is_back(fresh):
    async def scenario() -> tuple[str, str]:
        await fresh.backends[0].down()
        for _ in range(100):
            if fresh.gw.pool.instances["b0"].last_error:
                break
            await asyncio.sleep(0.05)
        seen = fresh.gw.pool.instances["b0"].last_error
        await fresh.settle()
        return seen, fresh.gw.pool.instances["b0"].last_error

    seen, after = fresh.run(scenario())
    assert "health check failed" in seen and after == ""


async def _delete(stack: Stack, iid: str) -> int:
    async with stack.client.post(f"{stack.url}/admin/instances/{iid}/drain") as r:
        await r.read()
    async with stack.client.delete(f"{stack.url}/admin/instances/{iid}") as r:
        return r.status

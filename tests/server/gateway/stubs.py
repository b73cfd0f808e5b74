"""Stub model servers and an in-process gateway for the gateway's fast tests.

A stub answers ``GET /load`` with the load the test sets and ``POST`` model routes with a
status the test chooses, counting what it received, so routing, holding and retries are
checked without loading a model (the real servers are in ``test_real_servers.py``).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from embedding_server.gateway.discovery import Service
from embedding_server.gateway.proxy import FORWARDED_ROUTES, Gateway
from embedding_server.gateway.settings import GatewaySettings


@dataclass
class Stub:
    """One fake endpoint: ``load`` is what /load says, ``status`` what POSTs get."""

    model: str
    load: dict[str, Any] = field(
        default_factory=lambda: {
            "ready": True,
            "queued_tokens": 0,
            "running_tokens": 0,
            "backlog_seconds": 0.0,
        }
    )
    status: int = 200
    delay: float = 0.0
    die_mid_answer: bool = False
    """Send the answer's headers and a few bytes of its body, then close the connection."""
    deaths: int = 0
    """As ``die_mid_answer``, for this many POSTs only (a pod restarted on its address)."""
    received: list[bytes] = field(default_factory=list)
    priorities: list[str | None] = field(default_factory=list)
    """The ``X-Priority`` header of each POST received."""
    url: str = ""
    runner: web.AppRunner | None = None

    async def _load(self, request: web.Request) -> web.Response:
        return web.json_response(self.load, status=200 if self.load.get("ready") else 503)

    async def _post(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.received.append(body)
        self.priorities.append(request.headers.get("X-Priority"))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.die_mid_answer or self.deaths > 0:
            self.deaths = max(0, self.deaths - 1)
            partial = web.StreamResponse(status=200)
            partial.content_length = 1000
            partial.content_type = "application/json"
            await partial.prepare(request)
            await partial.write(b'{"object": "li')
            assert request.transport is not None
            request.transport.close()
            return partial
        return web.json_response(
            {"served_by": self.url, "path": request.path, "echo": body.decode()},
            status=self.status,
            headers={"X-Stub": self.url},
        )

    async def start(self) -> Stub:
        app = web.Application()
        app.router.add_get("/load", self._load)
        for path in FORWARDED_ROUTES:
            app.router.add_post(path, self._post)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = _socket()
        await web.SockSite(self.runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def _socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class ListDiscovery:
    """A discovery the test drives: ``set`` publishes a new catalog."""

    def __init__(self, services: list[Service]) -> None:
        self.services = services
        self._publish: Any = None

    async def run(self, publish: Any) -> None:
        self._publish = publish
        publish(self.services)
        await asyncio.Event().wait()

    def set(self, services: list[Service]) -> None:
        self.services = services
        self._publish(services)


@asynccontextmanager
async def running_gateway(
    discovery: ListDiscovery, **settings: Any
) -> AsyncIterator[tuple[Gateway, str]]:
    """An in-process gateway on a free port; yields it and its base URL."""
    options = {"discovery": "static", "routes": ["unused=http://127.0.0.1:9"], **settings}
    gateway = Gateway(GatewaySettings(**options), discovery)
    runner = gateway.runner()
    await runner.setup()
    sock = _socket()
    listening = await gateway.guard.listen(runner, sock)
    try:
        yield gateway, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        listening.close()
        await runner.cleanup()


async def wait_until(condition: Any, timeout: float = 5.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)

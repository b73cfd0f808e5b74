"""The gateway's connection layer: what aiohttp's server itself does not bound.

aiohttp reads a request's head for as long as the client sends it (up to 128 header lines
of 8 KiB each), keeps a connection that never sends a request for its keep-alive timeout
(75 s under ``web.run_app``) and accepts every connection the kernel hands it. Each of these
costs memory before any request exists for a handler to refuse, so
:class:`GuardedConnection` wraps each connection's aiohttp protocol and bounds them where
the bytes arrive, as the server's front end does (:mod:`embedding_server.api.connections`):

* **Header size**: the bytes of a request's line and headers are counted as they arrive;
  past ``--max-header-bytes`` the client gets 431 and the connection is closed.
* **Header timeout**: a request's line and headers must arrive within ``--header-timeout``
  of the connection opening, or of the next request's first byte on a kept-alive
  connection; then 408 and the connection is closed (also one that never sends a byte).
* **Keep-alive**: a connection idle between requests is closed after
  ``--keep-alive-timeout``.
* **Connection cap**: a connection beyond ``--max-connections`` open ones is answered 503
  and closed at once. On the probe port (``--probe-port``), past its own small cap, a
  connection not in a request is closed instead, to make room for the new one: the oldest of
  the peer address that holds the most (:mod:`embedding_server.probe_room`).

A request's head ends at its first empty line, which is found here as the bytes arrive; the
request's handler (:meth:`ConnectionGuard.middleware`) marks where the request begins and
ends for requests aiohttp had read ahead (pipelined). The body's timeout, the write timeout
and the byte budget are the handler's (:mod:`embedding_server.gateway.proxy`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any, cast

import orjson
from aiohttp import web

from embedding_server.probe_room import to_close

logger = logging.getLogger(__name__)

_HEAD_END = b"\r\n\r\n"
_REASONS = {
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


class _Phase(Enum):
    HEAD = "head"
    """Reading a request's line and headers (or waiting for the first request)."""
    REQUEST = "request"
    """A request's head is in: its body is the handler's, until its answer is written."""
    IDLE = "idle"
    """Between requests on a kept-alive connection."""


class ConnectionGuard:
    """The bounds of the module docstring for every connection of one gateway process."""

    def __init__(
        self,
        *,
        max_connections: int,
        max_header_bytes: int,
        header_timeout: float,
        keep_alive_timeout: float,
        make_room: bool = False,
    ) -> None:
        self.max_connections = max_connections
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.keep_alive_timeout = keep_alive_timeout
        self.make_room = make_room
        """At the cap, close a connection that is not in a request (still sending its head,
        or idle) to admit the new one, rather than refusing the new one: the probe
        port's rule, where a kubelet sends its request as soon as it connects, so a crowd
        of connections that send nothing cannot keep it out."""
        self.open: dict[asyncio.BaseTransport, GuardedConnection] = {}

    def _room(self) -> bool:
        """Whether one more connection may open (closing an old one for it with
        :attr:`make_room`)."""
        if len(self.open) < self.max_connections:
            return True
        if not self.make_room:
            return False
        transport = to_close(  # oldest first
            (t, t, not connection.in_request) for t, connection in self.open.items()
        )
        if transport is None:
            return False
        del self.open[transport]
        transport.close()
        return True

    async def listen(self, runner: web.AppRunner, sock: socket.socket) -> asyncio.AbstractServer:
        """Serve ``runner``'s application on ``sock`` (bound), each connection guarded.
        Close what it returns before ``runner.cleanup()``."""
        server = runner.server
        assert server is not None, "set the runner up first"
        loop = asyncio.get_running_loop()
        return await loop.create_server(lambda: GuardedConnection(self, server), sock=sock)

    @web.middleware
    async def middleware(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Marks where each request begins and ends on its connection."""
        transport = request.transport
        connection = self.open.get(transport) if transport is not None else None
        if connection is not None:
            connection.request_started()
        try:
            return await handler(request)
        finally:
            if connection is not None:
                connection.request_finished()


class GuardedConnection(asyncio.Protocol):
    """One client connection: aiohttp's protocol for it (made once the connection is
    admitted), behind the bounds of the module docstring."""

    def __init__(self, guard: ConnectionGuard, make_protocol: Callable[[], Any]) -> None:
        self._guard = guard
        self._make_protocol = make_protocol
        self._inner: Any = None
        self._transport: asyncio.Transport | None = None
        self._phase = _Phase.HEAD
        self._head_bytes = 0
        self._tail = b""
        """The last bytes of the head so far, where its end may begin."""
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        guard = self._guard
        if not guard._room():
            self._refuse(503, "The gateway has as many connections open as it takes.", "busy")
            return
        guard.open[transport] = self
        self._inner = self._make_protocol()
        self._inner.connection_made(transport)
        self._start_head()

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if self._phase is _Phase.IDLE and data:
            self._start_head()
        if self._phase is _Phase.HEAD and data:
            head = _head_bytes_in(self._tail, data)
            if head is None:
                self._head_bytes += len(data)
                self._tail = (self._tail + data[-3:])[-3:]
            else:
                self._head_bytes += head
                self._head_done()
            if self._head_bytes > self._guard.max_header_bytes:
                self._refuse(
                    431,
                    f"The request line and headers exceed {self._guard.max_header_bytes} "
                    "bytes (--max-header-bytes).",
                    "headers_too_large",
                )
                return
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._transport is not None:
            self._guard.open.pop(self._transport, None)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    @property
    def in_request(self) -> bool:
        """Whether a request's head is in and its answer not yet written."""
        return self._phase is _Phase.REQUEST

    # -- where requests begin and end -------------------------------------------------------
    def request_started(self) -> None:
        """A request's handler runs: its head is in (it may have been read ahead)."""
        if self._phase is _Phase.HEAD:
            self._head_done()
        self._phase = _Phase.REQUEST
        self._cancel_timer()

    def request_finished(self) -> None:
        """Its handler returned: what arrives next is the next request's head."""
        self._phase = _Phase.IDLE
        self._cancel_timer()
        if self._transport is None or self._transport.is_closing():
            return  # closed while it ran (a write timeout): nothing to time
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.keep_alive_timeout, self._idle_timed_out)

    # -- internals ----------------------------------------------------------------------------
    def _start_head(self) -> None:
        self._phase = _Phase.HEAD
        self._head_bytes = 0
        self._tail = b""
        self._cancel_timer()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.header_timeout, self._head_timed_out)

    def _head_done(self) -> None:
        self._phase = _Phase.REQUEST
        self._tail = b""
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._phase is _Phase.HEAD:
            self._refuse(
                408,
                "The request line and headers did not arrive within "
                f"{self._guard.header_timeout:g} s (--header-timeout).",
                "request_timeout",
            )

    def _idle_timed_out(self) -> None:
        self._timer = None
        if self._phase is _Phase.IDLE and self._transport is not None:
            self._transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with an OpenAI-shaped error body and close the connection."""
        self._cancel_timer()
        self._phase = _Phase.REQUEST  # nothing more is read as a head
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        logger.debug("closing a connection: %s", message)
        error_type = "server_error" if status >= 500 else "invalid_request_error"
        body = orjson.dumps(
            {"error": {"message": message, "type": error_type, "param": None, "code": code}}
        )
        head = [
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
            b"Content-Type: application/json\r\n",
            b"Content-Length: %d\r\n" % len(body),
            b"Connection: close\r\n",
        ]
        if status == 503:
            head.append(b"Retry-After: 1\r\n")
        transport.write(b"".join([*head, b"\r\n", body]))
        transport.close()


def _head_bytes_in(tail: bytes, data: bytes) -> int | None:
    """How many bytes of ``data`` end the head whose last bytes so far are ``tail`` (at
    most 3), or None when the head goes on past ``data``."""
    if tail:
        across = (tail + data[:3]).find(_HEAD_END)
        if across >= 0:
            return across + len(_HEAD_END) - len(tail)
    end = data.find(_HEAD_END)
    return end + len(_HEAD_END) if end >= 0 else None

"""The connection layer under the application: what uvicorn itself does not bound.

uvicorn (with httptools) reads a request's line and headers for as long as the client sends
them, holds a connection that never sends a byte forever, and accepts every connection the
kernel hands it. Each of these costs memory before any request exists for the application's
middleware to refuse, so :class:`GuardedHttpToolsProtocol` bounds them where the bytes
arrive, for each connection:

* **Header size**: the bytes of a request's line and headers are counted as they arrive;
  past ``--max-header-bytes`` the client gets 431 and the connection is closed (httptools
  would otherwise buffer a header of any length: 200 MiB of one grew a server by 200 MiB).
* **Header timeout**: a request's line and headers must arrive within ``--header-timeout``
  of the connection opening, or of the next request's first byte on a kept-alive
  connection; then 408 and the connection is closed (half-open connections, and headers
  sent a byte at a time, used to stay open for good).
* **Connection cap**: a connection beyond ``--max-connections`` open ones is answered 503
  and closed at once.
* **Answers waiting to be sent**: an answer the client does not read stays in the
  connection's write buffer (a 44 MiB ``/pooling`` answer pinned 44 MiB for as long as the
  client liked). What a connection's buffer holds once the transport pauses writing (past its
  high-water mark, 64 KiB) counts against the process's ``--max-sending-bytes``
  (:class:`SendBudget`) until the buffer drains; while the budget is full, new requests are
  refused with 429 before any work (the middleware asks :meth:`budget_full`). A buffer that
  has not drained within ``--send-timeout`` is dropped and its connection aborted, which gives
  back its share. The next request on a connection is not worked on while its previous answer
  still waits (:meth:`previous_answer_sent`): one connection holds at most one answer.

Idle kept-alive connections end after ``--keep-alive-timeout`` (uvicorn's own timer), and a
body's timeout and the bytes bodies may hold while they arrive are the middleware's
(:mod:`embedding_server.api.middleware`), which sees them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from embedding_server.api.errors import error_body
from embedding_server.api.middleware import SENDING_SCOPE_KEY
from embedding_server.settings import ServerSettings

logger = logging.getLogger(__name__)


class SendBudget:
    """Bytes of answers written by one HTTP process and not yet taken by their clients,
    all connections together (``--max-sending-bytes``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    @property
    def full(self) -> bool:
        return self.held >= self.limit


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring (set per server
    by :func:`guarded_protocol`)."""

    max_header_bytes: ClassVar[int] = 32768
    header_timeout: ClassVar[float] = 10.0
    max_connections: ClassVar[int] = 1024
    send_timeout: ClassVar[float] = 30.0
    send_budget: ClassVar[SendBudget] = SendBudget(128 * 2**20)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        """Between requests or inside a request's line and headers: bytes are head bytes."""
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._unsent = 0
        """What this connection holds of :attr:`send_budget`."""
        self._send_timer: asyncio.TimerHandle | None = None
        self._sent = asyncio.Event()
        """Set while nothing waits to be sent beyond the transport's high-water mark."""
        self._sent.set()
        self.opened_at = 0.0
        """The loop's time when the connection was made."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened_at = self.loop.time()
        if len(self.connections) > self.max_connections and not self._make_room():
            self.refuse_busy()
            return
        self._arm_head_timer()

    def _make_room(self) -> bool:
        """Past the cap: whether room was made for this connection (the client port makes
        none: the new connection is refused)."""
        return False

    @property
    def waiting_for_request(self) -> bool:
        """Between requests or still sending one's line and headers."""
        return self._in_head

    def refuse_busy(self) -> None:
        """Answer 503 (the server holds as many connections as it takes) and close."""
        self._refuse(503, "The server has as many connections open as it takes.", "busy")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._answer_gone()
        super().connection_lost(exc)

    # -- answers waiting to be sent --------------------------------------------------------

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark: what it holds is charged to
        the budget, and the client has ``send_timeout`` to take it."""
        super().pause_writing()
        self._hold(self.transport.get_write_buffer_size())
        self._sent.clear()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._answer_gone()

    def _answer_gone(self) -> None:
        """Nothing (or only what is under the low-water mark) waits: give its share back."""
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        self._hold(0)
        self._sent.set()

    def _hold(self, size: int) -> None:
        self.send_budget.held += size - self._unsent
        self._unsent = size

    def _send_timed_out(self) -> None:
        self._send_timer = None
        unsent = self.transport.get_write_buffer_size()
        logger.info(
            "closing a connection from %s: %d bytes of its answer not taken within %g s "
            "(--send-timeout)",
            self.client,
            unsent,
            self.send_timeout,
        )
        self._answer_gone()
        self.transport.abort()  # drops the buffer; connection_lost follows

    async def previous_answer_sent(self) -> bool:
        """Wait until this connection's previous answer has been taken (at most
        ``send_timeout``, which then closes it); whether the connection is still open."""
        await self._sent.wait()
        return not self.transport.is_closing()

    def budget_full(self) -> bool:
        """Whether the process holds its ``--max-sending-bytes`` of answers waiting."""
        return self.send_budget.full

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Still in the head after these bytes: all of them were head bytes. httptools holds
        # at most this limit plus one read of them.
        if self._in_head and self._head_bytes > self.max_header_bytes:
            self._refuse(
                431,
                f"The request line and headers exceed {self.max_header_bytes} bytes.",
                "headers_too_large",
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        self.scope[SENDING_SCOPE_KEY] = self  # type: ignore[literal-required]
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # What follows on this connection is the next request's head (pipelined or not).
        self._in_head = True
        self._head_bytes = 0

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        self._refuse(
            408,
            f"The request line and headers did not arrive within {self.header_timeout:g} s.",
            "request_timeout",
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with an OpenAI-shaped error body and close the connection."""
        self._disarm_head_timer()
        self._in_head = False
        if self.transport.is_closing():
            return
        logger.debug("closing a connection from %s: %s", self.client, message)
        error_type = "server_error" if status >= 500 else "invalid_request_error"
        body = error_body(message, error_type, None, code)
        head = [
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
        ]
        if status == 503:
            head.append(b"retry-after: 1\r\n")
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self.transport.close()


def guarded_protocol(
    settings: ServerSettings,
    base: type[GuardedHttpToolsProtocol] = GuardedHttpToolsProtocol,
    *,
    max_connections: int | None = None,
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class (``base``'s) of a server with these settings' connection bounds
    and its own :class:`SendBudget`; ``max_connections`` in place of the settings' (the probe
    port's own cap)."""
    return type(
        base.__name__,
        (base,),
        {
            "max_header_bytes": settings.max_header_bytes,
            "header_timeout": settings.header_timeout,
            "max_connections": max_connections or settings.max_connections,
            "send_timeout": settings.send_timeout,
            "send_budget": SendBudget(settings.sending_bytes),
        },
    )

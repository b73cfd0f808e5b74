"""The engine process's end of the wire (``--api-workers N``): a unix socket every front-end
connects to, served from the one scheduler, so a batch holds sequences of every front-end.

Front-ends send token ids (:mod:`embedding_server.ipc.messages`); the engine answers with
vectors and, on every answer, its queue as the answer left, which front-ends admit requests
against (see :mod:`embedding_server.ipc.client`). It withdraws the queued work of a front-end
whose connection closes (one that crashed) as it does a cancelled request's, and welcomes
the front-end the engine process starts in its place like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pickle
import socket
from collections.abc import Callable, Sequence

from embedding_server.errors import EmbeddingServerError
from embedding_server.ipc.messages import (
    Cancel,
    Handoff,
    QueueNews,
    QueueView,
    Run,
    Welcome,
    decode_sequences,
    encode,
    encode_error,
    encode_output,
    to_engine,
)
from embedding_server.ipc.wire import Frames, Wire
from embedding_server.request.scheduler import ScheduledOutput, Scheduler

logger = logging.getLogger(__name__)


def _answer(wire: Wire, frames: Sequence[bytes | memoryview]) -> None:
    with contextlib.suppress(ConnectionError):  # the front-end is gone: nobody to tell
        wire.send(frames)


class EngineService:
    """The engine process's end: a unix socket every front-end connects to, served from the
    one scheduler. Listening from construction, before the model loads, so front-ends can
    connect and wait; :meth:`serve` answers them once the engine is warmed up."""

    def __init__(self, path: str) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(socket.SOMAXCONN)
        self._running: dict[tuple[Wire, int], asyncio.Future[ScheduledOutput]] = {}
        self._scheduler: Scheduler | None = None
        self._told: dict[Wire, int] = {}
        """The queue's held tokens each front-end last heard of, where that could refuse a
        request (see :meth:`_queue`)."""
        self._update_due = False

    async def serve(self, scheduler: Scheduler, handoff: Handoff, front_ends: int) -> None:
        """Answer front-ends until cancelled. The handoff goes to all ``front_ends`` at once,
        when the last has said hello: they share one port, so a front-end that served while
        another still started would let that one answer some clients "not ready"."""
        loop = asyncio.get_running_loop()
        self._scheduler = scheduler
        scheduler.watch(functools.partial(self._queue_changed, loop))
        payload = pickle.dumps(handoff, protocol=pickle.HIGHEST_PROTOCOL)
        welcome = encode(Welcome())
        failed: asyncio.Future[None] = loop.create_future()
        waiting: list[Wire] = []

        def connection() -> Wire:
            wire: Wire

            def received(frames: Frames) -> None:
                try:
                    self._received(scheduler, wire, frames, hello)
                except Exception as error:  # noqa: BLE001 - a bug: serving ends, the server too
                    if not failed.done():
                        failed.set_exception(error)

            def hello() -> None:
                nonlocal front_ends
                waiting.append(wire)
                if len(waiting) >= front_ends:
                    for each in waiting:
                        _answer(each, [welcome, payload])
                    waiting.clear()
                    front_ends = 0  # from now on (a restarted front-end) welcomed at once

            def lost() -> None:
                # A front-end that died before the handoff is not waited for: the one
                # started in its place says hello instead.
                if wire in waiting:
                    waiting.remove(wire)
                self._withdraw(wire)

            wire = Wire(received, lost)
            return wire

        server = await loop.create_unix_server(connection, sock=self._listener)
        try:
            await failed
        finally:
            scheduler.watch(None)
            server.close()
            for running in list(self._running.values()):
                running.cancel()

    def _received(
        self, scheduler: Scheduler, wire: Wire, frames: Frames, hello: Callable[[], None]
    ) -> None:
        message = to_engine.decode(frames[0])
        if isinstance(message, Run):
            rid = message.rid
            seqs = decode_sequences(frames[1:], message.want_tokens)
            try:
                running = scheduler.enqueue(seqs, priority=message.priority)
            except EmbeddingServerError as error:  # 413, 429, not running: answered at once
                _answer(wire, [encode_error(rid, error, self._queue(wire))])
                return
            # Answered from the future's callback: no task, no coroutine per request.
            self._running[(wire, rid)] = running
            running.add_done_callback(functools.partial(self._done, wire, rid))
        elif isinstance(message, Cancel):
            cancelled = self._running.get((wire, message.rid))
            if cancelled is not None:
                cancelled.cancel()  # the scheduler withdraws what is still queued
        else:
            hello()

    def _withdraw(self, wire: Wire) -> None:
        """A front-end gone (it crashed): its queued work leaves the scheduler."""
        self._told.pop(wire, None)
        for (owner, _), running in list(self._running.items()):
            if owner is wire:
                running.cancel()

    def _done(self, wire: Wire, rid: int, running: asyncio.Future[ScheduledOutput]) -> None:
        """Send a request's results, or its error, to its front-end."""
        self._running.pop((wire, rid), None)
        if running.cancelled():  # the front-end cancelled it, or is gone: nobody to tell
            return
        error = running.exception()
        if error is None:
            _answer(wire, encode_output(rid, running.result(), self._queue(wire)))
            return
        if not isinstance(error, EmbeddingServerError):  # the front-end raises it there
            logger.error("request failed in the engine: %s", error, exc_info=error)
        _answer(wire, [encode_error(rid, error, self._queue(wire))])

    def _view(self) -> int:
        """The queue's held tokens as front-ends are told them. A queue with room for any
        request within the per-request limit is told as empty: such a view cannot refuse a
        request, so it needs no news, and under all but overload the engine sends none."""
        assert self._scheduler is not None
        held = self._scheduler.held_tokens
        return held if held > self._scheduler.admission.refusing_above else 0

    def _queue(self, wire: Wire, held: int | None = None) -> QueueView:
        """The queue as ``wire``'s front-end is told it (tokens held, drain rate; ``held``
        when already read), noted so that it hears when the queue drains below that."""
        assert self._scheduler is not None
        if held is None:
            held = self._view()
        if held:
            self._told[wire] = held
        else:
            self._told.pop(wire, None)
        return held, self._scheduler.tokens_per_s

    def _queue_changed(self, loop: asyncio.AbstractEventLoop) -> None:
        """The scheduler's queue changed: see, once this turn of the loop is done, whether a
        front-end heard of more than it now holds."""
        if self._told and not self._update_due:
            self._update_due = True
            loop.call_soon(self._update_views)

    def _update_views(self) -> None:
        self._update_due = False
        view = self._view()
        for wire, heard in list(self._told.items()):
            if heard > view:
                held, rate = self._queue(wire, view)
                _answer(wire, [encode(QueueNews(held=held, rate=rate))])

    def close(self) -> None:
        self._listener.close()

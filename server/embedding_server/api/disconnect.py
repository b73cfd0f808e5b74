"""Client disconnects: a client that goes away gets its queued work cancelled, so the
scheduler does not spend forward passes on answers nobody reads.

The work runs in the request's own task; one watcher task reads the connection and, when
the client hangs up while the work is still running, cancels the request's task. Only the
``await`` of the work can receive that cancellation: the watcher checks, on the event loop,
that the work has not returned yet (``_Watch.done``, set before the request's task can
await anything else), so a cancellation can never land on the response being sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from embedding_server.api.errors import ClientDisconnectedError

T = TypeVar("T")


class _Watch:
    __slots__ = ("done", "fired", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.done = False  # the work returned or raised: too late to cancel it
        self.fired = False  # the watcher cancelled the task


async def _watch_for_disconnect(request: Request, watch: _Watch) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not watch.done:
                watch.fired = True
                watch.task.cancel()
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (dropping its queued
    batches) and raise :class:`ClientDisconnectedError`."""
    task = asyncio.current_task()
    assert task is not None, "an ASGI request always runs in a task"
    watch = _Watch(task)
    watcher = asyncio.get_running_loop().create_task(_watch_for_disconnect(request, watch))
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.fired:
            raise  # cancelled by someone else (shutdown): not ours to swallow
        task.uncancel()
        raise ClientDisconnectedError("The client disconnected; its work was cancelled.") from None
    finally:
        watch.done = True
        watcher.cancel()

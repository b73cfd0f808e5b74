"""cancel_on_disconnect: a hang-up cancels the work, and only the work."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from embedding_server.api.disconnect import cancel_on_disconnect
from embedding_server.api.errors import ClientDisconnectedError
from fastapi import Request


class _Connection:
    """The ``receive`` side of a request whose body was read: it answers only when the
    client hangs up."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def request(self) -> Request:
        return cast(Request, self)


async def test_a_hang_up_cancels_the_work_and_the_request_can_still_answer() -> None:
    connection = _Connection()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def work() -> str:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def request() -> str:
        try:
            await cancel_on_disconnect(connection.request(), work())
        except ClientDisconnectedError:
            await asyncio.sleep(0)  # the task is not left cancelled: it can still respond
            return "499 sent"
        return "200 sent"

    task = asyncio.create_task(request())
    await started.wait()
    connection.gone.set()
    assert await asyncio.wait_for(task, 5) == "499 sent"
    assert cancelled.is_set()


async def test_a_hang_up_after_the_work_returned_never_cancels_the_response() -> None:
    connection = _Connection()
    result: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def request() -> str:
        answer = await cancel_on_disconnect(connection.request(), result)
        # The client hung up in the same loop turn the work finished: the answer is still
        # sent (nobody reads it) rather than a cancellation landing mid-response.
        for _ in range(5):
            await asyncio.sleep(0)
        return answer

    task = asyncio.create_task(request())
    for _ in range(3):
        await asyncio.sleep(0)  # the watcher is waiting on the connection
    result.set_result("vectors")  # the request's task resumes first...
    connection.gone.set()  # ...then the watcher sees the hang-up, too late to cancel
    assert await asyncio.wait_for(task, 5) == "vectors"


async def test_the_hang_up_wins_when_it_lands_before_the_request_resumes() -> None:
    connection = _Connection()
    result: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(cancel_on_disconnect(connection.request(), result))
    for _ in range(3):
        await asyncio.sleep(0)
    connection.gone.set()  # the watcher runs first...
    result.set_result("vectors")  # ...though the work finished in the same loop turn
    with pytest.raises(ClientDisconnectedError):
        await asyncio.wait_for(task, 5)


async def test_a_shutdown_cancellation_is_not_taken_for_a_hang_up() -> None:
    connection = _Connection()
    task = asyncio.create_task(cancel_on_disconnect(connection.request(), asyncio.sleep(60)))
    for _ in range(3):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

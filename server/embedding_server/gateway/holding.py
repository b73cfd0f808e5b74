"""Requests held while their model has no ready endpoint (scale from zero, or a rollout
that took every pod away at once).

Held requests are bounded per model by count and by estimated tokens, so a cold model
cannot take the gateway's memory, and each waits at most until its deadline. When an
endpoint becomes ready every waiter of the model is released, interactive ones first: they
are woken in that order and so reach the new pod's queue first. The number held per model
is the demand signal an autoscaler scales a model from zero on
(``embedding_gateway_held_requests``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from embedding_server.gateway.settings import Priority


class HoldFullError(Exception):
    """The model's holding queue is at its request or token bound."""


class HoldClosedError(Exception):
    """The gateway is shutting down: nothing is held any more (:meth:`Holding.close`)."""


@dataclass
class _Waiter:
    tokens: int
    future: asyncio.Future[None]


@dataclass
class _ModelHold:
    interactive: deque[_Waiter] = field(default_factory=deque)
    bulk: deque[_Waiter] = field(default_factory=deque)
    tokens: int = 0

    @property
    def count(self) -> int:
        return len(self.interactive) + len(self.bulk)


class Holding:
    """Per-model holding queues. ``on_change(model, count)`` reports the number held."""

    def __init__(
        self,
        *,
        max_requests: int,
        max_tokens: int,
        on_change: Callable[[str, int], None] = lambda model, count: None,
    ) -> None:
        self._max_requests = max_requests
        self._max_tokens = max_tokens
        self._on_change = on_change
        self._models: dict[str, _ModelHold] = {}
        self._closed = False

    def held(self, model: str) -> int:
        hold = self._models.get(model)
        return hold.count if hold is not None else 0

    async def wait(self, model: str, tokens: int, priority: Priority, timeout: float) -> bool:
        """Hold until :meth:`release` for ``model`` (True) or ``timeout`` seconds (False).

        Raises :class:`HoldFullError` at once when the model already holds its bound, and
        :class:`HoldClosedError` once the gateway is shutting down (:meth:`close`).
        """
        if self._closed:
            raise HoldClosedError(model)
        hold = self._models.setdefault(model, _ModelHold())
        if hold.count + 1 > self._max_requests or hold.tokens + tokens > self._max_tokens:
            raise HoldFullError(model)
        waiter = _Waiter(tokens, asyncio.get_running_loop().create_future())
        queue = hold.interactive if priority == "interactive" else hold.bulk
        queue.append(waiter)
        hold.tokens += tokens
        self._on_change(model, hold.count)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):  # released ones are out already
                queue.remove(waiter)
                hold.tokens -= waiter.tokens
            self._on_change(model, hold.count)

    def release(self, model: str) -> int:
        """Wake every request held for ``model``, interactive first; return how many."""
        hold = self._models.get(model)
        if hold is None:
            return 0
        released = 0
        for queue in (hold.interactive, hold.bulk):
            while queue:
                waiter = queue.popleft()
                hold.tokens -= waiter.tokens
                if not waiter.future.done():
                    waiter.future.set_result(None)
                released += 1
        self._on_change(model, hold.count)
        return released

    def close(self) -> int:
        """Shutting down: wake every held request with :class:`HoldClosedError`, so that its
        client is answered (503, retry elsewhere) within the shutdown's grace period rather
        than cut off at its end, and hold nothing from now on; return how many were held."""
        self._closed = True
        woken = 0
        for model, hold in self._models.items():
            for queue in (hold.interactive, hold.bulk):
                while queue:
                    waiter = queue.popleft()
                    hold.tokens -= waiter.tokens
                    if not waiter.future.done():
                        waiter.future.set_exception(HoldClosedError(model))
                    woken += 1
            self._on_change(model, hold.count)
        return woken

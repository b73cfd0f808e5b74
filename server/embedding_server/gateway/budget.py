"""The bytes the gateway holds for requests: one budget for the whole process.

The gateway holds what it forwards whole, so that a pod that dies mid-request or
mid-answer can be retried on another: a request's body from its first byte until its
answer is in, and the answer from its first byte until the client has taken it. Each is
charged here before it is read, by its ``Content-Length`` (or, for a chunked one, as it
arrives), and given back when it is dropped. A request that does not fit gets 503 with
``Retry-After`` before its bytes are read (:mod:`embedding_server.gateway.proxy`); a
connection's other bounds (its header bytes, its timeouts, the connection cap) are
:mod:`embedding_server.gateway.connections`'.

The first :data:`FREE_BYTES` of each body and each answer are not charged, as the server
does not charge them to its receiving budget: a small request is never refused by it, and
what small ones hold together is bounded by the connection cap instead.
"""

from __future__ import annotations

from collections.abc import Callable

FREE_BYTES = 64 * 1024
"""Bytes of each body or answer that are not charged (at most this times
``--max-connections`` in all: 64 MiB at the defaults)."""


class ByteBudget:
    """``limit`` bytes for all holds together; ``held`` is what they hold now, and
    ``on_change`` hears of every change (the gateway's gauge)."""

    def __init__(self, limit: int, on_change: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.held = 0
        self._on_change = on_change

    def hold(self) -> Hold:
        """A hold of nothing yet, to :meth:`Hold.resize` as bytes are known."""
        return Hold(self)

    def has_room(self, size: int) -> bool:
        """Whether a new hold of ``size`` bytes fits now."""
        return self.held + _charged(size) <= self.limit

    def fits(self, size: int) -> bool:
        """Whether one hold of ``size`` bytes could ever fit (in an empty budget)."""
        return _charged(size) <= self.limit

    def _change(self, delta: int) -> None:
        self.held += delta
        if self._on_change is not None:
            self._on_change(self.held)


class Hold:
    """The bytes one body or answer holds of a :class:`ByteBudget`."""

    __slots__ = ("_budget", "charged")

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.charged = 0

    def resize(self, size: int) -> bool:
        """Hold ``size`` bytes in all (less the free ones); False, holding what it held,
        when the budget has no room for them."""
        charged = _charged(size)
        budget = self._budget
        if charged > self.charged and budget.held + charged - self.charged > budget.limit:
            return False
        budget._change(charged - self.charged)
        self.charged = charged
        return True

    def release(self) -> None:
        """Give everything back (again: nothing)."""
        if self.charged:
            self._budget._change(-self.charged)
            self.charged = 0


def _charged(size: int) -> int:
    return max(0, size - FREE_BYTES)

"""Admission: whether the queue takes a request, decided before it is tokenized and again when
its exact tokens are queued.

The rules (:class:`Admission`) are the scheduler's, and every ``--api-workers`` front-end
applies the same ones on its latest view of the engine process's queue
(:class:`~embedding_server.ipc.client.EngineClient`), so a request the engine would refuse is
refused before it costs tokenization, as it is in one process. What a request is likely to
hold before it is tokenized is :mod:`embedding_server.request.estimates`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from embedding_server.errors import QueueFullError, TooManyTokensError


def drain_seconds(held: int, tokens_per_s: float) -> float:
    """A full queue's ``Retry-After``: the seconds until ``held`` tokens have likely drained at
    the measured rate (1 to 60; 1 before any rate is measured)."""
    if tokens_per_s <= 0:
        return 1.0
    return float(min(60, max(1, math.ceil(held / tokens_per_s))))


Priority = Literal["interactive", "bulk"]
"""A request's class: ``interactive`` (queries a user waits for) or ``bulk`` (indexing)."""

PRIORITIES: tuple[Priority, ...] = ("interactive", "bulk")

BULK_QUEUE_SHARE = 0.75
"""Bulk requests may fill at most this share of ``max_queue_tokens``: the last quarter of the
queue is kept for interactive requests, which are admitted there while bulk ones get 429.
A quarter holds a few full batches at the default budgets, enough for a burst of queries to
wait one batch rather than be refused behind an indexing job."""

TOKENIZING_QUEUES = 4
"""Requests being tokenized may hold at most this many queues' worth of tokens by their
bounds: ordinary text's bound is about four times what it holds, so this budget is reached
about when the queue is, while text made to hold a token per byte is bounded all the same."""


@dataclass(eq=False)
class Admission:
    """The queue's admission rules and the room reserved for requests being tokenized.

    The scheduler admits with it; so does each ``--api-workers`` front-end, on its latest
    view of the engine process's queue (:class:`~.ipc.client.EngineClient`), so that a request the
    engine would refuse is refused there before it is tokenized, as it is in one process."""

    max_queue_tokens: int
    max_request_tokens: int
    bulk_queue_tokens: int = 0
    """Tokens held past which bulk requests are refused (:data:`BULK_QUEUE_SHARE` of the
    queue; 0 means the whole queue)."""
    reserved: int = 0
    """Tokens held in the queue for admitted requests still being tokenized (their likely
    count)."""
    tokenizing: int = 0
    """The most tokens the requests being tokenized can hold (their bounds)."""

    @classmethod
    def of(cls, max_queue_tokens: int, max_request_tokens: int | None = None) -> Admission:
        """Rules for a queue of ``max_queue_tokens``; one request may hold at most
        ``max_request_tokens`` (at most, and by default, the whole queue)."""
        limit = min(max_request_tokens or max_queue_tokens, max_queue_tokens)
        return cls(max_queue_tokens, limit, int(max_queue_tokens * BULK_QUEUE_SHARE))

    def limit(self, priority: Priority) -> int:
        """The tokens the queue may hold with a request of ``priority`` in it."""
        if priority == "bulk" and self.bulk_queue_tokens:
            return self.bulk_queue_tokens
        return self.max_queue_tokens

    def check_size(self, tokens: int, *, exact: bool) -> None:
        """Refuse a request of ``tokens`` (``exact``, or at least that many) over the
        per-request limit, whatever the queue holds."""
        if tokens > self.max_request_tokens:
            amount = f"{tokens}" if exact else f"at least {tokens}"
            raise TooManyTokensError(
                f"this request holds {amount} tokens; one request may hold at most "
                f"{self.max_request_tokens} (max_request_tokens); split it into smaller requests",
                param="input",
            )

    def check_room(
        self,
        queued: int,
        tokens: int,
        tokens_per_s: float,
        priority: Priority = "interactive",
    ) -> None:
        """Refuse ``tokens`` more when the queue holds ``queued`` (plus what is reserved) and
        they would not fit in what a request of ``priority`` may fill (:meth:`limit`). An
        empty queue admits any request within the per-request limit, bulk included, so a
        big request is delayed, never refused forever."""
        held = queued + self.reserved
        limit = self.limit(priority)
        if held and held + tokens > limit:
            if limit < self.max_queue_tokens:
                message = (
                    f"the queue holds {held} of {self.max_queue_tokens} tokens and bulk "
                    f"requests may fill at most {limit} of them (X-Priority: bulk); this "
                    f"request needs {tokens}; retry later"
                )
            else:
                message = (
                    f"the queue holds {held} of {self.max_queue_tokens} tokens and this "
                    f"request needs {tokens}; retry later"
                )
            raise QueueFullError(message, retry_after=drain_seconds(held, tokens_per_s))

    def tokenizing_limit(self, priority: Priority) -> int:
        """The most tokens requests being tokenized may hold (by their bounds) with one of
        ``priority`` among them: :data:`TOKENIZING_QUEUES` queues' worth, of which bulk may
        fill :data:`BULK_QUEUE_SHARE`, so that bulk text which looks cheap but tokenizes to a
        token per byte cannot fill this budget and get queries refused behind it."""
        whole = TOKENIZING_QUEUES * self.max_queue_tokens
        if priority == "bulk" and self.bulk_queue_tokens:
            return int(whole * BULK_QUEUE_SHARE)
        return whole

    @property
    def refusing_above(self) -> int:
        """Below this many tokens held, the queue has room for any request within the
        per-request limit, of either priority (only a queue fuller than that refuses one)."""
        least = min(self.limit(priority) for priority in PRIORITIES)
        return max(0, least - self.max_request_tokens)

    def reserve(
        self,
        floor: int,
        estimate: int,
        queued: int,
        tokens_per_s: float,
        *,
        bound: int | None = None,
        priority: Priority = "interactive",
    ) -> Reservation:
        """Admit a request before it is tokenized, on what it is known to hold: ``floor``
        tokens at least, about ``estimate`` (held in the queue's budget) and at most ``bound``
        (held in the budget of what is being tokenized, :data:`TOKENIZING_QUEUES` queues), all
        until released. An estimate or bound over the per-request limit counts as the limit:
        a request that really holds more is refused when its exact tokens are queued.

        Two budgets, because the likely count of a text is a guess a hostile text can beat
        (one token per character of punctuation) and its bound is four times what ordinary
        text holds: the queue is charged what is likely, so ordinary requests fill it, and
        what the tokenizer may have to produce is bounded however the texts are made.
        A ``bulk`` request is admitted into :data:`BULK_QUEUE_SHARE` of the queue only."""
        self.check_size(floor, exact=False)
        bound = min(estimate if bound is None else bound, self.max_request_tokens)
        estimate = min(estimate, bound)
        self.check_room(queued, estimate, tokens_per_s, priority)
        budget = self.tokenizing_limit(priority)
        if self.tokenizing and self.tokenizing + bound > budget:
            whose = " bulk requests" if budget < TOKENIZING_QUEUES * self.max_queue_tokens else ""
            raise QueueFullError(
                f"requests being tokenized may hold up to {self.tokenizing} tokens, of "
                f"{budget}{whose} may have tokenized at once, and this request up to "
                f"{bound}; retry later",
                retry_after=drain_seconds(queued + self.reserved, tokens_per_s),
            )
        self.reserved += estimate
        self.tokenizing += bound
        return Reservation(self, estimate, bound)


@dataclass(eq=False)
class Reservation:
    """Queue room held for a request while it is tokenized; released exactly once."""

    admission: Admission
    tokens: int
    bound: int = 0

    def release(self) -> None:
        if self.tokens or self.bound:
            self.admission.reserved -= self.tokens
            self.admission.tokenizing -= self.bound
            self.tokens = self.bound = 0

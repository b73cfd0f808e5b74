"""Continuous batching by token budget, with admission control and cancellation.

Requests are split into one work item per input and queued. A single loop on the event loop
repeatedly forms a batch and runs it on the one forward thread, so request handling goes on
while the model computes (torch releases the GIL). A batch runs in two halves
(:class:`BatchRunner`): ``prepare`` packs it on the host and starts its copy to the device,
``execute`` runs the forward pass. While batch N executes, batch N+1 is taken and prepared on
a thread of its own, so the device does not idle while the host packs:

* **Budget**: a batch holds at most ``max_batch_tokens`` tokens (sum of unpadded lengths)
  and ``max_batch_size`` sequences.
* **Fairness**: the oldest waiting item is always in the next batch, so nothing starves.
* **Length-aware fill**: the rest of the batch is filled with the items whose length is
  closest to the oldest one's (oldest first among equals). Equal lengths make CPU attention
  a zero-copy view and keep padded GPU kernels honest.
* **Admission**: one request may hold at most ``max_request_tokens`` (more is
  :class:`TooManyTokensError`, never queued), and the queue is bounded in *tokens*
  (``max_queue_tokens``); a request that does not fit gets :class:`QueueFullError` with a
  ``retry_after`` derived from the measured drain rate. Admission happens twice: before
  tokenizing, on what the request is known to hold (:meth:`Scheduler.reserve`: queue room is
  reserved for its estimate, so a crowd of requests is refused before it pays tokenization),
  and when its exact tokens are queued (:meth:`Scheduler.submit`). An empty queue admits any
  request within the per-request limit, so a big request is delayed, never refused forever.
  The rules are :class:`~embedding_server.request.admission.Admission`'s, which
  ``--api-workers`` front-ends apply too, on their view of the engine process's queue
  (:mod:`embedding_server.ipc`).
* **Priority**: each request is ``interactive`` (the default) or ``bulk`` (the
  ``X-Priority`` header). Bulk requests may fill at most :data:`BULK_QUEUE_SHARE` of
  ``max_queue_tokens``; past that they get :class:`QueueFullError` (429) while interactive
  ones are still admitted, so a bulk indexing job cannot take the room a user's query
  needs. A batch is anchored on the oldest *interactive* item and filled with interactive
  items first; bulk items fill what room is left, so bulk rides the slack interactive
  traffic leaves. When interactive traffic leaves none, the oldest bulk item anchors every
  :data:`BULK_TURN`-th batch all the same: bulk is slowed, never starved. Within a class the
  fairness rule above holds as it is. A batch that holds bulk items holds at most what the
  model runs in ``bulk_batch_seconds`` (``--bulk-batch-ms``) at its measured rate, its bulk
  anchor aside (:meth:`Scheduler.bulk_room`), while interactive requests came recently
  (:data:`BULK_CAP_MEMORY_S`): a query that arrives while bulk work runs waits for that
  long at most, not for a full batch budget. A batch of bulk items only, prepared ahead while
  interactive items were not yet queued, is passed once by a batch formed for those that
  arrived since: a query waits for the batch running when it arrives, never also for a bulk
  batch packed behind it (the passed batch runs next, so bulk loses one batch's time).
* **Pipelining, lazily**: batch N+1 is taken while N runs only once the queue holds a full
  batch (``max_batch_tokens`` tokens or ``max_batch_size`` items), so nothing that arrives
  later could have joined it anyway; otherwise it is taken when N returns, and everything
  that arrived during N still gets into it. Under saturation the device never waits for
  packing; under light load no request waits a batch longer for it.
* **Cancellation**: when the awaiting coroutine is cancelled (client went away), its queued
  items leave the queue at once; items already in a prepared or running batch are discarded
  on return, and a prepared batch whose requests have all gone is never run.
* **Failure**: a failed forward pass fails its batch's requests with the error, and the loop
  goes on; after a fatal device error the runner refuses every later batch (the prepared
  one included) with :class:`~.errors.EngineFailedError`. Stopping fails what is queued,
  prepared or running with :class:`~.errors.NotReadyError`.

The queue gauges (requests and tokens waiting) and the backlog in seconds (the work queued
and running over the throughput measured recently, :func:`backlog_seconds`) are updated on
every change: they drive the autoscalers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, TypeVar

import numpy as np

from embedding_server.errors import NotReadyError
from embedding_server.metrics import Metrics
from embedding_server.request.admission import (
    PRIORITIES,
    Admission,
    Priority,
    Reservation,
)
from embedding_server.request.pooling import FloatArray
from embedding_server.request.sequences import BatchOutput, SequenceInput

logger = logging.getLogger(__name__)

Prepared = TypeVar("Prepared")


class BatchRunner(Protocol[Prepared]):
    """The two halves of a forward pass (``device.runner.ModelRunner``): ``prepare`` is host
    work that must not wait for the model; ``execute`` runs on the one forward thread."""

    def prepare(self, seqs: Sequence[SequenceInput]) -> Prepared: ...

    def execute(self, prepared: Prepared) -> BatchOutput: ...


class _State(Enum):
    QUEUED = 0
    TAKEN = 1
    CANCELLED = 2


@dataclass(frozen=True, slots=True)
class ScheduledOutput:
    """A request's raw results: pooled vectors (before per-request head) and timings."""

    pooled: FloatArray  # [n, d]
    tokens: list[FloatArray | None]
    queue_s: float
    forward_s: float
    pool_s: float
    batches: int = 1
    """Forward passes the request's sequences rode (traces report them)."""
    batch_size: int = 0
    """Sequences in the largest of those passes, the request's own and others'."""
    batch_tokens: int = 0
    """Tokens in the largest of those passes."""


@dataclass(eq=False)
class _Request:
    future: asyncio.Future[ScheduledOutput]
    size: int
    enqueued_at: float
    priority: Priority = "interactive"
    pooled: list[FloatArray | None] = field(default_factory=list)
    tokens: list[FloatArray | None] = field(default_factory=list)
    remaining: int = 0
    queued_items: int = 0
    queue_s: float = 0.0
    forward_s: float = 0.0
    pool_s: float = 0.0
    batches: int = 0
    batch_size: int = 0
    batch_tokens: int = 0


RATE_DECAY = 0.8
"""How much of the throughput estimate each batch keeps from the ones before it: about the
last ten batches count, so the estimate follows a change of traffic (short texts after long
ones) within seconds, and one odd batch (a cold cache, a pause) moves it by a fifth."""


@dataclass
class Throughput:
    """The tokens per second the model has measured recently: a decaying average of batch
    tokens over a decaying average of batch seconds (forward pass and pooling).

    A ratio of averages, not an average of per-batch rates: a batch of 8 tokens that took
    as long as one of 2,000 (a small batch is mostly fixed cost) counts for its share of the
    time, so the estimate says how fast the queue drains, which is what the backlog and a full
    queue's ``Retry-After`` need."""

    decay: float = RATE_DECAY
    tokens: float = 0.0
    seconds: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One batch of ``tokens`` that kept the model busy for ``seconds``."""
        if seconds <= 0:
            return
        self.tokens = self.decay * self.tokens + (1 - self.decay) * tokens
        self.seconds = self.decay * self.seconds + (1 - self.decay) * seconds

    @property
    def tokens_per_s(self) -> float:
        """The measured rate; 0 before the first batch."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class EngineLoad:
    """The work ahead of a new request, as ``GET /load`` reports it to a gateway: tokens
    admitted and waiting, tokens in batches taken from the queue, and both in seconds at
    the rate the model measured recently (the ``embedding_server_backlog_seconds`` gauge,
    :func:`backlog_seconds`)."""

    queued_tokens: int = 0
    running_tokens: int = 0
    backlog_seconds: float = 0.0


def backlog_seconds(work_tokens: int, tokens_per_s: float, prior_tokens_per_s: float) -> float:
    """Seconds of work waiting: ``work_tokens`` (queued plus running) at the measured rate.

    Before the first batch is measured there is no rate; the model is then assumed to run
    ``prior_tokens_per_s`` (the scheduler passes one full batch budget per second). That
    guess is pessimistic for a GPU and about right for a small model on CPU; it errs toward
    reporting work, never hides a queue, and is replaced by a measurement as soon as the
    first batch returns (within a second on any device). No work is 0 whatever the rate."""
    if work_tokens <= 0:
        return 0.0
    rate = tokens_per_s if tokens_per_s > 0 else prior_tokens_per_s
    return work_tokens / rate if rate > 0 else 0.0


BULK_TURN = 4
"""When interactive work fills every batch, the oldest bulk item anchors every this-many-th
batch anyway (bulk gets at least a fifth of the batches' anchors under saturation), so bulk
traffic is slowed by interactive traffic, never starved by it."""


BULK_CAP_MEMORY_S = 60.0
"""``bulk_batch_seconds`` caps bulk batches while interactive requests came in this many
seconds ago at most: a service that only indexes runs full batches, and one whose users query
it now and then keeps its cap between their queries."""


@dataclass(eq=False, slots=True)
class _Item:
    seq: SequenceInput
    tokens: int
    request: _Request
    index: int
    state: _State = _State.QUEUED


@dataclass(eq=False, slots=True)
class _Lane:
    """The queued items of one priority: in arrival order, and by length (the same items;
    taken or cancelled ones are dropped from both lazily)."""

    fifo: deque[_Item] = field(default_factory=deque)
    by_len: dict[int, deque[_Item]] = field(default_factory=dict)
    items: int = 0
    """Items of this lane still queued."""

    def oldest(self) -> _Item | None:
        """The oldest item still queued (dropping the taken and cancelled ones before it)."""
        while self.fifo and self.fifo[0].state is not _State.QUEUED:
            self.fifo.popleft()
        return self.fifo[0] if self.fifo else None


@dataclass(eq=False, slots=True)
class _Batch:
    """Items taken from the queue together, and (once prepared) the runner's packed form."""

    items: list[_Item]
    tokens: int = 0
    """Tokens of its items still counted as running work (0 once it is finished)."""
    prepared: Any = None
    ready: bool = False
    """``prepared`` holds the batch prepared ahead of its turn."""
    passable: bool = False
    """Bulk items only, taken while no interactive item was queued: interactive items
    queued later may run first in a batch of their own, once (:meth:`Scheduler._loop`)."""

    def wanted(self) -> bool:
        """Whether any of its requests still waits for a result."""
        return any(not item.request.future.done() for item in self.items)

    def fail(self, exc: BaseException) -> None:
        for item in self.items:
            if not item.request.future.done():
                item.request.future.set_exception(exc)


class Scheduler:
    """Token-budget continuous batching in front of one forward executor."""

    def __init__(
        self,
        runner: BatchRunner[Any],
        *,
        max_batch_tokens: int,
        max_batch_size: int,
        max_queue_tokens: int,
        max_request_tokens: int | None = None,
        bulk_batch_seconds: float | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        if bulk_batch_seconds is not None and bulk_batch_seconds <= 0:
            raise ValueError("bulk_batch_seconds must be positive (None: no cap)")
        self._runner = runner
        self._executor: Executor | None = None
        self._prepare_pool: ThreadPoolExecutor | None = None
        self._running: _Batch | None = None
        self._upcoming: _Batch | None = None
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.bulk_batch_seconds = bulk_batch_seconds
        self.admission = Admission.of(max_queue_tokens, max_request_tokens)
        self._metrics = metrics
        self._lanes: dict[Priority, _Lane] = {p: _Lane() for p in PRIORITIES}
        self._bulk_passed = 0  # batches formed in a row without bulk items while bulk waited
        self._interactive_at = -math.inf  # monotonic time of the last interactive request
        self._queued_tokens = 0
        self._queued_requests = 0
        self._queued_items = 0
        self._taken_tokens = 0  # in batches taken from the queue that have not finished
        self._accepting = False
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._throughput = Throughput()
        self._watcher: Callable[[], None] | None = None
        self.batches_run = 0
        if metrics is not None:
            metrics.batch_budget_tokens.set(max_batch_tokens)

    # -- observability ---------------------------------------------------------------------
    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def queued_requests(self) -> int:
        return self._queued_requests

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def tokens_per_s(self) -> float:
        """The measured drain rate (:class:`Throughput`; 0 before the first batch)."""
        return self._throughput.tokens_per_s

    @property
    def running_tokens(self) -> int:
        """Tokens in batches taken from the queue (running, or prepared to run next)."""
        return self._taken_tokens

    @property
    def backlog_seconds(self) -> float:
        """Seconds of work queued and running at the measured rate (:func:`backlog_seconds`;
        before the first batch, at one batch budget per second)."""
        return backlog_seconds(
            self._queued_tokens + self._taken_tokens, self.tokens_per_s, self.max_batch_tokens
        )

    @property
    def held_tokens(self) -> int:
        """Tokens the queue holds against ``max_queue_tokens``: queued and reserved."""
        return self._queued_tokens + self.admission.reserved

    def watch(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` whenever what the queue holds changes (``None`` stops)."""
        self._watcher = callback

    def _publish(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_tokens.set(self._queued_tokens)
            self._metrics.queue_requests.set(self._queued_requests)
            self._metrics.backlog_seconds.set(self.backlog_seconds)
        if self._watcher is not None:
            self._watcher()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, executor: Executor | None = None) -> None:
        """Run the batching loop on the current event loop; forward passes go to ``executor``
        (one thread: passes are serialized anyway, and a dedicated thread keeps the loop free).
        ``None`` uses the loop's default executor. Batches prepared ahead of their turn are
        packed on a thread the scheduler owns."""
        if self.running:
            return
        self._executor = executor
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="prepare")
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True
        self._task = asyncio.create_task(self._loop(), name="embedding-scheduler")
        self._publish()

    async def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; finish (drain) or fail the queued work; end the loop."""
        self._accepting = False
        if self._task is None:
            return
        if drain and self._idle is not None:
            try:
                async with asyncio.timeout(timeout):
                    await self._idle.wait()
            except TimeoutError:
                logger.warning("drain timed out with %d tokens queued", self._queued_tokens)
        self._fail_queued(NotReadyError("the server is shutting down"))
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if self._prepare_pool is not None:
            self._prepare_pool.shutdown(wait=False)
            self._prepare_pool = None
        self._publish()

    # -- submission ------------------------------------------------------------------------
    def reserve(
        self,
        floor: int,
        estimate: int,
        bound: int | None = None,
        priority: Priority = "interactive",
    ) -> Reservation:
        """Admit a request before it is tokenized, on what it is known to hold: ``floor``
        tokens at least (over ``max_request_tokens`` it is refused), about ``estimate``,
        which is held in the queue's budget until :meth:`submit` or ``release``, and at
        most ``bound`` (:meth:`Admission.reserve`; bulk into its share of the queue)."""
        if not self._accepting:
            raise NotReadyError("the engine is not running (starting up or shutting down)")
        return self.admission.reserve(
            floor, estimate, self._queued_tokens, self.tokens_per_s, bound=bound,
            priority=priority,
        )  # fmt: skip

    async def submit(
        self,
        seqs: Sequence[SequenceInput],
        reservation: Reservation | None = None,
        priority: Priority = "interactive",
    ) -> ScheduledOutput:
        """Queue one request's sequences and wait for all their results (its reservation,
        if any, becomes the exact count). Cancelling the caller withdraws what is queued."""
        return await self.enqueue(seqs, reservation, priority)

    def enqueue(
        self,
        seqs: Sequence[SequenceInput],
        reservation: Reservation | None = None,
        priority: Priority = "interactive",
    ) -> asyncio.Future[ScheduledOutput]:
        """:meth:`submit` without a coroutine: queue the sequences and return the future of
        their results. Cancelling the future withdraws whatever of the request is still
        queued. For callers that answer from a callback (the engine process answers each
        front-end's request so, with no task per request)."""
        if reservation is not None:
            reservation.release()
        if not self._accepting or self._wakeup is None:
            raise NotReadyError("the engine is not running (starting up or shutting down)")
        total = sum(len(s.ids) for s in seqs)
        self.admission.check_size(total, exact=True)
        self.admission.check_room(self._queued_tokens, total, self.tokens_per_s, priority)
        loop = asyncio.get_running_loop()
        request = _Request(
            future=loop.create_future(),
            size=len(seqs),
            enqueued_at=time.perf_counter(),
            priority=priority,
            pooled=[None] * len(seqs),
            tokens=[None] * len(seqs),
            remaining=len(seqs),
            queued_items=len(seqs),
        )
        if priority == "interactive":
            self._interactive_at = time.monotonic()
        lane = self._lanes[priority]
        for index, seq in enumerate(seqs):
            item = _Item(seq, len(seq.ids), request, index)
            lane.fifo.append(item)
            lane.by_len.setdefault(item.tokens, deque()).append(item)
        lane.items += len(seqs)
        self._queued_tokens += total
        self._queued_items += len(seqs)
        self._queued_requests += 1
        self._publish()
        if self._idle is not None:
            self._idle.clear()
        self._wakeup.set()
        request.future.add_done_callback(functools.partial(self._withdraw_if_cancelled, request))
        return request.future

    def _withdraw_if_cancelled(self, request: _Request, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            self._withdraw(request)

    def _withdraw(self, request: _Request) -> None:
        """Remove a cancelled request's queued items (lazily dropped from the deques)."""
        if request.queued_items == 0:
            return
        lane = self._lanes[request.priority]
        for item in lane.fifo:
            if item.request is request and item.state is _State.QUEUED:
                item.state = _State.CANCELLED
                self._queued_tokens -= item.tokens
                self._queued_items -= 1
                lane.items -= 1
        request.queued_items = 0
        self._queued_requests -= 1
        self._publish()

    def _fail_queued(self, exc: BaseException) -> None:
        for lane in self._lanes.values():
            for item in lane.fifo:
                if item.state is _State.QUEUED:
                    item.state = _State.CANCELLED
                    if not item.request.future.done():
                        item.request.future.set_exception(exc)
            lane.fifo.clear()
            lane.by_len.clear()
            lane.items = 0
        self._queued_tokens = self._queued_items = self._queued_requests = 0
        self._publish()

    # -- batching --------------------------------------------------------------------------
    def _take(self, item: _Item, batch: list[_Item]) -> None:
        item.state = _State.TAKEN
        batch.append(item)
        self._taken_tokens += item.tokens
        self._queued_tokens -= item.tokens
        self._queued_items -= 1
        request = item.request
        self._lanes[request.priority].items -= 1
        request.queued_items -= 1
        if request.queued_items == 0:
            self._queued_requests -= 1

    def next_batch(self) -> list[_Item]:
        """Pick the next batch: the oldest interactive item (the oldest bulk one when none
        is queued, or when bulk is owed its turn, :data:`BULK_TURN`), then interactive
        items of the closest lengths within budget, then bulk ones in the room left."""
        batch: list[_Item] = []
        interactive, bulk = self._lanes["interactive"], self._lanes["bulk"]
        first, waiting = interactive.oldest(), bulk.oldest()
        if waiting is not None and (first is None or self._bulk_passed >= BULK_TURN):
            first = waiting
        if first is None:
            return batch
        self._take(first, batch)
        budget = self.max_batch_tokens - first.tokens
        room = self.bulk_room()
        if first.request.priority == "bulk":  # the batch holds bulk: all of it within room
            budget = min(budget, room - first.tokens)
            for lane in (interactive, bulk):
                budget = self._fill(lane, batch, budget, first.tokens)
        else:
            budget = self._fill(interactive, batch, budget, first.tokens)
            held = self.max_batch_tokens - budget
            if room - held > 0:
                self._fill(bulk, batch, min(budget, room - held), first.tokens)
        if bulk.items and not any(item.request.priority == "bulk" for item in batch):
            self._bulk_passed += 1
        else:
            self._bulk_passed = 0
        self._publish()
        return batch

    def bulk_room(self) -> int:
        """Most tokens a batch that holds bulk items may hold (its bulk anchor aside): what the
        model runs in ``bulk_batch_seconds`` at the rate measured recently, within the batch
        budget, so a query that arrives while such a batch runs waits about that long at most.
        The whole budget without a cap, before the first batch, and when no interactive
        request came in the last :data:`BULK_CAP_MEMORY_S` seconds."""
        rate = self.tokens_per_s
        if self.bulk_batch_seconds is None or rate <= 0:
            return self.max_batch_tokens
        if time.monotonic() - self._interactive_at > BULK_CAP_MEMORY_S:
            return self.max_batch_tokens  # bulk only, lately: nobody waits for it
        return min(self.max_batch_tokens, int(rate * self.bulk_batch_seconds))

    def _fill(self, lane: _Lane, batch: list[_Item], budget: int, anchor: int) -> int:
        """Add ``lane``'s items to ``batch``, lengths closest to ``anchor`` first (oldest
        first among equals), within ``budget`` tokens and the batch size; the budget left."""
        for length in sorted(lane.by_len, key=lambda n: (abs(n - anchor), n)):
            if len(batch) >= self.max_batch_size:
                break
            if length > budget:
                continue
            queue = lane.by_len[length]
            while queue and len(batch) < self.max_batch_size and length <= budget:
                item = queue.popleft()
                if item.state is _State.QUEUED:
                    self._take(item, batch)
                    budget -= length
            if not queue:
                del lane.by_len[length]
        return budget

    def _holds_full_batch(self) -> bool:
        return (
            self._queued_tokens >= self.max_batch_tokens
            or self._queued_items >= self.max_batch_size
        )

    async def _loop(self) -> None:
        assert self._wakeup is not None and self._idle is not None
        try:
            while True:
                batch, self._upcoming = self._upcoming, None
                if batch is not None and batch.passable and self._lanes["interactive"].items:
                    # Queries queued since this bulk batch was prepared run first; it runs
                    # next, still prepared, and is not passed again.
                    batch.passable = False
                    batch, self._upcoming = self._new_batch(), batch
                if batch is None:
                    if self._queued_items == 0:
                        self._idle.set()
                        self._wakeup.clear()
                        await self._wakeup.wait()
                        continue
                    batch = self._new_batch()
                    if not batch.items:
                        continue
                if not batch.wanted():
                    self._finish(batch)
                    continue  # every request in it was cancelled while it waited, prepared
                self._running = batch
                await self._run(batch)
                self._running = None
                self._finish(batch)
        except asyncio.CancelledError:
            stopped = NotReadyError("the server is shutting down")
            for taken in (self._running, self._upcoming):
                if taken is not None:
                    taken.fail(stopped)
                    self._finish(taken)
            self._running = self._upcoming = None
            raise

    def _new_batch(self) -> _Batch:
        items = self.next_batch()
        passable = not self._lanes["interactive"].items and all(
            item.request.priority == "bulk" for item in items
        )
        return _Batch(items, tokens=sum(item.tokens for item in items), passable=passable)

    def _finish(self, batch: _Batch) -> None:
        """``batch`` ran, failed or was dropped: its tokens are no longer running work."""
        if batch.tokens:
            self._taken_tokens -= batch.tokens
            batch.tokens = 0
            self._publish()

    async def _run(self, batch: _Batch) -> None:
        """Execute ``batch`` on the forward thread, preparing the next one meanwhile."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        running = loop.run_in_executor(self._executor, self._execute, batch)
        await self._prepare_next(running)
        try:
            output = await running
        except Exception as exc:  # forwarded unchanged to every waiting caller
            logger.exception("forward pass over %d sequences failed", len(batch.items))
            batch.fail(exc)
            return
        self._deliver(batch.items, output, started)

    def _execute(self, batch: _Batch) -> BatchOutput:
        """On the forward thread: a batch not prepared ahead is prepared here, in line."""
        if not batch.ready:
            batch.prepared = self._runner.prepare([item.seq for item in batch.items])
            batch.ready = True
        return self._runner.execute(batch.prepared)

    async def _prepare_next(self, running: asyncio.Future[BatchOutput]) -> None:
        """While ``running`` executes, take the next batch as soon as the queue holds a full
        one and prepare it (into ``_upcoming``). If the queue never fills, nothing is taken:
        the next batch forms when ``running`` returns, with everything that arrived by then."""
        assert self._wakeup is not None and self._prepare_pool is not None
        if self._upcoming is not None:  # a passed batch is next, prepared already
            return
        while not running.done():
            if self._holds_full_batch():
                batch = self._upcoming = self._new_batch()
                try:
                    batch.prepared = await asyncio.get_running_loop().run_in_executor(
                        self._prepare_pool, self._runner.prepare, [i.seq for i in batch.items]
                    )
                except Exception as exc:  # forwarded unchanged to every waiting caller
                    logger.exception("preparing %d sequences failed", len(batch.items))
                    self._upcoming = None
                    batch.fail(exc)
                    self._finish(batch)
                    return
                batch.ready = True
                return
            self._wakeup.clear()
            woken = asyncio.ensure_future(self._wakeup.wait())
            try:
                await asyncio.wait((running, woken), return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()

    def _deliver(self, batch: list[_Item], output: BatchOutput, started: float) -> None:
        tokens = sum(item.tokens for item in batch)
        self.batches_run += 1
        if output.forward_s > 0:
            self._throughput.observe(tokens, output.forward_s + output.pool_s)
        if self._metrics is not None:
            self._metrics.batch_size.observe(len(batch))
            self._metrics.batch_tokens.observe(tokens)
            self._metrics.batch_seconds.observe(output.forward_s + output.pool_s)
        seen: set[int] = set()
        for row, item in enumerate(batch):
            request = item.request
            if request.future.done():
                continue
            request.pooled[item.index] = output.pooled[row]
            request.tokens[item.index] = output.tokens[row]
            request.queue_s = max(request.queue_s, started - request.enqueued_at)
            if id(request) not in seen:
                seen.add(id(request))
                request.forward_s += output.forward_s
                request.pool_s += output.pool_s
                request.batches += 1
                request.batch_size = max(request.batch_size, len(batch))
                request.batch_tokens = max(request.batch_tokens, tokens)
            request.remaining -= 1
            if request.remaining == 0:
                pooled = np.stack([p for p in request.pooled if p is not None])
                request.future.set_result(
                    ScheduledOutput(
                        pooled=pooled,
                        tokens=request.tokens,
                        queue_s=request.queue_s,
                        forward_s=request.forward_s,
                        pool_s=request.pool_s,
                        batches=request.batches,
                        batch_size=request.batch_size,
                        batch_tokens=request.batch_tokens,
                    )
                )

"""A rate-limited work queue with client-go's ``workqueue`` semantics, on asyncio.

Why this shape: every trigger (an EmbeddingService changed, a child changed, the periodic
resync, a retry) only *adds a key*; workers take keys and reconcile. The queue, not locks in
the reconciler, guarantees what a level-based controller needs:

* **dirty set**: a key waiting to be processed is not queued twice; a burst of events for one
  object costs one reconcile (the reconcile reads the object fresh anyway);
* **processing set**: a key being reconciled is never handed to a second worker; an ``add``
  meanwhile marks it dirty, and ``done`` queues it again, so the change is not lost and the
  two reconciles never overlap;
* **rate-limited requeue**: ``add_rate_limited`` brings a key back after a per-key exponential
  backoff (``retry_delay``: 5s, 10s, 20s, 40s, then 60s), ``forget`` resets it after a success,
  as client-go's ``ItemExponentialFailureRateLimiter`` does;
* **delayed adds** keep the earliest due time per key, as client-go's delaying queue does.

All methods run on the event loop's thread (kopf handlers are coroutines, workers hand the key
back on the loop), so the queue needs no locks; ``stats`` alone is called from the metrics
server's thread, and reads only counters and a copy. The clock is injectable: tests move time
by hand and use ``get_nowait`` instead of sleeping.

It counts what client-go's workqueue metrics count (``metrics.py``): ``depth`` is the keys
waiting (queued, or added again while being processed), ``adds`` the adds that made a key
wait, ``retries`` the rate-limited adds, and the processing time of the keys being worked on;
``on_wait``, when set, is told how long each key handed out had waited since it was added.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from embedding_operator.metrics import QueueStats

K = TypeVar("K", bound=Hashable)

BASE_RETRY_DELAY = 5.0
MAX_RETRY_DELAY = 60.0


def retry_delay(retry: int) -> float:
    """The backoff before retry number ``retry`` (0-based): 5, 10, 20, 40, 60, 60, ... seconds."""
    return float(min(MAX_RETRY_DELAY, BASE_RETRY_DELAY * 2 ** min(retry, 10)))


class RateLimitingQueue(Generic[K]):
    """Keys to process; one worker per key at a time; retries with per-key backoff."""

    def __init__(
        self,
        *,
        backoff: Callable[[int], float] = retry_delay,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backoff = backoff
        self._clock = clock
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        # Delayed adds: a heap of (due, seq, key); _due holds the live entry of each key.
        self._waiting: list[tuple[float, int, K]] = []
        self._due: dict[K, float] = {}
        self._seq = itertools.count()
        self._failures: dict[K, int] = {}
        self._wakeup = asyncio.Event()
        self._shut_down = False
        self._started: dict[K, float] = {}  # key being processed -> when it was handed out
        self._added: dict[K, float] = {}  # waiting key -> when it was added
        self.on_wait: Callable[[float], None] | None = None
        self.adds = 0
        self.retries = 0

    def __len__(self) -> int:
        """Keys ready to be handed out now."""
        return len(self._queue)

    def add(self, key: K) -> None:
        """Queue ``key`` unless it is already waiting; if it is being processed, after that."""
        if self._shut_down or key in self._dirty:
            return
        self._dirty.add(key)
        self._added[key] = self._clock()
        self.adds += 1
        if key in self._processing:
            return  # ``done`` queues it again
        self._queue.append(key)
        self._wakeup.set()

    def add_after(self, key: K, delay: float) -> None:
        """``add`` in ``delay`` seconds; an earlier pending add of the same key wins."""
        if self._shut_down:
            return
        if delay <= 0:
            self.add(key)
            return
        due = self._clock() + delay
        if key in self._due and self._due[key] <= due:
            return
        self._due[key] = due
        heapq.heappush(self._waiting, (due, next(self._seq), key))
        self._wakeup.set()  # a waiting ``get`` may have to wake earlier than planned

    def add_rate_limited(self, key: K) -> float:
        """``add`` after this key's next backoff delay; returns the delay."""
        delay = self._backoff(self._failures.get(key, 0))
        self._failures[key] = self._failures.get(key, 0) + 1
        self.retries += 1
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """Reset the key's backoff (it succeeded, or its object is gone)."""
        self._failures.pop(key, None)

    def num_requeues(self, key: K) -> int:
        return self._failures.get(key, 0)

    def get_nowait(self) -> K | None:
        """The next ready key, now marked as processing; None if none is ready."""
        self._promote_due()
        if self._shut_down or not self._queue:
            return None
        key = self._queue.popleft()
        now = self._clock()
        self._processing.add(key)
        self._started[key] = now
        self._dirty.discard(key)
        added = self._added.pop(key, now)
        if self.on_wait is not None:
            self.on_wait(now - added)
        return key

    async def get(self) -> K | None:
        """Wait for the next ready key (see ``get_nowait``); None once the queue is shut down."""
        while not self._shut_down:
            key = self.get_nowait()
            if key is not None:
                return key
            timeout = self._promote_due()
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)
        return None

    def done(self, key: K) -> None:
        """The worker is finished with ``key``; if it was added meanwhile, queue it again."""
        self._processing.discard(key)
        self._started.pop(key, None)
        if key in self._dirty and not self._shut_down:
            self._queue.append(key)
            self._wakeup.set()

    def shut_down(self) -> None:
        """Stop handing out keys; waiting ``get`` calls return None."""
        self._shut_down = True
        self._wakeup.set()

    def stats(self) -> QueueStats:
        """What the queue holds now, for the metrics (safe from another thread: the counters
        are read as they are, the processing times from a copy)."""
        now = self._clock()
        running = [now - since for since in self._started.copy().values()]
        return QueueStats(
            depth=len(self._dirty),
            adds=self.adds,
            retries=self.retries,
            longest_running_seconds=max(running, default=0.0),
            unfinished_seconds=sum(running),
        )

    def _promote_due(self) -> float | None:
        """Move delayed keys that are due into the queue; seconds until the next is due."""
        now = self._clock()
        while self._waiting:
            due, _, key = self._waiting[0]
            if self._due.get(key) != due:  # superseded by an earlier add_after
                heapq.heappop(self._waiting)
                continue
            if due > now:
                return due - now
            heapq.heappop(self._waiting)
            del self._due[key]
            self.add(key)
        return None

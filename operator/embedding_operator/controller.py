"""The one work path: keys from the queue, reconciles on worker threads, retries with backoff.

kopf only watches and enqueues (``handlers.py``); this module is the only caller of
``Reconciler.reconcile``. That is what keeps one object from being reconciled twice at once
(the queue's processing set) and gives every trigger the same retry policy, client-go's:

* an API error (server down, 5xx, timeout, a namespace being deleted) or a problem that may
  fix itself (a Secret not created yet) requeues the key with a per-key exponential backoff;
* a reconcile that found nothing to retry ``forget``s the key's backoff;
* anything else is a bug in the reconcile of that object: it is logged with its traceback,
  counted (``controller_runtime_reconcile_panics_total``, as controller-runtime recovers a
  panicking reconcile) and retried with the same backoff, while every other object goes on
  being reconciled. Ending the process instead (the old rule) let one object that tripped a
  bug crash-loop the operator for every EmbeddingService in the cluster.

A periodic resync re-adds every EmbeddingService the watch has seen, the backstop for anything
a watch missed. It is a loop here, not a ``kopf.timer``: kopf puts a finalizer on every object
with a timer, and a finalizer makes ``kubectl delete`` hang whenever the operator is down.

Reconciles run on a thread pool of ``workers`` threads (the API client is synchronous); the
queue itself is only touched on the event loop. Each reconcile is counted by result and timed
(``metrics.py``: ``success``, ``error`` for an API error, ``requeue`` for a problem retried with
backoff), and the queue's state is read at each scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from embedding_operator.kube import ApiError
from embedding_operator.metrics import CONTROLLER, OperatorMetrics
from embedding_operator.reconcile import Outcome
from embedding_operator.workqueue import RateLimitingQueue

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name) of an EmbeddingService


class Reconciles(Protocol):
    def reconcile(self, namespace: str, name: str) -> Outcome | None: ...

    def forget(self, namespace: str, name: str) -> None: ...


class Controller:
    """Feeds ``reconciler`` from a rate-limited queue; ``run`` it next to kopf."""

    def __init__(
        self,
        reconciler: Reconciles,
        *,
        resync_seconds: float,
        workers: int,
        queue: RateLimitingQueue[Key] | None = None,
        metrics: OperatorMetrics | None = None,
        name: str = CONTROLLER,
    ) -> None:
        self._reconciler = reconciler
        self._name = name
        self._resync_seconds = resync_seconds
        self._workers = max(1, workers)
        self.queue: RateLimitingQueue[Key] = queue if queue is not None else RateLimitingQueue()
        self._known: set[Key] = set()
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self.metrics.watch_queue(self.queue.stats, self._workers, name)
        self.queue.on_wait = lambda seconds: self.metrics.queued(seconds, name)

    def enqueue(self, namespace: str, name: str) -> None:
        """Reconcile this EmbeddingService soon (event-loop thread only)."""
        self.queue.add((namespace, name))

    def seen(self, namespace: str, name: str) -> None:
        """The watch reports this EmbeddingService exists: include it in resyncs."""
        self._known.add((namespace, name))

    def gone(self, namespace: str, name: str) -> None:
        """It was deleted: no more resyncs, backoff state, reconciler state or series."""
        self._known.discard((namespace, name))
        self.queue.forget((namespace, name))
        self._reconciler.forget(namespace, name)
        if self._name == CONTROLLER:  # the per-service series are EmbeddingServices'
            self.metrics.forget(namespace, name)

    async def run(self, stop: asyncio.Event) -> None:
        """Work the queue and resync every ``resync_seconds`` until ``stop``."""
        executor = ThreadPoolExecutor(self._workers, thread_name_prefix="reconcile")
        workers = [asyncio.create_task(self._work(executor)) for _ in range(self._workers)]
        ticker = asyncio.create_task(self._resync(stop))
        tasks = [ticker, *workers]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            self.queue.shut_down()
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            executor.shutdown(wait=False, cancel_futures=True)

    async def _resync(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self._resync_seconds)
            if not stop.is_set():
                for namespace, name in sorted(self._known):
                    self.enqueue(namespace, name)

    async def _work(self, executor: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        active = self.metrics.active_workers.labels(self._name)
        while (key := await self.queue.get()) is not None:
            namespace, name = key
            started = time.monotonic()
            active.inc()
            try:
                outcome = await loop.run_in_executor(
                    executor, self._reconciler.reconcile, namespace, name
                )
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                self.metrics.reconciled("error", time.monotonic() - started, self._name)
                if exc.namespace_terminating:
                    # Nothing can be created there any more and the object goes with its
                    # namespace: a retry would only fail again (and warn) on every child
                    # event of the teardown. The resync still comes back if deletion stalls.
                    self.queue.forget(key)
                    log.info(
                        "reconcile of %s/%s stopped: namespace %s is being deleted",
                        namespace,
                        name,
                        namespace,
                    )
                    continue
                delay = self.queue.add_rate_limited(key)
                log.warning(
                    "reconcile of %s/%s: %s; retrying in %.0fs", namespace, name, exc, delay
                )
            except Exception:
                seconds = time.monotonic() - started
                self.metrics.reconciled("error", seconds, self._name, panicked=True)
                delay = self.queue.add_rate_limited(key)
                log.exception(
                    "reconcile of %s/%s failed unexpectedly (a bug: please report it with this "
                    "traceback); retrying in %.0fs, other objects are not affected",
                    namespace,
                    name,
                    delay,
                )
            else:
                retry = outcome is not None and outcome.retry
                self.metrics.reconciled(
                    "requeue" if retry else "success", time.monotonic() - started, self._name
                )
                if outcome is not None and outcome.retry:
                    delay = self.queue.add_rate_limited(key)
                    log.info(
                        "%s/%s: %s; retrying in %.0fs",
                        namespace,
                        name,
                        outcome.problem.message if outcome.problem else "retry",
                        delay,
                    )
                else:
                    self.queue.forget(key)
                    if outcome is not None and outcome.requeue_after is not None:
                        self.queue.add_after(key, outcome.requeue_after)
            finally:
                active.dec()
                self.queue.done(key)

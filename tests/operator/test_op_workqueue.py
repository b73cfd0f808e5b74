"""The work queue's client-go semantics, and the controller's retry policy on top of it.

Time is a hand-moved clock and ``get_nowait``, or asyncio without sleeps: no test waits for
a delay to pass.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import pytest
from embedding_operator.controller import Controller
from embedding_operator.kube import ApiError
from embedding_operator.reconcile import Outcome
from embedding_operator.status import SECRET_NOT_FOUND, Problem
from embedding_operator.workqueue import RateLimitingQueue


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def queue(clock: Clock) -> RateLimitingQueue[str]:
    return RateLimitingQueue(clock=clock)


def test_a_waiting_key_is_queued_once(queue: RateLimitingQueue[str]) -> None:
    for key in ("a", "b", "a", "a", "b"):
        queue.add(key)
    assert len(queue) == 2
    assert [queue.get_nowait(), queue.get_nowait(), queue.get_nowait()] == ["a", "b", None]


def test_a_key_in_processing_is_not_handed_out_again_until_done(
    queue: RateLimitingQueue[str],
) -> None:
    queue.add("a")
    assert queue.get_nowait() == "a"
    queue.add("a")  # an event while "a" is being reconciled ...
    queue.add("a")
    assert queue.get_nowait() is None  # ... does not start a second, concurrent reconcile
    queue.done("a")
    assert queue.get_nowait() == "a"  # ... but runs once more afterwards
    queue.done("a")
    assert queue.get_nowait() is None


def test_done_without_a_new_add_does_not_requeue(queue: RateLimitingQueue[str]) -> None:
    queue.add("a")
    assert queue.get_nowait() == "a"
    queue.done("a")
    assert queue.get_nowait() is None and len(queue) == 0


def test_rate_limited_requeue_backs_off_per_key_and_forget_resets(
    queue: RateLimitingQueue[str], clock: Clock
) -> None:
    delays = []
    for _ in range(6):
        delays.append(queue.add_rate_limited("a"))
        assert queue.get_nowait() is None  # not before its delay
        clock.now += delays[-1] - 0.001
        assert queue.get_nowait() is None
        clock.now += 0.001
        assert queue.get_nowait() == "a"
        queue.done("a")
    assert delays == [5, 10, 20, 40, 60, 60]
    assert queue.num_requeues("a") == 6
    assert queue.add_rate_limited("b") == 5  # backoff is per key
    queue.forget("a")
    assert queue.num_requeues("a") == 0
    assert queue.add_rate_limited("a") == 5


def test_delayed_adds_keep_the_earliest_and_a_plain_add_is_immediate(
    queue: RateLimitingQueue[str], clock: Clock
) -> None:
    queue.add_after("a", 30)
    queue.add_after("a", 10)
    queue.add_after("a", 20)
    clock.now += 10
    assert queue.get_nowait() == "a"
    queue.done("a")
    clock.now += 30  # the later entries were superseded, not queued again
    assert queue.get_nowait() is None
    queue.add_after("b", 60)
    queue.add("b")  # a child event does not wait for the backoff
    assert queue.get_nowait() == "b"


def test_a_rate_limited_add_during_processing_waits_for_done(
    queue: RateLimitingQueue[str], clock: Clock
) -> None:
    queue.add("a")
    assert queue.get_nowait() == "a"
    queue.add_rate_limited("a")
    clock.now += 5
    assert queue.get_nowait() is None  # due, but "a" is still processing
    queue.done("a")
    assert queue.get_nowait() == "a"


def test_get_waits_for_an_add_and_shut_down_releases_waiters() -> None:
    async def main() -> None:
        queue: RateLimitingQueue[str] = RateLimitingQueue()
        waiter = asyncio.create_task(queue.get())
        await asyncio.sleep(0)  # let it block
        assert not waiter.done()
        queue.add("a")
        assert await asyncio.wait_for(waiter, timeout=5) == "a"
        waiters = [asyncio.create_task(queue.get()) for _ in range(2)]
        await asyncio.sleep(0)
        queue.shut_down()
        assert await asyncio.wait_for(asyncio.gather(*waiters), timeout=5) == [None, None]
        queue.add("b")
        assert queue.get_nowait() is None

    asyncio.run(main())


def test_get_wakes_when_a_delayed_key_falls_due() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue: RateLimitingQueue[str] = RateLimitingQueue(clock=loop.time)
        waiter = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        queue.add_after("a", 0.01)  # shortens the wait of a get already waiting
        assert await asyncio.wait_for(waiter, timeout=5) == "a"

    asyncio.run(main())


# --- the controller's policy ------------------------------------------------------------------

RETRY = Outcome(problem=Problem(SECRET_NOT_FOUND, "no Secret", retryable=True), status_written=True)
FINE = Outcome(problem=None, status_written=False)


class Scripted:
    """A reconciler that answers from a script and counts concurrent calls per key."""

    def __init__(self, script: list[Callable[[], Outcome | None]]) -> None:
        self.script = script
        self.calls = 0
        self.running = 0
        self.max_running = 0
        self.forgotten: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self._lock = threading.Lock()

    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        with self._lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            step = self.script[self.calls]
            self.calls += 1
        try:
            self.gate.wait(5)
            return step()
        finally:
            with self._lock:
                self.running -= 1

    def forget(self, namespace: str, name: str) -> None:
        self.forgotten.append((namespace, name))


def _api_error() -> Outcome:
    raise ApiError(503, "unavailable")


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Poll the event loop (not the wall clock) until ``condition``, with a deadline."""
    deadline = asyncio.get_running_loop().time() + 5
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def test_controller_retries_with_backoff_and_forgets_on_success(clock: Clock) -> None:
    reconciler = Scripted([lambda: RETRY, _api_error, lambda: FINE])
    reconciler.gate.set()
    queue: RateLimitingQueue[tuple[str, str]] = RateLimitingQueue(clock=clock)
    controller = Controller(reconciler, resync_seconds=3600, workers=2, queue=queue)
    key = ("ns", "emb")

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        controller.enqueue(*key)
        await _until(lambda: queue.num_requeues(key) == 1, "a retry after the Secret problem")
        controller.enqueue(*key)  # a child event: no need to wait for the backoff
        await _until(lambda: queue.num_requeues(key) == 2, "a retry after the API error")
        controller.enqueue(*key)
        await _until(lambda: reconciler.calls == 3 and queue.num_requeues(key) == 0, "forget")
        controller.gone(*key)
        stop.set()
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(main())
    assert reconciler.forgotten == [key]


def _namespace_terminating() -> Outcome:
    raise ApiError(403, "is being terminated", ("NamespaceTerminating",))


def test_controller_does_not_retry_into_a_namespace_being_deleted(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Creating children there can only fail again, and the object goes with its namespace:
    no backoff retry, no warning; a later event or the resync still reconciles it."""
    reconciler = Scripted([_namespace_terminating, lambda: FINE])
    reconciler.gate.set()
    queue: RateLimitingQueue[tuple[str, str]] = RateLimitingQueue(clock=clock)
    controller = Controller(reconciler, resync_seconds=3600, workers=1, queue=queue)
    key = ("ns", "emb")

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        controller.enqueue(*key)
        await _until(lambda: reconciler.calls == 1 and reconciler.running == 0, "the reconcile")
        await _until(lambda: queue.stats().depth == 0, "the key to leave the queue")
        assert queue.num_requeues(key) == 0, "no rate-limited retry"
        clock.now += 120  # past any backoff: nothing comes back by itself
        assert queue.get_nowait() is None, "the key came back after a backoff"
        assert reconciler.calls == 1
        controller.enqueue(*key)  # an event still reconciles it
        await _until(lambda: reconciler.calls == 2, "the reconcile after an event")
        stop.set()
        await asyncio.wait_for(task, timeout=5)

    with caplog.at_level(logging.INFO, logger="embedding_operator.controller"):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("namespace ns is being deleted" in r.getMessage() for r in caplog.records)
    errors = controller.metrics.registry.get_sample_value(
        "controller_runtime_reconcile_errors_total", {"controller": "embeddingservice"}
    )
    assert errors == 1, "it still counts as a failed reconcile"


def _bug() -> Outcome:
    raise KeyError("ConfigMap")  # what a missing REST path raised in every reconcile


def test_a_bug_in_one_objects_reconcile_is_retried_and_the_others_go_on(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected exception ends neither the worker nor the operator (it once crash-looped
    the operator for every service): it is logged with its traceback, counted as an error and
    a panic, and retried with backoff, while another object is reconciled meanwhile."""
    reconciler = Scripted([_bug, lambda: FINE, lambda: FINE])
    reconciler.gate.set()
    queue: RateLimitingQueue[tuple[str, str]] = RateLimitingQueue(clock=clock)
    controller = Controller(reconciler, resync_seconds=3600, workers=1, queue=queue)
    broken, other = ("ns", "broken"), ("ns", "other")

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        controller.enqueue(*broken)
        await _until(lambda: queue.num_requeues(broken) == 1, "a retry after the bug")
        controller.enqueue(*other)
        await _until(lambda: reconciler.calls == 2, "the other object's reconcile")
        assert not task.done(), "the controller stopped"
        controller.enqueue(*broken)
        await _until(lambda: reconciler.calls == 3 and queue.num_requeues(broken) == 0, "forget")
        stop.set()
        await asyncio.wait_for(task, timeout=5)

    with caplog.at_level(logging.ERROR, logger="embedding_operator.controller"):
        asyncio.run(main())
    (logged,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "ns/broken failed unexpectedly" in logged.getMessage()
    assert logged.exc_info is not None and logged.exc_info[0] is KeyError
    registry = controller.metrics.registry
    labels = {"controller": "embeddingservice"}
    assert registry.get_sample_value("controller_runtime_reconcile_panics_total", labels) == 1
    assert registry.get_sample_value("controller_runtime_reconcile_errors_total", labels) == 1


def test_controller_never_reconciles_one_object_twice_at_once() -> None:
    reconciler = Scripted([lambda: FINE] * 2)
    controller = Controller(reconciler, resync_seconds=3600, workers=4)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        controller.enqueue("ns", "emb")
        await _until(lambda: reconciler.running == 1, "the first reconcile")
        for _ in range(5):  # events while it runs, with idle workers around
            controller.enqueue("ns", "emb")
        await asyncio.sleep(0)
        reconciler.gate.set()
        await _until(lambda: reconciler.calls == 2 and reconciler.running == 0, "the rerun")
        stop.set()
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(main())
    assert reconciler.max_running == 1 and reconciler.calls == 2


def test_controller_comes_back_when_a_reconcile_asks_to(clock: Clock) -> None:
    """``Outcome.requeue_after`` (an EmbeddingJob's ttlSecondsAfterFinished): the key comes
    back after that delay, with no backoff counted, and not before."""
    later = Outcome(problem=None, status_written=False, requeue_after=30.0)
    reconciler = Scripted([lambda: later, lambda: FINE])
    reconciler.gate.set()
    queue: RateLimitingQueue[tuple[str, str]] = RateLimitingQueue(clock=clock)
    controller = Controller(reconciler, resync_seconds=3600, workers=1, queue=queue)
    key = ("ns", "job")

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        controller.enqueue(*key)
        await _until(lambda: reconciler.calls == 1 and reconciler.running == 0, "the reconcile")
        await _until(lambda: queue.stats().depth == 0, "the key to leave the queue")
        clock.now += 29
        assert queue.get_nowait() is None, "back before its time"
        clock.now += 2
        controller.queue._wakeup.set()  # the fake clock moved: let the waiting worker look
        await _until(lambda: reconciler.calls == 2, "the reconcile it asked for")
        assert queue.num_requeues(key) == 0
        stop.set()
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(main())

"""Continuous batching: budgets, fairness, isolation, admission control, cancellation.

The scheduler is driven with a stub runner whose forward pass can be held closed
(tests.support.scheduler), so the queue state at each step is exact instead of
timing-dependent; waits poll a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from embedding_server.engine import Engine
from embedding_server.errors import NotReadyError, QueueFullError, TooManyTokensError
from embedding_server.metrics import Metrics
from embedding_server.request.admission import BULK_QUEUE_SHARE, Admission
from embedding_server.request.scheduler import BULK_TURN, RATE_DECAY, Scheduler
from embedding_server.request.sequences import BatchOutput, SequenceInput

from tests.support.scheduler import GatedForward, seq, started, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def sched() -> tuple[Scheduler, GatedForward, Metrics]:  # type: ignore[misc]
    forward = GatedForward()
    metrics = Metrics()
    limits = {"max_batch_tokens": 100, "max_batch_size": 4, "max_queue_tokens": 500}
    async with started(forward, **limits, metrics=metrics) as scheduler:
        yield scheduler, forward, metrics


def gauge(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    return value


async def test_batches_respect_token_and_size_budgets_and_oldest_goes_first(
    sched: tuple[Scheduler, GatedForward, Metrics],
) -> None:
    scheduler, forward, _ = sched
    blocker = asyncio.create_task(scheduler.submit([seq(0, 10)]))
    await wait_for(forward.started.is_set)
    rng = random.Random(0)
    lengths = [rng.randint(5, 40) for _ in range(12)]
    tasks = [asyncio.create_task(scheduler.submit([seq(i + 1, n)])) for i, n in enumerate(lengths)]
    # They queue together; holding more than a full batch, the next one is prepared at once.
    await wait_for(lambda: len(forward.prepared) == 2)
    forward.gate.set()
    results = await asyncio.gather(*tasks)
    await blocker
    by_tag = {i + 1: n for i, n in enumerate(lengths)}
    served: list[int] = []
    for batch in forward.batches[1:]:
        assert len(batch) <= 4
        assert sum(by_tag[t] for t in batch) <= 100
        oldest_waiting = min(t for t in by_tag if t not in served)
        assert oldest_waiting in batch  # fairness: the oldest is never passed over
        served.extend(batch)
    assert sorted(served) == sorted(by_tag)
    for tag, result in zip(by_tag, results, strict=True):
        assert result.pooled.tolist() == [[float(tag), float(by_tag[tag])]]


async def test_fill_prefers_lengths_close_to_the_oldest(
    sched: tuple[Scheduler, GatedForward, Metrics],
) -> None:
    scheduler, forward, _ = sched
    blocker = asyncio.create_task(scheduler.submit([seq(0, 10)]))
    await wait_for(forward.started.is_set)
    lengths = {1: 20, 2: 5, 3: 21, 4: 50, 5: 19, 6: 6, 7: 22}
    tasks = [asyncio.create_task(scheduler.submit([seq(tag, n)])) for tag, n in lengths.items()]
    await wait_for(lambda: len(forward.prepared) == 2)  # a full batch's worth: prepared early
    forward.gate.set()
    await asyncio.gather(blocker, *tasks)
    assert sorted(forward.batches[1]) == [1, 3, 5, 7]  # 20 with 21, 19, 22: not 5, 6, 50


async def test_queue_gauges_track_depth_and_queue_full_gives_retry_after(
    sched: tuple[Scheduler, GatedForward, Metrics],
) -> None:
    scheduler, forward, metrics = sched
    running = asyncio.create_task(scheduler.submit([seq(0, 50)]))
    await wait_for(forward.started.is_set)
    assert gauge(metrics, "embedding_server_queue_tokens") == 0  # running is not waiting
    waiting = [
        asyncio.create_task(scheduler.submit([seq(1, 60), seq(2, 40)])),
        asyncio.create_task(scheduler.submit([seq(3, 100), seq(4, 90)])),
        asyncio.create_task(scheduler.submit([seq(6, 100), seq(9, 100)])),
    ]
    # 490 tokens hold more than a full batch, so the next one (60 + 40) is taken and prepared
    # while the first runs: like a running batch, it is no longer waiting in the queue.
    await wait_for(lambda: len(forward.prepared) == 2)
    assert forward.prepared[1] == [1, 2]
    assert scheduler.queued_tokens == 390
    assert gauge(metrics, "embedding_server_queue_requests") == 2
    assert gauge(metrics, "embedding_server_queue_tokens") == 390
    with pytest.raises(QueueFullError) as err:
        await scheduler.submit([seq(5, 120)])
    assert err.value.retry_after >= 1
    assert "390" in err.value.message
    assert gauge(metrics, "embedding_server_queue_tokens") == 390  # refused work not counted
    forward.gate.set()
    await asyncio.gather(running, *waiting)
    assert gauge(metrics, "embedding_server_queue_requests") == 0
    assert gauge(metrics, "embedding_server_queue_tokens") == 0


async def test_backlog_seconds_is_queued_and_running_tokens_over_the_measured_rate(
    sched: tuple[Scheduler, GatedForward, Metrics],
) -> None:
    scheduler, forward, metrics = sched
    backlog = "embedding_server_backlog_seconds"
    assert gauge(metrics, backlog) == 0  # no work is no backlog, rate or not
    # Before any batch has been measured, one batch budget (100 tokens) per second.
    forward.seconds = [0.1, 0.1]
    first = asyncio.create_task(scheduler.submit([seq(1, 80)]))
    await wait_for(forward.started.is_set)
    assert gauge(metrics, backlog) == pytest.approx(80 / 100)
    forward.gate.set()
    await first
    # Batch 1: 80 tokens in 0.1 s; batch 2: 20 tokens in 0.1 s. The rate is a decaying
    # average of tokens over a decaying average of seconds, by hand:
    await scheduler.submit([seq(2, 20)])
    keep = RATE_DECAY
    tokens = keep * ((1 - keep) * 80) + (1 - keep) * 20
    seconds = keep * ((1 - keep) * 0.1) + (1 - keep) * 0.1
    rate = tokens / seconds  # 68 tokens/s: not the mean of the two batches' 800 and 200
    assert scheduler.tokens_per_s == pytest.approx(rate)
    forward.gate.clear()
    forward.started.clear()
    # A batch of 50 tokens running, and 40 + 50 queued behind it (less than a full batch, so
    # nothing is prepared ahead of its turn).
    running = asyncio.create_task(scheduler.submit([seq(3, 50)]))
    await wait_for(forward.running.is_set)
    waiting = asyncio.create_task(scheduler.submit([seq(4, 40), seq(5, 50)]))
    await wait_for(lambda: scheduler.queued_tokens == 90)
    assert scheduler.running_tokens == 50
    assert gauge(metrics, backlog) == pytest.approx((90 + 50) / rate)
    forward.gate.set()
    await asyncio.gather(running, waiting)
    assert gauge(metrics, backlog) == 0


async def test_a_request_over_the_per_request_limit_is_never_admitted() -> None:
    forward = GatedForward()
    async with started(
        forward, max_batch_tokens=100, max_batch_size=4, max_queue_tokens=500,
        max_request_tokens=200,
    ) as scheduler:  # fmt: skip
        # Even into an empty queue: one request may not hold the whole budget.
        with pytest.raises(TooManyTokensError) as err:
            await scheduler.submit([seq(1, 100), seq(2, 101)])
        assert "201" in err.value.message and "200" in err.value.message
        with pytest.raises(TooManyTokensError):
            scheduler.reserve(201, 201)
        assert scheduler.queued_tokens == 0 and not forward.batches
        forward.gate.set()
        out = await scheduler.submit([seq(1, 100), seq(2, 100)])
        assert out.pooled.shape == (2, 2)


async def test_reservations_refuse_a_crowd_before_it_is_tokenized(
    sched: tuple[Scheduler, GatedForward, Metrics],
) -> None:
    scheduler, forward, _ = sched
    running = asyncio.create_task(scheduler.submit([seq(0, 50)]))
    await wait_for(forward.started.is_set)
    held = [scheduler.reserve(1, 200), scheduler.reserve(1, 200)]  # being tokenized
    with pytest.raises(QueueFullError):
        scheduler.reserve(1, 200)  # refused before paying for tokenization
    held[0].release()
    third = scheduler.reserve(1, 200)
    # Submitting turns a reservation into the exact count.
    waiting = asyncio.create_task(scheduler.submit([seq(1, 60)], held[1]))
    await wait_for(lambda: scheduler.queued_tokens == 60)
    third.release()
    third.release()  # idempotent
    forward.gate.set()
    await asyncio.gather(running, waiting)
    assert scheduler.reserve(1, 500).tokens == 500  # everything was given back


def test_a_reservation_holds_no_more_than_one_request_may() -> None:
    # A guess from the characters can overshoot the request's tokens; more than the
    # per-request limit is never needed (a request really that big is refused when queued).
    admission = Admission.of(500, 200)
    held = admission.reserve(1, 250, queued=0, tokens_per_s=0.0)
    assert held.tokens == 200
    assert admission.reserve(1, 10_000, queued=100, tokens_per_s=0.0).tokens == 200
    with pytest.raises(QueueFullError) as full:
        admission.reserve(1, 1, queued=100, tokens_per_s=50.0)
    assert "holds 500 of 500" in full.value.message
    assert full.value.retry_after == 10  # 500 tokens at 50 per second


async def test_cancelled_request_leaves_the_queue(
    sched: tuple[Scheduler, GatedForward, Metrics],
) -> None:
    scheduler, forward, metrics = sched
    running = asyncio.create_task(scheduler.submit([seq(0, 10)]))
    await wait_for(forward.started.is_set)
    doomed = asyncio.create_task(scheduler.submit([seq(7, 30), seq(7, 31)]))
    kept = asyncio.create_task(scheduler.submit([seq(8, 12)]))
    await wait_for(lambda: scheduler.queued_tokens == 73)
    doomed.cancel()
    await wait_for(lambda: scheduler.queued_tokens == 12)
    assert gauge(metrics, "embedding_server_queue_requests") == 1
    forward.gate.set()
    await asyncio.gather(running, kept)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert all(7 not in batch for batch in forward.batches)  # never computed


async def test_forward_error_reaches_the_callers_and_the_loop_survives(
    sched: tuple[Scheduler, GatedForward, Metrics],
) -> None:
    scheduler, forward, _ = sched
    forward.fail_next = RuntimeError("device lost")
    forward.gate.set()
    with pytest.raises(RuntimeError, match="device lost"):
        await scheduler.submit([seq(1, 5)])
    out = await scheduler.submit([seq(2, 5)])
    assert out.pooled.tolist() == [[2.0, 5.0]]


async def test_stop_drains_or_refuses() -> None:
    forward = GatedForward()
    executor = ThreadPoolExecutor(1)
    scheduler = Scheduler(forward, max_batch_tokens=100, max_batch_size=4, max_queue_tokens=300)
    await scheduler.start(executor)
    first = asyncio.create_task(scheduler.submit([seq(1, 10)]))
    await wait_for(forward.started.is_set)
    queued = asyncio.create_task(scheduler.submit([seq(2, 10)]))
    await wait_for(lambda: scheduler.queued_tokens == 10)
    stopping = asyncio.create_task(scheduler.stop(drain=True))
    await asyncio.sleep(0)
    with pytest.raises(NotReadyError):
        await scheduler.submit([seq(3, 5)])  # no admission while draining
    forward.gate.set()
    await stopping
    assert (await first).pooled.tolist() == [[1.0, 10.0]]
    assert (await queued).pooled.tolist() == [[2.0, 10.0]]  # drained, not dropped

    forward2 = GatedForward()
    scheduler2 = Scheduler(forward2, max_batch_tokens=100, max_batch_size=4, max_queue_tokens=300)
    await scheduler2.start(executor)
    running = asyncio.create_task(scheduler2.submit([seq(1, 10)]))
    await wait_for(forward2.started.is_set)
    dropped = asyncio.create_task(scheduler2.submit([seq(2, 10)]))
    await wait_for(lambda: scheduler2.queued_tokens == 10)
    await scheduler2.stop(drain=False)
    with pytest.raises(NotReadyError):
        await dropped
    with pytest.raises(NotReadyError):
        await running  # its result will never be delivered: told so, not left hanging
    forward2.gate.set()
    executor.shutdown(wait=True)


async def test_concurrent_mixed_requests_each_get_their_solo_vectors() -> None:
    """Isolation on the real pipeline (fake model): batching must not leak between requests."""
    engine = Engine.from_pretrained("fake?dim=32", max_batch_tokens=512, max_batch_size=16)
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    requests = [
        [" ".join(rng.choices(words, k=rng.randint(1, 40))) for _ in range(rng.randint(1, 5))]
        for _ in range(40)
    ]
    solo = [engine.embed(r) for r in requests]
    await engine.start()
    try:
        results = await asyncio.gather(*(engine.aembed(r) for r in requests))
    finally:
        await engine.stop()
    assert engine.scheduler.batches_run < len(requests)  # they really were batched
    for alone, together in zip(solo, results, strict=True):
        np.testing.assert_allclose(together.embeddings, alone, atol=1e-6)


async def test_engine_gauges_and_cancellation_with_a_slow_fake_model() -> None:
    """The knobs the HTTP tests use: a slow fake model fills the queue; cancelling a waiting
    request empties it again and its inputs are never computed."""
    metrics = Metrics()
    engine = Engine.from_pretrained("fake?dim=8&delay_ms=300", metrics=metrics)
    model = engine._runner.model
    await engine.start()
    try:
        calls_before = model.calls  # type: ignore[attr-defined]
        running = asyncio.create_task(engine.aembed(["first"]))
        await wait_for(lambda: model.calls > calls_before)  # type: ignore[attr-defined]
        waiting = asyncio.create_task(engine.aembed(["second", "third"]))
        await wait_for(lambda: gauge(metrics, "embedding_server_queue_requests") == 1)
        assert gauge(metrics, "embedding_server_queue_tokens") == 2 * 2 + 6 + 5
        waiting.cancel()
        await wait_for(lambda: gauge(metrics, "embedding_server_queue_requests") == 0)
        assert gauge(metrics, "embedding_server_queue_tokens") == 0
        assert (await running).embeddings.shape == (1, 8)
        assert model.calls == calls_before + 1  # type: ignore[attr-defined]
    finally:
        await engine.stop()


def test_offline_batches_are_length_sorted_and_within_budget() -> None:
    from embedding_server.request.jobs import plan_offline_batches

    rng = random.Random(2)
    lengths = [rng.randint(1, 50) for _ in range(200)]
    batches = plan_offline_batches(lengths, max_tokens=120, max_size=8)
    assert sorted(i for b in batches for i in b) == list(range(200))
    previous_max = 0
    for batch in batches:
        assert len(batch) <= 8 and sum(lengths[i] for i in batch) <= 120
        assert min(lengths[i] for i in batch) >= previous_max
        previous_max = max(lengths[i] for i in batch)


def test_ordinary_text_is_charged_what_it_likely_holds_not_its_bound() -> None:
    """32 texts of 400 characters hold about 100 tokens each, while their bound (a token per
    byte) is 400: charged the bound, three such requests in tokenization filled a queue they
    fit in four times over, and a closed-loop benchmark got 429s far below capacity."""
    admission = Admission.of(16_384, 16_384)
    held = [
        admission.reserve(32, 32 * 100, queued=0, tokens_per_s=0.0, bound=32 * 400)
        for _ in range(5)
    ]
    assert [h.tokens for h in held] == [3200] * 5
    assert admission.reserved == 16_000 and admission.tokenizing == 64_000
    with pytest.raises(QueueFullError):  # the queue, by what is likely, is full
        admission.reserve(32, 3200, queued=0, tokens_per_s=0.0, bound=12_800)
    for h in held:
        h.release()
    assert admission.reserved == 0 and admission.tokenizing == 0


def test_what_is_being_tokenized_is_bounded_however_its_texts_are_made() -> None:
    """250 emoji are charged 63 tokens by their characters, and a byte-level BPE makes up to
    one token per byte of them (1,000 here, the limit). The queue, by what is likely, has
    room for many; what the tokenizer may be asked to produce at once is capped by their
    bounds all the same: TOKENIZING_QUEUES queues' worth, then 429 with Retry-After."""
    from embedding_server.request.admission import TOKENIZING_QUEUES

    admission = Admission.of(1000, 1000)
    held = [
        admission.reserve(1, 63, queued=0, tokens_per_s=0.0, bound=1000)
        for _ in range(TOKENIZING_QUEUES)
    ]
    assert admission.reserved == 63 * TOKENIZING_QUEUES < 1000
    with pytest.raises(QueueFullError) as full:
        admission.reserve(1, 63, queued=48, tokens_per_s=100.0, bound=1000)
    assert "being tokenized" in full.value.message
    assert full.value.retry_after == 3  # 300 tokens queued or held, at 100 per second
    held[0].release()
    assert admission.reserve(1, 63, queued=0, tokens_per_s=0.0, bound=1000).bound == 1000


def test_bulk_text_that_tokenizes_hostilely_cannot_fill_the_budget_queries_need() -> None:
    """Bulk requests whose texts look cheap (63 likely tokens) but may tokenize to a token per
    byte (1,000) fill only BULK_QUEUE_SHARE of what may be tokenized at once; past that, bulk
    gets 429 and a query is still admitted, up to the whole budget."""
    from embedding_server.request.admission import TOKENIZING_QUEUES

    admission = Admission.of(1000, 1000)
    bulk_room = int(TOKENIZING_QUEUES * 1000 * BULK_QUEUE_SHARE) // 1000  # 3 at these sizes
    held = [
        admission.reserve(1, 63, queued=0, tokens_per_s=0.0, bound=1000, priority="bulk")
        for _ in range(bulk_room)
    ]
    with pytest.raises(QueueFullError) as refused:
        admission.reserve(1, 63, queued=0, tokens_per_s=100.0, bound=1000, priority="bulk")
    assert "bulk" in refused.value.message and "being tokenized" in refused.value.message
    assert refused.value.retry_after >= 1
    query = admission.reserve(1, 63, queued=0, tokens_per_s=0.0, bound=1000)
    assert query.bound == 1000 and admission.tokenizing == TOKENIZING_QUEUES * 1000
    with pytest.raises(QueueFullError):  # the whole budget binds queries too
        admission.reserve(1, 63, queued=0, tokens_per_s=0.0, bound=1000)
    for h in (*held, query):
        h.release()
    assert admission.tokenizing == 0


async def test_interactive_is_picked_ahead_of_older_bulk_and_bulk_fills_the_slack(
    sched: tuple[Scheduler, GatedForward, Metrics],
) -> None:
    scheduler, forward, _ = sched
    blocker = asyncio.create_task(scheduler.submit([seq(0, 10)]))
    await wait_for(forward.started.is_set)
    # Bulk arrives first (an indexing job), then two queries; 150 tokens, more than a batch.
    bulk = [
        asyncio.create_task(scheduler.submit([seq(tag, 30)], priority="bulk")) for tag in (1, 2, 3)
    ]
    queries = [asyncio.create_task(scheduler.submit([seq(tag, 30)])) for tag in (10, 11)]
    await wait_for(lambda: len(forward.prepared) == 2)
    forward.gate.set()
    await asyncio.gather(blocker, *bulk, *queries)
    # The queries ride the next batch although bulk was queued before them, and the room
    # they leave (40 of 100 tokens) goes to the oldest bulk item; the rest of bulk follows.
    assert sorted(forward.batches[1]) == [1, 10, 11]
    assert sorted(forward.batches[2]) == [2, 3]
    for tag, task in zip((1, 2, 3), bulk, strict=True):
        assert task.result().pooled.tolist() == [[float(tag), 30.0]]


async def test_bulk_is_slowed_never_starved_by_interactive_traffic() -> None:
    forward = GatedForward()
    async with started(
        forward, max_batch_tokens=100, max_batch_size=4, max_queue_tokens=5000
    ) as scheduler:
        blocker = asyncio.create_task(scheduler.submit([seq(0, 10)]))
        await wait_for(forward.started.is_set)
        # One bulk item, then more queries than BULK_TURN batches hold, each a full batch:
        # interactive traffic leaves no room for the bulk item in any of them.
        bulk = asyncio.create_task(scheduler.submit([seq(1, 50)], priority="bulk"))
        queries = [
            asyncio.create_task(scheduler.submit([seq(tag, 100)]))
            for tag in range(10, 10 + 2 * BULK_TURN)
        ]
        await wait_for(lambda: len(forward.prepared) == 2)
        forward.gate.set()
        await asyncio.gather(blocker, bulk, *queries)
        # BULK_TURN query batches pass it over; then the bulk item anchors a batch of its
        # own, ahead of the queries still waiting.
        ran = forward.batches[1:]
        assert ran[:BULK_TURN] == [[tag] for tag in range(10, 10 + BULK_TURN)]
        assert ran[BULK_TURN] == [1]
        assert bulk.result().pooled.tolist() == [[1.0, 50.0]]


async def test_bulk_is_refused_past_its_share_while_interactive_is_admitted() -> None:
    forward = GatedForward()
    async with started(
        forward, max_batch_tokens=40, max_batch_size=1, max_queue_tokens=400
    ) as scheduler:
        running = asyncio.create_task(scheduler.submit([seq(0, 40)]))
        await wait_for(forward.started.is_set)
        # Bulk fills the queue up to 280 tokens (one more item is prepared beside the
        # running one: it has left the queue).
        queued = [
            asyncio.create_task(scheduler.submit([seq(tag, 40)], priority="bulk"))
            for tag in range(1, 8)
        ]
        await wait_for(lambda: len(forward.prepared) == 2)
        queued.append(asyncio.create_task(scheduler.submit([seq(8, 40)], priority="bulk")))
        await wait_for(lambda: scheduler.queued_tokens == 280)
        assert scheduler.admission.bulk_queue_tokens == int(400 * BULK_QUEUE_SHARE) == 300
        with pytest.raises(QueueFullError) as refused:
            await scheduler.submit([seq(20, 40)], priority="bulk")  # 320 > 300
        assert "bulk" in refused.value.message and refused.value.retry_after >= 1
        with pytest.raises(QueueFullError):
            scheduler.reserve(1, 40, priority="bulk")  # refused before tokenizing too
        # At the same depth a query is admitted, into the quarter kept for interactive work.
        query = asyncio.create_task(scheduler.submit([seq(30, 40)]))
        await wait_for(lambda: scheduler.queued_tokens == 320)
        scheduler.reserve(1, 40).release()
        forward.gate.set()
        await asyncio.gather(running, query, *queued)
        # The query ran ahead of the bulk items queued before it (the prepared one aside).
        order = [batch[0] for batch in forward.batches]
        assert order.index(30) < order.index(3)


def test_an_empty_queue_admits_a_bulk_request_however_big() -> None:
    # Within the per-request limit a bulk request is delayed, never refused forever: an
    # empty queue takes it even when it alone is more than bulk's share.
    admission = Admission.of(400, 400)
    assert admission.reserve(1, 380, queued=0, tokens_per_s=0.0, priority="bulk").tokens == 380
    # Any request within the limit fits while the queue holds at most bulk's share less it.
    assert Admission.of(400, 100).refusing_above == 200


class SteppedForward(GatedForward):
    """A forward pass per permit: ``permits.release()`` lets the running pass (or the next
    one) finish, so a test can act between two passes."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = threading.Semaphore(0)

    def open(self) -> None:
        for _ in range(16):
            self.permits.release()

    def execute(self, seqs: list[SequenceInput]) -> BatchOutput:
        self.batches.append([s.ids[0] for s in seqs])
        self.started.set()
        assert self.permits.acquire(timeout=10), "test never let the pass finish"
        pooled = np.array([[float(s.ids[0]), float(len(s.ids))] for s in seqs], dtype=np.float32)
        return BatchOutput(pooled=pooled, tokens=[None] * len(seqs), forward_s=0.01, pool_s=0.0)


async def test_a_query_passes_a_bulk_batch_prepared_before_it_came_once() -> None:
    forward = SteppedForward()
    async with started(
        forward, max_batch_tokens=100, max_batch_size=4, max_queue_tokens=5000
    ) as scheduler:
        blocker = asyncio.create_task(scheduler.submit([seq(0, 10)]))
        await wait_for(forward.started.is_set)
        # An indexing job: more than a full batch, so the next batch (bulk only) is prepared
        # while the blocker runs, before any query is queued.
        bulk = [
            asyncio.create_task(scheduler.submit([seq(tag, 50)], priority="bulk"))
            for tag in range(1, 9)
        ]
        await wait_for(lambda: forward.prepared[1:] == [[1, 2]])
        first = asyncio.create_task(scheduler.submit([seq(10, 30)]))
        await wait_for(lambda: scheduler.queued_requests == 7)
        forward.permits.release()  # the blocker returns
        # The query runs next, with the bulk slack it leaves, not behind the prepared batch.
        await wait_for(lambda: len(forward.batches) == 2)
        assert forward.batches[1] == [10, 3]
        # A second query, queued while the first runs, does not pass the same batch again:
        # bulk loses one batch's time to queries, never more.
        second = asyncio.create_task(scheduler.submit([seq(11, 30)]))
        await wait_for(lambda: scheduler.queued_requests == 6)
        for _ in range(8):
            forward.permits.release()
        await asyncio.gather(blocker, first, second, *bulk)
        assert forward.batches[2] == [1, 2]
        assert forward.batches[3][0] == 11
        assert forward.prepared.count([1, 2]) == 1  # it ran as it was prepared, once
        assert first.result().pooled.tolist() == [[10.0, 30.0]]
        for tag, task in zip(range(1, 9), bulk, strict=True):
            assert task.result().pooled.tolist() == [[float(tag), 50.0]]


async def test_a_bulk_batch_taken_while_queries_waited_is_not_passed() -> None:
    # Bulk's turn (BULK_TURN) is a bulk-only batch formed while queries wait: passing it
    # would starve bulk, so it runs in its turn.
    forward = SteppedForward()
    async with started(
        forward, max_batch_tokens=100, max_batch_size=4, max_queue_tokens=5000
    ) as scheduler:
        blocker = asyncio.create_task(scheduler.submit([seq(0, 10)]))
        await wait_for(forward.started.is_set)
        bulk = asyncio.create_task(scheduler.submit([seq(1, 50)], priority="bulk"))
        queries = [
            asyncio.create_task(scheduler.submit([seq(tag, 100)]))
            for tag in range(10, 10 + 2 * BULK_TURN)
        ]
        for _ in range(4 * BULK_TURN):
            forward.permits.release()
        await asyncio.gather(blocker, bulk, *queries)
        ran = forward.batches[1:]
        assert ran[:BULK_TURN] == [[tag] for tag in range(10, 10 + BULK_TURN)]
        assert ran[BULK_TURN] == [1]


class PacedForward(GatedForward):
    """A gated runner whose forward pass reports 1 ms a token: 1,000 tokens/s measured."""

    def execute(self, seqs: list[SequenceInput]) -> BatchOutput:
        self.seconds = [sum(len(s.ids) for s in seqs) * 1e-3]
        return super().execute(seqs)


def paced(
    forward: PacedForward, bulk_batch_seconds: float | None
) -> contextlib.AbstractAsyncContextManager[Scheduler]:
    """A scheduler of 1,000-token batches over ``forward``, bulk capped as given."""
    return started(
        forward,
        max_batch_tokens=1000,
        max_batch_size=64,
        max_queue_tokens=10_000,
        bulk_batch_seconds=bulk_batch_seconds,
    )


async def run_bulk_behind(first_priority: str, bulk_batch_seconds: float | None) -> list[list[int]]:
    """One request of ``first_priority`` runs (10 tokens, measured at 1,000 tokens/s) while
    ten bulk texts of 30 tokens queue behind it; the batches that ran after it."""
    forward = PacedForward()
    async with paced(forward, bulk_batch_seconds) as scheduler:
        blocker = asyncio.create_task(scheduler.submit([seq(0, 10)], priority=first_priority))
        await wait_for(forward.started.is_set)
        bulk = [
            asyncio.create_task(scheduler.submit([seq(tag, 30)], priority="bulk"))
            for tag in range(1, 11)
        ]
        await wait_for(lambda: scheduler.queued_tokens == 300)
        forward.gate.set()
        await asyncio.gather(blocker, *bulk)
        for tag, task in enumerate(bulk, start=1):
            assert task.result().pooled.tolist() == [[float(tag), 30.0]]
        return forward.batches[1:]


async def test_beside_queries_a_bulk_batch_holds_what_runs_in_the_bulk_batch_time() -> None:
    # 100 ms at the measured 1,000 tokens/s: 100 tokens, three bulk texts of 30 a batch,
    # where without the cap all ten ride one batch (300 of the 1,000-token budget).
    capped = await run_bulk_behind("interactive", 0.1)
    assert [len(batch) for batch in capped] == [3, 3, 3, 1]
    assert sorted(tag for batch in capped for tag in batch) == list(range(1, 11))
    assert [len(batch) for batch in await run_bulk_behind("interactive", None)] == [10]


async def test_bulk_alone_runs_full_batches_whatever_the_cap() -> None:
    # No query came: nobody waits behind a bulk batch, so the cap does not bind.
    assert [len(batch) for batch in await run_bulk_behind("bulk", 0.1)] == [10]


async def test_a_query_shares_its_batch_with_bulk_only_within_the_bulk_batch_time() -> None:
    forward = PacedForward()
    async with paced(forward, 0.1) as scheduler:
        blocker = asyncio.create_task(scheduler.submit([seq(0, 10)]))
        await wait_for(forward.started.is_set)
        bulk = [
            asyncio.create_task(scheduler.submit([seq(tag, 30)], priority="bulk"))
            for tag in range(1, 5)
        ]
        query = asyncio.create_task(scheduler.submit([seq(50, 40)]))
        await wait_for(lambda: scheduler.queued_tokens == 160)
        forward.gate.set()
        await asyncio.gather(blocker, query, *bulk)
        # The query anchors the next batch; bulk fills only the 60 tokens the 100 ms leave.
        assert sorted(forward.batches[1]) == [1, 2, 50]
        assert query.result().pooled.tolist() == [[50.0, 40.0]]


def test_the_bulk_batch_time_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bulk_batch_seconds"):
        Scheduler(
            GatedForward(),
            max_batch_tokens=10,
            max_batch_size=1,
            max_queue_tokens=10,
            bulk_batch_seconds=0.0,
        )

"""Batch N+1 is packed while batch N runs, so the device does not idle between batches.

The scheduler is driven with a stub runner whose forward pass is held closed (a
threading.Event), so what was prepared while a batch ran is exact, not timing-dependent; waits
poll a condition with a deadline. The real runner is checked on the real model (each request
gets the vectors the offline engine gives it) and, with CUDA's streams, events, pinned memory
and copies faked, for asking the device for what overlapping needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.device.attention import Backend, plan_attention
from embedding_server.device.runner import ModelRunner, PreparedBatch
from embedding_server.engine import Engine
from embedding_server.errors import EngineFailedError, NotReadyError
from embedding_server.request.scheduler import Scheduler
from embedding_server.request.sequences import SequenceInput

from tests.support.scheduler import GatedForward, seq, started, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def sched() -> tuple[Scheduler, GatedForward]:  # type: ignore[misc]
    forward = GatedForward()
    limits = {"max_batch_tokens": 100, "max_batch_size": 4, "max_queue_tokens": 500}
    async with started(forward, **limits) as scheduler:
        yield scheduler, forward


async def test_the_next_full_batch_is_prepared_while_the_current_one_runs(
    sched: tuple[Scheduler, GatedForward],
) -> None:
    scheduler, forward = sched
    first = asyncio.create_task(scheduler.submit([seq(1, 30)]))
    await wait_for(forward.running.is_set)
    # More than a full batch (100 tokens) arrives while batch 1 is held on the device.
    waiting = [asyncio.create_task(scheduler.submit([seq(t, 40)])) for t in (2, 3, 4)]
    await wait_for(lambda: len(forward.prepared) == 2)
    assert forward.running.is_set() and forward.batches == [[1]]  # still running batch 1
    assert forward.prepared[1] == [2, 3]  # the oldest first, within the token budget
    assert scheduler.queued_tokens == 40  # prepared work has left the queue
    forward.gate.set()
    results = await asyncio.gather(first, *waiting)
    assert forward.batches == [[1], [2, 3], [4]]
    assert forward.prepared == forward.batches  # each prepared exactly once
    for tag, result in zip((1, 2, 3, 4), results, strict=True):
        assert result.pooled.tolist() == [[float(tag), 30.0 if tag == 1 else 40.0]]


async def test_arrivals_during_a_batch_all_join_the_next_when_it_is_not_full(
    sched: tuple[Scheduler, GatedForward],
) -> None:
    """Continuous batching stays intact: preparing early would freeze the next batch with
    whatever had arrived first, so below a full batch nothing is taken until the device
    is free, and everything that arrived meanwhile gets in."""
    scheduler, forward = sched
    first = asyncio.create_task(scheduler.submit([seq(1, 30)]))
    await wait_for(forward.running.is_set)
    waiting = []
    for tag in (2, 3, 4):  # one by one, each seen by the scheduler before the next
        waiting.append(asyncio.create_task(scheduler.submit([seq(tag, 10)])))
        await wait_for(lambda: scheduler.queued_requests == len(waiting))
        await asyncio.sleep(0.02)  # room for a scheduler that would take them early to do so
    assert forward.prepared == [[1]]
    forward.gate.set()
    await asyncio.gather(first, *waiting)
    assert forward.batches == [[1], [2, 3, 4]]


async def test_a_prepared_batch_whose_requests_all_left_never_runs(
    sched: tuple[Scheduler, GatedForward],
) -> None:
    scheduler, forward = sched
    first = asyncio.create_task(scheduler.submit([seq(1, 30)]))
    await wait_for(forward.running.is_set)
    doomed = asyncio.create_task(scheduler.submit([seq(7, 50), seq(7, 50)]))
    await wait_for(lambda: len(forward.prepared) == 2)
    doomed.cancel()
    kept = asyncio.create_task(scheduler.submit([seq(8, 10)]))
    await wait_for(lambda: scheduler.queued_requests == 1)
    forward.gate.set()
    await asyncio.gather(first, kept)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert forward.prepared[1] == [7, 7]
    assert forward.batches == [[1], [8]]  # prepared, then dropped without a forward pass
    assert scheduler.queued_tokens == 0


async def test_a_cancelled_enqueue_future_withdraws_its_request(
    sched: tuple[Scheduler, GatedForward],
) -> None:
    """``enqueue`` (the engine process's way, answering from a callback): cancelling the
    future takes its request out of the queue, and the others are answered as usual."""
    scheduler, forward = sched
    first = scheduler.enqueue([seq(1, 30)])
    await wait_for(forward.running.is_set)
    doomed = scheduler.enqueue([seq(7, 10), seq(7, 20)])
    kept = scheduler.enqueue([seq(8, 10)])
    assert scheduler.queued_requests == 2
    doomed.cancel()
    await wait_for(lambda: scheduler.queued_requests == 1)
    assert scheduler.queued_tokens == 10
    forward.gate.set()
    assert (await kept).pooled.tolist() == [[8.0, 10.0]]
    await first
    assert forward.batches == [[1], [8]]


async def test_a_prepared_batch_still_runs_for_the_requests_that_stayed(
    sched: tuple[Scheduler, GatedForward],
) -> None:
    scheduler, forward = sched
    first = asyncio.create_task(scheduler.submit([seq(1, 30)]))
    await wait_for(forward.running.is_set)
    doomed = asyncio.create_task(scheduler.submit([seq(7, 50)]))
    kept = asyncio.create_task(scheduler.submit([seq(8, 50)]))
    await wait_for(lambda: len(forward.prepared) == 2)
    doomed.cancel()
    forward.gate.set()
    await first
    assert (await kept).pooled.tolist() == [[8.0, 50.0]]
    assert forward.batches == [[1], [7, 8]]


async def test_a_failed_preparation_fails_its_requests_and_the_loop_goes_on(
    sched: tuple[Scheduler, GatedForward],
) -> None:
    scheduler, forward = sched
    first = asyncio.create_task(scheduler.submit([seq(1, 30)]))
    await wait_for(forward.running.is_set)
    forward.fail_prepare = RuntimeError("pinned memory exhausted")
    failed = asyncio.create_task(scheduler.submit([seq(2, 60), seq(3, 40)]))
    await wait_for(failed.done)
    with pytest.raises(RuntimeError, match="pinned memory"):
        await failed
    forward.gate.set()
    assert (await first).pooled.tolist() == [[1.0, 30.0]]
    assert (await scheduler.submit([seq(4, 5)])).pooled.tolist() == [[4.0, 5.0]]
    assert forward.batches == [[1], [4]]


async def test_stopping_fails_the_prepared_batch_instead_of_leaving_it_waiting() -> None:
    forward = GatedForward()
    executor = ThreadPoolExecutor(1)
    scheduler = Scheduler(forward, max_batch_tokens=100, max_batch_size=4, max_queue_tokens=500)
    await scheduler.start(executor)
    try:
        first = asyncio.create_task(scheduler.submit([seq(1, 30)]))
        await wait_for(forward.running.is_set)
        prepared = asyncio.create_task(scheduler.submit([seq(2, 100)]))
        await wait_for(lambda: len(forward.prepared) == 2)
        await scheduler.stop(drain=False)
        for task in (first, prepared):
            with pytest.raises(NotReadyError, match="shutting down"):
                await task
    finally:
        forward.gate.set()
        executor.shutdown(wait=True)
    assert forward.batches == [[1]]


async def test_a_fatal_device_error_fails_the_running_and_the_prepared_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine.from_pretrained("fake?dim=8", max_batch_size=2)
    runner = engine._runner
    await engine.start()  # warm-up on the working model
    gate, entered = threading.Event(), threading.Event()
    forwards: list[int] = []
    prepared_on: list[str] = []

    def poisoned(batch: Any) -> torch.Tensor:
        forwards.append(len(batch.seqlens))
        entered.set()
        assert gate.wait(10)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    prepare = runner.prepare

    def recording_prepare(seqs: Any) -> PreparedBatch:
        prepared_on.append(threading.current_thread().name)
        return prepare(seqs)

    monkeypatch.setattr(runner.model, "forward", poisoned)
    monkeypatch.setattr(runner, "prepare", recording_prepare)
    try:
        running = asyncio.create_task(engine.aembed(["first"]))
        await wait_for(entered.is_set)
        waiting = asyncio.create_task(engine.aembed(["second", "third"]))  # a full batch
        await wait_for(lambda: any(name.startswith("prepare") for name in prepared_on))
        gate.set()
        for task in (running, waiting):
            with pytest.raises(EngineFailedError, match="illegal memory access"):
                await task
        assert forwards == [1]  # the prepared batch never reached the poisoned device
        assert not engine.ready
    finally:
        gate.set()
        await engine.stop(drain=False)


async def test_concurrent_requests_on_the_real_model_get_the_offline_vectors(
    minilm_dir: Path,
) -> None:
    """Isolation on the real model with pipelining at work: a small batch budget keeps the
    queue fuller than a batch, so batches are prepared on the prepare thread meanwhile."""
    engine = Engine.from_pretrained(
        str(minilm_dir), dtype="float32", max_batch_tokens=256, max_batch_size=8
    )
    runner = engine._runner
    rng = random.Random(3)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "in", "rain"]
    requests = [
        [" ".join(rng.choices(words, k=rng.randint(1, 30))) for _ in range(rng.randint(1, 4))]
        for _ in range(30)
    ]
    offline = [engine.embed(r) for r in requests]
    prepared_on: list[str] = []
    prepare = runner.prepare

    def recording_prepare(seqs: Any) -> PreparedBatch:
        prepared_on.append(threading.current_thread().name)
        return prepare(seqs)

    runner.prepare = recording_prepare  # type: ignore[method-assign]
    await engine.start()
    try:
        results = await asyncio.gather(*(engine.aembed(r) for r in requests))
    finally:
        await engine.stop()
    assert any(name.startswith("prepare") for name in prepared_on)  # overlapped for real
    for alone, together in zip(offline, results, strict=True):
        np.testing.assert_allclose(together.embeddings, alone, atol=2e-5)


class _FakeCuda:
    """CUDA's host-side API as the runner uses it (streams, events, pinned memory, copies to
    the device), recording what it is asked for; tensors stay on the CPU, so a whole pass
    runs here as it would on a GPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.pinned: list[torch.Tensor] = []
        self.current: Any = None
        fake = self

        class Stream:
            def __init__(self, device: torch.device) -> None:
                self.device = device

            def wait_event(self, event: Any) -> None:
                fake.log.append(("wait", self, event))

        class Event:
            def record(self, stream: Any) -> None:
                fake.log.append(("record", stream, self))

        @contextlib.contextmanager
        def stream(s: Any) -> Iterator[None]:
            previous, fake.current = fake.current, s
            try:
                yield
            finally:
                fake.current = previous

        self.default = self.current = Stream(torch.device("cuda"))
        real_empty, real_to = torch.empty, torch.Tensor.to

        def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            tensor = real_empty(*args, **kwargs)
            if pin_memory:
                fake.pinned.append(tensor)
            return tensor

        def pin(tensor: torch.Tensor) -> torch.Tensor:
            fake.pinned.append(tensor.clone())
            return fake.pinned[-1]

        def is_pinned(tensor: torch.Tensor) -> bool:
            return any(tensor is p for p in fake.pinned)

        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            target = args[0] if args else kwargs.get("device")
            if isinstance(target, torch.device) and target.type == "cuda":
                blocking = not kwargs.get("non_blocking", False)
                fake.log.append(("copy", is_pinned(tensor), blocking, fake.current))
                return tensor
            return real_to(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.default)
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
        monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(
            torch.Tensor, "record_stream", lambda t, s: fake.log.append(("used on", s, t))
        )


def test_on_cuda_the_runner_copies_from_pinned_memory_on_its_own_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine.from_pretrained("fake?dim=8")
    cpu_runner = engine._runner
    seqs = [
        SequenceInput([5, 6, 7]),
        SequenceInput([9]),
        SequenceInput([4] * 5),
        SequenceInput([3] * 4),
    ]
    expected = cpu_runner.run(seqs).pooled
    cuda = _FakeCuda(monkeypatch)
    model = cpu_runner.model
    forward = model.forward

    def logged_forward(batch: Any) -> torch.Tensor:
        cuda.log.append(("forward",))
        return forward(batch)

    monkeypatch.setattr(model, "forward", logged_forward)
    runner = ModelRunner(
        model,
        device=torch.device("cuda"),
        pooling=cpu_runner.pooling,
        head=cpu_runner.head,
        attention=Backend.SDPA_PADDED,
    )
    copy_stream = runner._copy_stream
    assert copy_stream is not None and copy_stream is not cuda.default

    prepared = runner.prepare(seqs)
    copies = [entry for entry in cuda.log if entry[0] == "copy"]
    # ids and positions in one copy, cu_seqlens in another: from pinned memory, not blocking
    # the host, on the copy stream. The attention plan is built here too, off the forward.
    assert copies == [("copy", True, False, copy_stream)] * 2
    assert prepared.batch._plan is not None
    assert cuda.log[-1] == ("record", copy_stream, prepared.copied)  # after the copies
    assert ("forward",) not in cuda.log

    cuda.log.clear()
    out = runner.execute(prepared)
    # The forward stream waits on the device for the copies, marks the copy stream's tensors
    # as used by it (so their memory is not reused under it), then the model runs.
    assert cuda.log[0] == ("wait", cuda.default, prepared.copied)
    marked = cuda.log[1 : cuda.log.index(("forward",))]
    assert all(entry[:2] == ("used on", cuda.default) for entry in marked)
    batch_tensors = prepared.batch.tensors()
    assert len(batch_tensors) > 3  # ids, positions, cu_seqlens and the plan's index tensors
    assert len(marked) == len(batch_tensors)
    assert all(entry[2] is tensor for entry, tensor in zip(marked, batch_tensors, strict=True))
    np.testing.assert_allclose(out.pooled, expected, atol=1e-6)


def test_on_cuda_attention_index_tensors_are_copied_from_pinned_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = _FakeCuda(monkeypatch)
    plan = plan_attention([1, 3, 4, 5], torch.device("cuda"), Backend.SDPA_PADDED)
    copies = [entry for entry in cuda.log if entry[0] == "copy"]
    assert plan.buckets and len(copies) == 4  # gather, slots, their composition, key mask
    assert all(entry == ("copy", True, False, cuda.default) for entry in copies)


def test_on_the_cpu_the_copy_is_the_packed_tensor_itself() -> None:
    engine = Engine.from_pretrained("fake?dim=8")
    runner = engine._runner
    prepared = runner.prepare([SequenceInput([5, 6, 7]), SequenceInput([9, 8])])
    batch = prepared.batch
    assert runner._copy_stream is None and prepared.copied is None
    assert not batch.input_ids.is_pinned()
    # ids and positions are rows of one host tensor: no copy was made for the "device".
    assert batch.input_ids.untyped_storage().data_ptr() == (
        batch.position_ids.untyped_storage().data_ptr()
    )
    assert batch.input_ids.tolist() == [9, 8, 5, 6, 7]  # length order
    assert batch.position_ids.tolist() == [0, 1, 0, 1, 2]
    assert batch.cu_seqlens.tolist() == [0, 2, 5] and batch.cu_seqlens.dtype == torch.int32

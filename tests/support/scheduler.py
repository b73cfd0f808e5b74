"""Helpers for the scheduler tests: a runner whose forward pass is held closed, a scheduler
started over it for the length of a block, and an async poll with a deadline.

The runner blocks in ``execute`` until its ``gate`` (a threading.Event) is set, so the
queue state and what was prepared meanwhile are exact at each step instead of
timing-dependent.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from embedding_server.request.scheduler import Scheduler
from embedding_server.request.sequences import BatchOutput, SequenceInput


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``condition`` on the event loop until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.005)


class GatedForward:
    """A runner that records batches and whose forward pass blocks until ``gate`` is set.

    ``prepared`` lists the batches prepared (first token id of each sequence) in order, and
    ``batches`` those that ran; ``running`` is set while a forward pass waits at the gate.
    ``fail_next`` / ``fail_prepare`` make the next forward pass / preparation raise;
    ``seconds`` are the forward-pass times the next batches report (else 10 ms each)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.prepared: list[list[int]] = []
        self.batches: list[list[int]] = []  # first token id of each sequence, as executed
        self.started = threading.Event()
        self.running = threading.Event()
        self.fail_next: Exception | None = None
        self.fail_prepare: Exception | None = None
        self.seconds: list[float] = []

    def open(self) -> None:
        """Let every forward pass through, from now on (a test's teardown)."""
        self.gate.set()

    def prepare(self, seqs: Sequence[SequenceInput]) -> list[SequenceInput]:
        if self.fail_prepare is not None:
            exc, self.fail_prepare = self.fail_prepare, None
            raise exc
        self.prepared.append([s.ids[0] for s in seqs])
        return list(seqs)

    def execute(self, seqs: list[SequenceInput]) -> BatchOutput:
        self.batches.append([s.ids[0] for s in seqs])
        self.started.set()
        self.running.set()
        try:
            assert self.gate.wait(10), "test never opened the gate"
        finally:
            self.running.clear()
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        pooled = np.array([[float(s.ids[0]), float(len(s.ids))] for s in seqs], dtype=np.float32)
        forward_s = self.seconds.pop(0) if self.seconds else 0.01
        return BatchOutput(
            pooled=pooled, tokens=[None] * len(seqs), forward_s=forward_s, pool_s=0.0
        )


def seq(tag: int, length: int) -> SequenceInput:
    return SequenceInput([tag] * length)


@contextlib.asynccontextmanager
async def started(forward: GatedForward, **options: Any) -> AsyncIterator[Scheduler]:
    """A ``Scheduler(forward, **options)`` running on a thread of its own for the block; on
    leaving, ``forward`` is opened, the scheduler stopped without draining and the thread
    shut down."""
    executor = ThreadPoolExecutor(1)
    scheduler = Scheduler(forward, **options)
    await scheduler.start(executor)
    try:
        yield scheduler
    finally:
        forward.open()
        await scheduler.stop(drain=False)
        executor.shutdown(wait=True)

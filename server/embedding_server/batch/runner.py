"""Send a batch file's requests and write their answers, a bounded window at a time.

The input is read as a stream, twice: :func:`scan_input` first (before any model loads)
counts the requests still to answer and refuses a file whose ``custom_id`` repeats, then
:func:`run_batch` reads it again, skips what the output already answers, and keeps at most
``max_in_flight`` requests in flight, from a read-ahead of a few windows that is sorted by
body size so that requests of one size are batched together. Memory is bounded by that
window whatever the file's size; only the keys of answered lines are kept.

A request answered 429 or 503 waits its ``Retry-After`` and is sent again, for up to
``retry_for`` seconds, then its last answer is written as it is; a server that cannot be
reached is retried the same way. Every other answer, 4xx and 5xx included, is written as the
server gave it: a bad line never stops the batch.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx2

from embedding_server.batch.lines import (
    BatchFileError,
    BatchRequest,
    Key,
    LineRefusal,
    answer_line,
    custom_id_of,
    failure_line,
    line_key,
    parse_line,
    refusal_line,
)
from embedding_server.batch.output import BatchOutput
from embedding_server.batch.retries import (
    FIRST_BACKOFF_S,
    PRIORITY_HEADERS,
    RETRY_STATUSES,
    next_backoff,
    retry_after,
)
from embedding_server.batch.storage import Location
from embedding_server.fingerprint import HEADER

logger = logging.getLogger(__name__)

READ_AHEAD_WINDOWS = 4
"""The read-ahead, sorted by size, in windows of ``max_in_flight`` requests."""

PROGRESS_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class InputScan:
    """What :func:`scan_input` found: request lines in all, and those still to answer."""

    total: int
    remaining: int


@dataclass
class BatchCounts:
    """A run's tally of request lines (blank lines are not requests)."""

    total: int
    already: int = 0
    """Answered by an earlier run, found in the output file."""
    succeeded: int = 0
    failed: int = 0
    """Answered with an error: a line that is not a request, or a 4xx/5xx answer."""

    @property
    def answered(self) -> int:
        return self.already + self.succeeded + self.failed


def input_lines(path: Path | Location) -> Iterator[tuple[int, bytes]]:
    """The file's lines that are not blank, with their 1-based numbers; a
    :class:`~embedding_server.batch.storage.Location` (``s3://``) is streamed."""
    if isinstance(path, Location):
        for number, (_, raw) in enumerate(path.lines(), start=1):
            if raw.strip():
                yield number, raw
        return
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                yield number, raw


def scan_input(path: Path | Location, answered: Collection[Key]) -> InputScan:
    """Count the request lines of ``path`` and those ``answered`` does not hold yet.
    :class:`BatchFileError` when a ``custom_id`` repeats: its answers could not be told
    apart (OpenAI's Batch API refuses such a file too)."""
    first_line: dict[str, int] = {}
    total = remaining = 0
    for number, raw in input_lines(path):
        total += 1
        custom_id = custom_id_of(raw)
        if custom_id is not None:
            if custom_id in first_line:
                raise BatchFileError(
                    f"{path}: custom_id {custom_id!r} is on line {first_line[custom_id]} and "
                    f"line {number}; each request needs its own"
                )
            first_line[custom_id] = number
        if line_key(custom_id, number) not in answered:
            remaining += 1
    return InputScan(total, remaining)


class Progress:
    """Lines answered out of the total: a bar with rate and ETA on a terminal (tqdm), else a
    log line every :data:`PROGRESS_LOG_INTERVAL_S` seconds."""

    def __init__(self, total: int, initial: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = initial
        self._initial = initial
        self._started = time.monotonic()
        self._logged = self._started
        stream = stream if stream is not None else sys.stderr
        self._bar = None
        if stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, unit="line", file=stream, dynamic_ncols=True
            )

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
            return
        now = time.monotonic()
        if now - self._logged >= PROGRESS_LOG_INTERVAL_S:
            self._logged = now
            logger.info("run-batch: %s", self.describe(now))

    def describe(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.monotonic()) - self._started
        rate = (self.done - self._initial) / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = _duration(left / rate) if rate > 0 else "unknown"
        share = 100.0 * self.done / self.total if self.total else 100.0
        return (
            f"{self.done} of {self.total} lines answered ({share:.1f}%), "
            f"{rate:.1f} lines/s, ETA {eta}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def run_batch(
    input_path: Path | Location,
    output: BatchOutput,
    client: httpx2.AsyncClient,
    *,
    urls: Collection[str],
    answered: Collection[Key],
    total: int,
    max_in_flight: int = 64,
    retry_for: float = 600.0,
    progress: Progress | None = None,
) -> BatchCounts:
    """Answer every request line of ``input_path`` that ``answered`` does not hold, through
    ``client`` (paths relative to its base URL), appending the answers to ``output`` (open)."""
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    counts = BatchCounts(total=total)
    progress = progress or Progress(total, 0)
    queue: asyncio.Queue[BatchRequest | None] = asyncio.Queue(maxsize=max_in_flight)

    def record(line: bytes, ok: bool) -> None:
        output.write(line)
        if ok:
            counts.succeeded += 1
        else:
            counts.failed += 1
        progress.advance()

    async def produce() -> None:
        window: list[BatchRequest] = []
        read_ahead = max_in_flight * READ_AHEAD_WINDOWS
        for number, raw in input_lines(input_path):
            item = parse_line(number, raw, urls)
            if item.key in answered:
                counts.already += 1
                continue
            if isinstance(item, LineRefusal):
                record(refusal_line(item), ok=False)
                continue
            window.append(item)
            if len(window) >= read_ahead:
                await _enqueue(queue, window)
                window = []
        await _enqueue(queue, window)
        for _ in range(max_in_flight):
            await queue.put(None)

    async def consume() -> None:
        while (request := await queue.get()) is not None:
            line, ok = await _send(client, request, retry_for)
            record(line, ok)

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(produce(), name="run-batch-reader")
            for index in range(max_in_flight):
                group.create_task(consume(), name=f"run-batch-sender-{index}")
    finally:
        progress.close()
    return counts


async def _enqueue(queue: asyncio.Queue[BatchRequest | None], window: list[BatchRequest]) -> None:
    """Largest bodies first: requests of one size go out together and batch together."""
    window.sort(key=lambda request: len(request.body), reverse=True)
    for request in window:
        await queue.put(request)


async def _send(
    client: httpx2.AsyncClient, request: BatchRequest, retry_for: float
) -> tuple[bytes, bool]:
    """The output line for ``request`` and whether it succeeded, after waiting out 429 and 503
    (their ``Retry-After``) and unreachable servers for up to ``retry_for`` seconds."""
    deadline = time.monotonic() + retry_for
    backoff = FIRST_BACKOFF_S
    headers = {
        "Content-Type": "application/json",
        "X-Request-ID": request.request_id,
        **PRIORITY_HEADERS,
    }
    while True:
        try:
            response = await client.post(request.url, content=request.body, headers=headers)
        except httpx2.TransportError as error:
            wait = backoff
            backoff = next_backoff(backoff)
            if time.monotonic() + wait > deadline:
                message = f"no answer from the server after {retry_for:.0f} s: {error!r}"
                return failure_line(request, "server_unreachable", message), False
            await asyncio.sleep(wait)
            continue
        status = response.status_code
        if status in RETRY_STATUSES:
            wait = retry_after(response) or backoff
            backoff = next_backoff(backoff)
            if time.monotonic() + wait <= deadline:
                await asyncio.sleep(wait)
                continue
        content_type = response.headers.get("content-type", "")
        line = answer_line(
            request,
            status,
            response.headers.get("x-request-id", request.request_id),
            response.content,
            json_body="json" in content_type,
            fingerprint=response.headers.get(HEADER),
        )
        return line, status < 400


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"

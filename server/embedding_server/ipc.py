"""Front-end processes and the engine process (``--api-workers N``): the wire between them.

With N front-ends, each runs the engine's request-level code (inputs, prompts, truncation,
tokenization, the per-request head, results) and hands the engine process only what its
scheduler takes: token ids. The engine process owns the model and the one
:class:`~.scheduler.Scheduler`, so a batch holds sequences of every front-end.

Transport: asyncio's own unix-socket streams, one connection per front-end to a socket the
engine process listens on. A message is a 4-byte length, then its frames (a 2-byte count,
each frame's 4-byte length, the frames): a small orjson header frame plus raw buffers.
Nothing per request is pickled, and nothing is a Python list on the wire. Both ends write
from their event loop and read in the loop's own callback, so a message costs no thread
hand-off (ZeroMQ, used before, woke an I/O thread of its own for every message, on both
sides), and the messages of one turn of the loop leave in one write.

* front-end -> engine ``run``: header ``{"op": "run", "rid", "want_tokens"}``, then int32
  frames: sequence lengths, all token ids concatenated, the prompt tokens to skip per
  sequence, and the segment ids concatenated (an empty frame for single texts);
* engine -> front-end: header ``{"rid", "dim", "token_rows", "queue_s", "forward_s",
  "pool_s", "held", "rate"}``, then the pooled float32 ``[n, dim]`` matrix and, when asked,
  every sequence's per-token float32 states concatenated; or ``{"rid", "error": {...},
  "held", "rate"}`` naming one of the server's error types (429 with its ``retry_after``,
  413, 503) so the front-end raises it. ``held`` and ``rate`` are the engine's queue as the
  answer left: the tokens it holds and its drain rate;
* engine -> front-end ``{"op": "queue", "held", "rate"}``: the queue has drained below what
  this front-end last heard (see below);
* front-end -> engine ``cancel``: ``{"op": "cancel", "rid"}`` when the request's caller went
  away; the engine withdraws its queued sequences (:meth:`Scheduler.submit`'s cancellation);
* ``hello``: a front-end's first message; the engine answers once its model is warmed up and
  every front-end has said hello (so they turn ready together) with a pickled
  :class:`Handoff` (configuration, info, tokenizer): the only pickle, once per front-end.

**Admission before tokenizing.** A front-end admits each request as the one-process server
does (:class:`~.scheduler.Admission`), before paying for its tokenization: over the
per-request limit is a 413, and a request that would not fit the engine's queue, as the
front-end last heard of it, is a 429 with the engine's ``Retry-After``; so is one that would
not fit beside the requests this front-end is still tokenizing (a burst). The view never
overstates the queue for longer than a message takes: every answer carries it, and when the
queue drains below what a front-end last heard, the engine tells it (``queue``, at most one
per turn of its loop, and none while its answers keep the front-end up to date). A queue
with room for any request (held at most ``max_queue_tokens - max_request_tokens``) is told
as empty, so short of overload no such news is ever sent. A view that understates the
queue only lets a request through to the engine, which admits the exact tokens again as
they arrive.

A front-end notices the engine process going away when its connection closes: it fails every
waiting request with 503 and reports it (:meth:`EngineClient.on_failure`), so its readiness
drops and it exits. The engine withdraws the queued work of a front-end whose connection
closes (one that crashed) as it does a cancelled request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import pickle
import socket
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import orjson

from .configuration import EngineConfig, EngineInfo
from .errors import (
    EmbeddingServerError,
    EngineFailedError,
    InputTooLongError,
    InvalidRequestError,
    NotReadyError,
    OutputTooLargeError,
    PayloadTooLargeError,
    QueueFullError,
    TooManyTokensError,
)
from .jobs import Job, ThreadedRunner
from .pooling import FloatArray
from .scheduler import Admission, Reservation, ScheduledOutput, Scheduler
from .sequences import SequenceInput
from .tokenization import TextTokenizer

logger = logging.getLogger(__name__)

_ERRORS: dict[str, type[EmbeddingServerError]] = {
    cls.__name__: cls
    for cls in (
        EmbeddingServerError,
        EngineFailedError,
        InputTooLongError,
        InvalidRequestError,
        NotReadyError,
        OutputTooLargeError,
        PayloadTooLargeError,
        QueueFullError,
        TooManyTokensError,
    )
}
"""The errors the engine process may answer a request with, by name."""

_HELLO = orjson.dumps({"op": "hello"})


@dataclass(frozen=True)
class Handoff:
    """What a front-end needs from the engine process, sent once when it connects."""

    config: EngineConfig
    info: EngineInfo
    tokenizer: TextTokenizer

    @classmethod
    def of(cls, config: EngineConfig, info: EngineInfo, tokenizer: TextTokenizer) -> Handoff:
        """A front-end's copy, with no weights: Dense layers, classifier heads and a SPLADE
        head run in the engine process's batches, and what runs per request (truncation,
        normalization, a classifier's activation) needs none. So no tensor crosses, and a
        front-end never loads torch."""
        classifier = config.classifier
        if classifier is not None:
            classifier = replace(classifier, head=None)
        head = replace(config.head, dense=())
        return cls(replace(config, head=head, classifier=classifier, sparse=None), info, tokenizer)


def _int32(values: Any, count: int) -> bytes:
    return np.fromiter(values, np.int32, count).tobytes()


def encode_sequences(seqs: Sequence[SequenceInput]) -> list[bytes]:
    """A request's sequences as four int32 buffers (see the module docstring)."""
    n = len(seqs)
    lengths = [len(s.ids) for s in seqs]
    total = sum(lengths)
    ids = _int32(itertools.chain.from_iterable(s.ids for s in seqs), total)
    skips = _int32((s.skip for s in seqs), n)
    types = b""
    if any(s.type_ids is not None for s in seqs):
        segments = (s.type_ids if s.type_ids is not None else [0] * len(s.ids) for s in seqs)
        types = _int32(itertools.chain.from_iterable(segments), total)
    return [_int32(lengths, n), ids, skips, types]


def decode_sequences(
    frames: Sequence[memoryview | bytes], want_tokens: bool
) -> list[SequenceInput]:
    """:func:`encode_sequences` read back. Each buffer becomes one Python list, sliced per
    sequence: numpy's ``split`` costs more than the copy for the one or few sequences of a
    typical request (one 100-token sequence: 8.9 against 3.2 us; 32 of them: 70 against 46)."""
    lengths = np.frombuffer(frames[0], np.int32).tolist()
    ids = np.frombuffer(frames[1], np.int32).tolist()
    skips = np.frombuffer(frames[2], np.int32).tolist()
    types = np.frombuffer(frames[3], np.int32).tolist() if len(frames[3]) else None
    seqs: list[SequenceInput] = []
    start = 0
    for length, skip in zip(lengths, skips, strict=True):
        end = start + length
        segments = None if types is None else types[start:end]
        seqs.append(SequenceInput(ids[start:end], skip, want_tokens, segments))
        start = end
    return seqs


def encode_output(
    rid: int, out: ScheduledOutput, queue: tuple[int, float] = (0, 0.0)
) -> list[bytes | memoryview]:
    """A request's results; ``queue`` is the engine's (held tokens, drain rate)."""
    pooled = np.ascontiguousarray(out.pooled, dtype=np.float32)
    header: dict[str, Any] = {
        "rid": rid,
        "held": queue[0],
        "rate": queue[1],
        "dim": int(pooled.shape[1]) if pooled.ndim == 2 else 0,
        "queue_s": out.queue_s,
        "forward_s": out.forward_s,
        "pool_s": out.pool_s,
        "token_rows": None,
    }
    frames: list[bytes | memoryview] = [b"", pooled.data.cast("B")]
    matrices = [t for t in out.tokens if t is not None]
    if matrices and len(matrices) == len(out.tokens):
        header["token_rows"] = [int(t.shape[0]) for t in matrices]
        header["token_dim"] = int(matrices[0].shape[1])
        stacked = np.ascontiguousarray(np.concatenate(matrices), dtype=np.float32)
        frames.append(stacked.data.cast("B"))
    frames[0] = orjson.dumps(header)
    return frames


def decode_output(header: dict[str, Any], frames: Sequence[memoryview | bytes]) -> ScheduledOutput:
    pooled = np.frombuffer(frames[0], np.float32).reshape(-1, header["dim"])
    rows: list[int] | None = header["token_rows"]
    tokens: list[FloatArray | None] = [None] * len(pooled)
    if rows is not None:
        flat = np.frombuffer(frames[1], np.float32).reshape(-1, header["token_dim"])
        tokens = list(np.split(flat, np.cumsum(rows)[:-1]))
    return ScheduledOutput(pooled, tokens, header["queue_s"], header["forward_s"], header["pool_s"])


def encode_error(rid: int, error: BaseException, queue: tuple[int, float] = (0, 0.0)) -> bytes:
    """A request's error by type (see :func:`decode_error`); ``queue`` as for
    :func:`encode_output`."""
    if isinstance(error, EmbeddingServerError) and type(error).__name__ in _ERRORS:
        body = {
            "type": type(error).__name__,
            "message": error.message,
            "param": error.param,
            "retry_after": getattr(error, "retry_after", None),
        }
    else:  # a bug or a failed forward pass: its details stay in the engine's log
        body = {"type": "EmbeddingServerError", "message": "the engine failed the request"}
    return orjson.dumps({"rid": rid, "error": body, "held": queue[0], "rate": queue[1]})


def decode_error(body: dict[str, Any]) -> EmbeddingServerError:
    cls = _ERRORS.get(body["type"], EmbeddingServerError)
    if issubclass(cls, QueueFullError):
        return cls(body["message"], retry_after=body.get("retry_after") or 1.0)
    return cls(body["message"], param=body.get("param"))


Frames = list[memoryview]
"""A received message: its frames, as views of one immutable buffer."""

_LENGTH = struct.Struct("<I")


def pack(frames: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """One message as buffers to write: its length and frame table, then the frames."""
    sizes = [memoryview(frame).nbytes for frame in frames]
    table = struct.pack(f"<H{len(sizes)}I", len(sizes), *sizes)
    return [_LENGTH.pack(len(table) + sum(sizes)), table, *frames]


def unpack(message: memoryview) -> Frames:
    """The frames of one message (without its length prefix)."""
    (count,) = struct.unpack_from("<H", message)
    offset = 2 + 4 * count
    frames: Frames = []
    for size in struct.unpack_from(f"<{count}I", message, 2):
        frames.append(message[offset : offset + size])
        offset += size
    return frames


class Wire(asyncio.Protocol):
    """One end of a connection between a front-end and the engine process: messages out
    (:meth:`send`), and each message in handed to ``on_message`` as it completes, in the
    event loop's read callback. ``on_lost`` is called once when the connection closes."""

    def __init__(self, on_message: Callable[[Frames], None], on_lost: Callable[[], None]) -> None:
        self._on_message, self._on_lost = on_message, on_lost
        self._transport: asyncio.Transport | None = None
        self._partial = bytearray()
        self._needed = 0  # the size of the message that _partial starts, once known
        self._outgoing: list[bytes | memoryview] = []
        self._drained: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if self._partial:
            self._partial += data
            if len(self._partial) < self._needed:
                return  # a large message arriving in pieces: one copy at the end
            data = bytes(self._partial)
            self._partial.clear()
        view = memoryview(data)
        offset, end = 0, len(data)
        while end - offset >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(view, offset)
            stop = offset + _LENGTH.size + size
            if stop > end:
                break
            self._on_message(unpack(view[offset + _LENGTH.size : stop]))
            offset = stop
        if offset < end:
            self._partial += view[offset:]
            rest = end - offset
            self._needed = (
                _LENGTH.size + _LENGTH.unpack_from(view, offset)[0]
                if rest >= _LENGTH.size
                else _LENGTH.size
            )

    def send(self, frames: Sequence[bytes | memoryview]) -> None:
        """Queue one message. The messages sent in one turn of the event loop are written
        together at its end: under load one write, and one wake-up of the peer, carries
        many (a batch's results, or every request a front-end read at once)."""
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing += pack(frames)

    def _flush(self) -> None:
        outgoing, self._outgoing = self._outgoing, []
        if self._transport is not None and not self._transport.is_closing():
            self._transport.writelines(outgoing)

    async def drained(self) -> None:
        """Wait while the peer is behind on reading (the transport's buffer is full)."""
        if self._drained is not None:
            await asyncio.shield(self._drained)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.resume_writing()
        self._on_lost()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class EngineClient:
    """A front-end's connection to the engine process: any number of requests in flight on
    it, matched to their callers by request id."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._wire = Wire(self._received, self._lost)
        self._pending: dict[int, asyncio.Future[ScheduledOutput]] = {}
        self._rids = itertools.count()
        self._handoff: asyncio.Future[Handoff] | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._admission = Admission.of(1)
        self._queue = (0, 0.0)
        self.failure: str | None = None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` once if the engine process goes away."""
        self._callbacks.append(callback)

    async def connect(self) -> Handoff:
        """Say hello and wait for the engine's handoff, sent once its model is warmed up
        (no deadline of our own: a big model takes its time; if the engine process dies,
        this fails)."""
        loop = asyncio.get_running_loop()
        self._handoff = loop.create_future()
        await loop.create_unix_connection(lambda: self._wire, self._path)
        self._wire.send([_HELLO])
        handoff = await self._handoff
        config = handoff.config
        self._admission = Admission.of(config.max_queue_tokens, config.max_request_tokens)
        return handoff

    @property
    def engine_queue(self) -> tuple[int, float]:
        """The engine's queue as this front-end last heard of it: tokens held, drain rate."""
        return self._queue

    def reserve(self, floor: int, estimate: int) -> Reservation:
        """Admit a request before it is tokenized (see the module docstring): ``floor``
        tokens at least, about ``estimate``, reserved here until :meth:`submit` sends it."""
        held, rate = self._queue
        return self._admission.reserve(floor, estimate, held, rate)

    async def submit(
        self,
        seqs: Sequence[SequenceInput],
        want_tokens: bool,
        reservation: Reservation | None = None,
    ) -> ScheduledOutput:
        """Queue ``seqs`` in the engine's scheduler and wait for their results; cancelling
        the caller withdraws them there. Their ``reservation`` ends as they are sent: from
        then on the engine's queue holds them."""
        if reservation is not None:
            reservation.release()
        if self.failure is not None:
            raise EngineFailedError("the engine process has stopped")
        rid = next(self._rids)
        future: asyncio.Future[ScheduledOutput] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        header = orjson.dumps({"op": "run", "rid": rid, "want_tokens": want_tokens})
        try:
            self._wire.send([header, *encode_sequences(seqs)])
            await self._wire.drained()
            return await future
        except ConnectionError:  # closing, before its loss was reported
            raise EngineFailedError("the engine process has stopped") from None
        except asyncio.CancelledError:
            # Cancelling this task cancelled ``future`` too; an answer may be on its way.
            if self.failure is None and (future.cancelled() or not future.done()):
                with contextlib.suppress(ConnectionError):
                    self._wire.send([orjson.dumps({"op": "cancel", "rid": rid})])
            raise
        finally:
            self._pending.pop(rid, None)

    def _received(self, frames: Frames) -> None:
        try:
            header = orjson.loads(frames[0])
            self._queue = (header.get("held", 0), header.get("rate", 0.0))
            op = header.get("op")
            if op == "queue":
                return
            if op == "hello":
                if self._handoff is not None and not self._handoff.done():
                    self._handoff.set_result(pickle.loads(frames[1]))
                return
            future = self._pending.get(header["rid"])
            if future is None or future.done():
                return  # its caller gave up
            if "error" in header:
                future.set_exception(decode_error(header["error"]))
            else:
                future.set_result(decode_output(header, frames[1:]))
        except Exception as error:
            # A bug here would leave every caller waiting: fail them instead.
            logger.error("engine connection failed", exc_info=error)
            self._fail(f"the engine connection failed: {error!r}")
            self._wire.close()

    def _lost(self) -> None:
        """The connection closing means the engine process is gone."""
        self._fail("the engine process has stopped")

    def _fail(self, message: str, *, report: bool = True) -> None:
        if self.failure is not None:
            return
        self.failure = message
        error = EngineFailedError(message)
        if self._handoff is not None and not self._handoff.done():
            self._handoff.set_exception(error)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for callback in self._callbacks if report else ():
            callback(message)

    def close(self) -> None:
        """Hang up (what this front-end has queued leaves the engine); a caller still
        waiting gets a 503."""
        self._fail("the front-end closed its engine connection", report=False)
        self._wire.close()


class RemoteRunner(ThreadedRunner):
    """A front-end's :class:`~.jobs.JobRunner`: tokenizes here, in the front-end's thread
    pool, and runs the sequences in the engine process's scheduler.

    Like :class:`~.jobs.ScheduledRunner` it admits a request before tokenizing it, here on
    the front-end's view of the engine's queue (:meth:`EngineClient.reserve`), with no round
    trip; the engine admits the exact tokens when they arrive."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        client: EngineClient,
        *,
        loop: asyncio.AbstractEventLoop,
        tokenize_pool: ThreadPoolExecutor,
    ) -> None:
        super().__init__(tokenizer, loop=loop, tokenize_pool=tokenize_pool)
        self._client = client

    def _reserve(self, floor: int, estimate: int) -> Reservation:
        return self._client.reserve(floor, estimate)

    async def _submit(
        self, job: Job, sequences: list[SequenceInput], reservation: Reservation
    ) -> ScheduledOutput:
        return await self._client.submit(sequences, job.want_tokens, reservation)


def _answer(wire: Wire, frames: Sequence[bytes | memoryview]) -> None:
    with contextlib.suppress(ConnectionError):  # the front-end is gone: nobody to tell
        wire.send(frames)


class EngineService:
    """The engine process's end: a unix socket every front-end connects to, served from the
    one scheduler. Listening from construction, before the model loads, so front-ends can
    connect and wait; :meth:`serve` answers them once the engine is warmed up."""

    def __init__(self, path: str) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(socket.SOMAXCONN)
        self._running: dict[tuple[Wire, int], asyncio.Future[ScheduledOutput]] = {}
        self._scheduler: Scheduler | None = None
        self._told: dict[Wire, int] = {}
        """The queue's held tokens each front-end last heard of, where that could refuse a
        request (see :meth:`_queue`)."""
        self._update_due = False

    async def serve(self, scheduler: Scheduler, handoff: Handoff, front_ends: int) -> None:
        """Answer front-ends until cancelled. The handoff goes to all ``front_ends`` at once,
        when the last has said hello: they share one port, so a front-end that served while
        another still started would let that one answer some clients "not ready"."""
        loop = asyncio.get_running_loop()
        self._scheduler = scheduler
        scheduler.watch(functools.partial(self._queue_changed, loop))
        payload = pickle.dumps(handoff, protocol=pickle.HIGHEST_PROTOCOL)
        failed: asyncio.Future[None] = loop.create_future()
        waiting: list[Wire] = []

        def connection() -> Wire:
            wire: Wire

            def received(frames: Frames) -> None:
                try:
                    self._received(scheduler, wire, frames, hello)
                except Exception as error:  # noqa: BLE001 - a bug: serving ends, the server too
                    if not failed.done():
                        failed.set_exception(error)

            def hello() -> None:
                nonlocal front_ends
                waiting.append(wire)
                if len(waiting) >= front_ends:
                    for each in waiting:
                        each.send([_HELLO, payload])
                    waiting.clear()
                    front_ends = 0

            wire = Wire(received, lambda: self._withdraw(wire))
            return wire

        server = await loop.create_unix_server(connection, sock=self._listener)
        try:
            await failed
        finally:
            scheduler.watch(None)
            server.close()
            for running in list(self._running.values()):
                running.cancel()

    def _received(
        self, scheduler: Scheduler, wire: Wire, frames: Frames, hello: Callable[[], None]
    ) -> None:
        header = orjson.loads(frames[0])
        op = header["op"]
        if op == "run":
            rid = int(header["rid"])
            seqs = decode_sequences(frames[1:], header["want_tokens"])
            try:
                running = scheduler.enqueue(seqs)
            except EmbeddingServerError as error:  # 413, 429, not running: answered at once
                _answer(wire, [encode_error(rid, error, self._queue(wire))])
                return
            # Answered from the future's callback: no task, no coroutine per request.
            self._running[(wire, rid)] = running
            running.add_done_callback(functools.partial(self._done, wire, rid))
        elif op == "cancel":
            cancelled = self._running.get((wire, int(header["rid"])))
            if cancelled is not None:
                cancelled.cancel()  # the scheduler withdraws what is still queued
        elif op == "hello":
            hello()

    def _withdraw(self, wire: Wire) -> None:
        """A front-end gone (it crashed): its queued work leaves the scheduler."""
        self._told.pop(wire, None)
        for (owner, _), running in list(self._running.items()):
            if owner is wire:
                running.cancel()

    def _done(self, wire: Wire, rid: int, running: asyncio.Future[ScheduledOutput]) -> None:
        """Send a request's results, or its error, to its front-end."""
        self._running.pop((wire, rid), None)
        if running.cancelled():  # the front-end cancelled it, or is gone: nobody to tell
            return
        error = running.exception()
        if error is None:
            _answer(wire, encode_output(rid, running.result(), self._queue(wire)))
            return
        if not isinstance(error, EmbeddingServerError):  # the front-end raises it there
            logger.error("request failed in the engine: %s", error, exc_info=error)
        _answer(wire, [encode_error(rid, error, self._queue(wire))])

    def _view(self) -> int:
        """The queue's held tokens as front-ends are told them. A queue with room for any
        request within the per-request limit is told as empty: such a view cannot refuse a
        request, so it needs no news, and under all but overload the engine sends none."""
        assert self._scheduler is not None
        held = self._scheduler.held_tokens
        return held if held > self._scheduler.admission.refusing_above else 0

    def _queue(self, wire: Wire, held: int | None = None) -> tuple[int, float]:
        """The queue as ``wire``'s front-end is told it (tokens held, drain rate; ``held``
        when already read), noted so that it hears when the queue drains below that."""
        assert self._scheduler is not None
        if held is None:
            held = self._view()
        if held:
            self._told[wire] = held
        else:
            self._told.pop(wire, None)
        return held, self._scheduler.tokens_per_s

    def _queue_changed(self, loop: asyncio.AbstractEventLoop) -> None:
        """The scheduler's queue changed: see, once this turn of the loop is done, whether a
        front-end heard of more than it now holds."""
        if self._told and not self._update_due:
            self._update_due = True
            loop.call_soon(self._update_views)

    def _update_views(self) -> None:
        self._update_due = False
        view = self._view()
        for wire, heard in list(self._told.items()):
            if heard > view:
                held, rate = self._queue(wire, view)
                _answer(wire, [orjson.dumps({"op": "queue", "held": held, "rate": rate})])

    def close(self) -> None:
        self._listener.close()

"""Front-end processes and the engine process (``--api-workers N``): the wire between them.

With N front-ends, each runs the engine's request-level code (inputs, prompts, truncation,
tokenization, the per-request head, results) and hands the engine process only what its
scheduler takes: token ids. The engine process owns the model and the one
:class:`~.scheduler.Scheduler`, so a batch holds sequences of every front-end.

Transport: ZeroMQ (pyzmq), one ``ROUTER`` socket in the engine process and one ``DEALER`` per
front-end, over an ``ipc://`` socket. A message is a small orjson header frame plus raw
buffers: nothing per request is pickled, and nothing is a Python list on the wire.

* front-end -> engine ``run``: header ``{"op": "run", "rid", "want_tokens"}``, then int32
  frames: sequence lengths, all token ids concatenated, the prompt tokens to skip per
  sequence, and the segment ids concatenated (an empty frame for single texts);
* engine -> front-end: header ``{"rid", "dim", "token_rows", "queue_s", "forward_s",
  "pool_s"}``, then the pooled float32 ``[n, dim]`` matrix and, when asked, every sequence's
  per-token float32 states concatenated; or ``{"rid", "error": {...}}`` naming one of the
  server's error types (429 with its ``retry_after``, 413, 503) so the front-end raises it;
* front-end -> engine ``cancel``: ``{"op": "cancel", "rid"}`` when the request's caller went
  away; the engine withdraws its queued sequences (:meth:`Scheduler.submit`'s cancellation);
* ``hello``: a front-end's first message; the engine answers once its model is warmed up and
  every front-end has said hello (so they turn ready together) with a pickled
  :class:`Handoff` (configuration, info, tokenizer): the only pickle, once per front-end.

A front-end notices the engine process going away from the socket's own monitor (a
disconnect of the ipc connection), fails every waiting request with 503 and reports it
(:meth:`EngineClient.on_failure`), so its readiness drops and it exits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import orjson
import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

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
from .results import JobOutput, StageTimings
from .runner import SequenceInput
from .scheduler import ScheduledOutput, Scheduler
from .tokenization import TextTokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")

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
        """A front-end's copy: the per-request code needs no weights but a classifier's (its
        activation, and the per-token head), and those on the CPU; Dense layers and a SPLADE
        head run in the engine process's batches."""
        classifier = config.classifier
        if classifier is not None:
            classifier = replace(classifier, head=classifier.head.to(torch.device("cpu")))
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
    lengths = np.frombuffer(frames[0], np.int32)
    bounds = np.cumsum(lengths)[:-1]
    ids = np.split(np.frombuffer(frames[1], np.int32), bounds)
    skips = np.frombuffer(frames[2], np.int32).tolist()
    types: list[list[int] | None] = [None] * len(lengths)
    if len(frames[3]):
        types = [t.tolist() for t in np.split(np.frombuffer(frames[3], np.int32), bounds)]
    return [
        SequenceInput(i.tolist(), skip, want_tokens, t)
        for i, skip, t in zip(ids, skips, types, strict=True)
    ]


def encode_output(rid: int, out: ScheduledOutput) -> list[bytes | memoryview]:
    pooled = np.ascontiguousarray(out.pooled, dtype=np.float32)
    header: dict[str, Any] = {
        "rid": rid,
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


def encode_error(rid: int, error: BaseException) -> bytes:
    if isinstance(error, EmbeddingServerError) and type(error).__name__ in _ERRORS:
        body = {
            "type": type(error).__name__,
            "message": error.message,
            "param": error.param,
            "retry_after": getattr(error, "retry_after", None),
        }
    else:  # a bug or a failed forward pass: its details stay in the engine's log
        body = {"type": "EmbeddingServerError", "message": "the engine failed the request"}
    return orjson.dumps({"rid": rid, "error": body})


def decode_error(body: dict[str, Any]) -> EmbeddingServerError:
    cls = _ERRORS.get(body["type"], EmbeddingServerError)
    if issubclass(cls, QueueFullError):
        return cls(body["message"], retry_after=body.get("retry_after") or 1.0)
    return cls(body["message"], param=body.get("param"))


class EngineClient:
    """A front-end's connection to the engine process: one DEALER socket, any number of
    requests in flight on it, matched to their callers by request id."""

    def __init__(self, address: str) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._socket.connect(address)
        self._pending: dict[int, asyncio.Future[ScheduledOutput]] = {}
        self._rids = itertools.count()
        self._handoff: asyncio.Future[Handoff] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._callbacks: list[Callable[[str], None]] = []
        self.failure: str | None = None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` once if the engine process goes away."""
        self._callbacks.append(callback)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # A bug in the receive loop would leave every caller waiting: fail them instead.
            logger.error("engine connection failed", exc_info=task.exception())
            self._fail(f"the engine connection failed: {task.exception()!r}")

    async def connect(self) -> Handoff:
        """Say hello and wait for the engine's handoff, sent once its model is warmed up
        (no deadline of our own: a big model takes its time; if the engine process dies,
        this fails)."""
        self._handoff = asyncio.get_running_loop().create_future()
        self._spawn(self._receive())
        self._spawn(self._watch())
        await self._socket.send(_HELLO)
        return await self._handoff

    async def submit(self, seqs: Sequence[SequenceInput], want_tokens: bool) -> ScheduledOutput:
        """Queue ``seqs`` in the engine's scheduler and wait for their results; cancelling
        the caller withdraws them there."""
        if self.failure is not None:
            raise EngineFailedError("the engine process has stopped")
        rid = next(self._rids)
        future: asyncio.Future[ScheduledOutput] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        header = orjson.dumps({"op": "run", "rid": rid, "want_tokens": want_tokens})
        try:
            await self._socket.send_multipart([header, *encode_sequences(seqs)], copy=False)
            return await future
        except asyncio.CancelledError:
            # Cancelling this task cancelled ``future`` too; an answer may be on its way.
            if self.failure is None and (future.cancelled() or not future.done()):
                cancel = orjson.dumps({"op": "cancel", "rid": rid})
                self._spawn(self._socket.send(cancel))
            raise
        finally:
            self._pending.pop(rid, None)

    async def _receive(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            header = orjson.loads(frames[0].bytes)
            if header.get("op") == "hello":
                if self._handoff is not None and not self._handoff.done():
                    self._handoff.set_result(pickle.loads(frames[1].bytes))
                continue
            future = self._pending.get(header["rid"])
            if future is None or future.done():
                continue  # its caller gave up
            if "error" in header:
                future.set_exception(decode_error(header["error"]))
            else:
                future.set_result(decode_output(header, [f.buffer for f in frames[1:]]))

    async def _watch(self) -> None:
        """The ipc connection dropping means the engine process is gone."""
        await recv_monitor_message(self._monitor)
        self._fail("the engine process has stopped")

    def _fail(self, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = message
        error = EngineFailedError(message)
        if self._handoff is not None and not self._handoff.done():
            self._handoff.set_exception(error)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for callback in self._callbacks:
            callback(message)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()


class RemoteRunner(ThreadedRunner):
    """A front-end's :class:`~.jobs.JobRunner`: tokenizes here, in the front-end's thread
    pool, and runs the sequences in the engine process's scheduler.

    Unlike :class:`~.jobs.ScheduledRunner` it does not reserve queue room before tokenizing
    (that would cost a round trip per request): the engine admits the exact tokens, so an
    overloaded engine still answers 429, after this front-end has paid the tokenization."""

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

    async def run(self, job: Job) -> JobOutput:
        tokenized, tokenize_s = await self.tokenize(job)
        out = await self._client.submit(job.sequences(tokenized), job.want_tokens)
        timings = StageTimings(tokenize_s, out.queue_s, out.forward_s, out.pool_s)
        return JobOutput(tokenized, out.pooled, out.tokens, timings)


class EngineService:
    """The engine process's end: one ROUTER socket serving every front-end from the one
    scheduler. Bound at construction, before the model loads, so front-ends can connect and
    wait; :meth:`serve` answers them once the engine is warmed up."""

    def __init__(self, address: str) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._running: dict[tuple[bytes, int], asyncio.Task[None]] = {}

    async def serve(self, scheduler: Scheduler, handoff: Handoff, front_ends: int) -> None:
        """Answer front-ends until cancelled. The handoff goes to all ``front_ends`` at once,
        when the last has said hello: they share one port, so a front-end that served while
        another still started would let that one answer some clients "not ready"."""
        payload = pickle.dumps(handoff, protocol=pickle.HIGHEST_PROTOCOL)
        waiting: list[bytes] = []
        try:
            while True:
                frames = await self._socket.recv_multipart(copy=False)
                peer = frames[0].bytes
                header = orjson.loads(frames[1].bytes)
                op = header["op"]
                if op == "run":
                    key = (peer, int(header["rid"]))
                    seqs = decode_sequences([f.buffer for f in frames[2:]], header["want_tokens"])
                    task = asyncio.create_task(self._run(scheduler, peer, key[1], seqs))
                    self._running[key] = task
                    task.add_done_callback(lambda _, key=key: self._running.pop(key, None))  # type: ignore[misc]
                elif op == "cancel":
                    running = self._running.get((peer, int(header["rid"])))
                    if running is not None:
                        running.cancel()
                elif op == "hello":
                    waiting.append(peer)
                    if len(waiting) >= front_ends:
                        for each in waiting:
                            await self._socket.send_multipart([each, _HELLO, payload], copy=False)
                        waiting, front_ends = [], 0
        finally:
            for task in list(self._running.values()):
                task.cancel()

    async def _run(
        self, scheduler: Scheduler, peer: bytes, rid: int, seqs: list[SequenceInput]
    ) -> None:
        try:
            out = await scheduler.submit(seqs)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # answered to the front-end, which raises it there
            if not isinstance(error, EmbeddingServerError):
                logger.error("request failed in the engine: %s", error, exc_info=error)
            await self._socket.send_multipart([peer, encode_error(rid, error)])
            return
        await self._socket.send_multipart([peer, *encode_output(rid, out)], copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

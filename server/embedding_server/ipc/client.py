"""The front-end's end of the wire: its connection to the engine process, and the engine it
serves through it (``--api-workers N``).

**Admission before tokenizing.** A front-end admits each request as the one-process server
does (:class:`~embedding_server.request.admission.Admission`), before paying for its tokenization:
over the per-request limit is a 413, and a request that would not fit the engine's queue, as
the front-end last heard of it, is a 429 with the engine's ``Retry-After``; so is one that
would not fit beside the requests this front-end is still tokenizing (a burst). The view never
overstates the queue for longer than a message takes: every answer carries it, and when the
queue drains below what a front-end last heard, the engine tells it
(:class:`~.messages.QueueNews`, at most one per turn of its loop, and none while its answers
keep the front-end up to date). A queue with room for any request (held at most
``max_queue_tokens - max_request_tokens``) is told as empty, so short of overload no such news
is ever sent. A view that understates the queue only lets a request through to the engine,
which admits the exact tokens again as they arrive.

A front-end notices the engine process going away when its connection closes: it fails every
waiting request with 503 and reports it (:meth:`EngineClient.on_failure`), so its readiness
drops and it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from embedding_server.errors import EngineFailedError, NotReadyError
from embedding_server.ipc.messages import (
    HELLO,
    Cancel,
    Failure,
    Handoff,
    QueueNews,
    Run,
    Welcome,
    decode_error,
    decode_output,
    encode,
    encode_sequences,
    to_front_end,
)
from embedding_server.ipc.wire import Frames, Wire
from embedding_server.metrics import Metrics
from embedding_server.request.admission import Admission, Priority, Reservation
from embedding_server.request.jobs import Job, JobRunner, ThreadedRunner
from embedding_server.request.scheduler import EngineLoad, ScheduledOutput, backlog_seconds
from embedding_server.request.sequences import SequenceInput
from embedding_server.request.serving import ServingEngine
from embedding_server.request.tokenization import TextTokenizer
from embedding_server.settings import ServerSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        self._wire.send([HELLO])
        handoff = await self._handoff
        config = handoff.config
        self._admission = Admission.of(config.max_queue_tokens, config.max_request_tokens)
        return handoff

    @property
    def engine_queue(self) -> tuple[int, float]:
        """The engine's queue as this front-end last heard of it: tokens held, drain rate."""
        return self._queue

    def reserve(
        self,
        floor: int,
        estimate: int,
        bound: int | None = None,
        priority: Priority = "interactive",
    ) -> Reservation:
        """Admit a request before it is tokenized (see the module docstring): ``floor``
        tokens at least, about ``estimate``, at most ``bound``, reserved here until
        :meth:`submit` sends it; a bulk request into its share of the queue only."""
        held, rate = self._queue
        return self._admission.reserve(floor, estimate, held, rate, bound=bound, priority=priority)

    async def submit(
        self,
        seqs: Sequence[SequenceInput],
        want_tokens: bool,
        reservation: Reservation | None = None,
        priority: Priority = "interactive",
    ) -> ScheduledOutput:
        """Queue ``seqs`` in the engine's scheduler, in ``priority``'s class (it travels in
        the ``Run`` message), and wait for their results; cancelling the caller withdraws
        them there. Their ``reservation`` ends as they are sent: from then on the engine's
        queue holds them."""
        if reservation is not None:
            reservation.release()
        if self.failure is not None:
            raise EngineFailedError("the engine process has stopped")
        rid = next(self._rids)
        future: asyncio.Future[ScheduledOutput] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        header = encode(Run(rid=rid, want_tokens=want_tokens, priority=priority))
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
                    self._wire.send([encode(Cancel(rid=rid))])
            raise
        finally:
            self._pending.pop(rid, None)

    def _received(self, frames: Frames) -> None:
        try:
            message = to_front_end.decode(frames[0])
            self._queue = (message.held, message.rate)
            if isinstance(message, QueueNews):
                return
            if isinstance(message, Welcome):
                if self._handoff is not None and not self._handoff.done():
                    self._handoff.set_result(pickle.loads(frames[1]))
                return
            future = self._pending.get(message.rid)
            if future is None or future.done():
                return  # its caller gave up
            if isinstance(message, Failure):
                future.set_exception(decode_error(message.error))
            else:
                future.set_result(decode_output(message, frames[1:]))
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
    """A front-end's :class:`~embedding_server.request.jobs.JobRunner`: tokenizes here, in the
    front-end's thread pool, and runs the sequences in the engine process's scheduler.

    Like :class:`~embedding_server.request.jobs.ScheduledRunner` it admits a request before
    tokenizing it, here on the front-end's view of the engine's queue
    (:meth:`EngineClient.reserve`), with no round trip; the engine admits the exact tokens
    when they arrive."""

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

    def _reserve(self, floor: int, estimate: int, bound: int, priority: Priority) -> Reservation:
        return self._client.reserve(floor, estimate, bound, priority)

    async def _submit(
        self,
        job: Job,
        sequences: list[SequenceInput],
        reservation: Reservation,
        priority: Priority,
    ) -> ScheduledOutput:
        return await self._client.submit(sequences, job.want_tokens, reservation, priority)


class AttachedEngine(ServingEngine):
    """A front-end process's engine (``--api-workers N``): the engine's request-level
    code (inputs, prompts, truncation, the per-request head, results) here, every job's
    sequences run by the model and the scheduler of the engine process.

    It has no model, so only the async API serves; ``Engine.__init__``, which builds the
    model's stages, is not called."""

    def __init__(
        self,
        settings: ServerSettings,
        handoff: Handoff,
        client: EngineClient,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings, self.metrics = settings, metrics
        self._config, self._info = handoff.config, handoff.info
        self._tokenizer = handoff.tokenizer
        self._images, self._chat = handoff.images, handoff.chat
        self._client = client
        self._remote: RemoteRunner | None = None
        self._ready = False

    @classmethod
    async def connect(
        cls, settings: ServerSettings, address: str, *, metrics: Metrics | None = None
    ) -> AttachedEngine:
        """Connect to the engine process at ``address`` and wait until it serves."""
        client = EngineClient(address)
        try:
            handoff = await client.connect()
        except BaseException:
            client.close()
            raise
        return cls(settings, handoff, client, metrics=metrics)

    def load(self) -> EngineLoad:
        """The engine's queue as this front-end last heard of it (the engine tells a change
        only once the queue nears its bound, so a light load can read as none; a gateway
        adds its own in-flight work on top)."""
        held, rate = self._client.engine_queue
        return EngineLoad(held, 0, backlog_seconds(held, rate, self._config.max_batch_tokens))

    @property
    def ready(self) -> bool:
        return self._ready and self._client.failure is None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` if the engine process goes away."""
        self._client.on_failure(callback)

    def close(self) -> None:
        self._client.close()

    async def start(self) -> None:
        if self._ready:
            return
        pool = ThreadPoolExecutor(self.settings.tokenizer_workers, thread_name_prefix="tokenize")
        loop = asyncio.get_running_loop()
        self._remote = RemoteRunner(self._tokenizer, self._client, loop=loop, tokenize_pool=pool)
        self._ready = True

    async def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop serving; the HTTP server has already waited for the requests in flight."""
        self._ready = False
        if self._remote is not None:
            self._remote.shutdown()
            self._remote = None
        self.close()

    def _scheduled(self) -> JobRunner:
        if not self.ready or self._remote is None:
            raise NotReadyError("the engine process is not serving")
        return self._remote

    def _offloader(self) -> JobRunner:
        return self._scheduled()

    def _sync(self, work: Callable[[JobRunner], Coroutine[Any, Any, T]]) -> T:
        raise RuntimeError("a front-end's engine serves the async API only")

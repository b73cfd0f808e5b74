"""The messages between front-end processes and the engine process, one definition each.

Each message is a small JSON header (a :mod:`msgspec` struct, tagged by ``op``) followed by
raw buffers (see :mod:`.wire` for the framing). Token ids and vectors travel as int32 and
float32 buffers, never as Python lists; the header says how to read them.

front-end -> engine:

* :class:`Hello`: a front-end's first message;
* :class:`Run`: a request's sequences, then six int32 frames and two for images
  (:func:`encode_sequences`);
* :class:`Cancel`: the request's caller went away.

engine -> front-end (every one carries the engine's queue, see :class:`QueueView`):

* :class:`Welcome`: the answer to every front-end's hello, once the model is warmed up, with
  the pickled :class:`Handoff` as its one frame (the only pickle, once per front-end);
* :class:`Output`: a request's pooled ``[n, dim]`` float32 matrix, then, when asked, every
  sequence's per-token float32 states concatenated;
* :class:`Failure`: a request's error, by type (:class:`ErrorBody`);
* :class:`QueueNews`: the queue has drained below what this front-end last heard.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from embedding_server.errors import (
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
from embedding_server.request.admission import Priority
from embedding_server.request.configuration import EngineConfig, EngineInfo
from embedding_server.request.media.inputs import ChatTemplate, ImagePreprocessor
from embedding_server.request.pooling import FloatArray
from embedding_server.request.scheduler import ScheduledOutput
from embedding_server.request.sequences import SequenceInput
from embedding_server.request.tokenization import TextTokenizer


@dataclass(frozen=True)
class Handoff:
    """What a front-end needs from the engine process, sent once when it connects: the
    decisions the engine was built from, what ``/info`` reports, and the tokenizer. None of
    it holds a tensor (heads run in the engine process's batches), so a front-end never
    loads torch to read it."""

    config: EngineConfig
    info: EngineInfo
    tokenizer: TextTokenizer
    images: ImagePreprocessor | None = None
    """The model's image preprocessing, where it takes images (front-ends decode and
    preprocess a request's images themselves)."""
    chat: ChatTemplate | None = None
    """The tokenizer's chat template, where it has one."""


class Hello(msgspec.Struct, tag_field="op", tag="hello", frozen=True):
    """A front-end's first message."""


class Run(msgspec.Struct, tag_field="op", tag="run", frozen=True):
    """Run a request's sequences (frames: :func:`encode_sequences`)."""

    rid: int
    want_tokens: bool
    priority: Priority = "interactive"
    """The request's class in the engine's admission and batching (``X-Priority``)."""


class Cancel(msgspec.Struct, tag_field="op", tag="cancel", frozen=True):
    """Withdraw request ``rid``: its caller went away."""

    rid: int


class Welcome(msgspec.Struct, tag_field="op", tag="welcome", frozen=True):
    """The engine serves: its :class:`Handoff` follows, pickled, as the one frame."""

    held: int = 0
    rate: float = 0.0


class Output(msgspec.Struct, tag_field="op", tag="output", frozen=True):
    """A request's results: the pooled ``[n, dim]`` matrix, then, with ``token_rows``, the
    per-token states ``[sum(token_rows), token_dim]``. The header carries the engine's stage
    seconds and the batches the request rode, which the front-end's traces turn into spans
    (:mod:`embedding_server.request.tracing`): three integers rather than a trace context."""

    rid: int
    held: int
    rate: float
    dim: int
    queue_s: float
    forward_s: float
    pool_s: float
    token_rows: list[int] | None = None
    token_dim: int = 0
    batches: int = 1
    batch_size: int = 0
    batch_tokens: int = 0


class ErrorBody(msgspec.Struct, frozen=True):
    """One of the server's errors by type name (:data:`ERRORS`), so the front-end raises the
    same error (429 with its ``retry_after``, 413, 503) as a one-process server would."""

    type: str
    message: str
    param: str | None = None
    retry_after: float | None = None


class Failure(msgspec.Struct, tag_field="op", tag="error", frozen=True):
    """Request ``rid`` failed."""

    rid: int
    held: int
    rate: float
    error: ErrorBody


class QueueNews(msgspec.Struct, tag_field="op", tag="queue", frozen=True):
    """The engine's queue drained below what this front-end last heard."""

    held: int
    rate: float


ToEngine = Hello | Run | Cancel
ToFrontEnd = Welcome | Output | Failure | QueueNews

QueueView = tuple[int, float]
"""The engine's queue as an answer leaves: tokens held, and the drain rate (tokens/s)."""

_encoder = msgspec.json.Encoder()
to_engine = msgspec.json.Decoder(ToEngine)
"""Decodes a header a front-end sent."""
to_front_end = msgspec.json.Decoder(ToFrontEnd)
"""Decodes a header the engine sent."""


def encode(message: ToEngine | ToFrontEnd) -> bytes:
    """A message's header frame."""
    return _encoder.encode(message)


HELLO = encode(Hello())

ERRORS: dict[str, type[EmbeddingServerError]] = {
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


def _int32(values: Any, count: int) -> bytes:
    return np.fromiter(values, np.int32, count).tobytes()


def encode_sequences(seqs: Sequence[SequenceInput]) -> list[bytes]:
    """A request's sequences as six int32 buffers: the sequence lengths, all token ids
    concatenated, the prompt tokens to skip per sequence, the segment ids concatenated (an
    empty buffer for single texts), each sequence's task adapter, -1 for none (an empty
    buffer when none names one), and each sequence's key length, -1 for all its tokens (an
    empty buffer when none limits its keys: ColBERT's augmented queries). Then two for
    images (empty when the request has none): each sequence's pixel shape as three int32
    (-1s for a text), and every image's float32 pixels concatenated, so an image crosses
    as its raw frame, never as a Python list."""
    n = len(seqs)
    lengths = [len(s.ids) for s in seqs]
    total = sum(lengths)
    ids = _int32(itertools.chain.from_iterable(s.ids for s in seqs), total)
    skips = _int32((s.skip for s in seqs), n)
    types = b""
    if any(s.type_ids is not None for s in seqs):
        segments = (s.type_ids if s.type_ids is not None else [0] * len(s.ids) for s in seqs)
        types = _int32(itertools.chain.from_iterable(segments), total)
    adapters = b""
    if any(s.adapter is not None for s in seqs):
        adapters = _int32((-1 if s.adapter is None else s.adapter for s in seqs), n)
    key_lens = b""
    if any(s.key_len is not None for s in seqs):
        key_lens = _int32((-1 if s.key_len is None else s.key_len for s in seqs), n)
    shapes, pixels = _encode_pixels(seqs)
    return [_int32(lengths, n), ids, skips, types, adapters, key_lens, shapes, pixels]


def _encode_pixels(seqs: Sequence[SequenceInput]) -> tuple[bytes, bytes]:
    images = [s.pixels for s in seqs if s.pixels is not None]
    if not images:
        return b"", b""
    dims = itertools.chain.from_iterable(
        (-1, -1, -1) if s.pixels is None else s.pixels.shape for s in seqs
    )
    shapes = _int32(dims, 3 * len(seqs))
    data = np.concatenate([np.asarray(p, dtype=np.float32).reshape(-1) for p in images])
    return shapes, data.tobytes()


def _decode_pixels(frames: Sequence[memoryview | bytes], count: int) -> list[FloatArray | None]:
    if len(frames) < 8 or not len(frames[6]):
        return [None] * count
    shapes = np.frombuffer(frames[6], np.int32).reshape(count, 3).tolist()
    data = np.frombuffer(frames[7], np.float32)
    out: list[FloatArray | None] = []
    start = 0
    for shape in shapes:
        if shape[0] < 0:
            out.append(None)
            continue
        size = shape[0] * shape[1] * shape[2]
        out.append(data[start : start + size].reshape(shape))
        start += size
    return out


def decode_sequences(
    frames: Sequence[memoryview | bytes], want_tokens: bool
) -> list[SequenceInput]:
    """:func:`encode_sequences` read back. Each buffer becomes one Python list, sliced per
    sequence: for the one or few sequences of a typical request that costs less than
    numpy's ``split`` (docs/performance-log.md)."""
    lengths = np.frombuffer(frames[0], np.int32).tolist()
    ids = np.frombuffer(frames[1], np.int32).tolist()
    skips = np.frombuffer(frames[2], np.int32).tolist()
    types = np.frombuffer(frames[3], np.int32).tolist() if len(frames[3]) else None
    adapters = np.frombuffer(frames[4], np.int32).tolist() if len(frames[4]) else None
    key_lens = np.frombuffer(frames[5], np.int32).tolist() if len(frames[5]) else None
    pixels = _decode_pixels(frames, len(lengths))
    seqs: list[SequenceInput] = []
    start = 0
    for i, (length, skip) in enumerate(zip(lengths, skips, strict=True)):
        end = start + length
        segments = None if types is None else types[start:end]
        adapter = None if adapters is None or adapters[i] < 0 else adapters[i]
        key_len = None if key_lens is None or key_lens[i] < 0 else key_lens[i]
        seqs.append(
            SequenceInput(ids[start:end], skip, want_tokens, segments, adapter, key_len, pixels[i])
        )
        start = end
    return seqs


def encode_output(
    rid: int, out: ScheduledOutput, queue: QueueView = (0, 0.0)
) -> list[bytes | memoryview]:
    """A request's results as an :class:`Output` and its buffers."""
    pooled = np.ascontiguousarray(out.pooled, dtype=np.float32)
    frames: list[bytes | memoryview] = [b"", pooled.data.cast("B")]
    token_rows: list[int] | None = None
    token_dim = 0
    matrices = [t for t in out.tokens if t is not None]
    if matrices and len(matrices) == len(out.tokens):
        token_rows = [int(t.shape[0]) for t in matrices]
        token_dim = int(matrices[0].shape[1])
        stacked = np.ascontiguousarray(np.concatenate(matrices), dtype=np.float32)
        frames.append(stacked.data.cast("B"))
    frames[0] = encode(
        Output(
            rid=rid,
            held=queue[0],
            rate=queue[1],
            dim=int(pooled.shape[1]) if pooled.ndim == 2 else 0,
            queue_s=out.queue_s,
            forward_s=out.forward_s,
            pool_s=out.pool_s,
            token_rows=token_rows,
            token_dim=token_dim,
            batches=out.batches,
            batch_size=out.batch_size,
            batch_tokens=out.batch_tokens,
        )
    )
    return frames


def decode_output(header: Output, frames: Sequence[memoryview | bytes]) -> ScheduledOutput:
    """:func:`encode_output` read back (``frames``: the buffers after the header)."""
    pooled = np.frombuffer(frames[0], np.float32).reshape(-1, header.dim)
    rows = header.token_rows
    tokens: list[FloatArray | None] = [None] * len(pooled)
    if rows is not None:
        flat = np.frombuffer(frames[1], np.float32).reshape(-1, header.token_dim)
        tokens = list(np.split(flat, np.cumsum(rows)[:-1]))
    return ScheduledOutput(
        pooled,
        tokens,
        header.queue_s,
        header.forward_s,
        header.pool_s,
        header.batches,
        header.batch_size,
        header.batch_tokens,
    )


def encode_error(rid: int, error: BaseException, queue: QueueView = (0, 0.0)) -> bytes:
    """A request's error as a :class:`Failure` (see :func:`decode_error`)."""
    if isinstance(error, EmbeddingServerError) and type(error).__name__ in ERRORS:
        body = ErrorBody(
            type=type(error).__name__,
            message=error.message,
            param=error.param,
            retry_after=getattr(error, "retry_after", None),
        )
    else:  # a bug or a failed forward pass: its details stay in the engine's log
        body = ErrorBody(type="EmbeddingServerError", message="the engine failed the request")
    return encode(Failure(rid=rid, held=queue[0], rate=queue[1], error=body))


def decode_error(body: ErrorBody) -> EmbeddingServerError:
    """The error a :class:`Failure` names, ready to raise."""
    cls = ERRORS.get(body.type, EmbeddingServerError)
    if issubclass(cls, QueueFullError):
        return cls(body.message, retry_after=body.retry_after or 1.0)
    return cls(body.message, param=body.param)

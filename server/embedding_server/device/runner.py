"""The forward stage: token id lists in, pooled float32 vectors (and token states) out.

One batch is one forward pass, in two halves so that a GPU never waits for the host:

* :meth:`ModelRunner.prepare` (host): orders sequences by length (equal lengths become
  contiguous, so CPU attention runs on zero-copy views), packs them into a
  :class:`~.models.base.PackedBatch`, builds the attention plan and starts the copies to the
  device: pinned staging memory, ``non_blocking``, on a copy stream of its own (CUDA).
* :meth:`ModelRunner.execute` (device): the forward pass under ``torch.inference_mode``,
  pooling and the batch-level part of the pooling head (the sentence-transformers Dense
  layers) in float32, one copy of the results back, the caller's order restored.

A batch may mix texts and images (sequences carrying ``pixels``, CLIP and SigLIP): the texts
take the packed path above; the images are stacked and embedded by the model's vision tower
(``encode_images``), which pools and projects them itself, so their rows skip the text
pooling and the batch head. A model without a vision tower refuses pixels.

The scheduler prepares batch N+1 on its own thread while batch N executes on the forward
thread. ``execute`` is the only code that touches the model, and it serializes calls with a
lock (``prepare`` never takes it), so the offline path (:meth:`ModelRunner.run`, both halves
inline) and the scheduler's threads can share one engine safely. The CPU takes the same path:
no pinned memory, no stream, and the "copy" is the host tensor itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt
import torch

from embedding_server.device.attention import Backend
from embedding_server.device.dtypes import fatal_device_error
from embedding_server.device.models.base import EmbeddingModel, PackedBatch
from embedding_server.device.models.vision import image_tokens_of
from embedding_server.device.pooling import pool
from embedding_server.device.prefix_cache import PrefixCache, PrefixKey, PrefixModel
from embedding_server.errors import EngineFailedError, InvalidRequestError
from embedding_server.request.pooling import FloatArray, PoolingMethod
from embedding_server.request.sequences import BatchOutput, SequenceInput

logger = logging.getLogger(__name__)

# Below this many tokens a CPU forward pass runs on one thread: the matmuls are too small to
# split profitably, and on a busy host every OpenMP region would wait for a descheduled
# worker (docs/performance-log.md, "Small batches on one thread").
SMALL_BATCH_TOKENS = 256


def token_grid(total: int) -> int:
    """The token count a CPU batch in bfloat16 or float16 is padded to: a multiple of 16 up
    to 128, then eight steps per doubling (at most 12.5% more rows).

    oneDNN compiles a matmul kernel for each shape it meets, at a cost that grows with the
    row count, and keeps 1,024 of them. A packed batch has a new row count almost every time,
    so without a grid a serving process compiles kernels for ever: four linear shapes per row
    count outrun the cache long before 2,048 row counts are seen. On the grid
    there are eight row counts up to 128 and eight per doubling above, 64 up to 16,384
    (docs/performance-log.md, "oneDNN kernels per batch shape")."""
    if total <= 128:
        return -(-total // 16) * 16
    step = 1 << ((total - 1).bit_length() - 4)
    return -(-total // step) * step


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    """A batch packed for the device by :meth:`ModelRunner.prepare`, for
    :meth:`ModelRunner.execute`."""

    batch: PackedBatch
    """Text sequences in length order, on the device (or on their way there)."""
    ordered: tuple[SequenceInput, ...]
    """The caller's text sequences in that order."""
    inverse: npt.NDArray[np.int64]
    """Row ``inverse[i]`` of the ordered results (the texts', then the images') is the
    caller's sequence ``i``."""
    copied: torch.cuda.Event | None
    """Recorded on the copy stream after the batch's copies (CUDA); None on the CPU."""
    images: torch.Tensor | None = None
    """The batch's images' pixels, flat and concatenated (float32, on the device: one
    copy), in the caller's order; None when it has none."""
    image_shapes: tuple[tuple[int, ...], ...] = ()
    """Each image's ``[3, H, W]`` shape (NaFlex SigLIP 2's differ)."""
    fill: int = 0
    """One-token filler sequences after the texts (:attr:`ModelRunner.shape_grid`), whose
    rows the forward pass computes and :meth:`ModelRunner.execute` drops."""


class BatchHead(Protocol):
    """The batch-level head after pooling: sentence-transformers Dense layers
    (:class:`~.pooling.DenseHead`) or a classifier (:class:`~.heads.ClassificationHead`)."""

    def project(self, pooled: torch.Tensor) -> torch.Tensor: ...


class TokenPooler(Protocol):
    """Pools packed token states into one vector per sequence itself (SPLADE's head), in place
    of the pooling method and batch head."""

    def __call__(self, hidden: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor: ...


TokenHead = Callable[[torch.Tensor], torch.Tensor]
"""Applied to the token states a sequence asked for (``[tokens, hidden]``) before they are
copied back: a token classifier's head (:func:`~.heads.token_head`)."""


class ModelRunner:
    """Runs packed forward passes and the batch-level part of pooling."""

    def __init__(
        self,
        model: EmbeddingModel,
        *,
        device: torch.device,
        pooling: PoolingMethod,
        head: BatchHead,
        include_prompt: bool = True,
        instruction: Callable[[Sequence[int]], int] | None = None,
        cpu_threads: int = 1,
        attention: Backend = Backend.SDPA_BUCKETED,
        token_pooler: TokenPooler | None = None,
        token_head: TokenHead | None = None,
        shape_grid: bool = False,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.model = model
        if prefix_cache is not None and not isinstance(model, PrefixModel):
            raise ValueError(f"{type(model).__name__} computes no prefix states to cache")
        dropped = getattr(model, "drop_prefix", None)  # tensor parallelism's other ranks
        if prefix_cache is not None and callable(dropped):
            prefix_cache.listen(dropped)
        self.prefix_cache = prefix_cache
        """Cached prompt prefixes (``--prefix-cache-bytes``, a causal decoder that has
        ``prefix_entries``); None: every sequence runs whole."""
        self.shape_grid = shape_grid and getattr(model, "token_states", True)
        """Pad each text batch to :func:`token_grid` tokens with one-token filler sequences
        (CPU bfloat16/float16: oneDNN's kernels are per shape); their rows are dropped after
        the forward pass."""
        self.token_pooler = token_pooler
        self.token_head = token_head
        self.device = device
        self.pooling = pooling
        self.include_prompt = include_prompt
        self.instruction = instruction
        """How many leading tokens of a sequence's ids are its instruction, which pooling
        leaves out (GritLM's, ``device.instructions``); None: the prompt's, where
        ``include_prompt`` is false."""
        self.head = head
        self._lock = threading.Lock()
        self._failure_lock = threading.Lock()
        # Host-to-device copies of prepared batches run on their own stream, so they overlap
        # the forward pass on the default stream instead of queueing behind it.
        self._copy_stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.cpu_threads = cpu_threads
        self.attention = attention
        self.failure: str | None = None
        """Why forward passes cannot run any more (a fatal device error), else None."""
        self._failure_callbacks: list[Callable[[str], None]] = []

    def warmup_batch(self, max_len: int, max_tokens: int, max_size: int) -> list[SequenceInput]:
        """A batch to run once before traffic. On CUDA it fills the whole token budget, so
        out-of-memory surfaces at start rather than under load."""
        if self.device.type == "cuda":
            n = max(1, min(max_size, max_tokens // max_len))
            return [SequenceInput([1] * max_len) for _ in range(n)] + self._warmup_image()
        texts = [SequenceInput([1] * min(16, max_len)), SequenceInput([1] * min(7, max_len))]
        return texts + self._warmup_image()

    def _warmup_image(self) -> list[SequenceInput]:
        """One blank image for a model with a vision tower (its kernels warm up too)."""
        tokens = image_tokens_of(self.model)
        size = getattr(self.model, "image_size", None)
        if tokens is None or not isinstance(size, int):
            return []
        pixels = np.zeros((3, size, size), dtype=np.float32)
        return [SequenceInput([0] * tokens, pixels=pixels)]

    def _encode_images(
        self, images: torch.Tensor | None, shapes: Sequence[tuple[int, ...]]
    ) -> torch.Tensor | None:
        """The vision tower's pooled vectors of the batch's images (their own pooling and
        projection: the text pooling method and batch head do not apply)."""
        if images is None:
            return None
        encode = getattr(self.model, "encode_images", None)
        if encode is None:  # prepare refused already; never drop an image silently
            raise InvalidRequestError("this model embeds texts only, not images", param="input")
        sizes = [int(np.prod(shape)) for shape in shapes]
        views = [
            part.view(shape) for part, shape in zip(torch.split(images, sizes), shapes, strict=True)
        ]
        out: torch.Tensor = encode(views, self.attention)
        return out

    def _token_states(
        self, hidden: torch.Tensor, ordered: Sequence[SequenceInput]
    ) -> list[FloatArray | None]:
        """The per-token states of the sequences that asked for them (through the token head,
        if any), in one device-to-host copy (a copy per sequence would sync the GPU once per
        sequence)."""
        wanted = [s.want_tokens for s in ordered]
        if not any(wanted):
            return [None] * len(ordered)
        lengths = [len(s.ids) for s in ordered]
        states = hidden
        if not all(wanted):
            starts = np.cumsum([0, *lengths[:-1]])
            rows = np.concatenate(
                [np.arange(a, a + n) for a, n, w in zip(starts, lengths, wanted, strict=True) if w]
            )
            states = hidden.index_select(0, torch.from_numpy(rows).to(hidden.device))
        if self.token_head is not None:
            states = self.token_head(states)
        host = states.float().cpu().numpy()
        out: list[FloatArray | None] = []
        offset = 0
        for n, want in zip(lengths, wanted, strict=True):
            if want:
                out.append(host[offset : offset + n])
                offset += n
            else:
                out.append(None)
        return out

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` once a forward pass hits a fatal device error."""
        self._failure_callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def run(self, seqs: Sequence[SequenceInput]) -> BatchOutput:
        """One forward pass: :meth:`prepare` then :meth:`execute` on the calling thread."""
        return self.execute(self.prepare(seqs))

    def prepare(self, seqs: Sequence[SequenceInput]) -> PreparedBatch:
        """The host half of a batch: order by length, pack into tensors, build the
        attention plan, start the copies to the device. It never takes the model lock, so
        the scheduler prepares batch N+1 on another thread while batch N's forward runs. On
        CUDA the staging tensors are pinned and copied ``non_blocking`` on a copy stream of
        their own; :meth:`execute` orders its stream after them. On the CPU nothing is
        copied. Raises :class:`EngineFailedError` once the device has failed."""
        with self._guard():
            return self._prepare(seqs)

    def execute(self, prepared: PreparedBatch) -> BatchOutput:
        """The device half: the forward pass, pooling and the batch head, then one copy of
        the results to the host in the caller's order; serialized (the model lock). After a
        fatal device error (a CUDA device-side assert, an illegal memory access) every call
        raises EngineFailedError: the context is poisoned, so the failure callbacks end the
        process instead of letting every later batch fail behind a green readiness probe."""
        with self._guard():
            return self._execute(prepared)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        try:
            yield
        except Exception as error:
            if not fatal_device_error(error):
                raise
            with self._failure_lock:
                first = self.failure is None
                if first:
                    self.failure = f"the device failed: {type(error).__name__}: {error}"
            if first:
                logger.error("%s; the server cannot serve any more", self.failure)
                for callback in self._failure_callbacks:
                    callback(self.failure or "")
            raise EngineFailedError(self.failure or "the device failed") from error

    def _stack_images(
        self, seqs: Sequence[SequenceInput], rows: Sequence[int]
    ) -> tuple[torch.Tensor, tuple[tuple[int, ...], ...]]:
        """The images of ``seqs`` at ``rows``, flat on the device in one copy, and their
        shapes; refused (a client error, never silently dropped) where the model has no
        vision tower, a sequence wants its token states, or an image is not ``[3, H, W]``."""
        if image_tokens_of(self.model) is None:
            raise InvalidRequestError(
                "this model has no vision tower: it embeds texts only, not images",
                param="input",
            )
        if any(seqs[i].want_tokens for i in rows):
            raise InvalidRequestError(
                "an image has no per-token states to return: its vision tower pools it",
                param="input",
            )
        arrays = [np.asarray(seqs[i].pixels, dtype=np.float32) for i in rows]
        if any(a.ndim != 3 or a.shape[0] != 3 for a in arrays):
            raise InvalidRequestError(
                f"an image must be [3, H, W] pixels; got {[a.shape for a in arrays]}",
                param="input",
            )
        host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
        if self.device.type == "cuda":
            host = host.pin_memory()
        shapes = tuple(tuple(int(d) for d in a.shape) for a in arrays)
        return host.to(self.device, non_blocking=True), shapes

    def _prepare(self, seqs: Sequence[SequenceInput]) -> PreparedBatch:
        image_rows = [i for i, s in enumerate(seqs) if s.pixels is not None]
        texts = [i for i, s in enumerate(seqs) if s.pixels is None]
        order = sorted(texts, key=lambda i: len(seqs[i].ids)) + image_rows
        ordered = tuple(seqs[i] for i in order[: len(texts)])
        if not getattr(self.model, "token_states", True) and any(s.want_tokens for s in ordered):
            raise InvalidRequestError(
                "this model's text tower pools inside the model (SigLIP's head): it has no "
                "per-token states to return",
                param="input",
            )
        inverse = np.empty(len(order), dtype=np.int64)
        inverse[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
        stream = self._copy_stream
        prefixes = self._prefixes(ordered)
        ids = [
            s.ids if p is None else s.ids[len(p) :]
            for s, p in zip(ordered, prefixes or [None] * len(ordered), strict=True)
        ]
        fill = 0
        if self.shape_grid and ordered:
            total = sum(len(i) for i in ids)
            fill = token_grid(total) - total
            # One-token sequences: they attend only to themselves, in one attention bucket
            # of their own, so no real sequence sees them; their rows are dropped after the
            # forward pass. Their token is the batch's first (a valid id of the vocabulary).
            ids = ids + [ordered[0].ids[:1]] * fill
            if prefixes is not None:
                prefixes = prefixes + [None] * fill
        with (
            torch.inference_mode(),
            torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
        ):
            batch = PackedBatch.build(
                ids,
                self.device,
                self.model.position_offset,
                attention=self.attention,
                token_types=(
                    [s.type_ids or [0] * len(s.ids) for s in ordered] + [[0]] * fill
                    if any(s.type_ids for s in ordered)
                    else None
                ),
                adapters=(
                    [-1 if s.adapter is None else s.adapter for s in ordered] + [-1] * fill
                    if any(s.adapter is not None for s in ordered)
                    else None
                ),
                key_lens=(
                    [len(s.ids) if s.key_len is None else s.key_len for s in ordered] + [1] * fill
                    if any(s.key_len is not None for s in ordered)
                    else None
                ),
                prefixes=prefixes,
            )
            if batch.prefix is None:
                batch.attention_plan  # noqa: B018  (built here, off the forward thread)
            images, shapes = self._stack_images(seqs, image_rows) if image_rows else (None, ())
            copied = None
            if stream is not None:
                copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
                copied.record(stream)
        return PreparedBatch(batch, ordered, inverse, copied, images, shapes, fill)

    def _prefixes(self, ordered: Sequence[SequenceInput]) -> list[PrefixKey | None] | None:
        """The cached prefix each text sequence runs after (None: it runs whole); None when
        none does. A sequence continues its prompt's tokens (``skip``, its prompt length)
        when it has tokens of its own after them, and no segment ids, adapter or key limit
        (each changes what the prefix tokens compute)."""
        if self.prefix_cache is None:
            return None
        found: list[PrefixKey | None] = []
        for s in ordered:
            p = s.skip
            usable = (
                0 < p < len(s.ids)
                and s.type_ids is None
                and s.adapter is None
                and s.key_len is None
            )
            found.append(tuple(s.ids[:p]) if usable else None)
        return found if any(p is not None for p in found) else None

    def _bind_prefixes(self, batch: PackedBatch) -> None:
        """Give the batch its prefixes' states: the cached ones, and those computed now (in
        one forward pass of the prefixes alone) and kept for the next batches."""
        prefix, cache = batch.prefix, self.prefix_cache
        if prefix is None or cache is None:
            return
        found = {key: cache.get(key) for key in prefix.keys}
        missing = [key for key, entry in found.items() if entry is None]
        fresh = {slot for slot, key in enumerate(prefix.keys) if found[key] is None}
        if missing:
            model = cast(PrefixModel, self.model)
            for entry in model.prefix_entries(missing, self.attention):
                cache.put(entry)
                found[entry.ids] = entry
        used = [slot for slot in prefix.slots if slot >= 0]
        misses = sum(slot in fresh for slot in used)
        cache.count(hits=len(used) - misses, misses=misses)
        prefix.bind([entry for entry in found.values() if entry is not None])

    def _forward(self, batch: PackedBatch, ordered: Sequence[SequenceInput]) -> torch.Tensor:
        """The model's forward pass over ``batch`` (``ordered``: its sequences)."""
        return self.model.forward(batch)

    def _pool(
        self,
        hidden: torch.Tensor,
        batch: PackedBatch,
        seqlens: Sequence[int],
        skip: Sequence[int] | None,
    ) -> torch.Tensor:
        """One vector per sequence of ``hidden`` (the first ``len(seqlens)`` of ``batch``),
        through the batch head or the token pooler."""
        if self.token_pooler is not None:
            return self.token_pooler(hidden, seqlens)
        return self.head.project(pool(hidden, seqlens, self.pooling, skip))

    def _execute(self, prepared: PreparedBatch) -> BatchOutput:
        batch, ordered = prepared.batch, prepared.ordered
        with self._lock, torch.inference_mode():
            start = time.perf_counter()
            if prepared.copied is not None:
                # The forward stream waits (on the device, not the host) for the batch's
                # copies. The tensors were allocated on the copy stream: marking them used on
                # this one keeps the caching allocator from handing their memory to the next
                # batch's copies before this stream is done with them (even when this pass
                # fails half-way and drops them early).
                forward_stream = torch.cuda.current_stream(self.device)
                forward_stream.wait_event(prepared.copied)
                for tensor in batch.tensors():
                    tensor.record_stream(forward_stream)
                if prepared.images is not None:
                    prepared.images.record_stream(forward_stream)
            if self.device.type == "cpu":
                total = sum(batch.seqlens) - prepared.fill
                total += len(prepared.image_shapes) * (image_tokens_of(self.model) or 0)
                threads = 1 if total < SMALL_BATCH_TOKENS else self.cpu_threads
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
            self._bind_prefixes(batch)
            hidden = self._forward(batch, ordered) if ordered else None
            seqlens = batch.seqlens
            if batch.prefix is not None and hidden is not None:
                hidden = batch.prefix.full_states(hidden)
                seqlens = batch.prefix.full_seqlens
            if prepared.fill and hidden is not None:
                seqlens = seqlens[: len(ordered)]
                hidden = hidden[: hidden.shape[0] - prepared.fill]
            pictures = self._encode_images(prepared.images, prepared.image_shapes)
            if hidden is not None and hidden.is_cuda:
                torch.cuda.synchronize(hidden.device)
            if pictures is not None and pictures.is_cuda:
                torch.cuda.synchronize(pictures.device)
            forward_done = time.perf_counter()
            rows: list[FloatArray] = []
            tokens_sorted: list[FloatArray | None] = []
            if hidden is not None:
                skip = (
                    [self.instruction(s.ids) for s in ordered]
                    if self.instruction is not None
                    else None
                    if self.include_prompt
                    else [s.skip for s in ordered]
                )
                pooled = self._pool(hidden, batch, seqlens, skip)
                rows.append(pooled.float().cpu().numpy())
                tokens_sorted = self._token_states(hidden, ordered)
            if pictures is not None:
                rows.append(pictures.float().cpu().numpy())
                tokens_sorted += [None] * pictures.shape[0]
            pooled_np = (
                np.concatenate(rows)
                if rows
                else np.zeros((0, self.model.hidden_size), dtype=np.float32)
            )
            pool_done = time.perf_counter()
        inverse = prepared.inverse
        return BatchOutput(
            pooled=pooled_np[inverse],
            tokens=[tokens_sorted[j] for j in inverse.tolist()],
            forward_s=forward_done - start,
            pool_s=pool_done - forward_done,
        )

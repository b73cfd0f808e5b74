"""The forward stage: token id lists in, pooled float32 vectors (and token states) out.

One call is one forward pass over a packed batch. The runner orders sequences by length
before packing (equal lengths become contiguous, so CPU attention runs on zero-copy views),
runs the model under ``torch.inference_mode``, pools and applies the batch-level part of the
pooling head (the sentence-transformers Dense layers) in float32, and restores the caller's
order. It is the only code that touches
the model, and it serializes calls with a lock, so the offline path and the scheduler's
forward thread can share one engine safely.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .attention import Backend
from .dtypes import fatal_device_error
from .errors import EngineFailedError
from .models.base import EmbeddingModel, PackedBatch
from .pooling import FloatArray, PoolingMethod, pool

logger = logging.getLogger(__name__)

# Below this many tokens a CPU forward pass runs on one thread: the matmuls are too small to
# split profitably, and on a busy host every OpenMP region would wait for a descheduled
# worker (measured: 2 short texts took 0.7 s on 2 threads under load, 25 ms on one).
SMALL_BATCH_TOKENS = 256


@dataclass(frozen=True, slots=True)
class SequenceInput:
    """One sequence of a batch."""

    ids: Sequence[int]
    skip: int = 0
    """Leading (prompt) tokens left out of pooling (every method but last)."""
    want_tokens: bool = False
    """Also return the per-token hidden states (``embed_tokens``)."""
    type_ids: Sequence[int] | None = None
    """Segment ids of a sentence pair (cross-encoders); None for all zeros."""


@dataclass(frozen=True, slots=True)
class BatchOutput:
    pooled: FloatArray  # [B, d], caller's order
    tokens: list[FloatArray | None]  # [len_i, hidden] where asked for
    forward_s: float
    pool_s: float


class BatchHead(Protocol):
    """The batch-level head after pooling: sentence-transformers Dense layers
    (:class:`~.pooling.PoolingHead`) or a classifier (:class:`~.heads.ClassificationHead`)."""

    def project(self, pooled: torch.Tensor) -> torch.Tensor: ...


class TokenPooler(Protocol):
    """Pools packed token states into one vector per sequence itself (SPLADE's head), in place
    of the pooling method and batch head."""

    def __call__(self, hidden: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor: ...


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
        cpu_threads: int = 1,
        attention: Backend = Backend.SDPA_BUCKETED,
        token_pooler: TokenPooler | None = None,
    ) -> None:
        self.model = model
        self.token_pooler = token_pooler
        self.device = device
        self.pooling = pooling
        self.include_prompt = include_prompt
        self.head = head
        self._lock = threading.Lock()
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
            return [SequenceInput([1] * max_len) for _ in range(n)]
        return [SequenceInput([1] * min(16, max_len)), SequenceInput([1] * min(7, max_len))]

    @staticmethod
    def _token_states(
        hidden: torch.Tensor, ordered: Sequence[SequenceInput]
    ) -> list[FloatArray | None]:
        """The per-token states of the sequences that asked for them, in one device-to-host
        copy (a copy per sequence would sync the GPU once per sequence)."""
        wanted = [s.want_tokens for s in ordered]
        if not any(wanted):
            return [None] * len(ordered)
        lengths = [len(s.ids) for s in ordered]
        if all(wanted):
            host = hidden.float().cpu().numpy()
        else:
            starts = np.cumsum([0, *lengths[:-1]])
            rows = np.concatenate(
                [np.arange(a, a + n) for a, n, w in zip(starts, lengths, wanted, strict=True) if w]
            )
            index = torch.from_numpy(rows).to(hidden.device)
            host = hidden.index_select(0, index).float().cpu().numpy()
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
        """One forward pass; thread-safe (serialized). After a fatal device error (a CUDA
        device-side assert, an illegal memory access) every call raises EngineFailedError:
        the context is poisoned, so the failure callbacks end the process instead of letting
        every later batch fail behind a green readiness probe."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        try:
            return self._run(seqs)
        except Exception as error:
            if not fatal_device_error(error):
                raise
            with self._lock:
                first = self.failure is None
                if first:
                    self.failure = f"the device failed: {type(error).__name__}: {error}"
            if first:
                logger.error("%s; the server cannot serve any more", self.failure)
                for callback in self._failure_callbacks:
                    callback(self.failure or "")
            raise EngineFailedError(self.failure or "the device failed") from error

    def _run(self, seqs: Sequence[SequenceInput]) -> BatchOutput:
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
        ordered = [seqs[i] for i in order]
        with self._lock, torch.inference_mode():
            start = time.perf_counter()
            if self.device.type == "cpu":
                total = sum(len(s.ids) for s in seqs)
                threads = 1 if total < SMALL_BATCH_TOKENS else self.cpu_threads
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
            batch = PackedBatch.build(
                [s.ids for s in ordered],
                self.device,
                self.model.position_offset,
                attention=self.attention,
                token_types=(
                    [s.type_ids or [0] * len(s.ids) for s in ordered]
                    if any(s.type_ids for s in ordered)
                    else None
                ),
            )
            hidden = self.model.forward(batch)
            if hidden.is_cuda:
                torch.cuda.synchronize(hidden.device)
            forward_done = time.perf_counter()
            skip = None if self.include_prompt else [s.skip for s in ordered]
            if self.token_pooler is not None:
                pooled = self.token_pooler(hidden, batch.seqlens)
            else:
                pooled = self.head.project(pool(hidden, batch.seqlens, self.pooling, skip))
            pooled_np = pooled.float().cpu().numpy()
            tokens_sorted = self._token_states(hidden, ordered)
            pool_done = time.perf_counter()
        inverse = np.empty(len(order), dtype=np.int64)
        inverse[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
        return BatchOutput(
            pooled=pooled_np[inverse],
            tokens=[tokens_sorted[j] for j in inverse.tolist()],
            forward_s=forward_done - start,
            pool_s=pool_done - forward_done,
        )

"""What every result is built from: a job's raw output, the usage and timings the HTTP layer
reports, and the value types results share (sparse vectors, ranked documents).

:class:`JobOutput` is what a job runner returns (pooled vectors before the per-request head,
token states, usage, stage timings); each task (:mod:`.tasks`) turns it into its own result
type, a :class:`Usage`, once the head has been applied. Kept apart from the tasks so the
runners can build it without importing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np
import numpy.typing as npt

from embedding_server.metrics import Metrics
from embedding_server.request.pooling import FloatArray
from embedding_server.request.truncation import TokenizedInput


@dataclass(frozen=True, slots=True)
class StageTimings:
    """Seconds one request spent per pipeline stage (TEI-style timing headers)."""

    tokenize: float = 0.0
    queue: float = 0.0
    forward: float = 0.0
    pool: float = 0.0

    @property
    def total(self) -> float:
        return self.tokenize + self.queue + self.forward + self.pool

    def to_dict(self) -> dict[str, float]:
        return {
            "tokenize": self.tokenize,
            "queue": self.queue,
            "forward": self.forward,
            "pool": self.pool,
        }


@dataclass(frozen=True, kw_only=True)
class Usage:
    """What every result reports beside its values: the tokens it cost, how many inputs
    were truncated, and the seconds each stage took."""

    prompt_tokens: int
    """Tokens run through the model (after truncation): the ``usage`` of the response."""
    truncated_inputs: int
    """How many inputs were truncated."""
    timings: StageTimings = field(default_factory=StageTimings)


class UsageFields(TypedDict):
    """:class:`Usage`'s fields, as keyword arguments of a result."""

    prompt_tokens: int
    truncated_inputs: int
    timings: StageTimings


def usage_of(source: Usage | JobOutput) -> UsageFields:
    """The usage of a job's output or of another result, for a result built from it."""
    return {
        "prompt_tokens": source.prompt_tokens,
        "truncated_inputs": source.truncated_inputs,
        "timings": source.timings,
    }


@dataclass(frozen=True, slots=True)
class SparseVector:
    """A sparse vector over the vocabulary: token ids with a non-zero weight, ascending."""

    indices: npt.NDArray[np.int64]
    values: FloatArray

    @classmethod
    def from_dense(cls, dense: FloatArray) -> SparseVector:
        indices = np.flatnonzero(dense).astype(np.int64)
        return cls(indices, dense[indices].astype(np.float32))

    def top(self, k: int | None) -> SparseVector:
        """The ``k`` largest weights (all when ``k`` is None or not smaller than the count),
        indices still ascending: sentence-transformers' ``max_active_dims``."""
        if k is None or len(self.values) <= k:
            return self
        keep = np.sort(np.argpartition(self.values, -k)[-k:])
        return SparseVector(self.indices[keep], self.values[keep])

    def to_dense(self, size: int) -> FloatArray:
        dense = np.zeros(size, dtype=np.float32)
        dense[self.indices] = self.values
        return dense


@dataclass(frozen=True, slots=True)
class Ranked:
    """One document of a rerank: its position in the request and its relevance."""

    index: int
    score: float


@dataclass(frozen=True)
class JobOutput:
    """A job's raw results: pooled vectors before the per-request head, token states where
    asked for, and usage."""

    tokenized: list[TokenizedInput]
    pooled: FloatArray
    tokens: list[FloatArray | None]
    timings: StageTimings

    @property
    def token_counts(self) -> list[int]:
        return [len(t.ids) for t in self.tokenized]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def truncated_inputs(self) -> int:
        return sum(t.truncated for t in self.tokenized)

    def record(self, metrics: Metrics) -> None:
        """Count the job's tokens and truncations and observe its stage timings."""
        metrics.input_tokens.inc(self.prompt_tokens)
        if self.truncated_inputs:
            metrics.truncated_inputs.inc(self.truncated_inputs)
        for stage, seconds in self.timings.to_dict().items():
            metrics.observe_stage(stage, seconds)

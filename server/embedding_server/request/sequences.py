"""What a forward pass takes and gives, per sequence: :class:`SequenceInput` in,
:class:`BatchOutput` out.

Kept apart from the runner, and free of torch, because these cross the process boundary of
``--api-workers``: the front-ends build the inputs and read the outputs, and never load the
model runtime (see ``ipc.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embedding_server.request.pooling import FloatArray


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
    adapter: int | None = None
    """Index of the task adapter the sequence runs (jina-embeddings-v3's task LoRA, in the
    model's ``lora_adaptations`` order); None for the base weights."""
    key_len: int | None = None
    """How many leading tokens the sequence's tokens may attend to (ColBERT's query
    augmentation: the ``[MASK]`` tokens padding a query are queries whose keys nothing
    sees); None: all of them."""
    pixels: FloatArray | None = None
    """A preprocessed image (``[3, height, width]`` float32, :class:`~.imaging.ImageInput`)
    for the model's vision tower; then ``ids`` are placeholders, one per token of the vision
    tower's sequence (what the image costs in admission and batching), and no other field
    applies. None for text."""


@dataclass(frozen=True, slots=True)
class BatchOutput:
    pooled: FloatArray  # [B, d], caller's order
    tokens: list[FloatArray | None]  # [len_i, hidden] where asked for
    forward_s: float
    pool_s: float

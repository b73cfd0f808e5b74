"""What every model implementation shares: the packed batch and the model protocol.

A ``PackedBatch`` is the flat layout of the design (input_ids[T], position_ids[T],
cu_seqlens[B+1], max_seqlen). Models turn it into final hidden states ``[T, hidden]``; pooling
is not their concern. Weights come from Hugging Face checkpoints through per-family name maps,
so no ``transformers`` model class is needed at run time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..attention import AttentionPlan, plan_attention
from ..errors import UnsupportedModelError


@dataclass(eq=False)
class PackedBatch:
    """All sequences of a forward pass concatenated, no padding."""

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarting at each sequence
    cu_seqlens: torch.Tensor  # [B+1] int32, on the model's device
    max_seqlen: int
    seqlens: tuple[int, ...]
    _plan: AttentionPlan | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls, sequences: Sequence[Sequence[int]], device: torch.device, position_offset: int = 0
    ) -> PackedBatch:
        """Pack token id lists; ``position_offset`` shifts positions (RoBERTa: padding_idx+1)."""
        seqlens = tuple(len(s) for s in sequences)
        flat = [t for s in sequences for t in s]
        input_ids = torch.tensor(flat, dtype=torch.int64)
        lens = torch.tensor(seqlens, dtype=torch.int64)
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        starts = torch.repeat_interleave(cu[:-1].to(torch.int64), lens)
        positions = torch.arange(len(flat), dtype=torch.int64) - starts + position_offset
        return cls(
            input_ids.to(device),
            positions.to(device),
            cu.to(device),
            max(seqlens, default=0),
            seqlens,
        )

    @property
    def attention_plan(self) -> AttentionPlan:
        """The CPU attention bucketing, built once and shared by all layers."""
        if self._plan is None:
            self._plan = plan_attention(self.seqlens, self.input_ids.device)
        return self._plan


class EmbeddingModel(Protocol):
    """A packed-token transformer body."""

    hidden_size: int
    causal: bool
    position_offset: int
    """Added to 0-based positions before the position embedding (RoBERTa: padding_idx + 1)."""
    max_positions: int
    """Longest sequence the position encoding supports."""
    sliding_window: int | None
    """The config's ``sliding_window`` when some layers attend only that far; else None."""

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` in the model dtype."""
        ...


def strip_prefix(
    weights: Mapping[str, torch.Tensor], prefixes: Sequence[str], marker: str
) -> dict[str, torch.Tensor]:
    """Remove the task-head prefix (``bert.``, ``model.`` ...) so names match the bare model.

    ``marker`` is a name every checkpoint of the family contains (e.g. ``embeddings.``); a
    prefix is stripped only if it precedes it.
    """
    for prefix in prefixes:
        if any(name.startswith(prefix + marker) for name in weights):
            return {
                name.removeprefix(prefix): t
                for name, t in weights.items()
                if name.startswith(prefix)
            }
    return dict(weights)


def take(
    weights: dict[str, torch.Tensor],
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    architecture: str,
) -> torch.Tensor:
    """Pop one weight, converted; a missing name means the checkpoint is not what it claims."""
    try:
        tensor = weights.pop(name)
    except KeyError:
        raise UnsupportedModelError(
            f"{architecture} checkpoint lacks the weight {name!r}; is it a complete "
            f"{architecture} model?"
        ) from None
    return tensor.to(device=device, dtype=dtype).contiguous()


def config_get(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """First present key among ``names`` (configs name the same thing differently)."""
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    return default

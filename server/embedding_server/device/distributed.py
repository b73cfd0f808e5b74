"""This process's place in a tensor-parallel group, as the model code sees it.

A model built for tensor parallelism holds one rank's share of the weights
(:class:`Shard` says which) and sums the partial outputs of its row-parallel projections
with :meth:`Shard.all_reduce`. That is the only collective inside a forward pass; the batch
plan reaches the other ranks once per batch, before the forward (``tensor_parallel.py``).
With ``size == 1`` (the default, and every single-process engine) nothing here touches
``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from embedding_server.errors import UnsupportedModelError


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks (``0`` of ``1``: no parallelism)."""

    rank: int = 0
    size: int = 1

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def split(self, total: int, what: str) -> slice:
        """This rank's contiguous ``1/size`` of ``total`` units (heads, MLP columns), or an
        error naming ``what`` and both numbers when ``size`` does not divide ``total``."""
        if total % self.size:
            raise UnsupportedModelError(
                f"tensor_parallel_size {self.size} does not divide {what} {total}; "
                f"use a size that divides it"
            )
        step = total // self.size
        return slice(self.rank * step, (self.rank + 1) * step)

    def chunk(self, total: int) -> slice:
        """This rank's contiguous share of ``total`` rows when they need not divide evenly
        (vocabularies): ``ceil(total / size)`` each, the last ranks possibly fewer."""
        step = -(-total // self.size)
        start = min(total, self.rank * step)
        return slice(start, min(total, start + step))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (a no-op on one rank)."""
        if self.parallel:
            dist.all_reduce(tensor)
        return tensor


SINGLE = Shard()
"""The whole model on one rank: what every engine without tensor parallelism builds."""

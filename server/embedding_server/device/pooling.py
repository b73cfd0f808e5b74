"""Pooling on the device: the methods over packed hidden states, and the Dense layers.

The request plane's half (method names, Matryoshka truncation, normalization) is
``embedding_server/request/pooling.py``; see its docstring for the composition (method x head)
and the methods' sentence-transformers semantics. What runs here, per batch in the forward worker:
:func:`pool` (one float32 vector per packed sequence) and :class:`DenseHead`
(sentence-transformers ``Dense`` modules), before the vectors leave the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import assert_never

import torch

from embedding_server.request.pooling import PoolingMethod


def pool(
    hidden: torch.Tensor,
    seqlens: Sequence[int],
    method: PoolingMethod,
    skip: Sequence[int] | None = None,
) -> torch.Tensor:
    """One float32 vector per packed sequence of ``hidden`` (``[sum(seqlens), hidden]``).

    ``skip[i]`` leading tokens of sequence i are the prompt, left out of pooling for models
    whose sentence-transformers config says ``include_prompt: false``. As in
    sentence-transformers, ``cls`` then takes the first token after the prompt, ``last`` is
    unaffected, and ``weightedmean`` keeps the remaining tokens' original position weights.
    A sequence that is all prompt (it can happen after truncation) keeps its last token for
    the token-wise reductions, so no vector is empty.
    """
    device = hidden.device
    count = len(seqlens)
    lens = torch.tensor(seqlens, dtype=torch.int64)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    prompt = torch.tensor(skip, dtype=torch.int64) if skip is not None else torch.zeros_like(lens)
    if method == "cls":
        first = starts + torch.where(prompt < lens, prompt.clamp(min=0), 0)
        return hidden.index_select(0, first.to(device)).float()
    if method == "last":
        return hidden.index_select(0, (ends - 1).to(device)).float()

    # Token-wise reductions: segment ids (and positions) of the kept tokens, then one
    # scatter over the packed tensor.
    dropped = prompt.clamp(min=0).minimum(lens - 1)
    segments = torch.repeat_interleave(torch.arange(count), lens)
    positions = torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)
    values = hidden
    if bool(dropped.any()):
        keep = positions >= torch.repeat_interleave(dropped, lens)
        values = hidden[keep.to(device)]
        segments, positions = segments[keep], positions[keep]
    kept = (lens - dropped).to(device=device, dtype=torch.float32).unsqueeze(1)
    segments = segments.to(device)
    width = hidden.shape[1]
    if method == "max":
        init = torch.full((count, width), float("-inf"), dtype=hidden.dtype, device=device)
        index = segments.unsqueeze(1).expand(-1, width)
        return init.scatter_reduce_(0, index, values, reduce="amax").float()
    sums = torch.zeros(count, width, dtype=torch.float32, device=device)
    if method == "weightedmean":
        weights = (positions + 1).to(device=device, dtype=torch.float32).unsqueeze(1)
        sums.index_add_(0, segments, values.float() * weights)
        # Sum of the kept weights: positions dropped+1 .. len, in closed form.
        total = (lens * (lens + 1) - dropped * (dropped + 1)) // 2
        return sums / total.to(device=device, dtype=torch.float32).unsqueeze(1)
    sums.index_add_(0, segments, values.float())
    if method == "mean":
        return sums / kept
    if method == "mean_sqrt_len":
        return sums / kept.sqrt()
    assert_never(method)


@functools.cache
def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The torch function of an activation in :data:`ACTIVATIONS`."""
    functions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "identity": lambda x: x,
        "tanh": torch.tanh,
        "relu": torch.relu,
        "gelu": torch.nn.functional.gelu,
        "sigmoid": torch.sigmoid,
        "silu": torch.nn.functional.silu,
    }
    return functions[name]


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers ``Dense`` module (``2_Dense``): activation(x W^T + b)."""

    weight: torch.Tensor  # [out, in] float32
    bias: torch.Tensor | None
    activation: str

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def to(self, device: torch.device) -> DenseLayer:
        bias = None if self.bias is None else self.bias.to(device)
        return DenseLayer(self.weight.to(device), bias, self.activation)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return activation(self.activation)(torch.nn.functional.linear(x, self.weight, self.bias))


@dataclass(frozen=True)
class DenseHead:
    """The sentence-transformers Dense layers of an embedder, in order (none: the identity):
    the batch-level part of the pooling head, applied to pooled vectors on the device."""

    layers: tuple[DenseLayer, ...] = ()

    def to(self, device: torch.device) -> DenseHead:
        return DenseHead(tuple(layer.to(device) for layer in self.layers))

    def out_features(self, hidden_size: int) -> int:
        """The width of the vectors it returns for a body of ``hidden_size``."""
        return self.layers[-1].out_features if self.layers else hidden_size

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            pooled = layer(pooled)
        return pooled

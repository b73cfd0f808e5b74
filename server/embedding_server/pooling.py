"""Pooling: from per-token hidden states to one float32 vector per input.

Composition as in vLLM: a *method* (over one packed sequence) and a *head* (float32 cast ->
optional sentence-transformers Dense layers -> Matryoshka truncation -> L2 normalization). The
method and Dense layers run inside the forward worker, per batch; the truncation and
normalization depend on the request (``dimensions``, ``normalize``) and run per request.
:class:`PoolingHead` holds the whole head, so it is defined in one place.

The methods are sentence-transformers' single pooling modes, with its semantics:

* ``cls``: the first token (``pooling_mode_cls_token``);
* ``last``: the last token (``pooling_mode_lasttoken``), for decoder-only embedders;
* ``mean``: the average of the tokens (``pooling_mode_mean_tokens``);
* ``max``: the element-wise maximum over the tokens (``pooling_mode_max_tokens``);
* ``weightedmean``: tokens weighted by their 1-based position in the sequence, so later tokens
  count more (``pooling_mode_weightedmean_tokens``, SGPT);
* ``mean_sqrt_len``: the token sum divided by the square root of the token count
  (``pooling_mode_mean_sqrt_len_tokens``).

sentence-transformers can also concatenate several modes into one longer vector; we serve one
method per model, and the loader refuses such configs rather than silently serving a
different vector (see ``loading.py``).

Matryoshka truncation renormalizes (when normalizing), like TEI and unlike Infinity: a
truncated unit vector is no longer unit length, and cosine-by-dot-product clients rely on it.
``dimensions`` is accepted only for models that declare Matryoshka training (or when the
operator says so through settings); anything else is an error naming the allowed values,
as vLLM does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, assert_never

import numpy as np
import numpy.typing as npt

from .errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

PoolingMethod = Literal["cls", "mean", "last", "max", "weightedmean", "mean_sqrt_len"]
POOLING_METHODS: tuple[PoolingMethod, ...] = (
    "cls",
    "mean",
    "last",
    "max",
    "weightedmean",
    "mean_sqrt_len",
)

FloatArray = npt.NDArray[np.float32]


def parse_pooling_method(name: str) -> PoolingMethod | None:
    """``name`` as a :data:`PoolingMethod`, or None when it is not one."""
    for method in POOLING_METHODS:
        if method == name:
            return method
    return None


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
    # Imported here, not at the top: front-end processes (``--api-workers``) use this module's
    # per-request head and never load torch.
    import torch

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


ACTIVATIONS = ("identity", "tanh", "relu", "gelu", "sigmoid", "silu")
"""The activations a head may declare, by name (:func:`activation`)."""


@functools.cache
def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The torch function of an activation in :data:`ACTIVATIONS`."""
    import torch  # see pool()

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
        from torch.nn.functional import linear  # see pool()

        return activation(self.activation)(linear(x, self.weight, self.bias))


@dataclass(frozen=True)
class Matryoshka:
    """Which output sizes a model may be truncated to.

    ``supported``: truncation is allowed at all. ``dimensions``: the allowed sizes, or
    ``None`` for any size up to ``full``. ``default``: the size returned when a request names
    none (``settings.dimensions``, else ``full``).
    """

    full: int
    supported: bool
    dimensions: tuple[int, ...] | None
    default: int

    def allowed(self) -> str:
        """Human-readable allowed values, for error messages and info()."""
        if not self.supported:
            return f"{self.full} (the model declares no Matryoshka support)"
        if self.dimensions is None:
            return f"any integer from 1 to {self.full}"
        return ", ".join(str(d) for d in self.dimensions)

    def resolve(self, requested: int | None) -> int:
        """The output size for a request's ``dimensions``; raises if not allowed."""
        if requested is None:
            return self.default
        if isinstance(requested, bool) or not isinstance(requested, int):
            raise InvalidRequestError(
                f"dimensions must be an integer, got {type(requested).__name__}", param="dimensions"
            )
        if requested == self.full or (
            self.supported
            and 1 <= requested <= self.full
            and (self.dimensions is None or requested in self.dimensions)
        ):
            return requested
        raise InvalidRequestError(
            f"dimensions={requested} is not supported by this model; allowed: {self.allowed()}",
            param="dimensions",
        )

    def to_list(self) -> list[int] | None:
        if not self.supported:
            return None
        return list(self.dimensions) if self.dimensions is not None else None


def build_matryoshka(
    full: int,
    *,
    declared: bool,
    declared_dims: Sequence[int] | None,
    override_dims: Sequence[int] | None,
    default_dims: int | None,
) -> Matryoshka:
    """Combine what the model declares with the operator's settings.

    Settings win: ``matryoshka_dimensions`` replaces the model's list, and a configured
    ``dimensions`` default is itself a statement that truncation is intended.
    """
    dims_source = override_dims if override_dims else declared_dims
    dims: tuple[int, ...] | None = None
    if dims_source:
        bad = [d for d in dims_source if not 1 <= d <= full]
        if bad:
            raise InvalidRequestError(
                f"matryoshka dimensions {bad} are outside 1..{full} (the model's output size)",
                param="matryoshka_dimensions",
            )
        dims = tuple(sorted(set(dims_source) | {full}))
    supported = declared or bool(dims_source) or default_dims is not None
    if default_dims is not None:
        if not 1 <= default_dims <= full:
            raise InvalidRequestError(
                f"dimensions={default_dims} is outside 1..{full} (the model's output size)",
                param="dimensions",
            )
        if dims is not None and default_dims not in dims:
            raise InvalidRequestError(
                f"dimensions={default_dims} is not one of the Matryoshka dimensions {list(dims)}",
                param="dimensions",
            )
    return Matryoshka(
        full=full,
        supported=supported,
        dimensions=dims,
        default=default_dims if default_dims is not None else full,
    )


def l2_normalize(vectors: FloatArray) -> FloatArray:
    """Each row scaled to unit length (float32; an all-zero row stays zero)."""
    out = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(out, axis=-1, keepdims=True)
    np.maximum(norms, 1e-12, out=norms)
    normalized: FloatArray = (out / norms).astype(np.float32, copy=False)
    return normalized


def finalize(vectors: FloatArray, *, dimensions: int, normalize: bool) -> FloatArray:
    """Per-request head: truncate to ``dimensions`` then L2-normalize (float32 throughout)."""
    out = vectors[:, :dimensions] if dimensions < vectors.shape[1] else vectors
    out = np.ascontiguousarray(out, dtype=np.float32)
    return l2_normalize(out) if normalize else out


@dataclass(frozen=True, slots=True)
class HeadOptions:
    """One request's choices for the per-request part of the head."""

    dimensions: int
    normalize: bool

    def apply(self, vectors: FloatArray) -> FloatArray:
        return finalize(vectors, dimensions=self.dimensions, normalize=self.normalize)


@dataclass(frozen=True)
class PoolingHead:
    """Everything after the pooling method, in order: Dense layers, Matryoshka truncation,
    L2 normalization.

    The Dense layers are the same for every request and run per batch in the forward worker
    (:meth:`project`); truncation and normalization depend on the request and run per request
    (:meth:`options`, then :meth:`HeadOptions.apply`). Per-token outputs (``/pooling``) skip
    Dense and truncation and are normalized only when asked (:meth:`finish_tokens`).
    """

    dense: tuple[DenseLayer, ...]
    matryoshka: Matryoshka
    normalize: bool
    """The default when a request does not say."""

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        """The sentence-transformers Dense layers over a batch of pooled vectors."""
        for layer in self.dense:
            pooled = layer(pooled)
        return pooled

    def options(self, dimensions: int | None, normalize: bool | None) -> HeadOptions:
        """Validate a request's ``dimensions`` / ``normalize`` against the model."""
        dims = self.matryoshka.resolve(dimensions)
        if normalize is not None and not isinstance(normalize, bool):
            raise InvalidRequestError("normalize must be a boolean", param="normalize")
        return HeadOptions(dims, self.normalize if normalize is None else normalize)

    @staticmethod
    def finish_tokens(matrices: Sequence[FloatArray], normalize: bool) -> list[FloatArray]:
        """Per-token hidden states, each token's vector normalized when asked."""
        return [l2_normalize(m) if normalize else m for m in matrices]

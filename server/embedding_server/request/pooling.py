"""Pooling: from per-token hidden states to one float32 vector per input.

Composition as in vLLM: a *method* (over one packed sequence) and a *head* (float32 cast ->
optional sentence-transformers Dense layers -> Matryoshka truncation -> L2 normalization). The
method and Dense layers run inside the forward worker, per batch; the truncation and
normalization depend on the request (``dimensions``, ``normalize``) and run per request.

This module is the request plane's half and imports no torch: the method names, Matryoshka
truncation and normalization (numpy), which front-end processes run per request. The half
that computes on the model's hidden states (the methods themselves, the Dense layers) is
``device/pooling.py``.

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from embedding_server.errors import InvalidRequestError

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


ACTIVATIONS = ("identity", "tanh", "relu", "gelu", "sigmoid", "silu")
"""The activations a head may declare, by name (``device.pooling.activation`` computes them)."""


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
    """The per-request part of the pooling head: Matryoshka truncation, then L2
    normalization.

    The Dense layers that come before them are the same for every request and run per batch
    on the device (``device.pooling.DenseHead``). :meth:`options` validates a request's
    choices, :meth:`HeadOptions.apply` runs them. Per-token outputs (``/pooling``) skip
    truncation and are normalized only when asked (:meth:`finish_tokens`).
    """

    matryoshka: Matryoshka
    normalize: bool
    """The default when a request does not say."""

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

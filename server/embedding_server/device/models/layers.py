"""Building blocks shared by the model families: norms, activations, rotary embeddings, the
reading of per-layer attention kinds, and the tensor-parallel split of heads and MLP columns.

They live here rather than in the first family that needed them so that a family module
imports only shared code, never a sibling family, and so that a new architecture starts from
these pieces instead of copying them. Each follows the transformers implementation it
replaces (dtype of each step included), because the models are verified against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.distributed import Shard
from embedding_server.errors import UnsupportedModelError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

ACT_FUNCS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}
"""transformers' ``hidden_act`` names -> torch functions."""


def activation(
    config: Mapping[str, Any], model_type: str, *keys: str, default: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation the config names under the first present of ``keys``, or an error."""
    name = str(next((config[k] for k in keys if config.get(k) is not None), default))
    if name not in ACT_FUNCS:
        raise UnsupportedModelError(
            f"{model_type} activation {name!r} is not supported; supported: {sorted(ACT_FUNCS)}"
        )
    return ACT_FUNCS[name]


def attention_shape(config: Mapping[str, Any], name: str) -> tuple[int, int, int, float]:
    """``(hidden_size, num_heads, head_dim, scale)`` of an encoder whose heads split its
    width evenly (scale ``1 / sqrt(head_dim)``); a width the heads do not divide is refused,
    naming the family (``name``)."""
    hidden_size = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    if hidden_size % num_heads:
        raise UnsupportedModelError(
            f"{name} hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"
        )
    head_dim = hidden_size // num_heads
    return hidden_size, num_heads, head_dim, 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True)
class HeadSplit:
    """Which attention heads and MLP columns one tensor-parallel rank holds (Megatron-style).

    The q/k/v and up/gate projections are column-parallel: each rank computes its heads and
    its slice of the MLP's intermediate features. The output and down projections are
    row-parallel: each rank multiplies its slice and :func:`row_linear` sums the partial
    results, so the residual stream (and everything outside attention and the MLP) stays
    whole on every rank. Key/value heads split like query heads; when there are fewer of
    them than ranks and the rank count is a multiple of theirs, each is replicated on the
    ranks whose query heads read it. On one rank every slice is the whole.
    """

    heads: int
    """Query heads on this rank."""
    kv_heads: int
    """Key/value heads on this rank."""
    head_dim: int
    q: slice
    """Rows of the query projection (and columns of the output projection) on this rank."""
    kv: slice
    """Rows of the key projection, and of the value projection, on this rank."""
    mlp: slice
    """Intermediate features (rows of up/gate, columns of down) on this rank."""

    @classmethod
    def of(
        cls,
        shard: Shard,
        model_type: str,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
    ) -> HeadSplit:
        """The split of a model's heads and MLP, or an error naming the numbers that do not
        divide."""
        q = shard.split(heads, f"{model_type} num_attention_heads")
        if kv_heads % shard.size == 0:
            kv_local = kv_heads // shard.size
            first = shard.rank * kv_local
        elif shard.size % kv_heads == 0:
            kv_local, first = 1, shard.rank // (shard.size // kv_heads)  # replicated
        else:
            raise UnsupportedModelError(
                f"tensor_parallel_size {shard.size} does not divide {model_type} "
                f"num_key_value_heads {kv_heads}, nor is it a multiple of it; use a size "
                f"that divides {kv_heads} or a multiple of {kv_heads} that divides {heads}"
            )
        mlp = shard.split(intermediate, f"{model_type} intermediate_size")
        return cls(
            heads=heads // shard.size,
            kv_heads=kv_local,
            head_dim=head_dim,
            q=slice(q.start * head_dim, q.stop * head_dim),
            kv=slice(first * head_dim, (first + kv_local) * head_dim),
            mlp=mlp,
        )


class VocabEmbedding:
    """A token embedding table, split by vocabulary rows over the tensor-parallel ranks.

    Each rank looks up the ids in its rows and writes zeros for the others; an all-reduce
    sums the one non-zero row each token has. Token embeddings are a large part of an
    embedder's weights (half of all-MiniLM-L6-v2's, several percent of a 7B decoder's), so a
    replicated table would leave every rank far above 1/N of the model, for the price of
    one all-reduce per forward pass. On one rank it is a plain lookup.

    Lookups here and in the families use ``index_select``, not ``weight[ids]``: torch's
    advanced indexing costs several times as much on the CPU for the same gather
    (docs/performance-log.md, "Advanced indexing in the embedding lookups").
    """

    def __init__(self, weight: torch.Tensor, rows: slice, shard: Shard) -> None:
        self.weight, self.start, self.shard = weight, rows.start, shard

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.shard.parallel:
            return self.weight.index_select(0, ids)
        count = self.weight.shape[0]
        local = ids - self.start
        outside = (local < 0) | (local >= count)
        if count == 0:
            out = self.weight.new_zeros(ids.shape[0], self.weight.shape[1])
        else:
            out = self.weight.index_select(0, local.clamp(0, count - 1))
            out.masked_fill_(outside.unsqueeze(1), 0)
        return self.shard.all_reduce(out)


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shard: Shard
) -> torch.Tensor:
    """A row-parallel projection: this rank's partial product, summed over the ranks, then
    the (replicated) bias added once."""
    if not shard.parallel:
        return F.linear(x, weight, bias)
    out = shard.all_reduce(F.linear(x, weight))
    return out if bias is None else out + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as Hugging Face's Llama implementation."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalize and multiply by ``scale`` (= 1 + weight, float32) in float32,
    then cast back (Llama's casts first)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * scale).to(x.dtype)


def layer_types(
    config: Mapping[str, Any], model_type: str, legacy: Callable[[int], Sequence[bool]]
) -> list[str]:
    """Each layer's attention kind (:data:`FULL_ATTENTION` or :data:`SLIDING_ATTENTION`).

    From the config's ``layer_types`` (transformers >= 4.5x writes it), refusing a list that
    does not name each layer as one of the two; configs written before it get
    ``legacy(num_layers)``, the family's older rule (True = sliding).
    """
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        return [SLIDING_ATTENTION if slides else FULL_ATTENTION for slides in legacy(layers)]
    kinds = [str(t) for t in types]
    if len(kinds) != layers or set(kinds) - set(LAYER_TYPES):
        raise UnsupportedModelError(
            f"{model_type} layer_types must name each of the {layers} layers as one "
            f"of {', '.join(LAYER_TYPES)}; got {list(types)!r}"
        )
    return kinds


def layer_rope(
    config: Mapping[str, Any], kind: str, *, theta: float, scaled: bool
) -> dict[str, Any]:
    """The rope of one layer kind in models whose kinds differ (Gemma 3, ModernBERT):
    ``rope_parameters[kind]`` (transformers >= 5) when present, else the default rope with the
    family's legacy ``theta``; ``scaled`` applies a top-level ``rope_scaling``."""
    nested = config.get("rope_parameters") or {}
    params: dict[str, Any] = dict(nested.get(kind) or {"rope_type": "default"})
    if scaled:
        params.update(config.get("rope_scaling") or {})
    if params.get("rope_theta") is None:
        params["rope_theta"] = float(theta)
    return params


def model_rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope of models with one rope for all layers (Llama and kin): transformers >= 5
    nests ``rope_theta`` and the scaling in ``rope_parameters``; older configs keep
    ``rope_theta`` / ``rope_scaling`` at top level."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    return {**scaling, "rope_theta": theta}


def rope_inv_freq(params: Mapping[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse rotary frequencies of flat rope ``params`` (``rope_theta``, ``rope_type`` and
    its keys), including the scalings published embedders use."""
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(
        f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3"
    )


class RotaryTable:
    """cos/sin of the rotary embedding per position, in the model dtype, grown on demand.

    Computed in float32 from ``inv_freq`` and cast, as transformers does for each forward.
    """

    def __init__(self, inv_freq: torch.Tensor, *, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = inv_freq.to(device)
        self.dtype, self.device = dtype, device
        dim = 2 * inv_freq.shape[0]
        self._cos = torch.empty(0, dim, dtype=dtype, device=device)
        self._sin = torch.empty(0, dim, dtype=dtype, device=device)

    @classmethod
    def of(
        cls, params: Mapping[str, Any], head_dim: int, *, dtype: torch.dtype, device: torch.device
    ) -> RotaryTable:
        """The table of flat rope ``params`` (see :func:`rope_inv_freq`)."""
        return cls(rope_inv_freq(params, head_dim), dtype=dtype, device=device)

    def lookup(
        self, positions: torch.Tensor, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` for ``positions`` (all ``<= max_position``), ``[T, 1, head_dim]``."""
        if self._cos.shape[0] <= max_position:
            size = max(2 * self._cos.shape[0], max_position + 1, 512)
            freqs = torch.outer(
                torch.arange(size, device=self.device, dtype=torch.float32), self.inv_freq.float()
            )
            emb = torch.cat([freqs, freqs], dim=-1)
            self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        cos, sin = self._cos.index_select(0, positions), self._sin.index_select(0, positions)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's pairing: ``[-x2, x1]`` for the halves ``x1``, ``x2``."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(
    x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], *, float32: bool = False
) -> torch.Tensor:
    """RoPE: ``x * cos + rotate_half(x) * sin``; with ``float32`` computed in float32 and cast
    back (ModernBERT's half-precision path)."""
    cos, sin = rope
    h = x.float() if float32 else x
    return (h * cos + rotate_half(h) * sin).to(x.dtype)


def relative_position_buckets(
    relative: torch.Tensor, *, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bidirectional relative-position buckets of ``relative`` = key position - query
    position (MPNet computes the same): half the buckets for keys after the query, half for
    keys before; in each half, distances below a quarter of ``num_buckets`` get a bucket each
    and longer ones share logarithmically wider buckets up to ``max_distance``. In float32
    and int64 exactly as transformers computes it, so every pair lands where it does there."""
    half = num_buckets // 2
    buckets = (relative > 0).to(torch.long) * half
    distance = relative.abs()
    exact = half // 2
    large = exact + (
        torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)
    ).to(torch.long)
    large = torch.minimum(large, torch.full_like(large, half - 1))
    return buckets + torch.where(distance < exact, distance, large)

"""ModernBERT encoders on packed tokens.

Covers ModernBERT-base/large and the embedders fine-tuned from them (gte-modernbert,
modernbert-embed, ...). Pre-LayerNorm blocks (LayerNorms without bias unless ``norm_bias``),
no position embeddings but rotary ones, a fused ``Wqkv`` projection, a GeGLU MLP (``Wi``
yields input and gate halves), and a final LayerNorm. Layer 0 has no attention norm: the
embedding LayerNorm already normalized its input.

Attention alternates: every ``global_attn_every_n_layers``-th layer (0, n, 2n, ...) attends
globally with ``global_rope_theta``; the others attend only to a local band with
``local_rope_theta``. Configs written by transformers >= 5 name each layer in ``layer_types``
and put the thetas in ``rope_parameters`` keyed by layer type; Hub configs written before
keep the scalar keys. Both are read here, as transformers reads them.

``local_attention`` is the band's *total* width: transformers masks query ``i`` to keys
``|i - j| <= local_attention // 2`` (both its eager/SDPA mask and flash-attn's
``window_size``), which is ``window = local_attention // 2`` in ``varlen_attention``'s
each-side convention. Inputs no longer than that + 1 cannot tell the difference.

transformers 4.x ModernBERT unpadded batches itself on its flash-attn path (the same
``cu_seqlens`` layout this server packs), so the packed forward here is also upstream's own
fast path; padding never reaches the math in either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.heads import ClassificationHead, HeadWeights
from embedding_server.device.models.base import Checkpoint, Ignored, PackedBatch
from embedding_server.device.models.layers import FULL_ATTENTION as _FULL
from embedding_server.device.models.layers import SLIDING_ATTENTION as _SLIDING
from embedding_server.device.models.layers import (
    HeadSplit,
    RotaryTable,
    activation,
    apply_rotary,
    attention_shape,
    layer_rope,
    row_linear,
)
from embedding_server.device.models.layers import layer_types as read_layer_types
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.pooling import ACTIVATIONS, PoolingMethod

# Defaults of transformers' ModernBertConfig for keys config.json may omit.
_DEFAULT_GLOBAL_EVERY = 3
_DEFAULT_LOCAL_ATTENTION = 128
_DEFAULT_THETA = {_FULL: 160_000.0, _SLIDING: 10_000.0}


IGNORED = (
    Ignored(
        r"head\.(?:dense|norm)\.(?:weight|bias)|decoder\.(?:weight|bias)",
        "the masked-LM head of ModernBertForMaskedLM (its transform and vocabulary "
        "decoder): embeddings read the final hidden states, SPLADE is not served for "
        "ModernBERT, and only a *ForSequenceClassification head reads head.*",
    ),
)
"""What ModernBERT checkpoints carry and the body does not read."""


@dataclass
class _Layer:
    kind: str  # _FULL or _SLIDING: picks the rotary table
    window: int | None  # varlen_attention's each-side window; None = global attention
    attn_norm_w: torch.Tensor | None  # None on layer 0 (Identity in transformers)
    attn_norm_b: torch.Tensor | None
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    out_w: torch.Tensor
    out_b: torch.Tensor | None
    mlp_norm_w: torch.Tensor
    mlp_norm_b: torch.Tensor | None
    wi_w: torch.Tensor
    wi_b: torch.Tensor | None
    wo_w: torch.Tensor
    wo_b: torch.Tensor | None


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's attention kind, from ``layer_types`` or ``global_attn_every_n_layers``."""
    every = int(config.get("global_attn_every_n_layers", _DEFAULT_GLOBAL_EVERY))
    if config.get("layer_types") is None and every < 1:
        raise UnsupportedModelError(
            f"modernbert global_attn_every_n_layers must be >= 1, got {every}"
        )
    return read_layer_types(config, "modernbert", lambda n: [i % every != 0 for i in range(n)])


def local_window(config: Mapping[str, Any]) -> int:
    """The each-side window of local layers: ``local_attention // 2``, as transformers."""
    total = int(config.get("local_attention", _DEFAULT_LOCAL_ATTENTION))
    if total < 0:
        raise UnsupportedModelError(f"modernbert local_attention must be >= 0, got {total}")
    return total // 2


def rope_parameters(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """One layer kind's rotary parameters (``rope_type``, ``rope_theta``, scaling keys).

    ``rope_parameters[kind]`` when present (transformers >= 5); otherwise the scalar
    ``global_rope_theta`` / ``local_rope_theta`` (an explicit null local theta means the
    global one, as transformers 4.x read it), with any ``rope_scaling`` applied to both.
    """
    global_theta = config.get("global_rope_theta")
    if global_theta is None:
        global_theta = _DEFAULT_THETA[_FULL]
    if kind == _FULL:
        theta = global_theta
    elif "local_rope_theta" in config:
        theta = config["local_rope_theta"]
        theta = global_theta if theta is None else theta
    else:
        theta = _DEFAULT_THETA[_SLIDING]
    return layer_rope(config, kind, theta=float(theta), scaled=True)


class ModernBertModel:
    """A ModernBERT encoder body for packed batches (bidirectional)."""

    causal = False
    position_offset = 0

    def __init__(self, checkpoint: Checkpoint) -> None:
        config, dtype, device = checkpoint.config, checkpoint.dtype, checkpoint.device
        self._act: Callable[[torch.Tensor], torch.Tensor] = activation(
            config, "modernbert", "hidden_activation", default="gelu"
        )
        self.hidden_size, self.num_heads, self.head_dim, self.scale = attention_shape(
            config, "modernbert"
        )
        self.eps = float(config.get("norm_eps", 1e-5))
        self.shard = checkpoint.shard
        self.split = split = HeadSplit.of(
            checkpoint.shard,
            "modernbert",
            heads=self.num_heads,
            kv_heads=self.num_heads,
            head_dim=self.head_dim,
            intermediate=int(config["intermediate_size"]),
        )
        self.max_positions = int(config.get("max_position_embeddings", 8192))
        self.dtype, self.device = dtype, device
        kinds = layer_types(config)
        window = local_window(config)
        self.sliding_window = window if _SLIDING in kinds else None
        self.rotary = {
            kind: RotaryTable.of(
                rope_parameters(config, kind), self.head_dim, dtype=dtype, device=device
            )
            for kind in set(kinds)
        }
        norm_bias = bool(config.get("norm_bias", False))
        attn_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False))

        # ModernBertForMaskedLM / ForSequenceClassification checkpoints nest the body under
        # ``model.``; ModernBertModel ones (and sentence-transformers saves) do not.
        w = checkpoint.reader(
            prefixes=("model.",),
            marker="embeddings.",
            architecture="modernbert",
        )
        get, maybe = w.get, w.maybe

        self.tok_emb = w.embedding("embeddings.tok_embeddings.weight")
        self.emb_norm_w = get("embeddings.norm.weight")
        self.emb_norm_b = maybe("embeddings.norm.bias", norm_bias)
        self.layers: list[_Layer] = []
        for i, kind in enumerate(kinds):
            p = f"layers.{i}."
            first = i == 0
            self.layers.append(
                _Layer(
                    kind=kind,
                    window=window if kind == _SLIDING else None,
                    attn_norm_w=None if first else get(p + "attn_norm.weight"),
                    attn_norm_b=None if first else maybe(p + "attn_norm.bias", norm_bias),
                    qkv_w=w.rows(p + "attn.Wqkv.weight", split.q, blocks=3),
                    qkv_b=w.rows(p + "attn.Wqkv.bias", split.q, blocks=3) if attn_bias else None,
                    out_w=w.columns(p + "attn.Wo.weight", split.q),
                    out_b=maybe(p + "attn.Wo.bias", attn_bias),
                    mlp_norm_w=get(p + "mlp_norm.weight"),
                    mlp_norm_b=maybe(p + "mlp_norm.bias", norm_bias),
                    # Wi fuses the input and gate halves: each rank keeps its slice of both.
                    wi_w=w.rows(p + "mlp.Wi.weight", split.mlp, blocks=2),
                    wi_b=w.rows(p + "mlp.Wi.bias", split.mlp, blocks=2) if mlp_bias else None,
                    wo_w=w.columns(p + "mlp.Wo.weight", split.mlp),
                    wo_b=maybe(p + "mlp.Wo.bias", mlp_bias),
                )
            )
        self.final_norm_w = get("final_norm.weight")
        self.final_norm_b = maybe("final_norm.bias", norm_bias)

    def _norm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), weight, bias, self.eps)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        t = batch.input_ids.shape[0]
        heads, d, shard = self.split.heads, self.head_dim, self.shard
        rotary = {
            kind: table.lookup(batch.position_ids, batch.max_seqlen)
            for kind, table in self.rotary.items()
        }
        x = self._norm(self.tok_emb(batch.input_ids), self.emb_norm_w, self.emb_norm_b)
        for layer in self.layers:
            a = x  # layer 0's attention norm is the identity
            if layer.attn_norm_w is not None:
                a = self._norm(x, layer.attn_norm_w, layer.attn_norm_b)
            qkv = F.linear(a, layer.qkv_w, layer.qkv_b).view(t, 3, heads, d)
            q, k, v = qkv.unbind(1)
            # RoPE in float32, cast back: what transformers' ModernBERT does in half precision.
            rope = rotary[layer.kind]
            q, k = apply_rotary(q, rope, float32=True), apply_rotary(k, rope, float32=True)
            attn = batch.attention(q, k, v, causal=False, scale=self.scale, window=layer.window)
            x = x + row_linear(attn.reshape(t, heads * d), layer.out_w, layer.out_b, shard)
            m = self._norm(x, layer.mlp_norm_w, layer.mlp_norm_b)
            inp, gate = F.linear(m, layer.wi_w, layer.wi_b).chunk(2, dim=-1)
            x = x + row_linear(self._act(inp) * gate, layer.wo_w, layer.wo_b, shard)
        return self._norm(x, self.final_norm_w, self.final_norm_b)


def classification_head(
    w: HeadWeights, per_token: bool
) -> tuple[ClassificationHead, PoolingMethod]:
    """ModernBERT's head (``head.dense`` + activation + ``head.norm``, then ``classifier``),
    token classifiers included; a sequence classifier pools as ``classifier_pooling`` says."""
    config = w.config
    act = str(config.get("classifier_activation") or config.get("hidden_activation") or "gelu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"ModernBERT classifier_activation {act!r} is not supported")
    head = ClassificationHead.read(
        w,
        "classifier.",
        "head.dense.",
        "head.norm.",
        pooler_activation=act,
        norm_eps=float(config.get("norm_eps", 1e-5)),
    )
    pooled = str(config.get("classifier_pooling", "cls"))
    if pooled not in ("cls", "mean"):
        raise UnsupportedModelError(
            f"ModernBERT classifier_pooling {pooled!r} is not supported (cls or mean)"
        )
    return head, "cls" if pooled == "cls" else "mean"

"""The post-LayerNorm encoder block, once for the BERT-likes: BERT (and DistilBERT, ERNIE,
ELECTRA, RoBERTa, XLM-R), MPNet, DeBERTa-v2, jina-embeddings-v3 and GTE.

Each layer of theirs is ::

    x = LayerNorm(x + out(attention(qkv(x))))
    x = LayerNorm(x + down(mlp(x)))

with q/k/v fused into one projection, ``out`` and ``down`` row-parallel (summed over the
tensor-parallel ranks), and ``mlp`` the up projection and its activation. What the families
differ in is around that loop, and is passed to it or overridden on the layer: an additive
term on the attention logits (MPNet's relative-position bias, DeBERTa's disentangled terms),
rotary positions on q and k (GTE, jina-embeddings-v3), a gated MLP (GTE:
:class:`GatedPostLnLayer`), task LoRA on every projection (jina-embeddings-v3 overrides the
four projections). Each family reads its own weights, under its own names
(:meth:`PostLnLayer.read` for the usual ones), and builds its own embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F

from embedding_server.device.attention import AttentionBias
from embedding_server.device.distributed import Shard
from embedding_server.device.models.base import Checkpoint, PackedBatch, WeightReader
from embedding_server.device.models.layers import (
    HeadSplit,
    activation,
    apply_rotary,
    attention_shape,
    row_linear,
)

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class PostLnLayer:
    """One post-LayerNorm block's weights, this rank's share: fused q/k/v and the attention
    output with their biases, LayerNorm, the two MLP projections, LayerNorm.

    The four projections are methods so that a family can change one (a gated MLP, LoRA)
    and keep the block; ``mask`` is what a LoRA layer selects each token's adapter by, and
    the plain projections ignore it."""

    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    up_w: torch.Tensor
    up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor

    @classmethod
    def read(
        cls,
        w: WeightReader,
        p: str,
        split: HeadSplit,
        qkv: tuple[torch.Tensor, torch.Tensor],
        *,
        out: str = "attention.output.dense.",
        ln1: str = "attention.output.LayerNorm.",
        **extra: Any,
    ) -> Self:
        """Layer ``p``'s block under BERT's names (``out`` and ``ln1`` where a family names
        them otherwise), around its fused ``qkv`` weight and bias; ``extra``: a subclass's
        fields."""
        get = w.get
        return cls(
            qkv_w=qkv[0],
            qkv_b=qkv[1],
            out_w=w.columns(p + out + "weight", split.q),
            out_b=get(p + out + "bias"),
            ln1_w=get(p + ln1 + "weight"),
            ln1_b=get(p + ln1 + "bias"),
            up_w=w.rows(p + "intermediate.dense.weight", split.mlp),
            up_b=w.rows(p + "intermediate.dense.bias", split.mlp),
            down_w=w.columns(p + "output.dense.weight", split.mlp),
            down_b=get(p + "output.dense.bias"),
            ln2_w=get(p + "output.LayerNorm.weight"),
            ln2_b=get(p + "output.LayerNorm.bias"),
            **extra,
        )

    def qkv(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``[T, 3 * heads * head_dim]``: this rank's queries, keys and values."""
        return F.linear(x, self.qkv_w, self.qkv_b)

    def out(self, x: torch.Tensor, mask: torch.Tensor | None, shard: Shard) -> torch.Tensor:
        """The attention output projection, summed over the ranks."""
        return row_linear(x, self.out_w, self.out_b, shard)

    def mlp(self, x: torch.Tensor, act: Activation, mask: torch.Tensor | None) -> torch.Tensor:
        """This rank's intermediate features, activated."""
        return act(F.linear(x, self.up_w, self.up_b))

    def down(self, x: torch.Tensor, mask: torch.Tensor | None, shard: Shard) -> torch.Tensor:
        """The MLP's down projection, summed over the ranks."""
        return row_linear(x, self.down_w, self.down_b, shard)


@dataclass
class GatedPostLnLayer(PostLnLayer):
    """A block whose MLP is gated (GTE): ``up_w`` holds this rank's up rows, then its gate
    rows, with no bias, and the features are ``act(gate) * up``."""

    def mlp(self, x: torch.Tensor, act: Activation, mask: torch.Tensor | None) -> torch.Tensor:
        up, gate = F.linear(x, self.up_w).chunk(2, dim=-1)
        return act(gate) * up


class PostLnEncoder:
    """What a post-LayerNorm encoder body shares: its sizes, read by
    :meth:`_read_sizes`, and the block (:meth:`_block`) its ``forward`` runs per layer."""

    causal = False
    sliding_window: int | None = None
    position_offset = 0

    hidden_size: int
    num_heads: int
    head_dim: int
    scale: float
    eps: float
    shard: Shard
    split: HeadSplit
    _act: Activation

    def _read_sizes(
        self, checkpoint: Checkpoint, model_type: str, *, eps: float, even: bool = False
    ) -> HeadSplit:
        """The activation (``hidden_act``), the width, heads, head size (``hidden_size //
        num_attention_heads``) and scale (``1 / sqrt(head_dim)``), the LayerNorm epsilon
        (``layer_norm_eps``, else ``eps``), and this rank's :class:`HeadSplit`, which it
        returns. ``even``: refuse a width the heads do not divide (:func:`attention_shape`)."""
        config: Mapping[str, Any] = checkpoint.config
        self._act = activation(config, model_type, "hidden_act", default="gelu")
        if even:
            self.hidden_size, self.num_heads, self.head_dim, self.scale = attention_shape(
                config, model_type
            )
        else:
            self.hidden_size = int(config["hidden_size"])
            self.num_heads = int(config["num_attention_heads"])
            self.head_dim = self.hidden_size // self.num_heads
            self.scale = 1.0 / math.sqrt(self.head_dim)
        self.eps = float(config.get("layer_norm_eps", eps))
        self.shard = checkpoint.shard
        self.split = HeadSplit.of(
            checkpoint.shard,
            model_type,
            heads=self.num_heads,
            kv_heads=self.num_heads,
            head_dim=self.head_dim,
            intermediate=int(config["intermediate_size"]),
        )
        return self.split

    def _block(
        self,
        x: torch.Tensor,
        layer: PostLnLayer,
        batch: PackedBatch,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        bias: AttentionBias | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer on the packed states ``x`` ``[T, hidden]``: ``rope`` the rotary
        ``cos``/``sin`` applied to q and k, ``bias`` the attention's additive term, ``mask``
        the LoRA adapter mask (see :class:`PostLnLayer`)."""
        t = x.shape[0]
        h, heads, d, shard = self.hidden_size, self.split.heads, self.head_dim, self.shard
        q, k, v = layer.qkv(x, mask).view(t, 3, heads, d).unbind(1)
        if rope is not None:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        attn = batch.attention(q, k, v, causal=False, scale=self.scale, bias=bias)
        a = layer.out(attn.reshape(t, heads * d), mask, shard)
        x = F.layer_norm(a + x, (h,), layer.ln1_w, layer.ln1_b, self.eps)
        m = layer.down(layer.mlp(x, self._act, mask), mask, shard)
        return F.layer_norm(m + x, (h,), layer.ln2_w, layer.ln2_b, self.eps)

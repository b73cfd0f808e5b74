"""JinaBERT (jina-embeddings-v2) on packed tokens: ALiBi positions and a GeGLU MLP.

jinaai/jina-embeddings-v2-small-en, -base-en, -base-de, -base-es, -base-zh and -base-code
ship ``model_type: bert`` with ``position_embedding_type: alibi`` and an ``auto_map`` to
jina's own code (``JinaBertModel``), which is not run: this module serves them. The body is
BERT's post-LayerNorm encoder (the same embedding LayerNorm, q/k/v, ``attention.output``
and segment ids, read by BERT's names) with three changes:

* **No position table.** Every head adds ``-slope_h * |i - j|`` to its logits (symmetric
  ALiBi), with the ALiBi paper's slopes (:func:`alibi_slopes`, the published code's
  ``_get_alibi_head_slopes``, including its rule for head counts that are not a power of
  2). flash-attn adds it itself (``alibi_slopes``); the SDPA kernels get it as a float
  mask (:class:`~..attention.AlibiBias`); torch_varlen cannot, and is passed over.
* **A gated MLP**, two published layouts, told apart by their weight names:

  - jina-bert-implementation (the ``-en``/``-de``/``-es``/``-zh`` models):
    ``mlp.gated_layers`` (``[gate; up]``, ``2 * intermediate_size`` rows, no bias), then
    ``act(gate) * up``, ``mlp.wo`` and ``mlp.layernorm`` over the residual sum.
  - jina-bert-v2-qk-post-norm (``-base-code``): ``mlp.up_gated_layer`` (``[up; gate]``, no
    bias), ``up * act(gate)``, ``mlp.down_layer``; the attention block's output goes
    through a second LayerNorm with the layer input (``layer_norm_1``), the MLP's through
    ``layer_norm_2``; and the query and key projections are each LayerNormed over all heads
    (``attention.self.layer_norm_q`` / ``_k``) before attention.

  The activation is named by ``feed_forward_type`` (``geglu``: exact GELU, ``reglu``: ReLU),
  as the published code reads it; ``hidden_act`` is not what it uses.
* **Mean pooling** (the config's ``emb_pooler: mean``, which the registry reads).

What the published code cannot compute the same way here is refused by name
(:func:`check_config`): other position types, a non-gated MLP. The code variant's q/k
LayerNorm spans all heads, so it is refused under tensor parallelism rather than computed on
a rank's share of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.attention import AlibiBias
from embedding_server.device.models.base import (
    Checkpoint,
    EmbeddingModel,
    PackedBatch,
    WeightReader,
)
from embedding_server.device.models.bert import BERT, LEGACY_NAMES, BertModel, _read_qkv, renames
from embedding_server.device.models.layers import ACT_FUNCS, HeadSplit, attention_shape, row_linear
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.pooling import PoolingMethod

MODEL_TYPE = "bert"
ALIBI = "alibi"
_ACTIVATIONS = {"geglu": "gelu", "reglu": "relu"}
"""``feed_forward_type`` -> the gate's activation (the published code's nn.GELU / nn.ReLU)."""


def uses_alibi(config: Mapping[str, Any]) -> bool:
    """Whether a ``bert`` config is JinaBERT's (ALiBi positions)."""
    return config.get("position_embedding_type") == ALIBI


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, before any weight is fetched, a ``bert`` config whose positions or MLP this
    server does not compute as its authors do."""
    kind = config.get("position_embedding_type", "absolute")
    if kind not in ("absolute", ALIBI):
        raise UnsupportedModelError(
            f"{MODEL_TYPE} with position_embedding_type={kind!r} is not supported (absolute "
            "and alibi are)"
        )
    if kind == ALIBI:
        _gate_activation(config)


def declared_pooling(config: Mapping[str, Any]) -> PoolingMethod | None:
    """JinaBERT's ``emb_pooler: mean``: what jina's ``encode`` pools with."""
    if uses_alibi(config) and config.get("emb_pooler") == "mean":
        return "mean"
    return None


def _gate_activation(config: Mapping[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gate's activation ``feed_forward_type`` names. A config without one is refused:
    jina's config classes disagree on its default (the published jina-embeddings-v2 configs
    all state ``geglu``), so it is not guessed."""
    kind = config.get("feed_forward_type")
    if kind is None:
        raise UnsupportedModelError(
            f"JinaBERT ({MODEL_TYPE} with ALiBi) config.json states no feed_forward_type; "
            "jina's code defaults it differently across versions, so which MLP the weights "
            "were trained with is not guessed: add the one the model was trained with "
            "(geglu for jina-embeddings-v2)"
        )
    if kind not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"JinaBERT ({MODEL_TYPE} with ALiBi) feed_forward_type={kind!r} is not supported; "
            f"supported: {', '.join(sorted(_ACTIVATIONS))} (the gated MLPs of "
            "jina-embeddings-v2)"
        )
    return ACT_FUNCS[_ACTIVATIONS[str(kind)]]


def build(checkpoint: Checkpoint) -> EmbeddingModel:
    """The ``bert`` entry's builder: JinaBERT for ALiBi configs, BERT for the others."""
    if uses_alibi(checkpoint.config):
        return JinaBertModel(checkpoint)
    return BertModel(checkpoint, BERT)


def alibi_slopes(heads: int) -> list[float]:
    """The ALiBi paper's per-head slopes: for ``2**a`` heads the geometric sequence starting
    at and with ratio ``2 ** (-8 / heads)``; otherwise those of the largest power of two
    below ``heads``, then every other slope of twice that power, as many as are missing."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_2(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: heads - closest]


@dataclass
class _Layer:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    mlp_w: torch.Tensor  # this rank's rows of the fused gated projection, in the file's order
    down_w: torch.Tensor
    down_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    # The code variant (jina-bert-v2-qk-post-norm) only:
    q_norm: tuple[torch.Tensor, torch.Tensor] | None = None
    k_norm: tuple[torch.Tensor, torch.Tensor] | None = None
    post_attention_norm: tuple[torch.Tensor, torch.Tensor] | None = None


class JinaBertModel:
    """A JinaBERT v2 encoder body for packed batches (bidirectional, ALiBi)."""

    causal = False
    position_offset = 0
    sliding_window: int | None = None

    def __init__(self, checkpoint: Checkpoint) -> None:
        config = checkpoint.config
        check_config(config)
        self._act = _gate_activation(config)
        self.hidden_size, self.num_heads, self.head_dim, self.scale = attention_shape(
            config, "JinaBERT"
        )
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        # ALiBi has no table to run past; the config's length is the one it was trained for.
        self.max_positions = int(config.get("max_position_embeddings", 512))
        self.shard = shard = checkpoint.shard
        self.split = split = HeadSplit.of(
            shard,
            "JinaBERT",
            heads=self.num_heads,
            kv_heads=self.num_heads,
            head_dim=self.head_dim,
            intermediate=int(config["intermediate_size"]),
        )
        first = split.q.start // self.head_dim
        slopes = alibi_slopes(self.num_heads)[first : first + split.heads]
        self.alibi = AlibiBias(torch.tensor(slopes, dtype=torch.float32, device=checkpoint.device))

        w = checkpoint.reader(prefixes=BERT.prefixes, marker="embeddings.", architecture="JinaBERT")
        w.rename(renames(*LEGACY_NAMES))
        get = w.get
        self.word_emb = w.embedding("embeddings.word_embeddings.weight")
        self.type_emb: torch.Tensor | None = None
        if "embeddings.token_type_embeddings.weight" in w:
            self.type_emb = get("embeddings.token_type_embeddings.weight")
        self.emb_ln_w = get("embeddings.LayerNorm.weight")
        self.emb_ln_b = get("embeddings.LayerNorm.bias")

        self.code = "encoder.layer.0.mlp.up_gated_layer.weight" in w
        if not self.code and "encoder.layer.0.mlp.gated_layers.weight" not in w:
            raise UnsupportedModelError(
                "bert config with position_embedding_type alibi (JinaBERT), but the "
                "checkpoint has neither jina-embeddings-v2's gated MLP "
                "(encoder.layer.N.mlp.gated_layers) nor the code model's "
                "(encoder.layer.N.mlp.up_gated_layer); no other MLP is served with ALiBi"
            )
        if self.code and shard.parallel:
            raise UnsupportedModelError(
                "JinaBERT's code variant (jina-embeddings-v2-base-code) normalizes its query "
                "and key projections over all heads together (layer_norm_q / layer_norm_k), "
                "which a rank holding some of the heads cannot compute alone; serve it with "
                "tensor_parallel_size 1"
            )
        self.layers = [
            self._read_layer(w, i, split) for i in range(int(config["num_hidden_layers"]))
        ]

    def _read_layer(self, w: WeightReader, i: int, split: HeadSplit) -> _Layer:
        get = w.get
        p = f"encoder.layer.{i}."
        qkv_w, qkv_b = _read_qkv(w, p, split)

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(name + ".weight"), get(name + ".bias")

        mlp, down = ("up_gated_layer", "down_layer") if self.code else ("gated_layers", "wo")
        ln2 = "layer_norm_2" if self.code else "mlp.layernorm"
        ln2_w, ln2_b = norm(p + ln2)
        return _Layer(
            qkv_w=qkv_w,
            qkv_b=qkv_b,
            out_w=w.columns(p + "attention.output.dense.weight", split.q),
            out_b=get(p + "attention.output.dense.bias"),
            ln1_w=get(p + "attention.output.LayerNorm.weight"),
            ln1_b=get(p + "attention.output.LayerNorm.bias"),
            mlp_w=w.rows(p + f"mlp.{mlp}.weight", split.mlp, blocks=2),
            down_w=w.columns(p + f"mlp.{down}.weight", split.mlp),
            down_b=get(p + f"mlp.{down}.bias"),
            ln2_w=ln2_w,
            ln2_b=ln2_b,
            q_norm=norm(p + "attention.self.layer_norm_q") if self.code else None,
            k_norm=norm(p + "attention.self.layer_norm_k") if self.code else None,
            post_attention_norm=norm(p + "layer_norm_1") if self.code else None,
        )

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), weight, bias, self.eps)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        t = batch.input_ids.shape[0]
        heads, d, shard = self.split.heads, self.head_dim, self.shard
        x = self.word_emb(batch.input_ids)
        if self.type_emb is not None:
            if batch.token_type_ids is not None:
                x = x + self.type_emb.index_select(0, batch.token_type_ids)  # a pair's 2nd text
            else:
                x = x + self.type_emb[0]
        x = self._norm(x, self.emb_ln_w, self.emb_ln_b)
        for layer in self.layers:
            q, k, v = F.linear(x, layer.qkv_w, layer.qkv_b).chunk(3, dim=-1)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self._norm(q, *layer.q_norm), self._norm(k, *layer.k_norm)
            attn = batch.attention(
                q.reshape(t, heads, d),
                k.reshape(t, heads, d),
                v.reshape(t, heads, d),
                causal=False,
                scale=self.scale,
                bias=self.alibi,
            )
            a = row_linear(attn.reshape(t, heads * d), layer.out_w, layer.out_b, shard)
            h = self._norm(a + x, layer.ln1_w, layer.ln1_b)
            if layer.post_attention_norm is not None:
                h = self._norm(h + x, *layer.post_attention_norm)
            first, second = F.linear(h, layer.mlp_w).chunk(2, dim=-1)
            # v2: [gate; up] -> act(gate) * up; the code model: [up; gate] -> up * act(gate).
            inner = first * self._act(second) if self.code else self._act(first) * second
            x = self._norm(
                row_linear(inner, layer.down_w, layer.down_b, shard) + h, layer.ln2_w, layer.ln2_b
            )
        return x

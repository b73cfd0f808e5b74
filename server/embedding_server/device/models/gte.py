"""Alibaba GTE "new" encoders on packed tokens (``model_type: new``, and Snowflake's ``gte``).

Covers Alibaba-NLP/gte-multilingual-base, gte-base/large-en-v1.5, NovaSearch/stella_en_400M_v5,
Snowflake/snowflake-arctic-embed-m-v2.0 (all run by the Hub's Alibaba-NLP/new-impl code) and the
mGTE reranker (``NewForSequenceClassification``). transformers >= 5 ships the same math as
``model_type: gte`` (``GteModel``), which is the reference the tests compare against; its
``save_pretrained`` writes the Hub's weight names back.

Post-LayerNorm blocks like BERT's, but: no position table, NeoX-style rotary positions
instead; q/k/v fused in ``attention.qkv_proj`` (with bias); a gated MLP whose fused
``mlp.up_gate_proj`` (no bias) holds the up half, then the gate half, computing
``act(gate) * up`` before ``mlp.down_proj`` (with bias); ``attn_ln`` and ``mlp_ln`` after each
residual. Token-type embeddings exist only where ``type_vocab_size > 0`` (gte-base-en-v1.5 has
none).

Rotary frequencies come from the config as each reader of it computes them:

* Hub configs (new-impl's ``NewConfig``, Snowflake's ``gte`` too) keep ``rope_theta`` and
  ``rope_scaling: {type: ntk, factor}`` at top level. new-impl's ``NTKScalingRotaryEmbedding``
  applies that scaling from the first position, not only past ``max_position_embeddings``:
  its constructor builds the cache for ``factor * max_position_embeddings`` positions, which
  replaces the frequencies with the scaled ones (base ``theta * factor``, every frequency
  divided by ``factor ** (2 / head_dim)``); vLLM's ``ntk`` rope computes the same. A
  ``mixed_b`` (its per-dimension variant) is refused: no published checkpoint sets it and
  nothing here verifies it.
* transformers >= 5 configs (``rope_parameters``) use transformers' rope types; its
  ``dynamic`` NTK changes the frequencies only for inputs longer than
  ``max_position_embeddings``, which the server never runs (inputs are capped there), so it
  is the default rope here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.heads import ClassificationHead, HeadWeights
from embedding_server.device.models.base import Checkpoint, Ignored, PackedBatch
from embedding_server.device.models.layers import RotaryTable, rope_inv_freq
from embedding_server.device.models.post_ln import GatedPostLnLayer, PostLnEncoder
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.pooling import PoolingMethod

PREFIXES = ("new.", "gte.")
"""Where task heads nest the body: ``new.`` on the Hub (new-impl), ``gte.`` in transformers."""

_PREFIX = r"(?:(?:new|gte)\.)?"

IGNORED = (
    Ignored(
        _PREFIX + r"pooler\.dense\.(?:weight|bias)",
        "the pooler (dense + tanh over the first token): embeddings pool the final hidden "
        "states; only NewForSequenceClassification's head reads it",
    ),
    Ignored(
        r"lm_head\.(?:dense|norm|layer_norm|decoder)\.(?:weight|bias)",
        "the masked-LM head of NewForMaskedLM: SPLADE is not served for GTE, embeddings read "
        "the final hidden states",
    ),
    Ignored(
        _PREFIX + r"embeddings\.(?:position_ids|token_type_ids)",
        "index buffers some saves carry; positions and segment ids come from the packed batch",
    ),
)
"""What GTE checkpoints carry and the body does not read."""

_DEFAULT_THETA = {"new": 10_000.0, "gte": 160_000.0}
"""``rope_theta`` when a config omits it: new-impl's ``NewConfig`` and transformers'
``GteConfig`` defaults."""


def _refuse_unserved(config: Mapping[str, Any], model_type: str) -> None:
    """Refuse new-impl options that change the math and are not implemented here."""
    position = config.get("position_embedding_type", "rope")
    if position != "rope":
        raise UnsupportedModelError(
            f"{model_type} position_embedding_type={position!r} is not supported natively "
            "(only rope, what every published GTE checkpoint uses)"
        )
    norm = config.get("layer_norm_type", "layer_norm")
    if norm != "layer_norm":
        raise UnsupportedModelError(
            f"{model_type} layer_norm_type={norm!r} is not supported natively (only "
            "layer_norm, what every published GTE checkpoint uses)"
        )
    for key in ("logn_attention_scale", "logn_attention_clip1"):
        if config.get(key):
            raise UnsupportedModelError(
                f"{model_type} {key}: true is not supported natively: it rescales the "
                "queries by each input's length, which is not implemented here; published "
                "GTE checkpoints set it false"
            )
    if config.get("pack_qkv") is False:
        raise UnsupportedModelError(
            f"{model_type} pack_qkv: false (separate q/k/v projections) is not supported "
            "natively; published GTE checkpoints fuse them in attention.qkv_proj"
        )


def rope_frequencies(config: Mapping[str, Any], model_type: str, head_dim: int) -> torch.Tensor:
    """The inverse rotary frequencies the config implies (see the module docstring)."""
    native = config.get("rope_parameters")
    if native:
        params = dict(native)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "dynamic":
            original = params.get("original_max_position_embeddings")
            if original is not None and int(original) < int(config["max_position_embeddings"]):
                raise UnsupportedModelError(
                    f"{model_type} dynamic rope with original_max_position_embeddings="
                    f"{original} below max_position_embeddings is not supported natively"
                )
            params["rope_type"] = "default"  # identical up to max_position_embeddings
        params.setdefault("rope_theta", _DEFAULT_THETA.get(model_type, 160_000.0))
        return rope_inv_freq(params, head_dim)
    theta = float(config.get("rope_theta") or _DEFAULT_THETA.get(model_type, 10_000.0))
    scaling = config.get("rope_scaling")
    if not scaling:
        return rope_inv_freq({"rope_theta": theta}, head_dim)
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind != "ntk":
        raise UnsupportedModelError(
            f"{model_type} rope_scaling type {kind!r} is not supported natively (only ntk, as "
            "new-impl reads it)"
        )
    if scaling.get("mixed_b") is not None:
        raise UnsupportedModelError(
            f"{model_type} rope_scaling mixed_b={scaling['mixed_b']!r} (mixed NTK scaling) is "
            "not supported natively; only the fixed ntk scaling is"
        )
    factor = float(scaling["factor"])
    if factor < 1.0:
        raise UnsupportedModelError(
            f"{model_type} rope_scaling factor {factor} below 1 is not supported natively"
        )
    if factor == 1.0:
        return rope_inv_freq({"rope_theta": theta}, head_dim)
    # new-impl's fixed NTK: a larger base, then every frequency divided by factor^(2/dim).
    scaled = rope_inv_freq({"rope_theta": theta * factor}, head_dim)
    return scaled / float(factor ** (2 / head_dim))


class GteModel(PostLnEncoder):
    """A GTE ("new") encoder body for packed batches (bidirectional)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        config, dtype, device = checkpoint.config, checkpoint.dtype, checkpoint.device
        model_type = str(config.get("model_type", "new"))
        _refuse_unserved(config, model_type)
        split = self._read_sizes(checkpoint, model_type, eps=1e-12, even=True)
        self.max_positions = int(config.get("max_position_embeddings", 8192))
        self.rotary = RotaryTable(
            rope_frequencies(config, model_type, self.head_dim), dtype=dtype, device=device
        )

        w = checkpoint.reader(prefixes=PREFIXES, marker="embeddings.", architecture=model_type)
        get = w.get
        self.word_emb = w.embedding("embeddings.word_embeddings.weight")
        self.type_emb: torch.Tensor | None = None
        if int(config.get("type_vocab_size", 0) or 0) > 0:
            self.type_emb = get("embeddings.token_type_embeddings.weight")
        self.emb_ln_w = get("embeddings.LayerNorm.weight")
        self.emb_ln_b = get("embeddings.LayerNorm.bias")
        self.layers: list[GatedPostLnLayer] = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            self.layers.append(
                GatedPostLnLayer(
                    qkv_w=w.rows(p + "attention.qkv_proj.weight", split.q, blocks=3),
                    qkv_b=w.rows(p + "attention.qkv_proj.bias", split.q, blocks=3),
                    out_w=w.columns(p + "attention.o_proj.weight", split.q),
                    out_b=get(p + "attention.o_proj.bias"),
                    ln1_w=get(p + "attn_ln.weight"),
                    ln1_b=get(p + "attn_ln.bias"),
                    up_w=w.rows(p + "mlp.up_gate_proj.weight", split.mlp, blocks=2),
                    up_b=None,
                    down_w=w.columns(p + "mlp.down_proj.weight", split.mlp),
                    down_b=get(p + "mlp.down_proj.bias"),
                    ln2_w=get(p + "mlp_ln.weight"),
                    ln2_b=get(p + "mlp_ln.bias"),
                )
            )

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        """The normalized word (+ segment) embeddings ``[T, hidden]``."""
        x = self.word_emb(batch.input_ids)
        if self.type_emb is not None:
            # One row (gte-multilingual's type_vocab_size 1): every token reads it. Its XLM-R
            # tokenizer gives a pair's second text type 0 as well; a tokenizer that said 1
            # would index past the table (a device-side assert on a GPU), not change the math.
            if batch.token_type_ids is not None and self.type_emb.shape[0] > 1:
                x = x + self.type_emb.index_select(0, batch.token_type_ids)
            else:
                x = x + self.type_emb[0]
        return F.layer_norm(x, (self.hidden_size,), self.emb_ln_w, self.emb_ln_b, self.eps)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        rope = self.rotary.lookup(batch.position_ids, batch.max_seqlen)
        x = self.embed(batch)
        for layer in self.layers:
            x = self._block(x, layer, batch, rope=rope)
        return x


def classification_head(
    w: HeadWeights, per_token: bool
) -> tuple[ClassificationHead, PoolingMethod]:
    """``NewForSequenceClassification``: the pooler (dense + tanh over the first token), then
    ``classifier``; ``NewForTokenClassification``: ``classifier`` on every token."""
    out = ClassificationHead.read(w, "classifier.")
    if per_token:
        return out, "cls"
    pooler = next((p for p in (*PREFIXES, "") if p + "pooler.dense.weight" in w), None)
    if pooler is None:
        raise UnsupportedModelError(
            f"{w.architecture} checkpoint lacks its pooler (new.pooler.dense.*), which its "
            "sequence classifier reads; is it complete?"
        )
    head = ClassificationHead(
        weight=out.weight,
        bias=out.bias,
        pooler_weight=w.get(pooler + "pooler.dense.weight"),
        pooler_bias=w.maybe(pooler + "pooler.dense.bias"),
    )
    return head, "cls"

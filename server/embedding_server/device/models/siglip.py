"""SigLIP (``model_type: siglip``, ``SiglipModel``): google/siglip-* and the SigLIP 2 "FixRes"
checkpoints (google/siglip2-base-patch16-224 ...), which ship ``model_type: siglip``.

Text: token + learned position embeddings, pre-LayerNorm blocks with full (non-causal)
attention (``vision.PreLnStack``), ``final_layer_norm``, then the vector is the LAST
position's state through ``head`` (a Linear with bias). SigLIP was trained, and its processor
is documented to be called, with every text padded to ``max_length`` (the text config's
``max_position_embeddings``, 64) and no attention mask: the padding tokens are attended to,
and the last position is a padding token whose state has read the whole text. So the tower
does that padding itself: each packed sequence is padded with ``pad_token_id`` to
``max_position_embeddings`` and run with full attention, and the served vector equals
``get_text_features(**processor(text, padding="max_length"))``. An unpadded sequence would
give another vector (one the model never saw in training). The tower's output puts that
pooled vector on every token row of its sequence, so any pooling method gives it (``last``,
the registry's default, is the one that means it); per-token states are not served.

Vision (``encode_images``): a stride-``patch_size`` convolution (with bias), learned position
embeddings (no class token), the blocks, ``post_layernorm``, then the multihead-attention
pooling head: a learned ``probe`` query attends over the tokens (``torch.nn.MultiheadAttention``
weights ``in_proj_*``, ``out_proj``), then ``x + mlp(layernorm(x))``: ``get_image_features``.

``logit_scale`` and ``logit_bias`` (the sigmoid loss's temperature and bias) are read by
nothing: they turn similarities into probabilities in training, not the vectors.

SigLIP 2's NaFlex checkpoints (``model_type: siglip2``: variable resolution, patches made by
the processor) are refused in the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.errors import UnsupportedModelError

from ..attention import Backend
from .base import Checkpoint, Ignored, PackedBatch, refuse_beyond_table
from .vision import (
    PreLnStack,
    check_images,
    image_batch,
    patch_tokens,
    refuse_parallel,
    text_config,
    vision_config,
)

MODEL_TYPE = "siglip"

IGNORED = (
    Ignored(
        r"logit_(?:scale|bias)",
        "the sigmoid loss's temperature and bias: they turn image-text similarities into "
        "probabilities in training, not the embeddings",
    ),
    Ignored(
        r"(?:text|vision)_model\.embeddings\.position_ids",
        "an index buffer some saves carry; positions come from the packed batch",
    ),
)

NAFLEX_REFUSAL = (
    "model_type 'siglip2' (Siglip2Model, SigLIP 2 NaFlex: variable-resolution images "
    "patchified by the processor) is not served yet. The SigLIP 2 FixRes checkpoints "
    "(google/siglip2-base-patch16-224 and the other fixed-resolution ones, model_type "
    "'siglip') are served natively"
)


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, from config.json alone, what this implementation does not serve."""
    text_config(config, MODEL_TYPE)
    vision = vision_config(config, MODEL_TYPE)
    if vision.get("vision_use_head", True) is False:
        raise UnsupportedModelError(
            "siglip vision_config.vision_use_head is false: the vision tower has no pooling "
            "head, and get_image_features has no pooled vector to serve"
        )


class SiglipModel:
    """SigLIP's text tower (padded to its trained length, pooled by ``head``) on packed
    tokens, and its vision tower."""

    causal: bool = False
    position_offset: int = 0
    sliding_window: int | None = None

    def __init__(self, ckpt: Checkpoint) -> None:
        refuse_parallel(ckpt.shard.parallel, MODEL_TYPE)
        config = ckpt.config
        check_config(config)
        text, vision = text_config(config, MODEL_TYPE), vision_config(config, MODEL_TYPE)
        r = ckpt.reader(prefixes=(), marker="text_model.", architecture="SigLIP")
        # Text tower.
        self.token_embedding = r.embedding("text_model.embeddings.token_embedding.weight")
        self.text_positions = r.get("text_model.embeddings.position_embedding.weight")
        self.max_positions = int(text.get("max_position_embeddings", 64))
        refuse_beyond_table(
            "SigLIP",
            "text_config.max_position_embeddings",
            self.max_positions,
            self.text_positions.shape[0],
            "text_model.embeddings.position_embedding.weight",
        )
        self.pad_id = int(text.get("pad_token_id", 1))
        self.text = PreLnStack(
            r, "text_model.", text, "siglip text", default_act="gelu_pytorch_tanh"
        )
        self.final_ln = (
            r.get("text_model.final_layer_norm.weight"),
            r.get("text_model.final_layer_norm.bias"),
        )
        self.text_head = (r.get("text_model.head.weight"), r.get("text_model.head.bias"))
        self.hidden_size = int(self.text_head[0].shape[0])
        # Vision tower.
        self.patch = int(vision.get("patch_size", 16))
        self.image_size = int(vision.get("image_size", 224))
        self.image_tokens = (self.image_size // self.patch) ** 2
        self.patch_w = r.get("vision_model.embeddings.patch_embedding.weight")
        self.patch_b = r.get("vision_model.embeddings.patch_embedding.bias")
        self.image_positions = r.get("vision_model.embeddings.position_embedding.weight")
        if self.image_positions.shape[0] != self.image_tokens:
            raise UnsupportedModelError(
                f"siglip vision position table has {self.image_positions.shape[0]} rows, but "
                f"image_size {self.image_size} / patch_size {self.patch} makes "
                f"{self.image_tokens} patches; the config does not match its weights"
            )
        self.vision = PreLnStack(
            r, "vision_model.", vision, "siglip vision", default_act="gelu_pytorch_tanh"
        )
        self.post_ln = (
            r.get("vision_model.post_layernorm.weight"),
            r.get("vision_model.post_layernorm.bias"),
        )
        h = "vision_model.head."
        self.probe = r.get(h + "probe")
        self.pool_in = (r.get(h + "attention.in_proj_weight"), r.get(h + "attention.in_proj_bias"))
        self.pool_out = (
            r.get(h + "attention.out_proj.weight"),
            r.get(h + "attention.out_proj.bias"),
        )
        self.pool_ln = (r.get(h + "layernorm.weight"), r.get(h + "layernorm.bias"))
        self.pool_mlp = (
            r.get(h + "mlp.fc1.weight"),
            r.get(h + "mlp.fc1.bias"),
            r.get(h + "mlp.fc2.weight"),
            r.get(h + "mlp.fc2.bias"),
        )
        if self.pool_out[0].shape[0] != self.hidden_size:
            raise UnsupportedModelError(
                "siglip text head and vision tower give different widths "
                f"({self.hidden_size} and {self.pool_out[0].shape[0]})"
            )

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Each sequence padded to ``max_position_embeddings`` and run with full attention;
        its pooled, projected vector (get_text_features) on each of its rows ``[T, dim]``."""
        lengths = batch.seqlens
        width = self.max_positions
        if max(lengths, default=0) > width:
            raise ValueError(f"siglip texts are at most {width} tokens; got {max(lengths)}")
        count = len(lengths)
        device = batch.input_ids.device
        lens = torch.tensor(lengths, dtype=torch.int64, device=device)
        starts = torch.repeat_interleave(torch.arange(count, device=device) * width, lens)
        padded_ids = torch.full((count * width,), self.pad_id, dtype=torch.int64, device=device)
        padded_ids[starts + batch.position_ids] = batch.input_ids
        positions = torch.arange(width, device=device).repeat(count)
        padded = PackedBatch.of(
            padded_ids, positions, [width] * count, attention=batch.attention_backend
        )
        h = self.token_embedding(padded_ids) + self.text_positions.index_select(0, positions)
        h = self.text(h, padded, causal=False)
        last = h.reshape(count, width, -1)[:, -1]
        pooled = F.linear(self.text.norm(last, *self.final_ln), *self.text_head)
        return pooled.repeat_interleave(lens, dim=0)

    def encode_images(self, pixels: torch.Tensor, attention: Backend) -> torch.Tensor:
        """get_image_features of ``pixels`` ``[N, 3, H, W]``: ``[N, dim]``."""
        check_images(pixels, self.image_size, MODEL_TYPE)
        count, tokens = pixels.shape[0], self.image_tokens
        h = patch_tokens(pixels, self.patch_w, self.patch_b, self.patch) + self.image_positions
        batch = image_batch(count, tokens, pixels.device, attention)
        h = self.vision(h.reshape(count * tokens, -1), batch, causal=False)
        h = self.vision.norm(h, *self.post_ln).reshape(count, tokens, -1)
        return self._attention_pool(h)

    def _attention_pool(self, h: torch.Tensor) -> torch.Tensor:
        """SiglipMultiheadAttentionPoolingHead: the probe attends over each image's tokens."""
        count, _, width = h.shape
        heads, head_dim = self.vision.heads, self.vision.head_dim
        w_q, w_k, w_v = self.pool_in[0].chunk(3)
        b_q, b_k, b_v = self.pool_in[1].chunk(3)
        q = F.linear(self.probe.reshape(1, width), w_q, b_q)  # [1, width]
        k, v = F.linear(h, w_k, b_k), F.linear(h, w_v, b_v)  # [N, S, width]
        q = q.reshape(1, 1, heads, head_dim).transpose(1, 2).expand(count, -1, -1, -1)
        k = k.reshape(count, -1, heads, head_dim).transpose(1, 2)
        v = v.reshape(count, -1, heads, head_dim).transpose(1, 2)
        ctx = F.scaled_dot_product_attention(q, k, v)  # [N, heads, 1, head_dim]
        x = F.linear(ctx.transpose(1, 2).reshape(count, width), *self.pool_out)
        fc1_w, fc1_b, fc2_w, fc2_b = self.pool_mlp
        y = self.vision.norm(x, *self.pool_ln)
        return x + F.linear(self.vision.act(F.linear(y, fc1_w, fc1_b)), fc2_w, fc2_b)


def build(ckpt: Checkpoint) -> SiglipModel:
    """The SigLIP builder of the registry."""
    return SiglipModel(ckpt)

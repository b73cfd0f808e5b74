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

SigLIP 2 NaFlex (``model_type: siglip2``, ``Siglip2Model``, :class:`Siglip2Model`): the same
text tower; images keep their aspect ratio at a variable number of patches. The processor
resizes an image to ``[3, h * patch, w * patch]`` (at most ``max_num_patches`` patches);
the tower cuts it into patches exactly as Siglip2ImageProcessor's
``convert_image_to_patches`` lays them out (row-major patches, each flattened as
``(patch_row, patch_col, channel)``), embeds them with a Linear, and adds the position table
resized to ``h x w`` as transformers resizes it (bilinear with antialiasing, its own
float32 formula). The images of a batch are packed as variable-length sequences
(``cu_seqlens``), not padded: attention and the pooling head see each image's own patches,
as transformers' ``pixel_attention_mask`` makes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.attention import Backend
from embedding_server.device.models.base import (
    Checkpoint,
    Ignored,
    PackedBatch,
    refuse_beyond_table,
)
from embedding_server.device.models.vision import (
    PreLnStack,
    image_batch,
    patch_tokens,
    refuse_parallel,
    stack_images,
    text_config,
    vision_config,
)
from embedding_server.errors import UnsupportedModelError

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

NAFLEX_MODEL_TYPE = "siglip2"

DEFAULT_MAX_PATCHES = 256
"""Siglip2ImageProcessor's default ``max_num_patches``."""


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
    token_states = False
    """The rows ``forward`` returns are the pooled vector, not per-token states: the runner
    refuses requests for token states (``embed_tokens``) instead of returning copies."""

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
        self.patch_w = r.get("vision_model.embeddings.patch_embedding.weight")
        self.patch_b = r.get("vision_model.embeddings.patch_embedding.bias")
        self.image_positions = r.get("vision_model.embeddings.position_embedding.weight")
        self._image_shape(ckpt, vision)
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

    def _image_shape(self, ckpt: Checkpoint, vision: Mapping[str, Any]) -> None:
        """The fixed resolution and its patch count, checked against the position table."""
        self.image_size = int(vision.get("image_size", 224))
        self.image_tokens = (self.image_size // self.patch) ** 2
        if self.image_positions.shape[0] != self.image_tokens:
            raise UnsupportedModelError(
                f"siglip vision position table has {self.image_positions.shape[0]} rows, but "
                f"image_size {self.image_size} / patch_size {self.patch} makes "
                f"{self.image_tokens} patches; the config does not match its weights"
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

    def encode_images(self, images: Sequence[torch.Tensor], attention: Backend) -> torch.Tensor:
        """get_image_features of ``images`` (each ``[3, H, W]``): ``[N, dim]``."""
        pixels = stack_images(images, self.image_size, MODEL_TYPE)
        count, tokens = pixels.shape[0], self.image_tokens
        h = patch_tokens(pixels, self.patch_w, self.patch_b, self.patch) + self.image_positions
        batch = image_batch(count, tokens, pixels.device, attention)
        h = self.vision(h.reshape(count * tokens, -1), batch, causal=False)
        h = self.vision.norm(h, *self.post_ln).reshape(count, tokens, -1)
        return self._attention_pool(h)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """post_layernorm, then the attention-pooling head, over one image's tokens
        ``[S, width]`` (or a stack ``[N, S, width]``)."""
        h = self.vision.norm(h, *self.post_ln)
        return self._attention_pool(h if h.dim() == 3 else h[None])

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


class Siglip2Model(SiglipModel):
    """SigLIP 2 NaFlex: SigLIP's towers with variable-resolution, packed images."""

    def _image_shape(self, ckpt: Checkpoint, vision: Mapping[str, Any]) -> None:
        positions = int(self.image_positions.shape[0])
        self.grid = math.isqrt(positions)
        if self.grid**2 != positions or self.patch_w.dim() != 2:
            raise UnsupportedModelError(
                f"siglip2 vision tower: a square position table and a Linear patch embedding "
                f"are expected (NaFlex); got {positions} positions and a patch embedding of "
                f"shape {tuple(self.patch_w.shape)}"
            )
        self.image_tokens = int(ckpt.config.get("max_num_patches") or DEFAULT_MAX_PATCHES)
        side = math.isqrt(self.image_tokens)
        self.image_size = side * self.patch  # a square image of (at most) max_num_patches

    def encode_images(self, images: Sequence[torch.Tensor], attention: Backend) -> torch.Tensor:
        """get_image_features of ``images`` (each ``[3, h * patch, w * patch]``, sizes may
        differ), packed: ``[N, dim]``."""
        p = self.patch
        table = self.image_positions.reshape(self.grid, self.grid, -1)
        embedded: list[torch.Tensor] = []
        lengths: list[int] = []
        for image in images:
            channels, height, width = image.shape
            if channels != 3 or height % p or width % p or not height or not width:
                raise ValueError(
                    f"siglip2 vision tower takes [3, h * {p}, w * {p}] pixels; got "
                    f"{list(image.shape)} (the model's image processor makes them so)"
                )
            h, w = height // p, width // p
            patches = image.reshape(3, h, p, w, p).permute(1, 3, 2, 4, 0).reshape(h * w, -1)
            x = F.linear(patches.to(self.patch_w.dtype), self.patch_w, self.patch_b)
            embedded.append(x + resized_positions(table, h, w))
            lengths.append(h * w)
        device = self.patch_w.device
        batch = PackedBatch.build([[0] * n for n in lengths], device, attention=attention)
        hidden = self.vision(torch.cat(embedded), batch, causal=False)
        hidden = self.vision.norm(hidden, *self.post_ln)
        return torch.cat(
            [self._attention_pool(part[None]) for part in torch.split(hidden, lengths)]
        )


def resized_positions(table: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The ``[grid, grid, width]`` position table resized to ``rows x cols`` ``[rows * cols,
    width]``, row-major: transformers' ``Siglip2VisionEmbeddings.resize_positional_embeddings``
    (``F.interpolate(mode="bilinear", align_corners=False, antialias=True)`` written as its
    per-axis weights, in float32, then cast to the table's dtype)."""
    grid = table.shape[0]

    def axis(size: int) -> torch.Tensor:
        scale = grid / size
        support = max(scale, 1.0)
        center = (torch.arange(size, device=table.device, dtype=torch.float32) + 0.5) * scale - 0.5
        source = torch.arange(grid, device=table.device, dtype=torch.float32)
        weights = (1 - (source[None, :] - center[:, None]).abs() / support).clamp(min=0)
        return weights / weights.sum(-1, keepdim=True)  # [size, grid]

    weights = (axis(rows)[:, None, :, None] * axis(cols)[None, :, None, :]).reshape(
        rows * cols, grid * grid
    )
    flat = table.reshape(grid * grid, -1).float()
    return (weights @ flat).to(table.dtype)


def build_naflex(ckpt: Checkpoint) -> Siglip2Model:
    """The SigLIP 2 NaFlex builder of the registry."""
    return Siglip2Model(ckpt)

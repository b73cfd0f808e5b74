"""OpenAI CLIP (``model_type: clip``, ``CLIPModel``): a text tower and a vision tower
projected into one vector space.

Text: token + learned position embeddings, pre-LayerNorm blocks with causal attention
(``vision.PreLnStack``), ``final_layer_norm``, then ``text_projection`` (no bias) applied to
every token, so the body's states are already in the shared space (``hidden_size`` is
``projection_dim``, as voyage-4-nano's projection in ``llama.py``). transformers pools the
text at the end-of-text token (``CLIPTextTransformer``): the first position holding
``eos_token_id``, or, for the legacy configs whose ``eos_token_id`` is 2, the position of
the largest id (the end-of-text token is the vocabulary's last). CLIP's tokenizer appends
that token last, so pooling ``last`` over an unpadded sequence is that position, and the
served vector is ``CLIPModel.get_text_features``; :func:`check_tokenizer` refuses a
checkpoint whose tokenizer would make "last" another position.

Vision (``encode_images``): a stride-``patch_size`` convolution (no bias), the class
embedding in front, learned position embeddings, ``pre_layrnorm`` (transformers' spelling),
the blocks (full attention, one packed sequence per image), ``post_layernorm`` on the class
token, ``visual_projection``: ``CLIPModel.get_image_features``.

``logit_scale`` (the contrastive temperature) is read by nothing: it scales similarities in
training, not the vectors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

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

MODEL_TYPE = "clip"

IGNORED = (
    Ignored(
        r"logit_scale",
        "the contrastive temperature: it scales image-text similarities in training, not the "
        "embeddings",
    ),
    Ignored(
        r"(?:text|vision)_model\.embeddings\.position_ids",
        "an index buffer some saves carry; positions come from the packed batch",
    ),
)

LEGACY_EOS = 2
"""The ``eos_token_id`` of CLIP configs written before transformers#24773: transformers then
pools at the largest token id (``argmax``) instead."""


def _eos(config: Mapping[str, Any]) -> int:
    eos = text_config(config, MODEL_TYPE).get("eos_token_id", 49407)
    if not isinstance(eos, int):
        raise UnsupportedModelError(
            f"clip text_config eos_token_id must be one token id; got {eos!r} (transformers "
            "pools the text at that token's position)"
        )
    return eos


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, from config.json alone, what this implementation does not serve."""
    text_config(config, MODEL_TYPE)
    vision_config(config, MODEL_TYPE)
    _eos(config)


def check_tokenizer(config: Mapping[str, Any], tokenizer: Tokenizer) -> None:
    """Pooling ``last`` is transformers' pooled position only if the tokenizer ends every
    text with the token transformers pools at: the ``eos_token_id`` (or, for the legacy
    ``eos_token_id: 2`` configs, the largest id of the vocabulary, which ``argmax`` finds)."""
    eos = _eos(config)
    vocab = int(text_config(config, MODEL_TYPE).get("vocab_size", 0))
    pooled_at = vocab - 1 if eos == LEGACY_EOS else eos
    rule = (
        f"the largest token id ({pooled_at}, the legacy eos_token_id: 2 rule)"
        if eos == LEGACY_EOS
        else f"the first eos_token_id ({eos})"
    )
    ids = tokenizer.encode("a photo").ids
    if not ids or ids[-1] != pooled_at:
        raise UnsupportedModelError(
            f"clip pools the text at {rule}, but this checkpoint's tokenizer ends a text with "
            f"token {ids[-1] if ids else None}: the served vector would not be "
            "get_text_features'. A CLIP tokenizer appends <|endoftext|>; check tokenizer.json "
            "and text_config.eos_token_id"
        )


class ClipModel:
    """CLIP's text tower on packed tokens (projected), and its vision tower."""

    causal: bool = True
    position_offset: int = 0
    sliding_window: int | None = None

    def __init__(self, ckpt: Checkpoint) -> None:
        refuse_parallel(ckpt.shard.parallel, MODEL_TYPE)
        config = ckpt.config
        text, vision = text_config(config, MODEL_TYPE), vision_config(config, MODEL_TYPE)
        r = ckpt.reader(prefixes=(), marker="text_model.", architecture="CLIP")
        # Text tower.
        self.token_embedding = r.embedding("text_model.embeddings.token_embedding.weight")
        self.text_positions = r.get("text_model.embeddings.position_embedding.weight")
        self.max_positions = int(text.get("max_position_embeddings", 77))
        refuse_beyond_table(
            "CLIP",
            "text_config.max_position_embeddings",
            self.max_positions,
            self.text_positions.shape[0],
            "text_model.embeddings.position_embedding.weight",
        )
        self.text = PreLnStack(r, "text_model.", text, "clip text", default_act="quick_gelu")
        self.final_ln = (
            r.get("text_model.final_layer_norm.weight"),
            r.get("text_model.final_layer_norm.bias"),
        )
        self.text_projection = r.get("text_projection.weight")
        self.hidden_size = int(self.text_projection.shape[0])
        # Vision tower.
        self.patch = int(vision.get("patch_size", 32))
        self.image_size = int(vision.get("image_size", 224))
        self.image_tokens = (self.image_size // self.patch) ** 2 + 1
        self.class_embedding = r.get("vision_model.embeddings.class_embedding")
        self.patch_w = r.get("vision_model.embeddings.patch_embedding.weight")
        self.image_positions = r.get("vision_model.embeddings.position_embedding.weight")
        if self.image_positions.shape[0] != self.image_tokens:
            raise UnsupportedModelError(
                f"clip vision position table has {self.image_positions.shape[0]} rows, but "
                f"image_size {self.image_size} / patch_size {self.patch} makes "
                f"{self.image_tokens} tokens; the config does not match its weights"
            )
        self.pre_ln = (
            r.get("vision_model.pre_layrnorm.weight"),
            r.get("vision_model.pre_layrnorm.bias"),
        )
        self.vision = PreLnStack(
            r, "vision_model.", vision, "clip vision", default_act="quick_gelu"
        )
        self.post_ln = (
            r.get("vision_model.post_layernorm.weight"),
            r.get("vision_model.post_layernorm.bias"),
        )
        self.visual_projection = r.get("visual_projection.weight")
        if self.visual_projection.shape[0] != self.hidden_size:
            raise UnsupportedModelError(
                "clip text_projection and visual_projection project to different widths "
                f"({self.hidden_size} and {self.visual_projection.shape[0]})"
            )

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Projected text states ``[T, projection_dim]``; pooling ``last`` is
        get_text_features."""
        h = self.token_embedding(batch.input_ids) + self.text_positions.index_select(
            0, batch.position_ids
        )
        h = self.text(h, batch, causal=True)
        h = self.text.norm(h, *self.final_ln)
        return F.linear(h, self.text_projection)

    def encode_images(self, images: Sequence[torch.Tensor], attention: Backend) -> torch.Tensor:
        """get_image_features of ``images`` (each ``[3, H, W]``): ``[N, projection_dim]``."""
        pixels = stack_images(images, self.image_size, MODEL_TYPE)
        count = pixels.shape[0]
        patches = patch_tokens(pixels, self.patch_w, None, self.patch)
        cls = self.class_embedding.expand(count, 1, -1)
        h = torch.cat([cls, patches], dim=1) + self.image_positions
        h = self.vision.norm(h, *self.pre_ln).reshape(count * self.image_tokens, -1)
        batch = image_batch(count, self.image_tokens, pixels.device, attention)
        h = self.vision(h, batch, causal=False)
        first = h.reshape(count, self.image_tokens, -1)[:, 0]
        return F.linear(self.vision.norm(first, *self.post_ln), self.visual_projection)


def build(ckpt: Checkpoint) -> ClipModel:
    """The CLIP builder of the registry."""
    return ClipModel(ckpt)

"""What the CLIP-style two-tower families (CLIP, SigLIP) share: the pre-LayerNorm transformer
block both towers of both families are made of, under the names both use
(``layer_norm1``, ``self_attn.{q,k,v,out}_proj``, ``layer_norm2``, ``mlp.fc1`` / ``mlp.fc2``),
the ViT patch embedding, and the packing of a stack of equal-size images into a
:class:`~.base.PackedBatch` so the vision tower's attention runs through the same varlen
kernels as text.

A model with a vision tower implements :class:`VisionModel`: besides the text body's packed
``forward`` it embeds images itself (``encode_images``), pooled and projected, since the
tower's pooling (a class token, an attention-pooling head) is part of the model, not of the
text pooling methods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from embedding_server.device.attention import Backend
from embedding_server.device.models.base import EmbeddingModel, PackedBatch, WeightReader
from embedding_server.device.models.layers import ACT_FUNCS, attention_shape
from embedding_server.errors import UnsupportedModelError

QUICK_GELU = "quick_gelu"


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's GELU approximation, ``x * sigmoid(1.702 x)`` (transformers'
    ``QuickGELUActivation``)."""
    return x * torch.sigmoid(1.702 * x)


def tower_activation(
    config: Mapping[str, Any], model_type: str, default: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The tower config's ``hidden_act`` (quick_gelu included), or a refusal naming it."""
    name = str(config.get("hidden_act") or default)
    if name == QUICK_GELU:
        return quick_gelu
    if name not in ACT_FUNCS:
        raise UnsupportedModelError(
            f"{model_type} activation {name!r} is not supported; supported: "
            f"{sorted([*ACT_FUNCS, QUICK_GELU])}"
        )
    return ACT_FUNCS[name]


@runtime_checkable
class VisionModel(EmbeddingModel, Protocol):
    """A text body with a vision tower beside it (CLIP, SigLIP)."""

    image_tokens: int
    """The vision tower's sequence length per image (patches, plus the class token where
    the model has one): what an image costs in admission and batching."""
    image_size: int
    """The height and width (pixels) the tower takes."""

    def encode_images(self, images: Sequence[torch.Tensor], attention: Backend) -> torch.Tensor:
        """Pooled, projected image vectors ``[N, dim]`` of ``images`` (each ``[3, H, W]``)."""
        ...


def image_tokens_of(model: object) -> int | None:
    """The vision tower's tokens per image of a model that embeds images, else None."""
    if not callable(getattr(model, "encode_images", None)):
        return None
    tokens = getattr(model, "image_tokens", None)
    return tokens if isinstance(tokens, int) else None


@dataclass
class PreLnBlock:
    """One pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor


class PreLnStack:
    """A tower's ``encoder.layers.*`` (CLIP's and SigLIP's names), run on packed tokens."""

    def __init__(
        self,
        r: WeightReader,
        prefix: str,
        config: Mapping[str, Any],
        model_type: str,
        *,
        default_act: str,
    ) -> None:
        self.hidden, self.heads, self.head_dim, self.scale = attention_shape(config, model_type)
        self.eps = float(config.get("layer_norm_eps", 1e-5))
        self.act = tower_activation(config, model_type, default_act)
        self.layers = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"{prefix}encoder.layers.{i}."
            a = p + "self_attn."
            self.layers.append(
                PreLnBlock(
                    ln1_w=r.get(p + "layer_norm1.weight"),
                    ln1_b=r.get(p + "layer_norm1.bias"),
                    qkv_w=r.cat([a + f"{n}_proj.weight" for n in "qkv"], [slice(None)] * 3),
                    qkv_b=r.cat([a + f"{n}_proj.bias" for n in "qkv"], [slice(None)] * 3),
                    out_w=r.get(a + "out_proj.weight"),
                    out_b=r.get(a + "out_proj.bias"),
                    ln2_w=r.get(p + "layer_norm2.weight"),
                    ln2_b=r.get(p + "layer_norm2.bias"),
                    fc1_w=r.get(p + "mlp.fc1.weight"),
                    fc1_b=r.get(p + "mlp.fc1.bias"),
                    fc2_w=r.get(p + "mlp.fc2.weight"),
                    fc2_b=r.get(p + "mlp.fc2.bias"),
                )
            )

    def norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)

    def __call__(self, h: torch.Tensor, batch: PackedBatch, *, causal: bool) -> torch.Tensor:
        """The blocks over packed states ``[T, hidden]``."""
        tokens = h.shape[0]
        for layer in self.layers:
            x = self.norm(h, layer.ln1_w, layer.ln1_b)
            q, k, v = F.linear(x, layer.qkv_w, layer.qkv_b).chunk(3, dim=-1)
            shape = (tokens, self.heads, self.head_dim)
            ctx = batch.attention(
                q.reshape(shape),
                k.reshape(shape),
                v.reshape(shape),
                causal=causal,
                scale=self.scale,
            )
            h = h + F.linear(ctx.reshape(tokens, self.hidden), layer.out_w, layer.out_b)
            x = self.norm(h, layer.ln2_w, layer.ln2_b)
            h = h + F.linear(
                self.act(F.linear(x, layer.fc1_w, layer.fc1_b)), layer.fc2_w, layer.fc2_b
            )
        return h


def vision_config(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The ``vision_config`` of a two-tower config, or a refusal."""
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise UnsupportedModelError(f"{model_type} config.json has no vision_config")
    return dict(vision)


def text_config(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The ``text_config`` of a two-tower config, or a refusal."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise UnsupportedModelError(f"{model_type} config.json has no text_config")
    return dict(text)


def flatten_text(config: Mapping[str, Any]) -> dict[str, Any]:
    """A two-tower config with its text tower's keys (``hidden_size``, ``vocab_size``,
    ``max_position_embeddings`` ...) also at top level, where the loader, the tokenizer
    stage and ``/info`` read a text body's shape; the top level's own keys win
    (``model_type``, ``architectures``, ``projection_dim``)."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        return dict(config)
    flat = {k: v for k, v in text.items() if k not in ("model_type", "architectures")}
    flat.update(config)
    return flat


def refuse_parallel(checkpoint_parallel: bool, model_type: str) -> None:
    """The two-tower families run on one device only."""
    if checkpoint_parallel:
        raise UnsupportedModelError(
            f"{model_type} models are not served with tensor parallelism (their towers are "
            "small; the vision tower is not split over ranks): use tensor_parallel_size 1"
        )


def stack_images(images: Sequence[torch.Tensor], size: int, model_type: str) -> torch.Tensor:
    """Fixed-resolution images stacked ``[N, 3, size, size]``; each must be that size, what
    the model's processor makes."""
    for image in images:
        if tuple(image.shape) != (3, size, size):
            raise ValueError(
                f"{model_type} vision tower takes images of 3 x {size} x {size} pixels; got "
                f"{' x '.join(str(d) for d in image.shape)} (the model's image processor makes "
                "them that size)"
            )
    return torch.stack(list(images))


def patch_tokens(
    pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, patch: int
) -> torch.Tensor:
    """The ViT patch embedding: a stride-``patch`` convolution, ``[N, patches, hidden]``
    in row-major patch order (transformers' ``flatten(2).transpose(1, 2)``)."""
    out = F.conv2d(pixels.to(weight.dtype), weight, bias, stride=patch)
    return out.flatten(2).transpose(1, 2)


def image_batch(count: int, length: int, device: torch.device, attention: Backend) -> PackedBatch:
    """A packed batch of ``count`` images of ``length`` tokens each, for the attention plan
    (ids are placeholders: the towers embed pixels, not ids)."""
    return PackedBatch.build([[0] * length] * count, device, attention=attention)

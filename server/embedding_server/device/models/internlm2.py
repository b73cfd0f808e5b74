"""InternLM2 (``internlm2``): Llama's math under other weight names, with q, k and v packed
into one interleaved ``wqkv``; its reward models (internlm2-1_8b/7b/20b-reward,
``InternLM2ForRewardModel``).

The authors' code (``modeling_internlm2.py``, custom code, not run; transformers has no
InternLM2 class) is a Llama decoder: RMSNorm before attention and MLP, rotary positions,
grouped-query attention, SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down). Its one difference is
the attention's input projection: ``wqkv`` holds, for each key/value head, that head's
``groups`` query heads, then its key, then its value (``head_dim`` rows each), which the code
reads as ``(kv_heads, groups + 2, head_dim)`` (vLLM's ``split_qkv`` too). So the body here is
the native Llama body reading a view of the checkpoint (:class:`InternLM2Weights`) that
de-interleaves ``wqkv`` into Llama's ``q_proj`` / ``k_proj`` / ``v_proj`` and renames the
rest; every original tensor a Llama name reads is claimed, so one nobody reads still
refuses the load.

Its rotary scaling: ``linear`` divides the frequencies, as Llama's; ``dynamic`` (NTK) changes
the base only for a sequence longer than ``max_position_embeddings``, which the server never
admits (inputs are limited to it), so within that limit it is the plain rotary embedding.

The reward head is ``v_head`` (a Linear to one output, no bias) at every token, raw, as
vLLM's ``InternLM2ForRewardModel`` returns it; the authors' ``get_score`` reads the last
token, after appending the reward token to the formatted conversation (the caller's part).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from embedding_server.device.heads import ClassificationHead, HeadWeights, RewardReader
from embedding_server.device.models.base import Checkpoint, EmbeddingModel, Ignored
from embedding_server.device.models.llama import DECODER_IGNORED, DecoderVariant, LlamaModel
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.pooling import PoolingMethod

VARIANT = DecoderVariant()
"""Llama's math with no biases (``bias: false``, every published checkpoint)."""

IGNORED = (
    *DECODER_IGNORED,
    Ignored(
        r"output\.weight",
        "the language-model head of an InternLM2ForCausalLM checkpoint (next-token logits); "
        "the body's final states are what is served",
    ),
)

_RENAMES = {
    "tok_embeddings.weight": "embed_tokens.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_WQKV = "attention.wqkv.weight"
_PROJECTIONS = ("q", "k", "v")


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, before weights are fetched, what the Llama body would not compute as the
    authors' code does."""
    if config.get("bias"):
        raise UnsupportedModelError(
            "internlm2 with bias: true (biases on wqkv and wo) is not supported; every "
            "published InternLM2 checkpoint has none"
        )
    scaling = config.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("type") if isinstance(scaling, Mapping) else None
        if kind not in ("linear", "dynamic"):
            raise UnsupportedModelError(
                f"internlm2 rope_scaling {scaling!r} is not supported (supported: none, "
                "linear, dynamic)"
            )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"internlm2 activation {act!r} is not supported (only silu)")


def llama_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as the Llama body reads it: dynamic NTK scaling is the plain rotary
    embedding within ``max_position_embeddings`` (the most the server admits)."""
    out = {**config, "attention_bias": False, "mlp_bias": False}
    scaling = config.get("rope_scaling")
    if isinstance(scaling, Mapping) and scaling.get("type") == "dynamic":
        out["rope_scaling"] = None
    return out


class InternLM2Weights(Mapping[str, torch.Tensor]):
    """A checkpoint's InternLM2 tensors under the Llama body's names, ``wqkv`` split into
    ``q_proj``, ``k_proj`` and ``v_proj`` as the authors' code reads it. Reading a derived
    name reads the original through ``weights`` (so the loader's audit counts it read)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        self._weights = weights
        heads = int(config["num_attention_heads"])
        self._kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % self._kv_heads:
            raise UnsupportedModelError(
                f"internlm2 num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {self._kv_heads}"
            )
        self._groups = heads // self._kv_heads
        self._head_dim = int(config["hidden_size"]) // heads
        self._names: dict[str, tuple[str, str | None]] = {}
        for name in weights:
            match = re.fullmatch(r"(.*layers\.\d+\.)(.+)", name)
            stem, rest = (match.group(1), match.group(2)) if match else ("", name)
            if rest == _WQKV:
                for p in _PROJECTIONS:
                    self._names[f"{stem}self_attn.{p}_proj.weight"] = (name, p)
                continue
            for old, new in _RENAMES.items():
                if rest == old or (not match and rest.endswith("." + old)):
                    self._names[stem + rest[: -len(old)] + new] = (name, None)
                    break
            else:
                self._names[name] = (name, None)

    def __getitem__(self, name: str) -> torch.Tensor:
        source, part = self._names[name]
        tensor = self._weights[source]
        if part is None:
            return tensor
        return self._split(tensor, part)

    def shape_of(self, name: str) -> tuple[int, ...]:
        source, part = self._names[name]
        reader = getattr(self._weights, "shape_of", None)
        shape = tuple(reader(source)) if reader is not None else tuple(self[name].shape)
        if part is None:
            return shape
        rows = self._kv_heads * self._head_dim * (self._groups if part == "q" else 1)
        return (rows, *shape[1:])

    def _split(self, wqkv: torch.Tensor, part: str) -> torch.Tensor:
        """Rows of ``part`` from ``wqkv`` laid out as ``(kv_heads, groups + 2, head_dim)``."""
        blocks = wqkv.reshape(self._kv_heads, self._groups + 2, self._head_dim, -1)
        if part == "q":
            chosen = blocks[:, : self._groups]
        else:
            index = self._groups if part == "k" else self._groups + 1
            chosen = blocks[:, index : index + 1]
        return chosen.reshape(-1, wqkv.shape[-1])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def build(checkpoint: Checkpoint) -> EmbeddingModel:
    """The Llama body over the checkpoint's de-interleaved view."""
    config = checkpoint.config
    check_config(config)
    view = Checkpoint(
        llama_config(config),
        InternLM2Weights(checkpoint.weights, config),
        checkpoint.dtype,
        checkpoint.device,
        checkpoint.shard,
    )
    return LlamaModel(view, variant=VARIANT)


def reward_head(w: HeadWeights, per_token: bool) -> tuple[ClassificationHead, PoolingMethod]:
    """``v_head`` (no bias) at every token; the reward is the last token's."""
    return ClassificationHead(weight=w.get("v_head.weight"), bias=None), "last"


REWARD = RewardReader(head=reward_head, outputs={"outcome": 1})
"""internlm2-1_8b-reward, -7b-reward, -20b-reward."""

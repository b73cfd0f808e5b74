"""Gemma 3 text models on packed tokens (``model_type: gemma3_text``): EmbeddingGemma
(google/embeddinggemma-300m) and Gemma 3 language models used as embedders.

The skeleton is Llama's (grouped-query attention, RoPE, gated MLP, RMSNorm over each head of
q and k like Qwen3), so this module uses the shared :mod:`.layers`: rope frequencies, the
rotary table, the ``layer_types`` reader, Gemma's RMSNorm. Gemma differs in enough places at
once that a separate forward reads better than a dozen switches in ``LlamaModel``:

* token embeddings are multiplied by ``sqrt(hidden_size)``, the scale first rounded to the
  model dtype (bf16 turns sqrt(768) = 27.71 into 27.75), as transformers does;
* Gemma's RMSNorm scales by ``1 + weight`` and multiplies in float32 before casting back
  (Llama casts, then multiplies by ``weight``);
* four norms per block: ``input_layernorm`` before attention and ``post_attention_layernorm``
  on its output before the residual add; ``pre_feedforward_layernorm`` /
  ``post_feedforward_layernorm`` the same around the MLP;
* attention scale ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``; ``head_dim``
  is its own setting (256 by default), not ``hidden_size / heads``;
* GeGLU MLP: ``hidden_activation`` gelu with the tanh approximation;
* ``layer_types`` alternate local (``sliding_attention``) and global (``full_attention``)
  layers, and each kind has its own rope: local layers ``rope_local_base_freq`` (10k),
  global ones ``rope_theta`` (1M) and ``rope_scaling``; checkpoints saved by transformers
  >= 5 nest both in ``rope_parameters`` by layer type;
* ``use_bidirectional_attention`` (EmbeddingGemma) drops the causal mask, and then a local
  layer's query ``i`` sees keys ``|i - j| <= sliding_window // 2``: transformers' config
  turns ``sliding_window`` into ``sliding_window // 2 + 1`` and masks ``|i - j|`` below it.
  A causal local layer sees ``i - sliding_window < j <= i``, as Mistral's.

Pooling: the registry's default for ``gemma3_text`` is the last token, as for every decoder
(in a causal Gemma only the last token has seen the whole input). EmbeddingGemma declares
mean pooling, two Dense layers and Normalize in its sentence-transformers files, and those
win (:mod:`..loading`).

The multimodal wrapper (``model_type: gemma3``, a vision tower plus a ``text_config``) is
refused by the registry with :data:`MULTIMODAL_REFUSAL`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.models.base import (
    Captured,
    Checkpoint,
    PackedBatch,
    PrefixStates,
    config_get,
    decoder_causal,
)
from embedding_server.device.models.layers import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    HeadSplit,
    RotaryTable,
    apply_rotary,
    gemma_rms_norm,
    layer_rope,
    layer_types,
    row_linear,
)
from embedding_server.errors import UnsupportedModelError

MULTIMODAL_REFUSAL = (
    "model_type 'gemma3' is the multimodal Gemma 3 checkpoint (vision tower + language "
    "model); only text-only Gemma 3 checkpoints (model_type 'gemma3_text', such as "
    "google/embeddinggemma-300m) are supported. Save its language model on its own with "
    "transformers (a Gemma3TextModel, with the tokenizer) and serve that directory."
)

# Gemma3TextConfig's defaults, for keys config.json may omit.
_DEFAULT_HEAD_DIM = 256
_DEFAULT_KV_HEADS = 4
_DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_SLIDING_WINDOW_PATTERN = 6  # every sixth layer is global
_DEFAULT_ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_LEGACY_ROPE_THETA_KEY = {
    "full_attention": "rope_theta",
    "sliding_attention": "rope_local_base_freq",
}
# transformers' activation names -> torch's gelu ``approximate``.
_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def gelu_activation(config: Mapping[str, Any]) -> str:
    """The config's activation name (Gemma's default: gelu with the tanh approximation)."""
    return str(config_get(config, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"))


@dataclass
class _Layer:
    local: bool  # sliding_attention layer: local rope (and the window, if any)
    window: int | None  # attention window in varlen_attention's convention; None = full
    in_norm: torch.Tensor  # norms hold 1 + weight, float32
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None  # Gemma 3's per-head norms; Gemma 2 has none
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_attn_norm: torch.Tensor | None  # sandwich norms (Gemma 2, 3); Gemma 1 has none
    pre_ff_norm: torch.Tensor
    post_ff_norm: torch.Tensor | None
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


def local_layers(config: Mapping[str, Any]) -> list[bool]:
    """Which layers are local (``sliding_attention``), as Gemma3TextConfig reads the config:
    ``layer_types``, or, in configs without it, all but every ``sliding_window_pattern``-th."""
    pattern = int(config.get("sliding_window_pattern", _DEFAULT_SLIDING_WINDOW_PATTERN))
    kinds = layer_types(config, "gemma3_text", lambda n: [(i + 1) % pattern != 0 for i in range(n)])
    return [kind == SLIDING_ATTENTION for kind in kinds]


def rope_parameters(config: Mapping[str, Any], layer_type: str) -> dict[str, Any]:
    """The rope of ``full_attention`` or ``sliding_attention`` layers, from either layout:
    ``rope_parameters`` nested by layer type (transformers >= 5), or top-level ``rope_theta``
    (global), ``rope_local_base_freq`` (local) and ``rope_scaling`` (global only)."""
    legacy = config_get(
        config, _LEGACY_ROPE_THETA_KEY[layer_type], default=_DEFAULT_ROPE_THETA[layer_type]
    )
    return layer_rope(config, layer_type, theta=legacy, scaled=layer_type == FULL_ATTENTION)


class Gemma3TextModel(PrefixStates):
    """Gemma 3 text body for packed batches (causal unless ``use_bidirectional_attention``).

    Gemma 2 (:mod:`.gemma2`) is the same block without the q/k norms and with one rope, plus
    soft-capped attention logits; Gemma 1 (:mod:`.gemma`) is Gemma 2 without the sandwich
    norms, the cap and the window. They subclass this and override the hooks below."""

    position_offset = 0
    model_type = "gemma3_text"
    qk_norm = True
    sandwich = True
    """Four norms per block, each sublayer's output normed before its residual add; False:
    Llama's two (``post_attention_layernorm`` is then the MLP's input norm)."""
    default_max_positions = 131_072
    default_kv_heads = _DEFAULT_KV_HEADS

    def check(self, config: Mapping[str, Any]) -> None:
        """Refuse what this family does not serve exactly."""
        act = gelu_activation(config)
        if act not in _GELU_APPROXIMATION:
            raise UnsupportedModelError(
                f"gemma3_text activation {act!r} is not supported "
                f"(supported: {', '.join(_GELU_APPROXIMATION)})"
            )
        if config.get("attn_logit_softcapping") is not None:
            raise UnsupportedModelError(
                "gemma3_text attn_logit_softcapping is not supported (attention logits are "
                "not soft-capped here; Gemma 3 checkpoints leave it null)"
            )
        if not decoder_causal(config, "gemma3_text") and not config.get(
            "use_bidirectional_attention"
        ):
            # transformers then masks local layers to |i - j| <= sliding_window, not the
            # window // 2 each side of use_bidirectional_attention; no Gemma 3 checkpoint we
            # know does this, and what is not checked against transformers is not served.
            raise UnsupportedModelError(
                "gemma3_text with is_causal: false is not supported; Gemma 3 embedders "
                "declare bidirectional attention with use_bidirectional_attention: true "
                "(EmbeddingGemma), which is: set that instead if the model was trained so"
            )

    def attention_softcap(self, config: Mapping[str, Any]) -> float | None:
        return None

    def gelu_approximation_of(self, config: Mapping[str, Any]) -> str:
        """torch's ``approximate`` for the MLP's gelu (``check`` refused any other name)."""
        return _GELU_APPROXIMATION[gelu_activation(config)]

    def local_layers(self, config: Mapping[str, Any]) -> list[bool]:
        return local_layers(config)

    def attention_scale(self, config: Mapping[str, Any], head_dim: int) -> float:
        """``query_pre_attn_scalar ** -0.5`` (Gemma 2 and 3), not ``head_dim ** -0.5``."""
        scalar = config_get(config, "query_pre_attn_scalar", default=_DEFAULT_QUERY_PRE_ATTN_SCALAR)
        scale: float = float(scalar) ** -0.5
        return scale

    def ropes(self, config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The rope parameters of each layer kind."""
        return {kind: rope_parameters(config, kind) for kind in (FULL_ATTENTION, SLIDING_ATTENTION)}

    def __init__(self, checkpoint: Checkpoint) -> None:
        config, dtype, device = checkpoint.config, checkpoint.dtype, checkpoint.device
        name = self.model_type
        self.check(config)
        self.gelu_approximation = self.gelu_approximation_of(config)
        self.softcap = self.attention_softcap(config)
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(
            config_get(config, "num_key_value_heads", default=self.default_kv_heads)
        )
        self.head_dim = int(config_get(config, "head_dim", default=_DEFAULT_HEAD_DIM))
        self.eps = float(config_get(config, "rms_norm_eps", default=1e-6))
        self.scale = self.attention_scale(config, self.head_dim)
        self.causal = decoder_causal(config, name)
        self.max_positions = int(
            config_get(config, "max_position_embeddings", default=self.default_max_positions)
        )
        self.dtype, self.device = dtype, device
        self.shard = checkpoint.shard
        self.split = split = HeadSplit.of(
            checkpoint.shard,
            name,
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate=int(config["intermediate_size"]),
        )

        local = self.local_layers(config)
        window = config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
        if any(local) and (window is None or int(window) < 1):
            raise UnsupportedModelError(
                f"{name} sliding_window must be >= 1 when layer_types has "
                f"sliding_attention layers; got {window!r}"
            )
        self.sliding_window = int(window) if any(local) else None
        # varlen_attention's window counts keys on each side. Causal: the query itself plus
        # window - 1 before it. Bidirectional: transformers uses window // 2 + 1 as an
        # exclusive bound on |i - j|, i.e. window // 2 keys each side.
        attention_window = None
        if self.sliding_window is not None:
            attention_window = self.sliding_window - 1 if self.causal else self.sliding_window // 2
        built: list[tuple[dict[str, Any], RotaryTable]] = []  # kinds of one rope share it
        self.rotary: dict[str, RotaryTable] = {}
        for kind, params in self.ropes(config).items():
            table = next((t for known, t in built if known == params), None)
            if table is None:
                table = RotaryTable.of(params, self.head_dim, dtype=dtype, device=device)
                built.append((params, table))
            self.rotary[kind] = table
        bias = bool(config.get("attention_bias", False))

        w = checkpoint.reader(prefixes=("model.",), marker="layers.", architecture=name)
        get = w.get

        def norm(name: str) -> torch.Tensor:
            # Rounded to the model dtype first, as the module's parameter is.
            return 1.0 + get(name).float()

        self.embed = w.embedding("embed_tokens.weight")
        self.embed_scale = torch.tensor(math.sqrt(self.hidden_size)).to(dtype=dtype, device=device)
        self.norm = norm("norm.weight")
        self.layers: list[_Layer] = []
        for i, is_local in enumerate(local):
            p = f"layers.{i}."
            self.layers.append(
                _Layer(
                    local=is_local,
                    window=attention_window if is_local else None,
                    in_norm=norm(p + "input_layernorm.weight"),
                    qkv_w=w.qkv([p + f"self_attn.{n}_proj.weight" for n in "qkv"], split),
                    qkv_b=(
                        w.qkv([p + f"self_attn.{n}_proj.bias" for n in "qkv"], split)
                        if bias
                        else None
                    ),
                    q_norm=norm(p + "self_attn.q_norm.weight") if self.qk_norm else None,
                    k_norm=norm(p + "self_attn.k_norm.weight") if self.qk_norm else None,
                    o_w=w.columns(p + "self_attn.o_proj.weight", split.q),
                    o_b=w.maybe(p + "self_attn.o_proj.bias", bias),
                    post_attn_norm=(
                        norm(p + "post_attention_layernorm.weight") if self.sandwich else None
                    ),
                    pre_ff_norm=norm(
                        p
                        + (
                            "pre_feedforward_layernorm.weight"
                            if self.sandwich
                            else "post_attention_layernorm.weight"
                        )
                    ),
                    post_ff_norm=(
                        norm(p + "post_feedforward_layernorm.weight") if self.sandwich else None
                    ),
                    gate_up_w=w.cat(
                        [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                        (split.mlp, split.mlp),
                    ),
                    down_w=w.columns(p + "mlp.down_proj.weight", split.mlp),
                )
            )

    def _run(self, batch: PackedBatch, captured: Captured | None) -> torch.Tensor:
        """The forward pass; each layer's keys (after RoPE) and values appended to
        ``captured`` when given."""
        t = batch.input_ids.shape[0]
        hq, hkv, d, eps = self.split.heads, self.split.kv_heads, self.head_dim, self.eps
        looked_up: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for table in self.rotary.values():
            if id(table) not in looked_up:
                looked_up[id(table)] = table.lookup(batch.position_ids, batch.max_position)
        global_rope = looked_up[id(self.rotary[FULL_ATTENTION])]
        local_rope = looked_up[id(self.rotary[SLIDING_ATTENTION])]
        x = self.embed(batch.input_ids) * self.embed_scale
        for i, layer in enumerate(self.layers):
            rope = local_rope if layer.local else global_rope
            h = gemma_rms_norm(x, layer.in_norm, eps)
            qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = gemma_rms_norm(q, layer.q_norm, eps)
                k = gemma_rms_norm(k, layer.k_norm, eps)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            if captured is not None:
                captured.append((k, v))
            attn = batch.attention(
                q,
                k,
                v,
                causal=self.causal,
                scale=self.scale,
                window=layer.window,
                softcap=self.softcap,
                layer=i,
            )
            h = row_linear(attn.reshape(t, hq * d), layer.o_w, layer.o_b, self.shard)
            if layer.post_attn_norm is not None:
                h = gemma_rms_norm(h, layer.post_attn_norm, eps)
            x = x + h
            h = gemma_rms_norm(x, layer.pre_ff_norm, eps)
            gate, up = F.linear(h, layer.gate_up_w).chunk(2, dim=-1)
            h = F.gelu(gate, approximate=self.gelu_approximation) * up
            h = row_linear(h, layer.down_w, None, self.shard)
            if layer.post_ff_norm is not None:
                h = gemma_rms_norm(h, layer.post_ff_norm, eps)
            x = x + h
        return gemma_rms_norm(x, self.norm, eps)

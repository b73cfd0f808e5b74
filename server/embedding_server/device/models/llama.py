"""Decoder-only embedders on packed tokens: Llama, Mistral, Qwen2, Qwen3, and NVIDIA's
bidirectional Llama (``llama_bidirec``).

Covers Qwen3-Embedding, gte-Qwen2 and e5-mistral (last-token pooling), and
llama-nemotron-embed-1b-v2 (``llama_bidirec``: Llama's math and weight names, attention
bidirectional by its model class, mean pooling). Pre-RMSNorm blocks,
rotary position embeddings (``rope_theta``; default, linear and llama3 scaling),
grouped-query attention, causal masks, SwiGLU MLP. The family members differ only in small
switches, declared per ``model_type`` as a :class:`DecoderVariant` in the registry
(``models/__init__.py``) rather than as four copies of the code or ``model_type`` checks:

* Qwen2: biases on the q/k/v projections;
* Qwen3: RMSNorm over each head of q and k before RoPE (``q_norm`` / ``k_norm``) and an
  explicit ``head_dim``;
* Llama/Qwen3: ``attention_bias`` (q/k/v/o) and, Llama only, ``mlp_bias`` flags (usually false);
  Mistral has no biases;
* sliding-window attention (:func:`sliding_windows`): every Mistral layer when
  ``sliding_window`` is set (e5-mistral, SFR-Embedding-Mistral, Linq-Embed-Mistral: 4096);
  Qwen2/Qwen3 layers picked by ``layer_types`` or ``max_window_layers`` when
  ``use_sliding_window`` is on. An input longer than the window gets the vectors transformers
  computes, not full-attention ones.

Causal unless the config switches it off (``is_causal: false``, gte-Qwen2;
``use_bidirectional_attention: true``, voyage-4-nano): :func:`~.base.decoder_causal`. A
projection shipped beside the body as a top-level ``linear.weight`` (voyage-4-nano: no bias,
1024 -> 2048) is applied after the final norm, so the model's vectors are its output width;
any other tensor the checkpoint carries and this code does not read refuses the load
(``DECODER_IGNORED`` lists those it knowingly skips).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from embedding_server.device.models.base import (
    Captured,
    Checkpoint,
    Ignored,
    PackedBatch,
    PrefixStates,
    WeightReader,
    config_get,
    decoder_causal,
)
from embedding_server.device.models.layers import (
    SLIDING_ATTENTION,
    HeadSplit,
    RotaryTable,
    apply_rotary,
    layer_types,
    model_rope,
    rms_norm,
    row_linear,
)
from embedding_server.errors import UnsupportedModelError

WindowRule = Literal["none", "every_layer", "opt_in"]
"""Which layers slide: none; every layer when ``sliding_window`` is set (Mistral); or, with
``use_sliding_window`` on, the layers ``layer_types`` / ``max_window_layers`` pick (Qwen)."""


DECODER_IGNORED = (
    Ignored(
        r"lm_head\.weight",
        "the language-model head of a *ForCausalLM checkpoint (next-token logits); an "
        "embedder reads the final hidden states, and a yes/no reranker (task score) only "
        "its rows for the answer tokens",
    ),
    Ignored(
        r"(?:model\.)?(?:layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq",
        "rotary frequencies older transformers saved as a buffer; recomputed from the config",
    ),
)
"""What decoder checkpoints (Llama, Mistral, Qwen2/3, Gemma 3) carry and their body does not
read."""

PROJECTION = "linear."
"""A projection head saved beside the body (voyage-4-nano: ``linear.weight``, no bias)."""


@dataclass(frozen=True)
class DecoderVariant:
    """How one decoder ``model_type`` differs from Llama, as transformers builds it."""

    qkv_bias: bool = False
    """q/k/v projections always carry biases (Qwen2; never o)."""
    attention_bias: bool = False
    """The config's ``attention_bias`` puts biases on q/k/v/o (Llama, Qwen3)."""
    mlp_bias: bool = False
    """The config's ``mlp_bias`` puts biases on the MLP (Llama)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    window: WindowRule = "none"
    bidirectional: bool = False
    """Bidirectional by definition of the model type, whatever the config's causality flags
    (``llama_bidirec``: NVIDIA's LlamaBidirectionalModel turns causality off in code)."""

    def check_config(self, config: Mapping[str, Any]) -> None:
        """Refuse, before weights are fetched, a config that contradicts the variant."""
        if self.bidirectional and config.get("is_causal") is True:
            model_type = config.get("model_type")
            raise UnsupportedModelError(
                f"{model_type} attends bidirectionally by definition (its model class turns "
                "causal masking off), but config.json says is_causal: true; which attention "
                "the model was trained with is ambiguous: remove the flag or fix the "
                "model_type"
            )


@dataclass
class _Layer:
    window: int | None  # attention window in varlen_attention's convention; None = full
    in_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


Adapters = Callable[[int, str, torch.Tensor], torch.Tensor]
"""``(layer, projection, input) -> what the projection adds to its output`` for a batch: the
projections are ``qkv``, ``o``, ``gate_up`` and ``down``, each fed its input."""

# Defaults transformers' configuration classes apply when config.json omits the key.
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28


def sliding_windows(config: Mapping[str, Any], variant: DecoderVariant) -> list[int | None]:
    """Each layer's ``sliding_window`` (tokens), None for full attention; as transformers
    reads the config.

    * ``every_layer`` (Mistral): ``sliding_window`` (4096 when absent, off when null) applies
      to every layer; ``layer_types`` is ignored.
    * ``opt_in`` (Qwen2 / Qwen3): nothing slides unless ``use_sliding_window``; then the
      layers whose ``layer_types`` entry is ``sliding_attention`` do, or, in configs written
      before ``layer_types`` existed, layers ``>= max_window_layers`` (default 28).
    * ``none`` (Llama): no sliding window.

    transformers masks a causal query ``i`` to keys ``i - sliding_window < j <= i`` (the
    window counts the query itself); a bidirectional (``is_causal: false``) one to
    ``|i - j| <= sliding_window``.
    """
    model_type = str(config.get("model_type", "llama"))
    layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
    if variant.window == "every_layer":
        sliding = [True] * layers
    elif variant.window == "opt_in" and config.get("use_sliding_window", False):
        first = int(config.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
        kinds = layer_types(config, model_type, lambda n: [i >= first for i in range(n)])
        sliding = [kind == SLIDING_ATTENTION for kind in kinds]
    else:
        return [None] * layers
    if window is None:
        return [None] * layers
    if int(window) < 1:
        raise UnsupportedModelError(f"{model_type} sliding_window must be >= 1, got {window!r}")
    return [int(window) if slides else None for slides in sliding]


class LlamaModel(PrefixStates):
    """Llama / Mistral / Qwen2 / Qwen3 body for packed batches (causal by default)."""

    position_offset = 0

    def __init__(self, checkpoint: Checkpoint, *, variant: DecoderVariant) -> None:
        config, dtype, device = checkpoint.config, checkpoint.dtype, checkpoint.device
        model_type = str(config.get("model_type", "llama"))
        act = str(config.get("hidden_act", "silu"))
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"{model_type} activation {act!r} is not supported (only silu)"
            )
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config_get(config, "num_key_value_heads", default=self.num_heads))
        self.head_dim = int(
            config_get(config, "head_dim", default=self.hidden_size // self.num_heads)
        )
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.shard = checkpoint.shard
        self.split = split = HeadSplit.of(
            checkpoint.shard,
            model_type,
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate=int(config["intermediate_size"]),
        )
        variant.check_config(config)
        self.causal = not variant.bidirectional and decoder_causal(config, model_type)
        windows = sliding_windows(config, variant)
        self.sliding_window = next((w for w in windows if w is not None), None)
        self.dtype, self.device = dtype, device
        self.max_positions = int(config.get("max_position_embeddings", 32768))
        self.rotary = RotaryTable.of(model_rope(config), self.head_dim, dtype=dtype, device=device)
        attention_bias = variant.attention_bias and bool(config.get("attention_bias", False))
        qkv_bias = variant.qkv_bias or attention_bias
        mlp_bias = variant.mlp_bias and bool(config.get("mlp_bias", False))

        w = checkpoint.reader(
            prefixes=("model.", "transformer."),
            marker="layers.",
            architecture=model_type,
        )
        self.embed = w.embedding("embed_tokens.weight")
        self.norm = w.get("norm.weight")
        self.projection, self.projection_bias = _projection(w, config, model_type)
        if self.projection is not None:
            self.hidden_size = int(self.projection.shape[0])
        self.layers: list[_Layer] = []
        for i, window in enumerate(windows):
            p = f"layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            gate_up = [mlp + "gate_proj.", mlp + "up_proj."]
            self.layers.append(
                _Layer(
                    # transformers' causal window counts the query itself (i - j < window);
                    # its bidirectional one reaches window tokens each side (|i - j| <= window).
                    window=None if window is None else window - 1 if self.causal else window,
                    in_norm=w.get(p + "input_layernorm.weight"),
                    qkv_w=w.qkv([f"{attn}{n}_proj.weight" for n in "qkv"], split),
                    qkv_b=(
                        w.qkv([f"{attn}{n}_proj.bias" for n in "qkv"], split) if qkv_bias else None
                    ),
                    q_norm=w.maybe(attn + "q_norm.weight", variant.qk_norm),
                    k_norm=w.maybe(attn + "k_norm.weight", variant.qk_norm),
                    o_w=w.columns(attn + "o_proj.weight", split.q),
                    o_b=w.maybe(attn + "o_proj.bias", attention_bias),
                    post_norm=w.get(p + "post_attention_layernorm.weight"),
                    gate_up_w=w.cat([n + "weight" for n in gate_up], (split.mlp, split.mlp)),
                    gate_up_b=(
                        w.cat([n + "bias" for n in gate_up], (split.mlp, split.mlp))
                        if mlp_bias
                        else None
                    ),
                    down_w=w.columns(mlp + "down_proj.weight", split.mlp),
                    down_b=w.maybe(mlp + "down_proj.bias", mlp_bias),
                )
            )

    def _run(self, batch: PackedBatch, captured: Captured | None) -> torch.Tensor:
        """The forward pass; each layer's keys (after RoPE) and values appended to
        ``captured`` when given."""
        t = batch.input_ids.shape[0]
        hq, hkv, d, shard = self.split.heads, self.split.kv_heads, self.head_dim, self.shard
        rope = self.rotary.lookup(batch.position_ids, batch.max_position)
        adapt = self._adapters(batch)

        def plus(out: torch.Tensor, i: int, kind: str, x: torch.Tensor) -> torch.Tensor:
            return out if adapt is None else out + adapt(i, kind, x)

        x = self.embed(batch.input_ids)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.in_norm, self.eps)
            qkv = plus(F.linear(h, layer.qkv_w, layer.qkv_b), i, "qkv", h)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = rms_norm(q, layer.q_norm, self.eps)
                k = rms_norm(k, layer.k_norm, self.eps)
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            if captured is not None:
                captured.append((k, v))
            attn = batch.attention(
                q, k, v, causal=self.causal, scale=self.scale, window=layer.window, layer=i
            ).reshape(t, hq * d)
            x = plus(x + row_linear(attn, layer.o_w, layer.o_b, shard), i, "o", attn)
            h = rms_norm(x, layer.post_norm, self.eps)
            gate_up = plus(F.linear(h, layer.gate_up_w, layer.gate_up_b), i, "gate_up", h)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
            x = plus(x + row_linear(act, layer.down_w, layer.down_b, shard), i, "down", act)
        x = rms_norm(x, self.norm, self.eps)
        if self.projection is not None:
            x = F.linear(x, self.projection, self.projection_bias)
        return x

    def _adapters(self, batch: PackedBatch) -> Adapters | None:
        """What each projection of a batch adds to its output (LoRA, :data:`Adapters`);
        None: nothing (the plain body)."""
        return None


def _projection(
    w: WeightReader, config: Mapping[str, Any], model_type: str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The top-level ``linear`` projection and its bias, when the checkpoint ships one
    (whole on every tensor-parallel rank: it runs on the all-reduced final states)."""
    weight_name = PROJECTION + "weight"
    if weight_name not in w:
        return None, None
    weight = w.get(weight_name)
    bias = w.maybe(PROJECTION + "bias", PROJECTION + "bias" in w)
    hidden = int(config["hidden_size"])
    rows, columns = (int(n) for n in weight.shape)
    if columns != hidden:
        raise UnsupportedModelError(
            f"{model_type} checkpoint's top-level projection {weight_name} is {rows}x{columns} "
            f"but hidden_size is {hidden}; it cannot be applied after the final norm"
        )
    declared = config.get("num_labels")
    if isinstance(declared, int) and declared != rows:
        raise UnsupportedModelError(
            f"{model_type} checkpoint's projection {weight_name} has {rows} outputs but "
            f"config.json says num_labels {declared}; the checkpoint and its config disagree"
        )
    return weight, bias

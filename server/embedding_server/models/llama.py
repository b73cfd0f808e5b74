"""Decoder-only embedders on packed tokens: Llama, Mistral, Qwen2, Qwen3.

Covers Qwen3-Embedding, gte-Qwen2 and e5-mistral (last-token pooling). Pre-RMSNorm blocks,
rotary position embeddings (``rope_theta``; default, linear and llama3 scaling),
grouped-query attention, causal masks, SwiGLU MLP. The family members differ only in small
switches, kept as data here rather than as four copies of the code:

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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..attention import flash_available, varlen_attention
from ..errors import UnsupportedModelError
from .base import PackedBatch, config_get, strip_prefix, take


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as Hugging Face's implementation does."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_inv_freq(config: Mapping[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse rotary frequencies, including the scalings published embedders use.

    Checkpoints saved by transformers >= 5 nest ``rope_theta`` and the scaling in
    ``rope_parameters``; older ones keep ``rope_theta`` / ``rope_scaling`` at top level.
    """
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(
        f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3"
    )


# Defaults transformers' configuration classes apply when config.json omits the key.
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28
_LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_windows(config: Mapping[str, Any]) -> list[int | None]:
    """Each layer's ``sliding_window`` (tokens), None for full attention; as transformers
    reads the config.

    * Mistral: ``sliding_window`` (4096 when absent, off when null) applies to every layer;
      Mistral ignores ``layer_types``.
    * Qwen2 / Qwen3: nothing slides unless ``use_sliding_window``; then the layers whose
      ``layer_types`` entry is ``sliding_attention`` do, or, in configs written before
      ``layer_types`` existed, layers ``>= max_window_layers`` (default 28).
    * Llama: no sliding window.

    transformers masks a causal query ``i`` to keys ``i - sliding_window < j <= i`` (the
    window counts the query itself); a bidirectional (``is_causal: false``) one to
    ``|i - j| <= sliding_window``.
    """
    model_type = str(config.get("model_type", "llama"))
    layers = int(config["num_hidden_layers"])
    if model_type == "mistral":
        window = config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
        sliding = [True] * layers
    elif model_type in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False):
            return [None] * layers
        window = config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
        if config.get("layer_types") is None:
            first = int(config.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
            sliding = [i >= first for i in range(layers)]
        else:
            sliding = sliding_layer_types(config, model_type, layers)
    else:
        return [None] * layers
    if window is None:
        return [None] * layers
    if int(window) < 1:
        raise UnsupportedModelError(f"{model_type} sliding_window must be >= 1, got {window!r}")
    return [int(window) if slides else None for slides in sliding]


def sliding_layer_types(config: Mapping[str, Any], model_type: str, layers: int) -> list[bool]:
    """Which layers the config's ``layer_types`` marks ``sliding_attention``; refuses a list
    that does not name each layer as full or sliding attention."""
    types = config["layer_types"]
    unknown = sorted({str(t) for t in types} - set(_LAYER_TYPES))
    if unknown or len(types) != layers:
        raise UnsupportedModelError(
            f"{model_type} layer_types must name each of the {layers} layers as one "
            f"of {', '.join(_LAYER_TYPES)}; got {list(types)!r}"
        )
    return [t == "sliding_attention" for t in types]


class RotaryTable:
    """cos/sin of the rotary embedding per position, in the model dtype, grown on demand.

    Computed in float32 from ``inv_freq`` and cast, as transformers does for each forward.
    """

    def __init__(self, inv_freq: torch.Tensor, *, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = inv_freq.to(device)
        self.dtype, self.device = dtype, device
        dim = 2 * inv_freq.shape[0]
        self._cos = torch.empty(0, dim, dtype=dtype, device=device)
        self._sin = torch.empty(0, dim, dtype=dtype, device=device)

    def lookup(
        self, positions: torch.Tensor, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` for ``positions`` (all ``<= max_position``), ``[T, 1, head_dim]``."""
        if self._cos.shape[0] <= max_position:
            size = max(2 * self._cos.shape[0], max_position + 1, 512)
            freqs = torch.outer(
                torch.arange(size, device=self.device, dtype=torch.float32), self.inv_freq.float()
            )
            emb = torch.cat([freqs, freqs], dim=-1)
            self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)


class LlamaModel:
    """Llama / Mistral / Qwen2 / Qwen3 body for packed batches (causal by default)."""

    position_offset = 0

    def __init__(
        self,
        config: Mapping[str, Any],
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
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
        # Some embedders (gte-Qwen2 variants) declare bidirectional attention.
        self.causal = bool(config.get("is_causal", True))
        windows = sliding_windows(config)
        self.sliding_window = next((w for w in windows if w is not None), None)
        self.dtype, self.device = dtype, device
        self.max_positions = int(config.get("max_position_embeddings", 32768))
        self.rotary = RotaryTable(rope_inv_freq(config, self.head_dim), dtype=dtype, device=device)
        qk_norm = model_type == "qwen3"
        # Which projections carry biases, as transformers builds each model type: Qwen2 always
        # on q/k/v (never o); Llama and Qwen3 on q/k/v/o when attention_bias, Llama's MLP when
        # mlp_bias; Mistral never (it ignores both flags).
        attention_bias = model_type in ("llama", "qwen3") and bool(
            config.get("attention_bias", False)
        )
        qkv_bias = model_type == "qwen2" or attention_bias
        mlp_bias = model_type == "llama" and bool(config.get("mlp_bias", False))

        w = strip_prefix(weights, ("model.", "transformer."), "layers.")

        def get(name: str) -> torch.Tensor:
            return take(w, name, dtype, device, architecture=model_type)

        self.embed = get("embed_tokens.weight")
        self.norm = get("norm.weight")
        self.layers: list[_Layer] = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"layers.{i}."
            qkv_w = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = (
                torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                if qkv_bias
                else None
            )
            window = windows[i]
            self.layers.append(
                _Layer(
                    # transformers' causal window counts the query itself (i - j < window);
                    # its bidirectional one reaches window tokens each side (|i - j| <= window).
                    window=None if window is None else window - 1 if self.causal else window,
                    in_norm=get(p + "input_layernorm.weight"),
                    qkv_w=qkv_w,
                    qkv_b=qkv_b,
                    q_norm=get(p + "self_attn.q_norm.weight") if qk_norm else None,
                    k_norm=get(p + "self_attn.k_norm.weight") if qk_norm else None,
                    o_w=get(p + "self_attn.o_proj.weight"),
                    o_b=get(p + "self_attn.o_proj.bias") if attention_bias else None,
                    post_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up_w=torch.cat(
                        [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]
                    ),
                    gate_up_b=(
                        torch.cat([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")])
                        if mlp_bias
                        else None
                    ),
                    down_w=get(p + "mlp.down_proj.weight"),
                    down_b=get(p + "mlp.down_proj.bias") if mlp_bias else None,
                )
            )

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        t = batch.input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.rotary.lookup(batch.position_ids, batch.max_seqlen)
        x = self.embed[batch.input_ids]
        plan = None if flash_available(x) else batch.attention_plan
        for layer in self.layers:
            h = rms_norm(x, layer.in_norm, self.eps)
            qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = rms_norm(q, layer.q_norm, self.eps)
                k = rms_norm(k, layer.k_norm, self.eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attn = varlen_attention(
                q,
                k,
                v,
                cu_seqlens=batch.cu_seqlens,
                max_seqlen=batch.max_seqlen,
                causal=self.causal,
                plan=plan,
                scale=self.scale,
                window=layer.window,
            )
            x = x + F.linear(attn.reshape(t, hq * d), layer.o_w, layer.o_b)
            h = rms_norm(x, layer.post_norm, self.eps)
            gate, up = F.linear(h, layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down_w, layer.down_b)
        return rms_norm(x, self.norm, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's pairing: ``[-x2, x1]`` for the halves ``x1``, ``x2``."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

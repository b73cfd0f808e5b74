"""Gemma 2 on packed tokens (``model_type: gemma2``): BAAI/bge-multilingual-gemma2 and Gemma 2
language models used as embedders.

Gemma 3's block (:mod:`.gemma3`) without the q/k norms and with one rope for every layer, plus
attention logit soft-capping; the shared :mod:`.layers` give the rest:

* token embeddings times ``sqrt(hidden_size)``, the scale rounded to the model dtype first;
* Gemma's RMSNorm (``1 + weight``, multiplied in float32), four per block: ``input_layernorm``
  / ``post_attention_layernorm`` around attention, ``pre_feedforward_layernorm`` /
  ``post_feedforward_layernorm`` around the GeGLU MLP (``gelu_pytorch_tanh``), each output
  normed before its residual add (sandwich norms);
* attention scale ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``), ``head_dim``
  its own setting;
* ``attn_logit_softcapping`` (50 in every Gemma 2): logits become ``cap * tanh(logits / cap)``
  after the scale, before mask and softmax. flash-attn (>= 2.6, ``softcap``) does it in the
  kernel; torch's varlen_attn and SDPA cannot, so the registry declares it
  (``Architecture.attention_softcap``): the kernel choice passes over torch_varlen and the SDPA
  paths compute this attention eagerly, saying so in ``/info``'s ``attention_passed_over``;
* ``layer_types``, or in configs written before it, alternate sliding (even layers) and full
  (odd) attention, as transformers has always read Gemma 2; a sliding layer's causal query
  ``i`` sees ``i - sliding_window < j <= i``;
* ``final_logit_softcapping`` caps the LM head's vocabulary logits: an embedder never computes
  them (the ``lm_head`` is not read), so it does not change a hidden state and is ignored.

Causal only: bge-multilingual-gemma2 is, and pools the last token (the registry's default for
decoders; its sentence-transformers config says the same). transformers' Gemma 2 with
``use_bidirectional_attention`` drops the causal flag but still builds causal masks, an
ambiguity not served here (:func:`check_config`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.errors import UnsupportedModelError

from .base import Checkpoint, PackedBatch, config_get, decoder_causal
from .layers import (
    SLIDING_ATTENTION,
    HeadSplit,
    RotaryTable,
    apply_rotary,
    gemma_rms_norm,
    layer_types,
    model_rope,
    row_linear,
)

# Gemma2Config's defaults, for keys config.json may omit.
_DEFAULT_HEAD_DIM = 256
_DEFAULT_KV_HEADS = 4
_DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_ATTN_SOFTCAP = 50.0
# transformers' activation names -> torch's gelu ``approximate``.
_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def attention_softcap(config: Mapping[str, Any]) -> float | None:
    """The config's ``attn_logit_softcapping`` (Gemma2Config's 50 when the key is absent;
    None when it is null: no capping)."""
    if "attn_logit_softcapping" not in config:
        return _DEFAULT_ATTN_SOFTCAP
    cap = config["attn_logit_softcapping"]
    return None if cap is None else float(cap)


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, before any weight is fetched, Gemma 2 configs not served exactly."""
    if not decoder_causal(config, "gemma2"):
        raise UnsupportedModelError(
            "gemma2 with bidirectional attention (is_causal: false or "
            "use_bidirectional_attention: true) is not supported: transformers' Gemma 2 then "
            "drops the causal flag but still builds causal masks, so which attention the "
            "model was trained with is ambiguous. Gemma 2 embedders such as "
            "BAAI/bge-multilingual-gemma2 are causal: remove the flag if the model is too"
        )
    cap = attention_softcap(config)
    if cap is not None and not cap > 0:
        raise UnsupportedModelError(
            f"gemma2 attn_logit_softcapping must be a positive number or null; got {cap!r}"
        )
    act = str(config_get(config, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"))
    if act not in _GELU_APPROXIMATION:
        raise UnsupportedModelError(
            f"gemma2 activation {act!r} is not supported "
            f"(supported: {', '.join(_GELU_APPROXIMATION)})"
        )


@dataclass
class _Layer:
    window: int | None  # attention window in varlen_attention's convention; None = full
    in_norm: torch.Tensor  # norms hold 1 + weight, float32
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_attn_norm: torch.Tensor
    pre_ff_norm: torch.Tensor
    post_ff_norm: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


class Gemma2Model:
    """Gemma 2 body for packed batches (causal, soft-capped attention logits)."""

    position_offset = 0
    causal = True

    def __init__(self, checkpoint: Checkpoint) -> None:
        config, dtype, device = checkpoint.config, checkpoint.dtype, checkpoint.device
        check_config(config)
        act = str(
            config_get(config, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
        )
        self.gelu_approximation = _GELU_APPROXIMATION[act]
        self.softcap = attention_softcap(config)
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(
            config_get(config, "num_key_value_heads", default=_DEFAULT_KV_HEADS)
        )
        self.head_dim = int(config_get(config, "head_dim", default=_DEFAULT_HEAD_DIM))
        self.eps = float(config_get(config, "rms_norm_eps", default=1e-6))
        scalar = config_get(config, "query_pre_attn_scalar", default=_DEFAULT_QUERY_PRE_ATTN_SCALAR)
        self.scale = float(scalar) ** -0.5
        self.max_positions = int(config_get(config, "max_position_embeddings", default=8192))
        self.dtype, self.device = dtype, device
        self.shard = checkpoint.shard
        self.split = split = HeadSplit.of(
            checkpoint.shard,
            "gemma2",
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate=int(config["intermediate_size"]),
        )
        # Before layer_types, Gemma 2 slid on even layers (transformers 4.42: not layer_idx % 2).
        kinds = layer_types(config, "gemma2", lambda n: [i % 2 == 0 for i in range(n)])
        local = [kind == SLIDING_ATTENTION for kind in kinds]
        window = config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
        if any(local) and (window is None or int(window) < 1):
            raise UnsupportedModelError(
                f"gemma2 sliding_window must be >= 1 when layer_types has sliding_attention "
                f"layers; got {window!r}"
            )
        self.sliding_window = int(window) if any(local) else None
        # varlen_attention's window counts the keys before the query; transformers' causal
        # window counts the query itself (i - j < sliding_window).
        attention_window = None if self.sliding_window is None else self.sliding_window - 1
        self.rotary = RotaryTable.of(model_rope(config), self.head_dim, dtype=dtype, device=device)
        bias = bool(config.get("attention_bias", False))

        w = checkpoint.reader(prefixes=("model.",), marker="layers.", architecture="gemma2")
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
                    window=attention_window if is_local else None,
                    in_norm=norm(p + "input_layernorm.weight"),
                    qkv_w=w.qkv([p + f"self_attn.{n}_proj.weight" for n in "qkv"], split),
                    qkv_b=(
                        w.qkv([p + f"self_attn.{n}_proj.bias" for n in "qkv"], split)
                        if bias
                        else None
                    ),
                    o_w=w.columns(p + "self_attn.o_proj.weight", split.q),
                    o_b=w.maybe(p + "self_attn.o_proj.bias", bias),
                    post_attn_norm=norm(p + "post_attention_layernorm.weight"),
                    pre_ff_norm=norm(p + "pre_feedforward_layernorm.weight"),
                    post_ff_norm=norm(p + "post_feedforward_layernorm.weight"),
                    gate_up_w=w.cat(
                        [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                        (split.mlp, split.mlp),
                    ),
                    down_w=w.columns(p + "mlp.down_proj.weight", split.mlp),
                )
            )

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        t = batch.input_ids.shape[0]
        hq, hkv, d, eps = self.split.heads, self.split.kv_heads, self.head_dim, self.eps
        rope = self.rotary.lookup(batch.position_ids, batch.max_seqlen)
        x = self.embed(batch.input_ids) * self.embed_scale
        for layer in self.layers:
            h = gemma_rms_norm(x, layer.in_norm, eps)
            qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            attn = batch.attention(
                q, k, v, causal=True, scale=self.scale, window=layer.window, softcap=self.softcap
            )
            h = row_linear(attn.reshape(t, hq * d), layer.o_w, layer.o_b, self.shard)
            x = x + gemma_rms_norm(h, layer.post_attn_norm, eps)
            h = gemma_rms_norm(x, layer.pre_ff_norm, eps)
            gate, up = F.linear(h, layer.gate_up_w).chunk(2, dim=-1)
            h = F.gelu(gate, approximate=self.gelu_approximation) * up
            h = row_linear(h, layer.down_w, None, self.shard)
            x = x + gemma_rms_norm(h, layer.post_ff_norm, eps)
        return gemma_rms_norm(x, self.norm, eps)

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

from collections.abc import Mapping
from typing import Any

from embedding_server.device.models.base import decoder_causal
from embedding_server.device.models.gemma3 import (
    _GELU_APPROXIMATION,
    Gemma3TextModel,
    gelu_activation,
)
from embedding_server.device.models.layers import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    layer_types,
    model_rope,
)
from embedding_server.errors import UnsupportedModelError

_DEFAULT_ATTN_SOFTCAP = 50.0  # Gemma2Config's, for configs that omit the key


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
    act = gelu_activation(config)
    if act not in _GELU_APPROXIMATION:
        raise UnsupportedModelError(
            f"gemma2 activation {act!r} is not supported "
            f"(supported: {', '.join(_GELU_APPROXIMATION)})"
        )


class Gemma2Model(Gemma3TextModel):
    """Gemma 2 body for packed batches (causal, soft-capped attention logits)."""

    model_type = "gemma2"
    qk_norm = False
    default_max_positions = 8192

    def check(self, config: Mapping[str, Any]) -> None:
        check_config(config)

    def attention_softcap(self, config: Mapping[str, Any]) -> float | None:
        return attention_softcap(config)

    def local_layers(self, config: Mapping[str, Any]) -> list[bool]:
        # Before layer_types, Gemma 2 slid on even layers (transformers 4.42: not layer_idx % 2).
        kinds = layer_types(config, "gemma2", lambda n: [i % 2 == 0 for i in range(n)])
        return [kind == SLIDING_ATTENTION for kind in kinds]

    def ropes(self, config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        rope = model_rope(config)  # one rope for every layer
        return {FULL_ATTENTION: rope, SLIDING_ATTENTION: rope}

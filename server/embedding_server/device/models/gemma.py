"""Gemma (1) on packed tokens (``model_type: gemma``): BAAI/bge-reranker-v2-gemma, a
``GemmaForCausalLM`` served as a yes/no reranker (task score), and Gemma language models
used as embedders.

Gemma 2's body (:mod:`.gemma2`, itself Gemma 3's) with less in it, so it subclasses
:class:`.gemma3.Gemma3TextModel` and overrides its hooks:

* token embeddings times ``sqrt(hidden_size)``, the scale rounded to the model dtype first;
* Gemma's RMSNorm (``1 + weight``, multiplied in float32), but Llama's two per block:
  ``input_layernorm`` before attention and ``post_attention_layernorm`` before the MLP, no
  norm on either sublayer's output (no sandwich norms);
* GeGLU MLP with gelu's tanh approximation: the published configs say ``hidden_act: gelu``,
  which transformers (5, and 4.x through ``hidden_activation``'s default) reads as
  ``gelu_pytorch_tanh``; an explicit ``hidden_activation`` that contradicts it is refused;
* attention scale ``head_dim ** -0.5`` (no ``query_pre_attn_scalar``), ``head_dim`` its own
  setting (256), no q/k norms, no logit cap, no sliding window: every layer attends fully,
  with one rope (``rope_theta``, 10k).

Causal only, as :mod:`.gemma2`: transformers' Gemma with ``use_bidirectional_attention``
drops the causal flag but still builds causal masks (:func:`check_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from embedding_server.device.models.base import config_get, decoder_causal
from embedding_server.device.models.gemma3 import Gemma3TextModel
from embedding_server.device.models.layers import FULL_ATTENTION, SLIDING_ATTENTION, model_rope
from embedding_server.errors import UnsupportedModelError

# What transformers' GemmaMLP runs for each activation name a Gemma config holds: "gelu"
# is the original releases' value, meant (and converted to) the tanh approximation.
_APPROXIMATION = {"gelu": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}


def gelu_approximation(config: Mapping[str, Any]) -> str:
    """torch's gelu ``approximate`` for the config, or UnsupportedModelError: ``hidden_act``
    (transformers 5 reads it alone), checked against ``hidden_activation`` where a config
    written for transformers 4 sets one."""
    act = str(config_get(config, "hidden_act", default="gelu_pytorch_tanh"))
    legacy = config.get("hidden_activation")
    names = [act] if legacy is None else [act, str(legacy)]
    for name in names:
        if name not in _APPROXIMATION:
            raise UnsupportedModelError(
                f"gemma activation {name!r} is not supported "
                f"(supported: {', '.join(_APPROXIMATION)}, each gelu's tanh approximation as "
                "transformers runs Gemma)"
            )
    return _APPROXIMATION[act]


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, before any weight is fetched, Gemma configs not served exactly."""
    if not decoder_causal(config, "gemma"):
        raise UnsupportedModelError(
            "gemma with bidirectional attention (is_causal: false or "
            "use_bidirectional_attention: true) is not supported: transformers' Gemma then "
            "drops the causal flag but still builds causal masks, so which attention the "
            "model was trained with is ambiguous. bge-reranker-v2-gemma is causal: remove the "
            "flag if the model is too"
        )
    gelu_approximation(config)


class GemmaModel(Gemma3TextModel):
    """Gemma body for packed batches (causal, Llama's two norms per block)."""

    model_type = "gemma"
    qk_norm = False
    sandwich = False
    default_max_positions = 8192
    default_kv_heads = 16  # GemmaConfig's

    def check(self, config: Mapping[str, Any]) -> None:
        check_config(config)

    def gelu_approximation_of(self, config: Mapping[str, Any]) -> str:
        return gelu_approximation(config)

    def attention_scale(self, config: Mapping[str, Any], head_dim: int) -> float:
        scale: float = float(head_dim) ** -0.5  # GemmaAttention's scaling
        return scale

    def local_layers(self, config: Mapping[str, Any]) -> list[bool]:
        return [False] * int(config["num_hidden_layers"])

    def ropes(self, config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        rope = model_rope(config)  # one rope for every layer
        return {FULL_ATTENTION: rope, SLIDING_ATTENTION: rope}

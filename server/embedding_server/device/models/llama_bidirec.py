"""NVIDIA's bidirectional Llama checkpoints (``llama_bidirec``): what sets them apart from the
Llama body they share (``llama.py``, the ``LLAMA_BIDIREC`` variant).

Their custom code (``llama_bidirectional_model.py``, not run) pools by the config's
``pooling``: ``avg`` (the mean over the tokens), ``cls`` or ``last``. The embedder
(llama-nemotron-embed-1b-v2, ``LlamaBidirectionalModel``) returns that vector; the reranker
(llama-nemotron-rerank-1b-v2, ``LlamaBidirectionalForSequenceClassification``) puts it
through ``score`` (a Linear without bias) and divides the logit by the config's
``temperature``. vLLM reads ``pooling`` the same way and refuses any other value; the
authors' code would silently fall back to the first token, so we refuse it too. The
reranker's pair prompt is ``embedding_server.request.heads.NEMOTRON_RERANK``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from embedding_server.device.heads import ClassificationHead, HeadWeights
from embedding_server.device.models.llama import DecoderVariant
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.pooling import PoolingMethod

LLAMA_BIDIREC = DecoderVariant(attention_bias=True, mlp_bias=True, bidirectional=True)
"""A LlamaModel whose layers attend both ways, whatever config.json's flags say."""

POOLING: dict[str, PoolingMethod] = {"avg": "mean", "cls": "cls", "last": "last"}
"""config.json's ``pooling`` -> ours, as the authors' ``_pool`` computes each."""


def declared_pooling(config: Mapping[str, Any]) -> PoolingMethod | None:
    """The pooling the config's ``pooling`` names (None when it names none)."""
    name = config.get("pooling")
    return None if name is None else POOLING.get(str(name))


def temperature(config: Mapping[str, Any]) -> float:
    """The config's ``temperature`` (1.0 when absent), which the reranker's logit is divided
    by; refused unless a positive finite number."""
    value = config.get("temperature", 1.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise UnsupportedModelError(
            f"llama_bidirec temperature must be a positive number, got {value!r}"
        )
    if not math.isfinite(value):
        raise UnsupportedModelError(f"llama_bidirec temperature must be finite, got {value!r}")
    return float(value)


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, before weights are fetched, what its model class would not compute as we do."""
    LLAMA_BIDIREC.check_config(config)
    name = config.get("pooling")
    if name is not None and str(name) not in POOLING:
        raise UnsupportedModelError(
            f"llama_bidirec pooling {name!r} is not supported (supported: "
            f"{', '.join(POOLING)}); its authors' code would pool the first token for it, "
            "which is not what the name says"
        )
    temperature(config)


def classification_head(
    w: HeadWeights, per_token: bool
) -> tuple[ClassificationHead, PoolingMethod]:
    """The reranker's ``score`` over the pooled state, divided by ``temperature`` (folded
    into the weight); no bias, as its ``nn.Linear(bias=False)`` (a ``score.bias`` in the
    checkpoint is left unread, and so refuses the load)."""
    if per_token:
        raise UnsupportedModelError(
            f"{w.architecture}: token classification is not supported for llama_bidirec"
        )
    weight = w.get("score.weight") / temperature(w.config)
    return ClassificationHead(weight=weight, bias=None), declared_pooling(w.config) or "mean"

"""Model registry: ``config.json``'s ``model_type`` -> our packed implementation.

Capabilities are declared here, not guessed at run time: each entry says which family module
builds it and what pooling the architecture implies when the checkpoint has no
sentence-transformers config (CLS for encoders, last token for decoders; Gemma 3 too, since
only its last token has seen the whole input when it runs causally: EmbeddingGemma declares
mean pooling in its sentence-transformers config, which wins). Model types we recognise but
refuse say why and what to serve instead (``REFUSED``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..pooling import PoolingMethod
from .base import EmbeddingModel, PackedBatch
from .bert import BertModel
from .gemma3 import MULTIMODAL_REFUSAL, Gemma3TextModel
from .llama import LlamaModel
from .modernbert import ModernBertModel

ModelBuilder = Callable[..., EmbeddingModel]


@dataclass(frozen=True)
class Architecture:
    """How to build one ``model_type``."""

    model_type: str
    family: str
    builder: ModelBuilder
    default_pooling: PoolingMethod


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture("bert", "bert", BertModel, "cls"),
        Architecture("roberta", "bert", BertModel, "cls"),
        Architecture("xlm-roberta", "bert", BertModel, "cls"),
        Architecture("modernbert", "modernbert", ModernBertModel, "cls"),
        Architecture("llama", "llama", LlamaModel, "last"),
        Architecture("mistral", "llama", LlamaModel, "last"),
        Architecture("qwen2", "llama", LlamaModel, "last"),
        Architecture("qwen3", "llama", LlamaModel, "last"),
        Architecture("gemma3_text", "gemma3", Gemma3TextModel, "last"),
    )
}

REFUSED: dict[str, str] = {"gemma3": MULTIMODAL_REFUSAL}


def lookup(config: Mapping[str, Any]) -> Architecture:
    """The registry entry for a config, or UnsupportedModelError naming what we support."""
    model_type = str(config.get("model_type", ""))
    arch = ARCHITECTURES.get(model_type)
    if arch is None and model_type in REFUSED:
        raise UnsupportedModelError(REFUSED[model_type])
    if arch is None:
        names = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise UnsupportedModelError(
            f"model_type {model_type!r} ({names}) is not supported; supported model types: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return arch


def build_model(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> EmbeddingModel:
    """Instantiate the packed implementation for ``config`` from HF-named weights."""
    return lookup(config).builder(config, weights, dtype=dtype, device=device)


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "EmbeddingModel",
    "PackedBatch",
    "build_model",
    "lookup",
]

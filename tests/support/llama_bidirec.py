"""NVIDIA's bidirectional-Llama checkpoints as they ship on the Hub (llama-nemotron-embed-1b-v2
and llama-nemotron-rerank-1b-v2): a tiny Llama with llama3 rope, rewritten into their
``llama_bidirec`` config with the custom-code classes named (never run)."""

from __future__ import annotations

from typing import Any

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
"""The tiny base Llama's rope: llama3 scaling, as both checkpoints use, over 32 positions."""


def hub_config(architecture: str, auto_class: str, **extra: Any) -> dict[str, Any]:
    """The config keys the Hub checkpoint adds to a plain Llama: its model type, the custom
    class ``architecture`` registered under ``auto_class``, its pooling and temperature."""
    return {
        "model_type": "llama_bidirec",
        "architectures": [architecture],
        "auto_map": {
            "AutoConfig": "llama_bidirectional_model.LlamaBidirectionalConfig",
            auto_class: f"llama_bidirectional_model.{architecture}",
        },
        "pooling": "avg",
        "temperature": 1.0,
        **extra,
    }


EMBED_CONFIG = hub_config("LlamaBidirectionalModel", "AutoModel")
"""llama-nemotron-embed-1b-v2's config keys."""

"""What the benchmarks build their random models from: the packaged MiniLM's tokenizer, and a
1-layer, 32-wide BERT with it (near-zero compute, so that what a benchmark measures around it
is the server's own cost, not the model's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
"""What is copied from the packaged MiniLM (those of them it has)."""


def copy_tokenizer(path: Path) -> None:
    """The packaged MiniLM's :data:`TOKENIZER_FILES` into the folder ``path``."""
    from embedding_server.device.hub import resolve_model_path
    from embedding_server.settings import DEFAULT_MODEL

    source = resolve_model_path(DEFAULT_MODEL)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)


def build_tiny_bert(path: Path, *, cross_encoder: bool = False) -> Path:
    """The model at ``path``, built there unless a ``config.json`` already is: a bare
    ``BertModel``, or with ``cross_encoder`` a ``BertForSequenceClassification`` of one label."""
    from embedding_server.device.hub import resolve_model_path
    from embedding_server.settings import DEFAULT_MODEL
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    if (path / "config.json").exists():
        return path
    source = resolve_model_path(DEFAULT_MODEL, revision=None, cache_dir=None)
    path.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(path)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    if cross_encoder:
        config.num_labels = 1
        BertForSequenceClassification(config).save_pretrained(path)
    else:
        BertModel(config).save_pretrained(path)
    return path


def build_tiny_qwen3_reranker(path: Path) -> Path:
    """The model at ``path``, built there unless a ``config.json`` already is: a 1-layer
    ``Qwen3ForCausalLM`` with MiniLM's tokenizer (which has the "yes" and "no" tokens), which
    ``--task score`` serves as a Qwen3-Reranker: its prompt around every pair."""
    from embedding_server.device.hub import resolve_model_path
    from embedding_server.settings import DEFAULT_MODEL
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    source = resolve_model_path(DEFAULT_MODEL, revision=None, cache_dir=None)
    path.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(path)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path

"""Shared fixtures for the server tests (engine fixtures; model builders: tests.support.models)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

# The tests never reach the Hugging Face Hub: everything is local or built on the fly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.models import (
    MINILM_DIR,
    build_bert,
    build_deberta,
    build_decoder,
    build_mpnet,
    build_xlm_roberta,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: a tiny random model directory per model_type, built once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in cache:
            target = root / model_type
            if model_type == "bert":
                cache[model_type] = build_bert(target)
            elif model_type == "xlm-roberta":
                cache[model_type] = build_xlm_roberta(target)
            elif model_type == "mpnet":
                cache[model_type] = build_mpnet(target)
            elif model_type == "deberta-v2":  # DeBERTa-v3's layout
                cache[model_type] = build_deberta(target)
            else:
                cache[model_type] = build_decoder(target, model_type)
        return cache[model_type]

    return get


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return MINILM_DIR


@pytest.fixture(scope="session")
def minilm_engine():  # type: ignore[no-untyped-def]
    """The packaged all-MiniLM-L6-v2 in float32, loaded once (not started)."""
    from embedding_server.engine import Engine

    return Engine.from_pretrained(dtype="float32")

"""When the checkpoint does not say how it pools, ``inspect`` and the serve log say the
pooling is a guess and how to set it.

e5-small without its sentence-transformers pooling files gets BERT's first token, where e5
means the mean; a ``Qwen2Model`` embedder trained with the mean gets the last token. Both
serve vectors of the right shape, so the note is the only sign.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from embedding_server.cli import format_inspection
from embedding_server.device.inspection import Inspection, inspect_model
from embedding_server.engine import Engine
from embedding_server.settings import EngineSettings

from tests.support.jina_bert import build_jina_bert
from tests.support.models import add_sentence_transformers, build_decoder
from tests.support.tasks import build_classifier


def _inspect(path: Path, **settings: Any) -> Inspection:
    return inspect_model(EngineSettings(model=str(path), dtype="float32", **settings))


def test_a_bert_without_pooling_files_is_said_to_get_a_guessed_cls(
    tiny_model: Callable[[str], Path],
) -> None:
    inspection = _inspect(tiny_model("bert"))  # e5-small's layout without 1_Pooling
    note = inspection.pooling_note
    assert note is not None and note.startswith("pooling cls is a guess")
    assert "no sentence-transformers files" in note and "--pooling" in note
    assert "BertModel default" in note
    printed = format_inspection(inspection)
    assert "note: pooling cls is a guess" in printed
    assert "cls (a guess, see the note)" in printed
    assert inspection.to_dict()["pooling_note"] == note


def test_a_qwen2_body_without_pooling_files_is_said_to_get_a_guessed_last_token(
    tmp_path: Path,
) -> None:
    """Qwen2-7B-Instruct-embed-base's shape: a ``Qwen2Model`` with no sentence-transformers
    files, trained with the mean."""
    path = build_decoder(tmp_path / "qwen2", "qwen2")
    note = _inspect(path).pooling_note
    assert note is not None and note.startswith("pooling last is a guess")
    assert "the last token's state" in note
    assert _inspect(path, pooling="mean").pooling_note is None  # the way out it names


def test_a_declared_pooling_gets_no_note(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    st = add_sentence_transformers(tiny_model("bert"), pooling="mean", name="declared")
    assert _inspect(st).pooling_note is None
    jina = build_jina_bert(tmp_path / "jina-bert")  # config.json's emb_pooler: mean
    assert _inspect(jina).pooling_note is None
    classifier = build_classifier(tmp_path / "classifier", "bert", 1)  # a head, not a pooling
    assert _inspect(classifier, task="score").pooling_note is None


def test_serving_logs_the_guess_at_warning_level(
    tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    path = tiny_model("bert")
    with caplog.at_level(logging.WARNING, logger="embedding_server.engine"):
        Engine.from_pretrained(str(path), dtype="float32")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("pooling cls is a guess" in m and str(path) in m for m in warnings), warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="embedding_server.engine"):
        Engine.from_pretrained(str(path), dtype="float32", pooling="cls")
    assert not any("is a guess" in r.getMessage() for r in caplog.records)

"""A stanford-colbert ``HF_ColBERT`` checkpoint served end to end through the Engine, against
the reference ``test_colbert_augmentation.py`` restates (stanford-colbert's tensorize,
``ColBERT.query``/``doc`` and MaxSim over transformers' eager ``BertModel``): the vectors of
queries and documents, float32 >= 0.99999 and bfloat16 >= 0.999 cosine per token, and
/score and /rerank as ColBERT's summed MaxSim. Queries and documents of mixed lengths share
the batch, the expanded queries' [MASK] keys hidden by the packed attention."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.engine import Engine
from embedding_server.errors import (
    InputTooLongError,
    InvalidRequestError,
    UnsupportedModelError,
)
from safetensors.torch import load_file, save_file

from tests.server.device.test_colbert_augmentation import (
    DIM,
    DOC_MAXLEN,
    DOCS,
    QUERIES,
    QUERY_MAXLEN,
    _maxsim,
    _reference,
)
from tests.support.attention import assert_rows_close
from tests.support.models import build_bert

LINEAR = torch.randn(DIM, 32, generator=torch.Generator().manual_seed(3))


def build_hf_colbert(path: Path, **metadata: object) -> Path:
    """``build_bert``'s body saved as stanford-colbert saves an ``HF_ColBERT``: the body
    under ``bert.``, ``linear.weight`` beside it, ``artifact.metadata`` with its settings."""
    build_bert(path)
    weights = load_file(str(path / "model.safetensors"))
    colbert = {f"bert.{name}": t for name, t in weights.items()}
    colbert["linear.weight"] = LINEAR.clone()
    save_file(colbert, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["HF_ColBERT"]
    (path / "config.json").write_text(json.dumps(config))
    meta = {
        "query_token_id": "[unused0]",
        "doc_token_id": "[unused1]",
        "query_maxlen": QUERY_MAXLEN,
        "doc_maxlen": DOC_MAXLEN,
        "attend_to_mask_tokens": False,
        "mask_punctuation": True,
        "similarity": "cosine",
        "dim": DIM,
        **metadata,
    }
    (path / "artifact.metadata").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert(tmp_path_factory.mktemp("ref") / "bert")


@pytest.fixture(scope="module")
def colbert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_colbert(tmp_path_factory.mktemp("colbert") / "hf_colbert")


@pytest.fixture(scope="module")
def want(bert: Path) -> list[np.ndarray]:
    return _reference(bert, LINEAR)


@pytest.mark.parametrize(("dtype", "min_cosine"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_queries_and_documents_match_stanford_colbert(
    colbert: Path, want: list[np.ndarray], dtype: str, min_cosine: float
) -> None:
    engine = Engine.from_pretrained(str(colbert), dtype=dtype)
    info = engine.info()
    assert info.outputs == ["multi_vector"] and info.score_method == "maxsim"
    assert info.multi_vector_dim == DIM
    queries = engine.embed_tokens(QUERIES, input_type="query")
    documents = engine.hybrid_embed(DOCS, ["multi_vector"], input_type="document").multi_vector
    assert documents is not None
    got = [*queries, *documents]
    assert [g.shape for g in got] == [w.shape for w in want]
    assert_rows_close(got, want, min_cosine=min_cosine)


def test_score_and_rerank_are_colberts_maxsim(colbert: Path, want: list[np.ndarray]) -> None:
    engine = Engine.from_pretrained(str(colbert), dtype="float32")
    n = len(QUERIES)
    for q, query in enumerate(QUERIES):
        expected = [_maxsim(want[q], want[n + d]) for d in range(len(DOCS))]
        np.testing.assert_allclose(engine.score(query, DOCS), expected, rtol=1e-4)
        ranked = engine.rerank(query, DOCS).results
        assert [r.index for r in ranked] == list(np.argsort(expected)[::-1])
        np.testing.assert_allclose([r.score for r in ranked], sorted(expected)[::-1], rtol=1e-4)


def test_what_a_colbert_model_cannot_answer_is_a_400(colbert: Path) -> None:
    engine = Engine.from_pretrained(str(colbert), dtype="float32")
    with pytest.raises(InvalidRequestError, match="no single pooled vector") as pooled:
        engine.embed(QUERIES)
    assert pooled.value.param == "model"
    with pytest.raises(InvalidRequestError, match=r"input_type .* is required") as side:
        engine.embed_tokens(QUERIES)
    assert side.value.param == "input_type"
    with pytest.raises(InvalidRequestError, match="one of query, document"):
        engine.embed_tokens(QUERIES, input_type="passage")
    with pytest.raises(InvalidRequestError, match="must be multi_vector") as outputs:
        engine.hybrid_embed(QUERIES, ["dense"], input_type="query")
    assert outputs.value.param == "outputs"
    for option in ({"prompt": "q: "}, {"truncate": "left"}, {"normalize": False}):
        with pytest.raises(InvalidRequestError) as refused:
            engine.embed_tokens(QUERIES, input_type="query", **option)  # type: ignore[arg-type]
        assert refused.value.param == next(iter(option))


def test_without_truncation_a_text_longer_than_its_side_is_refused(colbert: Path) -> None:
    engine = Engine.from_pretrained(str(colbert), dtype="float32")
    long = " ".join(DOCS * 2)
    assert len(engine.embed_tokens([long], input_type="document")[0]) <= DOC_MAXLEN
    with pytest.raises(InputTooLongError, match="document length of 24"):
        engine.embed_tokens([long], input_type="document", truncate=False)
    with pytest.raises(InputTooLongError, match="query length of 16"):
        engine.score(long, DOCS, truncate=False)
    engine.embed_tokens(QUERIES, input_type="query", truncate=False)  # short: expanded


def test_input_type_on_another_model_is_a_400(bert: Path) -> None:
    engine = Engine.from_pretrained(str(bert), dtype="float32")
    with pytest.raises(InvalidRequestError, match="not one") as refused:
        engine.embed_tokens(QUERIES, input_type="query")
    assert refused.value.param == "input_type"


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"similarity": "l2"}, "similarity 'l2'"),
        ({"query_token_id": "[NOPE]"}, "not in the tokenizer's vocabulary"),
        ({"query_maxlen": None}, "query_maxlen must be an integer"),
    ],
)
def test_settings_it_cannot_reproduce_are_refused(
    tmp_path: Path, metadata: dict[str, object], match: str
) -> None:
    path = build_hf_colbert(tmp_path / "bad", **metadata)
    with pytest.raises(UnsupportedModelError, match=match):
        Engine.from_pretrained(str(path), dtype="float32")


def test_a_checkpoint_without_its_metadata_is_refused(tmp_path: Path) -> None:
    path = build_hf_colbert(tmp_path / "bare")
    (path / "artifact.metadata").unlink()
    with pytest.raises(UnsupportedModelError, match=r"without a readable artifact\.metadata"):
        Engine.from_pretrained(str(path), dtype="float32")

"""A stanford-colbert ``HF_ColBERT`` checkpoint served end to end through the Engine, against
the reference ``test_colbert_augmentation.py`` restates (stanford-colbert's tensorize,
``ColBERT.query``/``doc`` and MaxSim over transformers' eager ``BertModel``): the vectors of
queries and documents, float32 >= 0.99999 and bfloat16 >= 0.999 cosine per token, and
/score and /rerank as ColBERT's summed MaxSim. Queries and documents of mixed lengths share
the batch, the expanded queries' [MASK] keys hidden by the packed attention."""

from __future__ import annotations

import json
import string
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


def test_a_pylate_dense_with_a_residual_is_refused(tmp_path: Path) -> None:
    path = build_pylate(tmp_path / "residual")
    config = json.loads((path / "1_Dense" / "config.json").read_text())
    (path / "1_Dense" / "config.json").write_text(json.dumps({**config, "use_residual": True}))
    with pytest.raises(UnsupportedModelError, match="sets use_residual"):
        Engine.from_pretrained(str(path), dtype="float32")


def test_a_checkpoint_without_its_metadata_is_refused(tmp_path: Path) -> None:
    path = build_hf_colbert(tmp_path / "bare")
    (path / "artifact.metadata").unlink()
    with pytest.raises(UnsupportedModelError, match=r"without a readable artifact\.metadata"):
        Engine.from_pretrained(str(path), dtype="float32")


def build_pylate(path: Path) -> Path:
    """``build_modernbert``'s body saved as PyLate saves a ColBERT: a Transformer and a
    PyLate Dense module, its tokenization in config_sentence_transformers.json. The prefix
    tokens are the stand-in ids the reference uses (PyLate adds ``[Q] ``/``[D] `` to the
    vocabulary)."""
    from tokenizers import Tokenizer

    from tests.server.device.test_colbert_augmentation import (
        D_PREFIX,
        DOCUMENT_LENGTH,
        Q_PREFIX,
        QUERY_LENGTH,
    )
    from tests.support.models import build_modernbert

    build_modernbert(path, "modernbert")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    dense = path / "1_Dense"
    dense.mkdir()
    (dense / "config.json").write_text(
        json.dumps(
            {
                "in_features": 32,
                "out_features": DIM,
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
            }
        )
    )
    save_file({"linear.weight": PYLATE_LINEAR.clone()}, str(dense / "model.safetensors"))
    settings = {
        "query_prefix": tok.id_to_token(Q_PREFIX),
        "document_prefix": tok.id_to_token(D_PREFIX),
        "query_length": QUERY_LENGTH,
        "document_length": DOCUMENT_LENGTH,
        "do_query_expansion": True,
        "attend_to_expansion_tokens": False,
        "skiplist_words": list(string.punctuation),
    }
    (path / "config_sentence_transformers.json").write_text(json.dumps(settings))
    return path


PYLATE_LINEAR = torch.randn(DIM, 32, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize(("dtype", "min_cosine"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_pylate_queries_and_documents_match_pylate(
    tmp_path_factory: pytest.TempPathFactory, dtype: str, min_cosine: float
) -> None:
    from tests.server.device.test_colbert_augmentation import (
        PYLATE_QUERIES,
        _pylate_reference,
    )
    from tests.support.attention import BF16_COSINE

    path = build_pylate(tmp_path_factory.mktemp("pylate") / "gte-moderncolbert")
    want = _pylate_reference(path, PYLATE_LINEAR)
    engine = Engine.from_pretrained(str(path), dtype=dtype)
    assert engine.info().outputs == ["multi_vector"]
    queries = engine.embed_tokens(PYLATE_QUERIES, input_type="query")
    documents = engine.embed_tokens(DOCS, input_type="document")
    got = [*queries, *documents]
    assert [g.shape for g in got] == [w.shape for w in want]
    n = len(PYLATE_QUERIES)
    assert_rows_close(got[:n], want[:n], min_cosine=min_cosine)
    # As test_colbert_augmentation's: this 4-layer ModernBERT's plain documents come to
    # 0.9988 in bfloat16 against float32, key prefix or not.
    assert_rows_close(
        got[n:], want[n:], min_cosine=min_cosine if dtype == "float32" else BF16_COSINE
    )
    for q in range(n):
        expected = [_maxsim(want[q], want[n + d]) for d in range(len(DOCS))]
        rel = 1e-4 if dtype == "float32" else 2e-2
        np.testing.assert_allclose(engine.score(PYLATE_QUERIES[q], DOCS), expected, rtol=rel)


def test_a_sliding_window_colbert_is_kept_off_the_varlen_kernels_and_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU with flash-attn and torch's varlen kernel, a ModernBERT (local layers slide)
    serving ColBERT queries runs padded SDPA, saying why: the varlen kernels would align the
    window to the end of the keys, and the packed attention refuses a key prefix there."""
    from tests.server.device.test_colbert_augmentation import PYLATE_QUERIES
    from tests.support.attention import BF16_COSINE, pretend_cuda

    path = build_pylate(tmp_path / "gte-moderncolbert")
    baseline = Engine.from_pretrained(str(path), dtype="bfloat16")
    want = baseline.embed_tokens(PYLATE_QUERIES, input_type="query")
    cuda = pretend_cuda(monkeypatch)
    engine = Engine.from_pretrained(str(path), dtype="bfloat16")
    info = engine.info()
    assert info.attention == "sdpa_padded"
    assert len(info.attention_passed_over) == 2
    assert all("prefix within a sliding window" in r for r in info.attention_passed_over)
    got = engine.embed_tokens(PYLATE_QUERIES, input_type="query")
    assert not cuda.flash.calls
    assert_rows_close(got, want, min_cosine=BF16_COSINE)

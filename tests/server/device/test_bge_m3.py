"""bge-m3's three outputs (dense, sparse, multi-vector) against FlagEmbedding's math.

The model is a tiny random XLM-R (bge-m3's body) with a sentence-transformers CLS pipeline
and the two head files bge-m3 keeps at its root, ``sparse_linear.pt`` (hidden -> 1) and
``colbert_linear.pt`` (hidden -> hidden), written with ``torch.save(linear.state_dict())``
as FlagEmbedding saves them. FlagEmbedding itself is not a dependency, so the reference is
its ``BGEM3FlagModel`` computation written out below, a few lines over transformers'
``XLMRobertaModel`` run on each input alone:

* dense: the CLS state, L2-normalized;
* sparse: ``relu(sparse_linear(h_t))``, CLS/EOS/PAD/UNK dropped, max per token id;
* multi-vector: ``colbert_linear(h_t)`` for t >= 1, each L2-normalized; MaxSim is the mean
  over query vectors of the best dot product with a document vector.

The server runs every input of a request as one packed batch of mixed lengths; cosine >=
0.99999 (and 2e-5 absolute) in float32, >= 0.999 in bfloat16.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from transformers import AutoTokenizer, XLMRobertaModel

from tests.support.models import (
    add_bge_m3_heads,
    add_sentence_transformers,
    build_bge_m3,
    build_xlm_roberta,
)
from tests.support.tasks import build_classifier

F32_COSINE, BF16_COSINE = 0.99999, 0.999
TEXTS = [
    "a",
    "dense, sparse and multi-vector from one pass",
    "the the the: repeated tokens keep the max",
    "hybrid retrieval",
]
SPECIAL_IDS = {0, 1, 2, 3}  # <s>, <pad>, </s>, <unk> in build_xlm_roberta's tokenizer


@pytest.fixture(scope="module")
def bge_m3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny bge-m3-shaped directory: XLM-R, CLS pooling + Normalize, the two heads."""
    return build_bge_m3(tmp_path_factory.mktemp("bge-m3") / "xlmr")


def _reference(path: Path, texts: list[str]) -> list[dict[str, Any]]:
    """FlagEmbedding's BGEM3FlagModel.encode, each input alone."""
    model = XLMRobertaModel.from_pretrained(str(path), attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    sparse = torch.nn.Linear(model.config.hidden_size, 1)
    sparse.load_state_dict(torch.load(path / "sparse_linear.pt", weights_only=True))
    colbert_state = torch.load(path / "colbert_linear.pt", weights_only=True)
    colbert = torch.nn.Linear(model.config.hidden_size, colbert_state["weight"].shape[0])
    colbert.load_state_dict(colbert_state)
    out = []
    with torch.no_grad():
        for text in texts:
            enc = tokenizer(text, return_tensors="pt")
            h = model(**enc).last_hidden_state[0]
            weights = torch.relu(sparse(h)).squeeze(-1)
            lexical: dict[int, float] = {}
            for token, w in zip(enc["input_ids"][0].tolist(), weights.tolist(), strict=True):
                if token not in SPECIAL_IDS and w > 0:
                    lexical[token] = max(lexical.get(token, 0.0), w)
            out.append(
                {
                    "dense": torch.nn.functional.normalize(h[0], dim=-1).numpy(),
                    "sparse": lexical,
                    "colbert": torch.nn.functional.normalize(colbert(h[1:]), dim=-1).numpy(),
                }
            )
    return out


def _cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.sum(got * want, axis=-1) / (
        np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1)
    )


def _maxsim(q: np.ndarray, d: np.ndarray) -> float:
    return float((q @ d.T).max(axis=1).mean())


@pytest.mark.parametrize(("dtype", "min_cosine"), [("float32", F32_COSINE), ("bfloat16", 0.999)])
def test_three_outputs_in_one_request_match_flagembedding(
    bge_m3: Path, dtype: str, min_cosine: float
) -> None:
    engine = Engine.from_pretrained(str(bge_m3), dtype=dtype)
    info = engine.info()
    assert info.outputs == ["dense", "sparse", "multi_vector"]
    assert info.multi_vector_dim == 32 and info.score_method == "maxsim"
    want = _reference(bge_m3, TEXTS)
    got = engine.hybrid_embed(TEXTS)
    assert got.dense is not None and got.sparse is not None and got.multi_vector is not None
    dense_want = np.stack([w["dense"] for w in want])
    assert _cosines(got.dense, dense_want).min() >= min_cosine
    for i, w in enumerate(want):
        colbert = got.multi_vector[i]
        assert colbert.shape == w["colbert"].shape  # every token but CLS, EOS included
        assert _cosines(colbert, w["colbert"]).min() >= min_cosine
        vector = got.sparse[i]
        assert list(vector.indices) == sorted(vector.indices)
        vocab = int(engine.info().vocab_size)
        dense_sparse = np.zeros(vocab, np.float32)
        for token, weight in w["sparse"].items():
            dense_sparse[token] = weight
        if min_cosine == F32_COSINE:
            assert set(vector.indices.tolist()) == set(w["sparse"])
            np.testing.assert_allclose(
                vector.values, [w["sparse"][int(t)] for t in vector.indices], atol=2e-5
            )
            np.testing.assert_allclose(got.dense[i], w["dense"], atol=2e-5)
            np.testing.assert_allclose(colbert, w["colbert"], atol=2e-5)
        elif w["sparse"]:
            assert _cosines(vector.to_dense(vocab), dense_sparse) >= min_cosine
        else:
            assert len(vector.indices) == 0
        assert not set(vector.indices.tolist()) & SPECIAL_IDS
    # The dense output is the same vector /v1/embeddings serves.
    np.testing.assert_allclose(got.dense, engine.embed(TEXTS), atol=1e-6)


def test_each_output_alone_and_through_the_task_apis(bge_m3: Path) -> None:
    engine = Engine.from_pretrained(str(bge_m3), dtype="float32")
    both = engine.hybrid_embed(TEXTS)
    sparse_only = engine.hybrid_embed(TEXTS, ["sparse"])
    assert sparse_only.dense is None and sparse_only.multi_vector is None
    assert sparse_only.sparse is not None and both.sparse is not None
    for a, b in zip(sparse_only.sparse, both.sparse, strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
    # task sparse's API and /pooling token_embed's serve the same outputs.
    for a, b in zip(engine.sparse_embed(TEXTS), both.sparse, strict=True):
        np.testing.assert_allclose(a.values, b.values, atol=1e-6)
    tokens = engine.embed_tokens(TEXTS)
    assert both.multi_vector is not None
    for a, b in zip(tokens, both.multi_vector, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    raw = engine.embed_tokens(TEXTS[:1], normalize=False)[0]
    assert not np.allclose(np.linalg.norm(raw, axis=-1), 1.0)
    with pytest.raises(InvalidRequestError, match="outputs must be"):
        engine.hybrid_embed(TEXTS, ["dense", "colbert"])
    with pytest.raises(InvalidRequestError, match="dense output"):
        engine.hybrid_embed(TEXTS, ["sparse"], dimensions=16)


def test_score_and_rerank_are_maxsim(bge_m3: Path) -> None:
    engine = Engine.from_pretrained(str(bge_m3), dtype="float32")
    query, docs = "hybrid retrieval", TEXTS
    want = _reference(bge_m3, [query, *docs])
    expected = [_maxsim(want[0]["colbert"], w["colbert"]) for w in want[1:]]
    scores = engine.score(query, docs)
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    ranked = engine.rerank(query, docs)
    assert [r.index for r in ranked.results] == list(np.argsort(expected)[::-1])
    pairwise = engine.score(docs[:2], docs[2:])
    np.testing.assert_allclose(
        pairwise,
        [_maxsim(want[i]["colbert"], want[i + 2]["colbert"]) for i in (1, 2)],
        atol=1e-5,
    )


def test_a_plain_embedder_has_no_hybrid_outputs(tmp_path: Path) -> None:
    path = add_sentence_transformers(build_xlm_roberta(tmp_path / "xlmr"), pooling="cls")
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert engine.info().outputs == ["dense"] and engine.info().score_method == "cosine"
    with pytest.raises(InvalidRequestError, match=r"sparse_linear\.pt") as error:
        engine.hybrid_embed(TEXTS)
    assert error.value.param == "model"


class _Planted:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (print, ("planted code ran",))


def test_head_files_are_read_safely_or_refused(tmp_path: Path) -> None:
    path = add_sentence_transformers(build_xlm_roberta(tmp_path / "xlmr"), pooling="cls")
    add_bge_m3_heads(path)
    (path / "colbert_linear.pt").unlink()
    with pytest.raises(UnsupportedModelError, match=r"not colbert_linear\.pt"):
        Engine.from_pretrained(str(path))
    # A pickle that would run code when unpickled: weights_only refuses it.
    buffer = io.BytesIO()
    pickle.dump({"weight": _Planted()}, buffer)
    (path / "colbert_linear.pt").write_bytes(buffer.getvalue())
    with pytest.raises(UnsupportedModelError, match="weights_only"):
        Engine.from_pretrained(str(path))
    # A Linear of the wrong width for the body.
    torch.save(torch.nn.Linear(16, 16).state_dict(), path / "colbert_linear.pt")
    with pytest.raises(UnsupportedModelError, match=r"expected \[width, 32\]"):
        Engine.from_pretrained(str(path))
    # A model of another task would leave the heads unread: refused, not dropped.
    reranker = build_classifier(tmp_path / "reranker", "xlm-roberta", 1)
    add_bge_m3_heads(reranker)
    with pytest.raises(UnsupportedModelError, match="served with task embed"):
        Engine.from_pretrained(str(reranker))
    add_bge_m3_heads(path, colbert_dim=8)
    narrow = Engine.from_pretrained(str(path), dtype="float32")
    assert narrow.info().multi_vector_dim == 8
    assert narrow.embed_tokens(["ab"])[0].shape == (3, 8)  # <s> a b </s>, CLS left out


def test_colbert_checkpoints_are_refused_not_pooled(tmp_path: Path) -> None:
    """A ColBERT checkpoint that cannot be served as one (stanford-colbert's HF_ColBERT
    without its projection, PyLate's with a module other than its Dense, whose Dense is
    named like sentence-transformers' but projects every token, or either on the
    transformers backend) would otherwise load as a single-vector embedder: refused, saying
    why (the served ones: test_colbert_engine.py)."""
    import json

    hf = build_xlm_roberta(tmp_path / "hf-colbert")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    with pytest.raises(UnsupportedModelError, match="HF_ColBERT checkpoint without linear"):
        Engine.from_pretrained(str(hf))
    with pytest.raises(UnsupportedModelError, match=r"HF_ColBERT: .* native backend only"):
        Engine.from_pretrained(str(hf), backend="transformers")
    pylate = add_sentence_transformers(build_xlm_roberta(tmp_path / "pylate"), pooling="cls")
    modules = json.loads((pylate / "modules.json").read_text())
    modules = [m for m in modules if not m["type"].endswith(("Pooling", "Normalize"))]
    modules.append({"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"})
    (pylate / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match=r"PyLate ColBERT .* native backend only"):
        Engine.from_pretrained(str(pylate), backend="transformers")
    # A PyLate module other than its Dense is not read: refused by name on either backend.
    modules[-1]["type"] = "pylate.models.Other"
    (pylate / "modules.json").write_text(json.dumps(modules))
    for backend in ("native", "transformers"):
        with pytest.raises(UnsupportedModelError, match="PyLate's: it is a ColBERT"):
            Engine.from_pretrained(str(pylate), backend=backend)


def test_the_transformers_backend_serves_the_same_outputs(bge_m3: Path) -> None:
    """The heads run on the token states whichever backend runs the body."""
    native = Engine.from_pretrained(str(bge_m3), dtype="float32").hybrid_embed(TEXTS)
    generic = Engine.from_pretrained(str(bge_m3), dtype="float32", backend="transformers")
    assert generic.info().backend == "transformers"
    got = generic.hybrid_embed(TEXTS)
    assert got.dense is not None and native.dense is not None
    np.testing.assert_allclose(got.dense, native.dense, atol=2e-5)
    assert got.multi_vector is not None and native.multi_vector is not None
    for a, b in zip(got.multi_vector, native.multi_vector, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert got.sparse is not None and native.sparse is not None
    for x, y in zip(got.sparse, native.sparse, strict=True):
        np.testing.assert_array_equal(x.indices, y.indices)


def test_inspect_says_which_outputs_the_model_has(bge_m3: Path) -> None:
    from embedding_server.device.inspection import inspect_model
    from embedding_server.settings import EngineSettings

    info = inspect_model(EngineSettings(model=str(bge_m3), dtype="float32")).info
    assert (info.outputs, info.multi_vector_dim, info.score_method) == (
        ["dense", "sparse", "multi_vector"],
        32,
        "maxsim",
    )

"""The task endpoints over HTTP on a real server (127.0.0.1): /score, /rerank (and /v1, /v2),
/classify and /pooling with task classify, in vLLM's shapes; a cross-encoder and a classifier
checked against sentence-transformers and transformers, an embedder's cosine scores, and the
400s of each endpoint on a model of the wrong task.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from embedding_server.settings import ServerSettings

from tests.support.api import RunningServer, fake_settings, running_server
from tests.support.api import post_json as post
from tests.support.tasks import build_classifier, build_splade, save_cross_encoder

pytestmark = pytest.mark.timeout(300)

QUERY = "where do cats sleep in the winter?"
DOCS = [
    "cats sleep anywhere warm, " * 5,
    "the stock market fell",
    "c",
    "in winter, cats curl up near the radiator",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("task-models")
    return {
        "cross": save_cross_encoder(build_classifier(root / "bert-1", "bert", 1)),
        "classifier": build_classifier(root / "xlmr-3", "xlm-roberta", 3),
        "tagger": build_classifier(root / "bert-5-token", "bert", 5, per_token=True),
        "splade": build_splade(root / "splade", "bert"),
    }


@pytest.fixture(scope="module")
def cross(model_dirs: dict[str, Path]) -> Iterator[RunningServer]:
    settings = ServerSettings(model=str(model_dirs["cross"]), dtype="float32", max_batch_size=3)
    with running_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def classifier(model_dirs: dict[str, Path]) -> Iterator[RunningServer]:
    settings = ServerSettings(model=str(model_dirs["classifier"]), dtype="float32")
    with running_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def tagger(model_dirs: dict[str, Path]) -> Iterator[RunningServer]:
    settings = ServerSettings(model=str(model_dirs["tagger"]), dtype="float32")
    with running_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def embedder() -> Iterator[RunningServer]:
    with running_server(fake_settings("fake?dim=32")) as running:
        yield running


def test_info_shows_the_task(
    cross: RunningServer, classifier: RunningServer, embedder: RunningServer
) -> None:
    tasks = {
        name: httpx.get(s.url + "/info", timeout=10).json()
        for name, s in (("cross", cross), ("classifier", classifier), ("embedder", embedder))
    }
    assert tasks["cross"]["task"] == "score"
    assert tasks["cross"]["score_activation"] == "sigmoid"
    assert tasks["classifier"]["task"] == "classify"
    assert tasks["classifier"]["labels"] == ["class_0", "class_1", "class_2"]
    assert tasks["embedder"]["task"] == "embed"


def test_score_uses_the_cross_encoder(cross: RunningServer, model_dirs: dict[str, Path]) -> None:
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(model_dirs["cross"]), device="cpu").predict(
        [(QUERY, d) for d in DOCS]
    )
    for path in ("/score", "/v1/score"):
        body = post(cross, path, {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": -1})
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-4)
        assert body["usage"]["prompt_tokens"] > 0
    pairwise = post(cross, "/score", {"text_1": [QUERY, QUERY], "text_2": DOCS[1:3]})
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], expected[1:3], atol=1e-4)


def test_rerank_in_every_dialect(cross: RunningServer, model_dirs: dict[str, Path]) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(model_dirs["cross"]), device="cpu").rank(QUERY, DOCS)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(
            cross,
            path,
            {"query": QUERY, "documents": DOCS, "top_n": 3, "truncate_prompt_tokens": -1},
        )
        results = body["results"]
        assert [r["index"] for r in results] == [r["corpus_id"] for r in reference[:3]]
        np.testing.assert_allclose(
            [r["relevance_score"] for r in results], [r["score"] for r in reference[:3]], atol=1e-4
        )
        assert [r["document"]["text"] for r in results] == [DOCS[r["index"]] for r in results]
        assert body["usage"]["total_tokens"] > 0 and body["id"].startswith("rerank-")
    # Cohere/Jina document objects, no documents back, top_n 0 = all.
    body = post(
        cross,
        "/v2/rerank",
        {
            "query": QUERY,
            "documents": [{"text": d} for d in DOCS],
            "top_n": 0,
            "return_documents": False,
            "truncate_prompt_tokens": -1,
        },
    )
    assert len(body["results"]) == len(DOCS)
    assert all("document" not in r for r in body["results"])
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)


def test_classify_matches_transformers(
    classifier: RunningServer, model_dirs: dict[str, Path]
) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = ["a", "mixed lengths in one batch " * 3, "xyz"]
    path = str(model_dirs["classifier"])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = [
            torch.softmax(model(**tok(t, return_tensors="pt")).logits[0], -1) for t in texts
        ]
    body = post(classifier, "/classify", {"input": texts})
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for row, probs in zip(body["data"], expected, strict=True):
        np.testing.assert_allclose(row["probs"], probs.numpy(), atol=1e-4)
        assert row["num_classes"] == 3
        assert row["label"] == f"class_{int(probs.argmax())}"
    single = post(classifier, "/v1/classify", {"input": texts[2]})
    assert len(single["data"]) == 1
    np.testing.assert_allclose(single["data"][0]["probs"], expected[2].numpy(), atol=1e-4)
    pooled = post(classifier, "/pooling", {"input": texts, "task": "classify"})
    np.testing.assert_allclose(
        [d["data"] for d in pooled["data"]], [d["probs"] for d in body["data"]], atol=1e-6
    )


def test_pooling_token_classify(tagger: RunningServer, model_dirs: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    texts = ["John lives in Paris", "a much longer sentence about nothing in particular", "x"]
    path = str(model_dirs["tagger"])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    body = post(tagger, "/pooling", {"input": texts, "task": "token_classify"})
    assert httpx.get(tagger.url + "/info", timeout=10).json()["task"] == "token_classify"
    for text, row in zip(texts, body["data"], strict=True):
        with torch.no_grad():
            logits = model(**tok(text, return_tensors="pt")).logits[0]
        np.testing.assert_allclose(row["data"], torch.softmax(logits, -1).numpy(), atol=1e-4)
    assert "task is token_classify" in error(tagger, "/classify", {"input": "x"})["message"]
    assert "task is token_classify" in error(tagger, "/pooling", {"input": "x"})["message"]


def test_pooling_reward(model_dirs: dict[str, Path]) -> None:
    """A classifier served with task reward: /pooling task reward gives the raw head output of
    every token, the same as the offline Engine.reward."""
    from embedding_server.engine import Engine

    path = str(model_dirs["cross"])
    texts = ["a short one", "and a rather longer input, to mix lengths in the batch"]
    expected = Engine.from_pretrained(path, dtype="float32", task="reward").reward(texts)
    settings = ServerSettings(model=path, dtype="float32", task="reward")
    with running_server(settings) as server:
        body = post(server, "/pooling", {"input": texts, "task": "reward"})
        for row, want in zip(body["data"], expected, strict=True):
            np.testing.assert_allclose(row["data"], want, atol=1e-5)
        assert (
            "task is reward"
            in error(server, "/rerank", {"query": "a", "documents": ["b"]})["message"]
        )


SPARSE_TEXTS = ["a short one", "a much longer input, so the batch mixes lengths", "z"]
# Each SPLADE vector may weight all 30522 vocabulary entries (about 22 bytes each in JSON):
# three vectors fit in this limit, five do not unless max_active_dims caps them.
SPARSE_LIMIT = 3_000_000


@pytest.fixture(scope="module")
def splade(model_dirs: dict[str, Path]) -> Iterator[RunningServer]:
    settings = ServerSettings(
        model=str(model_dirs["splade"]), dtype="float32", max_response_bytes=SPARSE_LIMIT
    )
    with running_server(settings) as running:
        yield running


def sparse_reference(
    model_dirs: dict[str, Path], texts: list[str], max_active_dims: int | None = None
) -> np.ndarray:
    """sentence-transformers' SparseEncoder on the same checkpoint, as dense rows."""
    from sentence_transformers import SparseEncoder

    encoder = SparseEncoder(str(model_dirs["splade"]), device="cpu")
    dense = encoder.encode(
        texts,
        convert_to_tensor=True,
        convert_to_sparse_tensor=False,
        max_active_dims=max_active_dims,
    )
    return np.asarray(dense.numpy())


def assert_sparse_rows(rows: list[dict[str, list[Any]]], reference: np.ndarray) -> None:
    assert len(rows) == len(reference)
    for row, want in zip(rows, reference, strict=True):
        indices, values = row["indices"], row["values"]
        assert indices == sorted(indices) and len(indices) == len(values)
        assert set(indices) == set(np.flatnonzero(want).tolist())
        dense = np.zeros_like(want)
        dense[indices] = values
        np.testing.assert_allclose(dense, want, atol=1e-4, rtol=1e-5)


def test_pooling_sparse(splade: RunningServer, model_dirs: dict[str, Path]) -> None:
    """A SPLADE model: /pooling task sparse gives {indices, values} per input, the same as
    sentence-transformers' SparseEncoder (max_active_dims too); binary encodings, other
    tasks and answers that could exceed max_response_bytes are 400s before any work."""
    assert httpx.get(splade.url + "/info", timeout=10).json()["task"] == "sparse"
    body = post(splade, "/pooling", {"input": SPARSE_TEXTS, "task": "sparse"})
    assert_sparse_rows(
        [row["data"] for row in body["data"]], sparse_reference(model_dirs, SPARSE_TEXTS)
    )
    capped = post(
        splade, "/pooling", {"input": SPARSE_TEXTS, "task": "sparse", "max_active_dims": 7}
    )
    assert_sparse_rows(
        [row["data"] for row in capped["data"]], sparse_reference(model_dirs, SPARSE_TEXTS, 7)
    )
    binary = {"input": "a", "task": "sparse", "encoding_format": "base64"}
    assert error(splade, "/pooling", binary)["param"] == "encoding_format"
    assert "task is sparse" in error(splade, "/v1/embeddings", {"input": "a"})["message"]
    too_many = error(splade, "/pooling", {"input": ["w"] * 5, "task": "sparse"})
    assert too_many["param"] == "input" and too_many["code"] == "response_too_large", too_many
    assert "max_active_dims" in too_many["message"]
    assert (
        len(
            post(splade, "/pooling", {"input": ["w"] * 5, "task": "sparse", "max_active_dims": 16})[
                "data"
            ]
        )
        == 5
    )


def test_v2_embed_sparse(splade: RunningServer, model_dirs: dict[str, Path]) -> None:
    """/v2/embed with embedding_types ["sparse"]: {indices, values} per text under
    embeddings.sparse, as SparseEncoder gives; the size bound and the refusals."""
    body = post(splade, "/v2/embed", {"texts": SPARSE_TEXTS, "embedding_types": ["sparse"]})
    assert body["response_type"] == "embeddings_by_type" and body["texts"] == SPARSE_TEXTS
    assert list(body["embeddings"]) == ["sparse"]
    assert body["meta"]["billed_units"]["input_tokens"] > 0
    assert_sparse_rows(body["embeddings"]["sparse"], sparse_reference(model_dirs, SPARSE_TEXTS))
    five = {"texts": ["w"] * 5, "embedding_types": ["sparse"]}
    refused = error(splade, "/v2/embed", five)
    assert refused["param"] == "texts" and refused["code"] == "response_too_large", refused
    capped = post(splade, "/v2/embed", {**five, "max_active_dims": 3})
    assert_sparse_rows(capped["embeddings"]["sparse"], sparse_reference(model_dirs, ["w"] * 5, 3))
    for request, param in (
        ({"texts": ["a"], "embedding_types": ["sparse", "float"]}, "embedding_types"),
        (
            {"texts": ["a"], "embedding_types": ["sparse"], "output_dimension": 8},
            "output_dimension",
        ),
        ({"texts": ["a"], "embedding_types": ["sparse"], "max_active_dims": 0}, "max_active_dims"),
        ({"texts": ["a"], "embedding_types": ["float"]}, "model"),
    ):
        assert error(splade, "/v2/embed", request)["param"] == param, request


def test_sparse_output_on_a_dense_model_is_a_400_naming_its_task(embedder: RunningServer) -> None:
    err = error(embedder, "/v2/embed", {"texts": ["a"], "embedding_types": ["sparse"]})
    assert "task is embed" in err["message"] and err["param"] == "model", err
    for path, body in (
        ("/v2/embed", {"texts": ["a"], "max_active_dims": 4}),
        ("/pooling", {"input": "a", "task": "embed", "max_active_dims": 4}),
    ):
        assert error(embedder, path, body)["param"] == "max_active_dims", body


def test_embedder_scores_and_reranks_by_cosine(embedder: RunningServer) -> None:
    docs = ["alpha beta", "gamma", "alpha beta gamma"]
    scores = post(embedder, "/score", {"text_1": "alpha", "text_2": docs})
    by_score = sorted(range(3), key=lambda i: -scores["data"][i]["score"])
    ranked = post(embedder, "/rerank", {"query": "alpha", "documents": docs})
    assert [r["index"] for r in ranked["results"]] == by_score
    np.testing.assert_allclose(
        [r["relevance_score"] for r in ranked["results"]],
        [scores["data"][i]["score"] for i in by_score],
        atol=1e-6,
    )


def error(server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    payload: dict[str, Any] = response.json()["error"]
    return payload


def test_each_task_on_the_wrong_model_is_a_400_naming_its_task(
    cross: RunningServer, classifier: RunningServer, embedder: RunningServer
) -> None:
    assert "task is embed" in error(embedder, "/classify", {"input": "x"})["message"]
    for task in ("token_classify", "reward", "sparse"):
        request = {"input": "x", "task": task}
        assert "task is embed" in error(embedder, "/pooling", request)["message"]
    assert (
        "task is embed"
        in error(embedder, "/pooling", {"input": "x", "task": "classify"})["message"]
    )
    for path, body in (
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
        ("/v1/embeddings", {"input": "a"}),
        ("/pooling", {"input": "a"}),
    ):
        err = error(classifier, path, body)
        assert "task is classify" in err["message"] and err["param"] == "model", err
    assert "task is score" in error(cross, "/v1/embeddings", {"input": "a"})["message"]
    assert "task is score" in error(cross, "/v2/embed", {"texts": ["a"]})["message"]


def test_task_routes_check_the_model_name(cross: RunningServer) -> None:
    for path, body in (
        ("/rerank", {"query": "a", "documents": ["b"]}),
        ("/v2/rerank", {"query": "a", "documents": ["b"]}),
        ("/classify", {"input": "a"}),
    ):
        response = httpx.post(cross.url + path, json={**body, "model": "other"}, timeout=30)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["param"] == "model"


def test_malformed_task_requests_are_400s_naming_the_field(
    cross: RunningServer, classifier: RunningServer
) -> None:
    cases: list[tuple[RunningServer, str, dict[str, Any], str]] = [
        (cross, "/rerank", {"documents": ["a"]}, "query"),
        (cross, "/rerank", {"query": "", "documents": ["a"]}, "query"),
        (cross, "/rerank", {"query": "q", "documents": []}, "documents"),
        (cross, "/rerank", {"query": "q", "documents": ["a", ""]}, "documents"),
        (cross, "/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        (cross, "/v2/rerank", {"query": "q", "documents": [{"title": "x"}]}, "documents"),
        (cross, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        (cross, "/score", {"text_1": "a", "text_2": [[1, 2]]}, "text_2"),
        (cross, "/score", {"text_1": "word " * 200, "text_2": "b"}, "input"),
        (classifier, "/classify", {}, "input"),
        (classifier, "/classify", {"input": []}, "input"),
        (
            classifier,
            "/pooling",
            {"input": "a", "task": "classify", "normalize": True},
            "normalize",
        ),
    ]
    for server, path, body, param in cases:
        err = error(server, path, body)
        assert param in (err.get("param") or "") + err["message"], (path, body, err)

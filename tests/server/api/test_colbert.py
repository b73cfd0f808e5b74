"""A stanford-colbert HF_ColBERT checkpoint over HTTP: its multi-vectors on Cohere's
/v2/embed (input_type search_query or search_document), ColBERT's MaxSim on /score and
/rerank, /info saying so, and 400s naming the field for what it cannot answer.

The engine's vectors are checked against stanford-colbert's computation in
tests/server/device/test_colbert_engine.py; here the HTTP answers must equal that
reference (through the server's scheduler, not the offline path)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.server.device.test_colbert_augmentation import DOCS, QUERIES, _maxsim, _reference
from tests.server.device.test_colbert_engine import LINEAR, build_hf_colbert
from tests.support.api import RunningServer, fake_settings, running_server
from tests.support.api import post_json as post
from tests.support.attention import assert_rows_close
from tests.support.models import build_bert

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def want(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    return _reference(build_bert(tmp_path_factory.mktemp("ref") / "bert"), LINEAR)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    path = build_hf_colbert(tmp_path_factory.mktemp("colbert") / "hf_colbert")
    with running_server(fake_settings(str(path), dtype="float32")) as running:
        yield running


def test_info_says_multi_vector_and_maxsim(server: RunningServer) -> None:
    info = httpx.get(server.url + "/info", timeout=10).json()
    assert info["architecture"] == "HF_ColBERT"
    assert info["outputs"] == ["multi_vector"] and info["score_method"] == "maxsim"


def test_cohere_multi_vectors_of_queries_and_documents_are_stanford_colberts(
    server: RunningServer, want: list[np.ndarray]
) -> None:
    got = []
    for texts, side in ((QUERIES, "search_query"), (DOCS, "search_document")):
        body = {"texts": texts, "input_type": side, "embedding_types": ["multi_vector"]}
        got += [
            np.array(m, np.float32)
            for m in post(server, "/v2/embed", body)["embeddings"]["multi_vector"]
        ]
    assert [g.shape for g in got] == [w.shape for w in want]
    assert_rows_close(got, want, min_cosine=0.99999)


def test_rerank_is_colberts_maxsim(server: RunningServer, want: list[np.ndarray]) -> None:
    n = len(QUERIES)
    for q, query in enumerate(QUERIES):
        expected = [_maxsim(want[q], want[n + d]) for d in range(len(DOCS))]
        ranked = post(server, "/rerank", {"query": query, "documents": DOCS})["results"]
        assert [r["index"] for r in ranked] == list(np.argsort(expected)[::-1])
        scores = [r["relevance_score"] for r in sorted(ranked, key=lambda r: r["index"])]
        np.testing.assert_allclose(scores, expected, rtol=1e-4)
        scored = post(server, "/score", {"text_1": query, "text_2": DOCS})
        np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, rtol=1e-4)


def test_truncate_none_refuses_a_text_longer_than_its_side(server: RunningServer) -> None:
    long = " ".join(DOCS * 2)
    body = {"texts": [long], "input_type": "search_document", "embedding_types": ["multi_vector"]}
    assert post(server, "/v2/embed", body)["embeddings"]["multi_vector"]  # END: cut
    refused = post(server, "/v2/embed", {**body, "truncate": "NONE"}, 400)
    assert refused["error"]["param"] == "truncate"
    assert post(server, "/rerank", {"query": "q", "documents": [long]}, 400)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": "a"}, "model"),
        ("/v2/embed", {"texts": ["a"], "embedding_types": ["multi_vector"]}, "input_type"),
        (
            "/v2/embed",
            {"texts": ["a"], "input_type": "search_query", "embedding_types": ["float"]},
            "embedding_types",
        ),
        (
            "/v2/embed",
            {
                "texts": ["a"],
                "input_type": "search_query",
                "embedding_types": ["multi_vector"],
                "truncate": "START",
            },
            "truncate",
        ),
    ],
)
def test_what_it_cannot_answer_is_a_400_naming_the_field(
    server: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    assert post(server, path, body, 400)["error"]["param"] == param


def test_expanded_queries_count_their_whole_length_against_the_request_limit(
    tmp_path: Path,
) -> None:
    path = build_hf_colbert(tmp_path / "hf_colbert")
    settings = fake_settings(str(path), dtype="float32", max_request_tokens=64, max_model_len=64)
    body = {"input_type": "search_query", "embedding_types": ["multi_vector"]}
    with running_server(settings) as small:
        assert post(small, "/v2/embed", {**body, "texts": ["q"] * 4})  # 4 x 16 tokens
        refused = post(small, "/v2/embed", {**body, "texts": ["q"] * 5}, 413)
        assert "64" in refused["error"]["message"]


@pytest.mark.slow
def test_front_ends_tokenize_each_side_and_the_engine_hides_the_expansion(
    tmp_path: Path, want: list[np.ndarray]
) -> None:
    """With --api-workers the front-ends tokenize queries and documents and the key lengths
    cross to the engine process with the token ids: the answers are still the reference's."""
    from tests.support.api import server_process

    path = build_hf_colbert(tmp_path / "hf_colbert")
    args = ["--model", str(path), "--dtype", "float32", "--api-workers", "2"]
    with server_process(args, workers=2) as s:
        for _ in range(3):  # whichever front-end accepts each connection
            got = []
            for texts, side in ((QUERIES, "search_query"), (DOCS, "search_document")):
                body = {"texts": texts, "input_type": side, "embedding_types": ["multi_vector"]}
                response = httpx.post(s.url + "/v2/embed", json=body, timeout=60)
                assert response.status_code == 200, response.text
                vectors = response.json()["embeddings"]["multi_vector"]
                got += [np.array(m, np.float32) for m in vectors]
            assert_rows_close(got, want, min_cosine=0.99999)

"""A bge-m3-shaped model over HTTP: dense, sparse and multi-vector outputs in one request on
/pooling (task hybrid) and on Cohere's /v2/embed (embedding_types sparse and multi_vector,
our extensions), MaxSim on /score and /rerank, the dense vector unchanged on /v1/embeddings
(the official openai client), and 400s naming the field where a model lacks an output.

The engine's outputs are checked against FlagEmbedding's math in
tests/server/device/test_bge_m3.py; here the HTTP answers must be those outputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest
from embedding_server.engine import Engine

from tests.support.api import RunningServer, fake_settings, running_server, server_process
from tests.support.api import post_json as post
from tests.support.models import build_bge_m3

pytestmark = pytest.mark.timeout(180)

TEXTS = ["hybrid search", "dense, sparse and multi-vector in one request", "z"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bge_m3(tmp_path_factory.mktemp("bge-m3") / "xlmr")


@pytest.fixture(scope="module")
def offline(model: Path) -> Engine:
    return Engine.from_pretrained(str(model), dtype="float32")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[RunningServer]:
    with running_server(fake_settings(str(model), dtype="float32")) as running:
        yield running


def test_info_lists_the_three_outputs(server: RunningServer) -> None:
    info = httpx.get(server.url + "/info", timeout=10).json()
    assert info["outputs"] == ["dense", "sparse", "multi_vector"]
    assert info["multi_vector_dim"] == 32 and info["score_method"] == "maxsim"


def test_pooling_hybrid_answers_all_three_in_one_request(
    server: RunningServer, offline: Engine
) -> None:
    body = post(server, "/pooling", {"input": TEXTS, "task": "hybrid"})
    want = offline.hybrid_embed(TEXTS)
    assert want.dense is not None and want.sparse is not None and want.multi_vector is not None
    assert body["usage"]["prompt_tokens"] == want.prompt_tokens
    for row, dense, sparse, multi in zip(
        body["data"], want.dense, want.sparse, want.multi_vector, strict=True
    ):
        got = row["data"]
        np.testing.assert_allclose(got["dense"], dense, atol=1e-6)
        assert got["sparse"]["indices"] == sparse.indices.tolist()
        np.testing.assert_allclose(got["sparse"]["values"], sparse.values, atol=1e-6)
        np.testing.assert_allclose(np.array(got["multi_vector"]), multi, atol=1e-6)
    capped = post(server, "/pooling", {"input": TEXTS, "task": "hybrid", "max_active_dims": 2})
    assert all(len(r["data"]["sparse"]["indices"]) <= 2 for r in capped["data"])
    refused = post(
        server, "/pooling", {"input": "a", "task": "hybrid", "encoding_format": "base64"}, 400
    )
    assert refused["error"]["param"] == "encoding_format"


def test_pooling_token_embed_and_sparse_are_the_heads_outputs(
    server: RunningServer, offline: Engine
) -> None:
    tokens = post(server, "/pooling", {"input": TEXTS, "task": "token_embed"})
    sparse = post(server, "/pooling", {"input": TEXTS, "task": "sparse"})
    want = offline.hybrid_embed(TEXTS, ["sparse", "multi_vector"])
    assert want.sparse is not None and want.multi_vector is not None
    for row, multi in zip(tokens["data"], want.multi_vector, strict=True):
        np.testing.assert_allclose(np.array(row["data"]), multi, atol=1e-6)
    for row, vector in zip(sparse["data"], want.sparse, strict=True):
        assert row["data"]["indices"] == vector.indices.tolist()


def test_cohere_embed_mixes_dense_sparse_and_multi_vector(
    server: RunningServer, offline: Engine
) -> None:
    types = ["float", "int8", "sparse", "multi_vector"]
    body = post(server, "/v2/embed", {"texts": TEXTS, "embedding_types": types})
    got = body["embeddings"]
    assert set(got) == set(types)
    want = offline.hybrid_embed(TEXTS)
    assert want.dense is not None and want.sparse is not None and want.multi_vector is not None
    np.testing.assert_allclose(np.array(got["float"]), want.dense, atol=1e-6)
    assert len(got["int8"]) == len(TEXTS)
    for sparse, vector in zip(got["sparse"], want.sparse, strict=True):
        assert sparse["indices"] == vector.indices.tolist()
    for multi, vectors in zip(got["multi_vector"], want.multi_vector, strict=True):
        np.testing.assert_allclose(np.array(multi), vectors, atol=1e-6)
    only = post(server, "/v2/embed", {"texts": TEXTS, "embedding_types": ["multi_vector"]})
    assert list(only["embeddings"]) == ["multi_vector"]
    refused = post(
        server,
        "/v2/embed",
        {"texts": TEXTS, "embedding_types": ["sparse"], "output_dimension": 16},
        400,
    )
    assert refused["error"]["param"] == "output_dimension"


def test_score_and_rerank_are_maxsim_of_the_multi_vectors(server: RunningServer) -> None:
    query, docs = "hybrid", TEXTS
    vectors = [
        np.array(row["data"])
        for row in post(server, "/pooling", {"input": [query, *docs], "task": "token_embed"})[
            "data"
        ]
    ]
    expected = [float((vectors[0] @ d.T).max(axis=1).mean()) for d in vectors[1:]]
    scores = post(server, "/score", {"text_1": query, "text_2": docs})
    np.testing.assert_allclose([d["score"] for d in scores["data"]], expected, atol=1e-5)
    ranked = post(server, "/rerank", {"query": query, "documents": docs})
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(expected)[::-1])


def test_openai_embeddings_are_the_dense_output(server: RunningServer, offline: Engine) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    response = client.embeddings.create(input=TEXTS, model=str(server.settings.model))
    got = np.array([d.embedding for d in response.data])
    np.testing.assert_allclose(got, offline.embed(TEXTS), atol=1e-6)


def test_a_model_without_the_heads_refuses_their_outputs() -> None:
    with running_server(fake_settings("fake?max_len=64")) as fake:
        info = httpx.get(fake.url + "/info", timeout=10).json()
        assert info["outputs"] == ["dense"]
        refused = post(fake, "/pooling", {"input": "a", "task": "hybrid"}, 400)
        assert refused["error"]["param"] == "model"
        assert "sparse_linear.pt" in refused["error"]["message"]
        multi = {"texts": ["a"], "embedding_types": ["multi_vector"]}
        refused = post(fake, "/v2/embed", multi, 400)
        assert refused["error"]["param"] == "model"
        refused = post(
            fake, "/v2/embed", {"texts": ["a"], "embedding_types": ["float", "sparse"]}, 400
        )
        assert "task sparse" in refused["error"]["message"]


def test_front_end_processes_answer_all_three_without_torch(model: Path, offline: Engine) -> None:
    """With --api-workers the heads run in the engine process's batches and the outputs are
    read from the token rows in the front-end, which loads no torch."""
    args = ["--model", str(model), "--dtype", "float32", "--api-workers", "2"]
    with server_process(args, workers=2) as s:
        response = httpx.post(
            s.url + "/pooling", json={"input": TEXTS, "task": "hybrid"}, timeout=60
        )
        assert response.status_code == 200, response.text
        want = offline.hybrid_embed(TEXTS)
        assert want.sparse is not None and want.multi_vector is not None
        for row, sparse, multi in zip(
            response.json()["data"], want.sparse, want.multi_vector, strict=True
        ):
            assert row["data"]["sparse"]["indices"] == sparse.indices.tolist()
            np.testing.assert_allclose(np.array(row["data"]["multi_vector"]), multi, atol=1e-5)
        scores = httpx.post(s.url + "/score", json={"text_1": "z", "text_2": TEXTS}, timeout=60)
        np.testing.assert_allclose(
            [d["score"] for d in scores.json()["data"]], offline.score("z", TEXTS), atol=1e-5
        )
        for child in s.children:
            maps = psutil.Process(child.pid).memory_maps()
            assert not any("libtorch" in Path(m.path).name for m in maps), child.pid

"""/v2/embed in Cohere's v2 shape: every embedding type derived from the same vectors by the
documented rules, input_type selecting the model's prompt, truncate END/START/NONE."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.api import RunningServer, fake_settings, running_server

pytestmark = pytest.mark.timeout(120)

TEXTS = ["hello there", "a somewhat longer sentence about embeddings", "z"]
ALL_TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(fake_settings("fake?max_len=64")) as running:
        yield running


def embed(server: RunningServer, **body: Any) -> dict[str, Any]:
    response = httpx.post(server.url + "/v2/embed", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_response_is_shaped_like_cohere_v2(server: RunningServer) -> None:
    body = embed(server, texts=TEXTS, model="fake", input_type="search_document")
    assert set(body) >= {"id", "embeddings", "texts", "meta"}
    assert body["texts"] == TEXTS
    assert list(body["embeddings"]) == ["float"]  # float is the default type
    assert len(body["embeddings"]["float"]) == len(TEXTS)
    assert body["meta"]["billed_units"]["input_tokens"] > 0
    assert body["meta"]["api_version"]["version"] == "2"


def test_every_type_comes_from_the_same_vectors(server: RunningServer) -> None:
    body = embed(server, texts=TEXTS, embedding_types=ALL_TYPES, output_dimension=64)
    got = body["embeddings"]
    floats = np.array(got["float"], dtype=np.float32)
    assert floats.shape == (3, 64)
    unit = floats / np.linalg.norm(floats, axis=1, keepdims=True)

    decoded = np.stack([np.frombuffer(base64.b64decode(s), "<f4") for s in got["base64"]])
    np.testing.assert_array_equal(decoded, floats)

    int8 = np.array(got["int8"])
    assert int8.dtype.kind == "i" and int8.min() >= -128 and int8.max() <= 127
    np.testing.assert_array_equal(int8, np.clip(np.rint(unit * 127), -128, 127))
    np.testing.assert_array_equal(np.array(got["uint8"]), int8 + 128)

    packed = np.packbits(floats > 0, axis=1)  # 8 dimensions per byte, MSB first
    np.testing.assert_array_equal(np.array(got["ubinary"]), packed)
    np.testing.assert_array_equal(np.array(got["binary"]), packed.astype(np.int16) - 128)
    assert np.array(got["ubinary"]).shape == (3, 8)

    # Quantized vectors still rank like the floats do.
    cos = unit @ unit.T
    cos8 = (int8 @ int8.T) / np.outer(np.linalg.norm(int8, axis=1), np.linalg.norm(int8, axis=1))
    np.testing.assert_allclose(cos8, cos, atol=0.02)


def test_input_type_selects_the_models_prompt(server: RunningServer) -> None:
    # The fake model's sentence-transformers prompts are query: "query: " and
    # document: "passage: ".
    query = embed(server, texts=["x"], input_type="search_query")
    document = embed(server, texts=["x"], input_type="search_document")
    plain = embed(server, texts=["x"], input_type="clustering")  # no such prompt: as is
    assert query["embeddings"]["float"] != document["embeddings"]["float"]
    assert query["meta"]["billed_units"]["input_tokens"] == plain["meta"]["billed_units"][
        "input_tokens"
    ] + len("query: ")
    openai_style = httpx.post(
        server.url + "/v1/embeddings", json={"input": "x", "prompt_name": "query"}
    ).json()
    np.testing.assert_allclose(
        openai_style["data"][0]["embedding"], query["embeddings"]["float"][0], atol=1e-6
    )


def test_truncate_end_start_none(server: RunningServer) -> None:
    long_text = "".join(chr(ord("a") + i % 26) for i in range(200))
    end = embed(server, texts=[long_text], truncate="END")
    start = embed(server, texts=[long_text], truncate="START")
    assert end["meta"]["billed_units"]["input_tokens"] == 64
    assert end["embeddings"]["float"] != start["embeddings"]["float"]
    short = embed(server, texts=[long_text], truncate="END", max_tokens=10)
    assert short["meta"]["billed_units"]["input_tokens"] == 10
    refused = httpx.post(server.url + "/v2/embed", json={"texts": [long_text], "truncate": "NONE"})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"

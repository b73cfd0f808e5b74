"""``input_type`` over HTTP: Cohere's hints, and any prompt name the checkpoint declares.

A sentence-transformers prompt name (``s2p_query``) or a jina-embeddings-v3 task name
(``retrieval.query``, the task-key form vLLM's docs describe) given as ``input_type``
selects that prompt (and jina's adapter of that name), on ``/v1/embeddings`` and
``/v2/embed`` alike; anything else is a 400 naming the field and the accepted values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from embedding_server.engine import Engine
from embedding_server.settings import ServerSettings

from tests.support.api import RunningServer, fake_settings, running_server
from tests.support.jina_v3 import build_jina_v3
from tests.support.models import add_sentence_transformers

pytestmark = pytest.mark.timeout(300)

TEXTS = ["what is a fox?", "The quick brown fox jumps over the lazy dog.", "x"]
PROMPTS = {"s2p_query": "Instruct: find a passage\nQuery: ", "web_document": "Document: "}


def _openai(server: RunningServer, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, **body}, timeout=60)


def _cohere(server: RunningServer, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v2/embed", json={"texts": TEXTS, **body}, timeout=60)


def _vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    body = response.json()
    if "data" in body:
        return np.array([row["embedding"] for row in body["data"]])
    return np.array(body["embeddings"]["float"])


def _refusal(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input_type"
    return str(error["message"])


@pytest.fixture(scope="module")
def fake() -> Iterator[RunningServer]:
    with running_server(fake_settings()) as server:
        yield server


@pytest.mark.parametrize("post", [_openai, _cohere])
def test_an_unknown_input_type_is_a_400_listing_what_is_accepted(
    fake: RunningServer, post: Callable[..., httpx.Response]
) -> None:
    message = _refusal(post(fake, input_type="retrieval.querry"))
    assert "'retrieval.querry'" in message
    for accepted in ("search_query", "search_document", "classification", "clustering"):
        assert accepted in message
    assert "document, query" in message  # the fake model's own prompt names


def test_cohere_hints_without_a_matching_prompt_still_embed_as_is(fake: RunningServer) -> None:
    plain = _vectors(_openai(fake))
    np.testing.assert_allclose(_vectors(_openai(fake, input_type="clustering")), plain)
    np.testing.assert_allclose(_vectors(_cohere(fake, input_type="classification")), plain)


@pytest.fixture(scope="module")
def prompted(tiny_model: Callable[[str], Path]) -> Iterator[tuple[RunningServer, Engine]]:
    """A tiny BERT whose sentence-transformers config names its own prompts."""
    path = add_sentence_transformers(
        tiny_model("bert"), pooling="mean", prompts=PROMPTS, name="prompts"
    )
    with running_server(ServerSettings(model=str(path), dtype="float32")) as server:
        yield server, Engine.from_pretrained(str(path), dtype="float32")


@pytest.mark.parametrize("post", [_openai, _cohere])
def test_a_declared_prompt_name_is_an_input_type(
    prompted: tuple[RunningServer, Engine], post: Callable[..., httpx.Response]
) -> None:
    server, engine = prompted
    for name in PROMPTS:
        expected = engine.embed(TEXTS, prompt_name=name)
        got = _vectors(post(server, input_type=name))
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert np.abs(got - engine.embed(TEXTS)).max() > 1e-3  # the prompt was applied
    message = _refusal(post(server, input_type="s2s_query"))
    assert "s2p_query, web_document" in message


@pytest.fixture(scope="module")
def jina(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Engine]]:
    hub = build_jina_v3(tmp_path_factory.mktemp("jina-v3"))[1]
    with running_server(ServerSettings(model=str(hub), dtype="float32")) as server:
        yield server, Engine.from_pretrained(str(hub), dtype="float32")


@pytest.mark.parametrize("post", [_openai, _cohere])
@pytest.mark.parametrize("task", ["retrieval.query", "retrieval.passage", "text-matching"])
def test_jina_v3_task_names_are_input_types_choosing_their_adapter(
    jina: tuple[RunningServer, Engine], post: Callable[..., httpx.Response], task: str
) -> None:
    server, engine = jina
    got = _vectors(post(server, input_type=task))
    np.testing.assert_allclose(got, engine.embed(TEXTS, adapter=task), atol=1e-5)
    assert np.abs(got - engine.embed(TEXTS)).max() > 0.01  # the adapter ran


def test_jina_v3_refuses_a_misspelled_task_name_listing_its_own(
    jina: tuple[RunningServer, Engine],
) -> None:
    message = _refusal(_openai(jina[0], input_type="retrieval_query"))
    assert "retrieval.passage, retrieval.query, separation, text-matching" in message

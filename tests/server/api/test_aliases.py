"""``--served-model-aliases``: the other names a server answers to (what an EmbeddingService's
``spec.servedModelAliases`` becomes), seen from a client. Runs on the fake backend: which model
answers makes no difference to naming."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from embedding_server.cli import load_settings

from tests.support.api import RunningServer, fake_settings, running_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    settings = fake_settings(
        served_model_name="bge-small", served_model_aliases=["text-embedding-3-small", "bge"]
    )
    with running_server(settings) as s:
        yield s


def embed(server: RunningServer, model: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/embeddings", json={"input": ["a b", "c"], "model": model}, timeout=30
    )


@pytest.mark.parametrize("name", ["bge-small", "text-embedding-3-small", "bge"])
def test_every_alias_is_accepted_and_the_answer_names_the_served_model(
    server: RunningServer, name: str
) -> None:
    response = embed(server, name)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "bge-small"
    assert len(body["data"]) == 2
    assert body["data"] == embed(server, "bge-small").json()["data"]


def test_an_unknown_name_is_still_a_404(server: RunningServer) -> None:
    response = embed(server, "bge-large")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "bge-small" in error["message"]


def test_models_lists_the_served_name_with_its_aliases(server: RunningServer) -> None:
    (entry,) = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert entry["id"] == "bge-small"
    assert entry["aliases"] == ["text-embedding-3-small", "bge"]


def test_the_flag_and_the_variable_take_comma_separated_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flag = load_settings(["serve", "--served-model-aliases", "a, b,,c"])
    assert flag.served_model_aliases == ["a", "b", "c"]
    monkeypatch.setenv("EMBEDDING_SERVER_SERVED_MODEL_ALIASES", "x,y")
    assert load_settings(["serve"]).served_model_aliases == ["x", "y"]

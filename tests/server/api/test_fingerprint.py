"""The embedding fingerprint as a client sees it (issue 47, item 1): the
``X-Embedding-Fingerprint`` header on every answer that comes from the model, the same value
in ``/info`` and ``embedding_server_model_info``, unchanged by a restart or a rename, and
``--expect-fingerprint`` keeping a server that differs from ever becoming ready.

On the real packaged all-MiniLM-L6-v2 (and a tiny classifier for ``/classify``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from embedding_server.fingerprint import HEADER, is_fingerprint
from embedding_server.settings import ServerSettings

from tests.support.api import RunningServer, running_server, scrape, server_process, wait_for
from tests.support.tasks import build_classifier

pytestmark = pytest.mark.timeout(300)

QUERY, DOCS = "what is a cat", ["a cat is an animal", "the stock market fell"]

ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/embeddings", {"input": DOCS}),
    ("/v1/embeddings", {"input": DOCS, "encoding_format": "base64"}),
    ("/v2/embed", {"texts": DOCS, "input_type": "search_document", "embedding_types": ["float"]}),
    ("/pooling", {"input": DOCS}),
    ("/score", {"text_1": QUERY, "text_2": DOCS}),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCS}),
    ("/rerank", {"query": QUERY, "documents": DOCS}),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS}),
    ("/v2/rerank", {"query": QUERY, "documents": DOCS}),
]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(ServerSettings(dtype="float32")) as s:
        yield s


def _info(server: RunningServer) -> dict[str, Any]:
    response = httpx.get(server.url + "/info", timeout=30)
    assert response.status_code == 200
    info: dict[str, Any] = response.json()
    return info


@pytest.mark.parametrize(
    ("path", "body"), ROUTES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(ROUTES)]
)
def test_every_model_answer_carries_the_fingerprint(
    server: RunningServer, path: str, body: dict[str, Any]
) -> None:
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers[HEADER] == _info(server)["fingerprint"]


def test_info_and_the_metric_say_the_same_fingerprint(server: RunningServer) -> None:
    info = _info(server)
    fingerprint = info["fingerprint"]
    assert is_fingerprint(fingerprint)
    assert info["fingerprint_inputs"]["files"]["model.safetensors"]
    assert info["fingerprint_inputs"]["dtype"] == "float32"
    assert server.metric("embedding_server_model_info", {"fingerprint": fingerprint}) == 1.0


def test_answers_without_model_output_do_not_carry_it(server: RunningServer) -> None:
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": QUERY}, timeout=30)
    assert tokenized.status_code == 200 and HEADER not in tokenized.headers
    refused = httpx.post(server.url + "/v1/embeddings", json={"input": []}, timeout=30)
    assert refused.status_code == 400 and HEADER not in refused.headers


def test_classify_answers_carry_it(tmp_path: Path) -> None:
    classifier = build_classifier(tmp_path / "xlmr-3", "xlm-roberta", 3)
    with running_server(ServerSettings(model=str(classifier), dtype="float32")) as s:
        for path in ("/classify", "/v1/classify"):
            response = httpx.post(s.url + path, json={"input": DOCS}, timeout=60)
            assert response.status_code == 200, response.text
            assert response.headers[HEADER] == _info(s)["fingerprint"]


def test_api_worker_front_ends_send_the_engines_fingerprint(server: RunningServer) -> None:
    """With --api-workers, the front-ends have the fingerprint from the engine process."""
    ours = _info(server)["fingerprint"]
    with server_process(["--api-workers", "2", "--dtype", "float32"], workers=2) as s:
        for _ in range(4):  # over both front-ends, most likely
            response = httpx.post(s.url + "/v1/embeddings", json={"input": DOCS}, timeout=60)
            assert response.status_code == 200 and response.headers[HEADER] == ours
        assert scrape(s.url, "embedding_server_model_info", {"fingerprint": ours}) == 1.0


def test_a_restart_and_a_rename_keep_the_fingerprint(server: RunningServer) -> None:
    """A rename never forces a re-embed: the name is not an input."""
    before = _info(server)
    renamed = ServerSettings(
        dtype="float32", served_model_name="minilm-v2", served_model_aliases=["old-name"]
    )
    with running_server(renamed) as again:
        after = _info(again)
        response = httpx.post(
            again.url + "/v1/embeddings", json={"input": DOCS, "model": "minilm-v2"}, timeout=60
        )
        assert response.headers[HEADER] == before["fingerprint"]
    assert after["served_model_name"] == "minilm-v2" != before["served_model_name"]
    assert after["fingerprint"] == before["fingerprint"]
    assert after["fingerprint_inputs"] == before["fingerprint_inputs"]


@contextlib.contextmanager
def _refused(settings: ServerSettings) -> Iterator[tuple[RunningServer, httpx.Response]]:
    """A server that loads its model and refuses it, with its ``/ready`` answer."""
    server = RunningServer(settings)
    server._thread.start()
    try:
        wait_for(
            lambda: server.lifecycle.refusal is not None,
            timeout=120,
            what="the fingerprint check",
        )
        yield server, httpx.get(server.url + "/ready", timeout=10)
    finally:
        server.stop()


def test_a_different_expected_fingerprint_keeps_the_server_unready(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    ours = _info(server)
    expected_inputs = {**ours["fingerprint_inputs"], "dtype": "bfloat16"}
    settings = ServerSettings(dtype="float32", expect_fingerprint=json.dumps(expected_inputs))
    with _refused(settings) as (refused, ready):
        assert ready.status_code == 503
        error = ready.json()["error"]
        assert error["code"] == "fingerprint_mismatch"
        assert ours["fingerprint"] in error["message"]
        embed = httpx.post(refused.url + "/v1/embeddings", json={"input": DOCS}, timeout=30)
        assert embed.status_code == 503
        assert "--expect-fingerprint" in embed.json()["error"]["message"]
        # /info still says what this server would serve, to compare with the expected one.
        assert _info(refused)["fingerprint"] == ours["fingerprint"]
        assert 'dtype: "float32", expected "bfloat16"' in (refused.lifecycle.refusal or "")
    assert any("expected" in r.getMessage() and "dtype" in r.getMessage() for r in caplog.records)


def test_a_bare_expected_fingerprint_that_differs_names_both(server: RunningServer) -> None:
    ours = _info(server)["fingerprint"]
    settings = ServerSettings(dtype="float32", expect_fingerprint="0123456789abcdef")
    with _refused(settings) as (refused, ready):
        assert ready.status_code == 503
        message = refused.lifecycle.refusal or ""
        assert ours in message and "0123456789abcdef" in message


def test_the_expected_fingerprint_serves() -> None:
    with running_server(ServerSettings(dtype="float32")) as first:
        fingerprint = _info(first)["fingerprint"]
    with running_server(ServerSettings(dtype="float32", expect_fingerprint=fingerprint)) as s:
        assert httpx.get(s.url + "/ready", timeout=10).status_code == 200


def test_a_malformed_expected_fingerprint_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="expect_fingerprint"):
        ServerSettings(expect_fingerprint="fp-nothex")

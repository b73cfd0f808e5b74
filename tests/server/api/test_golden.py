"""Golden vectors as an operator and a client see them (issue 47, items 2 and 4): ``GET
/golden`` on both ports, ``--golden-vectors`` holding readiness while the vectors differ
(``vectors_changed``, the lowest cosine, its probe, the threshold and what differs in the
fingerprint), a file that appears or changes later, and ``X-Expect-Embedding-Fingerprint``'s
409 before any work.

On the real packaged all-MiniLM-L6-v2, in float32 and bfloat16 (the CPU here has AMX, so the
tests name the dtype: ``auto`` would pick bfloat16), a tiny classifier for a model without
golden vectors, and the fake backend where only the file's shape matters.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from embedding_server.fingerprint import EXPECT_HEADER, HEADER
from embedding_server.request.golden import PROBE_SET, PROBES, cosine, decode_vector
from embedding_server.settings import ServerSettings

from e2e.harness.proc import free_port
from tests.support.api import (
    RunningServer,
    fake_settings,
    running_server,
    server_process,
    wait_for,
)
from tests.support.tasks import build_classifier

pytestmark = pytest.mark.timeout(300)

DOCS = ["a cat is an animal", "the stock market fell"]


@pytest.fixture(scope="module")
def f32() -> Iterator[RunningServer]:
    with running_server(ServerSettings(dtype="float32")) as s:
        yield s


@pytest.fixture(scope="module")
def f32_golden(f32: RunningServer) -> dict[str, Any]:
    response = httpx.get(f32.url + "/golden", timeout=30)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _save(path: Path, answer: dict[str, Any]) -> Path:
    path.write_text(json.dumps(answer), encoding="utf-8")
    return path


def _swap(link: Path, answer: dict[str, Any], name: str) -> None:
    """Replace what ``link`` shows as the kubelet updates a ConfigMap volume: write a new
    file beside it and swap the symlink in one rename."""
    target = _save(link.parent / name, answer)
    tmp = link.parent / f".{name}.link"
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _unready(server: RunningServer, *, what: str) -> None:
    """Start ``server`` and wait until its golden check has answered (ready or not)."""
    server._thread.start()
    golden = server.lifecycle.golden
    assert golden is not None
    wait_for(lambda: golden.prepared, timeout=120, what=what)


def _state(url: str) -> str:
    state: str = httpx.get(url + "/golden", timeout=30).json()["check"]["state"]
    return state


def test_golden_serves_the_probe_sets_vectors_as_v1_embeddings_does(
    f32: RunningServer, f32_golden: dict[str, Any]
) -> None:
    info = httpx.get(f32.url + "/info", timeout=30).json()
    assert f32_golden["probe_set"] == PROBE_SET
    assert f32_golden["fingerprint"] == info["fingerprint"]
    assert f32_golden["fingerprint_inputs"] == info["fingerprint_inputs"]
    assert f32_golden["model"] == info["served_model_name"]
    assert f32_golden["dimensions"] == 384
    assert f32_golden["probes"] == list(PROBES)
    assert f32_golden["check"] == {
        "state": "unchecked",
        "min_cosine": None,
        "probe": None,
        "expected_fingerprint": None,
        "differs": {},
        "source": None,
        "reason": None,
    }
    # The vectors are what a client gets from /v1/embeddings with no other field.
    served = httpx.post(
        f32.url + "/v1/embeddings",
        json={"input": list(PROBES), "encoding_format": "base64"},
        timeout=60,
    ).json()["data"]
    for golden, row in zip(f32_golden["vectors"], served, strict=True):
        ours = np.frombuffer(base64.b64decode(golden), dtype="<f4")
        theirs = np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4")
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
    assert info["golden"]["state"] == "unchecked"
    # Nothing compared: the gauge is absent.
    assert f32.metric("embedding_server_golden_min_cosine") is None


def test_its_own_golden_file_passes(tmp_path: Path, f32_golden: dict[str, Any]) -> None:
    path = _save(tmp_path / "golden.json", f32_golden)
    with running_server(ServerSettings(dtype="float32", golden_vectors=str(path))) as s:
        check = httpx.get(s.url + "/golden", timeout=30).json()["check"]
        assert check["state"] == "passed"
        assert check["min_cosine"] >= 0.9999
        assert check["expected_fingerprint"] == f32_golden["fingerprint"]
        assert check["differs"] == {} and check["source"] == str(path)
        assert httpx.get(s.url + "/info", timeout=30).json()["golden"]["state"] == "passed"
        gauge = s.metric("embedding_server_golden_min_cosine")
        assert gauge is not None and gauge >= 0.9999


def test_float32_vectors_keep_a_bfloat16_server_unready_until_its_own_file_is_given(
    tmp_path: Path, f32_golden: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case: a pod in another dtype than the one that recorded the vectors."""
    link = tmp_path / "golden.json"
    _swap(link, f32_golden, "f32.json")
    server = RunningServer(ServerSettings(dtype="bfloat16", golden_vectors=str(link)))
    caplog.set_level(logging.WARNING, logger="embedding_server.api.golden")
    try:
        _unready(server, what="the golden check")
        ready = httpx.get(server.url + "/ready", timeout=10)
        assert ready.status_code == 503
        error = ready.json()["error"]
        assert error["code"] == "vectors_changed"
        check = httpx.get(server.url + "/golden", timeout=30).json()["check"]
        assert check["state"] == "changed"
        assert check["min_cosine"] < 0.9999
        assert check["differs"]["dtype"] == ["float32", "bfloat16"]
        message = error["message"]
        assert f"{check['min_cosine']:.6f}" in message
        assert f"(probe {check['probe']})" in message and "0.9999" in message
        assert 'dtype: "float32" -> "bfloat16"' in message
        # The model routes refuse it too, and the process stays up.
        embed = httpx.post(server.url + "/v1/embeddings", json={"input": DOCS}, timeout=30)
        assert embed.status_code == 503 and embed.json()["error"]["code"] == "vectors_changed"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        gauge = server.metric("embedding_server_golden_min_cosine")
        assert gauge is not None and gauge == pytest.approx(check["min_cosine"])
        assert server.metric("embedding_server_loading") == 0.0
        warnings = [r for r in caplog.records if getattr(r, "golden_state", "") == "changed"]
        assert warnings and warnings[0].levelno == logging.WARNING
        logged = warnings[0]
        assert getattr(logged, "golden_min_cosine") == check["min_cosine"]  # noqa: B009
        assert getattr(logged, "golden_probe") == check["probe"]  # noqa: B009
        assert getattr(logged, "golden_threshold") == 0.9999  # noqa: B009
        assert getattr(logged, "fingerprint_differs")["dtype"] == ["float32", "bfloat16"]  # noqa: B009

        # The operator records this version's own vectors: the kubelet swaps the file.
        own = httpx.get(server.url + "/golden", timeout=30).json()
        _swap(link, own, "bf16.json")
        wait_for(
            lambda: httpx.get(server.url + "/ready", timeout=10).status_code == 200,
            timeout=60,
            interval=0.2,
            what="the bfloat16 file to be picked up",
        )
        assert _state(server.url) == "passed"
    finally:
        server.stop()


def test_a_file_that_appears_later_with_a_tampered_vector_holds_readiness(
    tmp_path: Path, f32_golden: dict[str, Any]
) -> None:
    path = tmp_path / "later" / "golden.json"
    with running_server(ServerSettings(dtype="float32", golden_vectors=str(path))) as s:
        # No file yet (a first pod): nothing to compare, readiness not held.
        check = httpx.get(s.url + "/golden", timeout=30).json()["check"]
        assert check["state"] == "unchecked" and "does not exist" in check["reason"]
        assert s.metric("embedding_server_golden_min_cosine") is None
        tampered = dict(f32_golden)
        vectors = list(tampered["vectors"])
        moved = decode_vector(vectors[2]).copy()
        moved[:40] = 0.0
        vectors[2] = base64.b64encode(moved.astype("<f4").tobytes()).decode()
        tampered["vectors"] = vectors
        path.parent.mkdir()
        _save(path, tampered)
        wait_for(
            lambda: httpx.get(s.url + "/ready", timeout=10).status_code == 503,
            timeout=60,
            interval=0.2,
            what="the file to be picked up",
        )
        ready = httpx.get(s.url + "/ready", timeout=10).json()["error"]
        assert ready["code"] == "vectors_changed"
        assert "(probe 2)" in ready["message"]
        expected = cosine(moved, decode_vector(f32_golden["vectors"][2]))
        assert f"{expected:.6f}" in ready["message"]
        # The same fingerprint: the message says no input differs.
        assert "no fingerprint input differs" in ready["message"]


def test_the_probe_port_and_every_front_end_serve_golden(
    tmp_path: Path, f32_golden: dict[str, Any]
) -> None:
    """What the operator reads (the probe port), with --api-workers: each front-end embeds
    the probe set through the engine process and checks the file itself."""
    path = _save(tmp_path / "golden.json", f32_golden)
    probe_port = free_port()
    args = ["--dtype", "float32", "--probe-port", str(probe_port), "--golden-vectors", str(path)]
    with server_process([*args, "--api-workers", "2"], workers=2) as served:
        for _ in range(4):  # over both front-ends, most likely
            probe = httpx.get(f"http://127.0.0.1:{probe_port}/golden", timeout=30)
            assert probe.status_code == 200
            assert probe.json()["check"]["state"] == "passed"
            assert probe.json()["vectors"] == f32_golden["vectors"]
            main = httpx.get(served.url + "/golden", timeout=30)
            assert main.json()["check"] == probe.json()["check"]


def test_another_dimension_count_is_a_change(tmp_path: Path) -> None:
    with running_server(fake_settings()) as first:
        answer = httpx.get(first.url + "/golden", timeout=30).json()
    answer["vectors"] = [
        base64.b64encode(decode_vector(v)[:256].astype("<f4").tobytes()).decode()
        for v in answer["vectors"]
    ]
    path = _save(tmp_path / "golden.json", answer)
    server = RunningServer(fake_settings(golden_vectors=str(path)))
    try:
        _unready(server, what="the golden check")
        error = httpx.get(server.url + "/ready", timeout=10).json()["error"]
        assert error["code"] == "vectors_changed"
        assert "dimensions differ" in error["message"] and "256" in error["message"]
        check = httpx.get(server.url + "/golden", timeout=30).json()["check"]
        assert check["state"] == "changed" and check["min_cosine"] is None
    finally:
        server.stop()


def test_a_file_of_other_probes_is_compared_on_them(tmp_path: Path) -> None:
    texts = ["another probe set", "with its own texts"]
    with running_server(fake_settings()) as first:
        data = httpx.post(
            first.url + "/v1/embeddings",
            json={"input": texts, "encoding_format": "base64"},
            timeout=30,
        ).json()["data"]
        answer = httpx.get(first.url + "/golden", timeout=30).json()
    answer.update(probe_set="v0", probes=texts, vectors=[row["embedding"] for row in data])
    path = _save(tmp_path / "golden.json", answer)
    with running_server(fake_settings(golden_vectors=str(path))) as s:
        assert _state(s.url) == "passed"


def test_a_file_that_is_no_golden_answer_is_unchecked_naming_why(tmp_path: Path) -> None:
    path = tmp_path / "golden.json"
    path.write_text('{"probe_set": "v1", "probes": ["a"], "vectors": ["%%"]}')
    with running_server(fake_settings(golden_vectors=str(path))) as s:
        check = httpx.get(s.url + "/golden", timeout=30).json()["check"]
        assert check["state"] == "unchecked"
        assert "'vectors'[0] is not base64" in check["reason"]


def test_a_model_without_embeddings_has_no_golden_vectors(
    tmp_path: Path, f32_golden: dict[str, Any]
) -> None:
    classifier = build_classifier(tmp_path / "xlmr-3", "xlm-roberta", 3)
    path = _save(tmp_path / "golden.json", f32_golden)
    settings = ServerSettings(model=str(classifier), dtype="float32", golden_vectors=str(path))
    with running_server(settings) as s:  # ready: nothing blocks it
        answer = httpx.get(s.url + "/golden", timeout=30).json()
        assert answer["check"]["state"] == "unsupported"
        assert "task is classify" in answer["check"]["reason"]
        assert answer["probes"] == [] and answer["vectors"] == []
        assert s.metric("embedding_server_golden_min_cosine") is None


ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/embeddings", {"input": DOCS}),
    ("/v2/embed", {"texts": DOCS, "input_type": "search_document", "embedding_types": ["float"]}),
    ("/pooling", {"input": DOCS}),
    ("/score", {"text_1": "what is a cat", "text_2": DOCS}),
    ("/rerank", {"query": "what is a cat", "documents": DOCS}),
    ("/tokenize", {"prompt": "what is a cat"}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[p for p, _ in ROUTES])
def test_another_expected_fingerprint_is_a_409_before_any_work(
    f32: RunningServer, f32_golden: dict[str, Any], path: str, body: dict[str, Any]
) -> None:
    ours = f32_golden["fingerprint"]
    other = "0123456789abcdef" if not ours.startswith("01234567") else "fedcba9876543210"
    tokens = f32.value("embedding_server_input_tokens_total")
    refused = httpx.post(f32.url + path, json=body, headers={EXPECT_HEADER: other}, timeout=30)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "fingerprint_mismatch" and error["param"] == EXPECT_HEADER
    assert ours in error["message"] and other in error["message"]
    assert HEADER not in refused.headers
    assert f32.value("embedding_server_input_tokens_total") == tokens  # nothing was run
    for expected in (ours, ours[:8], ours.upper()):
        served = httpx.post(
            f32.url + path, json=body, headers={EXPECT_HEADER: expected}, timeout=60
        )
        assert served.status_code == 200, served.text


PINNED_ROUTES = [r for r in ROUTES if r[0] != "/tokenize"]


@pytest.mark.parametrize(("path", "body"), PINNED_ROUTES, ids=[p for p, _ in PINNED_ROUTES])
def test_a_versioned_model_name_is_served_by_that_version_only(
    f32: RunningServer, f32_golden: dict[str, Any], path: str, body: dict[str, Any]
) -> None:
    """``<model>@<fingerprint>`` (what the gateway lists for each version during a model
    change) is served when the fingerprint, or a prefix of 8 or more of its digits, is the
    server's, and is a 409 before any work when it is another's."""
    ours = f32_golden["fingerprint"]
    name = httpx.get(f32.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    for pinned in (f"{name}@{ours}", f"{name}@{ours[:8]}", f"{name}@{ours.upper()}"):
        served = httpx.post(f32.url + path, json={**body, "model": pinned}, timeout=60)
        assert served.status_code == 200, served.text
        assert served.headers[HEADER] == ours
    other = "0123456789abcdef" if not ours.startswith("01234567") else "fedcba9876543210"
    tokens = f32.value("embedding_server_input_tokens_total")
    refused = httpx.post(f32.url + path, json={**body, "model": f"{name}@{other}"}, timeout=30)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "fingerprint_mismatch" and error["param"] == "model"
    assert ours in error["message"] and other in error["message"]
    assert f32.value("embedding_server_input_tokens_total") == tokens  # nothing was run


def test_the_openai_client_gets_a_versioned_names_vectors(
    f32: RunningServer, f32_golden: dict[str, Any]
) -> None:
    client = openai.OpenAI(base_url=f32.url + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    plain = client.embeddings.create(model=name, input=DOCS)
    pinned = client.embeddings.create(model=f"{name}@{f32_golden['fingerprint'][:10]}", input=DOCS)
    for a, b in zip(plain.data, pinned.data, strict=True):
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model=f"someone-else@{f32_golden['fingerprint']}", input=DOCS)
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):  # too short a prefix is no version: a name
        client.embeddings.create(model=f"{name}@{f32_golden['fingerprint'][:7]}", input=DOCS)


@pytest.mark.parametrize("value", ["0123456", "not-a-fingerprint", "0123456789abcdef0"])
def test_an_expected_fingerprint_that_is_none_is_a_400_naming_the_header(
    f32: RunningServer, value: str
) -> None:
    response = httpx.post(
        f32.url + "/v1/embeddings", json={"input": DOCS}, headers={EXPECT_HEADER: value}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == EXPECT_HEADER and EXPECT_HEADER in error["message"]

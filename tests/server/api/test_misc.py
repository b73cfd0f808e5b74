"""The vLLM-style extras (/pooling, /score, /tokenize, /detokenize), the probes (/health,
/ready), /info, /v1/models and /metrics, on the fake backend (and /tokenize on the real
all-MiniLM-L6-v2 WordPiece tokenizer)."""

from __future__ import annotations

import asyncio
import base64
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from embedding_server import termination
from embedding_server.api import create_app
from embedding_server.engine import Engine, load_engine
from embedding_server.metrics import (
    AUTOSCALING_METRICS,
    BACKLOG_SECONDS_METRIC,
    LOADING_METRIC,
    QUEUE_REQUESTS_METRIC,
    QUEUE_TOKENS_METRIC,
    Metrics,
)
from embedding_server.settings import ServerSettings

from tests.support.api import RunningServer, fake_settings, running_server, sample, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(fake_settings("fake?dim=32")) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any]) -> Any:
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_pooling_returns_one_vector_per_token(server: RunningServer) -> None:
    body = post(server, "/pooling", {"input": ["ab", "abcd"]})
    assert [d["index"] for d in body["data"]] == [0, 1]
    shapes = [np.array(d["data"]).shape for d in body["data"]]
    assert shapes == [(4, 32), (6, 32)]  # bytes + <s> and </s>
    assert body["usage"]["prompt_tokens"] == 10
    packed = post(server, "/pooling", {"input": "ab", "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), "<f4").reshape(4, 32)
    np.testing.assert_array_equal(decoded, np.array(body["data"][0]["data"], np.float32))
    pooled = post(server, "/pooling", {"input": "ab", "task": "embed"})
    embedded = post(server, "/v1/embeddings", {"input": "ab"})
    np.testing.assert_allclose(
        pooled["data"][0]["data"], embedded["data"][0]["embedding"], atol=1e-6
    )


def test_weightedmean_pooling_end_to_end() -> None:
    """/info reports the method, and /v1/embeddings is the position-weighted mean of the
    per-token states /pooling returns, normalized."""
    with running_server(fake_settings("fake?dim=16&pooling=weightedmean")) as running:
        assert httpx.get(running.url + "/info").json()["pooling"] == "weightedmean"
        texts = ["ab", "a longer input"]
        states = [np.array(d["data"]) for d in post(running, "/pooling", {"input": texts})["data"]]
        vectors = post(running, "/v1/embeddings", {"input": texts})["data"]
    for state, vector in zip(states, vectors, strict=True):
        weights = np.arange(1, len(state) + 1)[:, None]
        want = (state * weights).sum(0) / weights.sum()
        np.testing.assert_allclose(vector["embedding"], want / np.linalg.norm(want), atol=1e-5)


def test_score_is_the_cosine_of_the_embeddings(server: RunningServer) -> None:
    vectors = np.array(
        [
            d["embedding"]
            for d in post(server, "/v1/embeddings", {"input": ["query", "doc one", "doc two"]})[
                "data"
            ]
        ]
    )
    one_to_many = post(server, "/score", {"text_1": "query", "text_2": ["doc one", "doc two"]})
    assert [d["index"] for d in one_to_many["data"]] == [0, 1]
    np.testing.assert_allclose(
        [d["score"] for d in one_to_many["data"]], vectors[1:] @ vectors[0], atol=1e-5
    )
    pairs = post(server, "/score", {"text_1": ["query", "doc one"], "text_2": ["query", "doc two"]})
    np.testing.assert_allclose(
        [d["score"] for d in pairs["data"]], [1.0, vectors[1] @ vectors[2]], atol=1e-5
    )


def test_tokenize_and_detokenize_round_trip(server: RunningServer) -> None:
    tokens = post(server, "/tokenize", {"prompt": "héllo", "return_token_strs": True})
    assert tokens["count"] == len(tokens["tokens"]) == 8  # 6 UTF-8 bytes + 2 specials
    assert tokens["max_model_len"] == 512
    assert tokens["token_strs"][0] == "<s>"
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]})["prompt"] == "héllo"
    plain = post(server, "/tokenize", {"prompt": "héllo", "add_special_tokens": False})
    assert plain["tokens"] == tokens["tokens"][1:-1] and plain["token_strs"] is None


def test_tokenize_token_strs_keep_byte_level_markers(server: RunningServer) -> None:
    """Byte-level BPE: the space marker and the bytes of a multi-byte character come back as
    the tokenizer's own strings (convert_ids_to_tokens), not as per-id decoded text."""
    from embedding_server.device.fake import build_fake_tokenizer
    from transformers import PreTrainedTokenizerFast

    body = post(server, "/tokenize", {"prompt": "a é", "return_token_strs": True})
    assert body["token_strs"] == ["<s>", "a", "Ġ", "Ã", "©", "</s>"]
    hf = PreTrainedTokenizerFast(tokenizer_object=build_fake_tokenizer())
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])


def test_tokenize_token_strs_keep_wordpiece_continuations(minilm_dir: Path) -> None:
    """On the real all-MiniLM-L6-v2: continuation pieces keep their ``##``, exactly as the
    Hugging Face tokenizer names them."""
    from transformers import AutoTokenizer

    text = "Tokenization is unbelievably useful"
    hf = AutoTokenizer.from_pretrained(str(minilm_dir))
    ids = hf(text)["input_ids"]
    want = hf.convert_ids_to_tokens(ids)
    assert want == [
        "[CLS]",
        "token",
        "##ization",
        "is",
        "un",
        "##bel",
        "##ie",
        "##va",
        "##bly",
        "useful",
        "[SEP]",
    ]
    with running_server(ServerSettings(max_batch_tokens=4096)) as minilm:
        body = post(minilm, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert body["tokens"] == ids and body["token_strs"] == want


def test_a_ready_server_has_frozen_its_startup_heap(server: RunningServer) -> None:
    """The objects loading left behind (torch, transformers, the model) are out of the
    collector's sight, so a full collection does not stop the event loop to walk them
    (that was most of the p99 latency under load, see bench/frontend.py)."""
    assert httpx.get(server.url + "/ready").status_code == 200
    assert gc.get_freeze_count() > 0


def test_models_info_and_probes(server: RunningServer) -> None:
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake"
    info = httpx.get(server.url + "/info").json()
    assert info["served_model_name"] == "fake" and info["ready"] is True
    assert info["dimensions"] == 32 and info["pooling"] == "mean"
    assert info["max_input_tokens"] == 512 and info["prompts"]["query"] == "query: "
    # The limits a client must stay within, as resolved (half the default queue).
    assert info["max_request_tokens"] == 131072 and info["max_queue_tokens"] == 262144
    assert info["max_response_bytes"] == 64 * 2**20 and info["auto_truncate"] is False
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200


async def test_ready_is_503_until_the_model_is_up_and_again_while_draining() -> None:
    # The app without its lifespan: the model was never loaded.
    app = create_app(fake_settings(), connect=load_engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        assert (await client.get("/health")).status_code == 200
        not_ready = await client.get("/ready")
        assert not_ready.status_code == 503
        assert not_ready.json()["error"]["code"] == "not_ready"
        refused = await client.post("/v1/embeddings", json={"input": "a"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
    with running_server(fake_settings()) as running:
        assert httpx.get(running.url + "/ready").status_code == 200
        running.lifecycle.begin_drain("test")
        draining = httpx.get(running.url + "/ready")
        assert (
            draining.status_code == 503 and "shutting down" in draining.json()["error"]["message"]
        )
        assert httpx.get(running.url + "/health").status_code == 200


async def test_autoscaling_gauges_are_exported_only_while_ready() -> None:
    # A replica that is loading has no traffic: a 0 from it would lower the average an HPA
    # scales on (superlinked/sie#293). Absent, it counts as at the target on a scale-down.
    app = create_app(fake_settings(), connect=load_engine)  # no lifespan: never loads
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        loading = (await client.get("/metrics")).text
    for name in AUTOSCALING_METRICS:
        assert sample(loading, name) is None, name
    assert sample(loading, LOADING_METRIC) == 1
    assert sample(loading, "embedding_server_requests_total") is None  # nothing counted yet
    assert "# TYPE embedding_server_stage_seconds histogram" in loading  # the rest is there

    with running_server(fake_settings()) as running:
        ready = httpx.get(running.url + "/metrics").text
        for name in AUTOSCALING_METRICS:
            assert sample(ready, name) == 0, name
        assert sample(ready, LOADING_METRIC) == 0
        running.lifecycle.begin_drain("test")
        draining = httpx.get(running.url + "/metrics").text
        assert sample(draining, BACKLOG_SECONDS_METRIC) is None
        assert sample(draining, LOADING_METRIC) == 0  # draining is not loading

    failed = create_app(fake_settings(), connect=load_engine)
    failed.state.lifecycle.fail("no such model")
    transport = httpx.ASGITransport(app=failed)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        text = (await client.get("/metrics")).text
    assert sample(text, BACKLOG_SECONDS_METRIC) is None and sample(text, LOADING_METRIC) == 0


async def test_a_model_that_will_not_load_says_so_in_the_pods_termination_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kubelet copies /dev/termination-log into the pod's status: the operator reads it
    # there (ModelLoadFailed). A fixed line: the error itself may quote a Secret's value.
    log = tmp_path / "termination-log"
    log.touch()
    monkeypatch.setattr(termination, "TERMINATION_LOG", log)

    async def broken(settings: ServerSettings, metrics: Metrics) -> Engine:
        raise OSError("could not open /models/s3cr3t-token")

    app = create_app(fake_settings(), connect=broken)
    async with app.router.lifespan_context(app):
        await asyncio.sleep(0.2)
    assert app.state.lifecycle.exit_code == 1
    assert log.read_text() == termination.MODEL_LOAD_FAILED + "\n"
    assert "s3cr3t" not in log.read_text()


async def test_ready_does_not_echo_why_the_model_failed_to_load() -> None:
    # /ready is open without the API key; a load error can quote a path or a value that
    # came from a Secret. The log says why, /ready only that it failed.
    app = create_app(fake_settings(), connect=load_engine)
    app.state.lifecycle.fail("could not load /models/s3cr3t-token: OSError: denied")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        for path, body in (("/ready", None), ("/v1/embeddings", {"input": "a"})):
            response = await client.request("GET" if body is None else "POST", path, json=body)
            assert response.status_code == 503
            message = response.json()["error"]["message"]
            assert "could not be loaded" in message and "s3cr3t" not in message


def test_auto_truncate_cuts_over_long_input_unless_the_request_says_otherwise() -> None:
    # The fake tokenizer is one token per byte plus <s> and </s>: 40 letters are 42 tokens.
    text = "abcdefghij" * 4
    base = "fake?max_len=16&dim=16"
    with running_server(fake_settings(base)) as strict:
        refused = httpx.post(strict.url + "/v1/embeddings", json={"input": text}, timeout=30)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"
    with running_server(fake_settings(base, auto_truncate=True)) as server:
        auto = post(server, "/v1/embeddings", {"input": text})
        assert auto["usage"]["prompt_tokens"] == 16
        assert server.value("embedding_server_truncated_inputs_total") == 1
        explicit = post(server, "/v1/embeddings", {"input": text, "truncation_side": "right"})
        assert explicit["data"][0]["embedding"] == auto["data"][0]["embedding"]
        left = post(server, "/v1/embeddings", {"input": text, "truncation_side": "left"})
        same_left = post(
            server,
            "/v1/embeddings",
            {"input": text, "truncation_side": "left", "truncate_prompt_tokens": -1},
        )
        assert left["data"][0]["embedding"] == same_left["data"][0]["embedding"]
        assert left["data"][0]["embedding"] != auto["data"][0]["embedding"]
        # A request's own setting wins: a lower limit, or Cohere's NONE.
        assert (
            post(server, "/v1/embeddings", {"input": text, "truncate_prompt_tokens": 5})["usage"][
                "prompt_tokens"
            ]
            == 5
        )
        none = httpx.post(
            server.url + "/v2/embed", json={"texts": [text], "truncate": "NONE"}, timeout=30
        )
        assert none.status_code == 400
        assert post(server, "/score", {"text_1": text, "text_2": "a"})["usage"]["prompt_tokens"]
        assert post(server, "/pooling", {"input": text, "task": "embed"})["usage"] == {
            "prompt_tokens": 16,
            "total_tokens": 16,
        }
        assert server.value("embedding_server_truncated_inputs_total") == 7


def test_metrics_are_exposed_and_move_under_load() -> None:
    # Slow forward passes (100 ms, one sequence each) so a burst visibly queues.
    settings = fake_settings("fake?delay_ms=100&max_len=64", max_batch_tokens=64, max_batch_size=1)
    with running_server(settings) as server:
        text = httpx.get(server.url + "/metrics").text
        for name in (
            QUEUE_REQUESTS_METRIC,
            QUEUE_TOKENS_METRIC,
            BACKLOG_SECONDS_METRIC,
            "embedding_server_request_seconds",
            "embedding_server_in_flight_requests",
            "embedding_server_requests_total",
            "embedding_server_input_tokens_total",
            "embedding_server_stage_seconds",
            "embedding_server_batch_size",
            "embedding_server_batch_tokens",
            "embedding_server_batch_budget_tokens",
            "embedding_server_batch_seconds",
            "embedding_server_truncated_inputs_total",
            "embedding_server_model_load_seconds",
        ):
            assert f"# TYPE {name.removesuffix('_total')}" in text, name
        assert sample(text, "embedding_server_model_load_seconds") > 0
        assert sample(text, "embedding_server_batch_budget_tokens") == 64  # --max-batch-tokens
        peaks = {"queue_requests": 0.0, "queue_tokens": 0.0, "in_flight": 0.0, "backlog": 0.0}

        async def load() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as http:
                tasks = [
                    asyncio.create_task(
                        http.post(server.url + "/v1/embeddings", json={"input": f"text number {i}"})
                    )
                    for i in range(8)
                ]

                def observe() -> bool:
                    peaks["queue_requests"] = max(
                        peaks["queue_requests"], server.value(QUEUE_REQUESTS_METRIC)
                    )
                    peaks["queue_tokens"] = max(
                        peaks["queue_tokens"], server.value(QUEUE_TOKENS_METRIC)
                    )
                    peaks["in_flight"] = max(
                        peaks["in_flight"], server.value("embedding_server_in_flight_requests")
                    )
                    peaks["backlog"] = max(peaks["backlog"], server.value(BACKLOG_SECONDS_METRIC))
                    return peaks["queue_requests"] >= 3

                await asyncio.to_thread(
                    wait_for, observe, timeout=20, interval=0.005, what="the queue to fill"
                )
                return [r.status_code for r in await asyncio.gather(*tasks)]

        assert asyncio.run(load()) == [200] * 8
        assert peaks["queue_tokens"] >= 3 * 15 and peaks["in_flight"] >= 3
        # Three or more texts waiting behind a 100 ms model that runs one at a time: at least
        # a quarter second of work (the rate is measured on the warm batches before them).
        assert peaks["backlog"] >= 0.25
        after = httpx.get(server.url + "/metrics").text
        assert sample(after, QUEUE_REQUESTS_METRIC) == 0
        assert sample(after, BACKLOG_SECONDS_METRIC) == 0
        assert (
            sample(
                after,
                "embedding_server_requests_total",
                {"endpoint": "/v1/embeddings", "status": "200"},
            )
            == 8
        )
        assert sample(after, "embedding_server_input_tokens_total") >= 8 * 15
        embeddings = {"endpoint": "/v1/embeddings"}
        assert sample(after, "embedding_server_request_seconds_count", embeddings) == 8
        # Each waited for at least one 100 ms forward pass.
        assert sample(after, "embedding_server_request_seconds_sum", embeddings) >= 8 * 0.1
        batches = sample(after, "embedding_server_batch_size_count")
        assert batches >= 8
        # One timing per forward pass, each at least the fake model's 100 ms.
        assert sample(after, "embedding_server_batch_seconds_count") == batches
        assert sample(after, "embedding_server_batch_seconds_sum") >= 0.1 * batches
        for stage in ("tokenize", "queue", "forward", "pool"):
            assert sample(after, "embedding_server_stage_seconds_count", {"stage": stage}) >= 8
        assert sample(after, "embedding_server_stage_seconds_sum", {"stage": "queue"}) > 0.1
        httpx.post(
            server.url + "/v1/embeddings", json={"input": "x" * 100, "truncate_prompt_tokens": -1}
        )
        assert server.metric("embedding_server_truncated_inputs_total") == 1

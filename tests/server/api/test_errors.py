"""Every way a request can go wrong, seen from the client: status, the one error body shape,
the field named, and headers (Retry-After, X-Request-Id). Runs on the fake backend: the
model adds nothing to these checks."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.api import RunningServer, fake_settings, running_server, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(fake_settings(max_request_bytes=4096, max_inputs_per_request=8)) as s:
        yield s


def assert_error(
    response: httpx.Response, status: int, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


JSON_HEADERS = {"content-type": "application/json"}


def post(server: RunningServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, timeout=30, **kwargs)


@pytest.mark.parametrize("raw", [b'{"input": ', b"not json", b"\xff\xfe", b'{"input": "a",}'])
def test_malformed_json_is_a_400(server: RunningServer, raw: bytes) -> None:
    assert_error(post(server, "/v1/embeddings", content=raw, headers=JSON_HEADERS), 400)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": 123}, "input"),
        ("/v1/embeddings", {"input": [["a"]]}, "input"),
        ("/v1/embeddings", {"input": [-1]}, "input"),
        ("/v1/embeddings", {"input": "a", "dimensions": "x"}, "dimensions"),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "embed_dtype": "int4"}, "embed_dtype"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "binary"}, "encoding_format"),
        (
            "/v1/embeddings",
            {"input": "a", "encoding_format": "bytes", "embed_dtype": "fp8"},
            "embed_dtype",
        ),
        (
            "/v1/embeddings",
            {"input": "a", "encoding_format": "bytes", "endianness": "middle"},
            "endianness",
        ),
        # The binary options mean nothing with JSON numbers: refused, not ignored.
        ("/v1/embeddings", {"input": "a", "embed_dtype": "float16"}, "embed_dtype"),
        (
            "/v1/embeddings",
            {"input": "a", "encoding_format": "float", "embed_dtype": "fp8_e4m3"},
            "embed_dtype",
        ),
        ("/v1/embeddings", {"input": "a", "endianness": "big"}, "endianness"),
        ("/v1/embeddings", {"input": "a", "endianness": 1}, "endianness"),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/embeddings", {"input": "a", "truncation_side": "middle"}, "truncation_side"),
        ("/v1/embeddings", {"input": "a", "normalize": "perhaps"}, "normalize"),
        ("/v1/embeddings", {}, "input"),
        ("/v2/embed", {"texts": "a"}, "texts"),
        ("/v2/embed", {"texts": ["a"], "embedding_types": ["float64"]}, "embedding_types"),
        ("/v2/embed", {"texts": ["a"], "embedding_types": []}, "embedding_types"),
        ("/v2/embed", {"texts": ["a"], "truncate": "MIDDLE"}, "truncate"),
        ("/score", {"text_1": 1, "text_2": "a"}, "text_1"),
        ("/tokenize", {"prompt": ["a"]}, "prompt"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/pooling", {"input": "a", "task": "rerank"}, "task"),
        ("/pooling", {"input": "a", "embed_dtype": "bfloat16"}, "embed_dtype"),
        ("/pooling", {"input": "a", "endianness": "little"}, "endianness"),
        ("/pooling", {"input": "a", "encoding_format": "bytes", "endianness": "le"}, "endianness"),
        ("/pooling", {"input": "a", "encoding_format": "raw"}, "encoding_format"),
    ],
)
def test_wrong_types_and_values_are_a_400_naming_the_field(
    server: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    assert_error(post(server, path, json=body), 400, param=param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": "a", "prompt_name": "nope"}, "prompt_name"),
        (
            "/v1/embeddings",
            {"input": "a", "truncate_prompt_tokens": 100000},
            "truncate_prompt_tokens",
        ),
        ("/detokenize", {"tokens": [100000]}, "tokens"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v2/embed", {"texts": ["a"], "truncate": "NONE", "max_tokens": 3}, "max_tokens"),
    ],
)
def test_invalid_requests_the_engine_refuses_are_a_400(
    server: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    assert_error(post(server, path, json=body), 400, param=param)


def test_too_many_inputs_is_a_400(server: RunningServer) -> None:
    error = assert_error(
        post(server, "/v1/embeddings", json={"input": ["a"] * 9}), 400, param="input"
    )
    assert "at most 8" in error["message"]
    assert post(server, "/v1/embeddings", json={"input": ["a"] * 8}).status_code == 200


def test_over_long_input_is_a_400_with_the_token_count(server: RunningServer) -> None:
    error = assert_error(
        post(server, "/v1/embeddings", json={"input": "x" * 600}),
        400,
        param="input",
        code="context_length_exceeded",
    )
    assert "602 tokens" in error["message"]


def test_body_over_the_limit_is_a_413(server: RunningServer) -> None:
    big = {"input": "a" * 5000}
    assert_error(post(server, "/v1/embeddings", json=big), 413, code="payload_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        yield b'{"input": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    assert_error(
        post(server, "/v1/embeddings", content=chunks(), headers=JSON_HEADERS),
        413,
        code="payload_too_large",
    )


def test_unknown_routes_and_methods_use_the_error_shape(server: RunningServer) -> None:
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404, code="not_found")
    assert_error(httpx.get(server.url + "/v1/embeddings"), 405, code="method_not_allowed")


def test_another_model_is_a_404(server: RunningServer) -> None:
    assert_error(
        post(server, "/v1/embeddings", json={"input": "a", "model": "gpt-4"}),
        404,
        param="model",
        code="model_not_found",
    )
    assert_error(post(server, "/v2/embed", json={"texts": ["a"], "model": "embed-v4.0"}), 404)


def test_request_id_is_echoed_or_generated(server: RunningServer) -> None:
    given = post(
        server, "/v1/embeddings", json={"input": "a"}, headers={"X-Request-Id": "trace-123"}
    )
    assert given.headers["x-request-id"] == "trace-123"
    generated = post(server, "/v1/embeddings", json={"input": "a"})
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])
    failed = post(server, "/v1/embeddings", json={"input": 1}, headers={"X-Request-Id": "r-9"})
    assert failed.headers["x-request-id"] == "r-9"


def test_timing_headers_are_in_milliseconds(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request held for a known 250 ms reports about 250 in x-total-time: in seconds it
    would say 0.25, in microseconds 250000."""
    engine = server.lifecycle.engine
    assert engine is not None
    original = engine.aembed

    async def slow(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.25)
        return await original(*args, **kwargs)

    monkeypatch.setattr(engine, "aembed", slow)
    response = post(server, "/v1/embeddings", json={"input": ["a", "bb"]})
    assert response.status_code == 200
    for header in ("x-tokenization-time", "x-queue-time", "x-inference-time", "x-total-time"):
        assert float(response.headers[header]) >= 0.0
    assert 250 <= float(response.headers["x-total-time"]) < 30_000
    assert int(response.headers["x-compute-tokens"]) == response.json()["usage"]["prompt_tokens"]


def test_unexpected_errors_are_a_generic_500_logged_with_the_request_id(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = server.lifecycle.engine
    assert engine is not None

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(engine, "aembed", broken)
    with caplog.at_level(logging.ERROR):
        response = post(
            server, "/v1/embeddings", json={"input": "a"}, headers={"X-Request-Id": "boom-1"}
        )
    error = assert_error(response, 500, code="internal_error")
    assert "secret" not in response.text and "Traceback" not in response.text
    assert "boom-1" in error["message"]
    logged = [r for r in caplog.records if "boom-1" in r.getMessage()]
    assert logged and logged[0].exc_info is not None


def test_api_key_guards_every_route_but_probes_and_metrics() -> None:
    with running_server(fake_settings(api_key="s3cret")) as server:
        for path, body in (
            ("/v1/embeddings", {"input": "a"}),
            ("/v2/embed", {"texts": ["a"]}),
            ("/pooling", {"input": "a"}),
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/tokenize", {"prompt": "a"}),
            ("/detokenize", {"tokens": [5]}),
            ("/rerank", {"query": "q", "documents": ["a"]}),
        ):
            refused = post(server, path, json=body)
            assert_error(refused, 401, code="invalid_api_key")
            assert refused.headers["www-authenticate"] == "Bearer"
            assert_error(post(server, path, json=body, headers={"Authorization": "Bearer no"}), 401)
            ok = post(server, path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200, (path, ok.text)
        for path in ("/v1/models", "/info", "/openapi.json"):
            assert_error(httpx.get(server.url + path), 401)
        for path in ("/health", "/ready", "/load", "/metrics"):
            assert httpx.get(server.url + path).status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.embeddings.create(input="a", model="fake")
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert len(good.embeddings.create(input="a", model="fake").data[0].embedding) == 384


def _slow_server_settings() -> Any:
    # One 20-token sequence per 600 ms forward pass, and room for one more in the queue.
    return fake_settings(
        "fake?delay_ms=600&max_len=32", max_batch_tokens=32, max_queue_tokens=32, max_batch_size=1
    )


def test_a_full_queue_is_a_429_with_retry_after() -> None:
    with running_server(_slow_server_settings()) as server:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as http:
                return list(
                    await asyncio.gather(
                        *(
                            http.post(server.url + "/v1/embeddings", json={"input": "x" * 18})
                            for _ in range(6)
                        )
                    )
                )

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 429 in statuses, statuses
        for response in responses:
            if response.status_code == 429:
                assert_error(response, 429, code="queue_full")
                assert int(response.headers["retry-after"]) >= 1
        assert (
            server.metric(
                "embedding_server_requests_total", {"endpoint": "/v1/embeddings", "status": "429"}
            )
            >= 1
        )


def test_client_disconnect_cancels_queued_work() -> None:
    with running_server(_slow_server_settings()) as server:
        batches_before = server.metric("embedding_server_batch_size_count")

        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as http:
                first = asyncio.create_task(
                    http.post(server.url + "/v1/embeddings", json={"input": "x" * 18})
                )
                await asyncio.to_thread(
                    wait_for,
                    lambda: server.value("embedding_server_in_flight_requests") >= 1,
                    timeout=10,
                    what="first request in flight",
                )
                # A second client queues behind it, then hangs up.
                body = b'{"input": "' + b"y" * 18 + b'"}'
                sock = socket.create_connection(("127.0.0.1", server.port))
                sock.sendall(
                    b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
                # One sequence is a full batch here, so the scheduler takes it out of the
                # queue at once and prepares it as the next batch while the first runs.
                await asyncio.to_thread(
                    wait_for,
                    lambda: server.value("embedding_server_in_flight_requests") >= 2,
                    timeout=10,
                    what="second request waiting",
                )
                sock.close()
                await asyncio.to_thread(
                    wait_for,
                    lambda: server.value("embedding_server_in_flight_requests") == 1,
                    timeout=10,
                    what="second request gone",
                )
                return await first

        assert asyncio.run(scenario()).status_code == 200
        wait_for(
            lambda: (
                server.metric(
                    "embedding_server_requests_total",
                    {"endpoint": "/v1/embeddings", "status": "499"},
                )
                == 1
            ),
            timeout=10,
            what="the cancelled request counted",
        )
        # Only the first request's batch ever ran.
        assert server.metric("embedding_server_batch_size_count") == batches_before + 1

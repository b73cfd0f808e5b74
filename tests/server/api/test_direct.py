"""The POST routes are served by ``api/direct.py`` rather than through FastAPI's request
machinery, and enter the app at the server's own outermost middleware (``EmbeddingApp``)
rather than through Starlette's outer layers: a client must not be able to tell. Each
request below goes to the server as it runs and to the same app with both shortcuts taken
out (FastAPI's whole stack serving every route itself), and the two answers must match:
status, error type, field and code, and the payload."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from embedding_server.api.app import EmbeddingApp
from embedding_server.api.direct import DirectRoutes, direct_routes
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from tests.support.api import RunningServer, fake_settings, running_server, wait_for

pytestmark = pytest.mark.timeout(120)

SETTINGS = {"max_request_bytes": 4096, "max_inputs_per_request": 8}


@pytest.fixture(scope="module")
def direct() -> Iterator[RunningServer]:
    with running_server(fake_settings(**SETTINGS)) as server:
        yield server


@pytest.fixture(scope="module")
def framework() -> Iterator[RunningServer]:
    server = RunningServer(fake_settings(**SETTINGS))
    before = len(server.app.user_middleware)
    server.app.user_middleware = [
        m for m in server.app.user_middleware if m.cls is not DirectRoutes
    ]
    assert len(server.app.user_middleware) == before - 1
    assert isinstance(server.app, EmbeddingApp)
    server.app.direct_paths = frozenset()  # every request through Starlette's outer layers
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Body(BaseModel):
    text: str


J = {"content-type": "application/json"}

CASES: list[tuple[str, bytes]] = [
    # Bodies that are not what any route takes.
    ("/v1/embeddings", b""),
    ("/v1/embeddings", b"   "),
    ("/v1/embeddings", b"not json"),
    ("/v1/embeddings", b'{"input": '),
    ("/v1/embeddings", b"\xff\xfe"),
    ("/v1/embeddings", b"[1, 2]"),
    ("/v1/embeddings", b'"just a string"'),
    ("/v1/embeddings", b"null"),
    # What only the standard library's parser accepts: validation still names the field.
    ("/v1/embeddings", b'{"input": "a\\ud800b"}'),
    ("/v1/embeddings", b'{"input": "a", "dimensions": NaN}'),
    # Wrong fields, each route.
    ("/v1/embeddings", b'{"input": 123}'),
    ("/v1/embeddings", b'{"input": [["a"]]}'),
    ("/v1/embeddings", b'{"input": "a", "dimensions": 0}'),
    ("/v1/embeddings", b'{"input": "a", "dimensions": "x"}'),
    ("/v1/embeddings", b'{"input": "a", "encoding_format": "hex"}'),
    ("/v1/embeddings", b'{"input": "a", "embed_dtype": "float16"}'),
    ("/v1/embeddings", b'{"input": "a", "model": "another"}'),
    ("/v1/embeddings", b'{"input": []}'),
    ("/v1/embeddings", b'{"input": ["a","b","c","d","e","f","g","h","i"]}'),
    ("/v1/embeddings", b'{"nput": "a"}'),
    ("/v2/embed", b'{"texts": "a"}'),
    ("/v2/embed", b'{"texts": ["a"], "embedding_types": []}'),
    ("/v2/embed", b'{"texts": ["a"], "truncate": "MIDDLE"}'),
    ("/pooling", b'{"input": "a", "task": "nonsense"}'),
    ("/score", b'{"text_1": 1, "text_2": "b"}'),
    ("/rerank", b'{"query": "q"}'),
    ("/classify", b'{"input": "a"}'),
    ("/tokenize", b'{"prompt": 5}'),
    ("/detokenize", b'{"tokens": ["a"]}'),
    # And answers: the payloads must match too.
    ("/v1/embeddings", b'{"input": "hello world"}'),
    ("/v1/embeddings", b'{"input": ["a", "bb"], "encoding_format": "base64", "dimensions": 8}'),
    ("/v2/embed", b'{"texts": ["a"], "input_type": "search_query", "embedding_types": ["int8"]}'),
    ("/pooling", b'{"input": "abc"}'),
    ("/score", b'{"text_1": "a", "text_2": ["a", "b"]}'),
    ("/tokenize", b'{"prompt": "abc"}'),
    ("/detokenize", b'{"tokens": [97, 98]}'),
]

VOLATILE = {"id", "created", "x-total-time"}


def _comparable(response: httpx.Response) -> tuple[int, Any]:
    if response.headers["content-type"].startswith("application/json"):
        body = response.json()
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in VOLATILE}
            error = body.get("error")
            if isinstance(error, dict) and error.get("code") == "invalid_json":
                # The two JSON parsers word their reasons differently; both say where.
                error = {k: v for k, v in error.items() if k != "message"}
                body = {"error": error}
        return response.status_code, body
    return response.status_code, response.content


@pytest.mark.parametrize(("path", "raw"), CASES, ids=[f"{p} {r[:30]!r}" for p, r in CASES])
def test_a_client_cannot_tell_the_direct_routes_from_fastapi(
    direct: RunningServer, framework: RunningServer, path: str, raw: bytes
) -> None:
    ours = httpx.post(direct.url + path, content=raw, headers=J, timeout=30)
    theirs = httpx.post(framework.url + path, content=raw, headers=J, timeout=30)
    assert _comparable(ours) == _comparable(theirs)
    if ours.status_code >= 400:
        error = ours.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_every_post_route_is_served_directly(direct: RunningServer) -> None:
    schema = httpx.get(direct.url + "/openapi.json").json()
    posts = {path for path, methods in schema["paths"].items() if "post" in methods}
    assert posts and set(direct_routes(_routers())) == posts


def test_the_body_limit_and_the_request_context_still_apply(direct: RunningServer) -> None:
    big = orjson.dumps({"input": "x" * 5000})
    response = httpx.post(direct.url + "/v1/embeddings", content=big, headers=J)
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"

    counted = {"endpoint": "/v1/embeddings", "status": "200"}
    before = direct.value("embedding_server_requests_total", counted)
    tagged = httpx.post(
        direct.url + "/v1/embeddings", json={"input": "a"}, headers={"x-request-id": "abc-1"}
    )
    assert tagged.status_code == 200 and tagged.headers["x-request-id"] == "abc-1"
    assert float(tagged.headers["x-total-time"]) > 0
    assert httpx.post(direct.url + "/v1/embeddings", json={"input": "b"}).status_code == 200
    # Counted when each request ends, which may be just after its client has the answer.
    wait_for(
        lambda: direct.value("embedding_server_requests_total", counted) == before + 2,
        timeout=10,
        what="the request counted by endpoint and status",
    )


class _Spy:
    """An ASGI layer that records the paths it is called for, then passes them on."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.paths.append(f"{scope['method']} {scope['path']}")
        await self.app(scope, receive, send)


def test_json_posts_skip_starlettes_outer_layers_and_nothing_else_does(
    direct: RunningServer,
) -> None:
    app = direct.app
    assert httpx.post(direct.url + "/v1/embeddings", json={"input": "warm"}).status_code == 200
    outer = app.middleware_stack  # Starlette's ServerErrorMiddleware and what it wraps
    spy = app.middleware_stack = _Spy(outer)
    try:
        answer = httpx.post(
            direct.url + "/v1/embeddings", json={"input": "a"}, headers={"x-request-id": "r-7"}
        )
        health = httpx.get(direct.url + "/health")
        unknown = httpx.post(direct.url + "/v1/nothing-here", json={})
    finally:
        app.middleware_stack = outer
    # The JSON POST still went through the server's own middleware (request id, timing)...
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "r-7"
    assert len(answer.json()["data"][0]["embedding"]) > 0
    assert "x-total-time" in answer.headers
    # ... but not through Starlette's outer layers; a GET and an unknown path did.
    assert health.status_code == 200 and unknown.status_code == 404
    assert spy.paths == ["GET /health", "POST /v1/nothing-here"]


def test_a_post_route_of_another_shape_is_refused_when_the_app_is_built() -> None:
    router = APIRouter()

    @router.post("/odd")
    async def odd(request: Request, body: Body) -> Response:  # parameters swapped
        return Response()

    with pytest.raises(TypeError, match="POST /odd"):
        direct_routes([router])


def _routers() -> list[APIRouter]:
    from embedding_server.api.app import ROUTERS

    return list(ROUTERS)

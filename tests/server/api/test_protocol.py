"""The request schemas: each dialect's truncation fields translated into one policy, and the
validators every schema shares, checked once per schema."""

from __future__ import annotations

from typing import Any

import pytest
from embedding_server.api.app import ROUTERS
from embedding_server.api.protocol import (
    ApiRequest,
    CohereEmbedRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingRequest,
    ScoreRequest,
    TokenizeRequest,
    cohere_truncation,
    openai_truncation,
)
from embedding_server.api.protocol_tasks import ClassifyRequest, RerankRequest
from embedding_server.errors import InvalidRequestError
from embedding_server.tokenization import Truncation
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError


def test_truncation_dialects() -> None:
    assert openai_truncation(None) == Truncation(side=None, param="input")
    assert openai_truncation(-1, "left").side == "left"
    assert cohere_truncation("START") == Truncation(side="left")
    assert cohere_truncation(None).side == "right"
    for bad in (
        lambda: openai_truncation(0),
        lambda: cohere_truncation("MIDDLE"),
        lambda: openai_truncation(5, "middle"),
        lambda: cohere_truncation("NONE", max_tokens=5),
    ):
        with pytest.raises(InvalidRequestError):
            bad()


def test_request_models_translate_their_own_fields() -> None:
    openai = EmbeddingRequest(input="x", truncate_prompt_tokens=8, truncation_side="left")
    assert openai.truncation() == Truncation(
        side="left", max_tokens=8, param="truncate_prompt_tokens"
    )
    assert EmbeddingRequest(input="x").truncation() == Truncation(side=None, param="input")
    cohere = CohereEmbedRequest(texts=["x"], truncate="START", max_tokens=16)
    assert cohere.truncation() == Truncation(side="left", max_tokens=16, param="max_tokens")
    assert CohereEmbedRequest(texts=["x"]).truncation() == Truncation(side="right")


# One valid body per request schema; the test below requires every schema to be here.
MINIMAL_BODIES: dict[type[ApiRequest], dict[str, Any]] = {
    EmbeddingRequest: {"input": "a"},
    CohereEmbedRequest: {"texts": ["a"]},
    PoolingRequest: {"input": "a"},
    ScoreRequest: {"text_1": "a", "text_2": "b"},
    TokenizeRequest: {"prompt": "a"},
    DetokenizeRequest: {"tokens": [1]},
    RerankRequest: {"query": "q", "documents": ["d"]},
    ClassifyRequest: {"input": "a"},
}

LONE = "\ud800"


def _route_schemas() -> set[type[BaseModel]]:
    """The body schema of every route the server has."""
    schemas: set[type[BaseModel]] = set()
    for router in ROUTERS:
        for route in router.routes:
            if isinstance(route, APIRoute) and route.dependant.body_params:
                annotation = route.dependant.body_params[0].field_info.annotation
                assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
                schemas.add(annotation)
    return schemas


def test_every_route_schema_derives_from_the_shared_base() -> None:
    """Each route's body schema is an ApiRequest (so it has the shared validators), and each
    one is exercised by the tests below."""
    schemas = _route_schemas()
    assert all(issubclass(schema, ApiRequest) for schema in schemas), schemas
    assert schemas == set(MINIMAL_BODIES)


def _text_fields(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """Each field of ``body`` holding text, with that text replaced by a lone surrogate."""
    out: list[tuple[str, Any]] = [("model", f"a{LONE}")]
    for name, value in body.items():
        if isinstance(value, str):
            out.append((name, f"x{LONE}y"))
        elif isinstance(value, list) and value and isinstance(value[0], str):
            out.append((name, [*value, LONE]))
            if name == "documents":  # the object form of a document
                out.append((name, [{"text": "fine"}, {"text": LONE}]))
    return out


@pytest.mark.parametrize("schema", list(MINIMAL_BODIES), ids=lambda c: c.__name__)
def test_every_schema_refuses_a_lone_surrogate_in_each_text_field(
    schema: type[ApiRequest],
) -> None:
    body = MINIMAL_BODIES[schema]
    schema.model_validate(body)  # the body itself is valid
    for field, bad in _text_fields(body):
        with pytest.raises(ValidationError) as caught:
            schema.model_validate({**body, field: bad})
        (error,) = caught.value.errors()
        assert error["loc"] == (field,), (schema.__name__, error)
        assert "surrogate" in error["msg"], (schema.__name__, error)


def test_every_schema_ignores_unknown_fields() -> None:
    for schema, body in MINIMAL_BODIES.items():
        parsed = schema.model_validate({**body, "an_unknown_field": 1})
        assert "an_unknown_field" not in parsed.model_dump(), schema.__name__

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
    RequestLimits,
    ScoreRequest,
    TokenizeRequest,
    cohere_truncation,
    openai_truncation,
)
from embedding_server.api.protocol_tasks import ClassifyRequest, RerankRequest
from embedding_server.errors import InvalidRequestError, TooManyTokensError
from embedding_server.request.truncation import Truncation
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


@pytest.mark.parametrize(
    ("value", "shape"),
    [
        ("text", "text"),
        (["a", 1], "texts"),
        ([1, "a"], "tokens"),
        ([-1], "tokens"),
        ([[1], ["a"]], "token_lists"),
        (5, "texts"),
    ],
)
def test_an_input_is_validated_as_the_one_shape_its_first_element_says(
    value: Any, shape: str
) -> None:
    """One error, from one member of the input union: the shape is chosen from the value,
    never found by trying each member (a list of millions of ids used to be validated as a
    list of strings first)."""
    if shape == "text":
        assert EmbeddingRequest.model_validate({"input": value}).input == value
        return
    with pytest.raises(ValidationError) as caught:
        EmbeddingRequest.model_validate({"input": value})
    (error,) = caught.value.errors()
    assert error["loc"][:2] == ("input", shape), error


def test_token_ids_keep_their_list_and_bad_ones_are_named() -> None:
    ids = list(range(200_000))
    assert EmbeddingRequest.model_validate({"input": ids}).input is ids  # not copied
    with pytest.raises(ValidationError) as caught:
        DetokenizeRequest.model_validate({"tokens": [*ids, -3]})
    (error,) = caught.value.errors()
    assert error["loc"] == ("tokens", 200_000)


def test_counts_over_the_limits_are_refused_before_any_element_is_validated() -> None:
    limits = RequestLimits(max_inputs=4, max_tokens=100)
    cases: list[tuple[type[ApiRequest], dict[str, Any], type[Exception], str]] = [
        # The last id is not even an int: the count alone decides, first.
        (EmbeddingRequest, {"input": [*[1] * 100, "x"]}, TooManyTokensError, "input"),
        (EmbeddingRequest, {"input": [[1] * 60, [2] * 60]}, TooManyTokensError, "input"),
        (PoolingRequest, {"input": ["a"] * 5}, InvalidRequestError, "input"),
        # A flood of lone surrogates is refused by its count, not scanned first.
        (EmbeddingRequest, {"input": ["\ud800"] * 5}, InvalidRequestError, "input"),
        (
            RerankRequest,
            {"query": "q", "documents": ["\ud800"] * 5},
            InvalidRequestError,
            "documents",
        ),
        (ClassifyRequest, {"input": [[1]] * 5}, InvalidRequestError, "input"),
        (CohereEmbedRequest, {"texts": ["a", 1, 2, 3, 4]}, InvalidRequestError, "texts"),
        (ScoreRequest, {"text_1": "q", "text_2": ["d"] * 5}, InvalidRequestError, "text_2"),
        (RerankRequest, {"query": "q", "documents": ["d"] * 5}, InvalidRequestError, "documents"),
        (DetokenizeRequest, {"tokens": [1] * 101}, TooManyTokensError, "tokens"),
    ]
    for schema, body, error, param in cases:
        with pytest.raises(error) as caught:
            schema.model_validate(body, context=limits)
        assert caught.value.param == param, (schema.__name__, caught.value)  # type: ignore[attr-defined]
    # Within the limits, the same schemas validate as before.
    EmbeddingRequest.model_validate({"input": [[1] * 50, [2] * 50]}, context=limits)
    RerankRequest.model_validate({"query": "q", "documents": ["d"] * 4}, context=limits)

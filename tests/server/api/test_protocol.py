"""The HTTP dialects' truncation fields, translated by the request models into one policy."""

from __future__ import annotations

import pytest
from embedding_server.api.protocol import (
    CohereEmbedRequest,
    EmbeddingRequest,
    cohere_truncation,
    openai_truncation,
)
from embedding_server.errors import InvalidRequestError
from embedding_server.tokenization import Truncation


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

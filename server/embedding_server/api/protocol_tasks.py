"""Request schemas of the task endpoints: ``/rerank`` (vLLM, Jina and Cohere's shape) and
``/classify`` (vLLM's Classification API).

Kept beside ``protocol.py`` (whose truncation translation they reuse) so each dialect's
fields stay in one place per endpoint family. As everywhere, unknown fields are ignored and a
wrong type or value is a 400 naming the field.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from embedding_server.api.protocol import (
    ApiRequest,
    EmbeddingInput,
    MultiModalContent,
    openai_truncation,
)
from embedding_server.request.truncation import Truncation
from embedding_server.settings import TruncationSide


class _TaskRequest(ApiRequest):
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="Truncate each input (each query-document pair, for a cross-encoder) to "
        "this many tokens; -1 means the model's maximum. Without it an over-long input is "
        "refused with 400.",
    )
    truncation_side: TruncationSide | None = Field(
        None, description="Which end to cut when truncating: right (default) or left."
    )

    def truncation(self, *, auto: bool = False) -> Truncation:
        """These fields as the engine's truncation policy (``auto``: the server's
        ``--auto-truncate``, which truncates when the request does not say)."""
        return openai_truncation(self.truncate_prompt_tokens, self.truncation_side, auto=auto)


class RerankDocument(BaseModel):
    """Cohere's and Jina's object form of a document (its text is checked with the request's
    other text, by :class:`~embedding_server.api.protocol.ApiRequest`'s validators)."""

    model_config = ConfigDict(extra="ignore")

    text: str = Field(description="The document's text.")


class RerankRequest(_TaskRequest):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM; Jina and Cohere clients' shape)."""

    query: str | MultiModalContent = Field(
        description="The query the documents are ranked for; or {content: [one part]} (an "
        "image_url) for a model that takes images.",
    )
    documents: list[str | RerankDocument] | MultiModalContent = Field(
        description="Documents to rank: strings, or objects with a text field; or vLLM's "
        "{content: [parts]}, each part (image_url or text) one document, for a model that "
        "takes images."
    )
    top_n: int | None = Field(
        None,
        ge=0,
        description="Return only the N most relevant documents (absent or 0: all of them).",
    )
    return_documents: bool = Field(
        True, description="Include each document's text in its result (document.text)."
    )

    def texts(self) -> list[str]:
        """The documents' texts (not for ``{content: [...]}`` documents)."""
        assert not isinstance(self.documents, MultiModalContent)
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ClassifyRequest(_TaskRequest):
    """POST /classify (vLLM's Classification API)."""

    input: EmbeddingInput = Field(
        description="A string, a list of strings, a list of token ids, or a list of token-id lists."
    )

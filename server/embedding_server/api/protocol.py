"""Request schemas of every endpoint, the OpenAPI document's source of truth.

Requests are validated by pydantic so a wrong type or value becomes a 400 that names the
field, never a 500. Responses are not modelled as pydantic objects on purpose: they are
built as plain dicts holding numpy arrays and serialized by orjson in one pass (see
``encoding.py``), which is several times cheaper than validating thousands of floats on the
way out. Field names follow the APIs clients already speak: OpenAI (plus vLLM's extras) for
``/v1/embeddings``, Cohere v2 for ``/v2/embed``, vLLM for ``/pooling``, ``/score``,
``/tokenize`` and ``/detokenize``. Unknown fields are ignored, as OpenAI-compatible servers do.

Where vLLM silently ignores an option that cannot apply, we refuse it with a 400 naming the
field: ``embed_dtype`` other than float32, or ``endianness`` other than native, together
with ``encoding_format: float`` (JSON numbers have neither). The defaults themselves are
accepted with float, so a client that always sends every field still works.

Each dialect's truncation fields are translated into the engine's one ``Truncation`` here
(:func:`openai_truncation`, :func:`cohere_truncation`), beside the fields they read, so the
core never learns the dialects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)

from embedding_server.api.encoding import (
    CohereEmbeddingType,
    EmbedDtype,
    EncodingFormat,
    Endianness,
)
from embedding_server.errors import InvalidRequestError, TooManyTokensError
from embedding_server.request.media.inputs import MAX_CHAT_MESSAGES, check_message_count
from embedding_server.request.truncation import Truncation, parse_side
from embedding_server.settings import TruncationSide


def openai_truncation(
    truncate_prompt_tokens: int | None, truncation_side: str | None = None, *, auto: bool = False
) -> Truncation:
    """vLLM's fields: ``None`` refuses over-long input (truncates it to the model maximum with
    ``auto``, the server's ``--auto-truncate``), ``-1`` means the model maximum."""
    side = parse_side(truncation_side or "right", "truncation_side")
    if truncate_prompt_tokens is None:
        return Truncation(side=side if auto else None, param="input")
    if truncate_prompt_tokens == -1:
        return Truncation(side=side, max_tokens=None, param="truncate_prompt_tokens")
    if truncate_prompt_tokens < 1:
        raise InvalidRequestError(
            "truncate_prompt_tokens must be -1 (the model maximum) or a positive integer, "
            f"got {truncate_prompt_tokens}",
            param="truncate_prompt_tokens",
        )
    return Truncation(side=side, max_tokens=truncate_prompt_tokens, param="truncate_prompt_tokens")


_COHERE_SIDES: dict[str, TruncationSide | None] = {"END": "right", "START": "left", "NONE": None}


def cohere_truncation(truncate: str | None, max_tokens: int | None = None) -> Truncation:
    """Cohere's ``truncate``: END (default) keeps the start, START keeps the end, NONE
    refuses; ``max_tokens`` lowers the limit and needs END or START."""
    value = (truncate or "END").upper()
    if value not in _COHERE_SIDES:
        raise InvalidRequestError(
            f"truncate must be one of END, START, NONE; got {truncate!r}", param="truncate"
        )
    side = _COHERE_SIDES[value]
    if max_tokens is None:
        return Truncation(side=side, param="truncate")
    if side is None:
        raise InvalidRequestError(
            "max_tokens needs truncate END or START; with NONE an "
            "over-long text is refused instead",
            param="max_tokens",
        )
    return Truncation(side=side, max_tokens=max_tokens, param="max_tokens")


_ID_CHUNK = 1 << 16


def _plain_ids(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A list of plain non-negative ints, as JSON gives token ids, passes in C loops over
    chunks of 65,536 (between chunks, on a validation thread, the event loop gets the GIL);
    anything else is validated by pydantic, whose error names the bad element."""
    if type(value) is not list:
        return handler(value)
    for start in range(0, len(value), _ID_CHUNK):
        chunk = value[start : start + _ID_CHUNK]
        if set(map(type, chunk)) != {int} or min(chunk) < 0:
            return handler(value)
    return value


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], WrapValidator(_plain_ids)]


def _input_shape(value: Any) -> str:
    """Which of the input shapes a value is, from its type and first element: the union is
    validated as that one shape alone. Tried member by member, a list of 4 million ids was
    first validated as a list of strings (over a second of failing on every element)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, list):
            return "token_lists"
        if isinstance(first, int | float) and not isinstance(first, bool):
            return "tokens"
    return "texts"


EmbeddingInput = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[TokenIds, Tag("tokens")]
    | Annotated[list[TokenIds], Tag("token_lists")],
    Discriminator(_input_shape),
]
"""A string, a list of strings, one token-id list, or a list of token-id lists."""

INPUT_TYPE_DESCRIPTION = (
    "Cohere-style task hint (search_query, search_document, classification, clustering; "
    "query, document, passage too), or any prompt name the model declares (its "
    "sentence-transformers prompts; jina-embeddings-v3's task names, retrieval.query ...): "
    "selects the model's matching prompt when it has one (and, on jina-embeddings-v3, the "
    "task adapter of that prompt's name). Any other value is a 400 listing the accepted ones."
)
"""The ``input_type`` field, checked against the model's prompts by the routes
(``api/prompts.py``): the values accepted depend on the checkpoint."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request body may carry, passed to validation as its context so that a body
    over a limit is refused by its counts alone, before any of its elements is validated
    (the routes check the same limits again, for callers that validate without them)."""

    max_inputs: int
    """``--max-inputs-per-request``: texts, documents or token-id lists in one field."""
    max_tokens: int | None
    """The engine's ``max_request_tokens``: token ids in one field (None before it loads)."""


INPUT_FIELDS = frozenset(
    {"input", "texts", "images", "inputs", "documents", "text_1", "text_2", "tokens"}
)
"""The request fields that carry what is embedded, scored or decoded."""


def _check_counts(field: str, value: Any, limits: RequestLimits) -> None:
    """Refuse an input field holding more items, or token ids, than a request may. Only
    lengths are read: a list of ids, or of id lists, is not walked element by element."""
    if not isinstance(value, list) or not value:
        return
    first = value[0]
    if isinstance(first, int) and not isinstance(first, bool):
        ids = len(value)
    elif isinstance(first, list):
        if len(value) > limits.max_inputs:
            raise _too_many_inputs(field, len(value), limits.max_inputs)
        ids = sum(len(item) if isinstance(item, list) else 1 for item in value)
    else:
        if len(value) > limits.max_inputs:
            raise _too_many_inputs(field, len(value), limits.max_inputs)
        return
    if limits.max_tokens is not None and ids > limits.max_tokens:
        raise TooManyTokensError(
            f"'{field}' holds {ids} token ids; one request may hold at most "
            f"{limits.max_tokens} tokens (max_request_tokens)",
            param=field,
        )


def _too_many_inputs(field: str, count: int, limit: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"'{field}' has {count} inputs; this server accepts at most {limit} per request.",
        param=field,
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(value: Any) -> bool:
    """Whether a field's value as the JSON body held it (a string, or a list of strings or
    of objects with string fields, such as a rerank request's documents) holds a lone UTF-16
    surrogate. A list of token ids is skipped at its first element."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogate(v) for v in value.values() if isinstance(v, str))
    if isinstance(value, list) and value and not isinstance(value[0], int | list):
        return any(_has_surrogate(v) for v in value if isinstance(v, str | dict))
    return False


class ApiRequest(BaseModel):
    """What every endpoint's request schema inherits: unknown fields ignored, the ``model``
    field, and the validators every text field shares (no lone surrogate). The request
    schemas of every route derive from it, so none can miss them
    (``tests/server/api/test_protocol.py`` checks that each one does)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = Field(None, description="Served model name; another name gets 404.")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """JSON can escape a lone surrogate (``"\\ud800"``), which is no Unicode text: no
        tokenizer or JSON encoder takes it, so it is refused here, naming the field, before
        any other check of the field (pydantic's own length checks would call it only "not a
        valid string")."""
        if _has_surrogate(value):
            raise ValueError(
                "the text holds a lone UTF-16 surrogate escape (such as \\ud800), "
                "which is not valid Unicode"
            )
        return value

    # Defined after _valid_unicode so that it runs before it: pydantic runs a field's
    # "before" validators last-defined first. A flood is refused by its counts before its
    # texts are scanned.
    @field_validator(*sorted(INPUT_FIELDS), mode="before", check_fields=False)
    @classmethod
    def _within_limits(cls, value: Any, info: ValidationInfo) -> Any:
        """The field's counts against the server's limits, when the validation context gives
        them (:class:`RequestLimits`), before any element is validated."""
        if isinstance(info.context, RequestLimits):
            _check_counts(info.field_name or "input", value, info.context)
        return value


class _TruncationOptions(BaseModel):
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="Truncate each input to this many tokens; -1 means the "
        "model's maximum. Without it an over-long input is refused with 400.",
    )
    truncation_side: TruncationSide | None = Field(
        None, description="Which end to cut when truncating: right (default) or left."
    )
    add_special_tokens: bool = Field(
        True,
        description="Add the tokenizer's special tokens (e.g. [CLS]/[SEP]) around text inputs.",
    )

    def truncation(self, *, auto: bool = False) -> Truncation:
        """These fields as the engine's truncation policy (``auto``: the server truncates
        over-long input the request says nothing about)."""
        return openai_truncation(self.truncate_prompt_tokens, self.truncation_side, auto=auto)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be -1 (model maximum) or a positive token count")
        return value


class _EncodingOptions(BaseModel):
    """How vectors go on the wire (vLLM's encoding_format / embed_dtype / endianness)."""

    encoding_format: EncodingFormat = Field(
        "float",
        description="float: JSON numbers; base64: each output's raw bytes (embed_dtype, "
        "endianness) as a base64 string; bytes: an application/octet-stream body of every "
        "output's bytes back to back in input order, described by the JSON 'metadata' "
        "response header (index, embed_dtype, endianness, start, end, shape per output; id, "
        "created, model, usage); bytes_only: the same body without the header.",
    )
    embed_dtype: EmbedDtype = Field(
        "float32",
        description="Element type of base64/bytes output: float32, float16, bfloat16, "
        "fp8_e4m3 or fp8_e5m2 (one byte each: the float8_e4m3fn/float8_e5m2 bit pattern). "
        "Only float32 is accepted with encoding_format float.",
    )
    endianness: Endianness = Field(
        "native",
        description="Byte order of base64/bytes output: native (the server's, little-endian "
        "on x86-64 and arm64), big or little. Only native is accepted with encoding_format "
        "float.",
    )

    @field_validator("embed_dtype", "endianness")
    @classmethod
    def _binary_only(cls, value: str, info: ValidationInfo) -> str:
        """Non-default element types and byte orders only make sense for binary output."""
        assert info.field_name is not None
        default = cls.model_fields[info.field_name].default
        if value != default and info.data.get("encoding_format") == "float":
            raise ValueError(
                f"{value} applies to encoding_format base64, bytes or bytes_only; "
                "float returns JSON numbers"
            )
        return value


class MultiModalContent(BaseModel):
    """vLLM's ``ScoreMultiModalParam``: ``{"content": [parts]}``, each part one input
    (``{"type": "image_url", "image_url": {"url"}}`` or ``{"type": "text", "text"}``)."""

    model_config = ConfigDict(extra="forbid")

    content: list[dict[str, Any]] = Field(
        min_length=1, description="Content parts, each one input: image_url or text."
    )


class EmbeddingRequest(ApiRequest, _TruncationOptions, _EncodingOptions):
    """POST /v1/embeddings (OpenAI, with vLLM's extras, and vLLM's chat form: ``messages``
    in place of ``input``)."""

    input: EmbeddingInput | None = Field(
        None,
        description="A string, a list of strings, a list of token ids, or a list of token-id "
        "lists. Exactly one of input and messages.",
    )
    messages: list[dict[str, Any]] | None = Field(
        None,
        description="vLLM's chat form, one embedding for the conversation: messages "
        "{role, content}, content a string or a list of {type: text, text} and {type: "
        "image_url, image_url: {url}} parts (data: URIs, or http(s) URLs of the hosts in "
        "--allowed-media-domains). A model with a chat template renders them through it; "
        "a dual encoder (CLIP, SigLIP) takes messages that hold one text or one image. "
        f"At most {MAX_CHAT_MESSAGES} messages. Exactly one of input and messages.",
    )
    add_generation_prompt: bool = Field(
        False,
        description="messages only: add the chat template's generation prompt (vLLM's "
        "default: false).",
    )
    continue_final_message: bool = Field(
        False,
        description="messages only: leave the final message open (no end-of-turn after it).",
    )
    chat_template: str | None = Field(
        None,
        description="Not accepted (vLLM refuses a request's own template unless its server "
        "trusts them): the model's template is used.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="messages only: extra variables for the chat template (not the "
        "tokenizer's special tokens, messages, add_generation_prompt or the template's "
        "functions, which the server supplies: 400).",
    )
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="Not accepted: images get the model's own preprocessing."
    )
    media_io_kwargs: dict[str, Any] | None = Field(
        None, description="Not accepted: images are decoded under the server's limits."
    )
    dimensions: int | None = Field(
        None,
        gt=0,
        description="Matryoshka truncation: return the first N dimensions, renormalized.",
    )
    user: str | None = Field(None, description="End-user id (accepted, unused).")
    normalize: bool | None = Field(
        None, description="L2-normalize the vectors (default: the server's setting)."
    )
    prompt_name: str | None = Field(
        None,
        description="Name of a prompt from the model's sentence-transformers config to prepend.",
    )
    input_type: str | None = Field(None, max_length=256, description=INPUT_TYPE_DESCRIPTION)
    task: str | None = Field(
        None,
        description="Jina-style task adapter (jina-embeddings-v3: retrieval.query, "
        "retrieval.passage, separation, classification, text-matching): runs that LoRA "
        "adapter, with its prompt unless prompt_name is given. A model without that adapter "
        "answers 400.",
    )

    # Defined in the subclass, so that it runs before ApiRequest's "before" validators (the
    # lone-surrogate scan walks every message): a flood is refused by its count alone.
    @field_validator("messages", mode="before")
    @classmethod
    def _messages_counted(cls, value: Any) -> Any:
        """More messages than a conversation may hold, refused before any is validated."""
        check_message_count(value)
        return value


CohereEmbedType = CohereEmbeddingType | Literal["sparse", "multi_vector"]
"""Cohere's embedding types, and our extensions: ``sparse`` (a SPLADE model's, or bge-m3's,
``{indices, values}``) and ``multi_vector`` (bge-m3's per-token ColBERT vectors)."""


def _float_only() -> list[CohereEmbedType]:
    return ["float"]


MAX_ACTIVE_DIMS_DESCRIPTION = (
    "Sparse output only: keep each vector's this many largest weights (as "
    "sentence-transformers' max_active_dims); bounds the response, which otherwise may "
    "hold a weight for every vocabulary entry."
)


class CohereContent(BaseModel):
    """One part of a Cohere input object."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "image_url"] = Field(description="text or image_url.")
    text: str | None = Field(None, description="With type text: the text.")
    image_url: dict[str, Any] | str | None = Field(
        None, description="With type image_url: {url} (a data: URI or an http(s) URL)."
    )


class CohereInput(BaseModel):
    """Cohere's input object: content parts that make one embedding."""

    model_config = ConfigDict(extra="ignore")

    content: list[CohereContent] = Field(min_length=1, description="The input's parts.")


class CohereEmbedRequest(ApiRequest):
    """POST /v2/embed (Cohere v2)."""

    texts: list[str] | None = Field(
        None, description="Texts to embed. Exactly one of texts, images and inputs."
    )
    images: list[str] | None = Field(
        None,
        description="Images to embed (input_type image): data: URIs, or http(s) URLs of the "
        "hosts in --allowed-media-domains. Needs a model that takes images.",
    )
    inputs: list[CohereInput] | None = Field(
        None,
        description="Input objects, each {content: [parts]} one embedding; a part is {type: "
        "text, text} or {type: image_url, image_url: {url}}. A dual encoder (CLIP, SigLIP) "
        "takes one part per input.",
    )
    input_type: str | None = Field(
        None,
        max_length=256,
        description=INPUT_TYPE_DESCRIPTION + " With images: image. On a ColBERT checkpoint, "
        "search_query or search_document (required) says whether the texts are queries or "
        "documents.",
    )
    embedding_types: list[CohereEmbedType] = Field(
        default_factory=_float_only,
        min_length=1,
        description="Any of float, int8, uint8, binary, ubinary, base64 (a model of task "
        "embed); sparse: each text's weights over the vocabulary as {indices, values}, token "
        "ids ascending (alone on a SPLADE model of task sparse; with any other type on a "
        "model with sparse and multi-vector outputs, bge-m3); multi_vector: each text's "
        "per-token ColBERT vectors, [tokens - 1][width] (bge-m3). All from one forward pass.",
    )
    max_active_dims: int | None = Field(None, gt=0, description=MAX_ACTIVE_DIMS_DESCRIPTION)
    output_dimension: int | None = Field(None, gt=0, description="Matryoshka truncation.")
    truncate: Literal["END", "START", "NONE"] = Field(
        "END", description="END/START cut over-long texts at that end; NONE refuses them."
    )
    max_tokens: int | None = Field(
        None, gt=0, description="Truncate to this many tokens (default: the model's maximum)."
    )

    def truncation(self) -> Truncation:
        """``truncate`` and ``max_tokens`` as the engine's truncation policy."""
        return cohere_truncation(self.truncate, self.max_tokens)


class PoolingRequest(ApiRequest, _TruncationOptions, _EncodingOptions):
    """POST /pooling (vLLM): per-token hidden states, or the pooled vector.

    With a binary encoding each output is one input's whole per-token matrix (shape
    ``[tokens, hidden]``, row-major) or, for ``task: embed``, its pooled vector.
    """

    input: EmbeddingInput = Field(description="As for /v1/embeddings.")
    task: Literal[
        "token_embed", "embed", "classify", "token_classify", "reward", "sparse", "hybrid"
    ] = Field(
        "token_embed",
        description="token_embed (the default, as in vLLM for models that support it): one "
        "vector per token, refused with 400 when the answer would exceed the server's "
        "max_response_bytes; embed: the pooled vector (both need an embedding model); "
        "classify: the class probabilities (a classifier or cross-encoder); token_classify: "
        "the label probabilities of every token (a token classifier); reward: a reward "
        "model's raw outputs at every token (task reward); sparse: a SPLADE model's "
        "{indices, values} over the vocabulary (task sparse, or bge-m3's lexical weights); "
        "hybrid: a bge-m3-shaped model's three outputs from one pass, "
        "{dense, sparse: {indices, values}, multi_vector} per input (JSON only). On a model "
        "with multi-vector outputs (bge-m3), token_embed gives its ColBERT vectors, every "
        "token but the first, normalized unless normalize is false.",
    )
    max_active_dims: int | None = Field(None, gt=0, description=MAX_ACTIVE_DIMS_DESCRIPTION)
    normalize: bool | None = Field(
        None,
        description="L2-normalize each vector (default: false for token_embed, true for "
        "a multi-vector model's token_embed, the server setting for embed and hybrid's dense "
        "vector; hybrid's multi-vectors are always normalized).",
    )


class ScoreRequest(ApiRequest, _TruncationOptions):
    """POST /score (vLLM): a cross-encoder's relevance of text pairs (task score), or the
    cosine similarity of their embeddings (task embed), images included for a model that
    takes them (vLLM's ``{"content": [parts]}``)."""

    text_1: str | list[str] | MultiModalContent = Field(
        description="One text, or one per pair; or {content: [parts]}, each part one input "
        "(image_url or text), for a model that takes images."
    )
    text_2: str | list[str] | MultiModalContent = Field(
        description="One text, or one per pair; or {content: [parts]} as text_1."
    )


class TokenizeRequest(ApiRequest):
    """POST /tokenize (vLLM)."""

    prompt: str = Field(description="Text to tokenize.")
    add_special_tokens: bool = Field(True)
    return_token_strs: bool = Field(False, description="Also return each token's string.")


class DetokenizeRequest(ApiRequest):
    """POST /detokenize (vLLM)."""

    tokens: TokenIds = Field(description="Token ids to turn back into text.")

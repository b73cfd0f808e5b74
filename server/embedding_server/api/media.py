"""Image and chat-style inputs of the HTTP API: vLLM's ``messages`` on ``/v1/embeddings``,
Cohere's ``images`` and ``inputs`` on ``/v2/embed``, vLLM's ``{"content": [parts]}`` on
``/score`` and ``/rerank``, turned into the engine's inputs (texts and preprocessed images).

Every route goes the same way: parse the parts (a 400 names the part), count the images
against ``--max-images-per-request`` before anything is fetched, refuse an image sent to a
model that does not take images (naming its field), then admit them (what their URLs may
download, then the pixels their headers give: 429 beyond the process's budgets), fetch,
decode and preprocess them
(:func:`~embedding_server.request.tasks.media.load_images`: decoding off the event loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from embedding_server.api.lifecycle import Lifecycle
from embedding_server.api.protocol import (
    CohereEmbedRequest,
    CohereInput,
    EmbeddingRequest,
    MultiModalContent,
)
from embedding_server.errors import InvalidRequestError
from embedding_server.request.media.fetching import MediaPolicy
from embedding_server.request.media.inputs import (
    ImageRef,
    Part,
    TextPart,
    check_image_count,
    images_of,
    parse_content,
    parse_messages,
    single_input,
)
from embedding_server.request.media.preprocessing import ImageInput
from embedding_server.request.serving import ServingEngine
from embedding_server.request.tasks.media import load_images, render_chat
from embedding_server.settings import ServerSettings

Item = str | ImageInput
"""One input of a request once its images are loaded."""


def media_policy(settings: ServerSettings) -> MediaPolicy:
    """The server's limits on images (``--allowed-media-domains``, ...)."""
    return MediaPolicy.from_settings(settings)


async def load_parts(
    engine: ServingEngine, lifecycle: Lifecycle, parts: Sequence[Part], param: str
) -> list[Item]:
    """``parts`` as inputs, in order: texts as they are, images fetched, decoded and
    preprocessed. More images than a request may hold is a 400 naming ``param`` before any
    is fetched; an image for a model that takes none, a 400 naming the image's part. The
    images are admitted by the process's :class:`~.media.budget.ImageBudget` (429) before
    they are fetched, and again by their pixels before they are decoded."""
    refs = images_of(parts)
    check_image_count(len(refs), lifecycle.settings.max_images_per_request, param)
    for ref in refs:
        engine.check_takes_images(ref.param)
    loaded = iter(
        await engine.serve(load_images, refs, media_policy(lifecycle.settings), lifecycle.images)
        if refs
        else []
    )
    return [part.text if isinstance(part, TextPart) else next(loaded) for part in parts]


_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
_REFUSED = {
    "chat_template": "a request's own chat template is not accepted (as vLLM without "
    "--trust-request-chat-template): the model's template is used",
    "mm_processor_kwargs": "images get the model's own preprocessing; processor "
    "options are not accepted",
    "media_io_kwargs": "images are decoded under the server's limits; decoder options are "
    "not accepted",
}


def check_input_form(body: EmbeddingRequest) -> None:
    """Exactly one of ``input`` and ``messages``, and the chat fields only with messages;
    fields that are not served are refused, never ignored."""
    if (body.input is None) == (body.messages is None):
        both = body.input is not None
        raise InvalidRequestError(
            "give exactly one of input and messages"
            + ("; this request has both" if both else ": input: Field required"),
            param="messages" if both else "input",
        )
    for name, why in _REFUSED.items():
        if getattr(body, name) is not None:
            raise InvalidRequestError(f"{name}: {why}", param=name)
    if body.messages is None:
        for name in _CHAT_ONLY:
            if name in body.model_fields_set and getattr(body, name) not in (False, None):
                raise InvalidRequestError(f"{name} applies to messages, not to input", param=name)


@dataclass(frozen=True)
class MessagesInput:
    """What a ``messages`` request embeds."""

    item: Item
    add_special_tokens: bool
    templated: bool
    """Rendered through the chat template: the template formats the text, so no
    sentence-transformers prompt is put before it."""


async def messages_input(
    engine: ServingEngine, lifecycle: Lifecycle, body: EmbeddingRequest
) -> MessagesInput:
    """The one input a ``messages`` request embeds, and whether special tokens are added to
    it: the conversation rendered through the model's chat template (special tokens: no,
    unless asked, as vLLM: the template places them; a ``prompt_name`` is refused, the
    template formats the text), or, for a dual encoder (a model that takes images and has
    no template), the one text or image its messages hold (as ``input`` would embed it)."""
    messages = parse_messages(body.messages)
    parts = [part for message in messages for part in message.parts]
    refs = images_of(parts)
    check_image_count(len(refs), lifecycle.settings.max_images_per_request, "messages")
    for ref in refs:
        engine.check_takes_images(ref.param)
    template = engine.chat_template
    if template is not None:
        if refs:
            raise InvalidRequestError(
                f"{refs[0].param} is an image: this model's chat template is served for "
                "text (images through a chat template, as vision-language embedders take "
                "them, are not served)",
                param=refs[0].param,
            )
        text = await engine.serve(
            render_chat,
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            kwargs=body.chat_template_kwargs,
            max_request_bytes=lifecycle.settings.max_request_bytes,
        )
        if body.prompt_name is not None:
            raise InvalidRequestError(
                "prompt_name does not apply to messages rendered through the model's chat "
                "template (put an instruction in a system message)",
                param="prompt_name",
            )
        special = (
            body.add_special_tokens if "add_special_tokens" in body.model_fields_set else False
        )
        return MessagesInput(text, special, templated=True)
    if not engine.takes_images:
        raise InvalidRequestError(
            f"messages need a chat template, and this model ({engine.info().architecture}) "
            "has none in its tokenizer_config.json; send the text as input",
            param="messages",
        )
    for name in _CHAT_ONLY:
        if getattr(body, name) not in (False, None):
            raise InvalidRequestError(
                f"{name} applies to a chat template, and this model (a dual encoder) has none",
                param=name,
            )
    part = single_input(parts, "messages")
    (item,) = await load_parts(engine, lifecycle, [part], "messages")
    return MessagesInput(item, body.add_special_tokens, templated=False)


def cohere_parts(body: CohereEmbedRequest) -> tuple[list[Part], str]:
    """The parts of a Cohere request's ``images`` or ``inputs`` (one per embedding), and
    the field they came in. Exactly one of texts, images and inputs."""
    given = [n for n in ("texts", "images", "inputs") if getattr(body, n) is not None]
    if len(given) != 1:
        raise InvalidRequestError(
            "give exactly one of texts, images and inputs"
            + (f"; this request has {' and '.join(given)}" if given else ""),
            param=given[-1] if given else "texts",
        )
    if body.images is not None:
        # Any input_type goes with images (Embed v3 sends image, v4 search_document ...):
        # it selects a text prompt, which an image never gets.
        return [ImageRef(url, f"images[{i}]") for i, url in enumerate(body.images)], "images"
    assert body.inputs is not None
    return [
        _cohere_input(item, f"inputs[{i}].content") for i, item in enumerate(body.inputs)
    ], "inputs"


def _cohere_input(item: CohereInput, param: str) -> Part:
    raw: list[dict[str, Any]] = [
        {"type": c.type, "text": c.text}
        if c.type == "text"
        else {"type": c.type, "image_url": c.image_url}
        for c in item.content
    ]
    return single_input(parse_content(raw, param), param)


def content_parts(value: MultiModalContent, param: str) -> list[Part]:
    """vLLM's ``{"content": [parts]}`` of /score and /rerank: each part one input."""
    return parse_content(value.content, f"{param}.content")

"""Image and chat-style inputs on the request plane (torch-free): what turns a request's
``messages``, Cohere ``images`` / ``inputs`` or vLLM's multimodal score content into the
engine's inputs (texts and :class:`~.imaging.ImageInput`).

Two kinds of model take such inputs, and they take them differently:

* a dual encoder (CLIP, SigLIP: an image tower and a text tower, no chat template) embeds one
  text *or* one image per input, so a chat message must come down to exactly one of them;
* a model with a chat template in its ``tokenizer_config.json`` (instruction-tuned decoder
  embedders) renders the messages to one text through the template, as transformers'
  ``apply_chat_template`` does (the same sandboxed jinja2 environment), and that text is
  tokenized without adding special tokens again, as vLLM's chat embeddings do.

Images are fetched (``media.fetch_image``, on the event loop: it is network I/O) and decoded
and preprocessed off it (``media.decode_image``, then the model's processor, in the engine's
tokenizer threads): decoding a large PNG is milliseconds of CPU the loop must not spend.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from embedding_server.errors import InvalidRequestError
from embedding_server.request.media.preprocessing import ImageInput

IMAGE_TYPES = (Image.Image, ImageInput)
"""What the offline API takes as an image input."""


class ImagePreprocessor(Protocol):
    """A model's image preprocessing (:class:`~.imaging.ImageProcessor`, or the fake
    backend's): one decoded RGB image to what its vision tower reads."""

    def preprocess(self, image: Image.Image) -> ImageInput: ...


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image a request refers to (a ``data:`` URI or an http(s) URL), and the request
    field that holds it, which every refusal about it names."""

    url: str
    param: str


@dataclass(frozen=True, slots=True)
class TextPart:
    """A text a request carries in a content part, and the field that holds it."""

    text: str
    param: str


Part = TextPart | ImageRef


def parse_content(content: object, param: str) -> list[Part]:
    """A message's (or Cohere input's, or score item's) ``content``: a string, or a list of
    ``{"type": "text", "text"}`` and ``{"type": "image_url", "image_url": {"url"}}`` parts
    (vLLM's and OpenAI's shapes; ``image_url`` may also be the URL string itself, as vLLM
    takes it). Anything else is a 400 naming the part."""
    if isinstance(content, str):
        return [TextPart(_unicode(content, param), param)]
    if not isinstance(content, list) or not content:
        raise InvalidRequestError(
            f"{param} must be a string or a non-empty list of content parts", param=param
        )
    parts: list[Part] = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if not isinstance(part, Mapping):
            raise InvalidRequestError(f"{where} must be an object with a type", param=where)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{where}.text must be a string", param=where)
            parts.append(TextPart(_unicode(text, where), where))
        elif kind == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, Mapping) else ref
            if not isinstance(url, str) or not url:
                raise InvalidRequestError(
                    f"{where}.image_url.url must be a non-empty string (a data: URI or an "
                    "http(s) URL)",
                    param=where,
                )
            if isinstance(ref, Mapping) and ref.get("detail") not in (None, "auto"):
                raise InvalidRequestError(
                    f"{where}.image_url.detail is not supported: the model's own "
                    "preprocessing decides the resolution",
                    param=where,
                )
            parts.append(ImageRef(url, where))
        else:
            raise InvalidRequestError(
                f"{where}: content part type {kind!r} is not supported; use text or image_url",
                param=where,
            )
    return parts


def _unicode(text: str, param: str) -> str:
    """``text``, refused (400) when it holds a lone UTF-16 surrogate (JSON can escape one):
    no tokenizer takes it. The request schemas check their own text fields; content parts
    are nested deeper than they look."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"{param} holds a lone UTF-16 surrogate escape, which is not valid Unicode",
            param=param,
        ) from error
    return text


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a ``messages`` request, its content parsed."""

    role: str
    parts: list[Part]
    raw: Mapping[str, Any]


MAX_CHAT_MESSAGES = 2048
"""Most messages in one ``messages`` request (400 beyond). A conversation is embedded as one
input, so an embedder's context holds far fewer turns than this; the count is checked before
any message is looked at (and by the request schema before any is validated)."""


def check_message_count(messages: object, param: str = "messages") -> None:
    """Refuse, by its length alone, a list of more than :data:`MAX_CHAT_MESSAGES` messages."""
    if isinstance(messages, list) and len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequestError(
            f"{param} holds {len(messages)} messages; this server accepts at most "
            f"{MAX_CHAT_MESSAGES} in one conversation",
            param=param,
        )


def parse_messages(messages: object, param: str = "messages") -> list[ChatMessage]:
    """A request's ``messages``: a non-empty list of at most :data:`MAX_CHAT_MESSAGES`
    ``{"role", "content"}`` objects."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"{param} must be a non-empty list of messages", param=param)
    check_message_count(messages, param)
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where}.role must be a non-empty string", param=where)
        if "content" not in message:
            raise InvalidRequestError(f"{where}.content is required", param=where)
        out.append(
            ChatMessage(role, parse_content(message["content"], f"{where}.content"), message)
        )
    return out


def single_input(parts: Sequence[Part], param: str) -> Part:
    """The one text or one image a dual encoder (CLIP, SigLIP) embeds for ``parts``; anything
    else (two images, a text and an image, two texts) is a 400: such a model has no way to
    join them into one vector."""
    if len(parts) != 1:
        kinds = ", ".join("image" if isinstance(p, ImageRef) else "text" for p in parts)
        raise InvalidRequestError(
            f"{param} holds {len(parts)} parts ({kinds}); this model embeds one text or one "
            "image per input (a dual encoder has no way to join them into one vector): send "
            "each as its own input",
            param=param,
        )
    return parts[0]


def images_of(parts: Sequence[Part]) -> list[ImageRef]:
    return [p for p in parts if isinstance(p, ImageRef)]


def check_image_count(count: int, most: int, param: str) -> None:
    """Refuse, before anything is fetched, a request with more images than one may hold."""
    if count > most:
        raise InvalidRequestError(
            f"the request holds {count} images; this server accepts at most {most} per "
            "request (max_images_per_request)",
            param=param,
        )


# -- chat templates ------------------------------------------------------------------------

RENDERED_CHARS_PER_BODY_BYTE = 2
"""A conversation may render to at most this many characters per byte of
``--max-request-bytes`` (16 Mi characters by default): a template adds a few characters
around each message, never a multiple of what the request carries, so twice the largest body
leaves a template's own text ample room while bounding what a request makes it write."""

SPECIAL_TOKEN_NAMES = frozenset(
    {
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
    }
)
"""The special-token variables transformers gives every template (its tokenizers'
``SPECIAL_TOKENS_ATTRIBUTES``), whether or not this tokenizer sets them."""

_RENDER_ERRORS = (
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    ArithmeticError,
    RecursionError,
)
"""What a template raises on data it cannot handle (a message's extra field of another type
than it expects, ...). The template is the model's and compiles at load, so these come from
the request: a 400, never a 500."""


class ChatTemplate:
    """A tokenizer's chat template, rendered as transformers' ``apply_chat_template(...,
    tokenize=False)`` renders it: the same sandboxed jinja2 environment (immutable sandbox,
    ``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``,
    an HTML-unescaped ``tojson``) and the tokenizer's special tokens as variables
    (``bos_token``, ``eos_token``, ...)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as its source (a front-end of ``--api-workers`` gets it in the engine's
        handoff) and compiled again where it lands."""
        return {"source": self.source, "special_tokens": self.special_tokens}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["source"], state["special_tokens"])  # type: ignore[misc]

    @classmethod
    def from_directory(cls, path: Path | None) -> ChatTemplate | None:
        """The default chat template of the tokenizer in ``path`` (``chat_template.jinja``,
        else ``tokenizer_config.json``'s ``chat_template``, the one named ``default`` where
        it lists several), or None where it has none."""
        if path is None:
            return None
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                config = loaded
        source: object = None
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            source = jinja_file.read_text(encoding="utf-8")
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # [{"name", "template"}, ...]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        specials: dict[str, str] = {}
        for key, value in config.items():
            if key.endswith("_token") and key != "chat_template":
                text = value.get("content") if isinstance(value, dict) else value
                if isinstance(text, str):
                    specials[key] = text
        return cls(source, specials)

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
        max_request_bytes: int | None = None,
    ) -> str:
        """The conversation as one text. ``continue_final_message`` leaves the last message
        open (the template's end-of-turn after it cut off), as transformers does; it and
        ``add_generation_prompt`` exclude each other. Errors of the template itself
        (``raise_exception`` on a role it does not take, ...) and what it raises on the
        request's data are a 400 naming ``messages``.

        ``kwargs`` (the request's ``chat_template_kwargs``) may not set what the renderer
        supplies (:meth:`supplied_names`): a 400 naming ``chat_template_kwargs.<name>``.
        With ``max_request_bytes``, the text is counted as the template writes it and
        refused (400) past :data:`RENDERED_CHARS_PER_BODY_BYTE` characters per byte of it,
        before the rest is written."""
        import jinja2

        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        variables = self._variables(kwargs)
        chat = [_plain_message(m) for m in messages]
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = ""
        if continue_final_message:
            last = chat[-1]
            content = last["content"]
            if isinstance(content, list):
                texts = [p for p in content if p.get("type") == "text"]
                if not texts:
                    raise InvalidRequestError(
                        "continue_final_message needs text in the final message",
                        param="continue_final_message",
                    )
                final = texts[-1]["text"]
                texts[-1]["text"] = final + tag
            else:
                final = content
                last["content"] = content + tag
        variables["add_generation_prompt"] = add_generation_prompt
        limit = (
            None if max_request_bytes is None else RENDERED_CHARS_PER_BODY_BYTE * max_request_bytes
        )
        try:
            rendered = self._written(chat, variables, limit)
        except jinja2.TemplateError as error:
            raise InvalidRequestError(
                f"the model's chat template refused the messages: {error}", param="messages"
            ) from error
        except _RENDER_ERRORS as error:
            raise InvalidRequestError(
                "the model's chat template failed on the messages: "
                f"{type(error).__name__}: {str(error)[:200]}",  # it may quote the request
                param="messages",
            ) from error
        if continue_final_message:
            if final.strip() not in rendered or tag.strip() not in rendered:
                raise InvalidRequestError(
                    "continue_final_message: the chat template does not keep the final "
                    "message's text, so it cannot be continued",
                    param="continue_final_message",
                )
            at = rendered.rindex(tag.strip())
            if rendered[at : at + len(tag)] == tag:
                rendered = rendered[:at]
            else:
                rendered = rendered[:at].rstrip()
        return rendered

    def supplied_names(self) -> frozenset[str]:
        """The template variables the renderer sets itself: the tokenizer's special tokens
        (and transformers' standard special-token names), ``messages``,
        ``add_generation_prompt`` and the sandbox's functions (``raise_exception``,
        ``strftime_now``, ``namespace``, ``range``, ...)."""
        return frozenset(
            {*self.special_tokens, *SPECIAL_TOKEN_NAMES, *self._template.environment.globals}
            | {"messages", "add_generation_prompt"}
        )

    def _variables(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The template's variables: the special tokens, and the request's ``kwargs``, which
        may add variables but not replace one the renderer supplies (a special token the
        template writes after every message would multiply the request's size by the
        message count; a function replaced by a value turns the template's refusals into
        errors)."""
        supplied = self.supplied_names()
        for name in kwargs or {}:
            if name in supplied:
                raise InvalidRequestError(
                    f"chat_template_kwargs.{name} is the chat template's own variable (the "
                    "tokenizer's special tokens, messages, add_generation_prompt and the "
                    "template's functions) and cannot be set by a request",
                    param=f"chat_template_kwargs.{name}",
                )
        return {**self.special_tokens, **dict(kwargs or {})}

    def _written(
        self, chat: list[dict[str, Any]], variables: dict[str, Any], limit: int | None
    ) -> str:
        """The template's output, counted piece by piece as it is written: past ``limit``
        characters it is refused before the rest is written."""
        pieces: list[str] = []
        written = 0
        stream = self._template.generate(messages=chat, **variables)
        try:
            for piece in stream:
                written += len(piece)
                if limit is not None and written > limit:
                    raise InvalidRequestError(
                        "the messages render through the model's chat template to more than "
                        f"{limit:,} characters, the most one request may render "
                        f"({RENDERED_CHARS_PER_BODY_BYTE} x max_request_bytes)",
                        param="messages",
                    )
                pieces.append(piece)
        finally:
            stream.close()
        return "".join(pieces)


def _plain_message(message: ChatMessage) -> dict[str, Any]:
    """A message as the template reads it: its role and its content (the string, or the
    parts as plain dicts), plus its other fields (``name``, ...)."""
    plain: dict[str, Any] = {k: v for k, v in message.raw.items() if isinstance(k, str)}
    content = message.raw.get("content")
    if isinstance(content, list):
        plain["content"] = [dict(p) for p in content if isinstance(p, Mapping)]
    copied: dict[str, Any] = json.loads(json.dumps(plain))  # a deep copy of plain JSON data
    return copied


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    """``source`` compiled in the sandbox transformers' ``_compile_jinja_template`` builds."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' AssistantTracker,
        which marks the assistant's tokens for training masks): rendered as its content."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_content")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _content(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as error:
        raise ValueError(f"the tokenizer's chat template does not compile: {error}") from error

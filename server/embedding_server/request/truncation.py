"""Truncation and the limits of a request: what to do with an input longer than allowed
(:class:`Truncation`, the engine's single vocabulary for it), an input as tokenized and
truncated (:class:`TokenizedInput`), and the tokens a whole request may hold (:class:`Tally`).

Truncation is decided per request. The HTTP dialects' fields (OpenAI/vLLM
``truncate_prompt_tokens``, Cohere ``truncate``) are translated into :class:`Truncation` by the
request models in ``api/protocol.py``, so this module knows no client dialect.

We truncate *content* tokens and then add the special tokens, as Hugging Face tokenizers do,
so a truncated BERT input still starts with ``[CLS]`` and ends with ``[SEP]``
(:func:`fit`; :func:`fit_clipped` for a text read through a window, ``windows.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenizers import Encoding

from embedding_server.errors import InputTooLongError, InvalidRequestError, TooManyTokensError
from embedding_server.request.windows import Reading

TruncationSide = Literal["right", "left"]


@dataclass(frozen=True, slots=True)
class Truncation:
    """What to do with an input longer than allowed.

    ``side``: ``"right"`` keeps the first tokens, ``"left"`` keeps the last ones, ``None``
    refuses over-long input with :class:`InputTooLongError`.
    ``max_tokens``: the limit (special tokens included); ``None`` means the model maximum.
    A limit above the model maximum is refused rather than silently lowered.
    ``param``: the request field named in errors about truncation, so the HTTP layer can
    report the field the client actually sent.
    """

    side: TruncationSide | None = "right"
    max_tokens: int | None = None
    param: str = "truncate"

    @classmethod
    def refuse(cls, param: str = "truncate") -> Truncation:
        """Never truncate: over-long inputs are an error."""
        return cls(side=None, param=param)

    @classmethod
    def coerce(cls, value: TruncationArg) -> Truncation:
        """Accept the shorthand forms of the offline API (bool, side name or Truncation)."""
        if isinstance(value, Truncation):
            return value
        if value is True:
            return cls()
        if value is False or value is None:
            return cls.refuse()
        if isinstance(value, str):
            return cls(side=parse_side(value, "truncate"))
        raise InvalidRequestError(
            f"truncate must be a bool, 'right', 'left' or a Truncation; got {type(value).__name__}",
            param="truncate",
        )


TruncationArg = Truncation | bool | TruncationSide | None


def parse_side(value: str, param: str) -> TruncationSide:
    """``value`` as a truncation side, or an error naming ``param``."""
    if value == "right":
        return "right"
    if value == "left":
        return "left"
    raise InvalidRequestError(f"{param} must be 'right' or 'left', got {value!r}", param=param)


@dataclass(frozen=True, slots=True)
class TokenizedInput:
    """One input after tokenization and truncation, ready for the scheduler."""

    ids: list[int]
    original_length: int
    """Token count before truncation (special tokens included)."""
    prompt_length: int = 0
    """Leading tokens that belong to the prompt (excluded from pooling when the model says so)."""
    type_ids: list[int] | None = None
    """Segment ids of a sentence pair (0 for the first text, 1 for the second where the
    tokenizer's template says so); None for a single text."""
    key_len: int | None = None
    """How many leading tokens are keys (a ColBERT query expanded with ``[MASK]``); None:
    all of them."""

    @property
    def truncated(self) -> bool:
        return self.original_length > len(self.ids)


class Tally:
    """The tokens a request's inputs hold so far, against its limit (``max_total``)."""

    def __init__(self, limit: int | None, param: str) -> None:
        self.limit, self.param, self.total = limit, param, 0

    def add(self, tokens: int) -> None:
        self.total += tokens
        if self.limit is not None and self.total > self.limit:
            raise TooManyTokensError(
                f"this request holds at least {self.total} tokens; one request may hold at "
                f"most {self.limit} (max_request_tokens); split it into smaller requests",
                param=self.param,
            )


def limit_of(truncation: Truncation, max_length: int) -> int:
    """The tokens an input may keep under ``truncation`` with a model of ``max_length``: a
    limit above the model's is refused, not lowered."""
    if truncation.max_tokens is None:
        return max_length
    if truncation.max_tokens > max_length:
        raise InvalidRequestError(
            f"{truncation.param}={truncation.max_tokens} exceeds the model's maximum "
            f"input length of {max_length} tokens",
            param=truncation.param,
        )
    return truncation.max_tokens


def no_room(limit: int, specials: int, truncation: Truncation) -> InvalidRequestError:
    return InvalidRequestError(
        f"{truncation.param}={limit} leaves no room for content after the "
        f"{specials} special tokens",
        param=truncation.param,
    )


def fit_clipped(
    reading: Reading,
    prefix: list[int],
    suffix: list[int],
    limit: int,
    truncation: Truncation,
    index: int,
    param: str,
    prompt_len: int,
) -> TokenizedInput | None:
    """The input of a text read through a window, when its settled tokens decide it (the
    text is over-long); else None."""
    assert reading.enc is not None
    content = reading.enc.ids
    keep = limit - len(prefix) - len(suffix)
    settled = reading.settled
    if settled <= max(keep, 0):
        return None
    at_least = len(prefix) + settled + len(suffix)
    if truncation.side is None:
        raise InputTooLongError(
            f"{param}[{index}] has more than {at_least - 1} tokens, more than the maximum "
            f"of {limit}; shorten it or ask for truncation",
            param=param,
            token_count=at_least,
            max_tokens=limit,
        )
    if keep <= 0:
        raise no_room(limit, len(prefix) + len(suffix), truncation)
    if reading.from_end:
        return TokenizedInput(prefix + content[len(content) - keep :] + suffix, at_least, 0)
    return TokenizedInput(
        prefix + content[:keep] + suffix, at_least, min(prompt_len, len(prefix) + keep)
    )


def fit_encoding(
    enc: Encoding,
    prefix: list[int],
    suffix: list[int],
    limit: int,
    truncation: Truncation,
    index: int,
    param: str,
    prompt_len: int,
) -> TokenizedInput:
    """The input of a text read whole: :func:`fit` of its tokens between the affixes."""
    content = enc.ids
    return fit(
        content,
        prefix + content + suffix,
        [prefix, suffix],
        limit,
        truncation,
        index,
        param,
        prompt_len,
    )


def fit(
    content: list[int],
    full: list[int],
    affixes: list[list[int]],
    limit: int,
    truncation: Truncation,
    index: int,
    param: str,
    prompt_len: int,
) -> TokenizedInput:
    """``full`` (``content`` inside ``affixes``) within ``limit``: as it is when it fits,
    else its content cut on ``truncation``'s side, or refused."""
    n = len(full)
    if n == 0:
        raise InvalidRequestError(f"{param}[{index}] is empty: nothing to embed", param=param)
    if n <= limit:
        return TokenizedInput(full, n, prompt_len)
    if truncation.side is None:
        raise InputTooLongError(
            f"{param}[{index}] has {n} tokens, more than the maximum of {limit}; shorten it "
            "or ask for truncation",
            param=param,
            token_count=n,
            max_tokens=limit,
        )
    prefix, suffix = affixes if affixes else ([], [])
    keep = limit - len(prefix) - len(suffix)
    if keep <= 0:
        raise no_room(limit, len(prefix) + len(suffix), truncation)
    kept = content[:keep] if truncation.side == "right" else content[len(content) - keep :]
    if truncation.side == "left":
        prompt_len = 0  # the prompt was cut off with the start of the text
    return TokenizedInput(prefix + kept + suffix, n, min(prompt_len, len(prefix) + keep))

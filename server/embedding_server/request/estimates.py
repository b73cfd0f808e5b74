"""What a request will hold, known before it is tokenized (:class:`AdmissionEstimate`): the
scheduler admits, queues or refuses a request on it, so a request over its limit costs no
tokenization, and no hostile text can make its bound smaller than what it holds
(:func:`token_bound`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from embedding_server.request.texts import TextInput


def token_bound(text: str) -> int:
    """At most how many tokens ``text`` can hold: one per UTF-8 byte (four per character
    unless it is ASCII, which Python knows without reading it), plus a leading word marker
    (SentencePiece's). Every tokenizer we serve gives at most a token per byte, so no text can
    make its admission estimate smaller than what it holds."""
    return size_bound(len(text), text.isascii())


def size_bound(chars: int, ascii: bool) -> int:
    """:func:`token_bound` of a text of ``chars`` characters, all ASCII or not: what a text
    that is not built (a pair's prompt) can hold, from its parts' sizes."""
    return (chars if ascii else 4 * chars) + 1


LIKELY_CHARS_PER_TOKEN = 4
"""Characters per token of natural text (3-5 in every tokenizer we serve): what a text is
likely to hold, charged to the queue while it is tokenized."""


class AdmissionEstimate(NamedTuple):
    """What a request will hold, known before tokenizing it."""

    floor: int
    """Never more than it holds: a request whose floor is too big is refused at once."""
    likely: int
    """What it probably holds (texts at :data:`LIKELY_CHARS_PER_TOKEN`): the queue room it
    takes while it is tokenized, so ordinary text is not refused by a queue it fits in."""
    bound: int
    """Never less than it holds (:func:`token_bound`): what the tokenizer may have to produce
    for it, which no hostile text can shrink (the scheduler bounds the sum in flight)."""


def _likely(chars: int) -> int:
    return -(-chars // LIKELY_CHARS_PER_TOKEN)


def estimate_inputs(
    inputs: Sequence[TextInput], *, limit: int, num_special: int, prompt: str | None
) -> AdmissionEstimate:
    """What ``inputs`` will hold, each kept to ``limit`` tokens, each text with ``prompt``
    and ``num_special`` special tokens.

    Token-id inputs are counted exactly, at most the limit each. A text counts one token
    in ``floor``, its length at :data:`LIKELY_CHARS_PER_TOKEN` in ``likely``, and its
    :func:`token_bound` in ``bound`` (with the prompt's and the special tokens), each at
    most the limit, so no text can make its request's bound smaller than it is.
    """
    extra = (token_bound(prompt) if prompt else 0) + num_special
    prompt_chars = len(prompt or "")
    floor = likely = bound = 0
    for item in inputs:
        if isinstance(item, str):
            most = min(limit, token_bound(item) + extra)
            floor += 1
            bound += most
            likely += min(most, _likely(len(item) + prompt_chars) + num_special)
        else:
            exact = min(limit, len(item))
            floor += exact
            likely += exact
            bound += exact
    return AdmissionEstimate(floor, likely, bound)


def estimate_sized(
    sizes: Iterable[tuple[int, bool]], *, limit: int, num_special: int
) -> AdmissionEstimate:
    """:func:`estimate_inputs` of texts known by their sizes alone (characters, and whether
    all are ASCII), without a prompt: the prompts of a request's pairs, each holding its
    query, are measured from their parts and never built to be measured."""
    floor = likely = bound = 0
    for chars, ascii in sizes:
        most = min(limit, size_bound(chars, ascii) + num_special)
        floor += 1
        bound += most
        likely += min(most, _likely(chars) + num_special)
    return AdmissionEstimate(floor, likely, bound)


def estimate_pairs(
    pairs: Sequence[tuple[str, str]], *, limit: int, num_special: int
) -> AdmissionEstimate:
    """:func:`estimate_inputs` of sentence pairs, from their lengths alone (a pair's texts
    are never joined to be measured), each with the pair template's ``num_special``."""
    floor = min(limit, max(1, num_special)) * len(pairs)
    likely = bound = 0
    for a, b in pairs:
        most = min(limit, token_bound(a) + token_bound(b) + num_special)
        bound += most
        likely += min(most, _likely(len(a) + len(b)) + num_special)
    return AdmissionEstimate(floor, likely, bound)

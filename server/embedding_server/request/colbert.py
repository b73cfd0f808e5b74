"""ColBERT late interaction, the request plane's half: how a query or a document becomes the
token ids a ColBERT checkpoint was trained on, and its token vectors what it scores with.

Two checkpoint formats put the same computation in different files:

* stanford-futuredata/ColBERT's ``HF_ColBERT`` (answerdotai/answerai-colbert-small-v1): a
  BERT body, a ``linear`` projection (no bias) and ``artifact.metadata``. A text is
  tokenized as ``". " + text`` and position 1 (the ``.``) overwritten with the side's
  marker (``[unused0]`` for queries, ``[unused1]`` for documents), cut to ``query_maxlen``
  or ``doc_maxlen`` tokens (the closing ``[SEP]`` kept);
* lightonai/PyLate (GTE-ModernColBERT): a ModernBERT body, a Dense module and
  ``config_sentence_transformers.json``. A text is tokenized to ``query_length - 1`` or
  ``document_length - 1`` tokens and the side's prefix token (``[Q] ``, ``[D] ``) inserted
  after the first.

Either way a query is then expanded to its full length with ``[MASK]`` tokens whose keys
nothing attends to (``attend_to_mask_tokens`` / ``attend_to_expansion_tokens`` false), and
every query token is kept; a document is not padded, and its punctuation tokens (the
skip-list) are dropped from its vectors. Every kept vector is L2-normalized; a query scores a
document by MaxSim, the sum over its vectors of the best dot product with a document vector.

The device half (the projection) is ``device/colbert.py``; the attention over a key prefix
is ``device/attention.py``'s.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
from tokenizers import Tokenizer

from embedding_server.errors import InvalidRequestError
from embedding_server.request.estimates import (
    LIKELY_CHARS_PER_TOKEN,
    AdmissionEstimate,
    token_bound,
)
from embedding_server.request.pooling import FloatArray, l2_normalize

Side = Literal["query", "document"]
SIDES: tuple[Side, ...] = ("query", "document")
Style = Literal["stanford", "pylate"]


class Encoded(NamedTuple):
    """One text as a ColBERT side sees it."""

    ids: list[int]
    keys: int
    """How many leading tokens are keys (fewer than ``ids`` for an expanded query)."""
    original: int
    """Its token count, marker included, before it was cut to its side's length."""


@dataclass(frozen=True)
class ColbertFormat:
    """How a ColBERT checkpoint tokenizes each side and which document tokens it drops."""

    style: Style
    """``stanford``: the marker overwrites position 1 of ``". " + text``; ``pylate``: the
    prefix token is inserted at position 1 of ``text``."""
    query_marker: int
    document_marker: int
    query_length: int
    """Every query's length in tokens, expansion ``[MASK]`` tokens included."""
    document_length: int
    """The most tokens of a document."""
    mask_id: int
    attend_to_expansion: bool
    """Whether the expansion ``[MASK]`` tokens are keys too (false in both formats'
    defaults and in the published checkpoints)."""
    skiplist: frozenset[int]
    """Token ids dropped from a document's vectors (punctuation), empty for none."""
    width: int
    """Width of one vector (the projection's output size)."""

    def encode(self, tokenizer: Tokenizer, text: str, side: Side) -> Encoded:
        """``text``'s token ids as the checkpoint's side sees them, and how many leading
        tokens are keys (less than the ids for an expanded query). ``tokenizer`` pads and
        truncates nothing itself (:class:`~.tokenization.TextTokenizer`'s backend)."""
        length = self.query_length if side == "query" else self.document_length
        marker = self.query_marker if side == "query" else self.document_marker
        if self.style == "stanford":
            whole = tokenizer.encode(". " + text).ids
            ids = _cut(whole, length)
            ids[1] = marker
            original = len(whole)
        else:
            whole = tokenizer.encode(text).ids
            first, *rest = _cut(whole, length - 1)
            ids = [first, marker, *rest]
            original = len(whole) + 1
        keys = len(ids)
        if side == "query" and len(ids) < length:
            ids += [self.mask_id] * (length - len(ids))
            if self.attend_to_expansion:
                keys = length
        return Encoded(ids, keys, original)

    def vectors(self, rows: FloatArray, ids: Sequence[int], side: Side) -> FloatArray:
        """One input's ColBERT vectors from its projected token rows: every query token,
        a document's tokens but its skip-list's, each L2-normalized."""
        vectors = np.asarray(rows, dtype=np.float32)
        if side == "document" and self.skiplist:
            keep = ~np.isin(np.asarray(ids, np.int64), np.fromiter(self.skiplist, np.int64))
            vectors = vectors[keep]
        return l2_normalize(np.ascontiguousarray(vectors))

    def admission(self, texts: Sequence[str], sides: Sequence[Side]) -> AdmissionEstimate:
        """What a job of ``texts`` will hold, before tokenizing it: a query exactly its
        length (cut or expanded), a document at most its length, and at most its text's
        :func:`~.tokenization.token_bound` with the marker and special tokens."""
        floor = likely = bound = 0
        for text, side in zip(texts, sides, strict=True):
            if side == "query":
                floor += self.query_length
                likely += self.query_length
                bound += self.query_length
                continue
            most = min(self.document_length, token_bound(". " + text) + _EXTRA)
            floor += 1
            bound += most
            likely += min(most, -(-len(text) // LIKELY_CHARS_PER_TOKEN) + _EXTRA)
        return AdmissionEstimate(floor, likely, bound)

    def kept_ids(self, ids: Sequence[int], side: Side) -> list[int]:
        """The token ids whose vectors :meth:`vectors` keeps, in order."""
        if side == "document" and self.skiplist:
            return [i for i in ids if i not in self.skiplist]
        return list(ids)


_EXTRA = 3
"""Tokens beyond ``". " + text``'s own: ``[CLS]``, ``[SEP]`` and PyLate's inserted marker."""


def _cut(ids: list[int], length: int) -> list[int]:
    """``ids`` (``[CLS] ... [SEP]``) cut to ``length`` tokens, the closing token kept, as
    transformers' truncation of a single text does."""
    if len(ids) <= length:
        return list(ids)
    return [*ids[: length - 1], ids[-1]]


def punctuation_skiplist(tokenizer: Tokenizer, style: Style) -> frozenset[int]:
    """The ids of ``string.punctuation``'s symbols: stanford-colbert takes each symbol's
    first token, PyLate the symbol's own vocabulary entry (the unknown token where the
    vocabulary lacks it, as ``convert_tokens_to_ids`` gives)."""
    ids: set[int] = set()
    for symbol in string.punctuation:
        if style == "stanford":
            pieces = tokenizer.encode(symbol, add_special_tokens=False).ids
            if pieces:
                ids.add(pieces[0])
        else:
            found = tokenizer.token_to_id(symbol)
            if found is not None:
                ids.add(found)
    return frozenset(ids)


def parse_side(value: object, param: str = "input_type") -> Side:
    """A request's side (``query`` or ``document``), or a 400 naming ``param``."""
    if value in SIDES:
        return value  # type: ignore[return-value]
    raise InvalidRequestError(
        f"{param} must be one of {', '.join(SIDES)} for a ColBERT model (its queries and "
        f"documents are tokenized differently); got {value!r}",
        param=param,
    )


def maxsim_sum(query: FloatArray, document: FloatArray) -> float:
    """ColBERT's score: for each query vector, its best dot product with a document vector,
    summed. An empty document scores 0."""
    if len(query) == 0 or len(document) == 0:
        return 0.0
    similarities = np.asarray(query, np.float64) @ np.asarray(document, np.float64).T
    return float(similarities.max(axis=1).sum())

"""Tokenizing as the API serves it (``/tokenize``, ``/detokenize``): the model's tokenizer on
texts and ids, with no job and no scheduler (:meth:`~.tokenization.TextTokenizer.tokenize`)."""

from __future__ import annotations

from typing import TypedDict


class TokenizeOptions(TypedDict, total=False):
    """The options of the engine's ``tokenize`` and ``atokenize``."""

    add_special_tokens: bool
    """Add the tokenizer's special tokens around each text (default True)."""
    max_tokens: int | None
    """Refuse a text holding more tokens (413), after reading a bounded part of it."""
    param: str
    """The request field a refusal names (default ``input``)."""

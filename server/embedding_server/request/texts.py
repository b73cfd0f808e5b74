"""What a request's inputs are, validated before anything is tokenized: a text, or token ids
the client already produced (:data:`TextInput`, :func:`normalize_inputs`), and token ids in
the range a tokenizer knows (:func:`check_ids`, for ``/detokenize`` and token-id inputs).
"""

from __future__ import annotations

from collections.abc import Sequence

from embedding_server.errors import InvalidRequestError

TextInput = str | Sequence[int]
"""One input: a string, or token ids the client already produced (used verbatim)."""


def check_ids(ids: Sequence[int], param: str, bound: int) -> None:
    """Refuse anything but a list of integer ids below ``bound``, naming ``param``."""
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise InvalidRequestError("tokens must be a list of integers", param=param)
    # The common case in C loops (millions of ids in tens of milliseconds); the loop
    # below only runs to name the first bad id, or for int subclasses.
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < bound:
        return
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < bound:
            raise InvalidRequestError(
                f"token ids must be integers in [0, {bound}); got {token!r}", param=param
            )


def normalize_inputs(inputs: object, param: str) -> list[TextInput]:
    """Validate request inputs into a list of strings / token-id lists (errors name ``param``)."""
    if isinstance(inputs, str):
        if not inputs:
            raise InvalidRequestError(f"{param} must not be an empty string", param=param)
        return [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, bytes | bytearray):
        raise InvalidRequestError(
            f"{param} must be a string, a list of strings or a list of token ids; got "
            f"{type(inputs).__name__}",
            param=param,
        )
    items = list(inputs)
    if not items:
        raise InvalidRequestError(f"{param} must not be an empty list", param=param)
    if _all_tokens(items):
        return [items]
    out: list[TextInput] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"{param}[{i}] must not be an empty string", param=param)
            out.append(item)
        elif (
            isinstance(item, Sequence)
            and not isinstance(item, bytes | bytearray | str)
            and _all_tokens(item)
        ):
            if not item:
                raise InvalidRequestError(
                    f"{param}[{i}] must not be an empty token list", param=param
                )
            out.append(list(item))
        else:
            raise InvalidRequestError(
                f"{param}[{i}] must be a string or a list of token ids; got {type(item).__name__}",
                param=param,
            )
    return out


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _all_tokens(items: Sequence[object]) -> bool:
    """Whether every item is a token id: in C loops for plain ints (millions of ids in tens of
    milliseconds, on the event loop), item by item only for int subclasses."""
    return set(map(type, items)) == {int} or all(_is_token(x) for x in items)

"""Sentence pairs as a cross-encoder reads them: one sequence each, the tokenizer's pair
template (``[CLS] a [SEP] b [SEP]`` with segment ids for BERT, ``<s> a </s></s> b </s>`` for
RoBERTa) around both texts, an over-long pair cut longest-first (:func:`longest_first`), as
transformers' ``truncation=True`` does.

Pairs are read through windows as single texts are (``windows.py``), each distinct text once
however many pairs it is in (the query of a rerank request is one text, read once, for all its
documents), and widened only while a pair it is in cannot be decided (:func:`pair_keeps`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Encoding, Tokenizer

from embedding_server.errors import InputTooLongError, InvalidRequestError
from embedding_server.request.truncation import Tally, TokenizedInput, Truncation
from embedding_server.request.windows import (
    READ_CHARS_PER_CALL,
    Reading,
    read_windows,
    unsettled_error,
)


def encode_pairs(
    backend: Tokenizer,
    pairs: Sequence[tuple[str, str]],
    *,
    limit: int,
    special: int,
    windows: tuple[int, int],
    truncation: Truncation,
    max_total: int | None = None,
) -> list[TokenizedInput]:
    """Tokenize sentence pairs as one sequence each, the way a cross-encoder reads them:
    the tokenizer's pair template (``[CLS] a [SEP] b [SEP]`` with segment ids for BERT,
    ``<s> a </s></s> b </s>`` for RoBERTa) around both texts, over-long pairs cut
    longest-first (one token at a time from the longer text), as transformers'
    ``truncation=True`` does.

    Each distinct text is read once (a query scored against 2,048 documents is read
    once, not 2,048 times), through windows as single texts are, and widened only while
    a pair it is in cannot be decided (:func:`pair_keeps`). ``max_total`` as for
    ``TextTokenizer.encode``. ``limit``: the tokens a pair may keep, ``special`` of them
    the pair template's; ``windows``: the first and the widest window (characters)."""
    first, widest = windows
    from_end = truncation.side == "left"
    tally = Tally(max_total, "input")
    readings: dict[int, Reading] = {}

    def reading_of(text: str) -> Reading:
        found = readings.get(id(text))
        if found is None:
            found = readings[id(text)] = Reading(text, first, from_end)
        return found

    both = [(reading_of(a), reading_of(b)) for a, b in pairs]
    out: list[TokenizedInput | None] = [None] * len(pairs)
    # Turns of pairs by the characters their texts not read in an earlier turn take.
    groups: list[list[int]] = [[]]
    seen: set[int] = set()
    size = 0
    for i, (a, b) in enumerate(both):
        new = {id(r): r for r in (a, b) if id(r) not in seen}
        cost = sum(min(len(r.text), r.window) for r in new.values())
        if groups[-1] and size + cost > READ_CHARS_PER_CALL:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += cost
        seen.update(new)
    for pending in groups:
        while pending:
            read_windows(backend, [r for i in pending for r in both[i]])
            undecided: list[int] = []
            widen: dict[int, Reading] = {}
            for i in pending:
                a, b = both[i]
                keeps = pair_keeps(a, b, limit, special, truncation, i)
                if keeps is None:
                    for r in (a, b):
                        if not r.whole:
                            widen[id(r)] = r
                    undecided.append(i)
                    continue
                fitted = fit_pair(backend, a, b, keeps, limit, special, truncation, i)
                tally.add(len(fitted.ids))
                out[i] = fitted
            for r in widen.values():
                if not r.widen(widest):
                    i = next(i for i in undecided if r in both[i])
                    raise unsettled_error(f"pair {i}", r, 1, widest, truncation.param)
            pending = undecided
    return [x for x in out if x is not None]


def pair_keeps(
    a: Reading,
    b: Reading,
    limit: int,
    special: int,
    truncation: Truncation,
    index: int,
) -> tuple[int, int] | None:
    """How many tokens a pair keeps of each text, once its windows decide it; None while
    they do not. A text read whole is exact; a window gives a lower bound (its settled
    tokens), which decides the pair when:

    * refusing over-long pairs: the lower bounds alone are over the limit (refused);
    * longest-first, one text read whole: the other is strictly longer even by its
      lower bound, the pair over budget, so it keeps ``budget - shorter`` or half the
      budget whatever its full length, and those are settled tokens;
    * longest-first, both windows, an even budget: each is longer than half of it, so
      each keeps exactly half. With an odd budget the longer text keeps the odd token,
      and which one is longer depends on text not read: they are read further.
    """
    assert a.enc is not None and b.enc is not None
    budget = limit - special
    if a.whole and b.whole:
        n = len(a.enc) + len(b.enc) + special
        if n <= limit:
            return len(a.enc), len(b.enc)
        if truncation.side is None:
            raise pair_too_long(index, n, limit, truncation, at_least=False)
        return longest_first(len(a.enc), len(b.enc), budget)
    if truncation.side is None:
        lower = a.settled + b.settled + special
        if lower > limit:
            raise pair_too_long(index, lower, limit, truncation, at_least=True)
        return None
    if a.whole or b.whole:
        whole, part = (a, b) if a.whole else (b, a)
        n_whole, settled = whole.settled, part.settled
        if settled <= n_whole or settled + n_whole <= budget:
            return None
        keep_a, keep_b = longest_first(
            settled if part is a else n_whole, settled if part is b else n_whole, budget
        )
        return (keep_a, keep_b) if settled > (keep_a if part is a else keep_b) else None
    half = budget // 2
    if budget % 2 == 0 and a.settled > half and b.settled > half:
        return half, half
    return None


def pair_too_long(
    index: int, n: int, limit: int, truncation: Truncation, *, at_least: bool
) -> InputTooLongError:
    return InputTooLongError(
        f"pair {index} has {'at least ' if at_least else ''}{n} tokens, more than the "
        f"maximum of {limit}; shorten it or ask for truncation",
        param=truncation.param,
        token_count=n,
        max_tokens=limit,
    )


def fit_pair(
    backend: Tokenizer,
    a: Reading,
    b: Reading,
    keeps: tuple[int, int],
    limit: int,
    special: int,
    truncation: Truncation,
    index: int,
) -> TokenizedInput:
    """The pair's sequence: both texts cut to ``keeps`` (copies: an encoding may be
    shared with other pairs) inside the tokenizer's pair template."""
    assert a.enc is not None and b.enc is not None
    n = a.settled + b.settled + special
    if min(keeps) == 0 and n > limit:
        raise InvalidRequestError(
            f"pair {index} cannot be cut to {limit} tokens without dropping one of its texts",
            param=truncation.param,
        )
    encodings: list[Encoding] = []
    for reading, keep in ((a, keeps[0]), (b, keeps[1])):
        enc = reading.enc
        assert enc is not None
        if keep < len(enc):
            enc = Encoding.merge([enc], growing_offsets=True)
            enc.truncate(keep, direction=truncation.side or "right")
        encodings.append(enc)
    enc = backend.post_process(encodings[0], encodings[1], add_special_tokens=True)
    types = list(enc.type_ids)
    return TokenizedInput(list(enc.ids), n, 0, types if any(types) else None)


def longest_first(first: int, second: int, budget: int) -> tuple[int, int]:
    """Token counts kept of a pair's two texts within ``budget`` content tokens, as the
    tokenizers library's ``longest_first`` strategy cuts: the longer text loses tokens until
    both are equal, then the rest is split, the first text losing the odd token (on equal
    lengths the second counts as the longer)."""
    excess = first + second - budget
    if excess <= 0:
        return first, second
    first_longer = first > second
    longer, shorter = (first, second) if first_longer else (second, first)
    cut = min(excess, longer - shorter)
    rest = excess - cut
    longer -= cut + rest // 2
    shorter -= rest - rest // 2
    return (longer, shorter) if first_longer else (shorter, longer)

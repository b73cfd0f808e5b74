"""Tokenization and the per-request truncation policy.

Tokenizing is the first stage of the pipeline and, for small encoders, often the most expensive
one on the request path, so it runs off the event loop: one batched call into the Rust fast
tokenizer (``tokenizers.Tokenizer.encode_batch_fast``, which releases the GIL) per request, in a
small thread pool owned by the engine.

Truncation is decided per request. ``Truncation`` is the engine's single vocabulary for it;
the HTTP dialects' fields (OpenAI/vLLM ``truncate_prompt_tokens``, Cohere ``truncate``) are
translated into it by the request models in ``api/protocol.py``, so this module knows no
client dialect.

Prompts (sentence-transformers' ``prompts``, prepended to text inputs) are resolved here
too (:class:`Prompts`), as is the validation of what ``/tokenize`` and ``/detokenize`` get.

We truncate *content* tokens and then add the special tokens, as Hugging Face tokenizers do,
so a truncated BERT input still starts with ``[CLS]`` and ends with ``[SEP]``.

A text longer than the model can use is *read* through a window before the tokenizer sees
all of it, so a megabyte of text costs what a few thousand characters cost. Reading never
changes a result; the argument: the tokenizer splits text into words before it cuts words into
tokens, so every token of a window of the text, except those of the word at the window's edge
(and an added token touching it), is a token of the whole text, the same token at the same
place: these are the window's *settled* tokens, and the text beyond the window cannot change
them. When the settled tokens are more than an input may keep, the whole text is over-long,
and its truncation (or its refusal without truncation) is exactly that of the window. When
they are not (a text made of a few giant words, or a word longer than the window straddling
its edge), the window is doubled and the text read again, until either the settled tokens
decide it or the window holds the whole text, which is then tokenized as it is. A window
starts at :data:`CLIP_CHARS_PER_TOKEN` characters per token the input may keep and grows to
:data:`MAX_CHARS_PER_TOKEN` per token at most, so the tokenizer reads at most twice that of
any one input, whatever its words. A longer text its widest window does not settle (a word of
thousands of characters at the cut) is refused with :class:`~.errors.UnsettledInputError`,
never tokenized in full nor guessed at.

Sentence pairs are read the same way, each distinct text once however many pairs it is in
(the query of a rerank request is one text, read once, for all its documents), and the
tokens a whole request holds are counted as its inputs are read, so a request over its limit
is refused after reading at most that limit's worth of text (:meth:`TextTokenizer.encode`'s
``max_total``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from tokenizers import Encoding, Tokenizer

from embedding_server.errors import (
    InputTooLongError,
    InvalidRequestError,
    TooManyTokensError,
    UnsettledInputError,
)
from embedding_server.request.special_tokens import affixes

if TYPE_CHECKING:
    from embedding_server.request.heads import SegmentedPairTemplate

logger = logging.getLogger(__name__)

CLIP_CHARS_PER_TOKEN = 8
"""The first window over an over-long text: characters read per token the input may keep.
Natural text averages 3-5 characters per token in every tokenizer we serve, so this window
nearly always settles the text at once."""

MAX_CHARS_PER_TOKEN = 64
"""The widest window: characters read per token the input may keep (at least
:data:`MIN_WIDEST_CHARS`). Beyond it a text that is still not settled is refused."""

MIN_WIDEST_CHARS = 16384
"""The widest window is never narrower than this, so a request that keeps few tokens of each
input (a small ``truncate_prompt_tokens``) still reads a long word whole."""

READ_CHARS_PER_CALL = 1 << 20
"""Characters one batched tokenizer call reads at most: the inputs of a bigger request are
read in turns of this size, and its tokens are counted against its limit after each turn."""


def token_bound(text: str) -> int:
    """At most how many tokens ``text`` can hold: one per UTF-8 byte (four per character
    unless it is ASCII, which Python knows without reading it), plus a leading word marker
    (SentencePiece's). Every tokenizer we serve gives at most a token per byte, so no text can
    make its admission estimate smaller than what it holds."""
    return (len(text) if text.isascii() else 4 * len(text)) + 1


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


TruncationSide = Literal["right", "left"]

TextInput = str | Sequence[int]
"""One input: a string, or token ids the client already produced (used verbatim)."""


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


@dataclass(frozen=True)
class Prompts:
    """The model's named prompts and the one applied when a request names none, and its task
    adapters, which share the prompts' names (jina-embeddings-v3: the ``retrieval.query``
    adapter is trained with the ``retrieval.query`` prompt)."""

    table: Mapping[str, str]
    default_name: str | None = None
    adapters: tuple[str, ...] = ()
    """The model's task LoRA adapters in index order (``lora_adaptations``); empty for a
    model without any."""

    def resolve(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """The prompt text for a request: an explicit ``prompt``, else the named one (or the
        default), else None."""
        if prompt is not None and prompt_name is not None:
            raise InvalidRequestError(
                "give either prompt or prompt_name, not both", param="prompt_name"
            )
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string", param="prompt")
            return prompt
        name = prompt_name if prompt_name is not None else self.default_name
        if name is None:
            return None
        if name not in self.table:
            available = ", ".join(sorted(self.table)) or "none"
            raise InvalidRequestError(
                f"unknown prompt_name {name!r}; this model's prompts: {available}",
                param="prompt_name",
            )
        return self.table[name]

    def adapter(self, adapter: str | None, prompt_name: str | None) -> int | None:
        """The index of the task adapter a request runs: the one it names (``adapter``),
        else the one named like its prompt (``prompt_name``, or the default prompt), else
        None (the base weights). An adapter the model lacks is a 400."""
        if adapter is not None:
            if adapter not in self.adapters:
                available = ", ".join(self.adapters) or "none (it has no task adapters)"
                raise InvalidRequestError(
                    f"unknown task adapter {adapter!r}; this model's adapters: {available}",
                    param="adapter",
                )
            return self.adapters.index(adapter)
        name = prompt_name if prompt_name is not None else self.default_name
        return self.adapters.index(name) if name in self.adapters else None


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


@dataclass(eq=False, slots=True)
class _Reading:
    """One text being read through a window (see the module docstring)."""

    text: str
    window: int
    """Characters of ``text`` the next read takes (from its end with ``from_end``)."""
    from_end: bool = False
    prompt: str = ""
    """Prepended to what is read from the start (a prompt is cut off with the start)."""
    enc: Encoding | None = None
    read: int = 0
    """The window ``enc`` was read with (0: not read yet)."""
    settled: int = 0
    """Leading tokens of ``enc`` (trailing ones ``from_end``) that the unread text cannot
    change; all of them once the whole text was read."""

    @property
    def whole(self) -> bool:
        return self.window >= len(self.text)

    @property
    def current(self) -> bool:
        return self.enc is not None and self.read == self.window

    def part(self) -> str:
        if self.whole:
            return self.prompt + self.text
        if self.from_end:
            return self.text[len(self.text) - self.window :]
        return self.prompt + self.text[: self.window]

    def widen(self, widest: int) -> bool:
        """Double the window (to ``widest`` at most); False when it is at ``widest``."""
        if self.window >= widest:
            return False
        self.window = min(2 * self.window, widest)
        return True


class _Tally:
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


def _turns(readings: list[_Reading]) -> list[list[_Reading]]:
    """``readings`` in turns of at most :data:`READ_CHARS_PER_CALL` characters read."""
    turns: list[list[_Reading]] = [[]]
    size = 0
    for reading in readings:
        cost = min(len(reading.text), reading.window)
        if turns[-1] and size + cost > READ_CHARS_PER_CALL:
            turns.append([])
            size = 0
        turns[-1].append(reading)
        size += cost
    return turns


class TextTokenizer:
    """A fast tokenizer plus the model's limits; thread-safe for concurrent ``encode`` calls.

    The wrapped ``tokenizers.Tokenizer`` must have truncation and padding disabled: we
    truncate per request ourselves (its truncation setting is global mutable state).
    """

    def __init__(
        self, tokenizer: Tokenizer, *, max_length: int, embedding_rows: int | None = None
    ) -> None:
        self._tok = tokenizer
        self._tok.no_truncation()
        self._tok.no_padding()
        self.max_length = max_length
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.input_id_limit = min(self.vocab_size, embedding_rows or self.vocab_size)
        """Token ids a model input may hold: known to the tokenizer *and* a row of the
        model's embedding table (on CUDA an out-of-range row is a device assert)."""
        self.first_chars_per_token = CLIP_CHARS_PER_TOKEN
        self.max_chars_per_token = MAX_CHARS_PER_TOKEN
        self.min_widest_chars = MIN_WIDEST_CHARS
        self._prefix, self._suffix = _special_affixes(tokenizer)
        self.num_special = len(self._prefix) + len(self._suffix)
        self.num_pair_special = tokenizer.num_special_tokens_to_add(True)

    @property
    def backend(self) -> Tokenizer:
        return self._tok

    def windows(self, limit: int) -> tuple[int, int]:
        """The first and the widest window (characters) over a text that may keep ``limit``
        tokens."""
        first = self.first_chars_per_token * limit
        widest = max(self.max_chars_per_token * limit, self.min_widest_chars, first)
        return first, widest

    def tokenize(
        self,
        texts: str | Sequence[str],
        *,
        add_special_tokens: bool = True,
        max_tokens: int | None = None,
        param: str = "input",
    ) -> list[list[int]]:
        """Token ids of each text, untruncated (the ``/tokenize`` endpoint).

        With ``max_tokens``, a text holding more is refused (:class:`TooManyTokensError`)
        after reading at most :data:`CLIP_CHARS_PER_TOKEN` characters per allowed token of
        it: it is read through windows from one character per allowed token up, until its
        settled tokens are too many or the window holds it whole."""
        items = [texts] if isinstance(texts, str) else list(texts)
        if not items:
            raise InvalidRequestError("no texts given to tokenize", param=param)
        for i, text in enumerate(items):
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"{param}[{i}] must be a string, got {type(text).__name__}", param=param
                )
        if max_tokens is None:
            encodings = self._tok.encode_batch_fast(items, add_special_tokens=add_special_tokens)
            return [e.ids for e in encodings]
        specials = self.num_special if add_special_tokens else 0
        first, widest = max_tokens + 1, self.first_chars_per_token * (max_tokens + 1)
        out: list[list[int]] = []
        for i, text in enumerate(items):
            where = param if len(items) == 1 else f"{param}[{i}]"
            reading = _Reading(text, first)
            while not reading.whole:
                self._read([reading])
                at_least = reading.settled + specials
                if at_least > max_tokens:
                    raise self._too_many(where, f"at least {at_least}", max_tokens)
                if not reading.widen(widest):
                    raise self._unsettled(where, reading, max_tokens - specials, widest)
            ids = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
            if len(ids) > max_tokens:
                raise self._too_many(where, str(len(ids)), max_tokens)
            out.append(ids)
        return out

    @staticmethod
    def _too_many(where: str, count: str, limit: int) -> TooManyTokensError:
        return TooManyTokensError(
            f"'{where}' holds {count} tokens; one request may hold at most {limit} "
            "(max_request_tokens)",
            param=where.split("[", 1)[0],
        )

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of token ids (special tokens dropped unless asked for)."""
        self.check_ids(ids, "tokens")
        # decode_batch, not decode: only the batch form lets go of the GIL, and a long decode
        # holding it stalls the event loop even from a worker thread.
        return self._tok.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary string, as ``convert_ids_to_tokens`` gives it: decoding ids one
        at a time would drop WordPiece ``##`` and byte-level BPE markers."""
        self.check_ids(ids, "tokens")
        return [self._tok.id_to_token(token) or "" for token in ids]

    def check_ids(self, ids: Sequence[int], param: str, limit: int | None = None) -> None:
        """Refuse anything but a list of integer ids below ``limit`` (default: the
        tokenizer's vocabulary), naming ``param``."""
        bound = self.vocab_size if limit is None else limit
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

    def admission_estimate(
        self, inputs: Sequence[TextInput], truncation: Truncation, prompt: str | None
    ) -> AdmissionEstimate:
        """What a request will hold, known before tokenizing it (:class:`AdmissionEstimate`).

        Token-id inputs are counted exactly, at most the limit each. A text counts one token
        in ``floor``, its length at :data:`LIKELY_CHARS_PER_TOKEN` in ``likely``, and its
        :func:`token_bound` in ``bound`` (with the prompt's and the special tokens), each at
        most the limit, so no text can make its request's bound smaller than it is.
        """
        limit = min(self.max_length, truncation.max_tokens or self.max_length)
        extra = (token_bound(prompt) if prompt else 0) + self.num_special
        prompt_chars = len(prompt or "")
        floor = likely = bound = 0
        for item in inputs:
            if isinstance(item, str):
                most = min(limit, token_bound(item) + extra)
                floor += 1
                bound += most
                likely += min(most, _likely(len(item) + prompt_chars) + self.num_special)
            else:
                exact = min(limit, len(item))
                floor += exact
                likely += exact
                bound += exact
        return AdmissionEstimate(floor, likely, bound)

    def pair_estimate(
        self, pairs: Sequence[tuple[str, str]], truncation: Truncation
    ) -> AdmissionEstimate:
        """:meth:`admission_estimate` of sentence pairs, from their lengths alone (a pair's
        texts are never joined to be measured)."""
        limit = min(self.max_length, truncation.max_tokens or self.max_length)
        special = self.num_pair_special
        floor = min(limit, max(1, special)) * len(pairs)
        likely = bound = 0
        for a, b in pairs:
            most = min(limit, token_bound(a) + token_bound(b) + special)
            bound += most
            likely += min(most, _likely(len(a) + len(b)) + special)
        return AdmissionEstimate(floor, likely, bound)

    def prompt_length(self, prompt: str, *, add_special_tokens: bool = True) -> int:
        """Leading tokens that belong to the prompt, leading special tokens included, as
        sentence-transformers counts them for ``include_prompt=False``."""
        if not prompt:
            return 0
        content = len(self._tok.encode(prompt, add_special_tokens=False).ids)
        return content + (len(self._prefix) if add_special_tokens else 0)

    def encode(
        self,
        inputs: Sequence[TextInput],
        *,
        truncation: Truncation,
        add_special_tokens: bool = True,
        prompt: str | None = None,
        param: str = "input",
        max_total: int | None = None,
    ) -> list[TokenizedInput]:
        """Tokenize and truncate one request's inputs: each text read through windows (see
        the module docstring), all of a turn's texts in one batched call.

        ``max_total``: the most tokens the request may hold; once its inputs hold more, it
        is refused (:class:`TooManyTokensError`) without reading the rest."""
        limit = self._limit(truncation)
        prefix = self._prefix if add_special_tokens else []
        suffix = self._suffix if add_special_tokens else []
        prompt_len = self.prompt_length(prompt or "", add_special_tokens=add_special_tokens)
        first, widest = self.windows(limit)
        from_end = truncation.side == "left"
        tally = _Tally(max_total, param)
        out: list[TokenizedInput | None] = [None] * len(inputs)
        slots: dict[int, int] = {}  # id(reading) -> its input's index
        readings: list[_Reading] = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                # A prompt read from the end would be cut off: it joins only a whole text.
                reading = _Reading(item, first, from_end, prompt or "")
                slots[id(reading)] = i
                readings.append(reading)
            else:
                ids = list(item)
                where = f"{param}[{i}]" if len(inputs) > 1 else param
                self.check_ids(ids, where, self.input_id_limit)
                fitted = self._fit(ids, ids, [], limit, truncation, i, param, 0)
                tally.add(len(fitted.ids))
                out[i] = fitted
        for turn in _turns(readings):
            pending = turn
            while pending:
                self._read(pending)
                unsettled: list[_Reading] = []
                for reading in pending:
                    slot = slots[id(reading)]
                    if reading.whole:
                        assert reading.enc is not None
                        fitted = self._fit_encoding(
                            reading.enc, prefix, suffix, limit, truncation, slot, param, prompt_len
                        )
                    else:
                        unfit = self._fit_clipped(
                            reading, prefix, suffix, limit, truncation, slot, param, prompt_len
                        )
                        if unfit is None:
                            if not reading.widen(widest):
                                keep = limit - len(prefix) - len(suffix)
                                raise self._unsettled(f"{param}[{slot}]", reading, keep, widest)
                            unsettled.append(reading)
                            continue
                        fitted = unfit
                    tally.add(len(fitted.ids))
                    out[slot] = fitted
                pending = unsettled
        return [x for x in out if x is not None]

    def encode_suffixed(
        self,
        texts: Sequence[str],
        suffix: str,
        *,
        truncation: Truncation,
        param: str = "input",
        max_total: int | None = None,
    ) -> list[TokenizedInput]:
        """Tokenize ``texts`` without special tokens, each followed by ``suffix``'s tokens,
        which truncation never cuts: a text keeps at most the limit less the suffix, from its
        start (a yes/no reranker's prompt, whose suffix opens the turn the model answers in:
        its model card's code truncates the same way). Left truncation would cut the prompt's
        instructions, so it is refused."""
        if truncation.side == "left":
            raise InvalidRequestError(
                "truncate='left' would cut a yes/no reranker's prompt; use 'right' (the "
                "document's end is cut) or refuse over-long pairs",
                param=truncation.param,
            )
        tail = self._tok.encode(suffix, add_special_tokens=False).ids
        room = self._limit(truncation) - len(tail)
        if room < 1:
            raise self._no_room(self._limit(truncation), len(tail), truncation)
        bodies = self.encode(
            texts,
            truncation=Truncation(truncation.side, room, truncation.param),
            add_special_tokens=False,
            param=param,
            max_total=None if max_total is None else max(0, max_total - len(tail) * len(texts)),
        )
        return [
            TokenizedInput(b.ids + tail, b.original_length + len(tail), b.prompt_length)
            for b in bodies
        ]

    def encode_segmented(
        self,
        pairs: Sequence[tuple[str, str]],
        template: SegmentedPairTemplate,
        *,
        instruction: str | None,
        truncation: Truncation,
        max_total: int | None = None,
    ) -> list[TokenizedInput]:
        """A yes/no reranker's pairs laid out by ``template`` (:class:`SegmentedPairTemplate`):
        its fixed pieces and each pair's query and document segments tokenized apart, without
        special tokens, the query cut to :meth:`~SegmentedPairTemplate.query_room` and the
        document to what :meth:`~SegmentedPairTemplate.document_room` leaves it, from their
        ends, as the model's reference code cuts them. Each distinct query is read once.
        ``truncate=False`` refuses a pair that would be cut; ``'left'`` is refused (it would
        cut the prompt's instructions), as :meth:`encode_suffixed` does."""
        if truncation.side == "left":
            raise InvalidRequestError(
                "truncate='left' would cut a yes/no reranker's prompt; use 'right' (the "
                "document's end is cut) or refuse over-long pairs",
                param=truncation.param,
            )
        limit = self._limit(truncation)

        def ids(text: str) -> list[int]:
            return list(self._tok.encode(text, add_special_tokens=False).ids)

        head = [i for text in template.head for i in ids(text)]
        sep = ids(template.separator)
        tail = [i for text in template.tail_texts(instruction) for i in ids(text)]
        query_room = template.query_room(limit, len(head), len(tail))
        least_room = template.document_room(limit, len(head), len(sep), len(tail), query_room)
        if query_room < 1 or least_room < 1:
            raise self._no_room(limit, len(head) + len(sep) + len(tail), truncation)
        most_room = template.document_room(limit, len(head), len(sep), len(tail), 0)
        queries = list(dict.fromkeys(template.query_text(q, instruction) for q, _ in pairs))
        read_queries = self.encode(
            queries,
            truncation=Truncation("right", query_room, truncation.param),
            add_special_tokens=False,
        )
        by_query = dict(zip(queries, read_queries, strict=True))
        documents = self.encode(
            [template.document_text(d) for _, d in pairs],
            truncation=Truncation("right", most_room, truncation.param),
            add_special_tokens=False,
        )
        tally = _Tally(max_total, "input")
        out: list[TokenizedInput] = []
        for i, ((query, _), document) in enumerate(zip(pairs, documents, strict=True)):
            q = by_query[template.query_text(query, instruction)]
            room = template.document_room(limit, len(head), len(sep), len(tail), len(q.ids))
            body = document.ids[:room]
            whole = len(head) + q.original_length + len(sep) + document.original_length
            whole += len(tail)
            if truncation.side is None and (q.truncated or len(body) < document.original_length):
                raise InputTooLongError(
                    f"pair {i} has {whole} tokens in {template.name}'s prompt, more than its "
                    f"query may keep ({query_room}) or the maximum of {limit}; shorten it or "
                    "ask for truncation",
                    param="input",
                    token_count=whole,
                    max_tokens=limit,
                )
            fitted = TokenizedInput(head + q.ids + sep + body + tail, whole)
            tally.add(len(fitted.ids))
            out.append(fitted)
        return out

    def _read(self, readings: Sequence[_Reading]) -> None:
        """Tokenize the window of each reading that is not current, in at most two batched
        calls: windows need word ids to settle their edge (``encode_batch``); whole texts do
        not and skip the offset and word bookkeeping (``encode_batch_fast``, measurably
        cheaper per text)."""
        stale = list({id(r): r for r in readings if not r.current}.values())
        parts = [r for r in stale if not r.whole]
        wholes = [r for r in stale if r.whole]
        if parts:
            encodings = self._tok.encode_batch([r.part() for r in parts], add_special_tokens=False)
            for reading, enc in zip(parts, encodings, strict=True):
                reading.enc, reading.read = enc, reading.window
                reading.settled = _settled_tokens(enc.word_ids, from_end=reading.from_end)
        if wholes:
            encodings = self._tok.encode_batch_fast(
                [r.part() for r in wholes], add_special_tokens=False
            )
            for reading, enc in zip(wholes, encodings, strict=True):
                reading.enc, reading.read, reading.settled = enc, reading.window, len(enc.ids)

    @staticmethod
    def _unsettled(
        where: str, reading: _Reading, keep: int, widest: int, param: str | None = None
    ) -> UnsettledInputError:
        end = "last" if reading.from_end else "first"
        return UnsettledInputError(
            f"{where} is {len(reading.text)} characters long and its {end} {widest} characters, "
            "the most the server tokenizes of one input, hold only "
            f"{reading.settled} tokens that the rest of the text cannot change, not the "
            f"{max(keep, 1)} it needs: a word thousands of characters long runs across that "
            f"point. Send at most {widest} characters of this text, or break up that word.",
            param=param or where.split("[", 1)[0],
        )

    def encode_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        *,
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
        a pair it is in cannot be decided (:meth:`_pair_keeps`). ``max_total`` as for
        :meth:`encode`."""
        limit = self._limit(truncation)
        special = self.num_pair_special
        first, widest = self.windows(limit)
        from_end = truncation.side == "left"
        tally = _Tally(max_total, "input")
        readings: dict[int, _Reading] = {}

        def reading_of(text: str) -> _Reading:
            found = readings.get(id(text))
            if found is None:
                found = readings[id(text)] = _Reading(text, first, from_end)
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
                self._read([r for i in pending for r in both[i]])
                undecided: list[int] = []
                widen: dict[int, _Reading] = {}
                for i in pending:
                    a, b = both[i]
                    keeps = self._pair_keeps(a, b, limit, special, truncation, i)
                    if keeps is None:
                        for r in (a, b):
                            if not r.whole:
                                widen[id(r)] = r
                        undecided.append(i)
                        continue
                    fitted = self._fit_pair(a, b, keeps, limit, special, truncation, i)
                    tally.add(len(fitted.ids))
                    out[i] = fitted
                for r in widen.values():
                    if not r.widen(widest):
                        i = next(i for i in undecided if r in both[i])
                        raise self._unsettled(f"pair {i}", r, 1, widest, truncation.param)
                pending = undecided
        return [x for x in out if x is not None]

    def _pair_keeps(
        self,
        a: _Reading,
        b: _Reading,
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
                raise self._pair_too_long(index, n, limit, truncation, at_least=False)
            return longest_first(len(a.enc), len(b.enc), budget)
        if truncation.side is None:
            lower = a.settled + b.settled + special
            if lower > limit:
                raise self._pair_too_long(index, lower, limit, truncation, at_least=True)
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

    def _pair_too_long(
        self, index: int, n: int, limit: int, truncation: Truncation, *, at_least: bool
    ) -> InputTooLongError:
        return InputTooLongError(
            f"pair {index} has {'at least ' if at_least else ''}{n} tokens, more than the "
            f"maximum of {limit}; shorten it or ask for truncation",
            param=truncation.param,
            token_count=n,
            max_tokens=limit,
        )

    def _fit_pair(
        self,
        a: _Reading,
        b: _Reading,
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
        enc = self._tok.post_process(encodings[0], encodings[1], add_special_tokens=True)
        types = list(enc.type_ids)
        return TokenizedInput(list(enc.ids), n, 0, types if any(types) else None)

    def _limit(self, truncation: Truncation) -> int:
        if truncation.max_tokens is None:
            return self.max_length
        if truncation.max_tokens > self.max_length:
            raise InvalidRequestError(
                f"{truncation.param}={truncation.max_tokens} exceeds the model's maximum "
                f"input length of {self.max_length} tokens",
                param=truncation.param,
            )
        return truncation.max_tokens

    def _fit_clipped(
        self,
        reading: _Reading,
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
            raise self._no_room(limit, len(prefix) + len(suffix), truncation)
        if reading.from_end:
            return TokenizedInput(prefix + content[len(content) - keep :] + suffix, at_least, 0)
        return TokenizedInput(
            prefix + content[:keep] + suffix, at_least, min(prompt_len, len(prefix) + keep)
        )

    @staticmethod
    def _no_room(limit: int, specials: int, truncation: Truncation) -> InvalidRequestError:
        return InvalidRequestError(
            f"{truncation.param}={limit} leaves no room for content after the "
            f"{specials} special tokens",
            param=truncation.param,
        )

    def _fit_encoding(
        self,
        enc: Encoding,
        prefix: list[int],
        suffix: list[int],
        limit: int,
        truncation: Truncation,
        index: int,
        param: str,
        prompt_len: int,
    ) -> TokenizedInput:
        content = enc.ids
        return self._fit(
            content,
            prefix + content + suffix,
            [prefix, suffix],
            limit,
            truncation,
            index,
            param,
            prompt_len,
        )

    def _fit(
        self,
        content: list[int],
        full: list[int],
        affixes: list[list[int]],
        limit: int,
        truncation: Truncation,
        index: int,
        param: str,
        prompt_len: int,
    ) -> TokenizedInput:
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
            raise self._no_room(limit, len(prefix) + len(suffix), truncation)
        kept = content[:keep] if truncation.side == "right" else content[len(content) - keep :]
        if truncation.side == "left":
            prompt_len = 0  # the prompt was cut off with the start of the text
        return TokenizedInput(prefix + kept + suffix, n, min(prompt_len, len(prefix) + keep))


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


def _settled_tokens(word_ids: Sequence[int | None], *, from_end: bool) -> int:
    """How many tokens of a clipped text the text beyond the cut cannot change: all but
    those of the word at the cut (the last word, or the first when the start was cut off).
    A token outside any word (an added token) next to the cut counts as part of it, and so
    does the word beside it."""
    words = list(reversed(word_ids)) if from_end else list(word_ids)
    n = len(words)
    end = n
    for _ in range(2):
        if end == 0:
            return 0
        cut_word = words[end - 1]
        while end > 0 and words[end - 1] == cut_word:
            end -= 1
        if cut_word is not None:
            break
    return end


def _special_affixes(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the post-processor puts before and after a single sequence
    (:func:`~embedding_server.request.special_tokens.affixes`: BERT's [CLS] x [SEP], RoBERTa's
    <s> x </s>, Llama's <s> x, Qwen's x or x <|endoftext|>)."""
    found = affixes(tokenizer)
    if found is not None:
        return found
    logger.warning(
        "could not locate the special-token template of the tokenizer; inputs get no special tokens"
    )
    return [], []


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

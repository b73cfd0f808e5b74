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

A text far longer than the model can use is clipped to :data:`CLIP_CHARS_PER_TOKEN` characters
per allowed token before the tokenizer sees it, so a megabyte of text costs what a few
thousand characters cost. Clipping never changes a result: the tokenizer splits text into
words before it cuts words into tokens, so every token of a clipped text except those of the
word at the cut is a token of the full text. When those tokens are more than the input may
keep, the full text is over-long and its truncation is exactly theirs; otherwise (a text
that fits, or one made of a few giant words) the full text is tokenized as before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tokenizers import Encoding, Tokenizer

from .errors import InputTooLongError, InvalidRequestError

logger = logging.getLogger(__name__)

CLIP_CHARS_PER_TOKEN = 8
"""Characters kept per allowed token when clipping an over-long text. Natural text averages
3-5 characters per token in every tokenizer we serve, so the kept part nearly always holds
more than the allowed tokens; when it does not, the full text is tokenized (see above)."""

ESTIMATE_CHARS_PER_TOKEN = 4
"""Characters per token assumed when reserving queue room for a text before tokenizing it."""

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
    """The model's named prompts and the one applied when a request names none."""

    table: Mapping[str, str]
    default_name: str | None = None

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

    @property
    def truncated(self) -> bool:
        return self.original_length > len(self.ids)


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
        self.clip_chars = CLIP_CHARS_PER_TOKEN * max_length
        self._prefix, self._suffix = _special_affixes(tokenizer)
        self.num_special = len(self._prefix) + len(self._suffix)

    @property
    def backend(self) -> Tokenizer:
        return self._tok

    def tokenize(
        self, texts: str | Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each text, untruncated (the ``/tokenize`` endpoint)."""
        items = [texts] if isinstance(texts, str) else list(texts)
        if not items:
            raise InvalidRequestError("no texts given to tokenize", param="input")
        for i, text in enumerate(items):
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"input[{i}] must be a string, got {type(text).__name__}", param="input"
                )
        encodings = self._tok.encode_batch_fast(items, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

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
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < bound:
                raise InvalidRequestError(
                    f"token ids must be integers in [0, {bound}); got {token!r}", param=param
                )

    def admission_estimate(
        self, inputs: Sequence[TextInput], truncation: Truncation, prompt: str | None
    ) -> tuple[int, int]:
        """What a request will hold, known before tokenizing it: ``(floor, estimate)``.

        ``floor`` never exceeds the tokens the request will hold (token-id inputs are
        counted exactly, at most the limit each; a text counts one token), so a request
        whose floor is already too big can be refused at once. ``estimate`` guesses the
        texts from their length (:data:`ESTIMATE_CHARS_PER_TOKEN`), to reserve queue room
        while they are tokenized.
        """
        limit = min(self.max_length, truncation.max_tokens or self.max_length)
        extra = len(prompt or "")
        floor = estimate = 0
        for item in inputs:
            if isinstance(item, str):
                guess = -(-(len(item) + extra) // ESTIMATE_CHARS_PER_TOKEN) + self.num_special
                floor += 1
                estimate += min(limit, guess)
            else:
                exact = min(limit, len(item))
                floor += exact
                estimate += exact
        return floor, estimate

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
    ) -> list[TokenizedInput]:
        """Tokenize and truncate one request's inputs in one batched call (two when a
        clipped text has to be tokenized in full after all)."""
        limit = self._limit(truncation)
        prefix = self._prefix if add_special_tokens else []
        suffix = self._suffix if add_special_tokens else []
        prompt_len = self.prompt_length(prompt or "", add_special_tokens=add_special_tokens)
        out: list[TokenizedInput | None] = [None] * len(inputs)
        texts: list[str] = []
        text_slots: list[int] = []
        clipped_at: dict[int, str] = {}  # slot -> the side its text was clipped on
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                text_slots.append(i)
                if len(item) <= self.clip_chars:
                    texts.append((prompt or "") + item)
                elif truncation.side == "left":
                    clipped_at[i] = "left"  # the prompt would be cut off: leave it out
                    texts.append(item[-self.clip_chars :])
                else:
                    clipped_at[i] = "right"
                    texts.append((prompt or "") + item[: self.clip_chars])
            else:
                ids = list(item)
                where = f"{param}[{i}]" if len(inputs) > 1 else param
                self.check_ids(ids, where, self.input_id_limit)
                out[i] = self._fit(ids, ids, [], limit, truncation, i, param, 0)
        if not texts:
            return [x for x in out if x is not None]
        encodings = self._encode_texts(
            texts, [k for k, slot in enumerate(text_slots) if slot in clipped_at]
        )
        unsettled: list[int] = []
        for slot, enc in zip(text_slots, encodings, strict=True):
            side = clipped_at.get(slot)
            if side is None:
                out[slot] = self._fit_encoding(
                    enc, prefix, suffix, limit, truncation, slot, param, prompt_len
                )
                continue
            fitted = self._fit_clipped(
                enc, side, prefix, suffix, limit, truncation, slot, param, prompt_len
            )
            if fitted is None:
                unsettled.append(slot)
            out[slot] = fitted
        if unsettled:
            full = [(prompt or "") + str(inputs[slot]) for slot in unsettled]
            for slot, enc in zip(
                unsettled, self._tok.encode_batch_fast(full, add_special_tokens=False), strict=True
            ):
                out[slot] = self._fit_encoding(
                    enc, prefix, suffix, limit, truncation, slot, param, prompt_len
                )
        return [x for x in out if x is not None]

    def _encode_texts(self, texts: list[str], need_words: Sequence[int]) -> list[Encoding]:
        """Encodings of ``texts`` (no special tokens). Only the clipped texts, at positions
        ``need_words``, need word ids (:meth:`_fit_clipped`); the rest skip the offset and
        word bookkeeping (``encode_batch_fast``, measurably cheaper per text)."""
        if not need_words:
            return self._tok.encode_batch_fast(texts, add_special_tokens=False)
        words = set(need_words)
        plain = [k for k in range(len(texts)) if k not in words]
        out: list[Encoding | None] = [None] * len(texts)
        full = self._tok.encode_batch([texts[k] for k in need_words], add_special_tokens=False)
        for k, enc in zip(need_words, full, strict=True):
            out[k] = enc
        if plain:
            fast = self._tok.encode_batch_fast([texts[k] for k in plain], add_special_tokens=False)
            for k, enc in zip(plain, fast, strict=True):
                out[k] = enc
        return [enc for enc in out if enc is not None]

    def encode_pairs(
        self, pairs: Sequence[tuple[str, str]], *, truncation: Truncation
    ) -> list[TokenizedInput]:
        """Tokenize sentence pairs as one sequence each, the way a cross-encoder reads them:
        the tokenizer's pair template (``[CLS] a [SEP] b [SEP]`` with segment ids for BERT,
        ``<s> a </s></s> b </s>`` for RoBERTa) around both texts, over-long pairs cut
        longest-first (one token at a time from the longer text), as transformers'
        ``truncation=True`` does.

        As for single texts, a text longer than ``clip_chars`` is clipped before the
        tokenizer sees it, and tokenized in full only when the clipped part cannot decide the
        result (:meth:`_clipped_pair_settles`)."""
        limit = self._limit(truncation)
        special = self._tok.num_special_tokens_to_add(True)
        from_end = truncation.side == "left"

        def clip(text: str) -> str:
            if len(text) <= self.clip_chars:
                return text
            return text[-self.clip_chars :] if from_end else text[: self.clip_chars]

        firsts = self._tok.encode_batch([clip(a) for a, _ in pairs], add_special_tokens=False)
        seconds = self._tok.encode_batch([clip(b) for _, b in pairs], add_special_tokens=False)
        out: list[TokenizedInput] = []
        for i, ((a, b), first, second) in enumerate(zip(pairs, firsts, seconds, strict=True)):
            clipped = (len(a) > self.clip_chars, len(b) > self.clip_chars)
            n = len(first) + len(second) + special
            if not any(clipped):
                settles = True
            elif truncation.side is None:  # refused below when over the limit even clipped
                settles = n > limit
            else:
                settles = self._clipped_pair_settles(
                    first, second, clipped, limit - special, from_end=from_end
                )
            if not settles:
                first, second = self._tok.encode_batch([a, b], add_special_tokens=False)
                clipped = (False, False)
                n = len(first) + len(second) + special
            if n > limit:
                if truncation.side is None:
                    at_least = "at least " if any(clipped) else ""
                    raise InputTooLongError(
                        f"pair {i} has {at_least}{n} tokens, more than the maximum of {limit}; "
                        "shorten it or ask for truncation",
                        param=truncation.param,
                        token_count=n,
                        max_tokens=limit,
                    )
                keep_first, keep_second = longest_first(len(first), len(second), limit - special)
                if min(keep_first, keep_second) == 0:
                    raise InvalidRequestError(
                        f"pair {i} cannot be cut to {limit} tokens without dropping one of "
                        "its texts",
                        param=truncation.param,
                    )
                first.truncate(keep_first, direction=truncation.side or "right")
                second.truncate(keep_second, direction=truncation.side or "right")
            enc = self._tok.post_process(first, second, add_special_tokens=True)
            types = list(enc.type_ids)
            out.append(TokenizedInput(list(enc.ids), n, 0, types if any(types) else None))
        return out

    @staticmethod
    def _clipped_pair_settles(
        first: Encoding,
        second: Encoding,
        clipped: tuple[bool, bool],
        budget: int,
        *,
        from_end: bool,
    ) -> bool:
        """Whether a pair with one clipped text is cut exactly as its full texts would be.

        Longest-first keeps of the longer text an amount that depends only on the shorter
        text and the budget, so a clipped text that is still the strictly longer one, in a
        pair over budget, keeps the same number of tokens; those must be settled (not
        changed by the text beyond the cut, which is at the start with ``from_end``). Two
        clipped texts tie-break on their unknown full lengths, so they are tokenized in
        full."""
        if all(clipped):
            return False
        longer, shorter = (first, second) if clipped[0] else (second, first)
        if len(longer) <= len(shorter) or len(longer) + len(shorter) <= budget:
            return False
        keep = longest_first(len(first), len(second), budget)[0 if clipped[0] else 1]
        settled = _settled_tokens(longer.word_ids, from_end=from_end)
        return settled > keep

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
        enc: Encoding,
        side: str,
        prefix: list[int],
        suffix: list[int],
        limit: int,
        truncation: Truncation,
        index: int,
        param: str,
        prompt_len: int,
    ) -> TokenizedInput | None:
        """The input of a clipped text, when its settled tokens decide it; else None."""
        content = enc.ids
        keep = limit - len(prefix) - len(suffix)
        settled = _settled_tokens(enc.word_ids, from_end=side == "left")
        if keep <= 0 or settled <= keep:
            return None  # the full text decides (and _fit reports a limit with no room)
        at_least = len(prefix) + settled + len(suffix)
        if truncation.side is None:
            raise InputTooLongError(
                f"{param}[{index}] has more than {at_least - 1} tokens, more than the maximum "
                f"of {limit}; shorten it or ask for truncation",
                param=param,
                token_count=at_least,
                max_tokens=limit,
            )
        if side == "left":
            return TokenizedInput(prefix + content[len(content) - keep :] + suffix, at_least, 0)
        return TokenizedInput(
            prefix + content[:keep] + suffix, at_least, min(prompt_len, len(prefix) + keep)
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
            raise InvalidRequestError(
                f"{truncation.param}={limit} leaves no room for content after the "
                f"{len(prefix) + len(suffix)} special tokens",
                param=truncation.param,
            )
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
    """The special tokens the post-processor puts before and after a single sequence.

    Found by tokenizing a probe with and without special tokens; this covers BERT
    ([CLS] x [SEP]), RoBERTa (<s> x </s>), Llama (<s> x) and Qwen (x or x <|endoftext|>).
    """
    probe = "hello world"
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
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
    if all(_is_token(x) for x in items):
        return [items]
    out: list[TextInput] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"{param}[{i}] must not be an empty string", param=param)
            out.append(item)
        elif (
            isinstance(item, Sequence)
            and not isinstance(item, bytes | bytearray)
            and all(_is_token(x) for x in item)
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

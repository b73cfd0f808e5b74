"""Tokenization: :class:`TextTokenizer`, a fast tokenizer plus the model's limits, composed
of the request plane's tokenizing parts.

Tokenizing is the first stage of the pipeline and, for small encoders, often the most expensive
one on the request path, so it runs off the event loop: one batched call into the Rust fast
tokenizer (``tokenizers.Tokenizer.encode_batch_fast``, which releases the GIL) per request, in a
small thread pool owned by the engine.

The parts, each in its module:

* ``truncation.py``: the per-request truncation policy (:class:`~.truncation.Truncation`),
  an input as tokenized, and cutting it to the limit with its special tokens kept;
* ``windows.py``: reading a text longer than the model can use through windows, so a
  megabyte of text costs what a few thousand characters cost, without changing any result;
* ``pairs.py``: sentence pairs in the tokenizer's pair template, cut longest-first, each
  distinct text read once;
* ``prompts.py``: the model's named prompts, and yes/no rerankers' prompt templates;
* ``admission.py``: what a request will hold, known before it is tokenized;
* ``texts.py``: the validation of a request's inputs (texts or token ids);
* ``special_tokens.py``: the special tokens the tokenizer's post-processor puts around a text.

The tokens a whole request holds are counted as its inputs are read, so a request over its
limit is refused after reading at most that limit's worth of text
(:meth:`TextTokenizer.encode`'s ``max_total``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from embedding_server.errors import InvalidRequestError, TooManyTokensError
from embedding_server.request import estimates, prompts
from embedding_server.request import pairs as sentence_pairs
from embedding_server.request.estimates import AdmissionEstimate
from embedding_server.request.special_tokens import affixes
from embedding_server.request.texts import TextInput
from embedding_server.request.texts import check_ids as check_token_ids
from embedding_server.request.truncation import (
    Tally,
    TokenizedInput,
    Truncation,
    fit,
    fit_clipped,
    fit_encoding,
    limit_of,
)
from embedding_server.request.windows import (
    CLIP_CHARS_PER_TOKEN,
    MAX_CHARS_PER_TOKEN,
    MIN_WIDEST_CHARS,
    Reading,
    in_turns,
    read_windows,
    unsettled_error,
)

if TYPE_CHECKING:
    from embedding_server.request.heads import SegmentedPairTemplate, Size

logger = logging.getLogger(__name__)


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
            reading = Reading(text, first)
            while not reading.whole:
                read_windows(self._tok, [reading])
                at_least = reading.settled + specials
                if at_least > max_tokens:
                    raise self._too_many(where, f"at least {at_least}", max_tokens)
                if not reading.widen(widest):
                    raise unsettled_error(where, reading, max_tokens - specials, widest)
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
        check_token_ids(ids, param, self.vocab_size if limit is None else limit)

    def admission_estimate(
        self, inputs: Sequence[TextInput], truncation: Truncation, prompt: str | None
    ) -> AdmissionEstimate:
        """What a request will hold, known before tokenizing it
        (:func:`~.estimates.estimate_inputs`)."""
        limit = min(self.max_length, truncation.max_tokens or self.max_length)
        return estimates.estimate_inputs(
            inputs, limit=limit, num_special=self.num_special, prompt=prompt
        )

    def sized_estimate(self, sizes: Iterable[Size], truncation: Truncation) -> AdmissionEstimate:
        """:meth:`admission_estimate` of texts known by their sizes alone, without a prompt
        (:func:`~.estimates.estimate_sized`): pair prompts, which are not built to be
        measured."""
        limit = min(self.max_length, truncation.max_tokens or self.max_length)
        return estimates.estimate_sized(sizes, limit=limit, num_special=self.num_special)

    def pair_estimate(
        self, pairs: Sequence[tuple[str, str]], truncation: Truncation
    ) -> AdmissionEstimate:
        """:meth:`admission_estimate` of sentence pairs (:func:`~.estimates.estimate_pairs`)."""
        limit = min(self.max_length, truncation.max_tokens or self.max_length)
        return estimates.estimate_pairs(pairs, limit=limit, num_special=self.num_pair_special)

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
        start: int = 0,
        tally: Tally | None = None,
    ) -> list[TokenizedInput]:
        """Tokenize and truncate one request's inputs: each text read through windows
        (``windows.py``), all of a turn's texts in one batched call.

        ``max_total``: the most tokens the request may hold; once its inputs hold more, it
        is refused (:class:`TooManyTokensError`) without reading the rest. A request
        encoded in parts, a turn of its texts at a time (pair prompts, which are built as
        they are read: ``prompts.py``), passes each part's ``start`` (the index of
        ``inputs[0]`` in the request, for the errors naming an input) and the request's
        ``tally`` (its count so far, against its limit) instead of ``max_total``."""
        limit = limit_of(truncation, self.max_length)
        prefix = self._prefix if add_special_tokens else []
        suffix = self._suffix if add_special_tokens else []
        prompt_len = self.prompt_length(prompt or "", add_special_tokens=add_special_tokens)
        first, widest = self.windows(limit)
        from_end = truncation.side == "left"
        if tally is None:
            tally = Tally(max_total, param)
        out: list[TokenizedInput | None] = [None] * len(inputs)
        slots: dict[int, int] = {}  # id(reading) -> its input's index in inputs
        readings: list[Reading] = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                # A prompt read from the end would be cut off: it joins only a whole text.
                reading = Reading(item, first, from_end, prompt or "")
                slots[id(reading)] = i
                readings.append(reading)
            else:
                ids = list(item)
                where = f"{param}[{start + i}]" if len(inputs) > 1 or start else param
                self.check_ids(ids, where, self.input_id_limit)
                fitted = fit(ids, ids, [], limit, truncation, start + i, param, 0)
                tally.add(len(fitted.ids))
                out[i] = fitted
        for turn in in_turns(readings):
            pending = turn
            while pending:
                read_windows(self._tok, pending)
                unsettled: list[Reading] = []
                for reading in pending:
                    slot = slots[id(reading)]
                    index = start + slot  # in the request
                    if reading.whole:
                        assert reading.enc is not None
                        fitted = fit_encoding(
                            reading.enc, prefix, suffix, limit, truncation, index, param, prompt_len
                        )
                    else:
                        unfit = fit_clipped(
                            reading, prefix, suffix, limit, truncation, index, param, prompt_len
                        )
                        if unfit is None:
                            if not reading.widen(widest):
                                keep = limit - len(prefix) - len(suffix)
                                raise unsettled_error(f"{param}[{index}]", reading, keep, widest)
                            unsettled.append(reading)
                            continue
                        fitted = unfit
                    tally.add(len(fitted.ids))
                    out[slot] = fitted
                pending = unsettled
        return [x for x in out if x is not None]

    def encode_segmented(
        self,
        pairs: Sequence[tuple[str, str]],
        template: SegmentedPairTemplate,
        *,
        instruction: str | None,
        truncation: Truncation,
        max_total: int | None = None,
    ) -> list[TokenizedInput]:
        """A yes/no reranker's pairs laid out by ``template``
        (:func:`~.prompts.encode_segmented`)."""
        return prompts.encode_segmented(
            self,
            pairs,
            template,
            instruction=instruction,
            truncation=truncation,
            max_total=max_total,
        )

    def encode_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        *,
        truncation: Truncation,
        max_total: int | None = None,
    ) -> list[TokenizedInput]:
        """Tokenize sentence pairs as one sequence each, the way a cross-encoder reads them
        (:func:`~.pairs.encode_pairs`); ``max_total`` as for :meth:`encode`."""
        limit = limit_of(truncation, self.max_length)
        return sentence_pairs.encode_pairs(
            self._tok,
            pairs,
            limit=limit,
            special=self.num_pair_special,
            windows=self.windows(limit),
            truncation=truncation,
            max_total=max_total,
        )


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

"""Prompts: the model's named prompts (sentence-transformers' ``prompts``, prepended to text
inputs), resolved per request (:class:`Prompts`), and the prompt templates of pairs, which
lay a pair out in a prompt around the tokens of its texts (:class:`PromptedPairs`,
:func:`encode_segmented`) on top of a tokenizer's ``encode``.

A rerank request's query is in the prompt of every one of its pairs, so a pair's prompt is
never built before admission, nor whole: its size is known from its parts'
(:meth:`PromptedPairs.admission`, :meth:`SegmentedPairTemplate.query_size
<embedding_server.request.heads.SegmentedPairTemplate.query_size>`), and it is built when it
is tokenized (in the tokenizer's threads unless the job is small), a turn of pairs at a
time, from its parts cut to what reading it can use (:meth:`PromptedPairs.tokenize`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tokenizers import Tokenizer

from embedding_server.errors import InputTooLongError, InvalidRequestError
from embedding_server.request.heads import PairPrompt, PairTemplate, Size
from embedding_server.request.texts import TextInput
from embedding_server.request.truncation import (
    Tally,
    TokenizedInput,
    Truncation,
    limit_of,
    no_room,
)
from embedding_server.request.windows import READ_CHARS_PER_CALL

if TYPE_CHECKING:
    from embedding_server.request.heads import SegmentedPairTemplate


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


class Encoder(Protocol):
    """What the prompt templates need of a tokenizer (``TextTokenizer``)."""

    max_length: int

    @property
    def backend(self) -> Tokenizer: ...

    def windows(self, limit: int) -> tuple[int, int]: ...

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
    ) -> list[TokenizedInput]: ...


LEFT_CUTS_THE_PROMPT = (
    "truncate='left' would cut a yes/no reranker's prompt; use 'right' (the document's end "
    "is cut) or refuse over-long pairs"
)


@dataclass(frozen=True)
class PromptedPairs:
    """Sentence pairs, each read as one text of a prompt: a yes/no reranker's
    (:class:`~.heads.PairTemplate`, its suffix tokenized apart and never cut) or the one text
    a cross-encoder's authors make of a pair (:class:`~.heads.PairPrompt`).

    The query of a rerank request is in every pair's prompt, so the prompts are never built
    whole, nor before the job is admitted: admission reads their sizes from their parts'
    (:meth:`sizes`), and they are built when the job is tokenized (:meth:`tokenize`,
    in the tokenizer's threads unless the job is small), a turn of reading at a time, each
    from its parts cut to one character more than the widest window that reads it
    (:meth:`text`). The tokenizer never reads more of a text than that window
    (``windows.py``), so such a prompt tokenizes exactly as the whole one: the two agree on
    every character a window takes, and either they are equal or both are longer than the
    widest window (neither is read whole)."""

    pairs: Sequence[tuple[str, str]]
    template: PairTemplate | PairPrompt
    instruction: str | None = None
    """A yes/no reranker's instruction (the request's ``prompt``; None: the template's)."""

    def sizes(self, *, suffix: bool = False) -> Iterator[Size]:
        """Each pair's prompt's :data:`~.heads.Size`, from its parts': nothing is built.
        With ``suffix``, a yes/no reranker's suffix is counted in it, as admission charges
        it (``TextTokenizer.sized_estimate``)."""
        template = self.template
        if isinstance(template, PairPrompt):
            for query, document in self.pairs:
                yield template.size(query, document)
            return
        tail, tail_ascii = (
            (len(template.suffix), template.suffix.isascii()) if suffix else (0, True)
        )
        for query, document in self.pairs:
            chars, ascii = template.size(query, document, self.instruction)
            yield chars + tail, ascii and tail_ascii

    def chars(self) -> int:
        """The characters the pairs' prompts hold (a yes/no reranker's suffixes aside)."""
        return sum(chars for chars, _ in self.sizes())

    def tokenize(
        self, tokenizer: Encoder, truncation: Truncation, max_total: int | None = None
    ) -> list[TokenizedInput]:
        """Each pair's prompt tokenized. A yes/no reranker's is tokenized without special
        tokens, then its suffix's tokens, which truncation never cuts: its text keeps at most
        the limit less the suffix, from its start (its model card's code truncates the same
        way; left truncation would cut the prompt's instructions, so it is refused). A
        cross-encoder's is tokenized as any single text."""
        template = self.template
        if isinstance(template, PairPrompt):
            tally = Tally(max_total, "input")
            return self._encode(tokenizer, truncation, tally, add_special_tokens=True)
        if truncation.side == "left":
            raise InvalidRequestError(LEFT_CUTS_THE_PROMPT, param=truncation.param)
        tail = tokenizer.backend.encode(template.suffix, add_special_tokens=False).ids
        limit = limit_of(truncation, tokenizer.max_length)
        room = limit - len(tail)
        if room < 1:
            raise no_room(limit, len(tail), truncation)
        body = Truncation(truncation.side, room, truncation.param)
        # Every pair's suffix is charged at once: the bodies may hold the rest.
        most = None if max_total is None else max(0, max_total - len(tail) * len(self.pairs))
        bodies = self._encode(tokenizer, body, Tally(most, "input"), add_special_tokens=False)
        return [
            TokenizedInput(b.ids + tail, b.original_length + len(tail), b.prompt_length)
            for b in bodies
        ]

    def _encode(
        self, tokenizer: Encoder, truncation: Truncation, tally: Tally, *, add_special_tokens: bool
    ) -> list[TokenizedInput]:
        """The prompts tokenized under ``truncation``, built a turn of ``encode``'s reading
        at a time (the same turns, by the same sizes, as one call would read in), so that one
        turn's prompts are held at once, each cut to what its reading can use."""
        first, widest = tokenizer.windows(limit_of(truncation, tokenizer.max_length))
        keep = widest + 1
        from_end = truncation.side == "left"
        sizes = [chars for chars, _ in self.sizes()]
        out: list[TokenizedInput] = []
        start = 0
        while start < len(sizes):
            stop, read = start, 0
            while stop < len(sizes) and (
                stop == start or read + min(sizes[stop], first) <= READ_CHARS_PER_CALL
            ):
                read += min(sizes[stop], first)
                stop += 1
            texts = [self.text(i, keep, from_end) for i in range(start, stop)]
            out += tokenizer.encode(
                texts,
                truncation=truncation,
                add_special_tokens=add_special_tokens,
                param="input",
                start=start,
                tally=tally,
            )
            start = stop
        return out

    def text(self, index: int, keep: int, from_end: bool = False) -> str:
        """Pair ``index``'s prompt cut to its first ``keep`` characters (its last ones
        ``from_end``), built from its parts cut alike, so that no more than ``keep``
        characters of any part are copied: whatever was cut of a part lies beyond the
        prompt's first (last) ``keep`` characters."""

        def cut(text: str) -> str:
            return text[-keep:] if from_end else text[:keep]

        query, document = self.pairs[index]
        template = self.template
        if isinstance(template, PairPrompt):
            prompt = template.format(cut(query), cut(document))
        else:
            given = template.instruction if self.instruction is None else self.instruction
            prompt = template.text(cut(query), cut(document), cut(given))
        return cut(prompt)


def encode_segmented(
    tokenizer: Encoder,
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
    ends, as the model's reference code cuts them. Each query and each document is built
    and read once, however many pairs it is in. ``truncate=False`` refuses a pair that
    would be cut; ``'left'`` is refused (it would cut the prompt's instructions), as
    :meth:`PromptedPairs.tokenize` does."""
    if truncation.side == "left":
        raise InvalidRequestError(LEFT_CUTS_THE_PROMPT, param=truncation.param)
    limit = limit_of(truncation, tokenizer.max_length)

    def ids(text: str) -> list[int]:
        return list(tokenizer.backend.encode(text, add_special_tokens=False).ids)

    head = [i for text in template.head for i in ids(text)]
    sep = ids(template.separator)
    tail = [i for text in template.tail_texts(instruction) for i in ids(text)]
    query_room = template.query_room(limit, len(head), len(tail))
    least_room = template.document_room(limit, len(head), len(sep), len(tail), query_room)
    if query_room < 1 or least_room < 1:
        raise no_room(limit, len(head) + len(sep) + len(tail), truncation)
    most_room = template.document_room(limit, len(head), len(sep), len(tail), 0)
    # Each text's segment is built once: a rerank's query is in every pair (the same
    # object), as is the one document of a /score of many queries against it; equal query
    # segments are read once.
    segments: dict[int, str] = {}
    for query, _ in pairs:
        if id(query) not in segments:
            segments[id(query)] = template.query_text(query, instruction)
    queries = list(dict.fromkeys(segments.values()))
    read_queries = tokenizer.encode(
        queries,
        truncation=Truncation("right", query_room, truncation.param),
        add_special_tokens=False,
    )
    read = dict(zip(queries, read_queries, strict=True))
    by_query = {key: read[segment] for key, segment in segments.items()}
    texts: dict[int, str] = {}
    for _, text in pairs:
        if id(text) not in texts:
            texts[id(text)] = template.document_text(text)
    read_documents = tokenizer.encode(
        list(texts.values()),
        truncation=Truncation("right", most_room, truncation.param),
        add_special_tokens=False,
    )
    by_document = dict(zip(texts, read_documents, strict=True))
    tally = Tally(max_total, "input")
    out: list[TokenizedInput] = []
    for i, (query, text) in enumerate(pairs):
        q, document = by_query[id(query)], by_document[id(text)]
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

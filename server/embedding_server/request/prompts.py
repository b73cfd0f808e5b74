"""Prompts: the model's named prompts (sentence-transformers' ``prompts``, prepended to text
inputs), resolved per request (:class:`Prompts`), and the prompt templates of yes/no
rerankers, which lay a pair out in a prompt around the tokens of its texts
(:func:`encode_suffixed`, :func:`encode_segmented`) on top of a tokenizer's ``encode``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tokenizers import Tokenizer

from embedding_server.errors import InputTooLongError, InvalidRequestError
from embedding_server.request.texts import TextInput
from embedding_server.request.truncation import (
    Tally,
    TokenizedInput,
    Truncation,
    limit_of,
    no_room,
)

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

    def encode(
        self,
        inputs: Sequence[TextInput],
        *,
        truncation: Truncation,
        add_special_tokens: bool = True,
        prompt: str | None = None,
        param: str = "input",
        max_total: int | None = None,
    ) -> list[TokenizedInput]: ...


def encode_suffixed(
    tokenizer: Encoder,
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
    tail = tokenizer.backend.encode(suffix, add_special_tokens=False).ids
    limit = limit_of(truncation, tokenizer.max_length)
    room = limit - len(tail)
    if room < 1:
        raise no_room(limit, len(tail), truncation)
    bodies = tokenizer.encode(
        texts,
        truncation=Truncation(truncation.side, room, truncation.param),
        add_special_tokens=False,
        param=param,
        max_total=None if max_total is None else max(0, max_total - len(tail) * len(texts)),
    )
    return [
        TokenizedInput(b.ids + tail, b.original_length + len(tail), b.prompt_length) for b in bodies
    ]


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
    ends, as the model's reference code cuts them. Each distinct query is read once.
    ``truncate=False`` refuses a pair that would be cut; ``'left'`` is refused (it would
    cut the prompt's instructions), as :func:`encode_suffixed` does."""
    if truncation.side == "left":
        raise InvalidRequestError(
            "truncate='left' would cut a yes/no reranker's prompt; use 'right' (the "
            "document's end is cut) or refuse over-long pairs",
            param=truncation.param,
        )
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
    queries = list(dict.fromkeys(template.query_text(q, instruction) for q, _ in pairs))
    read_queries = tokenizer.encode(
        queries,
        truncation=Truncation("right", query_room, truncation.param),
        add_special_tokens=False,
    )
    by_query = dict(zip(queries, read_queries, strict=True))
    documents = tokenizer.encode(
        [template.document_text(d) for _, d in pairs],
        truncation=Truncation("right", most_room, truncation.param),
        add_special_tokens=False,
    )
    tally = Tally(max_total, "input")
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

"""Listwise rerankers: one prompt holds a query and many documents, and one forward pass
scores them all (jina-reranker-v3's "last but not late interaction").

jinaai/jina-reranker-v3 is a causal Qwen3 body (``JinaForRanking``, custom code that is not
run) with a projector MLP. Its authors' ``modeling.py`` (which vLLM's ``JinaForRanking`` and
its ``jina-reranking-scoring`` IO processor reproduce) formats one prompt per block of
documents: a fixed system turn, "I will provide you with N passages ...", each document as
``<passage id="i">\\n{doc}<|embed_token|>\\n</passage>``, then the query as
``<query>\\n{query}<|rerank_token|>\\n</query>`` and the assistant turn with an empty think
block. The final hidden states at the ``<|embed_token|>`` positions (one per document) and at
the ``<|rerank_token|>`` position (the query) go through the projector
(``device/listwise.py``); a document's score is the cosine of its projection with the
query's. The marker strings are removed from every text first, so each block holds exactly
its documents' markers and one query marker.

The authors' ``rerank(query, documents)`` is what :class:`ListwiseJob` reproduces:

* the query is cut to :attr:`ListwiseFormat.max_query_tokens` tokens and each document to
  :attr:`ListwiseFormat.max_document_tokens`, each tokenized alone; a text that reaches its
  limit is replaced by the decoded text of its kept tokens;
* documents are taken in order into blocks of at most :attr:`ListwiseFormat.block_size`; a
  block closes once the room left in the window (less twice the query's tokens) after its
  documents is at most ``max_document_tokens``. Here the window is the served input limit
  (the tokenizer's ``model_max_length``, which the authors read, capped at the model's
  positions and ``--max-model-len``). A block whose prompt still does not fit the window
  (the prompt's own words are not counted by that rule) is split in two until it does;
* with one block the scores are the cosines. With several, the query's projections are
  averaged, each weighted by its block's best ``(1 + cosine) / 2``, and every document is
  scored against that average.

``/score`` pairs sides as vLLM's IO processor does: one query against many documents is one
list; equal numbers of queries and documents (or many queries against one document) are
each pair's own one-document list. Everything here runs per request, in numpy and the
tokenizer: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embedding_server.errors import InputTooLongError, InvalidRequestError, TooManyTokensError
from embedding_server.request.estimates import (
    LIKELY_CHARS_PER_TOKEN,
    AdmissionEstimate,
    token_bound,
)
from embedding_server.request.pooling import FloatArray
from embedding_server.request.tokenization import TextTokenizer
from embedding_server.request.truncation import TokenizedInput, Truncation

PREFIX = (
    "<|im_start|>system\n"
    "You are a search relevance expert who can determine a ranking of the passages based on "
    "how relevant they are to the query. If the query is a question, how relevant a passage "
    "is depends on how well it answers the question. If not, try to analyze the intent of the "
    "query and assess how well each passage satisfies the intent. If an instruction is "
    "provided, you should follow the instruction when determining the ranking."
    "<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
"""The prompt's chat markers, which the tokenizer must hold as single tokens."""


@dataclass(frozen=True)
class ListwiseFormat:
    """How a listwise reranker's prompt is built and read (jina-reranker-v3's values)."""

    document_id: int
    """The vocabulary id of :attr:`document_token` (151670 in jina-reranker-v3)."""
    query_id: int
    """The vocabulary id of :attr:`query_token` (151671)."""
    width: int
    """The projector's output width (512)."""
    name: str = "jina-reranker-v3"
    document_token: str = "<|embed_token|>"
    query_token: str = "<|rerank_token|>"
    max_query_tokens: int = 512
    max_document_tokens: int = 2048
    block_size: int = 125
    """The most documents one prompt holds."""

    def sanitize(self, text: str) -> str:
        """``text`` without the marker strings (the authors' ``sanitize_input``)."""
        for token in (self.query_token, self.document_token):
            text = text.replace(token, "")
        return text

    def prompt(self, query: str, documents: Sequence[str], instruction: str | None) -> str:
        """The authors' ``format_docs_prompts_func`` (``no_thinking``): one block's prompt."""
        query = self.sanitize(query)
        text = (
            f"I will provide you with {len(documents)} passages, each indicated by a numerical "
            f"identifier. Rank the passages based on their relevance to query: {query}\n"
        )
        if instruction:
            text += f"<instruct>\n{self.sanitize(instruction)}\n</instruct>\n"
        passages = [
            f'<passage id="{i}">\n{self.sanitize(d)}{self.document_token}\n</passage>'
            for i, d in enumerate(documents)
        ]
        text += "\n".join(passages) + "\n"
        text += f"<query>\n{query}{self.query_token}\n</query>"
        return PREFIX + text + SUFFIX

    def blocks(self, lengths: Sequence[int], query_length: int, window: int) -> list[list[int]]:
        """The documents of each block, by index (the authors' ``get_all_blocks``)."""
        full = window - 2 * query_length
        out: list[list[int]] = []
        current: list[int] = []
        room = full
        for i, length in enumerate(lengths):
            current.append(i)
            room -= length
            if len(current) >= self.block_size or room <= self.max_document_tokens:
                out.append(current)
                current, room = [], full
        if current:
            out.append(current)
        return out

    def rows(self, states: FloatArray, ids: Sequence[int]) -> tuple[FloatArray, FloatArray]:
        """A block's document projections ``[n, width]`` (in prompt order) and its query's
        ``[width]``, from the projections of all its tokens."""
        tokens = np.asarray(ids)
        documents = np.flatnonzero(tokens == self.document_id)
        query = np.flatnonzero(tokens == self.query_id)
        if len(query) != 1:  # the texts were sanitized: never a user's doing
            raise RuntimeError(f"a {self.name} block holds {len(query)} query markers, not 1")
        return states[documents], states[query[0]]


def cosines(documents: npt.NDArray[np.float64], query: npt.NDArray[np.float64]) -> FloatArray:
    """The cosine of each row of ``documents`` with ``query``."""
    norms = np.linalg.norm(documents, axis=1) * np.linalg.norm(query)
    out: FloatArray = (documents @ query / np.maximum(norms, 1e-8)).astype(np.float32)
    return out


def merge(blocks: Sequence[tuple[FloatArray, FloatArray]]) -> FloatArray:
    """One list's scores from its blocks' (documents, query) projections, as the authors'
    ``rerank`` merges them (see the module docstring); float64 inside."""
    documents = np.concatenate([d for d, _ in blocks]).astype(np.float64)
    queries = np.stack([q for _, q in blocks]).astype(np.float64)
    if len(blocks) == 1:
        return cosines(documents, queries[0])
    weights = np.array(
        [
            ((1.0 + cosines(d.astype(np.float64), q.astype(np.float64))) / 2.0).max()
            for d, q in blocks
        ]
    )
    if weights.sum() <= 0:  # every block's best cosine is -1: nothing to weigh them by
        weights = np.ones_like(weights)
    return cosines(documents, np.average(queries, axis=0, weights=weights))


@dataclass(frozen=True)
class ListwiseJob:
    """The lists of one request (each a query and its documents), tokenized into blocks."""

    lists: list[tuple[str, list[str]]]
    format: ListwiseFormat
    instruction: str | None

    @classmethod
    def of_sides(
        cls,
        queries: Sequence[str],
        documents: Sequence[str],
        fmt: ListwiseFormat,
        instruction: str | None,
    ) -> ListwiseJob:
        """The lists of a ``/score`` request (see the module docstring for the pairing)."""
        if len(queries) == 1:
            lists = [(queries[0], list(documents))]
        elif len(documents) == 1:
            lists = [(q, [documents[0]]) for q in queries]
        else:
            lists = [(q, [d]) for q, d in zip(queries, documents, strict=True)]
        return cls(lists, fmt, instruction)

    @property
    def sizes(self) -> list[int]:
        """The documents of each list, in order."""
        return [len(docs) for _, docs in self.lists]

    def chars(self) -> int:
        """The characters its texts hold (each list's query once per list)."""
        return sum(len(q) + sum(len(d) for d in docs) for q, docs in self.lists)

    def admission(self, tokenizer: TextTokenizer) -> AdmissionEstimate:
        """What it will hold, from its texts' sizes: at least a token a list; at most every
        document in a block of its own, each block repeating the fixed words and the query."""
        fmt = self.format
        fixed = token_bound(fmt.prompt("", [], self.instruction)) + tokenizer.num_special
        per_document = token_bound(fmt.prompt("", [""], None)) - token_bound(
            fmt.prompt("", [], None)
        )
        floor = likely = bound = 0
        for query, documents in self.lists:
            repeated = fixed + 2 * min(token_bound(query), fmt.max_query_tokens)
            texts = sum(min(token_bound(d), fmt.max_document_tokens) for d in documents)
            most = texts + len(documents) * (per_document + repeated)
            chars = len(PREFIX + SUFFIX) + 2 * len(query) + sum(len(d) for d in documents)
            floor += 1
            bound += most
            likely += min(most, -(-chars // LIKELY_CHARS_PER_TOKEN) + len(documents))
        return AdmissionEstimate(floor, likely, bound)

    def tokenize(
        self, tokenizer: TextTokenizer, truncation: Truncation, max_total: int | None
    ) -> list[TokenizedInput]:
        """Each list's blocks as sequences, in order (see the module docstring)."""
        if truncation.side == "left" or truncation.max_tokens is not None:
            raise InvalidRequestError(
                f"a {self.format.name} reranker cuts queries to {self.format.max_query_tokens} "
                f"tokens and documents to {self.format.max_document_tokens}, keeping their "
                "start, as its authors' code does: truncation may only be asked for at the "
                "end (or refused)",
                param=truncation.param,
            )
        window = tokenizer.max_length
        out: list[TokenizedInput] = []
        total = 0
        for query, documents in self.lists:
            for block in self._blocks(tokenizer, truncation, window, query, documents):
                total += len(block.ids)
                if max_total is not None and total > max_total:
                    raise TooManyTokensError(
                        f"this request's prompts hold at least {total} tokens; one request "
                        f"may hold at most {max_total} (max_request_tokens); split it into "
                        "smaller requests",
                        param="documents",
                    )
                out.append(block)
        return out

    def _cut(
        self,
        tokenizer: TextTokenizer,
        texts: list[str],
        limit: int,
        truncation: Truncation,
        what: str,
    ) -> tuple[list[str], list[int], int]:
        """``texts`` as the authors' ``_truncate_texts`` leaves them (decoded from their kept
        tokens where they reach ``limit``), their token counts, and the tokens cut; without
        truncation, a text over ``limit`` is refused, naming it."""
        limit = min(limit, tokenizer.max_length)
        encoded = tokenizer.encode(texts, truncation=Truncation("right", limit, truncation.param))
        if truncation.side is None:
            for i, enc in enumerate(encoded):
                if enc.truncated:
                    where = what if what == "query" else f"{what}[{i}]"
                    raise InputTooLongError(
                        f"{where} has more than {limit} tokens, the most {self.format.name} "
                        f"reads of a {what.rstrip('s')} (its authors' code cuts it there); "
                        "shorten it or ask for truncation",
                        param=what,
                        token_count=enc.original_length,
                        max_tokens=limit,
                    )
        kept: list[str] = []
        for text, enc in zip(texts, encoded, strict=True):
            reached = len(enc.ids) >= limit
            decoded = reached and tokenizer.detokenize(enc.ids, skip_special_tokens=False)
            kept.append(decoded if isinstance(decoded, str) else text)
        cut = sum(e.original_length - len(e.ids) for e in encoded)
        return kept, [len(e.ids) for e in encoded], cut

    def _blocks(
        self,
        tokenizer: TextTokenizer,
        truncation: Truncation,
        window: int,
        query: str,
        documents: list[str],
    ) -> list[TokenizedInput]:
        fmt = self.format
        (query_text,), (query_length,), query_cut = self._cut(
            tokenizer, [query], fmt.max_query_tokens, truncation, "query"
        )
        texts, lengths, cut = self._cut(
            tokenizer, documents, fmt.max_document_tokens, truncation, "documents"
        )
        pending = [[texts[i] for i in block] for block in fmt.blocks(lengths, query_length, window)]
        out: list[TokenizedInput] = []
        while pending:
            block = pending.pop(0)
            prompt = fmt.prompt(query_text, block, self.instruction)
            ids = tokenizer.backend.encode_batch_fast([prompt])[0].ids
            if len(ids) > window and len(block) > 1:
                half = len(block) // 2
                pending[:0] = [block[:half], block[half:]]
                continue
            if len(ids) > window:
                raise InputTooLongError(
                    f"a {fmt.name} prompt for one document holds {len(ids)} tokens, more than "
                    f"the {window} this server takes (its documents are cut to "
                    f"{fmt.max_document_tokens} tokens, its queries to {fmt.max_query_tokens}); "
                    "shorten the document or query, or serve a longer max_model_len",
                    param="documents",
                    token_count=len(ids),
                    max_tokens=window,
                )
            out.append(TokenizedInput(list(ids), len(ids)))
        if query_cut or cut:  # usage counts the list as truncated on its first block
            first = out[0]
            out[0] = TokenizedInput(first.ids, len(first.ids) + query_cut + cut)
        return out

    def scores(self, rows: Sequence[FloatArray], ids: Sequence[Sequence[int]]) -> FloatArray:
        """Every document's score, in request order, from each block's token projections."""
        fmt = self.format
        parts = [fmt.rows(r, i) for r, i in zip(rows, ids, strict=True)]
        out: list[FloatArray] = []
        at = 0
        for size in self.sizes:
            blocks: list[tuple[FloatArray, FloatArray]] = []
            held = 0
            while held < size:
                blocks.append(parts[at])
                held += len(parts[at][0])
                at += 1
            if held != size:  # markers are sanitized out of texts: never a user's doing
                raise RuntimeError(f"a {fmt.name} list of {size} documents read {held} markers")
            out.append(merge(blocks))
        return np.concatenate(out).astype(np.float32)

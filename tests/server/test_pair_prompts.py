"""Pairs read inside a prompt (yes/no rerankers, a cross-encoder's pair text) cost what the
request holds, not its query once per document (issue 48, H2).

A rerank's query is in the prompt of every one of its pairs. Those prompts used to be built
on the event loop when the job was made, and again, each with its suffix, to measure them
for admission: a 266 KiB body cost 1.5 GiB and held ``/health`` for 2.8 s. Now admission
reads the prompts' sizes from their parts', and the prompts are built when the job is
tokenized, a turn at a time, each from its parts cut to what the tokenizer can read of it:
the same tokens, and the same refusals, as the whole prompts give.

The memory figures are ``tracemalloc``'s (every Python allocation, on every thread), so
they do not depend on the machine's load.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import pytest
from embedding_server.errors import InvalidRequestError, QueueFullError, TooManyTokensError
from embedding_server.request.admission import Admission, Priority, Reservation
from embedding_server.request.estimates import AdmissionEstimate
from embedding_server.request.heads import (
    BGE_RERANKER_GEMMA,
    MXBAI_RERANK_V2,
    NEMOTRON_RERANK,
    QWEN3_RERANKER,
    PairPrompt,
    PairTemplate,
    SegmentedPairTemplate,
)
from embedding_server.request.jobs import Job, ThreadedRunner
from embedding_server.request.prompts import PromptedPairs
from embedding_server.request.scheduler import ScheduledOutput
from embedding_server.request.sequences import SequenceInput
from embedding_server.request.tasks.score import pairs_job
from embedding_server.request.tokenization import TextTokenizer
from embedding_server.request.truncation import TokenizedInput, Truncation
from tokenizers import Tokenizer

from tests.support.models import MINILM_DIR

T = TypeVar("T")
Template = PairTemplate | SegmentedPairTemplate | PairPrompt
TEMPLATES: list[Template] = [QWEN3_RERANKER, NEMOTRON_RERANK, MXBAI_RERANK_V2, BGE_RERANKER_GEMMA]

QUERY = "what is the meaning of this long question " * 6000  # 252 kB
DOCUMENTS = [f"document {i} about a question" for i in range(256)]
ONE_COPY_PER_PAIR = len(QUERY) * len(DOCUMENTS)
"""Bytes of one copy of the (ASCII) query per pair: 64 MiB. The old code built two."""


def minilm(max_length: int) -> TextTokenizer:
    return TextTokenizer(
        Tokenizer.from_file(str(MINILM_DIR / "tokenizer.json")), max_length=max_length
    )


def peak_bytes(work: Callable[[], T]) -> tuple[int, T]:
    """The most Python memory ``work`` held at once above what was held before it, and its
    result."""
    tracemalloc.start()
    try:
        result = work()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def whole_prompts_estimate(
    tokenizer: TextTokenizer, template: Template, pairs: Sequence[tuple[str, str]]
) -> AdmissionEstimate:
    """What admission charged when it measured the whole prompts (the old code, restated):
    the estimate from their sizes must stay the same."""
    truncation = Truncation("right")
    if isinstance(template, PairTemplate):
        texts = [template.text(q, d) + template.suffix for q, d in pairs]
    elif isinstance(template, PairPrompt):
        texts = [template.format(q, d) for q, d in pairs]
    else:
        fixed = "".join((*template.head, template.separator, *template.tail_texts(None)))
        texts = [fixed + template.query_text(q, None) + template.document_text(d) for q, d in pairs]
    return tokenizer.admission_estimate(list(texts), truncation, None)


class Queued(Exception):
    """The job's sequences reached the queue (the test stops there)."""


class Runner(ThreadedRunner):
    """The online runner before the scheduler: admission by the scheduler's rules on a queue
    that already holds ``queued`` tokens, tokenization in a real thread pool."""

    def __init__(self, tokenizer: TextTokenizer, pool: ThreadPoolExecutor, queued: int) -> None:
        super().__init__(tokenizer, loop=asyncio.get_running_loop(), tokenize_pool=pool)
        self.admission = Admission.of(16384, 8192)
        self.queued = queued
        self.charged: list[tuple[int, int, int]] = []
        self.offloaded = 0

    def _reserve(self, floor: int, estimate: int, bound: int, priority: Priority) -> Reservation:
        self.charged.append((floor, estimate, bound))
        return self.admission.reserve(
            floor, estimate, self.queued, 0.0, bound=bound, priority=priority
        )

    async def offload(self, work: Callable[[], Any]) -> Any:
        self.offloaded += 1
        return await super().offload(work)

    async def _submit(
        self, job: Job, sequences: list[SequenceInput], reservation: Reservation, priority: Priority
    ) -> ScheduledOutput:
        raise Queued


def rerank(template: Template, queued: int) -> tuple[Runner, BaseException | None]:
    """A rerank of QUERY against DOCUMENTS on ``template``, from the job being made to its
    admission and tokenization, as the server's event loop runs it."""
    tokenizer = minilm(128)
    pairs = [(QUERY, d) for d in DOCUMENTS]  # the query shared, as text_pairs makes them
    box: dict[str, Any] = {}

    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            runner = box["runner"] = Runner(tokenizer, pool, queued)
            try:
                await runner.run(pairs_job(pairs, {}, template))
            except (QueueFullError, TooManyTokensError, Queued) as error:
                box["error"] = error

    asyncio.run(run())
    return box["runner"], box.get("error")


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_a_long_query_is_charged_from_its_size_and_refused_before_any_prompt_is_built(
    template: Template,
) -> None:
    """A queue with room for little: the rerank gets its 429 on what its prompts would hold,
    reckoned from the query's and the documents' sizes, before any prompt is built (nothing
    near one copy of the query per document was allocated) or anything is tokenized."""
    peak, (runner, error) = peak_bytes(partial(rerank, template, 16000))
    assert isinstance(error, QueueFullError) and error.retry_after is not None
    assert runner.offloaded == 0  # refused before tokenization
    assert peak < 2**20, f"{peak / 2**20:.0f} MiB held before the refusal"
    # What was charged is what measuring the whole prompts charged: the estimate from the
    # parts' sizes is the same, pair for pair (checked on a few of the pairs, built here).
    tokenizer = minilm(128)
    few = [(QUERY, d) for d in DOCUMENTS[:4]]
    assert pairs_job(few, {}, template).admission(tokenizer) == whole_prompts_estimate(
        tokenizer, template, few
    )


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_a_long_query_admitted_is_tokenized_off_the_loop_without_a_copy_per_document(
    template: Template,
) -> None:
    """An empty queue admits it; it is tokenized in the tokenizer's threads (its prompts are
    far over what the event loop tokenizes itself) and refused there (413) once it holds more
    than one request may, having held a fraction of one copy of the query per document."""
    peak, (runner, error) = peak_bytes(partial(rerank, template, 0))
    assert isinstance(error, TooManyTokensError) and "max_request_tokens" in error.message
    assert runner.offloaded == 1 and len(runner.charged) == 1
    assert peak < ONE_COPY_PER_PAIR / 4, f"{peak / 2**20:.0f} MiB held"


PROSE = " ".join(f"word{i} and some-more text, é 日本" for i in range(3000))


def whole_prompts_tokenized(
    tokenizer: TextTokenizer,
    template: PairTemplate | PairPrompt,
    pairs: Sequence[tuple[str, str]],
    truncation: Truncation,
    instruction: str | None,
) -> list[TokenizedInput]:
    """The old code, restated: every pair's whole prompt built and tokenized in one call (a
    yes/no reranker's without special tokens, then its suffix's tokens, never cut)."""
    if isinstance(template, PairPrompt):
        texts = [template.format(q, d) for q, d in pairs]
        return tokenizer.encode(texts, truncation=truncation)
    tail = tokenizer.backend.encode(template.suffix, add_special_tokens=False).ids
    room = tokenizer.max_length - len(tail)
    texts = [template.text(q, d, instruction) for q, d in pairs]
    body = Truncation(truncation.side, room, truncation.param)
    bodies = tokenizer.encode(texts, truncation=body, add_special_tokens=False)
    return [TokenizedInput(b.ids + tail, b.original_length + len(tail)) for b in bodies]


def outcome(work: Callable[[], list[TokenizedInput]]) -> object:
    try:
        return [(t.ids, t.original_length, t.prompt_length) for t in work()]
    except InvalidRequestError as refused:
        return type(refused).__name__, refused.message, refused.param


class Recording(TextTokenizer):
    """MiniLM's tokenizer, remembering the longest text it was given to encode."""

    longest = 0

    def encode(self, inputs: Sequence[Any], **options: Any) -> list[TokenizedInput]:
        self.longest = max([self.longest, *(len(t) for t in inputs)])
        return super().encode(inputs, **options)


@pytest.mark.parametrize("template", [QWEN3_RERANKER, NEMOTRON_RERANK], ids=lambda t: t.name)
def test_prompts_built_from_cut_parts_tokenize_exactly_as_the_whole_prompts(
    template: PairTemplate | PairPrompt,
) -> None:
    """Every pair of queries and documents short, long, made of a word wider than the widest
    window or ending in one, on each truncation (and a long instruction): the same tokens,
    or the same refusal word for word, as the whole prompts; and no text the tokenizer is
    given is longer than the widest window and one character."""
    tokenizer = Recording(Tokenizer.from_file(str(MINILM_DIR / "tokenizer.json")), max_length=32)
    _, widest = tokenizer.windows(32)
    texts = [
        "cats",
        PROSE,
        PROSE[::-1],
        "x" * (widest + 10) + " a b",  # a word no window settles, in first place
        "a " * widest,
        "a " * 100 + "y" * (2 * widest),  # ending in one
    ]
    pairs = [(q, d) for q in texts for d in texts]
    sides = ["right", None] + (["left"] if isinstance(template, PairPrompt) else [])
    instructions = [None, "judge " * 4000] if isinstance(template, PairTemplate) else [None]
    for side in sides:
        truncation = Truncation(side)  # type: ignore[arg-type]
        for instruction in instructions:
            prompted = PromptedPairs(pairs, template, instruction)
            got = outcome(partial(prompted.tokenize, tokenizer, truncation))
            whole = partial(whole_prompts_tokenized, tokenizer, template, pairs, truncation)
            assert got == outcome(partial(whole, instruction)), (side, instruction is None)
    tokenizer.longest = 0
    for side in sides:
        truncation = Truncation(side)  # type: ignore[arg-type]
        outcome(partial(PromptedPairs(pairs, template).tokenize, tokenizer, truncation))
    assert 0 < tokenizer.longest <= widest + 1

"""Jobs: a request prepared once, and the two ways to run one.

Each task (:mod:`.tasks`) turns its request into a :class:`Job` (inputs checked, prompt and
truncation resolved: :meth:`Job.prepare`, or the task's own job shape: sentence pairs, a
ColBERT side, a listwise prompt) before any work starts, then hands it to a
:class:`JobRunner`:

* :class:`ScheduledRunner`, inside the server's event loop: tokenization in the engine's
  thread pool, then the continuous-batching :class:`~.scheduler.Scheduler`;
* :class:`DirectRunner`, the offline bulk path used before ``start()``: tokenization and
  length-sorted, budgeted batches on the calling thread, no admission queue.

Both have the same async interface, so a task has one code path whichever runs it. The
direct runner never suspends, which is what lets the engine's sync methods drive an async
method to completion on the calling thread (:func:`run_inline`) without an event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, TypeVar

import numpy as np

from embedding_server.errors import (
    InputTooLongError,
    InvalidRequestError,
    OutputTooLargeError,
    TooManyTokensError,
)
from embedding_server.request.admission import Priority, Reservation
from embedding_server.request.colbert import ColbertFormat, Side
from embedding_server.request.estimates import AdmissionEstimate
from embedding_server.request.heads import SegmentedPairTemplate, Size
from embedding_server.request.listwise import ListwiseJob
from embedding_server.request.media.preprocessing import ImageInput
from embedding_server.request.pooling import FloatArray
from embedding_server.request.prompts import PromptedPairs, Prompts
from embedding_server.request.results import JobOutput, StageTimings
from embedding_server.request.scheduler import BatchRunner, ScheduledOutput, Scheduler
from embedding_server.request.sequences import SequenceInput
from embedding_server.request.texts import TextInput
from embedding_server.request.tokenization import TextTokenizer
from embedding_server.request.tracing import current_trace
from embedding_server.request.truncation import TokenizedInput, Truncation, TruncationArg

T = TypeVar("T")

JobItem = TextInput | ImageInput
"""One input of a job: a text, token ids, or a preprocessed image."""

INLINE_TOKENIZE_CHARS = 2048
"""Jobs whose texts (prompt included) and token ids come to this many characters or fewer
(8 KiB of UTF-8 at most) are tokenized on the event loop: less work than the hop to a
tokenizer thread and back costs on a busy core (``bench/frontend.py``;
docs/performance-log.md, "The tokenizer-thread hop for small jobs"). Decided by the inputs'
size, never by an estimate of their tokens: a long text can hold few tokens and still cost
the tokenizer its whole length to find that out."""

request_priority: ContextVar[Priority] = ContextVar("request_priority", default="interactive")
"""The priority of the request being served (the ``X-Priority`` header, which the HTTP layer
sets here for the whole request): a property of the request, not of one call, so every route
and every job a request runs (a rerank's, a score's) is admitted and batched in its class
without each route passing it on. The offline API serves ``interactive`` unless the caller
sets it (``request_priority.set("bulk")``) around its calls."""


class ScoreOptions(TypedDict, total=False):
    """Options every request type takes."""

    prompt: str | None
    """Text prepended to each text input (not with ``prompt_name``)."""
    prompt_name: str | None
    """One of the model's sentence-transformers prompts (default: the configured one)."""
    truncate: TruncationArg
    """True / "right" / "left" / a Truncation; False or None refuses over-long input."""
    adapter: str | None
    """One of the model's task LoRA adapters by name (jina-embeddings-v3's
    ``lora_adaptations``: retrieval.query, retrieval.passage, separation, classification,
    text-matching), with its prompt when the model has one of that name and the request
    gives none. Default: the adapter named like the prompt, else none (the base weights)."""


class TokenOptions(ScoreOptions, total=False):
    """Options of per-token embeddings (and, with ``EmbedOptions``, of pooled ones)."""

    add_special_tokens: bool
    """Add the tokenizer's special tokens around text inputs (default True)."""
    normalize: bool | None
    """L2-normalize each vector (per-token default: no; pooled: the server's setting)."""


@dataclass(frozen=True)
class Job:
    """One request, checked and resolved, ready to tokenize and run."""

    items: list[JobItem]
    """Texts, token ids, and images (:class:`~.imaging.ImageInput`, already preprocessed):
    an image becomes one sequence of placeholder ids, one per token of the vision tower,
    carrying its pixels; prompts, truncation and special tokens apply to texts only."""
    prompt: str | None
    truncation: Truncation
    add_special_tokens: bool = True
    want_tokens: bool = False
    max_token_rows: int | None = None
    """With ``want_tokens``: most token vectors the output may hold."""
    pairs: list[tuple[str, str]] | None = None
    """Sentence pairs, each tokenized as one sequence (cross-encoders); then ``items`` is
    empty and there is no prompt."""
    prompted: PromptedPairs | None = None
    """Sentence pairs, each one text of a prompt (a yes/no reranker's, or a cross-encoder's
    pair text), built only when they are tokenized (:class:`~.prompts.PromptedPairs`); then
    ``items`` is empty and there is no prompt."""
    adapter: int | None = None
    """The task adapter every sequence of the job runs (:meth:`Prompts.adapter`)."""
    segmented: SegmentedPairTemplate | None = None
    """With ``pairs``: a yes/no reranker's prompt whose pieces are tokenized apart
    (:meth:`TextTokenizer.encode_segmented`); ``prompt`` is then its instruction."""
    colbert: ColbertFormat | None = None
    """A ColBERT model's tokenization: each of ``items`` is encoded as the query or
    document ``sides`` says (:meth:`ColbertFormat.encode`), its keys limited accordingly."""
    sides: tuple[Side, ...] = ()
    """With ``colbert``: the side of each of ``items``."""
    listwise: ListwiseJob | None = None
    """A listwise reranker's lists (``listwise.py``), each tokenized into blocks, one
    sequence per block whose token projections come back; then ``items`` is empty."""

    @classmethod
    def prepare(
        cls,
        items: Sequence[JobItem],
        options: ScoreOptions,
        prompts: Prompts,
        *,
        add_special_tokens: bool = True,
        want_tokens: bool = False,
        max_token_rows: int | None = None,
    ) -> Job:
        """Resolve a request's prompt, task adapter and truncation once, after its inputs
        were checked. A named adapter brings its prompt (jina's ``encode(task=...)`` prepends
        the task's instruction) unless the request gives one. A prompt applies to texts
        only: asked for a request of images alone, it is refused, never ignored."""
        adapter, raw = options.get("adapter"), options.get("prompt")
        prompt_name = options.get("prompt_name")
        if items and all(isinstance(item, ImageInput) for item in items):
            for name in ("prompt", "prompt_name", "adapter"):
                if options.get(name) is not None:
                    raise InvalidRequestError(
                        f"{name} applies to text inputs; this request holds only images",
                        param=name,
                    )
            if want_tokens:
                raise InvalidRequestError(
                    "per-token outputs are served for text inputs only", param="input"
                )
        if adapter is not None and prompt_name is None and raw is None and adapter in prompts.table:
            prompt_name = adapter
        prompt = prompts.resolve(raw, prompt_name)
        index = prompts.adapter(adapter, prompt_name)
        truncation = Truncation.coerce(options.get("truncate", True))
        if want_tokens and any(isinstance(item, ImageInput) for item in items):
            raise InvalidRequestError(
                "per-token outputs are served for text inputs only", param="input"
            )
        return cls(
            list(items),
            prompt,
            truncation,
            add_special_tokens,
            want_tokens,
            max_token_rows,
            adapter=index,
        )

    def admission(self, tokenizer: TextTokenizer) -> AdmissionEstimate:
        """What the job will hold, from its inputs' sizes
        (:meth:`TextTokenizer.admission_estimate`): nothing is tokenized or copied."""
        if self.listwise is not None:
            return self.listwise.admission(tokenizer)
        if self.prompted is not None:  # from the prompts' parts: none is built
            return tokenizer.sized_estimate(self.prompted.sizes(suffix=True), self.truncation)
        if self.colbert is not None:  # queries expanded to their length: not the text's size
            return self.colbert.admission([str(t) for t in self.items], self.sides)
        if self.pairs is None:
            estimate = tokenizer.admission_estimate(self.text_items, self.truncation, self.prompt)
            images = self.image_tokens
            if images:  # an image holds exactly its vision tower's tokens
                return AdmissionEstimate(
                    estimate.floor + images, estimate.likely + images, estimate.bound + images
                )
            return estimate
        if self.segmented is not None:  # each pair in its prompt, at most the limit
            t = self.segmented
            fixed = "".join((*t.head, t.separator, *t.tail_texts(self.prompt)))
            sizes = (
                _joined(
                    len(fixed), fixed.isascii(), t.query_size(q, self.prompt), t.document_size(d)
                )
                for q, d in self.pairs
            )
            return tokenizer.sized_estimate(sizes, self.truncation)
        return tokenizer.pair_estimate(self.pairs, self.truncation)

    @property
    def text_items(self) -> list[TextInput]:
        """The job's texts and token ids, in order, without its images."""
        return [item for item in self.items if not isinstance(item, ImageInput)]

    @property
    def image_tokens(self) -> int:
        """The tokens the job's images hold (their vision tower's sequences)."""
        return sum(item.tokens for item in self.items if isinstance(item, ImageInput))

    def small(self, most: int = INLINE_TOKENIZE_CHARS) -> bool:
        """Whether its texts (each distinct one once, with the prompt) and token ids come to
        ``most`` characters or fewer."""
        if self.listwise is not None:
            return self.listwise.chars() <= most
        if self.prompted is not None:
            return self.prompted.chars() <= most
        size = 0
        if self.pairs is not None:
            seen: set[int] = set()
            for pair in self.pairs:
                for text in pair:
                    if id(text) not in seen:
                        seen.add(id(text))
                        size += len(text)
                if size > most:
                    return False
            return True
        prompt = len(self.prompt or "")
        for item in self.items:
            if isinstance(item, ImageInput):  # preprocessed already: nothing to tokenize
                continue
            size += len(item) + prompt if isinstance(item, str) else len(item)
            if size > most:
                return False
        return True

    def tokenize(
        self, tokenizer: TextTokenizer, max_total: int | None = None
    ) -> list[TokenizedInput]:
        """The job's inputs tokenized and truncated; over ``max_total`` tokens in all it is
        refused as soon as its inputs read so far hold more."""
        if self.listwise is not None:
            return self.listwise.tokenize(tokenizer, self.truncation, max_total)
        if self.prompted is not None:
            return self.prompted.tokenize(tokenizer, self.truncation, max_total)
        if self.colbert is not None:
            encoded = [
                self.colbert.encode(tokenizer.backend, str(text), side)
                for text, side in zip(self.items, self.sides, strict=True)
            ]
            total = sum(len(e.ids) for e in encoded)
            if max_total is not None and total > max_total:
                raise TooManyTokensError(
                    f"'input' holds {total} tokens; one request may hold at most {max_total} "
                    "(max_request_tokens)",
                    param="input",
                )
            if self.truncation.side is None:
                for i, e in enumerate(encoded):
                    limit = len(e.ids) if self.sides[i] == "document" else e.keys
                    if e.original > limit:
                        raise InputTooLongError(
                            f"input[{i}] has {e.original} tokens, more than this ColBERT "
                            f"model's {self.sides[i]} length of {limit}; shorten it or ask "
                            "for truncation",
                            param=self.truncation.param,
                            token_count=e.original,
                            max_tokens=limit,
                        )
            return self._checked_rows(
                [
                    TokenizedInput(
                        e.ids, e.original, key_len=e.keys if e.keys < len(e.ids) else None
                    )
                    for e in encoded
                ]
            )
        if self.pairs is not None and self.segmented is not None:
            return tokenizer.encode_segmented(
                self.pairs,
                self.segmented,
                instruction=self.prompt,
                truncation=self.truncation,
                max_total=max_total,
            )
        if self.pairs is not None:
            return tokenizer.encode_pairs(
                self.pairs, truncation=self.truncation, max_total=max_total
            )
        images = self.image_tokens
        if max_total is not None and images > max_total:
            raise TooManyTokensError(
                f"'input' holds {images} image tokens; one request may hold at most "
                f"{max_total} (max_request_tokens)",
                param="input",
            )
        plain = self.text_items
        tokenized = (
            tokenizer.encode(
                plain,
                truncation=self.truncation,
                add_special_tokens=self.add_special_tokens,
                prompt=self.prompt,
                param="input",
                max_total=None if max_total is None else max_total - images,
            )
            if plain
            else []
        )
        if len(plain) < len(self.items):  # images, in their places among the texts
            rest = iter(tokenized)
            tokenized = [
                TokenizedInput([0] * item.tokens, item.tokens)
                if isinstance(item, ImageInput)
                else next(rest)
                for item in self.items
            ]
        return self._checked_rows(tokenized)

    def _checked_rows(self, tokenized: list[TokenizedInput]) -> list[TokenizedInput]:
        """``tokenized``, or the refusal of a per-token output over ``max_token_rows``."""
        if self.want_tokens and self.max_token_rows is not None:
            rows = sum(len(t.ids) for t in tokenized)
            if rows > self.max_token_rows:
                raise OutputTooLargeError(
                    f"the per-token output would hold {rows} vectors, more than the "
                    f"{self.max_token_rows} allowed",
                    param="input",
                    vectors=rows,
                )
        return tokenized

    def sequences(self, tokenized: Sequence[TokenizedInput]) -> list[SequenceInput]:
        """The scheduler's sequences of the tokenized inputs; an image's carries its pixels
        beside its placeholder ids (and nothing else: no prompt, adapter or key limit)."""
        if self.pairs is None and any(isinstance(item, ImageInput) for item in self.items):
            return [
                SequenceInput(t.ids, pixels=item.pixels)
                if isinstance(item, ImageInput)
                else SequenceInput(
                    t.ids, t.prompt_length, self.want_tokens, t.type_ids, self.adapter, t.key_len
                )
                for item, t in zip(self.items, tokenized, strict=True)
            ]
        return [
            SequenceInput(
                t.ids, t.prompt_length, self.want_tokens, t.type_ids, self.adapter, t.key_len
            )
            for t in tokenized
        ]


def _joined(fixed: int, ascii: bool, *parts: Size) -> Size:
    """The :data:`~.heads.Size` of a text of ``fixed`` characters and ``parts`` joined."""
    return fixed + sum(n for n, _ in parts), ascii and all(a for _, a in parts)


class Offloader(Protocol):
    """Where blocking tokenizer calls run."""

    async def offload(self, work: Callable[[], T]) -> T:
        """Run blocking CPU work (tokenization) off the event loop where there is one."""
        ...


class JobRunner(Offloader, Protocol):
    """Where jobs run: the scheduler, or directly on the calling thread."""

    async def run(self, job: Job) -> JobOutput: ...


async def tokenize_job(
    runner: Offloader,
    tokenizer: TextTokenizer,
    job: Job,
    *,
    inline: bool = False,
    max_total: int | None = None,
) -> tuple[list[TokenizedInput], float]:
    """``job`` tokenized (at most ``max_total`` tokens in all), and the seconds it took:
    through ``runner.offload``, or right here when ``inline``."""
    started = time.perf_counter()
    if inline:
        tokenized = job.tokenize(tokenizer, max_total)
    else:
        tokenized = await runner.offload(lambda: job.tokenize(tokenizer, max_total))
    return tokenized, time.perf_counter() - started


class ThreadedRunner:
    """An online runner: admits a job, tokenizes it in a thread pool beside an event loop
    (or on the loop when it is small), then queues its sequences. Subclasses say where the
    queue is (:meth:`_reserve`, :meth:`_submit`)."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        loop: asyncio.AbstractEventLoop,
        tokenize_pool: ThreadPoolExecutor,
    ) -> None:
        self._tokenizer = tokenizer
        self.loop, self._pool = loop, tokenize_pool

    async def offload(self, work: Callable[[], T]) -> T:
        return await self.loop.run_in_executor(self._pool, work)

    async def run(self, job: Job) -> JobOutput:
        """Admit ``job`` on what it is known to hold before it is tokenized, so a request the
        queue would refuse costs no tokenization; tokenize it; queue its sequences, which
        turns the reservation into their exact count."""
        estimate = job.admission(self._tokenizer)
        priority = request_priority.get()
        reservation = self._reserve(estimate.floor, estimate.likely, estimate.bound, priority)
        traced = current_trace.get()  # None unless this request is traced
        try:
            # In the pool, or on the loop when its inputs are short (INLINE_TOKENIZE_CHARS);
            # either way refused as soon as it holds more than one request may.
            started_ns = time.time_ns() if traced is not None else 0
            tokenized, tokenize_s = await tokenize_job(
                self,
                self._tokenizer,
                job,
                inline=job.small(),
                max_total=reservation.admission.max_request_tokens,
            )
            out = await self._submit(job, job.sequences(tokenized), reservation, priority)
        finally:
            reservation.release()
        if traced is not None:
            traced.job(started_ns, tokenize_s, time.time_ns(), out, tokenized)
        timings = StageTimings(tokenize_s, out.queue_s, out.forward_s, out.pool_s)
        return JobOutput(tokenized, out.pooled, out.tokens, timings)

    def _reserve(self, floor: int, estimate: int, bound: int, priority: Priority) -> Reservation:
        """Admit a job of ``floor`` tokens at least, about ``estimate`` and at most ``bound``,
        in the room a request of ``priority`` may fill, or raise 413/429."""
        raise NotImplementedError

    async def _submit(
        self,
        job: Job,
        sequences: list[SequenceInput],
        reservation: Reservation,
        priority: Priority,
    ) -> ScheduledOutput:
        """Queue the job's sequences (ending ``reservation``) in ``priority``'s class and
        wait for their results."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the tokenizer threads (queued work is cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class ScheduledRunner(ThreadedRunner):
    """Runs jobs through the continuous-batching scheduler, on the engine's loop.

    A job is admitted (:meth:`Scheduler.reserve`) before it is tokenized, so a request the
    scheduler would refuse costs no tokenization."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        scheduler: Scheduler,
        *,
        loop: asyncio.AbstractEventLoop,
        tokenize_pool: ThreadPoolExecutor,
    ) -> None:
        super().__init__(tokenizer, loop=loop, tokenize_pool=tokenize_pool)
        self._scheduler = scheduler

    def _reserve(self, floor: int, estimate: int, bound: int, priority: Priority) -> Reservation:
        return self._scheduler.reserve(floor, estimate, bound, priority)

    async def _submit(
        self,
        job: Job,
        sequences: list[SequenceInput],
        reservation: Reservation,
        priority: Priority,
    ) -> ScheduledOutput:
        return await self._scheduler.submit(sequences, reservation, priority)


class DirectRunner:
    """Runs jobs on the calling thread in length-sorted batches within the token budget."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        runner: BatchRunner[Any],
        *,
        max_tokens: int,
        max_size: int,
    ) -> None:
        self._tokenizer, self._runner = tokenizer, runner
        self._max_tokens, self._max_size = max_tokens, max_size

    async def offload(self, work: Callable[[], T]) -> T:
        return work()

    async def run(self, job: Job) -> JobOutput:
        tokenized, tokenize_s = await tokenize_job(self, self._tokenizer, job)
        seqs = job.sequences(tokenized)
        pooled: list[FloatArray | None] = [None] * len(seqs)
        tokens: list[FloatArray | None] = [None] * len(seqs)
        forward_s = pool_s = 0.0
        lengths = [len(s.ids) for s in seqs]
        for chunk in plan_offline_batches(lengths, self._max_tokens, self._max_size):
            out = self._runner.execute(self._runner.prepare([seqs[i] for i in chunk]))
            forward_s += out.forward_s
            pool_s += out.pool_s
            for row, i in enumerate(chunk):
                pooled[i], tokens[i] = out.pooled[row], out.tokens[row]
        stacked = np.stack([p for p in pooled if p is not None])
        timings = StageTimings(tokenize=tokenize_s, forward=forward_s, pool=pool_s)
        return JobOutput(tokenized, stacked, tokens, timings)


def plan_offline_batches(lengths: Sequence[int], max_tokens: int, max_size: int) -> list[list[int]]:
    """Length-sorted batches within the token budget, for the offline bulk path."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and (used + lengths[i] > max_tokens or len(current) >= max_size):
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        batches.append(current)
    return batches


def run_inline(coroutine: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine that never suspends (one on the :class:`DirectRunner`) to its
    result on this thread, with or without an event loop around."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    coroutine.close()
    raise RuntimeError("offline engine work suspended; it must complete without a loop")


def run_sync(
    work: Callable[[JobRunner], Coroutine[Any, Any, T]],
    direct: DirectRunner,
    online: ScheduledRunner | None,
) -> T:
    """``work`` run to completion for sync code: inline on ``direct`` when the engine is not
    started (``online`` None), else on the engine's loop, waited for from this thread."""
    if online is None:
        return run_inline(work(direct))
    try:
        current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    if current is online.loop:
        raise RuntimeError(
            "a sync Engine method was called inside the engine's event "
            "loop, which would block it; await the async form instead"
        )
    return asyncio.run_coroutine_threadsafe(work(online), online.loop).result()

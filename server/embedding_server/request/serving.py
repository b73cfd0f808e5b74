"""What every engine serves: the request-level half of :class:`~.engine.Engine`.

:class:`ServingEngine` holds the async and sync API (``aembed``, ``embed``, ``score``, ...)
and everything a request goes through before and after the model: input checks, prompts,
truncation, the per-request head (Matryoshka truncation, normalization, a classifier's
activation) and the results. Where a job's sequences run is left to the two subclasses:

* :class:`~.engine.Engine` owns the model, the scheduler and the forward thread (one process,
  or the engine process of ``--api-workers``);
* :class:`~.ipc.client.AttachedEngine` is a front-end process's: its jobs go to the engine
  process over the wire of :mod:`.ipc`.

Nothing here imports torch, nor does anything it imports, and nothing here computes with it:
weights and heads run in the engine's batches, and what runs per request (truncation,
normalization, a classifier's activation) is numpy. So a front-end process never loads the
model runtime (seconds of start-up and hundreds of MB per process: docs/performance-log.md).
"""

from __future__ import annotations

import abc
import asyncio
import functools
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Unpack, cast

import numpy as np
import numpy.typing as npt
from PIL import Image

from embedding_server.errors import InvalidRequestError
from embedding_server.metrics import Metrics
from embedding_server.request.colbert import ColbertFormat, Side, maxsim_sum, parse_side
from embedding_server.request.configuration import EngineConfig, EngineInfo
from embedding_server.request.heads import PairPrompt, Task
from embedding_server.request.hybrid import OUTPUTS, HybridHeads, maxsim_scores
from embedding_server.request.jobs import (
    INLINE_TOKENIZE_CHARS,
    EmbedOptions,
    HybridOptions,
    Job,
    JobItem,
    JobRunner,
    ScoreOptions,
    TokenEmbedOptions,
    TokenOptions,
    check_options,
)
from embedding_server.request.media import fetching as media
from embedding_server.request.media.fetching import MediaPolicy
from embedding_server.request.media.inputs import (
    IMAGE_TYPES,
    ChatMessage,
    ChatTemplate,
    ImagePreprocessor,
    ImageRef,
)
from embedding_server.request.media.preprocessing import ImageInput
from embedding_server.request.pooling import FloatArray
from embedding_server.request.results import (
    ClassifyResult,
    EmbedResult,
    HybridResult,
    JobOutput,
    RerankResult,
    ScoreResult,
    SparseEmbedResult,
    SparseVector,
    TokenEmbedResult,
    usage_of,
)
from embedding_server.request.scoring import (
    check_sides,
    cosine_scores,
    pair_inputs,
    rank,
    text_pairs,
    text_sides,
)
from embedding_server.request.texts import TextInput, normalize_inputs
from embedding_server.request.tokenization import TextTokenizer
from embedding_server.settings import EngineSettings

T = TypeVar("T")

Inputs = (
    str
    | Sequence[str]
    | Sequence[int]
    | Sequence[Sequence[int]]
    | Sequence[TextInput]
    | Image.Image
    | ImageInput
    | Sequence[TextInput | Image.Image | ImageInput]
)
"""One string, a list of strings, one token-id list, or a list of token-id lists (mixed ok);
for a model that takes images, PIL images and :class:`~.imaging.ImageInput` too, alone or
mixed with texts."""

EncodeTask = Literal["embed", "token_embed", "classify", "token_classify", "reward"]
ENCODE_TASKS: tuple[EncodeTask, ...] = (
    "embed",
    "token_embed",
    "classify",
    "token_classify",
    "reward",
)


def _sizeable(value: object) -> bool:
    """Whether checking ``value`` element by element is more than a small job's worth of work
    (:data:`~.jobs.INLINE_TOKENIZE_CHARS` items or token ids)."""
    if not isinstance(value, list):
        return False
    if len(value) > INLINE_TOKENIZE_CHARS:
        return True
    return sum(len(v) for v in value if isinstance(v, list)) > INLINE_TOKENIZE_CHARS


def _holds_pil(inputs: object) -> bool:
    """Whether ``inputs`` hold a PIL image (its preprocessing is CPU work for a thread)."""
    if isinstance(inputs, Image.Image):
        return True
    return isinstance(inputs, list | tuple) and any(isinstance(x, Image.Image) for x in inputs)


async def _checked(runner: JobRunner, check: Callable[..., T], *inputs: object) -> T:
    """``check(*inputs)``: input validation that walks every element, off the event loop
    (``runner.offload``) when the inputs hold millions of token ids."""
    if any(_sizeable(value) for value in inputs):
        return await runner.offload(functools.partial(check, *inputs))
    return check(*inputs)


@dataclass(frozen=True)
class EngineLoad:
    """The work ahead of a new request, as ``GET /load`` reports it to a gateway: tokens
    admitted and waiting, tokens in batches taken from the queue, and both in seconds at
    the rate the model measured recently (the ``embedding_server_backlog_seconds`` gauge)."""

    queued_tokens: int = 0
    running_tokens: int = 0
    backlog_seconds: float = 0.0


class ServingEngine(abc.ABC):
    """The request-level API of an engine; subclasses say where a job's sequences run."""

    settings: EngineSettings
    metrics: Metrics | None
    _config: EngineConfig
    _info: EngineInfo
    _tokenizer: TextTokenizer
    _images: ImagePreprocessor | None = None
    """The model's image preprocessing, where it takes images (``info().modalities``)."""
    _chat: ChatTemplate | None = None
    """The tokenizer's chat template, where it has one (``messages`` requests)."""

    def info(self) -> EngineInfo:
        return self._info

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The tokenizer's chat template (``tokenizer_config.json``), where it has one."""
        return self._chat

    async def arender_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """``messages`` rendered through the model's chat template
        (:meth:`ChatTemplate.render`), off the event loop: a long conversation is
        milliseconds of template work the loop must not spend."""
        template = self._chat
        if template is None:
            raise InvalidRequestError(
                f"messages need a chat template, and this model ({self._info.architecture}) "
                "has none in its tokenizer_config.json; send the text as input",
                param="messages",
            )
        render = functools.partial(
            template.render,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            kwargs=kwargs,
        )
        return await self._offloader().offload(render)

    @property
    def takes_images(self) -> bool:
        """Whether the model embeds images (a vision tower and its preprocessing)."""
        return "image" in self._info.modalities and self._images is not None

    def check_takes_images(self, param: str) -> None:
        """A 400 naming ``param`` (the request field holding an image) when the model does
        not embed images: an image is never dropped or guessed at."""
        if not self.takes_images:
            raise InvalidRequestError(
                f"{param} is an image, and this model ({self._info.architecture}) embeds "
                f"{' and '.join(self._info.modalities)} only",
                param=param,
            )

    async def aload_images(self, refs: Sequence[ImageRef], policy: MediaPolicy) -> list[ImageInput]:
        """The images ``refs`` point at, fetched (concurrently, on the loop: network I/O)
        then decoded and preprocessed off the event loop in the tokenizer threads. Every
        refusal (a host not listed, a body too large, a decompression bomb) is a 400 naming
        the image's field."""
        for ref in refs:
            self.check_takes_images(ref.param)
        processor = self._images
        assert processor is not None
        offloader = self._offloader()

        def prepare(raw: bytes, param: str) -> ImageInput:
            with media.decode_image(raw, policy, param=param) as image:
                return processor.preprocess(image)

        async def one(ref: ImageRef) -> ImageInput:
            # Looked up on the module at each call (media's functions are the seam tests
            # replace).
            raw = await media.fetch_image(ref.url, policy, param=ref.param)
            return await offloader.offload(functools.partial(prepare, raw, ref.param))

        # The first refusal cancels the other fetches: a request already answered with 400
        # must not keep connections open until their timeouts.
        tasks = [asyncio.ensure_future(one(ref)) for ref in refs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _image_input(self, image: Image.Image | ImageInput, param: str) -> ImageInput:
        """An offline API image input, preprocessed as the model's processor does."""
        self.check_takes_images(param)
        if isinstance(image, ImageInput):
            return image
        assert self._images is not None
        return self._images.preprocess(image.convert("RGB"))

    def _job_items(self, inputs: object, param: str = "input") -> list[JobItem]:
        """A request's inputs: texts and token ids (:func:`normalize_inputs`), and images
        (PIL images are preprocessed here: call it off the loop for many of them)."""
        if isinstance(inputs, IMAGE_TYPES):
            return [self._image_input(inputs, param)]
        if isinstance(inputs, list | tuple) and any(isinstance(x, IMAGE_TYPES) for x in inputs):
            items: list[JobItem] = []
            for i, item in enumerate(inputs):
                if isinstance(item, IMAGE_TYPES):
                    items.append(self._image_input(item, f"{param}[{i}]"))
                    continue
                try:
                    items.extend(normalize_inputs([item], param))
                except InvalidRequestError as error:
                    raise InvalidRequestError(
                        f"{param}[{i}] must be a string, a list of token ids or an image",
                        param=param,
                    ) from error
            return items
        return list(normalize_inputs(inputs, param))

    async def _items(
        self, runner: JobRunner, inputs: object, param: str = "input"
    ) -> list[JobItem]:
        """:meth:`_job_items` of ``inputs``, off the event loop when they are many or hold
        images to preprocess."""
        if _holds_pil(inputs):
            return await runner.offload(functools.partial(self._job_items, inputs, param))
        return await _checked(runner, self._job_items, inputs, param)

    def load(self) -> EngineLoad:
        """The work queued and running now (an engine without a queue of its own: none)."""
        return EngineLoad()

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """True while the engine serves the async API."""

    @abc.abstractmethod
    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` once the engine can no longer serve."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the engine holds beyond memory. Idempotent."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Become ready to serve the async API."""

    @abc.abstractmethod
    async def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop serving; with ``drain`` finish what is queued first."""

    # -- async API (inside the server's loop) ----------------------------------------------
    async def aembed(self, inputs: Inputs, **options: Unpack[EmbedOptions]) -> EmbedResult:
        """Embed inputs through the scheduler; float32 ``[n, d]`` plus usage and timings."""
        return await self._embed(self._scheduled(), inputs, options)

    async def aembed_tokens(
        self, inputs: Inputs, **options: Unpack[TokenEmbedOptions]
    ) -> TokenEmbedResult:
        """Per-token final hidden states (float32 ``[len_i, hidden]`` per input); with
        ``max_output_values``, a request whose output would hold more numbers is refused
        with :class:`~.errors.OutputTooLargeError` before the forward pass."""
        return await self._embed_tokens(self._scheduled(), inputs, options)

    async def ascore(self, a: Inputs, b: Inputs, **options: Unpack[ScoreOptions]) -> ScoreResult:
        """Scores of pairs (equal-length lists, or one text against many): the
        cross-encoder's relevance (task score), or the cosine of embeddings (task embed)."""
        return await self._score(self._scheduled(), a, b, options)

    async def aclassify(self, inputs: Inputs, **options: Unpack[ScoreOptions]) -> ClassifyResult:
        """Class probabilities of each input (task classify or score)."""
        return await self._classify(self._scheduled(), inputs, options)

    async def atoken_classify(
        self, inputs: Inputs, **options: Unpack[TokenOptions]
    ) -> TokenEmbedResult:
        """Label probabilities of every token (float32 ``[len_i, num_labels]`` per input)."""
        return await self._token_classify(self._scheduled(), inputs, options)

    async def areward(self, inputs: Inputs, **options: Unpack[TokenOptions]) -> TokenEmbedResult:
        """A reward model's raw outputs at every token (see :meth:`reward`)."""
        return await self._reward(self._scheduled(), inputs, options)

    async def asparse_embed(
        self, inputs: Inputs, **options: Unpack[TokenOptions]
    ) -> SparseEmbedResult:
        """SPLADE sparse vectors (see :meth:`sparse_embed`)."""
        return await self._sparse(self._scheduled(), inputs, options)

    async def ahybrid_embed(
        self,
        inputs: Inputs,
        outputs: Sequence[str] = OUTPUTS,
        **options: Unpack[HybridOptions],
    ) -> HybridResult:
        """A bge-m3-shaped model's ``outputs`` (see :meth:`hybrid_embed`)."""
        return await self._hybrid(self._scheduled(), inputs, outputs, options)

    async def arerank(
        self,
        query: str | Image.Image | ImageInput,
        documents: Sequence[str | Image.Image | ImageInput],
        *,
        top_n: int | None = None,
        **options: Unpack[ScoreOptions],
    ) -> RerankResult:
        """``documents`` by decreasing relevance to ``query`` (see :meth:`rerank`)."""
        return await self._rerank(self._scheduled(), query, documents, top_n, options)

    async def atokenize(
        self,
        texts: str | Sequence[str],
        *,
        add_special_tokens: bool = True,
        max_tokens: int | None = None,
        param: str = "input",
    ) -> list[list[int]]:
        """``tokenize`` off the event loop."""
        return await self._offloader().offload(
            functools.partial(
                self.tokenize,
                texts,
                add_special_tokens=add_special_tokens,
                max_tokens=max_tokens,
                param=param,
            )
        )

    async def adetokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """``detokenize`` off the event loop."""
        return await self._offloader().offload(
            functools.partial(self.detokenize, ids, skip_special_tokens=skip_special_tokens)
        )

    async def atoken_strings(self, ids: Sequence[int]) -> list[str]:
        """``token_strings`` off the event loop."""
        return await self._offloader().offload(functools.partial(self.token_strings, ids))

    # -- sync API (no loop needed) ---------------------------------------------------------
    def embed(self, inputs: Inputs, **options: Unpack[EmbedOptions]) -> FloatArray:
        """Embed inputs; float32 numpy array ``[n, d]``."""
        return self.embed_full(inputs, **options).embeddings

    def embed_full(self, inputs: Inputs, **options: Unpack[EmbedOptions]) -> EmbedResult:
        """Like ``embed`` but returns the EmbedResult (usage, truncation count, timings)."""
        return self._sync(lambda runner: self._embed(runner, inputs, options))

    def embed_tokens(
        self, inputs: Inputs, **options: Unpack[TokenEmbedOptions]
    ) -> list[FloatArray]:
        """Per-token hidden states, one float32 ``[len_i, hidden]`` array per input."""
        return self._sync(lambda runner: self._embed_tokens(runner, inputs, options)).embeddings

    def score(
        self, a: Inputs, b: Inputs, **options: Unpack[ScoreOptions]
    ) -> npt.NDArray[np.float32]:
        """Scores ``[n]`` of pairs (equal-length lists, or one against many), as vLLM's
        ``LLM.score``: a cross-encoder's relevance after its activation (task score), or the
        cosine similarity of the two embeddings (task embed)."""
        return self._sync(lambda runner: self._score(runner, a, b, options)).scores

    def classify(self, inputs: Inputs, **options: Unpack[ScoreOptions]) -> ClassifyResult:
        """Class probabilities ``[n, num_labels]`` and labels, as vLLM's ``LLM.classify``
        (task classify; a cross-encoder gives its one sigmoid probability)."""
        return self._sync(lambda runner: self._classify(runner, inputs, options))

    def token_classify(self, inputs: Inputs, **options: Unpack[TokenOptions]) -> list[FloatArray]:
        """Label probabilities of every token, one float32 ``[len_i, num_labels]`` array per
        input, as vLLM's ``LLM.encode(..., pooling_task="token_classify")`` (task
        token_classify: softmax, sigmoid for one label)."""
        return self._sync(lambda runner: self._token_classify(runner, inputs, options)).embeddings

    def reward(self, inputs: Inputs, **options: Unpack[TokenOptions]) -> list[FloatArray]:
        """A reward model's outputs at every token, one float32 ``[len_i, num_labels]``
        array per input, as vLLM's reward task (all tokens, no activation): for a decoder
        ``*ForSequenceClassification`` reward model the last row is its score."""
        return self._sync(lambda runner: self._reward(runner, inputs, options)).embeddings

    def sparse_embed(self, inputs: Inputs, **options: Unpack[TokenOptions]) -> list[SparseVector]:
        """SPLADE sparse vectors over the vocabulary (task sparse): per input, the token ids
        with a non-zero weight and their weights, as sentence-transformers' SparseEncoder
        computes them."""
        return self._sync(lambda runner: self._sparse(runner, inputs, options)).vectors

    def hybrid_embed(
        self,
        inputs: Inputs,
        outputs: Sequence[str] = OUTPUTS,
        **options: Unpack[HybridOptions],
    ) -> HybridResult:
        """Any of a bge-m3-shaped model's three outputs from one forward pass, as
        FlagEmbedding's ``BGEM3FlagModel.encode`` computes them: ``dense`` (the pooled
        vectors, ``[n, d]``), ``sparse`` (lexical weights per token id) and ``multi_vector``
        (ColBERT vectors, ``[len_i - 1, width]`` per input, normalized). Needs a model whose
        ``info().outputs`` lists them."""
        return self._sync(lambda runner: self._hybrid(runner, inputs, outputs, options))

    def rerank(
        self,
        query: str | Image.Image | ImageInput,
        documents: Sequence[str | Image.Image | ImageInput],
        *,
        top_n: int | None = None,
        **options: Unpack[ScoreOptions],
    ) -> RerankResult:
        """``documents`` by decreasing relevance to ``query`` (the first ``top_n`` when
        given): a cross-encoder's scores, or cosine similarity for an embedding model."""
        return self._sync(lambda runner: self._rerank(runner, query, documents, top_n, options))

    def encode(
        self, inputs: Inputs, *, task: EncodeTask = "embed", **options: Any
    ) -> list[FloatArray]:
        """One array per input for a pooling ``task``, as vLLM's ``LLM.encode``: ``embed``
        (the pooled vector), ``token_embed`` (per-token hidden states ``[len_i, hidden]``),
        ``classify`` (class probabilities), ``token_classify`` (per-token probabilities) or
        ``reward`` (per-token raw outputs).
        ``options`` are those of the task's own method; one that does not apply is a
        TypeError, as there."""
        if task == "embed":
            return list(self.embed(inputs, **options))
        if task == "token_embed":
            return self.embed_tokens(inputs, **options)
        if task == "classify":
            return list(self.classify(inputs, **options).probs)
        if task == "token_classify":
            return self.token_classify(inputs, **options)
        if task == "reward":
            return self.reward(inputs, **options)
        raise InvalidRequestError(
            f"task must be one of {', '.join(ENCODE_TASKS)}; got {task!r}", param="task"
        )

    def tokenize(
        self,
        texts: str | Sequence[str],
        *,
        add_special_tokens: bool = True,
        max_tokens: int | None = None,
        param: str = "input",
    ) -> list[list[int]]:
        """Token ids of each text, untruncated (what ``/tokenize`` returns). With
        ``max_tokens``, a text holding more is refused (413) after reading a bounded part of
        it, never tokenized whole (:meth:`TextTokenizer.tokenize`)."""
        return self._tokenizer.tokenize(
            texts, add_special_tokens=add_special_tokens, max_tokens=max_tokens, param=param
        )

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of token ids (special tokens dropped unless asked for)."""
        return self._tokenizer.detokenize(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The tokenizer's own string for each id (``convert_ids_to_tokens``: WordPiece ``##``
        and byte-level ``Ġ`` markers kept), as vLLM's ``/tokenize`` returns them."""
        return self._tokenizer.token_strings(ids)

    # -- one path per request type, whichever runner runs it ------------------------------
    def _require(self, endpoint: str, *tasks: Task) -> None:
        """A 400 naming the model's task when it cannot serve ``endpoint``."""
        if self._config.task not in tasks:
            raise InvalidRequestError(
                f"{endpoint} needs a model with task {' or '.join(tasks)}; this model's task "
                f"is {self._config.task} ({self._info.architecture})",
                param="model",
            )

    async def _embed(self, runner: JobRunner, inputs: Inputs, options: EmbedOptions) -> EmbedResult:
        check_options("embed", dict(options), EmbedOptions)
        self._require("embedding", "embed")
        if self._config.colbert is not None:
            raise InvalidRequestError(
                f"{self._info.architecture} is a ColBERT model: it has no single pooled "
                "vector, only per-token multi-vectors (token embeddings or the multi_vector "
                "output, with input_type query or document) scored by MaxSim (/score, "
                "/rerank)",
                param="model",
            )
        items = await self._items(runner, inputs)
        head = self._config.head.options(options.get("dimensions"), options.get("normalize"))
        special = options.get("add_special_tokens", True)
        job = Job.prepare(items, options, self._config.prompts, add_special_tokens=special)
        out = await self._run(runner, job)
        return out.embed_result(head.apply(out.pooled))

    async def _embed_tokens(
        self, runner: JobRunner, inputs: Inputs, options: TokenEmbedOptions
    ) -> TokenEmbedResult:
        check_options("embed_tokens", dict(options), TokenEmbedOptions)
        self._require("per-token embedding", "embed")
        items = await _checked(runner, normalize_inputs, inputs, "input")
        colbert = self._colbert(options.get("input_type"))
        if colbert is not None:
            if options.get("normalize") is False:
                raise InvalidRequestError(
                    "a ColBERT model's vectors are always normalized", param="normalize"
                )
            fmt, side = colbert
            out = await self._run(runner, self._colbert_job(items, side, options, fmt))
            rows = [t for t in out.tokens if t is not None]
            vectors = [
                fmt.vectors(r, t.ids, side) for r, t in zip(rows, out.tokenized, strict=True)
            ]
            token_ids = [fmt.kept_ids(t.ids, side) for t in out.tokenized]
            return TokenEmbedResult(embeddings=vectors, token_ids=token_ids, **usage_of(out))
        special = options.get("add_special_tokens", True)
        max_values = options.get("max_output_values")
        hybrid = self._config.hybrid
        width = hybrid.multi_vector_dim if hybrid is not None else self._info.hidden_size
        job = Job.prepare(
            items,
            options,
            self._config.prompts,
            add_special_tokens=special,
            want_tokens=True,
            max_token_rows=None if max_values is None else max_values // width,
        )
        out = await self._run(runner, job)
        matrices = [t for t in out.tokens if t is not None]
        if hybrid is not None:
            # A bge-m3-shaped model's per-token output is its multi-vectors (as vLLM's
            # token_embed of BgeM3EmbeddingModel): CLS left out, normalized by default.
            normalize = options.get("normalize")
            vectors = [
                hybrid.multi_vector(m, normalize=normalize is None or bool(normalize))
                for m in matrices
            ]
            token_ids = [list(t.ids[1:]) for t in out.tokenized]
            return TokenEmbedResult(embeddings=vectors, token_ids=token_ids, **usage_of(out))
        normalize = bool(options.get("normalize"))
        return out.token_result(self._config.head.finish_tokens(matrices, normalize))

    async def _score(
        self, runner: JobRunner, a: Inputs, b: Inputs, options: ScoreOptions
    ) -> ScoreResult:
        check_options("score", dict(options), ScoreOptions)
        self._require("scoring", "embed", "score")
        classifier = self._config.classifier
        hybrid = self._config.hybrid
        listwise = self._config.listwise
        if listwise is not None:
            # A listwise reranker: a query and its documents in one prompt per block.
            queries, documents = await _checked(runner, text_sides, a, b)
            job = Job.for_listwise(queries, documents, options, listwise)
            assert job.listwise is not None
            out = await self._run(runner, job)
            rows = [t for t in out.tokens if t is not None]
            ids = [t.ids for t in out.tokenized]
            return out.score_result(job.listwise.scores(rows, ids))
        fmt = self._config.colbert
        if fmt is not None:
            # ColBERT: the a side as queries, the b side as documents, summed MaxSim.
            items, n_a = await _checked(runner, pair_inputs, a, b)
            query: Side = "query"
            document: Side = "document"
            sides = [query] * n_a + [document] * (len(items) - n_a)
            out = await self._run(runner, self._colbert_job(items, sides, options, fmt))
            rows = [t for t in out.tokens if t is not None]
            vectors = [
                fmt.vectors(r, t.ids, side)
                for r, t, side in zip(rows, out.tokenized, sides, strict=True)
            ]
            return out.score_result(maxsim_scores(vectors, n_a, maxsim_sum))
        if classifier is None and hybrid is not None:
            # Late interaction: both sides' multi-vectors from one job, MaxSim per pair.
            items, n_a = await _checked(runner, pair_inputs, a, b)
            job = Job.prepare(items, options, self._config.prompts, want_tokens=True)
            out = await self._run(runner, job)
            vectors = [hybrid.multi_vector(t) for t in out.tokens if t is not None]
            return out.score_result(maxsim_scores(vectors, n_a))
        if classifier is None:
            items_a = await self._items(runner, a, "text_1")
            items_b = await self._items(runner, b, "text_2")
            check_sides(len(items_a), len(items_b))
            both = [*items_a, *items_b]
            out = await self._run(runner, Job.prepare(both, options, self._config.prompts))
            return out.score_result(cosine_scores(out.pooled, len(items_a)))
        pairs = await _checked(runner, text_pairs, a, b)
        out = await self._run(runner, Job.for_pairs(pairs, options, classifier.template))
        return out.score_result(classifier.scores(out.pooled))

    async def _classify(
        self, runner: JobRunner, inputs: Inputs, options: ScoreOptions
    ) -> ClassifyResult:
        check_options("classify", dict(options), ScoreOptions)
        self._require("classification", "classify", "score")
        if self._config.listwise is not None:
            raise InvalidRequestError(
                f"classification of single texts is not served by a listwise reranker "
                f"({self._info.architecture}, {self._config.listwise.name}): it scores "
                "documents against a query; use /score or /rerank",
                param="model",
            )
        classifier = self._config.classifier
        assert classifier is not None  # task classify and score have one
        if classifier.template is not None:
            # Its score means something only for a pair inside its prompt.
            kind = (
                "a cross-encoder that reads each pair inside its prompt"
                if isinstance(classifier.template, PairPrompt)
                else "a yes/no reranker"
            )
            raise InvalidRequestError(
                f"classification of single texts is not served by {kind} "
                f"({self._info.architecture}, {classifier.template.name}'s prompt); use "
                "/score or /rerank with query and document pairs",
                param="model",
            )
        items = await _checked(runner, normalize_inputs, inputs, "input")
        out = await self._run(runner, Job.prepare(items, options, self._config.prompts))
        return out.classify_result(classifier.probabilities(out.pooled), classifier.labels)

    async def _token_classify(
        self, runner: JobRunner, inputs: Inputs, options: TokenOptions
    ) -> TokenEmbedResult:
        return await self._per_token(runner, inputs, options, "token_classify")

    async def _reward(
        self, runner: JobRunner, inputs: Inputs, options: TokenOptions
    ) -> TokenEmbedResult:
        return await self._per_token(runner, inputs, options, "reward")

    async def _per_token(
        self, runner: JobRunner, inputs: Inputs, options: TokenOptions, task: Task
    ) -> TokenEmbedResult:
        """The classifier's head on every token: probabilities (token_classify) or the raw
        outputs (reward), applied in the runner's batch (:attr:`EngineConfig.token_head`)."""
        check_options(task, dict(options), TokenOptions)
        if options.get("normalize"):
            raise InvalidRequestError(f"normalize does not apply to task {task}", param="normalize")
        self._require(task.replace("_", " "), task)
        items = await _checked(runner, normalize_inputs, inputs, "input")
        special = options.get("add_special_tokens", True)
        job = Job.prepare(
            items, options, self._config.prompts, add_special_tokens=special, want_tokens=True
        )
        out = await self._run(runner, job)
        outputs = [t for t in out.tokens if t is not None]
        classifier = self._config.classifier
        if task == "reward" and classifier is not None:  # a process reward model's steps
            outputs = [
                classifier.rewards(o, t.ids) for o, t in zip(outputs, out.tokenized, strict=True)
            ]
        return out.token_result(outputs)

    async def _sparse(
        self, runner: JobRunner, inputs: Inputs, options: TokenOptions
    ) -> SparseEmbedResult:
        check_options("sparse_embed", dict(options), TokenOptions)
        if options.get("normalize"):
            raise InvalidRequestError("normalize does not apply to task sparse", param="normalize")
        if self._config.hybrid is not None:  # bge-m3's lexical weights
            hybrid_options = cast(
                HybridOptions, {k: v for k, v in options.items() if k != "normalize"}
            )
            result = await self._hybrid(runner, inputs, ("sparse",), hybrid_options)
            return SparseEmbedResult(vectors=result.sparse or [], **usage_of(result))
        self._require("sparse embedding", "sparse")
        items = await _checked(runner, normalize_inputs, inputs, "input")
        special = options.get("add_special_tokens", True)
        job = Job.prepare(items, options, self._config.prompts, add_special_tokens=special)
        out = await self._run(runner, job)
        return out.sparse_result([SparseVector.from_dense(row) for row in out.pooled])

    async def _rerank(
        self,
        runner: JobRunner,
        query: str | Image.Image | ImageInput,
        documents: Sequence[str | Image.Image | ImageInput],
        top_n: int | None,
        options: ScoreOptions,
    ) -> RerankResult:
        check_options("rerank", dict(options), ScoreOptions)
        if not isinstance(query, IMAGE_TYPES) and (not isinstance(query, str) or not query):
            raise InvalidRequestError("query must be a non-empty string", param="query")
        if isinstance(documents, str) or not documents:
            raise InvalidRequestError("documents must be a non-empty list", param="documents")
        for i, document in enumerate(documents):
            if isinstance(document, IMAGE_TYPES):
                continue
            if not isinstance(document, str) or not document:
                raise InvalidRequestError(
                    f"documents[{i}] must be a non-empty string", param="documents"
                )
        if top_n is not None and (isinstance(top_n, bool) or top_n < 0):
            raise InvalidRequestError("top_n must be a non-negative integer", param="top_n")
        result = await self._score(runner, query, list(documents), options)  # type: ignore[arg-type]
        return RerankResult(results=rank(result.scores, top_n), **usage_of(result))

    def _colbert(self, input_type: object) -> tuple[ColbertFormat, Side] | None:
        """A ColBERT model's format and the request's side; None for any other model, which
        refuses an ``input_type`` rather than ignore it."""
        fmt = self._config.colbert
        if fmt is None:
            if input_type is not None:
                raise InvalidRequestError(
                    "input_type applies to a ColBERT model's queries and documents; this "
                    f"model ({self._info.architecture}) is not one",
                    param="input_type",
                )
            return None
        if input_type is None:
            raise InvalidRequestError(
                "input_type (query or document) is required by a ColBERT model: its queries "
                "and documents are tokenized differently",
                param="input_type",
            )
        return fmt, parse_side(input_type)

    def _colbert_job(
        self,
        items: list[TextInput],
        sides: Side | Sequence[Side],
        options: ScoreOptions | TokenOptions,
        fmt: ColbertFormat,
    ) -> Job:
        """A ColBERT job over ``items`` (one side for all, or one each), its per-token
        output held to the request's ``max_output_values``."""
        per_item: list[Side] = [sides] * len(items) if isinstance(sides, str) else list(sides)
        max_values = cast(dict[str, Any], options).get("max_output_values")
        rest = {
            k: v
            for k, v in options.items()
            if k not in ("input_type", "normalize", "max_output_values")
        }
        return Job.for_colbert(
            items,
            per_item,
            cast(TokenOptions, rest),
            fmt,
            max_token_rows=None if max_values is None else max_values // fmt.width,
        )

    def _hybrid_heads(self, what: str) -> HybridHeads:
        """The model's sparse and multi-vector heads, or a 400 saying it has none."""
        hybrid = self._config.hybrid
        if hybrid is None:
            raise InvalidRequestError(
                f"{what} needs a model with sparse and multi-vector outputs (bge-m3's "
                f"sparse_linear.pt and colbert_linear.pt); this model ({self._info.architecture}"
                f", task {self._config.task}) serves {', '.join(self._info.outputs) or 'neither'}",
                param="model",
            )
        return hybrid

    async def _hybrid(
        self,
        runner: JobRunner,
        inputs: Inputs,
        outputs: Sequence[str],
        options: HybridOptions,
    ) -> HybridResult:
        check_options("hybrid_embed", dict(options), HybridOptions)
        wanted = set(outputs) if not isinstance(outputs, str) else {outputs}
        colbert = self._colbert(options.get("input_type"))
        if colbert is not None:
            if wanted != {"multi_vector"}:
                raise InvalidRequestError(
                    f"outputs must be multi_vector for a ColBERT model ({self._info.architecture}"
                    "), which has no dense or sparse output",
                    param="outputs",
                )
            for name in ("dimensions", "normalize"):
                if options.get(name) is not None:
                    raise InvalidRequestError(
                        f"{name} applies to the dense output, which a ColBERT model has not",
                        param=name,
                    )
            fmt, side = colbert
            items = await _checked(runner, normalize_inputs, inputs, "input")
            out = await self._run(runner, self._colbert_job(items, side, options, fmt))
            rows = [t for t in out.tokens if t is not None]
            vectors = [
                fmt.vectors(r, t.ids, side) for r, t in zip(rows, out.tokenized, strict=True)
            ]
            return HybridResult(multi_vector=vectors, **usage_of(out))
        hybrid = self._hybrid_heads("dense, sparse and multi-vector output")
        unknown = sorted(wanted - set(OUTPUTS))
        if unknown or not wanted:
            raise InvalidRequestError(
                f"outputs must be a non-empty list of {', '.join(OUTPUTS)}"
                + (f"; got {', '.join(map(repr, unknown))}" if unknown else ""),
                param="outputs",
            )
        dense = "dense" in wanted
        if not dense:
            for name in ("dimensions", "normalize"):
                if options.get(name) is not None:
                    raise InvalidRequestError(
                        f"{name} applies to the dense output, which was not asked for",
                        param=name,
                    )
        head = self._config.head.options(options.get("dimensions"), options.get("normalize"))
        items = await _checked(runner, normalize_inputs, inputs, "input")
        per_token = bool(wanted & {"sparse", "multi_vector"})
        max_values = options.get("max_output_values")
        job = Job.prepare(
            items,
            options,
            self._config.prompts,
            add_special_tokens=options.get("add_special_tokens", True),
            want_tokens=per_token,
            max_token_rows=(
                None
                if max_values is None or "multi_vector" not in wanted
                else max_values // hybrid.multi_vector_dim
            ),
        )
        out = await self._run(runner, job)
        rows = [t for t in out.tokens if t is not None]
        return HybridResult(
            dense=head.apply(out.pooled) if dense else None,
            sparse=(
                [hybrid.sparse(r, t.ids) for r, t in zip(rows, out.tokenized, strict=True)]
                if "sparse" in wanted
                else None
            ),
            multi_vector=(
                [hybrid.multi_vector(r) for r in rows] if "multi_vector" in wanted else None
            ),
            **usage_of(out),
        )

    async def _run(self, runner: JobRunner, job: Job) -> JobOutput:
        out = await runner.run(job)
        if self.metrics is not None:
            out.record(self.metrics)
        return out

    @abc.abstractmethod
    def _scheduled(self) -> JobRunner:
        """Where the async API's jobs run; NotReadyError when not serving."""

    @abc.abstractmethod
    def _offloader(self) -> JobRunner:
        """Where blocking tokenizer calls run."""

    @abc.abstractmethod
    def _sync(self, work: Callable[[JobRunner], Coroutine[Any, Any, T]]) -> T:
        """Run ``work`` to completion for the sync API."""

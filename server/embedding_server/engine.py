"""The engine: the offline API and what the HTTP layer calls.

``Engine`` wires the pipeline stages together and owns their resources (the model runner,
the tokenizer thread pool and the one forward thread). Each stage lives in its own module:
configuration resolution (``configuration.py``), request preparation and the two ways to run
a prepared job (``jobs.py``), batching (``scheduler.py``), the forward pass (``runner.py``),
the pooling head (``pooling.py``) and scoring (``scoring.py``). It is usable without HTTP::

    engine = Engine.from_pretrained()                      # packaged all-MiniLM-L6-v2
    vectors = engine.embed(["a sentence", "another"])      # float32 [2, 384]

and inside an event loop (uvicorn's) through the async forms, which go through the
continuous-batching scheduler and return usage and per-stage timings as well::

    await engine.start()                   # warm-up, then engine.ready is True
    result = await engine.aembed(texts, dimensions=256, truncate=Truncation(max_tokens=64))
    await engine.stop(drain=True)

The sync forms are the async ones run elsewhere: before ``start()`` on the calling thread
(length-sorted, budgeted batches, no admission queue: the offline bulk path); after
``start()`` from another thread, on the engine's loop. Calling a sync form from inside the
engine's own loop would deadlock it, so that raises ``RuntimeError`` instead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar, Unpack

import numpy as np
import numpy.typing as npt
import torch

from .attention import probe, select_backend
from .configuration import EngineInfo, describe, resolve_config
from .distributed import SINGLE
from .dtypes import resolve_device, resolve_dtype
from .errors import InvalidRequestError, NotReadyError, UnsupportedModelError
from .fake import is_fake, load_fake
from .heads import Task
from .ipc import EngineClient, Handoff, RemoteRunner
from .jobs import (
    DirectRunner,
    EmbedOptions,
    Job,
    JobRunner,
    ScheduledRunner,
    ScoreOptions,
    TokenEmbedOptions,
    TokenOptions,
    check_options,
    run_sync,
)
from .loading import LoadedModel, load_model
from .metrics import Metrics
from .pooling import FloatArray
from .results import (
    ClassifyResult,
    EmbedResult,
    JobOutput,
    Ranked,
    RerankResult,
    ScoreResult,
    SparseEmbedResult,
    SparseVector,
    StageTimings,
    TokenEmbedResult,
)
from .runner import ModelRunner
from .scheduler import Scheduler
from .scoring import cosine_scores, pair_inputs, rank, text_pairs
from .settings import DEFAULT_MODEL, EngineSettings, ServerSettings
from .tensor_parallel import TensorParallelGroup, TensorParallelModel
from .tokenization import (
    TextInput,
    TextTokenizer,
    Truncation,
    TruncationArg,
    TruncationSide,
    normalize_inputs,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

Inputs = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Sequence[TextInput]
"""One string, a list of strings, one token-id list, or a list of token-id lists (mixed ok)."""

EncodeTask = Literal["embed", "token_embed", "classify", "token_classify", "reward"]
ENCODE_TASKS: tuple[EncodeTask, ...] = (
    "embed",
    "token_embed",
    "classify",
    "token_classify",
    "reward",
)

__all__ = [
    "ClassifyResult",
    "EmbedOptions",
    "EmbedResult",
    "Engine",
    "EngineInfo",
    "Inputs",
    "Ranked",
    "RerankResult",
    "ScoreOptions",
    "ScoreResult",
    "SparseEmbedResult",
    "SparseVector",
    "StageTimings",
    "TokenEmbedOptions",
    "TokenEmbedResult",
    "TokenOptions",
    "Truncation",
    "TruncationArg",
    "TruncationSide",
]


class Engine:
    """An embedding model behind a continuous-batching scheduler."""

    def __init__(
        self,
        settings: EngineSettings,
        loaded: LoadedModel,
        *,
        metrics: Metrics | None = None,
        device: torch.device,
        load_seconds: float = 0.0,
        group: TensorParallelGroup | None = None,
    ) -> None:
        self.settings, self.metrics = settings, metrics
        self._group = group
        self._load_seconds = load_seconds
        self._config = config = resolve_config(settings, loaded, device=device)
        if group is not None and config.task != "embed":
            # Pairs carry segment ids and heads read full hidden states; the ranks' batch
            # broadcast carries neither yet.
            raise UnsupportedModelError(
                f"tensor_parallel_size {settings.tensor_parallel_size} serves task embed only; "
                f"this model's task is {config.task}: serve it with tensor_parallel_size 1"
            )
        attention = select_backend(settings.attention, probe(device, loaded.dtype, loaded.head_dim))
        for reason in attention.passed_over:
            logger.warning("attention: not using %s", reason)
        self._tokenizer = TextTokenizer(
            loaded.tokenizer,
            max_length=config.max_input_tokens,
            embedding_rows=_int_or_none(loaded.config.get("vocab_size")),
        )
        self._runner = ModelRunner(
            loaded.model,
            device=device,
            pooling=config.pooling,
            head=config.batch_head,
            include_prompt=config.include_prompt,
            cpu_threads=config.cpu_threads,
            attention=attention.backend,
            token_pooler=config.sparse,
        )
        self._direct = DirectRunner(
            self._tokenizer,
            self._runner,
            max_tokens=config.max_batch_tokens,
            max_size=config.max_batch_size,
        )
        self._scheduler = Scheduler(
            self._runner,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
            max_queue_tokens=config.max_queue_tokens,
            max_request_tokens=config.max_request_tokens,
            metrics=metrics,
        )
        self._online: ScheduledRunner | None = None
        self._forward_pool: ThreadPoolExecutor | None = None
        self._ready = False
        self._info = describe(
            config,
            loaded,
            device=device,
            attention=attention,
            vocab_size=self._tokenizer.vocab_size,
        )
        info = self._info.to_dict()
        logger.info("engine configured: %s", info, extra={"engine_info": info})

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path_or_id: str = DEFAULT_MODEL, *, metrics: Metrics | None = None, **settings: Any
    ) -> Engine:
        """Load a model: a directory, a Hub id, the packaged default, or ``"fake?..."``.

        ``settings`` are :class:`EngineSettings` fields (``dtype="bfloat16"``,
        ``max_batch_tokens=8192``, ...); ``metrics`` receives queue, stage and batch metrics.
        """
        return cls.from_settings(EngineSettings(model=path_or_id, **settings), metrics=metrics)

    @classmethod
    def from_settings(cls, settings: EngineSettings, *, metrics: Metrics | None = None) -> Engine:
        """Load the model that ``settings`` (or a ServerSettings) names."""
        started = time.perf_counter()
        device = resolve_device(settings.device)
        if is_fake(settings.model):
            if settings.tensor_parallel_size > 1:
                raise UnsupportedModelError(
                    "tensor_parallel_size > 1 needs a real model; the fake backend has no "
                    "weights to split"
                )
            dtype = resolve_dtype(settings.dtype, device)
            loaded = load_fake(settings.model, device=device, dtype=dtype)
            return cls(settings, loaded, metrics=metrics, device=device)
        group = TensorParallelGroup(settings, device) if settings.tensor_parallel_size > 1 else None
        try:
            if group is not None:
                device = group.device
            loaded = load_model(
                settings.model,
                revision=settings.revision,
                cache_dir=settings.cache_dir,
                dtype=settings.dtype,
                device=device,
                shard=group.shard if group is not None else SINGLE,
                task=settings.task,
            )
            if group is not None:
                group.join()
                loaded.model = TensorParallelModel(loaded.model, group)
            seconds = time.perf_counter() - started
            return cls(
                settings,
                loaded,
                metrics=metrics,
                device=device,
                load_seconds=seconds,
                group=group,
            )
        except BaseException:
            if group is not None:
                group.close()
            raise

    def info(self) -> EngineInfo:
        return self._info

    @property
    def ready(self) -> bool:
        """True between a successful warm-up in ``start()`` and ``stop()``, unless the
        device failed or a tensor-parallel rank has."""
        if self._runner.failure is not None:
            return False
        return self._ready and (self._group is None or self._group.failure is None)

    @property
    def tensor_parallel(self) -> TensorParallelGroup | None:
        """The tensor-parallel group (ranks 1..N-1) when ``tensor_parallel_size > 1``."""
        return self._group

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` if the engine can no longer serve: a fatal device error
        (a CUDA device-side assert, an illegal memory access: every later batch would fail
        too), or a tensor-parallel rank that died or hangs. It runs on the forward or a
        watchdog thread."""
        self._runner.on_failure(callback)
        if self._group is not None:
            self._group.on_failure(callback)

    def close(self) -> None:
        """Release what the engine holds beyond memory: stops the tensor-parallel ranks.
        Idempotent; ``stop()`` calls it, and ``with Engine.from_pretrained(...)`` too."""
        if self._group is not None:
            self._group.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the scheduler on the running loop, warm the model up, then become ready."""
        if self._ready:
            return
        loop = asyncio.get_running_loop()
        workers = self.settings.tokenizer_workers
        tokenize_pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        self._forward_pool = ThreadPoolExecutor(1, thread_name_prefix="forward")
        c = self._config
        warmup = self._runner.warmup_batch(c.max_input_tokens, c.max_batch_tokens, c.max_batch_size)
        started = time.perf_counter()
        await loop.run_in_executor(self._forward_pool, self._runner.run, warmup)
        await self._scheduler.start(self._forward_pool)
        self._online = ScheduledRunner(
            self._tokenizer, self._scheduler, loop=loop, tokenize_pool=tokenize_pool
        )
        warm_s = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.model_load_seconds.set(self._load_seconds + warm_s)
        self._ready = True
        logger.info("engine ready (load %.2fs, warm-up %.2fs)", self._load_seconds, warm_s)

    async def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting work; with ``drain`` finish what is queued first."""
        self._ready = False
        await self._scheduler.stop(drain=drain, timeout=timeout)
        if self._online is not None:
            self._online.shutdown()
        if self._forward_pool is not None:
            self._forward_pool.shutdown(wait=False, cancel_futures=True)
        self._online = self._forward_pool = None
        self.close()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

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

    async def arerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        **options: Unpack[ScoreOptions],
    ) -> RerankResult:
        """``documents`` by decreasing relevance to ``query`` (see :meth:`rerank`)."""
        return await self._rerank(self._scheduled(), query, documents, top_n, options)

    async def atokenize(
        self, texts: str | Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """``tokenize`` off the event loop."""
        return await self._offloader().offload(
            functools.partial(self.tokenize, texts, add_special_tokens=add_special_tokens)
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

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
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
        self, texts: str | Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each text, untruncated (what ``/tokenize`` returns)."""
        return self._tokenizer.tokenize(texts, add_special_tokens=add_special_tokens)

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
        items = normalize_inputs(inputs, "input")
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
        items = normalize_inputs(inputs, "input")
        special = options.get("add_special_tokens", True)
        max_values = options.get("max_output_values")
        job = Job.prepare(
            items,
            options,
            self._config.prompts,
            add_special_tokens=special,
            want_tokens=True,
            max_token_rows=None if max_values is None else max_values // self._info.hidden_size,
        )
        out = await self._run(runner, job)
        matrices = [t for t in out.tokens if t is not None]
        normalize = bool(options.get("normalize"))
        return out.token_result(self._config.head.finish_tokens(matrices, normalize))

    async def _score(
        self, runner: JobRunner, a: Inputs, b: Inputs, options: ScoreOptions
    ) -> ScoreResult:
        check_options("score", dict(options), ScoreOptions)
        self._require("scoring", "embed", "score")
        classifier = self._config.classifier
        if classifier is None:
            items, n_a = pair_inputs(a, b)
            out = await self._run(runner, Job.prepare(items, options, self._config.prompts))
            return out.score_result(cosine_scores(out.pooled, n_a))
        out = await self._run(runner, Job.for_pairs(text_pairs(a, b), options))
        scores = classifier.scores(torch.from_numpy(out.pooled)).numpy().astype(np.float32)
        return out.score_result(scores)

    async def _classify(
        self, runner: JobRunner, inputs: Inputs, options: ScoreOptions
    ) -> ClassifyResult:
        check_options("classify", dict(options), ScoreOptions)
        self._require("classification", "classify", "score")
        classifier = self._config.classifier
        assert classifier is not None  # task classify and score have one
        items = normalize_inputs(inputs, "input")
        out = await self._run(runner, Job.prepare(items, options, self._config.prompts))
        probs = classifier.probabilities(torch.from_numpy(out.pooled)).numpy()
        return out.classify_result(probs.astype(np.float32), classifier.labels)

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
        outputs (reward)."""
        check_options(task, dict(options), TokenOptions)
        if options.get("normalize"):
            raise InvalidRequestError(f"normalize does not apply to task {task}", param="normalize")
        self._require(task.replace("_", " "), task)
        classifier = self._config.classifier
        assert classifier is not None  # both tasks have one
        items = normalize_inputs(inputs, "input")
        special = options.get("add_special_tokens", True)
        job = Job.prepare(
            items, options, self._config.prompts, add_special_tokens=special, want_tokens=True
        )
        out = await self._run(runner, job)
        outputs: list[FloatArray] = []
        for states in out.tokens:
            if states is not None:
                logits = classifier.head.project(torch.from_numpy(states))
                values = logits if task == "reward" else classifier.probabilities(logits)
                outputs.append(values.numpy())
        return out.token_result(outputs)

    async def _sparse(
        self, runner: JobRunner, inputs: Inputs, options: TokenOptions
    ) -> SparseEmbedResult:
        check_options("sparse_embed", dict(options), TokenOptions)
        if options.get("normalize"):
            raise InvalidRequestError("normalize does not apply to task sparse", param="normalize")
        self._require("sparse embedding", "sparse")
        items = normalize_inputs(inputs, "input")
        special = options.get("add_special_tokens", True)
        job = Job.prepare(items, options, self._config.prompts, add_special_tokens=special)
        out = await self._run(runner, job)
        return out.sparse_result([SparseVector.from_dense(row) for row in out.pooled])

    async def _rerank(
        self,
        runner: JobRunner,
        query: str,
        documents: Sequence[str],
        top_n: int | None,
        options: ScoreOptions,
    ) -> RerankResult:
        check_options("rerank", dict(options), ScoreOptions)
        if not isinstance(query, str) or not query:
            raise InvalidRequestError("query must be a non-empty string", param="query")
        if isinstance(documents, str) or not documents:
            raise InvalidRequestError("documents must be a non-empty list", param="documents")
        for i, document in enumerate(documents):
            if not isinstance(document, str) or not document:
                raise InvalidRequestError(
                    f"documents[{i}] must be a non-empty string", param="documents"
                )
        if top_n is not None and (isinstance(top_n, bool) or top_n < 0):
            raise InvalidRequestError("top_n must be a non-negative integer", param="top_n")
        result = await self._score(runner, query, list(documents), options)
        return RerankResult(
            results=rank(result.scores, top_n),
            prompt_tokens=result.prompt_tokens,
            truncated_inputs=result.truncated_inputs,
            timings=result.timings,
        )

    async def _run(self, runner: JobRunner, job: Job) -> JobOutput:
        out = await runner.run(job)
        if self.metrics is not None:
            out.record(self.metrics)
        return out

    def _scheduled(self) -> JobRunner:
        if not self._ready or self._online is None:
            raise NotReadyError("the engine is not ready (call and await engine.start())")
        return self._online

    def _offloader(self) -> JobRunner:
        """Where blocking tokenizer calls run: the tokenizer threads once started."""
        return self._online or self._direct

    def handoff(self) -> Handoff:
        """What a front-end process needs to serve this engine's requests (``--api-workers``)."""
        return Handoff.of(self._config, self._info, self._tokenizer)

    def _sync(self, work: Callable[[JobRunner], Coroutine[Any, Any, T]]) -> T:
        return run_sync(work, self._direct, self._online if self._ready else None)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class AttachedEngine(Engine):
    """A front-end process's engine (``--api-workers N``): the :class:`Engine`'s request-level
    code (inputs, prompts, truncation, the per-request head, results) here, every job's
    sequences run by the model and the scheduler of the engine process (:mod:`.ipc`).

    It has no model, so only the async API serves; ``Engine.__init__``, which builds the
    model's stages, is not called."""

    def __init__(
        self,
        settings: ServerSettings,
        handoff: Handoff,
        client: EngineClient,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings, self.metrics = settings, metrics
        self._config, self._info = handoff.config, handoff.info
        self._tokenizer = handoff.tokenizer
        self._group = None
        self._client = client
        self._remote: RemoteRunner | None = None
        self._ready = False

    @classmethod
    async def connect(
        cls, settings: ServerSettings, address: str, *, metrics: Metrics | None = None
    ) -> AttachedEngine:
        """Connect to the engine process at ``address`` and wait until it serves."""
        client = EngineClient(address)
        try:
            handoff = await client.connect()
        except BaseException:
            client.close()
            raise
        return cls(settings, handoff, client, metrics=metrics)

    @property
    def ready(self) -> bool:
        return self._ready and self._client.failure is None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` if the engine process goes away."""
        self._client.on_failure(callback)

    def close(self) -> None:
        self._client.close()

    async def start(self) -> None:
        if self._ready:
            return
        pool = ThreadPoolExecutor(self.settings.tokenizer_workers, thread_name_prefix="tokenize")
        loop = asyncio.get_running_loop()
        self._remote = RemoteRunner(self._tokenizer, self._client, loop=loop, tokenize_pool=pool)
        self._ready = True

    async def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop serving; the HTTP server has already waited for the requests in flight."""
        self._ready = False
        if self._remote is not None:
            self._remote.shutdown()
            self._remote = None
        self.close()

    def _scheduled(self) -> JobRunner:
        if not self.ready or self._remote is None:
            raise NotReadyError("the engine process is not serving")
        return self._remote

    def _offloader(self) -> JobRunner:
        return self._scheduled()

    def _sync(self, work: Callable[[JobRunner], Coroutine[Any, Any, T]]) -> T:
        raise RuntimeError("a front-end's engine serves the async API only")

"""What every engine serves: the request-level half of :class:`~.engine.Engine`.

:class:`ServingEngine` holds the async and sync API (``aembed``, ``embed``, ``score``, ...)
and dispatches each call to its task's module (:mod:`.tasks`: input checks, prompts,
truncation, the job, the per-request head and the result). Where a job's sequences run is
left to the two subclasses: :class:`~.engine.Engine` owns the model, the scheduler and the
forward thread (one process, or the engine process of ``--api-workers``);
:class:`~.ipc.client.AttachedEngine` is a front-end process's, its jobs sent to the engine
process over the wire of :mod:`.ipc`.

Nothing here imports torch, nor does anything it imports, and nothing here computes with it:
weights and heads run in the engine's batches, and what runs per request (truncation,
normalization, a classifier's activation) is numpy. So a front-end process never loads the
model runtime (seconds of start-up and hundreds of MB per process: docs/performance-log.md).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, Unpack

import numpy as np
import numpy.typing as npt

from embedding_server.metrics import Metrics
from embedding_server.request.configuration import EngineConfig, EngineInfo
from embedding_server.request.hybrid import OUTPUTS
from embedding_server.request.jobs import JobRunner, ScoreOptions, TokenOptions, request_priority
from embedding_server.request.media.inputs import ChatTemplate, ImagePreprocessor
from embedding_server.request.pooling import FloatArray
from embedding_server.request.results import SparseVector
from embedding_server.request.scheduler import EngineLoad
from embedding_server.request.tasks import context
from embedding_server.request.tasks.classify import ClassifyResult, classify
from embedding_server.request.tasks.context import Inputs, TaskContext
from embedding_server.request.tasks.embed import EmbedOptions, EmbedResult, embed
from embedding_server.request.tasks.encode import EncodeTask, check_task, encode
from embedding_server.request.tasks.hybrid_embed import HybridOptions, HybridResult, hybrid_embed
from embedding_server.request.tasks.rerank import Document, RerankResult, rerank
from embedding_server.request.tasks.score import score
from embedding_server.request.tasks.sparse import sparse_embed
from embedding_server.request.tasks.token_embed import TokenEmbedOptions, embed_tokens
from embedding_server.request.tasks.token_heads import reward, token_classify
from embedding_server.request.tasks.tokenize import TokenizeOptions
from embedding_server.request.tokenization import TextTokenizer
from embedding_server.settings import EngineSettings

P = ParamSpec("P")
T = TypeVar("T")
Task = Callable[Concatenate[TaskContext, P], Coroutine[Any, Any, T]]
"""A task's function (:mod:`.tasks`): the context, then the request's own arguments."""


def _online(task: Task[P, T]) -> Callable[Concatenate[ServingEngine, P], Coroutine[Any, Any, T]]:
    """The async API method of ``task`` (``a`` and its name): :meth:`ServingEngine.serve`."""

    async def method(self: ServingEngine, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.serve(task, *args, **kwargs)

    method.__name__, method.__doc__ = f"a{task.__name__}", task.__doc__
    return method


class ServingEngine(abc.ABC):
    """The request-level API of an engine; subclasses say where a job's sequences run."""

    settings: EngineSettings
    metrics: Metrics | None
    _config: EngineConfig
    _info: EngineInfo
    _tokenizer: TextTokenizer
    _images: ImagePreprocessor | None = None  # where it takes images (info().modalities)
    _chat: ChatTemplate | None = None  # the tokenizer's, where it has one (messages requests)

    def info(self) -> EngineInfo:
        return self._info

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

    @abc.abstractmethod
    def _scheduled(self) -> JobRunner:
        """Where the async API's jobs run; NotReadyError when not serving."""

    @abc.abstractmethod
    def _offloader(self) -> JobRunner:
        """Where blocking tokenizer calls run."""

    @abc.abstractmethod
    def _sync(self, work: Callable[[JobRunner], Coroutine[Any, Any, T]]) -> T:
        """Run ``work`` to completion for the sync API."""

    # -- dispatch: a task's function, its jobs on one runner --------------------------------
    def _context(self, runner: JobRunner) -> TaskContext:
        return TaskContext(self._config, self._info, runner, self._images, self._chat, self.metrics)

    async def serve(self, task: Task[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``task`` (a function of :mod:`.tasks`), its jobs on the scheduler: the async API."""
        return await task(self._context(self._scheduled()), *args, **kwargs)

    async def serve_unrecorded(self, task: Task[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``task`` as :meth:`serve` runs it, but not counted as a request's work (input
        tokens, truncations): the server's own probes (its golden vectors), not a client's.
        It runs at bulk priority: it is nobody's query, so it never goes ahead of a client's,
        nor makes the scheduler cut bulk batches short for a query (``--bulk-batch-ms``)."""
        runner = self._scheduled()
        context = TaskContext(self._config, self._info, runner, self._images, self._chat, None)
        token = request_priority.set("bulk")
        try:
            return await task(context, *args, **kwargs)
        finally:
            request_priority.reset(token)

    def run(self, task: Task[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``task`` run to completion for sync code: the sync API."""
        return self._sync(lambda runner: task(self._context(runner), *args, **kwargs))

    # -- async API (in the server's loop): the tasks' functions, not the sync methods below -
    aembed = _online(embed)
    aembed_tokens = _online(embed_tokens)
    ascore = _online(score)
    aclassify = _online(classify)
    atoken_classify = _online(token_classify)
    areward = _online(reward)
    asparse_embed = _online(sparse_embed)
    ahybrid_embed = _online(hybrid_embed)
    arerank = _online(rerank)

    async def atokenize(
        self, texts: str | Sequence[str], **options: Unpack[TokenizeOptions]
    ) -> list[list[int]]:
        """``tokenize`` off the event loop."""
        return await self._offloader().offload(functools.partial(self.tokenize, texts, **options))

    async def adetokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """``detokenize`` off the event loop."""
        return await self._offloader().offload(
            functools.partial(self.detokenize, ids, skip_special_tokens=skip_special_tokens)
        )

    async def atoken_strings(self, ids: Sequence[int]) -> list[str]:
        """``token_strings`` off the event loop."""
        return await self._offloader().offload(functools.partial(self.token_strings, ids))

    # -- a request's images and chat messages, before its task -----------------------------
    @property
    def chat_template(self) -> ChatTemplate | None:
        """The tokenizer's chat template (``tokenizer_config.json``), where it has one."""
        return self._chat

    @property
    def takes_images(self) -> bool:
        """Whether the model embeds images (a vision tower and its preprocessing)."""
        return context.takes_images(self._info, self._images)

    def check_takes_images(self, param: str) -> None:
        """A 400 naming ``param`` (an image's field) where the model does not embed images."""
        context.check_takes_images(self._info, self._images, param)

    # -- sync API (no loop needed) ---------------------------------------------------------
    def embed(self, inputs: Inputs, **options: Unpack[EmbedOptions]) -> FloatArray:
        """Embed inputs; float32 numpy array ``[n, d]``."""
        return self.embed_full(inputs, **options).embeddings

    def embed_full(self, inputs: Inputs, **options: Unpack[EmbedOptions]) -> EmbedResult:
        """Like ``embed`` but returns the EmbedResult (usage, truncation count, timings)."""
        return self.run(embed, inputs, **options)

    def embed_tokens(
        self, inputs: Inputs, **options: Unpack[TokenEmbedOptions]
    ) -> list[FloatArray]:
        """Per-token hidden states, one float32 ``[len_i, hidden]`` array per input."""
        return self.run(embed_tokens, inputs, **options).embeddings

    def score(
        self, a: Inputs, b: Inputs, **options: Unpack[ScoreOptions]
    ) -> npt.NDArray[np.float32]:
        """Scores ``[n]`` of pairs, as vLLM's ``LLM.score`` (:func:`.tasks.score.score`)."""
        return self.run(score, a, b, **options).scores

    def classify(self, inputs: Inputs, **options: Unpack[ScoreOptions]) -> ClassifyResult:
        """Class probabilities ``[n, num_labels]`` and labels, as vLLM's ``LLM.classify``."""
        return self.run(classify, inputs, **options)

    def token_classify(self, inputs: Inputs, **options: Unpack[TokenOptions]) -> list[FloatArray]:
        """Label probabilities of every token (:func:`.tasks.token_heads.token_classify`)."""
        return self.run(token_classify, inputs, **options).embeddings

    def reward(self, inputs: Inputs, **options: Unpack[TokenOptions]) -> list[FloatArray]:
        """A reward model's outputs at every token (:func:`.tasks.token_heads.reward`)."""
        return self.run(reward, inputs, **options).embeddings

    def sparse_embed(self, inputs: Inputs, **options: Unpack[TokenOptions]) -> list[SparseVector]:
        """SPLADE sparse vectors over the vocabulary (:func:`.tasks.sparse.sparse_embed`)."""
        return self.run(sparse_embed, inputs, **options).vectors

    def hybrid_embed(
        self, inputs: Inputs, outputs: Sequence[str] = OUTPUTS, **options: Unpack[HybridOptions]
    ) -> HybridResult:
        """Any of a bge-m3-shaped model's three outputs from one forward pass
        (:func:`.tasks.hybrid_embed.hybrid_embed`)."""
        return self.run(hybrid_embed, inputs, outputs, **options)

    def rerank(
        self,
        query: Document,
        documents: Sequence[Document],
        *,
        top_n: int | None = None,
        **options: Unpack[ScoreOptions],
    ) -> RerankResult:
        """``documents`` by decreasing relevance to ``query`` (the first ``top_n`` when
        given): a cross-encoder's scores, or cosine similarity for an embedding model."""
        return self.run(rerank, query, documents, top_n=top_n, **options)

    def encode(
        self, inputs: Inputs, *, task: EncodeTask = "embed", **options: Any
    ) -> list[FloatArray]:
        """One array per input for a pooling ``task``, as vLLM's ``LLM.encode``
        (:func:`.tasks.encode.encode`)."""
        check_task(task)
        return self.run(encode, inputs, task=task, **options)

    def tokenize(
        self, texts: str | Sequence[str], **options: Unpack[TokenizeOptions]
    ) -> list[list[int]]:
        """Token ids of each text, untruncated (what ``/tokenize`` returns). With
        ``max_tokens``, a text holding more is refused (413) after reading a bounded part of
        it, never tokenized whole (:meth:`TextTokenizer.tokenize`)."""
        return self._tokenizer.tokenize(texts, **options)

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of token ids (special tokens dropped unless asked for)."""
        return self._tokenizer.detokenize(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The tokenizer's own string for each id (``convert_ids_to_tokens``: WordPiece ``##``
        and byte-level ``Ġ`` markers kept), as vLLM's ``/tokenize`` returns them."""
        return self._tokenizer.token_strings(ids)

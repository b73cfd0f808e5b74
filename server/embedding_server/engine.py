"""The engine: the offline API and what the HTTP layer calls.

``Engine`` composes the two planes and owns their resources (the model runner, the tokenizer
thread pool and the one forward thread). The device plane (``device/``: everything that
imports torch) loads the model and resolves the configuration (``device/loading.py``,
``device/configuration.py``) and runs forward passes (``device/runner.py``); the request
plane prepares jobs and runs them (``jobs.py``), batches them (``scheduler.py``) and applies
the per-request head (``pooling.py``) and scoring (``scoring.py``). The request-level API
below is :class:`~.serving.ServingEngine`'s, shared with the front-ends of ``--api-workers``.
It is usable without HTTP::

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
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from embedding_server.device.attention import Backend
from embedding_server.device.configuration import (
    DeviceHeads,
    choose_attention,
    describe,
    prefix_cache_refusal,
    resolve_config,
)
from embedding_server.device.distributed import SINGLE
from embedding_server.device.dtypes import resolve_device, resolve_dtype
from embedding_server.device.fake import (
    FakeRunner,
    fake_chat_template,
    fake_images,
    fake_info,
    is_fake,
    load_fake,
)
from embedding_server.device.fingerprint import with_fingerprint
from embedding_server.device.generic import tensor_parallel_refusal
from embedding_server.device.loading import LoadedModel, load_configured, model_backend
from embedding_server.device.pooling_guess import pooling_guess
from embedding_server.device.prefix_cache import PrefixCache
from embedding_server.device.preflight import inspect_before_download
from embedding_server.device.runner import ModelRunner
from embedding_server.device.tensor_parallel import TensorParallelGroup, TensorParallelModel
from embedding_server.errors import InvalidRequestError, NotReadyError, UnsupportedModelError
from embedding_server.ipc.messages import Handoff
from embedding_server.metrics import Metrics
from embedding_server.request.configuration import EngineInfo
from embedding_server.request.jobs import (
    DirectRunner,
    JobRunner,
    ScheduledRunner,
    ScoreOptions,
    TokenOptions,
    run_sync,
)
from embedding_server.request.media.inputs import ChatTemplate, ImagePreprocessor
from embedding_server.request.media.preprocessing import ImageProcessor
from embedding_server.request.results import Ranked, SparseVector, StageTimings
from embedding_server.request.scheduler import EngineLoad, Scheduler
from embedding_server.request.sequences import SequenceInput
from embedding_server.request.serving import ServingEngine
from embedding_server.request.tasks.classify import ClassifyResult
from embedding_server.request.tasks.context import Inputs
from embedding_server.request.tasks.embed import EmbedOptions, EmbedResult
from embedding_server.request.tasks.encode import ENCODE_TASKS, EncodeTask
from embedding_server.request.tasks.hybrid_embed import HybridOptions, HybridResult
from embedding_server.request.tasks.rerank import RerankResult
from embedding_server.request.tasks.score import ScoreResult
from embedding_server.request.tasks.sparse import SparseEmbedResult
from embedding_server.request.tasks.token_embed import TokenEmbedOptions, TokenEmbedResult
from embedding_server.request.tokenization import TextTokenizer
from embedding_server.request.truncation import Truncation, TruncationArg, TruncationSide
from embedding_server.settings import DEFAULT_MODEL, EngineSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "ENCODE_TASKS",
    "ClassifyResult",
    "EmbedOptions",
    "EmbedResult",
    "EncodeTask",
    "Engine",
    "EngineInfo",
    "HybridOptions",
    "HybridResult",
    "Inputs",
    "Ranked",
    "RerankResult",
    "ScoreOptions",
    "ScoreResult",
    "ServingEngine",
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


def _prefix_cache(
    settings: EngineSettings, loaded: LoadedModel, attention: Backend, metrics: Metrics | None
) -> PrefixCache | None:
    """The prompt-prefix cache ``--prefix-cache-bytes`` asks for, or its refusal naming why
    the model cannot use it exactly; None when off."""
    if not settings.prefix_cache_bytes:
        return None
    refusal = prefix_cache_refusal(settings, loaded, attention)
    if refusal is not None:
        raise InvalidRequestError(
            f"prefix_cache_bytes cannot be used with this model: {refusal}",
            param="prefix_cache_bytes",
        )
    return PrefixCache(settings.prefix_cache_bytes, metrics=metrics)


class Engine(ServingEngine):
    """An embedding model behind a continuous-batching scheduler, in this process."""

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
        guess = pooling_guess(settings, loaded, config)
        if guess is not None:
            logger.warning("model %r: %s", settings.model, guess)
        heads = DeviceHeads.of(config, loaded, device)
        attention = choose_attention(settings, loaded, device)
        for reason in attention.passed_over:
            logger.warning("attention: not using %s", reason)
        self._tokenizer = TextTokenizer(
            loaded.tokenizer,
            max_length=config.max_input_tokens,
            embedding_rows=_int_or_none(loaded.config.get("vocab_size")),
        )
        fake = loaded.backend == "fake"
        prefix_cache = _prefix_cache(settings, loaded, attention.backend, metrics)
        self._runner = (FakeRunner if fake else ModelRunner)(
            loaded.model,
            device=device,
            pooling=config.pooling,
            head=heads.batch_head,
            include_prompt=config.include_prompt,
            instruction=loaded.instruction,
            cpu_threads=config.cpu_threads,
            attention=attention.backend,
            token_pooler=heads.sparse,
            token_head=heads.token_head,
            # oneDNN's bfloat16/float16 matmuls on the CPU compile a kernel per shape. Only
            # length buckets keep the fillers in one bucket of length 1 (sdpa_padded would
            # pad each to the longest text; the transformers backend pads its own way).
            shape_grid=loaded.backend == "native"
            and device.type == "cpu"
            and attention.backend is Backend.SDPA_BUCKETED
            and loaded.dtype in (torch.bfloat16, torch.float16),
            prefix_cache=prefix_cache,
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
            bulk_batch_seconds=config.bulk_batch_seconds,
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
        if fake:
            self._info = fake_info(loaded, self._info)
        if prefix_cache is not None:
            self._info = dataclasses.replace(self._info, prefix_cache_bytes=prefix_cache.max_bytes)
        started = time.perf_counter()
        self._info = with_fingerprint(
            self._info,
            loaded,
            config,
            code=loaded.backend == "transformers" and settings.trust_remote_code,
        )
        logger.info(
            "embedding fingerprint %s (%d files, %.3f s)",
            self._info.fingerprint,
            len(self._info.fingerprint_inputs["files"]),
            time.perf_counter() - started,
        )
        self._images, self._chat = _inputs_of(loaded, self._info)
        info = self._info.to_dict()
        logger.info(
            "engine configured: %s backend, %s (%s), attention %s: %s",
            self._info.backend,
            self._info.architecture,
            self._info.model_type,
            self._info.attention,
            info,
            extra={"engine_info": info},
        )
        if metrics is not None:
            metrics.model_info.labels(
                backend=self._info.backend,
                model_type=self._info.model_type,
                architecture=self._info.architecture,
                attention=self._info.attention,
                fingerprint=self._info.fingerprint,
            ).set(1)

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
            if settings.quantization != "none":
                raise UnsupportedModelError(
                    "quantization int8 needs a real model; the fake backend has no weights",
                    param="quantization",
                )
            dtype = resolve_dtype(settings.dtype, device)
            loaded = load_fake(settings.model, device=device, dtype=dtype)
            return cls(settings, loaded, metrics=metrics, device=device)
        if settings.tensor_parallel_size > 1:
            # Decided from config.json before any rank starts: the transformers backend runs
            # one whole module and cannot be split.
            backend, config = model_backend(
                settings.model,
                revision=settings.revision,
                cache_dir=settings.cache_dir,
                backend=settings.backend,
            )
            if backend == "transformers":
                raise UnsupportedModelError(
                    tensor_parallel_refusal(settings.model, config, settings.tensor_parallel_size)
                )
        # What inspect would refuse, refused before a Hub model's weights are downloaded.
        inspect_before_download(settings)
        group = TensorParallelGroup(settings, device) if settings.tensor_parallel_size > 1 else None
        try:
            if group is not None:
                device = group.device
            loaded = load_configured(
                settings, device=device, shard=group.shard if group is not None else SINGLE
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

    def load(self) -> EngineLoad:
        scheduler = self._scheduler
        return EngineLoad(
            scheduler.queued_tokens, scheduler.running_tokens, scheduler.backlog_seconds
        )

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
        prompted = self._prompt_warmup()
        if prompted:  # the declared prompts' states, into the prefix cache before traffic
            await loop.run_in_executor(self._forward_pool, self._runner.run, prompted)
        await self._scheduler.start(self._forward_pool)
        self._online = ScheduledRunner(
            self._tokenizer, self._scheduler, loop=loop, tokenize_pool=tokenize_pool
        )
        warm_s = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.model_load_seconds.set(self._load_seconds + warm_s)
        self._ready = True
        logger.info("engine ready (load %.2fs, warm-up %.2fs)", self._load_seconds, warm_s)

    def _prompt_warmup(self) -> list[SequenceInput]:
        """With a prefix cache: one short text after each prompt the model declares, so
        that every declared prompt is cached at start (others are on first use)."""
        if self._runner.prefix_cache is None:
            return []
        prompts = [p for p in self._info.prompts.values() if p]
        sequences = []
        for prompt in dict.fromkeys(prompts):
            (encoded,) = self._tokenizer.encode(["a"], truncation=Truncation(), prompt=prompt)
            if 0 < encoded.prompt_length < len(encoded.ids):
                sequences.append(SequenceInput(encoded.ids, encoded.prompt_length))
        return sequences

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

    def _scheduled(self) -> JobRunner:
        if not self._ready or self._online is None:
            raise NotReadyError("the engine is not ready (call and await engine.start())")
        return self._online

    def _offloader(self) -> JobRunner:
        """Where blocking tokenizer calls run: the tokenizer threads once started."""
        return self._online or self._direct

    def handoff(self) -> Handoff:
        """What a front-end process needs to serve this engine's requests (``--api-workers``)."""
        return Handoff(self._config, self._info, self._tokenizer, self._images, self._chat)

    def _sync(self, work: Callable[[JobRunner], Coroutine[Any, Any, T]]) -> T:
        return run_sync(work, self._direct, self._online if self._ready else None)


async def load_engine(settings: EngineSettings, metrics: Metrics) -> Engine:
    """Load the model ``settings`` names, off the event loop: how a one-process server gets
    its engine (``create_app(settings, connect=load_engine)``)."""
    return await asyncio.to_thread(Engine.from_settings, settings, metrics=metrics)


def _inputs_of(
    loaded: LoadedModel, info: EngineInfo
) -> tuple[ImagePreprocessor | None, ChatTemplate | None]:
    """The model's image preprocessing (where ``info.modalities`` lists images: its
    ``preprocessor_config.json``) and its tokenizer's chat template, from the model
    directory. A model that takes images without a processor we can build is refused: its
    images could not be served exactly."""
    if loaded.backend == "fake":
        return fake_images(loaded), fake_chat_template(loaded)
    images: ImagePreprocessor | None = None
    if "image" in info.modalities:
        if loaded.path is not None:
            images = ImageProcessor.from_pretrained(loaded.path, loaded.config)
        if images is None:
            raise UnsupportedModelError(
                f"{loaded.name} ({loaded.architecture}) has a vision tower but no image "
                "preprocessing this server can build (preprocessor_config.json)"
            )
    try:
        chat = ChatTemplate.from_directory(loaded.path)
    except ValueError as error:
        logger.warning("%s: no chat template served: %s", loaded.name, error)
        chat = None
    return images, chat


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

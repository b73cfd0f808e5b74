"""The engine: the offline API and what the HTTP layer calls.

``Engine`` ties the pipeline stages together (tokenization -> scheduler -> packed forward ->
pooling head) and owns their resources: the model, the tokenizer thread pool and the one
forward thread. It is usable without HTTP::

    engine = Engine.from_pretrained()                      # packaged all-MiniLM-L6-v2
    vectors = engine.embed(["a sentence", "another"])      # float32 [2, 384]

and inside an event loop (uvicorn's) through the async forms, which go through the
continuous-batching scheduler and return usage and per-stage timings as well::

    await engine.start()                   # warm-up, then engine.ready is True
    result = await engine.aembed(texts, dimensions=256, truncate=Truncation.from_openai(-1))
    await engine.stop(drain=True)

The sync forms work without a running loop: before ``start()`` they run batches directly
(length-sorted, budgeted, no admission queue: the offline bulk path); after ``start()`` from
another thread they submit to the engine's loop. Calling a sync form from inside the engine's
own loop would deadlock it, so that raises ``RuntimeError`` instead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from .attention import backend_name
from .dtypes import cpu_thread_budget, dtype_name, resolve_device, resolve_dtype
from .errors import InvalidRequestError, NotReadyError, UnsupportedModelError
from .fake import is_fake, load_fake
from .loading import LoadedModel, declared_matryoshka, load_model
from .metrics import Metrics
from .pooling import (
    POOLING_METHODS,
    FloatArray,
    Matryoshka,
    PoolingMethod,
    build_matryoshka,
    finalize,
)
from .runner import BatchOutput, ModelRunner, SequenceInput
from .scheduler import Scheduler, plan_offline_batches
from .settings import CPU_BATCH_TOKENS, DEFAULT_MODEL, GPU_BATCH_TOKENS, EngineSettings
from .tokenization import (
    TextInput,
    TextTokenizer,
    TokenizedInput,
    Truncation,
    TruncationArg,
    TruncationSide,
    normalize_inputs,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

Inputs = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Sequence[TextInput]
"""One string, a list of strings, one token-id list, or a list of token-id lists (mixed ok)."""

__all__ = [
    "EmbedResult",
    "Engine",
    "EngineInfo",
    "Inputs",
    "ScoreResult",
    "StageTimings",
    "TokenEmbedResult",
    "Truncation",
    "TruncationArg",
    "TruncationSide",
]


@dataclass(frozen=True, slots=True)
class StageTimings:
    """Seconds one request spent per pipeline stage (TEI-style timing headers)."""

    tokenize: float = 0.0
    queue: float = 0.0
    forward: float = 0.0
    pool: float = 0.0

    @property
    def total(self) -> float:
        return self.tokenize + self.queue + self.forward + self.pool

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class EmbedResult:
    """Embeddings of one request plus what the HTTP layer reports about it."""

    embeddings: FloatArray  # [n, d] float32
    prompt_tokens: int  # tokens embedded (after truncation): usage
    token_counts: list[int]  # per input, after truncation
    truncated_inputs: int  # how many inputs were truncated
    timings: StageTimings = field(default_factory=StageTimings)


@dataclass(frozen=True)
class TokenEmbedResult:
    """Per-token hidden states (float32 ``[len_i, hidden]`` per input) and their token ids."""

    embeddings: list[FloatArray]
    token_ids: list[list[int]]
    prompt_tokens: int
    truncated_inputs: int
    timings: StageTimings = field(default_factory=StageTimings)


@dataclass(frozen=True)
class ScoreResult:
    """Cosine similarities of text pairs (``[n]`` float32)."""

    scores: npt.NDArray[np.float32]
    prompt_tokens: int
    truncated_inputs: int
    timings: StageTimings = field(default_factory=StageTimings)


@dataclass(frozen=True)
class EngineInfo:
    """The resolved configuration: logged once at load and served by /info."""

    model: str
    model_path: str | None
    architecture: str
    model_type: str
    hidden_size: int
    dimensions: int
    """Default output dimensions (after Dense layers and any configured truncation)."""
    max_input_tokens: int
    pooling: PoolingMethod
    normalize: bool
    dtype: str
    device: str
    attention: str
    sliding_window: int | None
    """Attention window (tokens, transformers' ``sliding_window``) of the layers that slide;
    None when every layer sees the whole input."""
    prompts: dict[str, str]
    default_prompt_name: str | None
    matryoshka: bool
    matryoshka_dimensions: list[int] | None
    """Allowed truncation sizes; None with ``matryoshka`` true means any size up to full."""
    full_dimensions: int
    vocab_size: int
    cpu_threads: int
    """torch intra-op threads for CPU forward passes."""
    max_batch_tokens: int
    max_batch_size: int
    max_queue_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Engine:
    """An embedding model behind a continuous-batching scheduler."""

    def __init__(
        self,
        settings: EngineSettings,
        loaded: LoadedModel,
        *,
        metrics: Metrics | None = None,
        device: torch.device,
        dtype: torch.dtype,
        load_seconds: float = 0.0,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._loaded = loaded
        self._device, self._dtype = device, dtype
        self._load_seconds = load_seconds
        st = loaded.st
        positions = loaded.model.max_positions
        declared = st.max_seq_length or min(loaded.tokenizer_max_length or positions, positions)
        if settings.max_model_len is not None and settings.max_model_len > positions:
            raise InvalidRequestError(
                f"max_model_len={settings.max_model_len} exceeds the {positions} positions the "
                "model supports",
                param="max_model_len",
            )
        max_len = settings.max_model_len or min(declared, positions)
        if settings.max_batch_tokens is None:
            default = GPU_BATCH_TOKENS if device.type == "cuda" else CPU_BATCH_TOKENS
            self._max_batch_tokens = max(max_len, min(default, settings.max_queue_tokens))
        else:
            self._max_batch_tokens = settings.max_batch_tokens
        if max_len > self._max_batch_tokens:
            raise InvalidRequestError(
                f"max_batch_tokens={self._max_batch_tokens} is smaller than one maximal "
                f"input ({max_len} tokens); raise it or lower max_model_len",
                param="max_batch_tokens",
            )
        if settings.max_queue_tokens < self._max_batch_tokens:
            raise InvalidRequestError(
                f"max_queue_tokens={settings.max_queue_tokens} is smaller than one batch "
                f"({self._max_batch_tokens} tokens)",
                param="max_queue_tokens",
            )
        self._tokenizer = TextTokenizer(loaded.tokenizer, max_length=max_len)

        if settings.pooling != "auto":
            pooling: PoolingMethod = settings.pooling
        elif st.unsupported_pooling is not None:
            raise UnsupportedModelError(
                f"{st.unsupported_pooling}. Set pooling to one of {', '.join(POOLING_METHODS)} "
                "to serve the model with that single method instead (its vectors will then "
                "differ from what sentence-transformers computes)"
            )
        else:
            pooling = st.pooling or loaded.default_pooling
        self._pooling = pooling
        self._normalize = (
            settings.normalize
            if settings.normalize is not None
            else (st.normalize if st.present else True)
        )
        self._runner = ModelRunner(
            loaded.model,
            device=device,
            pooling=pooling,
            dense=st.dense,
            include_prompt=st.include_prompt,
            cpu_threads=cpu_thread_budget(),
        )
        declared_flag, declared_dims = declared_matryoshka(loaded.config, st)
        self._matryoshka: Matryoshka = build_matryoshka(
            self._runner.output_dim,
            declared=declared_flag,
            declared_dims=declared_dims,
            override_dims=settings.matryoshka_dimensions,
            default_dims=settings.dimensions,
        )
        self._prompts = dict(st.prompts)
        self._default_prompt_name = settings.default_prompt_name or st.default_prompt_name
        if self._default_prompt_name and self._default_prompt_name not in self._prompts:
            raise InvalidRequestError(
                f"default_prompt_name={self._default_prompt_name!r} is not one of the model's "
                f"prompts {sorted(self._prompts)}",
                param="default_prompt_name",
            )

        self._scheduler = Scheduler(
            self._run_batch,
            max_batch_tokens=self._max_batch_tokens,
            max_batch_size=settings.max_batch_size,
            max_queue_tokens=settings.max_queue_tokens,
            metrics=metrics,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tokenize_pool: ThreadPoolExecutor | None = None
        self._forward_pool: ThreadPoolExecutor | None = None
        self._ready = False
        self._info = self._build_info()
        logger.info(
            "engine configured: %s",
            self._info.to_dict(),
            extra={"engine_info": self._info.to_dict()},
        )

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
        dtype = resolve_dtype(settings.dtype, device)
        if is_fake(settings.model):
            loaded = load_fake(settings.model, device=device, dtype=dtype)
        else:
            loaded = load_model(
                settings.model,
                revision=settings.revision,
                cache_dir=settings.cache_dir,
                dtype=dtype,
                device=device,
            )
        return cls(
            settings,
            loaded,
            metrics=metrics,
            device=device,
            dtype=dtype,
            load_seconds=time.perf_counter() - started,
        )

    def _build_info(self) -> EngineInfo:
        loaded = self._loaded
        m = self._matryoshka
        return EngineInfo(
            model=loaded.name,
            model_path=str(loaded.path) if loaded.path else None,
            architecture=loaded.architecture,
            model_type=str(loaded.config.get("model_type", "")),
            hidden_size=loaded.model.hidden_size,
            dimensions=m.default,
            max_input_tokens=self._tokenizer.max_length,
            pooling=self._pooling,
            normalize=self._normalize,
            dtype=dtype_name(self._dtype),
            device=str(self._device),
            attention=backend_name(self._device, self._dtype),
            sliding_window=loaded.model.sliding_window,
            prompts=dict(self._prompts),
            default_prompt_name=self._default_prompt_name,
            matryoshka=m.supported,
            matryoshka_dimensions=m.to_list(),
            full_dimensions=m.full,
            vocab_size=self._tokenizer.vocab_size,
            cpu_threads=self._runner.cpu_threads,
            max_batch_tokens=self._max_batch_tokens,
            max_batch_size=self.settings.max_batch_size,
            max_queue_tokens=self.settings.max_queue_tokens,
        )

    def info(self) -> EngineInfo:
        return self._info

    @property
    def ready(self) -> bool:
        """True between a successful warm-up in ``start()`` and ``stop()``."""
        return self._ready

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the scheduler on the running loop, warm the model up, then become ready."""
        if self._ready:
            return
        self._loop = asyncio.get_running_loop()
        self._tokenize_pool = ThreadPoolExecutor(
            self.settings.tokenizer_workers, thread_name_prefix="tokenize"
        )
        self._forward_pool = ThreadPoolExecutor(1, thread_name_prefix="forward")
        started = time.perf_counter()
        await self._loop.run_in_executor(self._forward_pool, self._runner.run, self._warmup_batch())
        await self._scheduler.start(self._forward_pool)
        warm_s = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.model_load_seconds.set(self._load_seconds + warm_s)
        self._ready = True
        logger.info("engine ready (load %.2fs, warm-up %.2fs)", self._load_seconds, warm_s)

    async def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting work; with ``drain`` finish what is queued first."""
        self._ready = False
        await self._scheduler.stop(drain=drain, timeout=timeout)
        for pool in (self._tokenize_pool, self._forward_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._tokenize_pool = self._forward_pool = None
        self._loop = None

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _warmup_batch(self) -> list[SequenceInput]:
        max_len = self._tokenizer.max_length
        if self._device.type == "cuda":
            # Surface out-of-memory at start, not under load: fill the whole token budget.
            n = max(1, min(self.settings.max_batch_size, self._max_batch_tokens // max_len))
            return [SequenceInput([1] * max_len) for _ in range(n)]
        return [SequenceInput([1] * min(16, max_len)), SequenceInput([1] * min(7, max_len))]

    def _run_batch(self, seqs: Sequence[SequenceInput]) -> BatchOutput:
        return self._runner.run(seqs)

    # -- request preparation ---------------------------------------------------------------
    def _resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        if prompt is not None and prompt_name is not None:
            raise InvalidRequestError(
                "give either prompt or prompt_name, not both", param="prompt_name"
            )
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string", param="prompt")
            return prompt
        name = prompt_name if prompt_name is not None else self._default_prompt_name
        if name is None:
            return None
        if name not in self._prompts:
            available = ", ".join(sorted(self._prompts)) or "none"
            raise InvalidRequestError(
                f"unknown prompt_name {name!r}; this model's prompts: {available}",
                param="prompt_name",
            )
        return self._prompts[name]

    def _resolve_head(self, dimensions: int | None, normalize: bool | None) -> tuple[int, bool]:
        dims = self._matryoshka.resolve(dimensions)
        if normalize is not None and not isinstance(normalize, bool):
            raise InvalidRequestError("normalize must be a boolean", param="normalize")
        return dims, self._normalize if normalize is None else normalize

    def _encode(
        self,
        items: list[TextInput],
        prompt: str | None,
        truncate: TruncationArg,
        add_special_tokens: bool,
        param: str,
    ) -> list[TokenizedInput]:
        return self._tokenizer.encode(
            items,
            truncation=Truncation.coerce(truncate),
            add_special_tokens=add_special_tokens,
            prompt=prompt,
            param=param,
        )

    async def _process(
        self,
        items: list[TextInput],
        *,
        prompt: str | None,
        truncate: TruncationArg,
        add_special_tokens: bool,
        want_tokens: bool,
        param: str,
    ) -> tuple[list[TokenizedInput], FloatArray, list[FloatArray | None], StageTimings]:
        if not self._ready or self._loop is None or self._tokenize_pool is None:
            raise NotReadyError("the engine is not ready (call and await engine.start())")
        started = time.perf_counter()
        tokenized = await self._loop.run_in_executor(
            self._tokenize_pool,
            functools.partial(self._encode, items, prompt, truncate, add_special_tokens, param),
        )
        tokenize_s = time.perf_counter() - started
        out = await self._scheduler.submit(
            [SequenceInput(t.ids, t.prompt_length, want_tokens) for t in tokenized]
        )
        timings = StageTimings(
            tokenize=tokenize_s, queue=out.queue_s, forward=out.forward_s, pool=out.pool_s
        )
        return tokenized, out.pooled, out.tokens, timings

    def _process_offline(
        self,
        items: list[TextInput],
        *,
        prompt: str | None,
        truncate: TruncationArg,
        add_special_tokens: bool,
        want_tokens: bool,
        param: str,
    ) -> tuple[list[TokenizedInput], FloatArray, list[FloatArray | None], StageTimings]:
        started = time.perf_counter()
        tokenized = self._encode(items, prompt, truncate, add_special_tokens, param)
        tokenize_s = time.perf_counter() - started
        pooled: list[FloatArray | None] = [None] * len(tokenized)
        tokens: list[FloatArray | None] = [None] * len(tokenized)
        forward_s = pool_s = 0.0
        for chunk in plan_offline_batches(
            [len(t.ids) for t in tokenized],
            self._max_batch_tokens,
            self.settings.max_batch_size,
        ):
            out = self._runner.run(
                [
                    SequenceInput(tokenized[i].ids, tokenized[i].prompt_length, want_tokens)
                    for i in chunk
                ]
            )
            forward_s += out.forward_s
            pool_s += out.pool_s
            for row, i in enumerate(chunk):
                pooled[i] = out.pooled[row]
                tokens[i] = out.tokens[row]
        stacked = np.stack([p for p in pooled if p is not None])
        return (
            tokenized,
            stacked,
            tokens,
            StageTimings(tokenize=tokenize_s, forward=forward_s, pool=pool_s),
        )

    def _record(self, tokenized: list[TokenizedInput], timings: StageTimings) -> None:
        if self.metrics is None:
            return
        self.metrics.input_tokens.inc(sum(len(t.ids) for t in tokenized))
        truncated = sum(t.truncated for t in tokenized)
        if truncated:
            self.metrics.truncated_inputs.inc(truncated)
        for stage, seconds in timings.to_dict().items():
            self.metrics.stage_seconds.labels(stage=stage).observe(seconds)

    def _embed_result(
        self,
        tokenized: list[TokenizedInput],
        pooled: FloatArray,
        timings: StageTimings,
        dims: int,
        norm: bool,
    ) -> EmbedResult:
        self._record(tokenized, timings)
        return EmbedResult(
            embeddings=finalize(pooled, dimensions=dims, normalize=norm),
            prompt_tokens=sum(len(t.ids) for t in tokenized),
            token_counts=[len(t.ids) for t in tokenized],
            truncated_inputs=sum(t.truncated for t in tokenized),
            timings=timings,
        )

    def _token_result(
        self,
        tokenized: list[TokenizedInput],
        tokens: list[FloatArray | None],
        timings: StageTimings,
    ) -> TokenEmbedResult:
        self._record(tokenized, timings)
        return TokenEmbedResult(
            embeddings=[t for t in tokens if t is not None],
            token_ids=[list(t.ids) for t in tokenized],
            prompt_tokens=sum(len(t.ids) for t in tokenized),
            truncated_inputs=sum(t.truncated for t in tokenized),
            timings=timings,
        )

    def _score_result(
        self, tokenized: list[TokenizedInput], pooled: FloatArray, n_a: int, timings: StageTimings
    ) -> ScoreResult:
        self._record(tokenized, timings)
        vectors = finalize(pooled, dimensions=pooled.shape[1], normalize=True)
        a, b = vectors[:n_a], vectors[n_a:]
        if len(a) == 1 and len(b) > 1:
            a = np.repeat(a, len(b), axis=0)
        elif len(b) == 1 and len(a) > 1:
            b = np.repeat(b, len(a), axis=0)
        scores = np.einsum("ij,ij->i", a, b).astype(np.float32)
        return ScoreResult(
            scores=scores,
            prompt_tokens=sum(len(t.ids) for t in tokenized),
            truncated_inputs=sum(t.truncated for t in tokenized),
            timings=timings,
        )

    def _score_inputs(self, a: Inputs, b: Inputs) -> tuple[list[TextInput], int]:
        items_a = normalize_inputs(a, "text_1")
        items_b = normalize_inputs(b, "text_2")
        if len(items_a) != len(items_b) and 1 not in (len(items_a), len(items_b)):
            raise InvalidRequestError(
                f"text_1 has {len(items_a)} inputs and text_2 has {len(items_b)}; give equal "
                "numbers or one on either side",
                param="text_2",
            )
        return items_a + items_b, len(items_a)

    # -- async API (inside the server's loop) ----------------------------------------------
    async def aembed(
        self,
        inputs: Inputs,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate: TruncationArg = True,
        add_special_tokens: bool = True,
    ) -> EmbedResult:
        """Embed inputs through the scheduler; float32 ``[n, d]`` plus usage and timings."""
        items = normalize_inputs(inputs, "input")
        dims, norm = self._resolve_head(dimensions, normalize)
        text_prompt = self._resolve_prompt(prompt, prompt_name)
        tokenized, pooled, _, timings = await self._process(
            items,
            prompt=text_prompt,
            truncate=truncate,
            add_special_tokens=add_special_tokens,
            want_tokens=False,
            param="input",
        )
        return self._embed_result(tokenized, pooled, timings, dims, norm)

    async def aembed_tokens(
        self,
        inputs: Inputs,
        *,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate: TruncationArg = True,
        add_special_tokens: bool = True,
    ) -> TokenEmbedResult:
        """Per-token final hidden states (float32 ``[len_i, hidden]`` per input)."""
        items = normalize_inputs(inputs, "input")
        text_prompt = self._resolve_prompt(prompt, prompt_name)
        tokenized, _, tokens, timings = await self._process(
            items,
            prompt=text_prompt,
            truncate=truncate,
            add_special_tokens=add_special_tokens,
            want_tokens=True,
            param="input",
        )
        return self._token_result(tokenized, tokens, timings)

    async def ascore(
        self,
        a: Inputs,
        b: Inputs,
        *,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate: TruncationArg = True,
    ) -> ScoreResult:
        """Cosine similarity of pairs: equal-length lists, or one text against many."""
        items, n_a = self._score_inputs(a, b)
        text_prompt = self._resolve_prompt(prompt, prompt_name)
        tokenized, pooled, _, timings = await self._process(
            items,
            prompt=text_prompt,
            truncate=truncate,
            add_special_tokens=True,
            want_tokens=False,
            param="input",
        )
        return self._score_result(tokenized, pooled, n_a, timings)

    async def atokenize(
        self, texts: str | Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """``tokenize`` off the event loop."""
        if self._loop is None or self._tokenize_pool is None:
            return self.tokenize(texts, add_special_tokens=add_special_tokens)
        return await self._loop.run_in_executor(
            self._tokenize_pool,
            functools.partial(self.tokenize, texts, add_special_tokens=add_special_tokens),
        )

    # -- sync API (no loop needed) ---------------------------------------------------------
    def embed(
        self,
        inputs: Inputs,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate: TruncationArg = True,
        add_special_tokens: bool = True,
    ) -> FloatArray:
        """Embed inputs; float32 numpy array ``[n, d]``."""
        return self.embed_full(
            inputs,
            dimensions=dimensions,
            normalize=normalize,
            prompt=prompt,
            prompt_name=prompt_name,
            truncate=truncate,
            add_special_tokens=add_special_tokens,
        ).embeddings

    def embed_full(
        self,
        inputs: Inputs,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate: TruncationArg = True,
        add_special_tokens: bool = True,
    ) -> EmbedResult:
        """Like ``embed`` but returns the EmbedResult (usage, truncation count, timings)."""

        def offline() -> EmbedResult:
            items = normalize_inputs(inputs, "input")
            dims, norm = self._resolve_head(dimensions, normalize)
            text_prompt = self._resolve_prompt(prompt, prompt_name)
            tokenized, pooled, _, timings = self._process_offline(
                items,
                prompt=text_prompt,
                truncate=truncate,
                add_special_tokens=add_special_tokens,
                want_tokens=False,
                param="input",
            )
            return self._embed_result(tokenized, pooled, timings, dims, norm)

        return self._sync(
            lambda: self.aembed(
                inputs,
                dimensions=dimensions,
                normalize=normalize,
                prompt=prompt,
                prompt_name=prompt_name,
                truncate=truncate,
                add_special_tokens=add_special_tokens,
            ),
            offline,
        )

    def embed_tokens(
        self,
        inputs: Inputs,
        *,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate: TruncationArg = True,
        add_special_tokens: bool = True,
    ) -> list[FloatArray]:
        """Per-token hidden states, one float32 ``[len_i, hidden]`` array per input."""

        def offline() -> TokenEmbedResult:
            items = normalize_inputs(inputs, "input")
            text_prompt = self._resolve_prompt(prompt, prompt_name)
            tokenized, _, tokens, timings = self._process_offline(
                items,
                prompt=text_prompt,
                truncate=truncate,
                add_special_tokens=add_special_tokens,
                want_tokens=True,
                param="input",
            )
            return self._token_result(tokenized, tokens, timings)

        return self._sync(
            lambda: self.aembed_tokens(
                inputs,
                prompt=prompt,
                prompt_name=prompt_name,
                truncate=truncate,
                add_special_tokens=add_special_tokens,
            ),
            offline,
        ).embeddings

    def score(
        self,
        a: Inputs,
        b: Inputs,
        *,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate: TruncationArg = True,
    ) -> npt.NDArray[np.float32]:
        """Cosine similarities ``[n]`` of pairs (equal-length lists, or one against many)."""

        def offline() -> ScoreResult:
            items, n_a = self._score_inputs(a, b)
            text_prompt = self._resolve_prompt(prompt, prompt_name)
            tokenized, pooled, _, timings = self._process_offline(
                items,
                prompt=text_prompt,
                truncate=truncate,
                add_special_tokens=True,
                want_tokens=False,
                param="input",
            )
            return self._score_result(tokenized, pooled, n_a, timings)

        return self._sync(
            lambda: self.ascore(a, b, prompt=prompt, prompt_name=prompt_name, truncate=truncate),
            offline,
        ).scores

    def tokenize(
        self, texts: str | Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each text, untruncated (what ``/tokenize`` returns)."""
        items = [texts] if isinstance(texts, str) else list(texts)
        if not items:
            raise InvalidRequestError("no texts given to tokenize", param="input")
        for i, text in enumerate(items):
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"input[{i}] must be a string, got {type(text).__name__}", param="input"
                )
        return self._tokenizer.tokenize(items, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of token ids (special tokens dropped unless asked for)."""
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise InvalidRequestError("tokens must be a list of integers", param="tokens")
        return self._tokenizer.detokenize(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The tokenizer's own string for each id (``convert_ids_to_tokens``: WordPiece ``##``
        and byte-level ``Ġ`` markers kept), as vLLM's ``/tokenize`` returns them."""
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise InvalidRequestError("tokens must be a list of integers", param="tokens")
        return self._tokenizer.token_strings(ids)

    def _sync(self, coroutine: Callable[[], Awaitable[T]], offline: Callable[[], T]) -> T:
        loop = self._loop
        if loop is None or not self._ready:
            return offline()
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is loop:
            raise RuntimeError(
                "a sync Engine method was called inside the engine's event "
                "loop, which would block it; await the async form instead"
            )

        async def run() -> T:
            return await coroutine()

        return asyncio.run_coroutine_threadsafe(run(), loop).result()

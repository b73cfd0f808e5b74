"""Resolving an engine's configuration on the device plane: settings plus what the loaded
model declares, decided once.

:func:`resolve_config` is pure: from the settings and the loaded model's declarations
(positions, tokenizer limit, sentence-transformers files, its heads) it decides the input
length, the batch budgets, the pooling method and head, the task and the prompts, or raises
naming the setting at fault. The result
(:class:`~embedding_server.request.configuration.EngineConfig`) holds no tensor; the weights
the forward worker applies after the body go to :class:`DeviceHeads`. :func:`describe` turns
the same decisions into :class:`~embedding_server.request.configuration.EngineInfo` for the
start-up log line and ``/info``,
so what runs and what is reported cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from embedding_server.device.attention import Backend, BackendChoice, probe, select_backend
from embedding_server.device.colbert import ColbertHead
from embedding_server.device.dtypes import cpu_thread_budget, dtype_name
from embedding_server.device.heads import ClassificationHead, SparseHead, token_head
from embedding_server.device.hybrid import HybridHead
from embedding_server.device.listwise import ProjectorHead
from embedding_server.device.loading import LoadedModel
from embedding_server.device.models.gemma3 import Gemma3TextModel
from embedding_server.device.models.llama import LlamaModel
from embedding_server.device.models.vision import image_tokens_of
from embedding_server.device.pooling import DenseHead
from embedding_server.device.sentence_transformers import declared_matryoshka
from embedding_server.device.tensor_parallel import TensorParallelModel
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from embedding_server.request.configuration import EngineConfig, EngineInfo
from embedding_server.request.heads import Task, resolve_task
from embedding_server.request.hybrid import OUTPUTS
from embedding_server.request.pooling import (
    POOLING_METHODS,
    PoolingHead,
    PoolingMethod,
    build_matryoshka,
)
from embedding_server.request.prompts import Prompts
from embedding_server.request.special_tokens import describe_tokens
from embedding_server.settings import CPU_BATCH_TOKENS, GPU_BATCH_TOKENS, EngineSettings


def resolve_config(
    settings: EngineSettings, loaded: LoadedModel, *, device: torch.device
) -> EngineConfig:
    """Combine ``settings`` with what ``loaded`` declares; settings win where both speak."""
    if loaded.listwise is not None:
        task = _listwise_task(settings.task, loaded.architecture)
    else:
        task = resolve_task(
            settings.task,
            loaded.classifier,
            loaded.architecture,
            splade=loaded.st.splade is not None,
        )
    if loaded.hybrid is not None and task != "embed":
        raise UnsupportedModelError(
            f"{loaded.architecture} has bge-m3's sparse_linear.pt and colbert_linear.pt, whose "
            f"outputs are served with task embed, not {task}; serve it with task embed (or "
            "auto), or remove the two files to serve the body alone"
        )
    if loaded.colbert is not None and task != "embed":
        raise UnsupportedModelError(
            f"{loaded.architecture} is a ColBERT model, whose multi-vectors are served with "
            f"task embed, not {task}"
        )
    if loaded.colbert is not None and settings.tensor_parallel_size > 1:
        raise UnsupportedModelError(
            f"{loaded.architecture} is a ColBERT model, served with tensor_parallel_size 1 "
            "only for now"
        )
    if task == "sparse" and loaded.sparse is None:  # the fake backend: no weights, no head
        raise UnsupportedModelError(f"{loaded.architecture} has no masked-LM head for task sparse")
    if task != "embed":
        _refuse_embed_settings(settings, task)
        if settings.tensor_parallel_size > 1:
            # Pairs carry segment ids and heads read full hidden states; the ranks' batch
            # broadcast carries neither yet.
            raise UnsupportedModelError(
                f"tensor_parallel_size {settings.tensor_parallel_size} serves task embed only; "
                f"this model's task is {task}: serve it with tensor_parallel_size 1"
            )
    max_len = _max_input_tokens(settings, loaded)
    max_batch_tokens = _max_batch_tokens(settings, max_len, device)
    st = loaded.st
    declared_flag, declared_dims = declared_matryoshka(loaded.config, st)
    classifier = loaded.classifier if task != "embed" else None
    pooling = classifier.pooling if classifier is not None else _pooling(settings, loaded)
    matryoshka = build_matryoshka(
        DenseHead(tuple(st.dense)).out_features(loaded.model.hidden_size),
        declared=declared_flag,
        declared_dims=declared_dims,
        override_dims=settings.matryoshka_dimensions,
        default_dims=settings.dimensions,
    )
    normalize = (
        settings.normalize
        if settings.normalize is not None
        else (st.normalize if st.present else True)
    )
    return EngineConfig(
        max_input_tokens=max_len,
        max_batch_tokens=max_batch_tokens,
        max_batch_size=settings.max_batch_size,
        max_queue_tokens=settings.max_queue_tokens,
        max_request_tokens=_max_request_tokens(settings, max_len),
        pooling=pooling,
        include_prompt=st.include_prompt,
        head=PoolingHead(matryoshka=matryoshka, normalize=normalize),
        prompts=_prompts(settings, loaded),
        # Tensor-parallel ranks on one host share its CPUs.
        cpu_threads=max(1, cpu_thread_budget() // settings.tensor_parallel_size),
        tensor_parallel_size=settings.tensor_parallel_size,
        bulk_batch_seconds=settings.bulk_batch_ms / 1e3 if settings.bulk_batch_ms else None,
        task=task,
        classifier=classifier,
        hybrid=loaded.hybrid,
        colbert=loaded.colbert,
        listwise=loaded.listwise,
    )


def _listwise_task(requested: str, architecture: str) -> Task:
    """A listwise reranker's task: score (its /score and /rerank), whatever auto would guess
    from its causal-LM body; any other is refused, naming why."""
    if requested in ("auto", "score"):
        return "score"
    raise UnsupportedModelError(
        f"{architecture} is a listwise reranker (jina-reranker-v3): it scores documents "
        f"against a query in one prompt (task score: /score and /rerank), and has no head "
        f"for task {requested}"
    )


def _refuse_embed_settings(settings: EngineSettings, task: Task) -> None:
    """Embedding-only settings with another task are a mistake: say which."""
    given = {
        "pooling": settings.pooling != "auto",
        "normalize": settings.normalize is not None,
        "dimensions": settings.dimensions is not None,
        "matryoshka_dimensions": settings.matryoshka_dimensions is not None,
    }
    for name, set_ in given.items():
        if set_:
            raise InvalidRequestError(
                f"{name} applies to task embed only; this model serves task {task}",
                param=name,
            )


def _max_input_tokens(settings: EngineSettings, loaded: LoadedModel) -> int:
    positions = loaded.model.max_positions
    declared = loaded.st.max_seq_length or min(loaded.tokenizer_max_length or positions, positions)
    if settings.max_model_len is not None and settings.max_model_len > positions:
        raise InvalidRequestError(
            f"max_model_len={settings.max_model_len} exceeds the {positions} positions the "
            "model supports",
            param="max_model_len",
        )
    return settings.max_model_len or min(declared, positions)


def _max_batch_tokens(settings: EngineSettings, max_len: int, device: torch.device) -> int:
    if settings.max_batch_tokens is None:
        default = GPU_BATCH_TOKENS if device.type == "cuda" else CPU_BATCH_TOKENS
        budget = max(max_len, min(default, settings.max_queue_tokens))
    else:
        budget = settings.max_batch_tokens
    if max_len > budget:
        raise InvalidRequestError(
            f"max_batch_tokens={budget} is smaller than one maximal "
            f"input ({max_len} tokens); raise it or lower max_model_len",
            param="max_batch_tokens",
        )
    if settings.max_queue_tokens < budget:
        raise InvalidRequestError(
            f"max_queue_tokens={settings.max_queue_tokens} is smaller than one batch "
            f"({budget} tokens)",
            param="max_queue_tokens",
        )
    return budget


def _max_request_tokens(settings: EngineSettings, max_len: int) -> int:
    if settings.max_request_tokens is None:
        return max(max_len, settings.max_queue_tokens // 2)
    if settings.max_request_tokens < max_len:
        raise InvalidRequestError(
            f"max_request_tokens={settings.max_request_tokens} is smaller than one maximal "
            f"input ({max_len} tokens); raise it or lower max_model_len",
            param="max_request_tokens",
        )
    return settings.max_request_tokens


def _pooling(settings: EngineSettings, loaded: LoadedModel) -> PoolingMethod:
    if settings.pooling != "auto":
        return settings.pooling
    if loaded.st.unsupported_pooling is not None:
        raise UnsupportedModelError(
            f"{loaded.st.unsupported_pooling}. Set pooling to one of "
            f"{', '.join(POOLING_METHODS)} to serve the model with that single method instead "
            "(its vectors will then differ from what sentence-transformers computes)"
        )
    return loaded.st.pooling or loaded.default_pooling


def _prompts(settings: EngineSettings, loaded: LoadedModel) -> Prompts:
    # jina-embeddings-v3 names each adapter's prompt in config.json (task_instructions) as
    # well as in its sentence-transformers config: read there when the latter is missing.
    instructions = loaded.config.get("task_instructions")
    table = dict(loaded.st.prompts) or (
        {str(k): str(v) for k, v in instructions.items()} if isinstance(instructions, dict) else {}
    )
    # jina-embeddings-v5's encode() puts "Query: " / "Document: " (the default) in front.
    table = table or dict(getattr(loaded.model, "declared_prompts", None) or {})
    default = (
        settings.default_prompt_name
        or loaded.st.default_prompt_name
        or getattr(loaded.model, "default_prompt_name", None)
    )
    if default and default not in table:
        raise InvalidRequestError(
            f"default_prompt_name={default!r} is not one of the model's prompts {sorted(table)}",
            param="default_prompt_name",
        )
    adapters = tuple(getattr(loaded.model, "adapters", ()))
    return Prompts(table, default, adapters)


def describe(
    config: EngineConfig,
    loaded: LoadedModel,
    *,
    device: torch.device,
    attention: BackendChoice,
    vocab_size: int,
) -> EngineInfo:
    """The :class:`EngineInfo` of an engine built from ``config``."""
    m = config.head.matryoshka
    image_tokens = image_tokens_of(loaded.model)
    return EngineInfo(
        modalities=["text", "image"] if image_tokens is not None else ["text"],
        image_tokens=image_tokens,
        model=loaded.name,
        model_path=str(loaded.path) if loaded.path else None,
        architecture=loaded.architecture,
        model_type=str(loaded.config.get("model_type", "")),
        task=config.task,
        labels=list(config.classifier.labels) if config.classifier else None,
        score_activation=(
            config.classifier.score_activation
            if config.classifier and config.task == "score"
            else None
        ),
        hidden_size=loaded.model.hidden_size,
        dimensions=m.default,
        max_input_tokens=config.max_input_tokens,
        pooling=config.pooling,
        normalize=config.head.normalize,
        dtype=dtype_name(loaded.dtype),
        device=str(device),
        attention=loaded.attention or str(attention.backend),
        attention_passed_over=list(attention.passed_over),
        sliding_window=loaded.model.sliding_window,
        prompts=dict(config.prompts.table),
        default_prompt_name=config.prompts.default_name,
        adapters=list(config.prompts.adapters),
        matryoshka=m.supported,
        matryoshka_dimensions=m.to_list(),
        full_dimensions=m.full,
        vocab_size=vocab_size,
        cpu_threads=config.cpu_threads,
        tensor_parallel_size=config.tensor_parallel_size,
        max_batch_tokens=config.max_batch_tokens,
        max_batch_size=config.max_batch_size,
        max_queue_tokens=config.max_queue_tokens,
        max_request_tokens=config.max_request_tokens,
        backend=loaded.backend,
        quantization=loaded.quantization,
        outputs=(
            (
                ["multi_vector"]
                if config.colbert is not None
                else list(OUTPUTS)
                if config.hybrid is not None
                else ["dense"]
            )
            if config.task == "embed"
            else []
        ),
        multi_vector_dim=(
            config.hybrid.multi_vector_dim
            if config.hybrid
            else config.colbert.width
            if config.colbert
            else None
        ),
        score_method=_score_method(config),
        special_tokens=loaded.special_tokens or describe_tokens(loaded.tokenizer),
    )


def _score_method(config: EngineConfig) -> str | None:
    if config.listwise is not None:
        return "listwise"
    if config.task == "score":
        return "cross_encoder"
    if config.task == "embed":
        late = config.hybrid is not None or config.colbert is not None
        return "maxsim" if late else "cosine"
    return None


_TOKEN_HEAD_TASKS: tuple[Task, ...] = ("token_classify", "reward")
"""The tasks whose classifier runs on every token's state rather than a pooled vector."""


@dataclass(frozen=True)
class DeviceHeads:
    """The weights the forward worker applies after the body, on the engine's device: the
    sentence-transformers Dense layers (task embed, with bge-m3's sparse and ColBERT heads
    on the token states where it has them), the classification head (score, classify,
    token_classify, reward) or the SPLADE head (sparse)."""

    task: Task
    dense: DenseHead
    classifier: ClassificationHead | None = None
    sparse: SparseHead | None = None
    hybrid: HybridHead | None = None
    colbert: ColbertHead | None = None
    listwise: ProjectorHead | None = None

    @classmethod
    def of(cls, config: EngineConfig, loaded: LoadedModel, device: torch.device) -> DeviceHeads:
        """The heads ``config``'s task needs, moved to ``device``."""
        task = config.task
        classifier = loaded.classifier_head if config.classifier is not None else None
        return cls(
            task=task,
            dense=DenseHead(tuple(loaded.st.dense)).to(device),
            classifier=classifier.to(device) if classifier is not None else None,
            sparse=loaded.sparse.to(device) if task == "sparse" and loaded.sparse else None,
            hybrid=(
                loaded.hybrid_head.to(device)
                if config.hybrid is not None and loaded.hybrid_head is not None
                else None
            ),
            colbert=(
                loaded.colbert_head.to(device)
                if config.colbert is not None and loaded.colbert_head is not None
                else None
            ),
            listwise=(
                loaded.listwise_head.to(device)
                if config.listwise is not None and loaded.listwise_head is not None
                else None
            ),
        )

    @property
    def batch_head(self) -> DenseHead | ClassificationHead:
        """What the forward worker applies after pooling: Dense layers, or a sequence
        classifier (token_classify and reward run the head on the token states instead:
        :attr:`token_head`)."""
        if self.classifier is None or self.task in _TOKEN_HEAD_TASKS:
            return self.dense
        return self.classifier

    @property
    def token_head(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the forward worker applies to the token states it returns: the classifier of
        task token_classify (probabilities) or reward (raw outputs), bge-m3's sparse and
        ColBERT heads (each token's weight and vector), a ColBERT checkpoint's projection,
        else nothing."""
        if self.hybrid is not None:
            return self.hybrid
        if self.colbert is not None:
            return self.colbert
        if self.listwise is not None:  # a listwise reranker's projector, at every token
            return self.listwise
        if self.classifier is None or self.task not in _TOKEN_HEAD_TASKS:
            return None
        return token_head(self.classifier, raw=self.task == "reward")


def prefix_cache_refusal(
    settings: EngineSettings, loaded: LoadedModel, attention: Backend
) -> str | None:
    """Why ``--prefix-cache-bytes`` cannot serve this model exactly (None: it can).

    Only a causal decoder of ours computes a prefix's states independently of what follows
    (``device.prefix_cache``); a bidirectional one (gte-Qwen2, llama-nemotron-embed, an
    encoder) would give other vectors."""
    model = loaded.model
    if isinstance(model, TensorParallelModel):  # each rank caches its own heads
        model = model.model
    name = loaded.architecture
    if loaded.backend == "fake":
        return "the fake backend computes no states to cache"
    if loaded.backend != "native":
        return (
            f"the {loaded.backend} backend runs the model's own forward pass, which takes no "
            "cached prefix"
        )
    if not isinstance(model, LlamaModel | Gemma3TextModel):
        return (
            f"{name} is not a decoder whose prefix states the engine can cache (the Llama, "
            "Mistral, Qwen2, Qwen3 and Gemma bodies can)"
        )
    if not model.causal:
        return (
            f"{name} attends bidirectionally: every prompt token's state depends on the text "
            "after it, so a cached prefix would change the vectors"
        )
    if isinstance(model, LlamaModel) and type(model)._adapters is not LlamaModel._adapters:
        return f"{name} applies task adapters to every token, prompt tokens included"
    if attention is Backend.TORCH_VARLEN:
        return (
            "torch_varlen's causal mask is not documented to align queries to the end of "
            "longer keys, which a cached prefix needs; use flash_attn or an SDPA kernel"
        )
    return None


def choose_attention(
    settings: EngineSettings, loaded: LoadedModel, device: torch.device
) -> BackendChoice:
    """The attention kernel of a native model (``attention.select_backend``). A model on the
    transformers backend runs its own attention (``loaded.attention``) and ignores the plan
    the runner builds per batch; the bucketed plan is the cheap one (a length-sorted batch
    makes its buckets views, no index tensors)."""
    if loaded.attention is None:
        facts = probe(
            device,
            loaded.dtype,
            loaded.head_dim,
            bias=loaded.attention_bias,
            windowed_key_prefix=loaded.colbert is not None and bool(loaded.model.sliding_window),
            softcap=loaded.attention_softcap,
            alibi=loaded.attention_alibi,
        )
        return select_backend(settings.attention, facts)
    if settings.attention != "auto":
        raise InvalidRequestError(
            f"attention={settings.attention} chooses a kernel of the native backend; this "
            f"model runs on the {loaded.backend} backend, whose attention is transformers' "
            f"own ({loaded.attention}): leave attention at auto",
            param="attention",
        )
    return BackendChoice(Backend.SDPA_BUCKETED, ())

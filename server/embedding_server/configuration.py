"""Resolving an engine's configuration: settings plus what the model declares, decided once.

:func:`resolve_config` is pure: from the settings and the loaded model's declarations
(positions, tokenizer limit, sentence-transformers files) it decides the input length, the
batch budgets, the pooling method and head, and the prompts, or raises naming the setting at
fault. The engine builds its stages from the result, and :func:`describe` turns the same
result into :class:`EngineInfo` for the start-up log line and ``/info``, so what runs and what
is reported cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvalidRequestError, UnsupportedModelError
from .heads import ClassificationHead, Classifier, SparseHead, Task, resolve_task
from .pooling import POOLING_METHODS, PoolingHead, PoolingMethod, build_matryoshka
from .settings import CPU_BATCH_TOKENS, GPU_BATCH_TOKENS, EngineSettings
from .tokenization import Prompts

if TYPE_CHECKING:
    import torch

    from .attention import BackendChoice
    from .loading import LoadedModel


@dataclass(frozen=True)
class EngineConfig:
    """The decisions an engine is built from."""

    max_input_tokens: int
    max_batch_tokens: int
    max_batch_size: int
    max_queue_tokens: int
    max_request_tokens: int
    pooling: PoolingMethod
    include_prompt: bool
    """Whether prompt tokens take part in pooling (sentence-transformers' include_prompt)."""
    head: PoolingHead
    prompts: Prompts
    cpu_threads: int
    tensor_parallel_size: int
    task: Task = "embed"
    classifier: Classifier | None = None
    """The classification head (task score or classify), on the engine's device."""
    sparse: SparseHead | None = None
    """The SPLADE head (task sparse), on the engine's device: it replaces pooling."""

    @property
    def batch_head(self) -> PoolingHead | ClassificationHead:
        """What the forward worker applies after pooling: Dense layers, or a sequence
        classifier (token_classify and reward run the head on the token states instead:
        :attr:`token_head`)."""
        if self.classifier is None or self.task in _TOKEN_HEAD_TASKS:
            return self.head
        return self.classifier.weights()

    @property
    def token_head(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the forward worker applies to the token states it returns: the classifier of
        task token_classify (probabilities) or reward (raw outputs), else nothing."""
        if self.classifier is None or self.task not in _TOKEN_HEAD_TASKS:
            return None
        return self.classifier.token_head(raw=self.task == "reward")


_TOKEN_HEAD_TASKS: tuple[Task, ...] = ("token_classify", "reward")
"""The tasks whose classifier runs on every token's state rather than a pooled vector."""


def resolve_config(
    settings: EngineSettings, loaded: LoadedModel, *, device: torch.device
) -> EngineConfig:
    """Combine ``settings`` with what ``loaded`` declares; settings win where both speak."""
    # Imported here: the model-owning process resolves, while front-end processes only
    # unpickle the result (EngineConfig) and must not load torch for it.
    from .dtypes import cpu_thread_budget
    from .loading import declared_matryoshka

    task = resolve_task(
        settings.task, loaded.classifier, loaded.architecture, splade=loaded.st.splade is not None
    )
    sparse = loaded.sparse.to(device) if task == "sparse" and loaded.sparse else None
    if task == "sparse" and sparse is None:  # the fake backend: no weights, no head
        raise UnsupportedModelError(f"{loaded.architecture} has no masked-LM head for task sparse")
    if task != "embed":
        _refuse_embed_settings(settings, task)
    max_len = _max_input_tokens(settings, loaded)
    max_batch_tokens = _max_batch_tokens(settings, max_len, device)
    st = loaded.st
    dense = tuple(layer.to(device) for layer in st.dense)
    declared_flag, declared_dims = declared_matryoshka(loaded.config, st)
    classifier = loaded.classifier if task != "embed" else None
    if classifier is not None:
        classifier = classifier.to(device)
    pooling = classifier.pooling if classifier is not None else _pooling(settings, loaded)
    matryoshka = build_matryoshka(
        dense[-1].out_features if dense else loaded.model.hidden_size,
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
        head=PoolingHead(dense=dense, matryoshka=matryoshka, normalize=normalize),
        prompts=_prompts(settings, loaded),
        # Tensor-parallel ranks on one host share its CPUs.
        cpu_threads=max(1, cpu_thread_budget() // settings.tensor_parallel_size),
        tensor_parallel_size=settings.tensor_parallel_size,
        task=task,
        classifier=classifier,
        sparse=sparse,
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
    table = dict(loaded.st.prompts)
    default = settings.default_prompt_name or loaded.st.default_prompt_name
    if default and default not in table:
        raise InvalidRequestError(
            f"default_prompt_name={default!r} is not one of the model's prompts {sorted(table)}",
            param="default_prompt_name",
        )
    return Prompts(table, default)


@dataclass(frozen=True)
class EngineInfo:
    """The resolved configuration: logged once at load and served by /info."""

    model: str
    model_path: str | None
    architecture: str
    model_type: str
    task: Task
    """embed, score (a cross-encoder) or classify; decided at load from the checkpoint."""
    labels: list[str] | None
    """The classifier's labels in order (task score or classify), else None."""
    score_activation: str | None
    """The activation over a cross-encoder's logit in /score and /rerank (task score)."""
    hidden_size: int
    dimensions: int
    """Default output dimensions (after Dense layers and any configured truncation)."""
    max_input_tokens: int
    pooling: PoolingMethod
    normalize: bool
    dtype: str
    device: str
    attention: str
    """The attention kernel (flash_attn, torch_varlen, sdpa_padded or sdpa_bucketed)."""
    attention_passed_over: list[str]
    """Why each faster attention kernel was not used (empty when none was passed over)."""
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
    """torch intra-op threads for CPU forward passes (per rank)."""
    tensor_parallel_size: int
    """Ranks the model is split over (``--tensor-parallel-size``)."""
    max_batch_tokens: int
    max_batch_size: int
    max_queue_tokens: int
    max_request_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(
    config: EngineConfig,
    loaded: LoadedModel,
    *,
    device: torch.device,
    attention: BackendChoice,
    vocab_size: int,
) -> EngineInfo:
    """The :class:`EngineInfo` of an engine built from ``config``."""
    from .dtypes import dtype_name  # see resolve_config()

    m = config.head.matryoshka
    return EngineInfo(
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
        attention=str(attention.backend),
        attention_passed_over=list(attention.passed_over),
        sliding_window=loaded.model.sliding_window,
        prompts=dict(config.prompts.table),
        default_prompt_name=config.prompts.default_name,
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
    )

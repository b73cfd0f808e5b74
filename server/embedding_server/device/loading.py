"""Model loading: from a name to weights on a device, a tokenizer and the model's declared
embedding behaviour; this module plans a load, refuses what cannot be served, and builds
the body and heads (:func:`load_model`, :func:`load_shard`).

A model is a directory (local, the packaged default, or a Hugging Face Hub snapshot) holding
what the modules beside this one read:

* where its files come from, and their download, config before weights (``hub.py``);
* ``config.json`` -> which packed implementation (``models.lookup``) and its shapes
  (``model_config.py``);
* weights: ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``), or
  ``pytorch_model.bin`` when that is all there is (``weights.py``);
* the fast tokenizer and its special tokens (``tokenizer_files.py``);
* sentence-transformers files: ``modules.json``, ``1_Pooling/config.json``, ``2_Dense*/``,
  ``sentence_bert_config.json``, ``config_sentence_transformers.json``
  (``sentence_transformers.py``);
* a ``*ForSequenceClassification`` checkpoint's classification head, named as its family
  declares (``heads.py``, ``models/__init__.py``);
* bge-m3's ``sparse_linear.pt`` and ``colbert_linear.pt`` where the root has them: its sparse
  and multi-vector outputs (``hybrid.py``), unpickled with ``weights_only=True``.

Everything read there is declarative; the engine combines it with the settings.

Loading is guarded, so that a model is served as its authors compute it or not at all:

* **Config before weights.** A Hub model arrives in two downloads: first the config,
  tokenizer and sentence-transformers files (:func:`~.hub.locate_model`); the weights only
  once those are accepted (:func:`~.hub.fetch_weights`, pinned to the same commit). An
  unsupported architecture, head, sentence-transformers module or custom-code checkpoint is
  refused without downloading a single weight (:func:`plan_model`); so is, natively, one
  whose tensors would refuse the load, audited first from the Hub's safetensors headers
  (:func:`_audit_before_fetch`).
* **Every tensor is used or declared.** The body and its heads read through one
  :class:`~.models.base.TrackedWeights`; a tensor nobody read that the family does not
  declare ignorable (``Architecture.ignored``) refuses the load, naming it
  (:func:`refuse_unclaimed`). A head or projection we do not implement cannot vanish.
* **Custom code** (``auto_map``) is never run: a checkpoint whose ``model_type`` is
  implemented natively is served natively (and the log says its code is not run); any other
  is refused, naming the class (:func:`~.generic.custom_code_refusal`).
* **Generative checkpoints** (``*ForCausalLM`` without sentence-transformers files) are
  refused under ``--task auto``: they are yes/no rerankers or chat models, whose vectors are
  not what their authors score with (:func:`refuse_generative`).

Every refusal is an :class:`~embedding_server.errors.UnsupportedModelError` that names the
model, what was found and what to do. ``embedding-server inspect`` runs the same steps on
weight names and shapes alone (``shapes_only``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from embedding_server.device.colbert import (
    ColbertHead,
    is_hf_colbert,
    read_linear,
    read_pylate_format,
    read_stanford_format,
)
from embedding_server.device.distributed import SINGLE, Shard
from embedding_server.device.dtypes import resolve_dtype
from embedding_server.device.generic import (
    ServedBackend,
    build_transformers,
    choose_backend,
    custom_code_class,
    custom_code_refusal,
    refuse_before_fetch,
    refuse_task,
    tensor_parallel_refusal,
    transformers_dtype,
)
from embedding_server.device.heads import (
    ClassificationHead,
    SparseHead,
    check_reward,
    generative,
    read_classifier,
    read_reward,
    read_sparse_head,
    read_yes_no,
    yes_no_template,
)
from embedding_server.device.hub import (
    ModelSource,
    download,
    fetch_weights,
    locate_model,
    module_patterns,
)
from embedding_server.device.hybrid import (
    HEAD_FILES,
    HybridHead,
    read_hybrid_head,
    refuse_colbert,
)
from embedding_server.device.instructions import InstructionSpan
from embedding_server.device.listwise import ProjectorHead, is_listwise, read_format, read_projector
from embedding_server.device.model_config import read_json, read_model_config
from embedding_server.device.models import ARCHITECTURES, Architecture, build_model, lookup
from embedding_server.device.models.base import (
    EmbeddingModel,
    TensorAudit,
    TrackedWeights,
    audit_tensors,
)
from embedding_server.device.quantization import Quantization, quantize_layers, refuse_int8
from embedding_server.device.sentence_transformers import (
    SentenceTransformerConfig,
    read_dense_layers,
    read_sentence_transformers,
)
from embedding_server.device.tokenizer_files import load_tokenizer, read_tokenizer
from embedding_server.device.weights import TensorShapes, hub_shapes, load_weights
from embedding_server.errors import ModelNotFoundError, UnsupportedModelError
from embedding_server.request.colbert import ColbertFormat
from embedding_server.request.heads import Classifier, head_kind
from embedding_server.request.hybrid import HybridHeads
from embedding_server.request.listwise import ListwiseFormat
from embedding_server.request.pooling import PoolingMethod
from embedding_server.request.special_tokens import SpecialTokens
from embedding_server.settings import Dtype, EngineSettings, ModelBackend

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """Everything the engine needs from a model source, before settings are applied."""

    name: str
    path: Path | None
    config: dict[str, Any]
    architecture: str
    model: EmbeddingModel
    tokenizer: Tokenizer
    tokenizer_max_length: int | None
    st: SentenceTransformerConfig
    default_pooling: PoolingMethod
    dtype: torch.dtype
    """The compute dtype the model was built in."""
    head_dim: int
    """Per-head width of attention, which decides the attention kernels that can serve it."""
    classifier: Classifier | None = None
    """What the classification head of a ``*ForSequenceClassification`` or
    ``*ForTokenClassification`` checkpoint means (labels, pooling, activation)."""
    classifier_head: ClassificationHead | None = None
    """That head's weights (on the CPU, float32)."""
    sparse: SparseHead | None = None
    """The SPLADE head of a masked-LM checkpoint (task sparse), where it has one."""
    hybrid: HybridHeads | None = None
    """What bge-m3's sparse and ColBERT heads mean, where the directory has them."""
    hybrid_head: HybridHead | None = None
    """Their weights (on the CPU, float32)."""
    colbert: ColbertFormat | None = None
    """A ColBERT checkpoint's tokenization per side and skip-list (``HF_ColBERT``)."""
    colbert_head: ColbertHead | None = None
    """Its projection (on the CPU, float32)."""
    listwise: ListwiseFormat | None = None
    """A listwise reranker's prompt markers (jina-reranker-v3's ``JinaForRanking``)."""
    listwise_head: ProjectorHead | None = None
    """Its projector (on the CPU, float32)."""
    tensors: TensorAudit | None = None
    """Which of the checkpoint's tensors were read and which ignored, and why."""
    custom_code: str | None = None
    """The class ``config.json``'s ``auto_map`` names (not run: served natively), if any."""
    backend: str = "native"
    """What runs the body: native (our packed families), transformers (its own model class,
    ``generic.py``) or fake."""
    attention: str | None = None
    """The attention the body chose itself (the transformers backend: sdpa or eager); None
    when the engine's kernel choice (``attention.select_backend``) applies."""
    attention_bias: str | None = None
    """What the architecture adds to its attention logits (``Architecture.attention_bias``),
    which keeps it off the varlen kernels; None: plain attention."""
    attention_softcap: bool = False
    """The body soft-caps its attention logits (``Architecture.attention_softcap``), which
    keeps it off torch_varlen (and a flash-attn without ``softcap``)."""
    attention_alibi: bool = False
    """The body adds ALiBi position biases (``Architecture.attention_alibi``), which keeps it
    off torch_varlen (and a flash-attn without ``alibi_slopes``)."""
    quantization: str = "none"
    """How the body's weights are held: none (``dtype``) or int8 (``quantization.py``)."""
    special_tokens: SpecialTokens | None = None
    """The special tokens a text gets and where they come from (``special_tokens.py``)."""
    instruction: InstructionSpan | None = None
    """Finds the leading instruction tokens of each sequence that pooling leaves out
    (``Architecture.instruction``: GritLM); None: none are."""


def head_dim_of(config: Mapping[str, Any]) -> int:
    """The attention head width a config declares (``head_dim``, else hidden / heads)."""
    declared = config.get("head_dim")
    if isinstance(declared, int) and declared > 0:
        return declared
    return int(config["hidden_size"]) // int(config["num_attention_heads"])


@contextmanager
def naming(model: str) -> Iterator[None]:
    """Put the model's name in front of every refusal raised inside: a log line or a
    terminal must say which model was refused."""
    try:
        yield
    except UnsupportedModelError as error:
        prefix = f"model {model!r}: "
        if error.message.startswith(prefix):
            raise
        raise UnsupportedModelError(prefix + error.message, param=error.param) from error


@dataclass(frozen=True)
class ModelPlan:
    """What a model's config files decide, before any weight is downloaded: its
    architecture, its sentence-transformers pipeline (Dense weights not yet read), and the
    custom code its ``auto_map`` names (which is not run)."""

    source: ModelSource
    config: dict[str, Any]
    arch: Architecture
    st: SentenceTransformerConfig
    custom_code: str | None


def plan_model(source: ModelSource, *, task: str, trust_remote_code: bool) -> ModelPlan:
    """Read ``source``'s config files and refuse, before any weight is fetched, what cannot
    be served: custom code whose architecture we do not implement, an unknown
    ``model_type``, a task head or sentence-transformers module we do not serve, a
    generative checkpoint under task auto."""
    config = read_model_config(source.path)
    if not is_hf_colbert(config):  # served natively: its projection is read in _build
        refuse_colbert(config)
    custom = custom_code_class(config)
    if custom is not None and str(config.get("model_type", "")) not in ARCHITECTURES:
        raise UnsupportedModelError(custom_code_refusal(config, trust_remote_code))
    arch = lookup(config)
    if arch.images and task not in ("auto", "embed"):
        raise UnsupportedModelError(
            f"{arch.model_type} models embed texts and images (task embed); task {task!r} "
            "has no head for them"
        )
    if is_listwise(config) and task not in ("auto", "score"):
        raise UnsupportedModelError(
            f"{config['architectures'][0]} is a listwise reranker (jina-reranker-v3): it "
            f"scores documents against a query in one prompt (task score: /score and "
            f"/rerank), and has no head for task {task}"
        )
    config = arch.read_config(config)  # the common keys, whatever the family calls them
    if arch.images:
        # NaFlex SigLIP 2's processor bounds an image's patches (its image_tokens).
        processor = read_json(source.path / "preprocessor_config.json")
        if isinstance(processor, dict) and isinstance(processor.get("max_num_patches"), int):
            config["max_num_patches"] = processor["max_num_patches"]
    if arch.check_config is not None:
        arch.check_config(config)  # before any weight is fetched
    head_kind(config)  # a task head we do not serve
    check_reward(config, arch.reward)  # a reward model whose head we do not implement
    st = read_sentence_transformers(source.path, dense_weights=False)
    refuse_generative(config, st, task)
    if task == "score" and generative(config) and not st.present:
        yes_no_template(config, arch.yes_no)  # a family with no reranker prompt: refused now
    if custom is not None:
        logger.warning(
            "model %r: config.json's auto_map names custom code (%s); it is not run: the "
            "native %s implementation serves this checkpoint, its config flags and tensors "
            "checked as any other's",
            source.name,
            custom,
            arch.model_type,
        )
    return ModelPlan(source, config, arch, st, custom)


def refuse_generative(config: Mapping[str, Any], st: SentenceTransformerConfig, task: str) -> None:
    """Refuse a ``*ForCausalLM`` checkpoint with no sentence-transformers files under task
    auto: a decoder embedder says how it pools in ``modules.json`` (Qwen3-Embedding,
    gte-Qwen2); without one it is a chat model or a yes/no reranker (Qwen3-Reranker,
    mxbai-rerank-v2, bge-reranker-v2-gemma), whose last-token state is not what it scores
    with."""
    if task != "auto" or st.present:
        return
    causal_lm = generative(config)
    if causal_lm is None:
        return
    raise UnsupportedModelError(
        f"{causal_lm} checkpoint with no sentence-transformers config (modules.json): it looks "
        "like a generative model or a yes/no reranker (Qwen3-Reranker, mxbai-rerank-v2, "
        "bge-reranker-v2-gemma, which score a pair by the language-model head's logits for "
        "their answer tokens), so it is not served by guess; served as an embedder, its "
        "/rerank would return cosine similarities of hidden states, not its relevance scores. "
        "To serve one of those rerankers as the reranker it is, set --task score; to serve "
        "its hidden states as embeddings "
        "anyway, set --task embed (pooling defaults to --pooling last; set the one the model "
        "was trained with)"
    )


def refuse_unclaimed(audit: TensorAudit, arch: Architecture) -> None:
    """Refuse a checkpoint holding tensors nobody read and its family does not declare."""
    if not audit.unclaimed:
        return
    count = len(audit.unclaimed)
    shown = ", ".join(audit.unclaimed[:5]) + (f" and {count - 5} more" if count > 5 else "")
    raise UnsupportedModelError(
        f"the checkpoint holds {count} tensor(s) that the {arch.model_type} implementation "
        f"neither reads nor knows to ignore: {shown}. Serving it without them would give "
        "vectors that are not the model's, so it is refused. If they are a head or projection "
        "this server does not implement, the model is not supported yet (see the supported "
        "models page); if they are truly unused (left over from training), save the "
        "checkpoint without them. `embedding-server inspect` lists every tensor the server "
        "reads or ignores"
    )


@dataclass(frozen=True)
class _Parts:
    body: EmbeddingModel
    classifier: tuple[Classifier, ClassificationHead] | None
    sparse: SparseHead | None
    tensors: TensorAudit
    colbert: ColbertHead | None = None
    listwise: ProjectorHead | None = None


def _build(
    plan: ModelPlan,
    weights: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard,
    task: str,
) -> _Parts:
    """The body and heads ``plan`` calls for, from ``weights``; refuses the checkpoint when
    any tensor is left that nobody read and the family does not declare."""
    tracked = TrackedWeights(weights)
    config, arch, st = plan.config, plan.arch, plan.st
    classifier = read_classifier(
        config,
        tracked,
        reader=arch.classifier,
        st_activation=st.activation_fn,
        pair_prompt=arch.pair_prompt,
    )
    if classifier is None:
        classifier = read_reward(
            config,
            tracked,
            reader=arch.reward,
            token_id=lambda token: load_tokenizer(plan.source.path)[0].token_to_id(token),
        )
    if classifier is None and task == "score" and generative(config) and not st.present:
        tokenizer, _ = load_tokenizer(plan.source.path)
        classifier = read_yes_no(
            config, tracked, template=arch.yes_no, token_id=tokenizer.token_to_id
        )
    sparse = _sparse_head(config, tracked, arch=arch, st=st, task=task)
    body = build_model(config, tracked, dtype=dtype, device=device, shard=shard)
    colbert = read_linear(tracked, body.hidden_size) if is_hf_colbert(config) else None
    listwise = read_projector(tracked, body.hidden_size) if is_listwise(config) else None
    audit = audit_tensors(tracked, arch.ignored)
    refuse_unclaimed(audit, arch)
    return _Parts(body, classifier, sparse, audit, colbert, listwise)


def _compute_dtype(arch: Architecture, dtype: Dtype, device: torch.device) -> torch.dtype:
    overflows = arch.model_type if arch.float16_overflows else None
    return resolve_dtype(dtype, device, fp16_overflows=overflows)


def load_configured(
    settings: EngineSettings,
    *,
    device: torch.device,
    shard: Shard = SINGLE,
    shapes_only: bool = False,
) -> LoadedModel:
    """:func:`load_model` with what the engine's settings say (model, revision, cache, dtype,
    task, backend, remote code, quantization): serving and ``inspect`` load alike."""
    return load_model(
        settings.model,
        revision=settings.revision,
        cache_dir=settings.cache_dir,
        dtype=settings.dtype,
        device=device,
        shard=shard,
        task=settings.task,
        backend=settings.backend,
        trust_remote_code=settings.trust_remote_code,
        shapes_only=shapes_only,
        quantization=settings.quantization,
    )


def load_model(
    model: str,
    *,
    revision: str | None,
    cache_dir: str | None,
    dtype: Dtype,
    device: torch.device,
    shard: Shard = SINGLE,
    task: str = "auto",
    backend: ModelBackend = "auto",
    trust_remote_code: bool = False,
    shapes_only: bool = False,
    quantization: Quantization = "none",
) -> LoadedModel:
    """Resolve, read and build ``model`` (a path, the packaged default, or a Hub id), in the
    dtype that ``dtype`` resolves to for this device and architecture; with a tensor-parallel
    ``shard``, that rank's share of the weights; ``task`` (the setting) says whether a plain
    masked-LM checkpoint's head is wanted for SPLADE, and whether a generative checkpoint
    may be served as an embedder. ``backend`` (the setting) picks our packed implementation
    or transformers' own (``generic.choose_backend``); ``trust_remote_code`` lets the latter
    run a checkpoint's own code.

    ``shapes_only`` (``inspect``): the same decisions and refusals from the tensors' names
    and shapes alone, the model built on the ``meta`` device (a Hub model's safetensors
    headers are read remotely where possible, not downloaded); such a model cannot run. On
    the transformers backend nothing is built: the result says which backend would serve.

    ``quantization`` int8 builds the body in float32 (``dtype`` auto resolves to it) and
    turns its blocks' linear weights into int8 (``quantization.py``); where that cannot run
    it is refused."""
    with naming(model):
        source = locate_model(model, revision=revision, cache_dir=cache_dir)
        served = choose_backend(
            read_model_config(source.path),
            backend,
            model=model,
            trust_remote_code=trust_remote_code,
        )
        if quantization == "int8":
            refuse_int8(device=device, dtype=dtype, backend=served, tensor_parallel=shard.parallel)
            dtype = "float32"
        if served == "transformers":
            if shard.parallel:
                config = read_model_config(source.path)
                raise UnsupportedModelError(tensor_parallel_refusal(model, config, shard.size))
            return _load_transformers(
                model,
                source,
                dtype=dtype,
                device=device,
                task=task,
                trust=trust_remote_code,
                shapes_only=shapes_only,
            )
        plan = plan_model(source, task=task, trust_remote_code=trust_remote_code)
        compute_dtype = _compute_dtype(plan.arch, dtype, device)
        tokenizer, tokenizer_max, special_tokens = read_tokenizer(source.path)
        if plan.arch.check_tokenizer is not None:
            plan.arch.check_tokenizer(plan.config, tokenizer)
        instruction = (
            InstructionSpan.of(plan.arch.instruction, tokenizer)
            if plan.arch.instruction is not None
            else None
        )
        if shapes_only:
            path, weights = _weight_shapes(source, plan.st)
            build_device = torch.device("meta")
        else:
            _audit_before_fetch(plan, dtype=compute_dtype, shard=shard, task=task)
            path = fetch_weights(source, plan.st)
            weights, build_device = load_weights(path), device
            if plan.arch.companion is not None:  # jina-embeddings-v5's task adapters
                companion_config, weights = plan.arch.companion(path, plan.config, weights)
                plan = dataclasses.replace(plan, config=companion_config)
        read_dense_layers(plan.st, path)
        parts = _build(
            plan, weights, dtype=compute_dtype, device=build_device, shard=shard, task=task
        )
        if quantization == "int8" and not shapes_only:
            quantize_layers(parts.body)
        hybrid = _hybrid(path, parts.body.hidden_size, tokenizer, plan)
        colbert = (
            read_stanford_format(path, tokenizer, parts.colbert.width)
            if parts.colbert is not None
            else None
        )
        if plan.st.pylate is not None:
            colbert_head = ColbertHead(tuple(plan.st.dense))
            colbert = read_pylate_format(plan.st.pylate, tokenizer, colbert_head.width)
            parts = dataclasses.replace(parts, colbert=colbert_head)
        listwise = (
            read_format(tokenizer, parts.listwise.width) if parts.listwise is not None else None
        )
    config = plan.config
    architectures = config.get("architectures") or [plan.arch.model_type]
    return LoadedModel(
        name=model,
        path=path,
        config=config,
        architecture=str(architectures[0]),
        model=parts.body,
        tokenizer=tokenizer,
        tokenizer_max_length=tokenizer_max,
        st=plan.st,
        default_pooling=plan.arch.pooling_of(config),
        dtype=compute_dtype,
        head_dim=head_dim_of(config),
        classifier=parts.classifier[0] if parts.classifier else None,
        classifier_head=parts.classifier[1] if parts.classifier else None,
        sparse=parts.sparse,
        hybrid=hybrid[0] if hybrid else None,
        hybrid_head=hybrid[1] if hybrid else None,
        colbert=colbert,
        colbert_head=parts.colbert,
        listwise=listwise,
        listwise_head=parts.listwise,
        tensors=parts.tensors,
        custom_code=plan.custom_code,
        attention_bias=plan.arch.attention_bias,
        attention_softcap=plan.arch.softcaps(config),
        attention_alibi=plan.arch.alibi(config),
        quantization=quantization,
        instruction=instruction,
        special_tokens=special_tokens,
    )


def model_backend(
    model: str, *, revision: str | None, cache_dir: str | None, backend: ModelBackend
) -> tuple[ServedBackend, dict[str, Any]]:
    """Which backend would serve ``model`` with the ``backend`` setting, and its config,
    from config.json alone: what the engine checks before it starts tensor-parallel ranks."""
    source = locate_model(model, revision=revision, cache_dir=cache_dir)  # no weights yet
    config = read_model_config(source.path)
    return choose_backend(config, backend, model=model), config


def _load_transformers(
    model: str,
    source: ModelSource,
    *,
    dtype: Dtype,
    device: torch.device,
    task: str,
    trust: bool,
    shapes_only: bool = False,
) -> LoadedModel:
    """``model`` on the transformers backend (``generic.py``), with the same tokenizer and
    sentence-transformers pipeline as the native path reads. Custom code not allowed is
    refused before any weight is fetched; a Hub model's Python files are fetched only when
    it is allowed. ``shapes_only`` (``inspect``) builds the model all the same: transformers'
    classes are not built from shapes, and what they read decides what is refused."""
    config = read_model_config(source.path)
    refuse_colbert(config)
    if is_listwise(config):
        raise UnsupportedModelError(
            "a listwise reranker (JinaForRanking, jina-reranker-v3) is served by the native "
            "backend only (its scores are read at marker tokens of one prompt per list); "
            "serve it with backend native (or auto)"
        )
    refuse_before_fetch(config, name=model, trust_remote_code=trust)
    st = read_sentence_transformers(source.path, dense_weights=False)
    if st.pylate is not None:
        raise UnsupportedModelError(
            "a PyLate ColBERT model is served by the native backend only (its query "
            "expansion needs the packed attention's key limits, its Dense layers apply to "
            "every token); serve it with backend native (or auto)"
        )
    refuse_generative(config, st, task)  # as on the native path: no silent last-token embedder
    refuse_task(config, name=model, task=task, splade=st.splade is not None)
    transformers_dtype(config, dtype, device)  # T5 in float16: refused before the download
    path = fetch_weights(source, st, code=trust)
    read_dense_layers(st, path)
    tokenizer, tokenizer_max, special_tokens = read_tokenizer(path)
    built = build_transformers(
        path,
        config,
        name=model,
        dtype=dtype,
        device=device,
        task=task,
        trust_remote_code=trust,
        st_activation=st.activation_fn,
        splade=st.splade is not None,
        declared_max_length=max(st.max_seq_length or 0, tokenizer_max or 0) or None,
    )
    architectures = config.get("architectures") or [type(built.model.module).__name__]
    hybrid = read_hybrid_head(
        path,
        hidden_size=built.model.hidden_size,
        tokenizer=tokenizer,
        architecture=str(architectures[0]),
    )
    return LoadedModel(
        name=model,
        path=path,
        config=config,
        architecture=str(architectures[0]),
        model=built.model,
        tokenizer=tokenizer,
        tokenizer_max_length=tokenizer_max,
        st=st,
        default_pooling=built.default_pooling,
        dtype=built.dtype,
        head_dim=built.head_dim,
        classifier=built.classifier[0] if built.classifier else None,
        classifier_head=built.classifier[1] if built.classifier else None,
        hybrid=hybrid[0] if hybrid else None,
        hybrid_head=hybrid[1] if hybrid else None,
        backend="transformers",
        attention=built.model.attention,
        custom_code=custom_code_class(config),
        special_tokens=special_tokens,
    )


def load_shard(
    model: str,
    *,
    revision: str | None,
    cache_dir: str | None,
    dtype: Dtype,
    device: torch.device,
    shard: Shard,
    task: str = "auto",
    trust_remote_code: bool = False,
) -> tuple[EmbeddingModel, torch.dtype, int, str | None, bool, bool]:
    """Only the body of ``model``, as tensor-parallel rank ``shard`` holds it: what a worker
    rank needs (no tokenizer, no pooling: those live on rank 0); with the dtype it runs in
    (resolved as :func:`load_model` resolves it), its attention head width and what its
    attention adds to the logits (``Architecture.attention_bias``), whether it soft-caps
    them (``Architecture.attention_softcap``) and whether it adds ALiBi biases
    (``Architecture.attention_alibi``). The same refusals apply
    as on rank 0 (the heads are read and dropped, so the tensor guard counts them as rank 0
    does)."""
    with naming(model):
        source = locate_model(model, revision=revision, cache_dir=cache_dir)
        plan = plan_model(source, task=task, trust_remote_code=trust_remote_code)
        compute_dtype = _compute_dtype(plan.arch, dtype, device)
        _audit_before_fetch(plan, dtype=compute_dtype, shard=shard, task=task)
        weights = load_weights(fetch_weights(source, plan.st))
        parts = _build(plan, weights, dtype=compute_dtype, device=device, shard=shard, task=task)
    return (
        parts.body,
        compute_dtype,
        head_dim_of(plan.config),
        plan.arch.attention_bias,
        plan.arch.softcaps(plan.config),
        plan.arch.alibi(plan.config),
    )


def _audit_before_fetch(plan: ModelPlan, *, dtype: torch.dtype, shard: Shard, task: str) -> None:
    """Refuse a Hub model whose tensors would refuse the load (a head we do not implement,
    a tensor nobody claims, a shape the config contradicts) before its weights are
    downloaded: the body and heads are built on the ``meta`` device from the safetensors
    headers, as ``inspect`` builds them. A model accepted here is audited again on the real
    weights; where the headers cannot be read (offline, ``.bin`` only) that audit is the one."""
    try:
        shapes = hub_shapes(plan.source)
    except ModelNotFoundError as error:
        # The download may still work (the headers are a separate request): go on, and let
        # the audit of the downloaded weights decide.
        logger.warning("%s; auditing the weights after the download instead", error)
        return
    if shapes is None:
        return
    _build(plan, shapes, dtype=dtype, device=torch.device("meta"), shard=shard, task=task)


def _weight_shapes(
    source: ModelSource, st: SentenceTransformerConfig
) -> tuple[Path, Mapping[str, torch.Tensor]]:
    """The directory to read the Dense modules from, and the checkpoint's tensors as shapes:
    from the safetensors headers on the Hub when online (only the Dense modules' small
    files and bge-m3's head files are downloaded), else from the files themselves."""
    shapes = hub_shapes(source)
    if shapes is not None and source.repo_id is not None:
        # Small files read whole: the Dense modules', and bge-m3's two heads (which say
        # what the model outputs) where the repository has them.
        path = download(
            source.repo_id,
            revision=source.revision,
            cache_dir=source.cache_dir,
            patterns=[*module_patterns(st.dense_modules), *HEAD_FILES],
        )
        return path, shapes
    path = fetch_weights(source, st)
    return path, TensorShapes.of(load_weights(path))


def _hybrid(
    path: Path, hidden_size: int, tokenizer: Tokenizer, plan: ModelPlan
) -> tuple[HybridHeads, HybridHead] | None:
    """bge-m3's sparse and ColBERT heads where ``path`` holds them (``device/hybrid.py``)."""
    architectures = plan.config.get("architectures") or [plan.arch.model_type]
    return read_hybrid_head(
        path, hidden_size=hidden_size, tokenizer=tokenizer, architecture=str(architectures[0])
    )


def _sparse_head(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    arch: Architecture,
    st: SentenceTransformerConfig,
    task: str,
) -> SparseHead | None:
    """A SparseEncoder's SPLADE head, or a masked-LM checkpoint's head with ``--task sparse``
    (max pooling, as SPLADE v2/v3); an error when it cannot be read. None otherwise, so an
    embedder never keeps a vocabulary-sized matrix it does not use."""
    if st.splade is not None:
        return read_sparse_head(config, weights, reader=arch.masked_lm, strategy=st.splade)
    if task == "sparse":
        return read_sparse_head(config, weights, reader=arch.masked_lm, strategy="max")
    return None

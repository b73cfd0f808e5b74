"""What goes into a loaded model's embedding fingerprint (``embedding_server.fingerprint``).

Gathered once at load, where everything that decides a vector is known:

* **The model's files, by content**: the sha256 of each file a load reads, by its path
  inside the model directory (:func:`model_files`). Weights are the bulk of it. A Hub
  snapshot's weights cost nothing to hash: each is a symlink to ``blobs/<sha256>``, the LFS
  object id the Hub computed over the file's bytes, which is the same sha256 this module
  computes for a plain file, so a snapshot and a copy of it fingerprint alike. A plain file
  (a local directory, the packaged default, a snapshot's small git files) is read once and
  hashed; the digest is kept for the life of the process, keyed by the file's identity
  and change times. Safetensors headers and sizes alone would not do: a fine-tune has its
  base model's header and size byte for byte.
* **What the load decided** from the files and the settings (:func:`fingerprint_inputs`):
  the backend, task, pooling (and whether prompt tokens are pooled), normalization, default
  dimensions, input length and the truncation side, prompts and the default one, the
  head's activation, outputs and scoring, dtype, quantization and the attention kernel.

Left out, because they do not change a vector: the served name, aliases, the model's path
or Hub id and revision string (the content stands for them), port, host, API workers, batch
and queue budgets, tokenizer threads, the device index and tensor parallelism (which change
floating-point summation order only; the golden-vector check measures that kind of drift).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from embedding_server.device.colbert import METADATA_FILE
from embedding_server.device.fake import FakeOptions
from embedding_server.device.hybrid import HEAD_FILES
from embedding_server.device.loading import LoadedModel
from embedding_server.fingerprint import SCHEMA, fingerprint_of
from embedding_server.request.configuration import EngineConfig, EngineInfo

_SMALL_SUFFIXES = (".json", ".txt", ".model", ".jinja")
"""Config, tokenizer (``tokenizer.json``, ``vocab.txt``, sentencepiece ``*.model``), chat
template and sentence-transformers files, at any depth: what a Hub model's first download
fetches (``hub._CONFIG_PATTERNS``), plus a separate chat template."""

_BLOB = re.compile(r"[0-9a-f]{64}")

DEFAULT_TRUNCATION_SIDE = "right"
"""The end an over-long input is cut at when a request does not say (``Truncation``'s
default); part of the inputs so that a change to it would show."""

_digests: dict[tuple[int, int, int, int, int], str] = {}
_digests_lock = threading.Lock()


def model_files(path: Path, *, code: bool = False) -> dict[str, str]:
    """The sha256 of each file of the model in ``path`` that a load reads, by its POSIX
    path inside ``path``: config, tokenizer, sentence-transformers and adapter files
    (``*.json``, ``*.txt``, ``*.model``, ``*.jinja``, ColBERT's ``artifact.metadata``), every
    ``*.safetensors``, bge-m3's head files, ``pytorch_model*.bin`` in a folder without
    safetensors (where the loader falls back to them), and ``*.py`` when ``code`` (the
    transformers backend runs the checkpoint's own code). Hidden folders (``.cache``,
    ``.git``) are not the model's."""
    return {name: file_digest(file) for name, file in _model_file_paths(path, code=code)}


def _model_file_paths(root: Path, *, code: bool) -> Iterator[tuple[str, Path]]:
    seen: set[str] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a linked folder met twice (or a link to a parent): once is enough
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        here = Path(folder)
        has_safetensors = any(f.endswith(".safetensors") for f in files)
        for name in sorted(files):
            if name.startswith("."):
                continue
            top = here == root
            if (
                name.endswith(_SMALL_SUFFIXES)
                or name == METADATA_FILE
                or name.endswith(".safetensors")
                or (top and name in HEAD_FILES)
                or (
                    name.startswith("pytorch_model")
                    and name.endswith(".bin")
                    and not has_safetensors
                )
                or (code and name.endswith(".py"))
            ):
                file = here / name
                yield file.relative_to(root).as_posix(), file


def file_digest(file: Path) -> str:
    """The sha256 of ``file``'s bytes (hex): a Hub cache's LFS object id where ``file`` links
    to one (``.../blobs/<sha256>``), else read, once per process while the file's identity,
    size and change times stay the same."""
    if file.is_symlink():
        target = Path(os.readlink(file))
        if target.parent.name == "blobs" and _BLOB.fullmatch(target.name):
            return target.name
    stat = file.stat()
    key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    with _digests_lock:
        known = _digests.get(key)
    if known is not None:
        return known
    with file.open("rb") as stream:
        digest = hashlib.file_digest(stream, "sha256").hexdigest()
    with _digests_lock:
        _digests[key] = digest
    return digest


def has_weights(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint's weights at its root (``inspect`` of a Hub model
    reads only their headers: its fingerprint is then unknown)."""
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def fingerprint_inputs(
    loaded: LoadedModel, config: EngineConfig, info: EngineInfo, *, code: bool = False
) -> dict[str, Any]:
    """Everything that decides ``loaded``'s vectors as served with ``config`` (see the module
    doc), as plain JSON values; ``code``: the checkpoint's own Python runs."""
    inputs: dict[str, Any] = {
        "schema": SCHEMA,
        "files": model_files(loaded.path, code=code) if loaded.path is not None else {},
        "backend": info.backend,
        "task": info.task,
        "pooling": info.pooling,
        "include_prompt": config.include_prompt,
        "normalize": info.normalize,
        "dimensions": info.dimensions,
        "max_input_tokens": info.max_input_tokens,
        "truncation_side": DEFAULT_TRUNCATION_SIDE,
        "prompts": dict(info.prompts),
        "default_prompt_name": info.default_prompt_name,
        "score_activation": info.score_activation,
        "outputs": list(info.outputs),
        "score_method": info.score_method,
        "dtype": info.dtype,
        "quantization": info.quantization,
        "attention": info.attention,
    }
    if loaded.backend == "fake":
        options = asdict(FakeOptions.parse(loaded.name))
        # Waits and injected failures change timing, never a vector.
        for timing in ("delay_ms", "device_error_after", "device_us_per_token", "device_launch_us"):
            options.pop(timing)
        inputs["fake"] = options
    return inputs


def with_fingerprint(
    info: EngineInfo, loaded: LoadedModel, config: EngineConfig, *, code: bool = False
) -> EngineInfo:
    """``info`` with its ``fingerprint`` and ``fingerprint_inputs``."""
    inputs = fingerprint_inputs(loaded, config, info, code=code)
    return replace(info, fingerprint=fingerprint_of(inputs), fingerprint_inputs=inputs)

"""ColBERT checkpoints on the device: the projection of every token state, and what the
checkpoint's files say about its tokenization (``embedding_server/request/colbert.py``).

stanford-futuredata/ColBERT's ``HF_ColBERT`` (answerdotai/answerai-colbert-small-v1) is a
BERT body under ``bert.``, a ``linear`` projection without bias beside it in the same
safetensors, and ``artifact.metadata`` (JSON) naming the query and document markers, the
query and document lengths, whether the query's ``[MASK]`` expansion is attended to, and
whether punctuation is masked out of documents. A setting this server cannot reproduce
(another similarity than cosine, another interaction than ColBERT's) is refused naming it.
The body is whatever the config says: jinaai/jina-colbert-v2 is an ``HF_ColBERT`` over jina's
rotary XLM-R (``model_type: xlm-roberta``, ``position_embedding_type: rotary``, the body
under ``roberta.``: vLLM's ``ColBERTJinaRobertaModel``), served by jina-embeddings-v3's
implementation; its markers are tokens added to XLM-R's vocabulary (``[QueryMarker]``,
``[DocumentMarker]``), its expansion token XLM-R's ``<mask>``.

PyLate's (lightonai/GTE-ModernColBERT-v1) is a sentence-transformers pipeline of a
Transformer and PyLate ``Dense`` modules (read as sentence-transformers' Dense layers, whose
format they share, but applied to every token), its tokenization in
``config_sentence_transformers.json``: ``query_prefix``/``document_prefix`` (tokens added to
the vocabulary), ``query_length``/``document_length``, ``do_query_expansion``,
``attend_to_expansion_tokens`` and ``skiplist_words``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from embedding_server.device.pooling import DenseLayer
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.colbert import ColbertFormat, punctuation_skiplist

PYLATE_DENSE = "pylate.models.Dense.Dense"
"""The one PyLate module type read (its other modules are refused by name)."""
METADATA_FILE = "artifact.metadata"
"""stanford-colbert's checkpoint settings, saved beside the weights."""
LINEAR = "linear.weight"


@dataclass(frozen=True)
class ColbertHead:
    """The projection applied to every token state: HF_ColBERT's ``linear`` (no bias), or
    PyLate's Dense layers in order (float32)."""

    layers: tuple[DenseLayer, ...]

    @property
    def width(self) -> int:
        return self.layers[-1].out_features

    def to(self, device: torch.device) -> ColbertHead:
        return ColbertHead(tuple(layer.to(device) for layer in self.layers))

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        x = states.float()
        for layer in self.layers:
            x = layer(x)
        return x


def is_hf_colbert(config: Mapping[str, Any]) -> bool:
    """Whether ``config.json`` names stanford-colbert's ``HF_ColBERT`` class."""
    return "HF_ColBERT" in [str(n) for n in config.get("architectures") or []]


def read_linear(weights: Mapping[str, torch.Tensor], hidden_size: int) -> ColbertHead:
    """``linear.weight`` of an ``HF_ColBERT`` checkpoint (reading it marks it read)."""
    if LINEAR not in weights:
        raise UnsupportedModelError(
            f"HF_ColBERT checkpoint without {LINEAR}: its projection is what its vectors are"
        )
    weight = weights[LINEAR].float()
    if weight.dim() != 2 or int(weight.shape[1]) != hidden_size:
        raise UnsupportedModelError(
            f"HF_ColBERT {LINEAR} has shape {list(weight.shape)}, expected "
            f"[width, {hidden_size}] for a body of hidden size {hidden_size}"
        )
    if "linear.bias" in weights:
        raise UnsupportedModelError(
            "HF_ColBERT checkpoint with linear.bias: stanford-colbert's projection has none, "
            "and serving it without the bias would not give the checkpoint's vectors"
        )
    return ColbertHead((DenseLayer(weight, None, "identity"),))


def read_stanford_format(path: Path | None, tokenizer: Tokenizer, width: int) -> ColbertFormat:
    """The tokenization ``artifact.metadata`` declares, its markers resolved in
    ``tokenizer``'s vocabulary; refused when the file is missing or asks for what is not
    served."""
    meta: Any = None
    if path is not None:
        try:
            meta = json.loads((path / METADATA_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise UnsupportedModelError(
                f"HF_ColBERT checkpoint without a readable {METADATA_FILE} ({exc}): its query "
                "and document markers and lengths decide its vectors"
            ) from exc
    if not isinstance(meta, dict):
        raise UnsupportedModelError(f"HF_ColBERT checkpoint without {METADATA_FILE}")
    similarity = meta.get("similarity", "cosine")
    if similarity != "cosine":
        raise UnsupportedModelError(
            f"{METADATA_FILE} sets similarity {similarity!r}; only cosine (normalized "
            "vectors, MaxSim of dot products) is served"
        )
    interaction = meta.get("interaction", "colbert")
    if interaction != "colbert":
        raise UnsupportedModelError(
            f"{METADATA_FILE} sets interaction {interaction!r}; only colbert is served"
        )

    def token(key: str, default: str) -> int:
        name = str(meta.get(key) or default)
        found = tokenizer.token_to_id(name)
        if found is None:
            raise UnsupportedModelError(
                f"{METADATA_FILE}'s {key} {name!r} is not in the tokenizer's vocabulary"
            )
        return found

    def length(key: str) -> int:
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 3:
            raise UnsupportedModelError(
                f"{METADATA_FILE}'s {key} must be an integer of at least 3; got {value!r}"
            )
        return value

    return ColbertFormat(
        style="stanford",
        query_marker=token("query_token_id", "[unused0]"),
        document_marker=token("doc_token_id", "[unused1]"),
        query_length=length("query_maxlen"),
        document_length=length("doc_maxlen"),
        # stanford-colbert expands with its tokenizer's own mask token (XLM-R's <mask> in
        # jina-colbert-v2), which artifact.metadata does not repeat.
        mask_id=token("mask_token", declared_token(path, "mask_token") or "[MASK]"),
        attend_to_expansion=bool(meta.get("attend_to_mask_tokens", False)),
        skiplist=(
            punctuation_skiplist(tokenizer, "stanford")
            if meta.get("mask_punctuation", True)
            else frozenset()
        ),
        width=width,
    )


def declared_token(path: Path | None, role: str) -> str | None:
    """The token ``role`` (``mask_token`` ...) the tokenizer's configuration names
    (``tokenizer_config.json``, else ``special_tokens_map.json``), None where neither does."""
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            data = json.loads((path / file).read_text()) if path is not None else None
        except (OSError, ValueError):
            continue
        value = data.get(role) if isinstance(data, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def read_pylate_format(
    settings: Mapping[str, Any], tokenizer: Tokenizer, width: int
) -> ColbertFormat:
    """The tokenization a PyLate ``config_sentence_transformers.json`` declares; refused
    where it asks for what is not served or names a token the vocabulary lacks."""
    file = "config_sentence_transformers.json"

    def token(key: str) -> int:
        name = settings.get(key)
        found = tokenizer.token_to_id(name) if isinstance(name, str) else None
        if found is None:
            raise UnsupportedModelError(
                f"PyLate {file}'s {key} {name!r} is not a token of the vocabulary (PyLate "
                "adds it as one and inserts its id after the first token)"
            )
        return found

    def length(key: str) -> int:
        value = settings.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 3:
            raise UnsupportedModelError(
                f"PyLate {file}'s {key} must be an integer of at least 3; got {value!r}"
            )
        return value

    if settings.get("do_query_expansion", True) is not True:
        raise UnsupportedModelError(
            f"PyLate {file} sets do_query_expansion false; only expanded queries are served"
        )
    mask = tokenizer.token_to_id("[MASK]")
    if mask is None:
        raise UnsupportedModelError("PyLate model whose tokenizer has no [MASK] token")
    words = settings.get("skiplist_words") or []
    if not isinstance(words, list):
        raise UnsupportedModelError(f"PyLate {file}'s skiplist_words is not a list")
    # convert_tokens_to_ids gives the unknown token for a word the vocabulary lacks.
    unk = tokenizer.token_to_id("[UNK]")
    found = [tokenizer.token_to_id(str(w)) for w in words]
    skip = {unk if i is None else i for i in found}
    return ColbertFormat(
        style="pylate",
        query_marker=token("query_prefix"),
        document_marker=token("document_prefix"),
        query_length=length("query_length"),
        document_length=length("document_length"),
        mask_id=mask,
        attend_to_expansion=bool(settings.get("attend_to_expansion_tokens", False)),
        skiplist=frozenset(i for i in skip if i is not None),
        width=width,
    )

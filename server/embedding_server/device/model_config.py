"""A model directory's ``config.json`` as the server reads it (:func:`read_model_config`),
and the JSON reader every reader of a model's files shares (:func:`read_json`).

``config.json`` is the first file read of any model: it says which packed implementation
serves it (``models.lookup``). A checkpoint whose config names no ``model_type`` but a known
custom config class is given that class's type (:data:`CUSTOM_CONFIG_MODEL_TYPES`); a
sentence-transformers CLIP model, whose config.json is in a subfolder, is refused naming that
folder (:data:`ST_CLIP`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embedding_server.errors import UnsupportedModelError


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

"""Tiny CLIP and SigLIP checkpoints for the vision-tower tests: random weights (spread so the
layers mix) saved with transformers' ``save_pretrained``, byte-level tokenizers built
offline in each model's layout (CLIP: ``<|startoftext|> text <|endoftext|>``; SigLIP:
``text </s>``), saved as tokenizer.json so the loader finds them, and the model's image
processor (``preprocessor_config.json``, 32 x 32 pixels).

``serve`` loads such a directory the way the server does (``load_model``) and wraps it in the
runner that executes batches, so tests go through the same path as requests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from embedding_server.device.loading import LoadedModel, load_model
from embedding_server.device.pooling import DenseHead
from embedding_server.device.runner import ModelRunner
from embedding_server.request.pooling import FloatArray
from embedding_server.settings import Dtype
from transformers import (
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    Siglip2Config,
    Siglip2ImageProcessor,
    Siglip2Model,
    SiglipConfig,
    SiglipImageProcessor,
    SiglipModel,
)

from tests.support.models import _save_tokenizer, byte_tokenizer, spread_weights

TOWER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
IMAGE_SIZE = 32
PATCH = 8

CLIP_SPECIALS = ["<|startoftext|>", "<|endoftext|>"]
SIGLIP_SPECIALS = ["<pad>", "</s>", "<unk>"]


def build_clip(path: Path, *, seed: int = 3, **text: Any) -> Path:
    """A 2-layer CLIP (text and vision) with a CLIP-style tokenizer that appends
    ``<|endoftext|>`` (id 1, the config's eos_token_id unless ``text`` overrides it)."""
    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(CLIP_SPECIALS, "<|startoftext|> $A <|endoftext|>", CLIP_SPECIALS)
    _save_tokenizer(
        tok,
        path,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    text_config = {
        **TOWER,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 64,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
        **text,
    }
    vision_config = {**TOWER, "image_size": IMAGE_SIZE, "patch_size": PATCH}
    config = CLIPConfig(text_config=text_config, vision_config=vision_config, projection_dim=24)
    torch.manual_seed(seed)
    model = CLIPModel(config)
    spread_weights(model)
    model.save_pretrained(str(path))
    CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(str(path))
    return path


def _siglip_text(path: Path) -> dict[str, Any]:
    """SigLIP's tokenizer saved in ``path`` (a new folder), and the text tower's config."""
    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(SIGLIP_SPECIALS, "$A </s>", ["</s>"])
    _save_tokenizer(tok, path, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    return {
        **TOWER,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 24,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 1,
    }


def build_siglip(path: Path, *, seed: int = 4, **vision: Any) -> Path:
    """A 2-layer SigLIP (text and vision, attention-pooling head) with a SigLIP-style
    tokenizer that appends ``</s>``; texts are padded with ``<pad>`` (id 0) to 24 tokens."""
    text_config = _siglip_text(path)
    return _save_siglip(path, text_config, seed, **vision)


def _save_siglip(path: Path, text_config: dict[str, Any], seed: int, **vision: Any) -> Path:
    """A random SiglipModel of ``text_config`` and :data:`TOWER`'s vision tower, spread and
    saved at ``path`` with SigLIP's image processor at :data:`IMAGE_SIZE`."""
    vision_config = {**TOWER, "image_size": IMAGE_SIZE, "patch_size": PATCH, **vision}
    config = SiglipConfig(text_config=text_config, vision_config=vision_config)
    torch.manual_seed(seed)
    model = SiglipModel(config)
    spread_weights(model)
    model.save_pretrained(str(path))
    SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(
        str(path)
    )
    return path


SPM_CORPUS = [
    "a photo of a cat",
    "a photo of two dogs playing in the snow",
    "the quick brown fox jumps over the lazy dog",
    "an image of a red car parked on a street",
    "hello world this is a tiny sentencepiece model",
    "people walking in a park with trees",
]


SPM_VOCAB = 48


def build_siglip_spm(path: Path, *, seed: int = 6) -> Path:
    """A 2-layer SigLIP laid out as google/siglip-* are: a sentencepiece ``spiece.model``
    (Unigram, trained here on :data:`SPM_CORPUS`; ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2), no
    ``tokenizer.json``, and a ``tokenizer_config.json`` naming ``SiglipTokenizer`` with
    ``do_lower_case`` and ``</s>`` as the pad token; the text tower pads with ``</s>`` (id 1)
    to 24 tokens."""
    import sentencepiece as spm

    path.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS * 20),
        model_prefix=str(path / "spiece"),
        vocab_size=SPM_VOCAB,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    (path / "spiece.vocab").unlink()
    specials = {"eos_token": "</s>", "pad_token": "</s>", "unk_token": "<unk>"}
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "SiglipTokenizer",
                "do_lower_case": True,
                "model_max_length": 24,
                **specials,
            }
        )
    )
    (path / "special_tokens_map.json").write_text(json.dumps(specials))
    text_config = {
        **TOWER,
        "vocab_size": SPM_VOCAB,
        "max_position_embeddings": 24,
        "pad_token_id": 1,
        "eos_token_id": 1,
        "bos_token_id": 1,
    }
    return _save_siglip(path, text_config, seed)


def build_siglip2(path: Path, *, seed: int = 5) -> Path:
    """A 2-layer SigLIP 2 NaFlex (patch 8, a 4 x 4 position table) with build_siglip's
    tokenizer and a Siglip2ImageProcessor of ``max_num_patches`` 16."""
    text_config = _siglip_text(path)
    vision_config = {**TOWER, "num_patches": 16, "patch_size": PATCH}
    config = Siglip2Config(text_config=text_config, vision_config=vision_config)
    torch.manual_seed(seed)
    model = Siglip2Model(config)
    spread_weights(model)
    model.save_pretrained(str(path))
    Siglip2ImageProcessor(patch_size=PATCH, max_num_patches=16).save_pretrained(str(path))
    return path


def serve(path: Path, dtype: Dtype = "float32") -> tuple[LoadedModel, ModelRunner]:
    """``path`` loaded as the server loads it, and the runner of its batches (pooling last,
    the registry's default for both families; no Dense layers)."""
    loaded = load_model(
        str(path), revision=None, cache_dir=None, dtype=dtype, device=torch.device("cpu")
    )
    runner = ModelRunner(
        loaded.model, device=torch.device("cpu"), pooling=loaded.default_pooling, head=DenseHead()
    )
    return loaded, runner


def random_pixels(count: int, seed: int = 0) -> list[FloatArray]:
    """``count`` random ``[3, 32, 32]`` float32 images in a normalized range (what an image
    processor gives)."""
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32) for _ in range(count)
    ]


def cosines(a: FloatArray, b: FloatArray) -> FloatArray:
    """Row-wise cosine similarity."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    dot = (a64 * b64).sum(-1)
    out: FloatArray = dot / (np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1))
    return out

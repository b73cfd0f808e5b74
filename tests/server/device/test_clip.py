"""CLIP (``model_type: clip``) served natively: its text tower on the packed path and its
vision tower through ``encode_images``, in one batch.

A tiny random CLIPModel (``tests.support.vision``) loads as the server loads it; ONE batch
mixing texts of several lengths and images runs through the ModelRunner, and each row must
equal transformers' ``get_text_features`` / ``get_image_features`` for that input alone:
cosine >= 0.99999 in float32, >= 0.999 in bfloat16 (against float32 transformers). Pixels are
given directly (preprocessing parity is the image processor's test). Also: the legacy
``eos_token_id: 2`` pooling rule, the transformers backend and other tasks refused, and what
``/info`` says the model takes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.device.loading import load_model
from embedding_server.device.models.vision import image_tokens_of
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.media.preprocessing import ImageInput
from embedding_server.request.sequences import SequenceInput
from transformers import CLIPModel

from tests.support.vision import IMAGE_SIZE, PATCH, build_clip, cosines, random_pixels, serve

pytestmark = pytest.mark.timeout(300)

TEXTS = ["a", "a photo of a cat", "two dogs playing in the snow on a sunny day", "x y"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


def _reference(path: Path, ids: list[list[int]], pixels: list[np.ndarray]) -> np.ndarray:
    """transformers' vectors, each input alone (no padding, no batch effects)."""
    model = CLIPModel.from_pretrained(str(path)).eval()
    rows = []
    with torch.no_grad():
        for seq in ids:
            out = model.get_text_features(input_ids=torch.tensor([seq]))
            rows.append(out.pooler_output[0].numpy())
        for image in pixels:
            out = model.get_image_features(pixel_values=torch.from_numpy(image)[None])
            rows.append(out.pooler_output[0].numpy())
    return np.stack(rows)


@pytest.mark.parametrize(("dtype", "floor"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_mixed_batch_matches_transformers(clip_dir: Path, dtype: str, floor: float) -> None:
    loaded, runner = serve(clip_dir, dtype)  # type: ignore[arg-type]
    ids = [loaded.tokenizer.encode(t).ids for t in TEXTS]
    assert len({len(i) for i in ids}) == len(ids)  # mixed lengths
    pixels = random_pixels(3)
    tokens = image_tokens_of(loaded.model)
    assert tokens == (IMAGE_SIZE // PATCH) ** 2 + 1
    # Interleaved, as the scheduler may batch them: text, image, text, text, image, ...
    seqs = [
        SequenceInput(ids[0]),
        SequenceInput([0] * tokens, pixels=pixels[0]),
        SequenceInput(ids[1]),
        SequenceInput(ids[2]),
        SequenceInput([0] * tokens, pixels=pixels[1]),
        SequenceInput(ids[3]),
        SequenceInput([0] * tokens, pixels=pixels[2]),
    ]
    out = runner.run(seqs)
    ref = _reference(clip_dir, ids, pixels)
    expected = ref[[0, 4, 1, 2, 5, 3, 6]]
    assert out.pooled.shape == expected.shape == (7, 24)
    assert cosines(out.pooled, expected).min() >= floor
    assert out.tokens == [None] * 7


def test_images_alone_and_texts_alone(clip_dir: Path) -> None:
    loaded, runner = serve(clip_dir)
    pixels = random_pixels(2, seed=5)
    tokens = image_tokens_of(loaded.model) or 0
    images = runner.run([SequenceInput([0] * tokens, pixels=p) for p in pixels])
    ids = [loaded.tokenizer.encode(t).ids for t in TEXTS[:2]]
    texts = runner.run([SequenceInput(i) for i in ids])
    ref = _reference(clip_dir, ids, pixels)
    assert cosines(images.pooled, ref[2:]).min() >= 0.99999
    assert cosines(texts.pooled, ref[:2]).min() >= 0.99999


def test_warmup_includes_an_image(clip_dir: Path) -> None:
    _, runner = serve(clip_dir)
    warmup = runner.warmup_batch(64, 1024, 8)
    assert any(s.pixels is not None for s in warmup)
    out = runner.run(warmup)
    assert np.isfinite(out.pooled).all() and out.pooled.shape[0] == len(warmup)


def test_token_states_of_an_image_are_refused(clip_dir: Path) -> None:
    loaded, runner = serve(clip_dir)
    tokens = image_tokens_of(loaded.model) or 0
    with pytest.raises(Exception, match="no per-token states"):
        runner.run([SequenceInput([0] * tokens, want_tokens=True, pixels=random_pixels(1)[0])])


def test_wrong_image_size_is_refused(clip_dir: Path) -> None:
    _, runner = serve(clip_dir)
    small = np.zeros((3, 16, 16), dtype=np.float32)
    with pytest.raises(ValueError, match=f"3 x {IMAGE_SIZE} x {IMAGE_SIZE}"):
        runner.run([SequenceInput([0] * 5, pixels=small)])


def test_legacy_eos_rule_refuses_a_tokenizer_it_would_not_pool_right(tmp_path: Path) -> None:
    # eos_token_id 2: transformers pools at the largest id, which this tokenizer's
    # <|endoftext|> (id 1) is not, so "last" would not be get_text_features' position.
    path = build_clip(tmp_path / "legacy", eos_token_id=2)
    with pytest.raises(UnsupportedModelError, match="largest token id"):
        serve(path)


def test_transformers_backend_and_other_tasks_are_refused(clip_dir: Path) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(UnsupportedModelError, match="transformers backend cannot carry"):
        load_model(
            str(clip_dir),
            revision=None,
            cache_dir=None,
            dtype="float32",
            device=cpu,
            backend="transformers",
        )
    with pytest.raises(UnsupportedModelError, match="task embed"):
        load_model(
            str(clip_dir), revision=None, cache_dir=None, dtype="float32", device=cpu, task="score"
        )


def test_every_tensor_is_read_or_ignored_with_its_reason(clip_dir: Path) -> None:
    loaded, _ = serve(clip_dir)
    assert loaded.tensors is not None
    assert not loaded.tensors.unclaimed
    ignored = dict(loaded.tensors.ignored)
    assert "contrastive temperature" in ignored["logit_scale"]
    config = json.loads((clip_dir / "config.json").read_text())
    assert config["model_type"] == "clip"


def test_sentence_transformers_clip_layouts(clip_dir: Path, tmp_path: Path) -> None:
    """sentence-transformers' CLIPModel module: at the root (path "") the folder is served
    with CLIP's own vectors; in its own folder (clip-ViT-B-32's 0_CLIPModel) the load is
    refused, naming the folder to serve instead."""
    module = {"idx": 0, "name": "0", "type": "sentence_transformers.models.CLIPModel"}
    root = tmp_path / "st-root"
    shutil.copytree(clip_dir, root)
    (root / "modules.json").write_text(json.dumps([{**module, "path": ""}]))
    loaded, runner = serve(root)
    ids = loaded.tokenizer.encode(TEXTS[1]).ids
    pixels = random_pixels(1, seed=9)
    tokens = image_tokens_of(loaded.model) or 0
    out = runner.run([SequenceInput(ids), SequenceInput([0] * tokens, pixels=pixels[0])])
    assert cosines(out.pooled, _reference(clip_dir, [ids], pixels)).min() >= 0.99999

    nested = tmp_path / "st-nested"
    nested.mkdir()
    shutil.copytree(clip_dir, nested / "0_CLIPModel")
    (nested / "modules.json").write_text(json.dumps([{**module, "path": "0_CLIPModel"}]))
    with pytest.raises(UnsupportedModelError, match="serve that folder") as refused:
        serve(nested)
    assert str(nested / "0_CLIPModel") in str(refused.value)


def test_the_engine_serves_texts_and_images_with_transformers_vectors(clip_dir: Path) -> None:
    """Through the offline API: /info's modalities and image_tokens, and a preprocessed
    ImageInput beside a text in one request, each transformers' vector."""
    engine = Engine.from_pretrained(str(clip_dir), dtype="float32", normalize=False)
    info = engine.info()
    assert info.modalities == ["text", "image"]
    assert info.image_tokens == (IMAGE_SIZE // PATCH) ** 2 + 1
    assert info.pooling == "last"
    pixels = random_pixels(1, seed=21)
    text = TEXTS[2]
    out = engine.embed_full([text, ImageInput(pixels[0], info.image_tokens)])
    ids = engine.tokenize(text)[0]
    expected = _reference(clip_dir, [ids], pixels)
    assert cosines(out.embeddings, expected).min() >= 0.99999
    assert out.token_counts == [len(ids), info.image_tokens]

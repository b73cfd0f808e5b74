"""SigLIP (``model_type: siglip``, also the SigLIP 2 FixRes checkpoints) served natively.

A tiny random SiglipModel (``tests.support.vision``) loads as the server loads it; ONE batch
mixing texts of several lengths and images runs through the ModelRunner. Each text must equal
transformers' ``get_text_features`` on that text padded to ``max_length`` with the pad id and
no attention mask (how SigLIP's processor is documented to be called, and how it was trained;
the tower pads itself), each image ``get_image_features`` (the attention-pooling head):
cosine >= 0.99999 in float32, >= 0.999 in bfloat16; SigLIP 2 NaFlex (``siglip2``) likewise
with images of several sizes packed in one batch. Also: the vision-language embedders are
refused with what is missing, and a text-only model refuses pixels.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.device.distributed import Shard
from embedding_server.device.models import ARCHITECTURES, build_model
from embedding_server.device.models.vision import image_tokens_of
from embedding_server.device.weights import load_weights
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from embedding_server.request.sequences import SequenceInput
from transformers import Siglip2Model, SiglipModel
from transformers.models.siglip2.image_processing_pil_siglip2 import convert_image_to_patches

from tests.support.models import build_bert
from tests.support.vision import (
    IMAGE_SIZE,
    PATCH,
    build_siglip,
    build_siglip2,
    cosines,
    random_pixels,
    serve,
)

pytestmark = pytest.mark.timeout(300)

TEXTS = ["a", "a photo of a cat", "x y", "snowy dogs"]


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_siglip(tmp_path_factory.mktemp("siglip") / "tiny-siglip")


def _reference(path: Path, ids: list[list[int]], pixels: list[np.ndarray]) -> np.ndarray:
    """transformers' vectors: texts padded to max_length (24) with the pad id (0), no mask."""
    model = SiglipModel.from_pretrained(str(path)).eval()
    width = model.config.text_config.max_position_embeddings
    pad = model.config.text_config.pad_token_id
    rows = []
    with torch.no_grad():
        for seq in ids:
            padded = torch.tensor([seq + [pad] * (width - len(seq))])
            rows.append(model.get_text_features(input_ids=padded).pooler_output[0].numpy())
        for image in pixels:
            out = model.get_image_features(pixel_values=torch.from_numpy(image)[None])
            rows.append(out.pooler_output[0].numpy())
    return np.stack(rows)


@pytest.mark.parametrize(("dtype", "floor"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_mixed_batch_matches_transformers(siglip_dir: Path, dtype: str, floor: float) -> None:
    loaded, runner = serve(siglip_dir, dtype)  # type: ignore[arg-type]
    ids = [loaded.tokenizer.encode(t).ids for t in TEXTS]
    assert len({len(i) for i in ids}) == len(ids)  # mixed lengths
    assert all(i[-1] == 1 for i in ids)  # </s> last, as SigLIP's tokenizer does
    tokens = image_tokens_of(loaded.model)
    assert tokens == (IMAGE_SIZE // PATCH) ** 2  # no class token
    pixels = random_pixels(2, seed=3)
    seqs = [
        SequenceInput([0] * tokens, pixels=pixels[0]),
        SequenceInput(ids[0]),
        SequenceInput(ids[1]),
        SequenceInput([0] * tokens, pixels=pixels[1]),
        SequenceInput(ids[2]),
        SequenceInput(ids[3]),
    ]
    out = runner.run(seqs)
    expected = _reference(siglip_dir, ids, pixels)[[4, 0, 1, 5, 2, 3]]
    assert out.pooled.shape == expected.shape == (6, 32)
    assert cosines(out.pooled, expected).min() >= floor


def test_unpadded_text_would_differ(siglip_dir: Path) -> None:
    """Why the tower pads: the same text without padding is another vector."""
    loaded, runner = serve(siglip_dir)
    seq = loaded.tokenizer.encode("a photo of a cat").ids
    model = SiglipModel.from_pretrained(str(siglip_dir)).eval()
    with torch.no_grad():
        bare = model.get_text_features(input_ids=torch.tensor([seq])).pooler_output[0].numpy()
    served = runner.run([SequenceInput(seq)]).pooled
    assert cosines(served, bare[None])[0] < 0.999
    assert cosines(served, _reference(siglip_dir, [seq], []))[0] >= 0.99999


@pytest.mark.parametrize(("dtype", "floor"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_siglip2_naflex_packs_images_of_several_sizes(
    tmp_path_factory: pytest.TempPathFactory, dtype: str, floor: float
) -> None:
    """NaFlex: images of different aspect ratios and patch counts (and texts) in one batch,
    packed by their patch counts; each equals transformers' Siglip2Model on that image's
    processor layout (``convert_image_to_patches``, its spatial shape, a full mask)."""
    path = build_siglip2(tmp_path_factory.mktemp("siglip2") / "tiny-naflex")
    loaded, runner = serve(path, dtype)  # type: ignore[arg-type]
    assert image_tokens_of(loaded.model) == 16  # the processor's max_num_patches
    rng = np.random.default_rng(8)
    shapes = [(2, 4), (4, 2), (3, 3), (1, 1), (4, 4)]  # (h, w) in patches
    pixels = [rng.standard_normal((3, h * PATCH, w * PATCH)).astype(np.float32) for h, w in shapes]
    ids = [loaded.tokenizer.encode(t).ids for t in TEXTS[:2]]
    seqs = [SequenceInput(ids[0])]
    seqs += [
        SequenceInput([0] * (h * w), pixels=p) for (h, w), p in zip(shapes, pixels, strict=True)
    ]
    seqs += [SequenceInput(ids[1])]
    out = runner.run(seqs)

    model = Siglip2Model.from_pretrained(str(path)).eval()
    width = model.config.text_config.max_position_embeddings
    pad = model.config.text_config.pad_token_id
    rows = []
    with torch.no_grad():
        padded = torch.tensor([ids[0] + [pad] * (width - len(ids[0]))])
        rows.append(model.get_text_features(input_ids=padded).pooler_output[0].numpy())
        for (h, w), image in zip(shapes, pixels, strict=True):
            patches = torch.from_numpy(convert_image_to_patches(image, PATCH))[None]
            out_ref = model.get_image_features(
                pixel_values=patches,
                pixel_attention_mask=torch.ones(1, h * w, dtype=torch.long),
                spatial_shapes=torch.tensor([[h, w]]),
            )
            rows.append(out_ref.pooler_output[0].numpy())
        padded = torch.tensor([ids[1] + [pad] * (width - len(ids[1]))])
        rows.append(model.get_text_features(input_ids=padded).pooler_output[0].numpy())
    expected = np.stack(rows)
    assert out.pooled.shape == expected.shape
    assert cosines(out.pooled, expected).min() >= floor
    # The position table really is resized per shape: a 2 x 4 and a 4 x 2 image differ.
    assert cosines(out.pooled[1:2], out.pooled[2:3])[0] < 0.999


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl", "phi3_v", "llava_next"])
def test_vision_language_embedders_are_refused_saying_what_is_missing(
    tmp_path: Path, model_type: str
) -> None:
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(UnsupportedModelError) as refused:
        serve(path)
    message = str(refused.value)
    assert model_type in message
    assert "image path through the generic transformers backend" in message
    assert "CLIP or SigLIP" in message


def test_a_text_only_model_refuses_pixels(tmp_path: Path) -> None:
    _, runner = serve(build_bert(tmp_path / "bert"))
    image = SequenceInput([0] * 10, pixels=random_pixels(1)[0])
    with pytest.raises(InvalidRequestError, match="no vision tower"):
        runner.run([SequenceInput([101, 2000, 102]), image])


def test_vision_use_head_false_is_refused(tmp_path: Path) -> None:
    path = build_siglip(tmp_path / "headless")
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["vision_use_head"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="vision_use_head"):
        serve(path)
    shutil.rmtree(path)


def test_token_states_are_refused_not_faked(siglip_dir: Path) -> None:
    """The text tower pools inside the model: per-token states would be copies of the
    vector, so asking for them is refused."""
    loaded, runner = serve(siglip_dir)
    seq = loaded.tokenizer.encode("a cat").ids
    with pytest.raises(InvalidRequestError, match="no per-token states"):
        runner.run([SequenceInput(seq, want_tokens=True)])


def test_tensor_parallel_is_refused(siglip_dir: Path) -> None:
    config = json.loads((siglip_dir / "config.json").read_text())
    weights = load_weights(siglip_dir)
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size 1"):
        build_model(
            ARCHITECTURES["siglip"].read_config(config),
            weights,
            dtype=torch.float32,
            device=torch.device("cpu"),
            shard=Shard(rank=0, size=2),
        )

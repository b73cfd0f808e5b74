"""Image preprocessing parity: ours (Pillow + numpy, request plane) against transformers' own
image processors (the PIL backends AutoImageProcessor gives without torchvision), on random
images of several sizes, aspect ratios and modes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.media.preprocessing import ImageProcessor
from PIL import Image
from transformers import AutoImageProcessor

SIZES = [(224, 224), (37, 300), (300, 37), (513, 640), (17, 19), (1, 5)]
MODES = ["RGB", "RGBA", "L"]


def _image(height: int, width: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(data.squeeze(-1) if channels == 1 else data, mode=mode)


def _checkpoint(
    root: Path, name: str, preprocessor: dict[str, object], model: dict[str, object]
) -> Path:
    path = root / name
    path.mkdir()
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    (path / "config.json").write_text(json.dumps(model))
    return path


CLIP_MODEL: dict[str, object] = {
    "model_type": "clip",
    "vision_config": {"patch_size": 16, "image_size": 32},
}
SIGLIP_MODEL: dict[str, object] = {
    "model_type": "siglip",
    "vision_config": {"patch_size": 8, "image_size": 48},
}
SIGLIP2_MODEL: dict[str, object] = {
    "model_type": "siglip2",
    "vision_config": {"patch_size": 4, "num_patches": 64},
}

CASES: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    # The OpenAI layout: int sizes, the old feature-extractor name, bicubic.
    "clip-legacy": (
        {
            "feature_extractor_type": "CLIPFeatureExtractor",
            "size": 32,
            "crop_size": 32,
            "do_center_crop": True,
            "do_normalize": True,
            "do_resize": True,
            "resample": 3,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
        CLIP_MODEL,
    ),
    # Shortest edge below the crop (zero padding), bilinear.
    "clip-pad": (
        {
            "image_processor_type": "CLIPImageProcessor",
            "size": {"shortest_edge": 24},
            "crop_size": {"height": 32, "width": 32},
            "resample": 2,
        },
        CLIP_MODEL,
    ),
    # As transformers 4.4x saved a fast processor: unset options as null, the backend's own.
    "clip-fast-saved": (
        {
            "image_processor_type": "CLIPImageProcessorFast",
            "size": {"shortest_edge": 32},
            "crop_size": {"height": 32, "width": 32},
            "default_to_square": False,
            "disable_grouping": None,
            "crop_pct": None,
            "do_pad": None,
            "input_data_format": None,
            "data_format": "channels_first",
            "device": None,
            "return_tensors": None,
        },
        CLIP_MODEL,
    ),
    "siglip": (
        {
            "image_processor_type": "SiglipImageProcessor",
            "processor_class": "SiglipProcessor",
            "size": {"height": 48, "width": 48},
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
        SIGLIP_MODEL,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", MODES)
def test_fixed_resolution_matches_transformers(tmp_path: Path, case: str, mode: str) -> None:
    preprocessor, model = CASES[case]
    path = _checkpoint(tmp_path, case, preprocessor, model)
    ours = ImageProcessor.from_pretrained(path, model)
    assert ours is not None
    reference = AutoImageProcessor.from_pretrained(path)  # type: ignore[no-untyped-call]
    assert type(reference).__name__.endswith("Pil")  # the slow processor: Pillow's resampling
    vision = model["vision_config"]
    assert isinstance(vision, dict)
    patch, side = vision["patch_size"], vision["image_size"]
    expected_tokens = (side // patch) ** 2 + (1 if case.startswith("clip") else 0)
    assert ours.fixed_tokens == expected_tokens
    for seed, (height, width) in enumerate(SIZES):
        image = _image(height, width, mode, seed)
        got = ours.preprocess(image)
        want = reference(images=image, return_tensors="np")["pixel_values"][0]
        assert got.pixels.dtype == np.float32
        assert got.pixels.shape == want.shape == (3, side, side)
        np.testing.assert_allclose(got.pixels, want, rtol=0, atol=1e-6)
        assert got.tokens == expected_tokens


def _patchify(pixels: np.ndarray, patch: int) -> np.ndarray:
    channels, height, width = pixels.shape
    grid = pixels.reshape(channels, height // patch, patch, width // patch, patch)
    return grid.transpose(1, 3, 2, 4, 0).reshape((height // patch) * (width // patch), -1)


def test_siglip2_naflex_matches_transformers(tmp_path: Path) -> None:
    """RGB only: with SigLIP2's ``do_convert_rgb: null`` transformers feeds RGBA and L images
    to normalize unconverted and fails; the server's images are RGB (``decode_image``)."""
    preprocessor: dict[str, object] = {
        "image_processor_type": "Siglip2ImageProcessor",
        "do_convert_rgb": None,
        "patch_size": 4,
        "max_num_patches": 64,
        "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    path = _checkpoint(tmp_path, "siglip2", preprocessor, SIGLIP2_MODEL)
    ours = ImageProcessor.from_pretrained(path, SIGLIP2_MODEL)
    assert ours is not None and ours.fixed_tokens is None
    reference = AutoImageProcessor.from_pretrained(path)  # type: ignore[no-untyped-call]
    assert type(reference).__name__.endswith("Pil")
    for seed, (height, width) in enumerate(SIZES):
        image = _image(height, width, "RGB", seed)
        got = ours.preprocess(image)
        want = reference(images=image, return_tensors="np")
        rows, cols = (int(v) for v in want["spatial_shapes"][0])
        assert got.pixels.shape == (3, rows * 4, cols * 4)
        assert got.tokens == rows * cols <= 64
        assert int(want["pixel_attention_mask"][0].sum()) == got.tokens
        np.testing.assert_allclose(
            _patchify(got.pixels, 4), want["pixel_values"][0][: got.tokens], rtol=0, atol=1e-6
        )


def test_sentence_transformers_clip_layout(tmp_path: Path) -> None:
    """sentence-transformers' CLIP checkpoints keep the processor in ``0_CLIPModel/``."""
    inner = tmp_path / "st"
    inner.mkdir()
    _checkpoint(inner, "0_CLIPModel", CASES["clip-legacy"][0], CLIP_MODEL)
    ours = ImageProcessor.from_pretrained(inner, CLIP_MODEL)
    assert ours is not None and ours.fixed_tokens == 5


def test_no_preprocessor_config_means_no_vision(tmp_path: Path) -> None:
    assert ImageProcessor.from_pretrained(tmp_path, {"model_type": "bert"}) is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"image_processor_type": "ViTImageProcessor"}, "ViTImageProcessor"),
        ({"do_pad": True}, "do_pad"),
        ({"default_to_square": True}, "default_to_square"),
        ({"crop_pct": 0.9}, "crop_pct"),
        ({"size": {"longest_edge": 32}}, "longest_edge"),
        ({"resample": 7}, "resample=7"),
        ({"crop_size": 48}, "vision tower takes 32x32"),
        ({"do_center_crop": False}, "varying size"),
    ],
)
def test_refuses_what_it_cannot_reproduce(
    tmp_path: Path, change: dict[str, object], named: str
) -> None:
    preprocessor = {**CASES["clip-pad"][0], **change}
    path = _checkpoint(tmp_path, "clip", preprocessor, CLIP_MODEL)
    with pytest.raises(UnsupportedModelError, match=named):
        ImageProcessor.from_pretrained(path, CLIP_MODEL)


def test_refuses_siglip2_patch_size_mismatch(tmp_path: Path) -> None:
    preprocessor: dict[str, object] = {
        "image_processor_type": "Siglip2ImageProcessor",
        "patch_size": 16,
    }
    path = _checkpoint(tmp_path, "siglip2", preprocessor, SIGLIP2_MODEL)
    with pytest.raises(UnsupportedModelError, match="patch_size 16"):
        ImageProcessor.from_pretrained(path, SIGLIP2_MODEL)


def test_loads_what_transformers_saves(tmp_path: Path) -> None:
    """The installed transformers' own ``save_pretrained`` output is accepted as is."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    from transformers.models.siglip2.image_processing_pil_siglip2 import (
        Siglip2ImageProcessorPil,
    )

    saved = [
        (
            CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size=32),
            CLIP_MODEL,
            5,
        ),
        (SiglipImageProcessorPil(size={"height": 48, "width": 48}), SIGLIP_MODEL, 36),
        (Siglip2ImageProcessorPil(patch_size=4, max_num_patches=64), SIGLIP2_MODEL, None),
    ]
    for i, (reference, model, tokens) in enumerate(saved):
        path = tmp_path / str(i)
        reference.save_pretrained(path)  # type: ignore[no-untyped-call]
        ours = ImageProcessor.from_pretrained(path, model)
        assert ours is not None and ours.fixed_tokens == tokens
        image = _image(29, 41, "RGB", i)
        want = reference(images=image, return_tensors="np")["pixel_values"][0]
        got = ours.preprocess(image)
        if tokens is not None:
            np.testing.assert_allclose(got.pixels, want, rtol=0, atol=1e-6)
        else:
            np.testing.assert_allclose(
                _patchify(got.pixels, 4), want[: got.tokens], rtol=0, atol=1e-6
            )

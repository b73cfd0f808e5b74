"""Images for a vision tower, on the request plane (torch-free): the model's own
preprocessing from its ``preprocessor_config.json`` (resize, crop, rescale, normalize), done
with Pillow and numpy, into :class:`ImageInput`.

The steps, their order and their arithmetic are those of transformers' PIL image processors
(``CLIPImageProcessorPil``, ``SiglipImageProcessorPil``, ``Siglip2ImageProcessorPil`` and
``image_transforms.py``): an embedding of an image must not depend on which of the two
computed its pixels. Options those processors have but this module does not reproduce are
refused by name when the checkpoint is loaded, never ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from embedding_server.errors import UnsupportedModelError
from embedding_server.request.pooling import FloatArray

PREPROCESSOR_CONFIG = "preprocessor_config.json"

# Where sentence-transformers keeps a CLIP checkpoint's files (``modules.json``'s first module).
_SENTENCE_TRANSFORMERS_DIRS = ("0_CLIPModel",)

_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)

_BICUBIC = 3
_BILINEAR = 2
_PIL_RESAMPLE_CODES = frozenset({0, 1, 2, 3, 4, 5})
"""Pillow's resampling filters (NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING): the
config stores the integer, which ``Image.resize`` takes as is."""

Family = Literal["clip", "siglip", "siglip2"]

_PROCESSOR_TYPES: dict[str, Family] = {
    "CLIPImageProcessor": "clip",
    "CLIPFeatureExtractor": "clip",
    "SiglipImageProcessor": "siglip",
    "Siglip2ImageProcessor": "siglip2",
}

# Keys that describe the file or the call, not the pixels.
_INERT_KEYS = frozenset(
    {
        "image_processor_type",
        "feature_extractor_type",
        "processor_class",
        "_processor_class",
        "do_convert_rgb",  # every image reaching preprocess() is converted to RGB
        "input_data_format",
        "data_format",
        "return_tensors",
        "device",
        "image_seq_length",
        "disable_grouping",  # how the torchvision backend batches, not what it computes
        "_valid_processor_keys",
    }
)
_PIXEL_KEYS: dict[Family, frozenset[str]] = {
    "clip": frozenset(
        {
            "do_resize",
            "size",
            "resample",
            "do_center_crop",
            "crop_size",
            "do_rescale",
            "rescale_factor",
            "do_normalize",
            "image_mean",
            "image_std",
        }
    ),
    "siglip": frozenset(
        {
            "do_resize",
            "size",
            "resample",
            "do_rescale",
            "rescale_factor",
            "do_normalize",
            "image_mean",
            "image_std",
        }
    ),
    "siglip2": frozenset(
        {
            "do_resize",
            "resample",
            "do_rescale",
            "rescale_factor",
            "do_normalize",
            "image_mean",
            "image_std",
            "patch_size",
            "max_num_patches",
        }
    ),
}
# Keys that only matter when truthy; false (or null) is what the processor does anyway.
_OFF_KEYS = frozenset(
    {
        "do_pad",
        "do_center_crop",
        "use_square_size",
        "do_flip_channel_order",
        "default_to_square",  # false is these processors' own setting
        "crop_pct",
    }
)


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image, decoded and preprocessed for the model's vision tower."""

    pixels: FloatArray
    """``[3, height, width]`` float32, exactly what transformers' image processor gives."""
    tokens: int
    """The vision tower's sequence length for it (patches, plus the class token where the
    model has one): what the image costs in admission, batching and usage."""


@dataclass(frozen=True, slots=True)
class _Size:
    """A resize target as the processors' ``SizeDict`` holds it: either the shortest edge
    (aspect ratio kept) or a fixed height and width."""

    shortest_edge: int | None = None
    height: int | None = None
    width: int | None = None


class ImageProcessor:
    """A model's image preprocessing (CLIPImageProcessor, SiglipImageProcessor, ...)."""

    def __init__(
        self,
        *,
        family: Family,
        resize: _Size | None,
        resample: int,
        crop: tuple[int, int] | None,
        rescale_factor: float | None,
        mean: tuple[float, float, float] | None,
        std: tuple[float, float, float] | None,
        patch_size: int,
        class_token: bool,
        max_num_patches: int | None = None,
    ) -> None:
        self.family: Family = family
        self.resize_to = resize
        self.resample = resample
        self.crop = crop
        self.rescale_factor = rescale_factor
        self.mean = mean
        self.std = std
        self.patch_size = patch_size
        self.class_token = class_token
        self.max_num_patches = max_num_patches

    @classmethod
    def from_pretrained(cls, path: Path, model_config: dict[str, object]) -> ImageProcessor | None:
        """The processor of the checkpoint at ``path`` (its ``preprocessor_config.json``,
        with the vision tower's patch size from ``model_config``), or None where the model
        has no vision tower."""
        config_path = _find_preprocessor_config(Path(path))
        if config_path is None:
            return None
        vision = _vision_config(model_config)
        if vision is None:
            return None
        try:
            raw = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UnsupportedModelError(f"{config_path} is not readable JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise UnsupportedModelError(f"{config_path} is not a JSON object")
        return cls.from_config(raw, vision, source=str(config_path))

    @classmethod
    def from_config(
        cls, config: Mapping[str, object], vision_config: Mapping[str, object], *, source: str
    ) -> ImageProcessor:
        """The processor a ``preprocessor_config.json`` dict describes, for a tower with
        ``vision_config``; refuses (UnsupportedModelError) what it cannot reproduce."""
        # null is "the processor's default" in transformers (saved processors list their
        # unset options as null): the same as an absent key.
        config = {key: value for key, value in config.items() if value is not None}
        family = _family(config, source)
        unknown = sorted(
            key
            for key in config
            if key not in _INERT_KEYS
            and key not in _PIXEL_KEYS[family]
            and not (key in _OFF_KEYS and not config[key])
        )
        if unknown:
            raise UnsupportedModelError(
                f"{source}: image processor option(s) {', '.join(unknown)} are not supported "
                f"for {family} (this server reproduces resize, center crop, rescale and "
                "normalize only)"
            )
        defaults = _DEFAULTS[family]
        resample = config.get("resample", defaults["resample"])
        if not isinstance(resample, int) or resample not in _PIL_RESAMPLE_CODES:
            raise UnsupportedModelError(f"{source}: resample={resample!r} is not a PIL filter code")
        rescale_factor = (
            _number(config.get("rescale_factor", 1 / 255), "rescale_factor", source)
            if _flag(config, "do_rescale", True, source)
            else None
        )
        mean: tuple[float, float, float] | None = None
        std: tuple[float, float, float] | None = None
        if _flag(config, "do_normalize", True, source):
            mean = _triple(config.get("image_mean", defaults["mean"]), "image_mean", source)
            std = _triple(config.get("image_std", defaults["std"]), "image_std", source)
        do_resize = _flag(config, "do_resize", True, source)
        model_patch = _int(vision_config.get("patch_size", defaults["patch_size"]), "patch_size")

        if family == "siglip2":
            if not do_resize:
                raise UnsupportedModelError(
                    f"{source}: do_resize=false is not supported for Siglip2ImageProcessor "
                    "(the image must be resized to whole patches)"
                )
            patch = _int(config.get("patch_size", 16), "patch_size")
            if patch != model_patch:
                raise UnsupportedModelError(
                    f"{source}: the processor's patch_size {patch} differs from the vision "
                    f"tower's {model_patch}"
                )
            max_patches = _int(config.get("max_num_patches", 256), "max_num_patches")
            return cls(
                family=family,
                resize=None,
                resample=resample,
                crop=None,
                rescale_factor=rescale_factor,
                mean=mean,
                std=std,
                patch_size=patch,
                class_token=False,
                max_num_patches=max_patches,
            )

        size = _parse_size(config.get("size", defaults["size"]), source) if do_resize else None
        crop: tuple[int, int] | None = None
        if family == "clip" and _flag(config, "do_center_crop", True, source):
            crop_raw = config.get("crop_size", defaults["crop_size"])
            crop_size = _parse_size(crop_raw, source, default_to_square=True)
            assert crop_size.height is not None and crop_size.width is not None
            crop = (crop_size.height, crop_size.width)
        if crop is not None:
            out = crop
        elif size is not None and size.height is not None and size.width is not None:
            out = (size.height, size.width)
        else:
            raise UnsupportedModelError(
                f"{source}: this {family} processor config gives images of varying size "
                "(no fixed resize or center crop), which a fixed-resolution tower cannot take"
            )
        image_size = _int(vision_config.get("image_size", defaults["image_size"]), "image_size")
        if out != (image_size, image_size):
            raise UnsupportedModelError(
                f"{source}: the processor makes {out[0]}x{out[1]} images but the vision tower "
                f"takes {image_size}x{image_size}"
            )
        return cls(
            family=family,
            resize=size,
            resample=resample,
            crop=crop,
            rescale_factor=rescale_factor,
            mean=mean,
            std=std,
            patch_size=model_patch,
            class_token=family == "clip",
        )

    @property
    def fixed_tokens(self) -> int | None:
        """Every image's token count where it does not depend on the image (CLIP, SigLIP);
        None for SigLIP2 NaFlex (aspect-ratio dependent, at most ``max_num_patches``)."""
        if self.family == "siglip2":
            return None
        height, width = self.crop or (self.resize_to.height, self.resize_to.width)  # type: ignore[union-attr]
        assert height is not None and width is not None
        patches = (height // self.patch_size) * (width // self.patch_size)
        return patches + 1 if self.class_token else patches

    def preprocess(self, image: Image.Image) -> ImageInput:
        """One decoded RGB image to the tower's input."""
        array = _to_rgb_chw(image)
        if self.family == "siglip2":
            assert self.max_num_patches is not None
            height, width = siglip2_target_size(
                array.shape[1], array.shape[2], self.patch_size, self.max_num_patches
            )
            array = _resize(array, (height, width), self.resample)
        elif self.resize_to is not None:
            array = _resize(array, _output_size(array, self.resize_to), self.resample)
        if self.crop is not None:
            array = _center_crop(array, self.crop)
        pixels = _rescale_normalize(array, self.rescale_factor, self.mean, self.std)
        patches = (pixels.shape[1] // self.patch_size) * (pixels.shape[2] // self.patch_size)
        return ImageInput(pixels=pixels, tokens=patches + 1 if self.class_token else patches)


def siglip2_target_size(
    image_height: int, image_width: int, patch_size: int, max_num_patches: int, eps: float = 1e-5
) -> tuple[int, int]:
    """transformers' ``get_image_size_for_max_num_patches``: the largest size of whole
    patches, aspect ratio about kept, with at most ``max_num_patches`` patches (the same
    binary search, so the same answer to the pixel)."""

    def scaled(scale: float, size: int) -> int:
        value = math.ceil(size * scale / patch_size) * patch_size
        return int(max(patch_size, value))

    scale_min, scale_max = eps / 10, 100.0
    while (scale_max - scale_min) >= eps:
        scale = (scale_min + scale_max) / 2
        target_h = scaled(scale, image_height)
        target_w = scaled(scale, image_width)
        if (target_h / patch_size) * (target_w / patch_size) <= max_num_patches:
            scale_min = scale
        else:
            scale_max = scale
    return scaled(scale_min, image_height), scaled(scale_min, image_width)


_DEFAULTS: dict[Family, dict[str, object]] = {
    "clip": {
        "resample": _BICUBIC,
        "mean": _OPENAI_CLIP_MEAN,
        "std": _OPENAI_CLIP_STD,
        "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224},
        "patch_size": 32,
        "image_size": 224,
    },
    "siglip": {
        "resample": _BICUBIC,
        "mean": _HALF,
        "std": _HALF,
        "size": {"height": 224, "width": 224},
        "patch_size": 16,
        "image_size": 224,
    },
    "siglip2": {"resample": _BILINEAR, "mean": _HALF, "std": _HALF, "patch_size": 16},
}
"""The processor classes' own defaults (and the vision configs'), for keys a file omits."""


def _find_preprocessor_config(path: Path) -> Path | None:
    for folder in (path, *(path / sub for sub in _SENTENCE_TRANSFORMERS_DIRS)):
        candidate = folder / PREPROCESSOR_CONFIG
        if candidate.is_file():
            return candidate
    return None


def _vision_config(model_config: Mapping[str, object]) -> Mapping[str, object] | None:
    """The vision tower's config: ``vision_config`` of a dual encoder, or the whole config of
    a vision-only checkpoint (``clip_vision_model``, ``siglip_vision_model``, ...)."""
    vision = model_config.get("vision_config")
    if isinstance(vision, dict):
        return vision
    model_type = model_config.get("model_type")
    if isinstance(model_type, str) and model_type.endswith("_vision_model"):
        return model_config
    return None


def _family(config: Mapping[str, object], source: str) -> Family:
    declared = config.get("image_processor_type") or config.get("feature_extractor_type")
    if not isinstance(declared, str):
        raise UnsupportedModelError(f"{source} names no image_processor_type")
    base = declared.removesuffix("Fast").removesuffix("Pil")
    family = _PROCESSOR_TYPES.get(base)
    if family is None:
        raise UnsupportedModelError(
            f"{source}: image processor {declared} is not supported "
            f"(supported: {', '.join(sorted(_PROCESSOR_TYPES))})"
        )
    return family


def _flag(config: Mapping[str, object], key: str, default: bool, source: str) -> bool:
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UnsupportedModelError(f"{source}: {key}={value!r} is not a boolean")
    return value


def _number(value: object, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedModelError(f"{source}: {key}={value!r} is not a number")
    return float(value)


def _int(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(f"{key}={value!r} is not a positive integer")
    return value


def _triple(value: object, key: str, source: str) -> tuple[float, float, float]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (float(value),) * 3
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 3:
        a, b, c = (_number(v, key, source) for v in value)
        return (a, b, c)
    raise UnsupportedModelError(f"{source}: {key}={value!r} is not three numbers")


def _parse_size(value: object, source: str, *, default_to_square: bool = False) -> _Size:
    """transformers' ``get_size_dict`` for the layouts these processors use: an int is the
    shortest edge (``size``) or a square (``crop_size``); a dict has ``shortest_edge`` or
    ``height`` and ``width``. Others (``longest_edge``, ``max_height``...) are refused."""
    if isinstance(value, int) and not isinstance(value, bool):
        if default_to_square:
            return _Size(height=_int(value, "size"), width=_int(value, "size"))
        return _Size(shortest_edge=_int(value, "size"))
    if isinstance(value, Mapping):
        keys = set(value)
        if keys == {"shortest_edge"}:
            return _Size(shortest_edge=_int(value["shortest_edge"], "shortest_edge"))
        if keys == {"height", "width"}:
            return _Size(
                height=_int(value["height"], "height"), width=_int(value["width"], "width")
            )
    raise UnsupportedModelError(
        f"{source}: size {value!r} is not supported (an int, shortest_edge, or height and width)"
    )


def _to_rgb_chw(image: Image.Image) -> np.ndarray:
    """transformers' ``convert_to_rgb`` then channels first: an image with alpha (or a
    transparency colour) is composited onto white, others converted to RGB."""
    if image.mode != "RGB":
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, rgba).convert("RGB")
        else:
            image = image.convert("RGB")
    return np.moveaxis(np.asarray(image, dtype=np.uint8), -1, 0)


def _output_size(image: np.ndarray, size: _Size) -> tuple[int, int]:
    """``get_resize_output_image_size(default_to_square=False)``: the short side to
    ``shortest_edge``, the long one ``int()``-truncated in proportion."""
    if size.shortest_edge is None:
        assert size.height is not None and size.width is not None
        return size.height, size.width
    height, width = image.shape[1], image.shape[2]
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size.shortest_edge, int(size.shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _resize(image: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    """``image_transforms.resize`` on uint8 channels-first pixels: through Pillow, uint8 in
    and out (no rescaling round trip for uint8)."""
    height, width = size
    pil = Image.fromarray(np.ascontiguousarray(np.moveaxis(image, 0, -1)))
    resized = pil.resize((width, height), resample=Image.Resampling(resample))
    return np.moveaxis(np.asarray(resized, dtype=np.uint8), -1, 0)


def _center_crop(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``image_transforms.center_crop``: floor-centred crop; an image smaller than the crop
    is zero-padded around (ceil of half the difference on the top/left) first."""
    crop_h, crop_w = size
    orig_h, orig_w = image.shape[1], image.shape[2]
    top = (orig_h - crop_h) // 2
    left = (orig_w - crop_w) // 2
    if top >= 0 and left >= 0:
        return image[:, top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, orig_h), max(crop_w, orig_w)
    padded = np.zeros((image.shape[0], new_h, new_w), dtype=image.dtype)
    top_pad = math.ceil((new_h - orig_h) / 2)
    left_pad = math.ceil((new_w - orig_w) / 2)
    padded[:, top_pad : top_pad + orig_h, left_pad : left_pad + orig_w] = image
    top += top_pad
    left += left_pad
    return padded[
        :, max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)
    ]


def _rescale_normalize(
    image: np.ndarray,
    factor: float | None,
    mean: tuple[float, float, float] | None,
    std: tuple[float, float, float] | None,
) -> FloatArray:
    """``rescale`` (float64 product, cast to float32) then ``normalize`` (float32 mean and
    std), in the processors' order and precision."""
    out: np.ndarray = image
    if factor is not None:
        out = (image.astype(np.float64) * factor).astype(np.float32)
    if mean is not None and std is not None:
        if not np.issubdtype(out.dtype, np.floating):
            out = out.astype(np.float32)
        mean_arr = np.array(mean, dtype=out.dtype)
        std_arr = np.array(std, dtype=out.dtype)
        out = ((out.T - mean_arr) / std_arr).T
    result: FloatArray = np.ascontiguousarray(out, dtype=np.float32)
    return result

"""Images for a vision tower, on the request plane (torch-free): the model's own
preprocessing from its ``preprocessor_config.json`` (resize, crop, rescale, normalize), done
with Pillow and numpy, into :class:`ImageInput`.

CONTRACT (issue 33, to be filled in): :class:`ImageInput` and the signatures below are what
the pipeline, the API and the device plane build on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from .pooling import FloatArray


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image, decoded and preprocessed for the model's vision tower."""

    pixels: FloatArray
    """``[3, height, width]`` float32, exactly what transformers' image processor gives."""
    tokens: int
    """The vision tower's sequence length for it (patches, plus the class token where the
    model has one): what the image costs in admission, batching and usage."""


class ImageProcessor:
    """A model's image preprocessing (CLIPImageProcessor, SiglipImageProcessor, ...)."""

    @classmethod
    def from_pretrained(cls, path: Path, model_config: dict[str, object]) -> ImageProcessor | None:
        """The processor of the checkpoint at ``path`` (its ``preprocessor_config.json``,
        with the vision tower's patch size from ``model_config``), or None where the model
        has no vision tower."""
        raise NotImplementedError

    def preprocess(self, image: Image.Image) -> ImageInput:
        """One decoded RGB image to the tower's input."""
        raise NotImplementedError

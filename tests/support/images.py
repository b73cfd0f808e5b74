"""Images for the tests of image inputs: small PNGs made with Pillow, and as data URIs (real
base64 PNGs), and an ImageInput built without a model's processor.
"""

from __future__ import annotations

import base64
import io

import numpy as np
from embedding_server.request.media.preprocessing import ImageInput
from PIL import Image


def picture(seed: int, size: tuple[int, int] = (24, 20)) -> Image.Image:
    """A small random RGB image, the same for the same seed."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(image: Image.Image) -> str:
    """``image`` as a ``data:image/png;base64,...`` URI."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def image_input(image: Image.Image, tokens: int = 8, size: int = 16) -> ImageInput:
    """An ImageInput built from a PIL image without a model's processor (resize, scale)."""
    resized = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    pixels = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
    return ImageInput(np.ascontiguousarray(pixels), tokens)

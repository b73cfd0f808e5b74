"""The fake backend's image preprocessing (request plane, torch-free): a weightless stand-in
for a model's image processor, so the image paths of the API run fast in tests and demos.

An image is resized to :data:`SIZE` square with Pillow and scaled to ``[0, 1]``; what it
costs is the ``image_tokens`` the fake model declares (``fake?image_tokens=N``). The fake
model's vectors of an image are a function of these pixels' bytes (``device/fake.py``), so
two different images get different vectors and the same image the same one, alone or in a
crowd.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from embedding_server.request.media.preprocessing import ImageInput

SIZE = 16
"""Side of the square the fake processor resizes every image to."""


class FakeImageProcessor:
    """Resize to :data:`SIZE` x :data:`SIZE`, scale to ``[0, 1]``, channels first."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def preprocess(self, image: Image.Image) -> ImageInput:
        resized = image.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
        pixels = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return ImageInput(np.ascontiguousarray(pixels), self.tokens)

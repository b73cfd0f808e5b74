"""Images for the tests of image inputs: small PNGs made with Pillow, as data URIs, and
stand-ins for ``embedding_server.request.media.fetching``'s fetch and decode while its bodies
are stubs.

The stand-ins are used only where the real functions raise NotImplementedError (before the
media work is merged); against the real ones every test here runs unchanged, so the data
URIs are real base64 PNGs.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterator

import numpy as np
import pytest
from embedding_server.errors import InvalidRequestError
from embedding_server.request.media import fetching as media
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


async def _fetch_stand_in(url: str, policy: media.MediaPolicy, *, param: str) -> bytes:
    """data: URIs only (what the real fetch accepts without a listed host)."""
    if not url.startswith("data:"):
        raise InvalidRequestError(
            f"{param}: only data: URIs are fetched without --allowed-media-domains", param=param
        )
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise InvalidRequestError(f"{param}: data URI must be base64", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as error:
        raise InvalidRequestError(f"{param}: bad base64", param=param) from error
    if len(data) > policy.max_image_bytes:
        raise InvalidRequestError(f"{param}: image over max_image_bytes", param=param)
    return data


def _decode_stand_in(data: bytes, policy: media.MediaPolicy, *, param: str) -> Image.Image:
    with Image.open(io.BytesIO(data)) as opened:
        if opened.width * opened.height > policy.max_image_pixels:
            raise InvalidRequestError(f"{param}: image over max_image_pixels", param=param)
        return opened.convert("RGB")


def media_is_stub() -> bool:
    """Whether ``embedding_server.request.media.fetching`` still has its contract stubs."""
    try:
        media.decode_image(png_bytes(picture(0)), media.MediaPolicy(), param="probe")
    except NotImplementedError:
        return True
    return False


@pytest.fixture
def media_stand_ins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Stand-ins for media's fetch and decode where they are still stubs."""
    if media_is_stub():
        monkeypatch.setattr(media, "fetch_image", _fetch_stand_in)
        monkeypatch.setattr(media, "decode_image", _decode_stand_in)
    yield

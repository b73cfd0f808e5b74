"""Image inputs as requests carry them: ``data:`` URIs, and http(s) URLs of listed hosts,
fetched and decoded under the server's limits (torch-free, request plane).

CONTRACT (issue 33, to be filled in): the signatures below are what the API builds on.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image


@dataclass(frozen=True)
class MediaPolicy:
    """The limits of ``ServerSettings`` for images (``--allowed-media-domains`` ...)."""

    allowed_domains: tuple[str, ...] = ()
    fetch_timeout: float = 5.0
    max_image_bytes: int = 8 * 1024 * 1024
    max_image_pixels: int = 25_000_000
    max_images: int = 16


async def fetch_image(url: str, policy: MediaPolicy, *, param: str) -> bytes:
    """The encoded bytes of an image reference: a ``data:`` URI's payload, or an http(s)
    URL's body where the policy allows its host. Every refusal is an
    :class:`~.errors.InvalidRequestError` naming ``param``."""
    raise NotImplementedError


def decode_image(data: bytes, policy: MediaPolicy, *, param: str) -> Image.Image:
    """Decode encoded bytes into an RGB image, checking the header's pixel count first.
    CPU work: call it off the event loop."""
    raise NotImplementedError

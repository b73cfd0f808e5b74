"""What the images of the requests in flight may hold, all requests of one process together,
charged before the work (torch-free, request plane).

A request's images cost the server what their references do not show: a URL of a few bytes
downloads up to ``--max-image-bytes``, and a PNG of a few KB decodes to ``--max-image-pixels``
(seconds of CPU and hundreds of MB at the limits). The per-request limits bound one request;
:class:`ImageBudget` bounds the requests in flight together, in two budgets:

* **bytes being fetched** (``--max-fetching-bytes``): each image URL reserves
  ``--max-image-bytes``, what it may download, for all of its request's URLs at once and
  before any is fetched, until the request's images are decoded;
* **pixels being decoded** (``--max-decoding-pixels``): once a request's images are in, their
  headers' width x height, for all of them at once and before any is decoded, until they are.

As the token queue does, an empty budget takes any request within the per-request limits
(one request alone is never refused, only delayed behind others); one that does not fit
beside the requests in flight is refused at once with :class:`~.errors.ImagesBusyError`
(429, ``Retry-After``), never queued. Images are decoded and preprocessed on a thread of
their own (:meth:`ImageBudget.offload`), never the tokenizer's, so a request of texts is not
queued behind images however many are decoding, and the decoded pixels held at once are one
image's.

Everything runs on the event loop (the budgets are plain counters); a request that ends in
any way (an answer, a refusal, its client gone and its task cancelled) gives back what it
reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from embedding_server.errors import ImagesBusyError

if TYPE_CHECKING:
    from embedding_server.settings import ServerSettings

T = TypeVar("T")

RETRY_AFTER_S = 1.0
"""A refused request's ``Retry-After``: images in flight are fetched within
``--media-fetch-timeout`` and decoded within about a second each."""


@dataclass(eq=False)
class ImageBudget:
    """The bytes being fetched and the pixels being decoded for the requests in flight, and
    the thread that decodes them."""

    max_fetching_bytes: int
    max_decoding_pixels: int
    fetching: int = 0
    """Bytes reserved by the image URLs of requests being fetched."""
    decoding: int = 0
    """Pixels reserved by the images of requests being decoded."""
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> ImageBudget:
        """The budgets ``--max-fetching-bytes`` and ``--max-decoding-pixels`` set."""
        return cls(settings.fetching_bytes, settings.decoding_pixels)

    @contextlib.contextmanager
    def fetch(self, urls: int, max_image_bytes: int) -> Iterator[None]:
        """Hold ``urls`` x ``max_image_bytes`` (what they may download) while the block
        runs, or refuse the request (429) before it fetches anything."""
        amount = urls * max_image_bytes
        if self.fetching and self.fetching + amount > self.max_fetching_bytes:
            raise ImagesBusyError(
                f"image URLs being fetched may download {self.fetching} of "
                f"{self.max_fetching_bytes} bytes (--max-fetching-bytes) and this request's "
                f"{urls} may download {amount} (--max-image-bytes each); retry later",
                retry_after=RETRY_AFTER_S,
            )
        self.fetching += amount
        try:
            yield
        finally:
            self.fetching -= amount

    @contextlib.contextmanager
    def decode(self, pixels: int) -> Iterator[None]:
        """Hold ``pixels`` (a request's images, by their headers) while the block runs, or
        refuse the request (429) before it decodes anything."""
        if self.decoding and self.decoding + pixels > self.max_decoding_pixels:
            raise ImagesBusyError(
                f"images being decoded hold {self.decoding} of {self.max_decoding_pixels} "
                f"pixels (--max-decoding-pixels) and this request's hold {pixels}; retry later",
                retry_after=RETRY_AFTER_S,
            )
        self.decoding += pixels
        try:
            yield
        finally:
            self.decoding -= pixels

    async def offload(self, work: Callable[[], T]) -> T:
        """Run ``work`` (decoding and preprocessing an image) on the images' own thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="images")
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        """Stop the images' thread (what is queued is cancelled). Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

"""Image inputs as requests carry them: ``data:`` URIs, and http(s) URLs of listed hosts,
fetched and decoded under the server's limits (torch-free, request plane).

An image URL makes the server a client on the requester's behalf, so everything here assumes a
hostile requester: a URL aimed at the cluster's own services or the cloud metadata endpoint
(SSRF), a host name that resolves to one address when checked and another when connected
(DNS rebinding), a body that never ends, a slow drip, a redirect to somewhere unlisted, and an
image whose header promises billions of pixels (a decompression bomb). Each is refused with an
:class:`~.errors.InvalidRequestError` naming the request field, before the expensive step.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
import struct
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from PIL import Image, ImageOps, UnidentifiedImageError

from embedding_server.errors import InvalidRequestError

if TYPE_CHECKING:
    from embedding_server.request.media.preprocessing import ImageInput, ImageProcessor
    from embedding_server.settings import ServerSettings

T = TypeVar("T")

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""What ``decode_image`` opens (Pillow's format names); GIFs give their first frame."""

_INTERNAL_SUFFIXES = (".svc", ".cluster.local", ".localhost", ".internal")
"""Names that only mean something inside the cluster or the machine: refused like private
addresses unless listed exactly (a public resolver could answer anything for them)."""

_CHUNK = 64 * 1024

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class MediaPolicy:
    """The limits of ``ServerSettings`` for images (``--allowed-media-domains`` ...)."""

    allowed_domains: tuple[str, ...] = ()
    fetch_timeout: float = 5.0
    max_image_bytes: int = 8 * 1024 * 1024
    max_image_pixels: int = 25_000_000
    max_images: int = 16

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> MediaPolicy:
        """The policy the server's flags set (``--allowed-media-domains``,
        ``--media-fetch-timeout``, ``--max-image-bytes``, ``--max-image-pixels``,
        ``--max-images-per-request``)."""
        return cls(
            allowed_domains=tuple(
                domain.strip().lower().rstrip(".")
                for domain in settings.allowed_media_domains
                if domain.strip()
            ),
            fetch_timeout=settings.media_fetch_timeout,
            max_image_bytes=settings.max_image_bytes,
            max_image_pixels=settings.max_image_pixels,
            max_images=settings.max_images_per_request,
        )

    def host_listing(self, host: str) -> str | None:
        """``"exact"`` where ``host`` is listed as is, ``"wildcard"`` where only a
        ``*.suffix`` entry covers it (a subdomain, not the suffix itself), else None."""
        host = host.lower().rstrip(".")
        # Normalized here too: the policy may be built from raw flag values.
        domains = [domain.strip().lower().rstrip(".") for domain in self.allowed_domains]
        if host in domains:
            return "exact"
        if _is_ip_literal(host):
            return None  # a wildcard names DNS names, never addresses
        for domain in domains:
            if domain.startswith("*.") and host.endswith(domain[1:]) and host != domain[1:]:
                return "wildcard"
        return None


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# fetching


async def fetch_image(url: str, policy: MediaPolicy, *, param: str) -> bytes:
    """The encoded bytes of an image reference: a ``data:`` URI's payload, or an http(s)
    URL's body where the policy allows its host. Every refusal is an
    :class:`~.errors.InvalidRequestError` naming ``param``."""
    if url[:5].lower() == "data:":
        return decode_data_uri(url, policy, param=param)
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise InvalidRequestError(
            f"image URL scheme {scheme + ':' if scheme else '(none)'} is not supported: "
            "send an http(s) URL or a data: URI",
            param=param,
        )
    try:
        host = (parts.hostname or "").rstrip(".")
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError as exc:
        raise InvalidRequestError(f"image URL is malformed: {exc}", param=param) from exc
    if not host:
        raise InvalidRequestError("image URL has no host", param=param)
    listing = policy.host_listing(host)
    if listing is None:
        raise InvalidRequestError(
            f"image URL host {host} is not allowed (--allowed-media-domains)"
            if policy.allowed_domains
            else "image URLs are not allowed on this server (no --allowed-media-domains): "
            "send the image as a data: URI",
            param=param,
        )
    exact = listing == "exact"
    if not exact and (host == "localhost" or host.endswith(_INTERNAL_SUFFIXES)):
        raise InvalidRequestError(
            f"image URL host {host} is a cluster-internal name; only an exactly listed host "
            "may be one",
            param=param,
        )
    try:
        async with asyncio.timeout(policy.fetch_timeout):
            addresses = await _checked_addresses(host, port, exact=exact, param=param)
            return await _download(url, addresses, policy, param=param)
    except TimeoutError as exc:
        raise InvalidRequestError(
            f"image URL did not answer with its whole body within {policy.fetch_timeout:g} s",
            param=param,
        ) from exc


def decode_data_uri(uri: str, policy: MediaPolicy, *, param: str) -> bytes:
    """A base64 ``data:image/...`` URI's bytes; the size is checked from the base64 length
    before anything is decoded."""
    header, comma, payload = uri.partition(",")
    if not comma:
        raise InvalidRequestError("data: URI has no ',' before its data", param=param)
    fields = [field.strip().lower() for field in header[5:].split(";")]
    mime = fields[0]
    if not mime.startswith("image/"):
        raise InvalidRequestError(
            f"data: URI media type {mime or '(none)'} is not an image (image/png, image/jpeg, ...)",
            param=param,
        )
    if "base64" not in fields[1:]:
        raise InvalidRequestError("data: URI must be base64-encoded (';base64,')", param=param)
    if any(c in payload for c in " \t\r\n"):
        payload = "".join(payload.split())
    padding = len(payload) - len(payload.rstrip("="))
    size = len(payload) * 3 // 4 - min(padding, 2)
    if size > policy.max_image_bytes:
        raise InvalidRequestError(
            f"image is {size} bytes, larger than the server's limit of "
            f"{policy.max_image_bytes} (--max-image-bytes)",
            param=param,
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"data: URI is not valid base64: {exc}", param=param) from exc


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_host(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to (the system resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


_resolve: Resolver = resolve_host
"""The resolver ``fetch_image`` uses (a module attribute so tests can substitute one)."""


def forbidden_address(address: IPAddress) -> str | None:
    """Why a fetch must not connect to ``address`` unless its host is listed exactly:
    loopback, link-local (the cloud metadata endpoint), private, unspecified, multicast,
    reserved, site-local or otherwise not globally routable, or a 6to4 address of any of those
    (Python counts 6to4 and site-local as global); None for a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        elif address.sixtofour is not None:
            inner = forbidden_address(address.sixtofour)
            return None if inner is None else f"6to4 {inner}"
        elif address.is_site_local:
            return "site-local"
    for reason, flag in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("not globally routable", not address.is_global),
    ):
        if flag:
            return reason
    return None


async def _checked_addresses(host: str, port: int, *, exact: bool, param: str) -> list[str]:
    try:
        addresses = [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        try:
            addresses = await _resolve(host, port)
        except OSError as exc:
            raise InvalidRequestError(
                f"image URL host {host} does not resolve: {exc}", param=param
            ) from exc
    if not addresses:
        raise InvalidRequestError(f"image URL host {host} does not resolve", param=param)
    if not exact:
        for address in addresses:
            reason = forbidden_address(ipaddress.ip_address(address.split("%")[0]))
            if reason is not None:
                raise InvalidRequestError(
                    f"image URL host {host} resolves to a {reason} address ({address}); "
                    "only an exactly listed host may",
                    param=param,
                )
    return addresses


class _PinnedResolver(AbstractResolver):
    """Answers aiohttp with the addresses already checked: the connection goes where the
    check looked, whatever a second DNS answer would say (DNS rebinding). Its connector
    serves one request to one host and follows no redirect, so every question it gets is
    about that host (in whatever spelling aiohttp uses: IDNA for a non-ASCII name)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = tuple(addresses)

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results: list[ResolveResult] = []
        for address in self._addresses:
            parsed = ipaddress.ip_address(address.split("%")[0])
            results.append(
                ResolveResult(
                    hostname=host,
                    host=address,
                    port=port,
                    family=socket.AF_INET6 if parsed.version == 6 else socket.AF_INET,
                    proto=0,
                    flags=socket.AI_NUMERICHOST,
                )
            )
        return results

    async def close(self) -> None:
        return None


async def _download(
    url: str, addresses: Sequence[str], policy: MediaPolicy, *, param: str
) -> bytes:
    limit = policy.max_image_bytes
    connector = aiohttp.TCPConnector(
        resolver=_PinnedResolver(addresses), use_dns_cache=False, limit=1
    )
    timeout = aiohttp.ClientTimeout(total=policy.fetch_timeout)
    try:
        async with (
            aiohttp.ClientSession(
                connector=connector, timeout=timeout, trust_env=False, auto_decompress=False
            ) as session,
            session.get(
                url,
                allow_redirects=False,
                headers={"Accept": "image/*", "Accept-Encoding": "identity"},
            ) as response,
        ):
            if 300 <= response.status < 400:
                raise InvalidRequestError(
                    f"image URL answered with a redirect (HTTP {response.status}), which is not "
                    "followed: give the image's own URL",
                    param=param,
                )
            if response.status != 200:
                raise InvalidRequestError(f"image URL answered HTTP {response.status}", param=param)
            content_type = response.headers.get("Content-Type", "")
            if not content_type.lower().lstrip().startswith("image/"):
                raise InvalidRequestError(
                    f"image URL answered Content-Type {content_type or '(none)'}, not image/*",
                    param=param,
                )
            if response.headers.get("Content-Encoding", "identity").lower() != "identity":
                raise InvalidRequestError(
                    "image URL answered with a Content-Encoding; images are sent as they are",
                    param=param,
                )
            if response.content_length is not None and response.content_length > limit:
                raise _too_large(response.content_length, limit, param)
            body = bytearray()
            while chunk := await response.content.read(min(_CHUNK, limit + 1 - len(body))):
                body += chunk
                if len(body) > limit:  # read max_image_bytes + 1 at most
                    raise _too_large(None, limit, param)
            return bytes(body)
    except TimeoutError:
        raise  # fetch_image words it (a subclass of OSError)
    except (aiohttp.ClientError, OSError) as exc:
        raise InvalidRequestError(
            f"image URL could not be fetched: {type(exc).__name__}: {exc}", param=param
        ) from exc


def _too_large(size: int | None, limit: int, param: str) -> InvalidRequestError:
    what = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return InvalidRequestError(
        f"image is {what}, larger than the server's limit of {limit} (--max-image-bytes)",
        param=param,
    )


# ---------------------------------------------------------------------------------------------
# decoding


def image_size(data: bytes, policy: MediaPolicy, *, param: str) -> tuple[int, int]:
    """The width and height an image's header gives, read without decoding its pixels (a
    header parse: milliseconds at most, for the event loop), the pixel limit checked: what
    decoding it will cost, known before it is decoded."""
    with _open(data, policy, param=param) as image:
        width, height = image.size
    if width * height > policy.max_image_pixels:
        raise _too_many_pixels((width, height), policy, param)
    return width, height


def _open(data: bytes, policy: MediaPolicy, *, param: str) -> Image.Image:
    """The image of ``data``, its header read and its pixels not yet decoded."""
    try:
        return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError as exc:
        raise InvalidRequestError(
            "image is not a PNG, JPEG, WebP, GIF or BMP file (or is corrupt)", param=param
        ) from exc
    except Image.DecompressionBombError as exc:
        # Pillow's own ceiling (twice Image.MAX_IMAGE_PIXELS), met before ours can look.
        raise _too_many_pixels(None, policy, param) from exc
    except _DECODE_ERRORS as exc:
        raise InvalidRequestError(f"image is truncated or corrupt: {exc}", param=param) from exc


def decode_image(data: bytes, policy: MediaPolicy, *, param: str) -> Image.Image:
    """Decode encoded bytes into an RGB image, checking the header's pixel count first.
    CPU work: call it off the event loop.

    As transformers' ``load_image``: EXIF orientation applied, then ``convert("RGB")``."""
    image = _open(data, policy, param=param)
    with image:
        width, height = image.size
        if width * height > policy.max_image_pixels:
            raise _too_many_pixels((width, height), policy, param)
        try:
            image.load()
            transposed = ImageOps.exif_transpose(image)
            return transposed.convert("RGB")
        except Image.DecompressionBombError as exc:
            raise _too_many_pixels(None, policy, param) from exc
        except _DECODE_ERRORS as exc:
            raise InvalidRequestError(f"image is truncated or corrupt: {exc}", param=param) from exc


_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error)
"""What Pillow's decoders raise on malformed input (``OSError`` for a truncated file,
``SyntaxError`` for a broken PNG chunk, ...)."""


def _too_many_pixels(
    size: tuple[int, int] | None, policy: MediaPolicy, param: str
) -> InvalidRequestError:
    what = (
        f"{size[0]}x{size[1]} pixels"
        if size is not None
        else f"more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels"
    )
    return InvalidRequestError(
        f"image is {what}, more than the server's limit of {policy.max_image_pixels} "
        "(--max-image-pixels)",
        param=param,
    )


# ---------------------------------------------------------------------------------------------
# the request's images


async def load_images(
    refs: Sequence[tuple[str, str]],
    policy: MediaPolicy,
    processor: ImageProcessor,
    executor: Executor | None = None,
) -> list[ImageInput]:
    """A request's images, in order: ``refs`` holds each image's ``(url, param)``. Refuses
    more than ``policy.max_images`` before fetching any; fetches concurrently; decodes and
    preprocesses in ``executor`` (off the event loop). The first refusal cancels the rest."""
    if len(refs) > policy.max_images:
        raise InvalidRequestError(
            f"request has {len(refs)} images, more than the server's limit of "
            f"{policy.max_images} (--max-images-per-request)",
            param=refs[policy.max_images][1],
        )
    loop = asyncio.get_running_loop()

    async def one(url: str, param: str) -> ImageInput:
        data = await fetch_image(url, policy, param=param)
        return await loop.run_in_executor(
            executor, _decode_and_preprocess, data, policy, processor, param
        )

    return await gather_all_or_none([one(url, param) for url, param in refs])


async def gather_all_or_none(coroutines: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of ``coroutines``, run concurrently, in order; the first to fail cancels
    the others (awaited before its exception is raised): a request already answered with
    400 must not keep connections open until their timeouts."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _decode_and_preprocess(
    data: bytes, policy: MediaPolicy, processor: ImageProcessor, param: str
) -> ImageInput:
    image = decode_image(data, policy, param=param)
    with image:
        return processor.preprocess(image)

"""Image references under the server's limits: data: URIs, URL fetching (the SSRF, DNS
rebinding, slow, oversized and redirecting cases, against real servers on 127.0.0.1 only),
decoding (decompression bombs, truncated files) and a request's images end to end."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from embedding_server.errors import InvalidRequestError
from embedding_server.request.media import fetching as media
from embedding_server.request.media.fetching import (
    MediaPolicy,
    decode_image,
    fetch_image,
    load_images,
)
from embedding_server.request.media.preprocessing import ImageProcessor
from embedding_server.settings import ServerSettings
from PIL import Image


def _png(width: int = 12, height: int = 7, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(width * 1000 + height)
    channels = len(mode)
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def _refused(coro: object, match: str, param: str = "input[0]") -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=match) as info:
        await coro  # type: ignore[misc]
    assert info.value.param == param
    assert info.value.status_code == 400
    return info.value


# ---------------------------------------------------------------------------------------------
# policy


def test_policy_from_settings(tmp_path: Path) -> None:
    settings = ServerSettings(
        model=str(tmp_path),
        allowed_media_domains=["images.example.com", "*.cdn.example.org"],
        media_fetch_timeout=2.5,
        max_image_bytes=1000,
        max_image_pixels=5000,
        max_images_per_request=3,
    )
    policy = MediaPolicy.from_settings(settings)
    assert policy == MediaPolicy(
        allowed_domains=("images.example.com", "*.cdn.example.org"),
        fetch_timeout=2.5,
        max_image_bytes=1000,
        max_image_pixels=5000,
        max_images=3,
    )


def test_wildcard_matches_subdomains_only() -> None:
    policy = MediaPolicy(allowed_domains=("*.example.com", "exact.org"))
    assert policy.host_listing("a.example.com") == "wildcard"
    assert policy.host_listing("a.b.example.com") == "wildcard"
    assert policy.host_listing("example.com") is None
    assert policy.host_listing("badexample.com") is None
    assert policy.host_listing("EXACT.org.") == "exact"
    assert policy.host_listing("sub.exact.org") is None
    assert MediaPolicy(allowed_domains=(" Images.Example.COM ",)).host_listing("images.example.com")


# ---------------------------------------------------------------------------------------------
# data: URIs


async def test_data_uri_gives_its_bytes() -> None:
    png = _png()
    assert await fetch_image(_data_uri(png), MediaPolicy(), param="input[0]") == png


async def test_data_uri_refusals() -> None:
    policy = MediaPolicy(max_image_bytes=100)
    await _refused(fetch_image("data:image/png;base64,@@@@", policy, param="input[0]"), "base64")
    await _refused(
        fetch_image(_data_uri(b"hello", "text/plain"), policy, param="input[0]"), "text/plain"
    )
    await _refused(fetch_image("data:image/png,rawbytes", policy, param="input[0]"), "base64")
    # Too large is decided from the length alone: this payload is not even valid base64.
    await _refused(
        fetch_image("data:image/png;base64," + "!" * 200, policy, param="input[0]"),
        "150 bytes, larger than the server's limit of 100",
    )
    # At the limit exactly it is accepted.
    assert len(await fetch_image(_data_uri(b"x" * 100), policy, param="input[0]")) == 100


# ---------------------------------------------------------------------------------------------
# decoding


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` but whose data is a few bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("width", "height", "match"),
    [
        # Under Pillow's own warning threshold: the server's limit decides, from the header.
        (6000, 6000, "6000x6000 pixels, more than the server's limit of 25000000"),
        # Beyond Pillow's ceiling, which refuses it while opening.
        (20000, 20000, "more than the server's limit of 25000000"),
    ],
)
def test_decompression_bomb_refused_from_its_header(width: int, height: int, match: str) -> None:
    bomb = _bomb_png(width, height)
    assert len(bomb) < 200
    with pytest.raises(InvalidRequestError, match=match) as info:
        decode_image(bomb, MediaPolicy(), param="input[1]")
    assert info.value.param == "input[1]"
    # Not a size problem below the limit: the same header, then the missing data, is corrupt.
    with pytest.raises(InvalidRequestError, match="truncated or corrupt"):
        decode_image(_bomb_png(600, 600), MediaPolicy(), param="input[1]")


def test_truncated_jpeg_refused() -> None:
    buffer = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 120, dtype=np.uint8)).save(buffer, format="JPEG")
    truncated = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    with pytest.raises(InvalidRequestError, match="truncated or corrupt"):
        decode_image(truncated, MediaPolicy(), param="input[0]")


def test_other_formats_refused() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="TIFF")
    with pytest.raises(InvalidRequestError, match="not a PNG, JPEG, WebP, GIF or BMP"):
        decode_image(buffer.getvalue(), MediaPolicy(), param="input[0]")
    with pytest.raises(InvalidRequestError, match="not a PNG"):
        decode_image(b"<svg></svg>", MediaPolicy(), param="input[0]")


def test_decode_gives_rgb_upright() -> None:
    rgba = decode_image(_png(5, 3, "RGBA"), MediaPolicy(), param="input[0]")
    assert (rgba.mode, rgba.size) == ("RGB", (5, 3))
    # EXIF orientation 6 (rotate 90 degrees clockwise to display): as load_image, upright.
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.new("RGB", (40, 10), (200, 10, 10)).save(buffer, format="JPEG", exif=exif)
    upright = decode_image(buffer.getvalue(), MediaPolicy(), param="input[0]")
    assert (upright.mode, upright.size) == ("RGB", (10, 40))
    gif = io.BytesIO()
    frames = [Image.new("P", (6, 6), i) for i in range(3)]
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    assert decode_image(gif.getvalue(), MediaPolicy(), param="input[0]").size == (6, 6)


# ---------------------------------------------------------------------------------------------
# URLs: refused before any connection


@pytest.mark.parametrize(
    ("url", "allowed", "match"),
    [
        ("http://example.com/a.png", (), "not allowed on this server"),
        ("http://other.com/a.png", ("example.com",), "host other.com is not allowed"),
        ("http://127.0.0.1:9/a.png", ("*.example.com",), "host 127.0.0.1 is not allowed"),
        ("http://169.254.169.254/latest/meta-data", ("*.example.com",), "not allowed"),
        ("file:///etc/passwd", ("*.example.com",), "scheme file: is not supported"),
        ("ftp://a.example.com/a.png", ("*.example.com",), "scheme ftp:"),
        ("http://api.svc/a.png", ("*.svc",), "cluster-internal name"),
        ("http://x.default.svc.cluster.local/a", ("*.cluster.local",), "cluster-internal"),
    ],
)
async def test_url_refused_before_connecting(
    url: str, allowed: tuple[str, ...], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_dns(host: str, port: int) -> list[str]:
        raise AssertionError("resolved a host that should have been refused first")

    monkeypatch.setattr(media, "_resolve", no_dns)
    await _refused(fetch_image(url, MediaPolicy(allowed_domains=allowed), param="input[0]"), match)


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),
        ("10.1.2.3", "private"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("fe80::1", "link-local"),
        ("::ffff:127.0.0.1", "loopback"),
        # 6to4 carries an IPv4 address in its bits 16-48: a relay delivers 2002:7f00:1:: to
        # 127.0.0.1, 2002:a9fe:a9fe:: to the metadata endpoint.
        ("2002:7f00:1::", "6to4 loopback"),
        ("2002:a9fe:a9fe::1", "6to4 link-local"),
        ("2002:a01:203::", "6to4 private"),
        # Deprecated site-local (RFC 3879): still routed inside some sites.
        ("fec0::1", "site-local"),
    ],
)
async def test_wildcard_host_resolving_inside_refused(
    address: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        assert host == "img.example.com"
        return ["93.184.216.34", address]

    monkeypatch.setattr(media, "_resolve", resolve)
    policy = MediaPolicy(allowed_domains=("*.example.com",))
    await _refused(
        fetch_image("http://img.example.com/a.png", policy, param="input[0]"),
        f"resolves to a {reason} address",
    )


# ---------------------------------------------------------------------------------------------
# URLs: real servers on 127.0.0.1

PNG = _png(9, 6)
BIG = 10_000


@pytest.fixture
async def server() -> AsyncIterator[str]:
    """An aiohttp server on 127.0.0.1 with one route per behaviour; its base URL."""
    state = {"sent": 0}

    async def image(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(10)
        return web.Response(body=PNG, content_type="image/png")

    async def drip(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        for _ in range(100):
            await response.write(b"x")
            await asyncio.sleep(0.1)
        return response

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        for _ in range(1000):  # 4 MB at most, chunked, no Content-Length
            await response.write(b"x" * 4096)
            state["sent"] += 4096
        return response

    async def declared_big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (BIG + 1), content_type="image/png")

    async def at_limit(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * BIG, content_type="image/png")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("http://unlisted.example.net/a.png")

    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html></html>", content_type="text/html")

    app = web.Application()
    for path, handler in [
        ("/a.png", image),
        ("/slow", slow),
        ("/drip", drip),
        ("/endless", endless),
        ("/declared-big", declared_big),
        ("/at-limit", at_limit),
        ("/redirect", redirect),
        ("/html", html),
    ]:
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


LISTED = MediaPolicy(allowed_domains=("127.0.0.1",), fetch_timeout=1.0, max_image_bytes=BIG)


async def test_listed_loopback_host_is_fetched(server: str) -> None:
    assert await fetch_image(f"{server}/a.png", LISTED, param="input[0]") == PNG


async def test_loopback_refused_unless_listed(server: str) -> None:
    policy = MediaPolicy(allowed_domains=("*.0.0.1", "localhost.example"))
    await _refused(fetch_image(f"{server}/a.png", policy, param="input[0]"), "not allowed")


async def test_connects_to_the_checked_address(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host is resolved once, by the check; the connection uses that answer (a host name
    no DNS server knows is fetched, so no second lookup happened)."""
    calls: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(media, "_resolve", resolve)
    port = server.rsplit(":", 1)[1]
    policy = MediaPolicy(allowed_domains=("images.invalid",), fetch_timeout=2.0)
    got = await fetch_image(f"http://images.invalid:{port}/a.png", policy, param="input[0]")
    assert got == PNG
    assert calls == ["images.invalid"]
    # A non-ASCII name too (aiohttp asks for its IDNA spelling; the answer is the same).
    policy = MediaPolicy(allowed_domains=("bücher.invalid",), fetch_timeout=2.0)
    got = await fetch_image(f"http://bücher.invalid:{port}/a.png", policy, param="input[0]")
    assert got == PNG


async def test_slow_server_times_out(server: str) -> None:
    for path in ("/slow", "/drip"):
        started = time.monotonic()
        await _refused(fetch_image(server + path, LISTED, param="input[0]"), "within 1 s")
        assert time.monotonic() - started < 3


async def test_oversized_body_refused(server: str) -> None:
    await _refused(
        fetch_image(f"{server}/declared-big", LISTED, param="input[0]"),
        f"{BIG + 1} bytes, larger than the server's limit of {BIG}",
    )
    await _refused(
        fetch_image(f"{server}/endless", LISTED, param="input[0]"),
        f"more than {BIG} bytes",
    )
    assert len(await fetch_image(f"{server}/at-limit", LISTED, param="input[0]")) == BIG


async def test_redirect_and_non_image_refused(server: str) -> None:
    await _refused(fetch_image(f"{server}/redirect", LISTED, param="input[0]"), "redirect")
    await _refused(fetch_image(f"{server}/html", LISTED, param="input[0]"), "text/html")
    await _refused(fetch_image(f"{server}/missing", LISTED, param="input[0]"), "HTTP 404")


# ---------------------------------------------------------------------------------------------
# a request's images


def _siglip_processor(tmp_path: Path) -> ImageProcessor:
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "SiglipImageProcessor", "size": 32}).replace(
            '"size": 32', '"size": {"height": 32, "width": 32}'
        )
    )
    model: dict[str, object] = {
        "model_type": "siglip",
        "vision_config": {"patch_size": 8, "image_size": 32},
    }
    processor = ImageProcessor.from_pretrained(tmp_path, model)
    assert processor is not None
    return processor


async def test_load_images_fetches_decodes_and_preprocesses(server: str, tmp_path: Path) -> None:
    processor = _siglip_processor(tmp_path)
    refs = [(f"{server}/a.png", "input[0]"), (_data_uri(_png(40, 20)), "input[1]")]
    images = await load_images(refs, LISTED, processor, None)
    assert [image.pixels.shape for image in images] == [(3, 32, 32)] * 2
    assert [image.tokens for image in images] == [16, 16]
    expected = processor.preprocess(Image.open(io.BytesIO(PNG)).convert("RGB")).pixels
    np.testing.assert_array_equal(images[0].pixels, expected)
    # One bad reference refuses the request, naming its field.
    refs.append(("data:image/png;base64,AAAA", "input[2]"))
    await _refused(load_images(refs, LISTED, processor, None), "not a PNG", param="input[2]")


async def test_too_many_images_refused_before_fetching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_fetch(url: str, policy: MediaPolicy, *, param: str) -> bytes:
        raise AssertionError("fetched an image of a request that should be refused")

    monkeypatch.setattr(media, "fetch_image", no_fetch)
    refs = [(f"http://127.0.0.1:9/{i}.png", f"input[{i}]") for i in range(3)]
    await _refused(
        load_images(refs, MediaPolicy(max_images=2), _siglip_processor(tmp_path), None),
        "3 images, more than the server's limit of 2",
        param="input[2]",
    )

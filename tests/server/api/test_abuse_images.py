"""The third review's image attacks (issue 48: H7, M2), replayed against a real server.

H7: image URLs were fetched and decoded before any admission, so a few small requests naming
big images on a listed host made the server download and decode them all at once. Now a
request's URLs reserve what they may download (``--max-image-bytes`` each) before any is
fetched, and a request that does not fit beside those in flight gets 429 with Retry-After
without a single fetch; the reservation comes back when the request ends, also when its
client hangs up.

M2: an image was charged its vision tokens whatever its decoding costs, and decoded in the
tokenizer threads, so single-colour megapixel PNGs (a few KB each) held them for seconds
and texts queued behind them. Now images decode on a thread of their own, and a request's
pixels (from the headers) are reserved before any is decoded: a second such request is a
429 while the first decodes, and a text sent meanwhile is answered before it finishes.

The image host is a real HTTP server on 127.0.0.1 (listed exactly, as an operator lists an
in-cluster image store), whose ``/slow/`` images send half their body and wait for the test.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.server.api.test_abuse import Served, assert_refused, serve
from tests.support.api import wait_for

pytestmark = pytest.mark.timeout(300)


def _png(size: tuple[int, int], colour: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


class ImageHost:
    """An HTTP server on 127.0.0.1 serving one PNG at every path: at once, or for a path
    under ``/slow/``, half of it, then the rest once :attr:`release` is set. It records
    the paths it was asked for."""

    def __init__(self, image: bytes) -> None:
        self.image = image
        self.paths: list[str] = []
        self.release = threading.Event()
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                host.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(host.image)))
                self.end_headers()
                half = len(host.image) // 2
                try:
                    if self.path.startswith("/slow/"):
                        self.wfile.write(host.image[:half])
                        self.wfile.flush()
                        host.release.wait(60)
                        self.wfile.write(host.image[half:])
                    else:
                        self.wfile.write(host.image)
                except OSError:
                    pass  # the server hung up (a cancelled fetch)

            def log_images(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def asked(self, prefix: str) -> int:
        return sum(path.startswith(prefix) for path in self.paths)

    def __enter__(self) -> ImageHost:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


def _images(*urls: str) -> dict[str, Any]:
    """A Cohere ``/v2/embed`` body embedding ``urls`` (one embedding each)."""
    return {"images": list(urls), "input_type": "image", "embedding_types": ["float"]}


EMBED = "/v2/embed"


# -- H7: image URLs reserve what they may download before any is fetched ----------------------

MAX_IMAGE_BYTES = 200_000
IMAGES = 4


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    with ImageHost(_png((300, 300))) as served:
        yield served


@pytest.fixture(scope="module")
def url_server(tmp_path_factory: pytest.TempPathFactory, host: ImageHost) -> Iterator[Served]:
    """The fake backend taking images from the test's host, 4 URLs a request at most: the
    default budget of bytes being fetched holds one such request."""
    log = tmp_path_factory.mktemp("abuse-image-urls") / "server.log"
    with serve(
        log,
        "--model", "fake?dim=32&image_tokens=8",
        "--allowed-media-domains", "127.0.0.1",
        "--max-images-per-request", str(IMAGES),
        "--max-image-bytes", str(MAX_IMAGE_BYTES),
        "--media-fetch-timeout", "60",
    ) as served:  # fmt: skip
        yield served


def _post_in_thread(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[Any]]:
    answers: list[Any] = []

    def post() -> None:
        answers.append(httpx.post(url + EMBED, json=body, timeout=120))

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread, answers


def test_image_urls_over_the_fetch_budget_are_refused_before_any_is_fetched(
    url_server: Served, host: ImageHost
) -> None:
    host.release.clear()
    slow = [f"{host.url}/slow/a{i}.png" for i in range(IMAGES)]
    thread, answers = _post_in_thread(url_server.url, _images(*slow))
    try:
        wait_for(lambda: host.asked("/slow/a") == IMAGES, what="the first request's fetches")
        others = [f"{host.url}/b{i}.png" for i in range(IMAGES)]
        response = httpx.post(url_server.url + EMBED, json=_images(*others), timeout=60)
        message = assert_refused(response, 429)
        assert response.json()["error"]["code"] == "images_busy"
        assert "--max-fetching-bytes" in message
        assert int(response.headers["retry-after"]) >= 1
        assert host.asked("/b") == 0, "the refused request's images were fetched"
        # Texts are not images: they are served while the budget is full.
        text = httpx.post(url_server.url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert text.status_code == 200, text.text[:300]
    finally:
        host.release.set()
        thread.join(timeout=120)
    assert answers and answers[0].status_code == 200, answers and answers[0].text[:300]
    # The first request's reservation came back with its answer.
    response = httpx.post(url_server.url + EMBED, json=_images(*others), timeout=60)
    assert response.status_code == 200, response.text[:300]
    assert host.asked("/b") == IMAGES


def test_a_client_that_hangs_up_gives_back_its_image_reservation(
    url_server: Served, host: ImageHost
) -> None:
    host.release.clear()
    try:
        body = _images(*[f"{host.url}/slow/c{i}.png" for i in range(IMAGES)])
        raw = httpx.Request("POST", url_server.url + EMBED, json=body)
        payload = raw.read()
        address = url_server.url.removeprefix("http://").split(":")
        with socket.create_connection((address[0], int(address[1])), timeout=10) as sock:
            sock.sendall(
                b"POST /v2/embed HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(payload), payload)
            )
            wait_for(lambda: host.asked("/slow/c") == IMAGES, what="the fetches to start")
        # The client is gone while its fetches wait on the host; its reservation is given
        # back without the host ever finishing them.
        fast = _images(*[f"{host.url}/d{i}.png" for i in range(IMAGES)])

        def admitted() -> bool:
            response = httpx.post(url_server.url + EMBED, json=fast, timeout=60)
            assert response.status_code in (200, 429), response.text[:300]
            return response.status_code == 200

        wait_for(admitted, timeout=20, interval=0.2, what="the hung-up request's reservation")
    finally:
        host.release.set()


# -- M2: images are charged their pixels and decoded apart from the texts ----------------------

PIXELS = 16_000_000
SIDE = 4000  # 16 M pixels of one colour: about 50 KB of PNG, 48 MB decoded
PER_REQUEST = 4


@pytest.fixture(scope="module")
def pixel_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The fake backend taking images, one tokenizer thread; the default budget of pixels
    being decoded (4 x --max-image-pixels) holds one request of 4 full-size images."""
    log = tmp_path_factory.mktemp("abuse-image-pixels") / "server.log"
    with serve(
        log,
        "--model", "fake?dim=32&image_tokens=8",
        "--max-images-per-request", str(PER_REQUEST),
        "--max-image-bytes", str(1_000_000),
        "--max-image-pixels", str(PIXELS),
        "--tokenizer-workers", "1",
    ) as served:  # fmt: skip
        yield served


def _cpu_seconds(served: Served) -> float:
    fields = Path(f"/proc/{served.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def test_pixels_are_reserved_before_decoding_and_texts_are_not_queued_behind_them(
    pixel_server: Served,
) -> None:
    uri = "data:image/png;base64," + base64.b64encode(_png((SIDE, SIDE))).decode()
    body = _images(*[uri] * PER_REQUEST)
    assert len(uri) < 200_000  # the whole attack is a small body
    before = _cpu_seconds(pixel_server)
    first, first_answers = _post_in_thread(pixel_server.url, body)
    # Decoding is under way once the server has spent CPU beyond parsing the small body.
    wait_for(lambda: _cpu_seconds(pixel_server) - before > 0.3, what="decoding to start")
    second = httpx.post(pixel_server.url + EMBED, json=body, timeout=120)
    # Texts long enough together to be tokenized in the tokenizer thread, not inline.
    text = ["word " * 90] * 6
    answered = httpx.post(pixel_server.url + "/v1/embeddings", json={"input": text}, timeout=120)
    first_still_decoding = first.is_alive()
    first.join(timeout=120)
    assert first_answers and first_answers[0].status_code == 200, first_answers[0].text[:300]
    message = assert_refused(second, 429)
    assert second.json()["error"]["code"] == "images_busy"
    assert "--max-decoding-pixels" in message
    assert int(second.headers["retry-after"]) >= 1
    assert answered.status_code == 200, answered.text[:300]
    assert first_still_decoding, "the text was answered only once the images were decoded"
    # The pixels came back with the first answer.
    again = httpx.post(pixel_server.url + EMBED, json=body, timeout=120)
    assert again.status_code == 200, again.text[:300]

"""What each attack of the hardening review costs a server, before and after.

Not a test (``tests/server/api/test_abuse.py`` asserts the limits): the figures of the table
in docs/security.md. Each attack runs against a fresh ``embedding-server serve`` on
127.0.0.1 with its default limits (the packaged all-MiniLM-L6-v2; a 1-layer cross-encoder
with its tokenizer, built here, for the pair attacks), once with the server code of
``--before`` (a checkout's ``server/`` folder, e.g. ``git archive main | tar -x -C
/tmp/before``) and once with this tree's, and prints them side by side:

* **time**: how long the attack's request took (or the attack, for the connection ones);
* **peak**: how far the server's resident memory rose above where it started (``VmHWM``,
  reset before the attack), and **kept**: how much of it it still held a second after;
* **others**: the worst latency another client saw meanwhile (``/health`` every 50 ms, or a
  small rerank for the pair attacks);
* **outcome**: the status the attacker got, or what was left open.

The sizes are the review's where a machine shared with others can afford them (two of them are
halved: noted in the table). Writes bench/out/abuse.json.

The gateway's rows (``(gateway)`` in their names: the third review's H4, H5 and L1) run a
fresh ``embedding-server gateway`` with the code of ``--before`` or this tree's, in front of
this tree's ``embedding-server serve`` on the fake backend (whose ``/pooling`` answers a 4 KB
input with 42 MB); what they measure is the gateway process, and the other client is a small
``/v1/embeddings`` request through it::

    .venv/bin/python -m bench.abuse --before /tmp/before/server --only gateway

(``--after`` names another checkout's ``server/`` folder than this tree's to measure after.)

The third review's H6 and H8 rows (``--only "3rd review"``) each run on a server of their own
(:class:`Own`: the fake backend, and for H8 ``--max-connections 200`` on both sides and
``--probe-port`` after, where the probes then go).

The third review's H7 and M2 rows (images) run on servers of their own too: the fake backend
taking images, at the default image limits; for H7 an image host on 127.0.0.1 in this
process, listed with ``--allowed-media-domains 127.0.0.1`` (and ``--media-fetch-timeout 30``).
The H1 and M3 rows (chat templates) run on the fake backend with its chat template, the H2
row on a 1-layer Qwen3 reranker built here.

    .venv/bin/python -m bench.abuse --before /tmp/before/server
    .venv/bin/python -m bench.abuse --scale 0.02       # a smoke run, this tree only
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from PIL import Image

from bench import out_dir, write_results
from bench.models import build_tiny_bert, build_tiny_qwen3_reranker

OUT = out_dir()
REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "embedding-server"
MIB = 2**20


@dataclass
class Measure:
    seconds: float = 0.0
    peak_mib: float = 0.0
    kept_mib: float = 0.0
    others_worst_ms: float = 0.0
    outcome: str = ""


@dataclass
class Row:
    attack: str
    limit: str
    before: Measure | None = None
    after: Measure | None = None


@dataclass
class Served:
    url: str
    pid: int
    probe_url: str | None = None
    """The probe port's base URL, where the server has one (``--probe-port``)."""

    def _status(self, key: str) -> float:
        text = Path(f"/proc/{self.pid}/status").read_text()
        kib = next(line.split()[1] for line in text.splitlines() if line.startswith(key))
        return int(kib) / 1024

    def rss_mib(self) -> float:
        return self._status("VmRSS")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def peak_mib(self) -> float:
        return self._status("VmHWM")

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve(server_dir: Path, log: Path, *flags: str) -> Iterator[Served]:
    """``embedding-server serve`` with the code of ``server_dir``, until it is ready."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")}
    env["PYTHONPATH"] = str(server_dir)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(SCRIPT), "serve", "--port", str(port), *flags],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not get ready within 300 s; see {log}")
            time.sleep(0.3)
        yield Served(url, process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- measuring ---------------------------------------------------------------------------------


class Probe:
    """Another client, every 50 ms while an attack runs: ``/health`` (or ``request``); its
    worst latency in ms."""

    def __init__(self, served: Served, request: Callable[[httpx.Client], object] | None = None):
        self.served = served
        self.request = request or (lambda http: http.get(served.url + "/health"))
        self.worst_ms = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=300) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    self.request(http)
                self.worst_ms = max(self.worst_ms, (time.monotonic() - started) * 1000)
                self._stop.wait(0.05)

    def __enter__(self) -> Probe:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=300)


def measured(
    served: Served,
    attack: Callable[[], str],
    probe: Callable[[httpx.Client], object] | None = None,
) -> Measure:
    """Run ``attack`` (it returns the outcome) with the server's memory and another client
    watched."""
    with httpx.Client(timeout=60) as http:
        (probe or (lambda h: h.get(served.url + "/health")))(http)  # warm the prober's path
    start_rss = served.rss_mib()
    served.reset_peak()
    with Probe(served, probe) as watch:
        started = time.monotonic()
        outcome = attack()
        seconds = time.monotonic() - started
    peak = served.peak_mib() - start_rss
    time.sleep(1.0)
    return Measure(seconds, peak, served.rss_mib() - start_rss, watch.worst_ms, outcome)


def post(served: Served, path: str, body: dict[str, Any] | bytes, timeout: float = 600) -> str:
    if isinstance(body, bytes):
        response = httpx.post(
            served.url + path,
            content=body,
            headers={"content-type": "application/json"},
            timeout=timeout,
        )
    else:
        response = httpx.post(served.url + path, json=body, timeout=timeout)
    return f"{response.status_code}"


# -- the attacks -------------------------------------------------------------------------------


def giant_first_word(words: int, width: int = 3000) -> str:
    """A first word wider than a text's first reading window (and the old clipping: 8
    characters per token the model keeps, 2048 for MiniLM's 256 and 4096 for the
    cross-encoder's 512), then ``words`` short words."""
    return "x" * width + " a" * words


def h1(scale: float, truncate: int) -> Callable[[Served], Measure]:
    text = giant_first_word(int(4_000_000 * scale))
    body = {"input": text, "truncate_prompt_tokens": truncate}
    return lambda s: measured(s, lambda: post(s, "/v1/embeddings", body))


def h2(scale: float) -> Callable[[Served], Measure]:
    body = {"prompt": "a " * int(2_000_000 * scale)}
    return lambda s: measured(s, lambda: post(s, "/tokenize", body))


def h3_copy(scale: float) -> Callable[[Served], Measure]:
    query = "what is the meaning of this long question " * int(12_000 * scale)
    body = {
        "query": query,
        "documents": [f"document {i}" for i in range(max(16, int(2048 * min(1, scale * 4))))],
        "truncate_prompt_tokens": -1,
        "return_documents": False,
    }
    return lambda s: measured(s, lambda: post(s, "/rerank", body))


def h3_giant_query(scale: float) -> Callable[[Served], Measure]:
    body = {
        "query": giant_first_word(int(100_000 * scale), width=5000),
        "documents": [f"document number {i} about foxes" for i in range(64)],
        "truncate_prompt_tokens": -1,
    }
    normal = {
        "query": "what do foxes eat?",
        "documents": [" ".join(["fox"] * 200)] * 8,
        "truncate_prompt_tokens": -1,
    }

    def run(served: Served) -> Measure:
        def attack() -> str:
            async def two() -> list[int]:
                async with httpx.AsyncClient(timeout=600) as http:
                    answers = await asyncio.gather(
                        *(http.post(served.url + "/rerank", json=body) for _ in range(2))
                    )
                return [a.status_code for a in answers]

            return ",".join(map(str, asyncio.run(two())))

        return measured(served, attack, lambda http: http.post(served.url + "/rerank", json=normal))

    return run


def m2(scale: float) -> Callable[[Served], Measure]:
    ids = int(4_100_000 * scale)
    body = b'{"input": [' + b"1," * (ids - 1) + b"1]}"
    return lambda s: measured(s, lambda: post(s, "/v1/embeddings", body))


def m3_headers(scale: float) -> Callable[[Served], Measure]:
    total = int(200 * MIB * scale)

    def run(served: Served) -> Measure:
        def attack() -> str:
            sock = socket.create_connection(served.address)
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\nX-Fill: ")
            sent = 0
            with contextlib.suppress(OSError):
                while sent < total:
                    sock.sendall(b"a" * 65536)
                    sent += 65536
            sock.settimeout(5)
            answer = b""
            with contextlib.suppress(OSError):
                answer = sock.recv(100)
            sock.close()
            status = answer[9:12].decode() or "no answer"
            return f"{status} after {sent / MIB:.2f} MiB sent"

        return measured(served, attack)

    return run


def _open_after(sockets: list[socket.socket], wait: float) -> str:
    """How many of ``sockets`` the server still held open ``wait`` seconds on; closes them."""
    try:
        time.sleep(wait)
        still = 0
        for sock in sockets:
            sock.setblocking(False)
            try:
                while sock.recv(65536):
                    pass
            except BlockingIOError:
                still += 1
            except OSError:
                pass
        return f"{still} of {len(sockets)} open after {wait:g} s"
    finally:
        for sock in sockets:
            sock.close()


def m3_half_open(scale: float) -> Callable[[Served], Measure]:
    count = max(10, int(500 * scale))

    def run(served: Served) -> Measure:
        def attack() -> str:
            sockets = [socket.create_connection(served.address) for _ in range(count)]
            return _open_after(sockets, 12.0)

        return measured(served, attack)

    return run


def m3_stalled(scale: float) -> Callable[[Served], Measure]:
    count, size = max(4, int(60 * scale)), 8 * MIB - 4096

    def run(served: Served) -> Measure:
        def attack() -> str:
            head = (
                b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size
            )
            sockets = []
            for _ in range(count):
                sock = socket.create_connection(served.address)
                with contextlib.suppress(OSError):
                    sock.sendall(head + b'{"input": "' + b"a" * (size - 4096))
                sockets.append(sock)
            return _open_after(sockets, 35.0)

        return measured(served, attack)

    return run


def l4_host() -> Callable[[Served], Measure]:
    def run(served: Served) -> Measure:
        def attack() -> str:
            response = httpx.post(
                served.url + "/v1/embeddings",
                json={"input": "read by a page on attacker.example"},
                headers={"host": "attacker.example"},
                timeout=30,
            )
            return str(response.status_code)

        return measured(served, attack)

    return run


def attacks(scale: float) -> list[tuple[Row, Callable[[Served], Measure], bool | str | Own]]:
    """(row, attack, whether it needs the cross-encoder, or :data:`GATEWAY`, or its
    :class:`Own` server)."""
    return [
        (Row("H1: 8 MiB text, 3,000-char first word", "reading windows; inline by size"),
         h1(scale, -1), False),
        (Row("H1: same, truncate_prompt_tokens 8", "reading windows; inline by size"),
         h1(scale, 8), False),
        (Row("H2: /tokenize 4 MiB prompt (review: 8)", "max_request_tokens, windows"),
         h2(scale), False),
        (Row("H3: rerank 512 kB query x 2048 docs (review: 1 MiB)", "pairs measured by length"),
         h3_copy(scale), True),
        (Row("H3: two reranks, 200 kB query with a 5,000-char first word x 64", "query read once"),
         h3_giant_query(scale), True),
        (Row("M2: 4.1 million token ids", "counted before validation"), m2(scale), False),
        (Row("M3: 200 MiB of headers", "--max-header-bytes"), m3_headers(scale), False),
        (Row("M3: 500 half-open connections", "--header-timeout"), m3_half_open(scale), False),
        (Row("M3: 60 stalled 8 MiB uploads", "--max-receiving-bytes, --body-timeout"),
         m3_stalled(scale), False),
        (Row("L4: Host attacker.example", "--allowed-hosts localhost"), l4_host(), False),
        (Row("H4 (gateway): 30 stalled 16 MiB uploads", "--max-buffered-bytes, --body-timeout"),
         gateway_stalled(scale), GATEWAY),
        (Row("H5 (gateway): 5 unread 42 MB answers", "--max-buffered-bytes, --write-timeout"),
         gateway_unread(scale), GATEWAY),
        (Row("L1 (gateway): 500 half-open connections", "--header-timeout"),
         gateway_half_open(scale), GATEWAY),
        (Row("H8 (3rd review): a client holds all 200 connections, reopening them, 25 s",
             "--probe-port"),
         h8_connection_hog(scale), Own("fake?dim=8", ("--max-connections", "200"),
                                       (PROBE_PORT_FLAG,))),
        (Row("H6 (3rd review): 8 clients that never read a 42 MB /pooling answer",
             "--max-sending-bytes, --send-timeout"),
         h6_unread_answers(scale), Own("fake?dim=1024")),
        (Row("H7 (3rd review): 4 requests of 16 URLs (1 KB each) of 7.3 MiB images, listed host",
             "--max-fetching-bytes"),
         h7_image_urls(scale), Own(IMAGE_MODEL, IMAGE_HOST_FLAGS)),
        (Row("M2 (3rd review): 2 requests of 16 one-colour 25 MP PNGs (1.75 MiB each)",
             "--max-decoding-pixels, the images' own thread"),
         m2_pixels(scale), Own(IMAGE_MODEL)),
        (Row("H1 (3rd review): eos_token of 300,000 chars, written after each of 2000 messages",
             "special tokens not settable, rendered size counted"),
         h1_chat_kwargs(scale), Own(CHAT_MODEL)),
        (Row("M3 (3rd review): 250,000 messages (7.2 MiB)", "2048 messages, counted first"),
         m3_messages(scale), Own(CHAT_MODEL)),
        (Row("H2 (3rd review): yes/no rerank of a 256 KiB query x 2048 documents",
             "pair prompts sized from their parts, built cut"),
         h2_pair_prompts(scale), Own(str(QWEN3_RERANKER), ("--task", "score"))),
    ]  # fmt: skip


# -- the third review's H6 and H8 (their own servers: see Own) --------------------------------


@dataclass(frozen=True)
class Own:
    """A row's own server: its model and flags (``both``), and the flags only this tree's
    server has (``after``: the fix's own switch, such as ``--probe-port``)."""

    model: str
    both: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


PROBE_PORT_FLAG = "--probe-port"
CLOSE = {"connection": "close"}
"""A probe as the kubelet sends it: a new connection each time."""


def h8_connection_hog(scale: float) -> Callable[[Served], Measure]:
    """One client holds every client connection (``--max-connections 200`` on both sides:
    the default 1024 needs more descriptors than a shell gives), reopening each as the server
    closes it, for 25 s; the probes meanwhile are the kubelet's: a new connection each,
    ``/health`` every 100 ms, on the probe port where there is one."""
    count, seconds = 210, 25.0 * max(scale, 0.2)

    def run(served: Served) -> Measure:
        probe_url = served.probe_url or served.url
        outcomes: list[int] = []

        def kubelet(http: httpx.Client) -> object:
            try:
                status = http.get(probe_url + "/health", headers=CLOSE).status_code
            except httpx.HTTPError:
                status = 0
            outcomes.append(status)
            return status

        def attack() -> str:
            outcomes.clear()  # not the warm-up probe
            stop = threading.Event()
            held: list[socket.socket] = []

            def hog() -> None:
                while not stop.is_set():
                    while len(held) < count and not stop.is_set():
                        with contextlib.suppress(OSError):
                            held.append(socket.create_connection(served.address, timeout=5))
                    readable = select.select(held, [], [], 0.02)[0]
                    for sock in readable:
                        sock.close()
                        held.remove(sock)

            thread = threading.Thread(target=hog, daemon=True)
            thread.start()
            time.sleep(seconds)
            stop.set()
            thread.join(timeout=30)
            for sock in held:
                sock.close()
            ok = sum(status == 200 for status in outcomes)
            port = "probe" if served.probe_url else "client"
            return f"{ok} of {len(outcomes)} probes 200 on the {port} port"

        return measured(served, attack, kubelet)

    return run


def h6_unread_answers(scale: float) -> Callable[[Served], Measure]:
    """Clients that each ask ``/pooling`` for a 42 MB answer and never read it (a 4 KiB
    receive buffer), one after another, then wait 35 s (the default --send-timeout is 30)."""
    count = max(2, int(8 * scale))
    body = json.dumps({"input": ["w " * 250] * 8}).encode()
    request = (
        b"POST /pooling HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )

    def run(served: Served) -> Measure:
        def attack() -> str:
            sockets, statuses = [], []
            for _ in range(count):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(served.address)
                sock.sendall(request)
                sock.settimeout(60)
                statuses.append(sock.recv(12)[9:12].decode() or "none")
                sockets.append(sock)
            answered = ", ".join(f"{statuses.count(s)} x {s}" for s in sorted(set(statuses)))
            held = _held_by(served, sockets)
            return f"{answered}; {held}"

        return measured(served, attack, _small_embed(served))

    return run


def _small_embed(served: Served) -> Callable[[httpx.Client], object]:
    return lambda http: http.post(served.url + "/v1/embeddings", json={"input": "another"})


def _held_by(served: Served, sockets: list[socket.socket], wait: float = 35.0) -> str:
    """How many of ``sockets`` the server still holds open ``wait`` seconds on, seen from the
    server process (the client must not read to find out); closes them."""
    try:
        time.sleep(wait)
        mine = {s.getsockname() for s in sockets}
        held = sum(
            1
            for c in psutil.Process(served.pid).net_connections(kind="tcp")
            if c.raddr and tuple(c.raddr) in mine
        )
        return f"{held} of {len(sockets)} held after {wait:g} s"
    finally:
        for sock in sockets:
            sock.close()


# -- the third review's H7 and M2: images (their own servers: see Own) ------------------------

IMAGE_MODEL = "fake?dim=32&image_tokens=8"
"""The image rows' model: the fake backend taking images (its preprocessing decodes each one
whole and resizes it, as a vision model's does)."""
IMAGE_HOST_FLAGS = ("--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "30")
"""H7's server: the image host listed, and 30 s for a fetch (the default 5 s is too short for
64 downloads at once on two shared cores: the attack would end in timeouts, not memory)."""


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@contextlib.contextmanager
def image_host(body: bytes) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 answering every path with the PNG ``body``; its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _concurrently(served: Served, bodies: list[dict[str, Any]]) -> str:
    """POST ``bodies`` to ``/v2/embed`` at once; their statuses, counted."""
    statuses: list[str] = [""] * len(bodies)

    def one(i: int) -> None:
        statuses[i] = post(served, "/v2/embed", bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ", ".join(f"{statuses.count(s)} x {s}" for s in sorted(set(statuses)))


def _cohere_images(images: list[str]) -> dict[str, Any]:
    return {"images": images, "input_type": "image", "embedding_types": ["float"]}


def h7_image_urls(scale: float) -> Callable[[Served], Measure]:
    """Requests of 16 image URLs each, at once, to a listed host (127.0.0.1) whose images
    are random-pixel PNGs of 1600 x 1600 (7.3 MiB, under --max-image-bytes' 8 MiB): each
    request's body is about 1 KB. The other client sends a small embedding."""
    count = max(2, int(4 * scale))
    rng = np.random.default_rng(7)
    noise = rng.integers(0, 256, size=(1600, 1600, 3), dtype=np.uint8)
    body = _png(Image.fromarray(noise, "RGB"))

    def run(served: Served) -> Measure:
        with image_host(body) as host:
            bodies = [
                _cohere_images([f"{host}/{r}/{i}.png" for i in range(16)]) for r in range(count)
            ]

            def attack() -> str:
                return _concurrently(served, bodies)

            return measured(served, attack, _small_embed(served))

    return run


def m2_pixels(scale: float) -> Callable[[Served], Measure]:
    """Requests of 16 one-colour 5000 x 5000 PNGs as data: URIs (84 KB each, a 1.75 MiB
    body; 25 M pixels each, --max-image-pixels' limit), at once. The other client sends
    texts long enough (6 of 450 characters) to be tokenized in the tokenizer threads."""
    count = max(2, int(2 * scale))
    uri = (
        "data:image/png;base64,"
        + base64.b64encode(_png(Image.new("RGB", (5000, 5000), (200, 30, 90)))).decode()
    )
    bodies = [_cohere_images([uri] * 16) for _ in range(count)]
    texts = {"input": ["word " * 90] * 6}

    def run(served: Served) -> Measure:
        def attack() -> str:
            return _concurrently(served, bodies)

        return measured(
            served, attack, lambda http: http.post(served.url + "/v1/embeddings", json=texts)
        )

    return run


# -- the third review's H1 and M3: chat templates (their own servers: see Own) ---------------

CHAT_MODEL = "fake?dim=32&chat=true"
"""The chat rows' model: the fake backend with its Zephyr-style chat template, which writes
the end-of-sequence token after every message."""


def _chat(served: Served, body: dict[str, Any]) -> str:
    return post(served, "/v1/embeddings", json.dumps(body, separators=(",", ":")).encode())


def h1_chat_kwargs(scale: float) -> Callable[[Served], Measure]:
    """A 0.34 MiB request whose ``chat_template_kwargs`` set ``eos_token`` to 300,000
    characters, which the template writes after each of 2000 one-character messages (600 M
    characters rendered)."""
    body = {
        "messages": [{"role": "user", "content": "x"}] * max(2, int(2000 * scale)),
        "chat_template_kwargs": {"eos_token": "A" * 300_000},
        "truncate_prompt_tokens": 8,
    }

    def run(served: Served) -> Measure:
        return measured(served, lambda: _chat(served, body))

    return run


def m3_messages(scale: float) -> Callable[[Served], Measure]:
    """250,000 one-character messages in one request (7.2 MiB)."""
    body = {"messages": [{"role": "user", "content": "x"}] * max(3000, int(250_000 * scale))}

    def run(served: Served) -> Measure:
        return measured(served, lambda: _chat(served, body))

    return run


# -- the third review's H2: a yes/no reranker's pair prompts (its own server: see Own) -------

QWEN3_RERANKER = OUT / "abuse-qwen3-reranker"
"""H2's model: a 1-layer Qwen3 causal LM with MiniLM's tokenizer, served with ``--task
score`` as a Qwen3-Reranker (its prompt around every pair), built by :func:`main`."""


def h2_pair_prompts(scale: float) -> Callable[[Served], Measure]:
    """A rerank whose 256 KiB query the reranker's prompt holds once per document, against
    2048 short documents (a 273 KiB body)."""
    query = "what is the meaning of this long question " * max(10, int(6200 * scale))
    documents = [f"doc {i}" for i in range(max(8, int(2048 * scale)))]
    body = {"query": query, "documents": documents}

    def run(served: Served) -> Measure:
        return measured(served, lambda: post(served, "/rerank", body))

    return run


GATEWAY = "gateway"
FAKE_POOLING = "fake?dim=1024&max_len=4096"
"""The gateway rows' upstream: a 4 KB ``/pooling`` input is answered with 4096 vectors of
1024 floats (42 MB of JSON)."""


@contextlib.contextmanager
def serve_gateway(server_dir: Path, log: Path, upstream: str) -> Iterator[Served]:
    """``embedding-server gateway`` with the code of ``server_dir`` in front of
    ``upstream``, with its default limits, until it routes to it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_GATEWAY_")}
    env["PYTHONPATH"] = str(server_dir)
    args = ["gateway", "--port", str(port), "--routes", f"fake={upstream}"]
    with log.open("wb") as out:
        process = subprocess.Popen([str(SCRIPT), *args], env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {process.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                # The gauge, not /v1/models: a gateway after issue 48's L4 lists no counts by
                # default, and the one before it knows no flag to ask for them.
                metrics = httpx.get(url + "/metrics", timeout=2).text
                if 'embedding_gateway_ready_endpoints{model="fake"} 1.0' in metrics:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not route within 60 s; see {log}")
            time.sleep(0.2)
        yield Served(url, process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _through(served: Served) -> Callable[[httpx.Client], object]:
    """Another client of the gateway: a small embedding through it."""
    return lambda http: http.post(served.url + "/v1/embeddings", json={"input": "another"})


def gateway_stalled(scale: float) -> Callable[[Served], Measure]:
    count, size = max(4, int(30 * scale)), 16 * MIB - 1

    def run(served: Served) -> Measure:
        def attack() -> str:
            head = (
                b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size
            )
            sent = b'{"input": "' + b"a" * (size - MIB)
            sockets: list[socket.socket] = []
            refused = []

            def upload() -> None:
                sock = socket.create_connection(served.address)
                sockets.append(sock)
                sock.sendall(head)
                if select.select([sock], [], [], 1.0)[0]:  # refused by its Content-Length
                    refused.append(sock)
                    return
                sock.settimeout(30)
                with contextlib.suppress(OSError):
                    sock.sendall(sent)

            threads = [threading.Thread(target=upload) for _ in range(count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            left = _open_after([s for s in sockets if s not in refused], 35.0)
            for sock in refused:
                sock.close()
            return f"{len(refused)} refused at once, {left}"

        return measured(served, attack, _through(served))

    return run


def gateway_unread(scale: float) -> Callable[[Served], Measure]:
    count = max(2, int(5 * scale))
    body = b'{"input": "' + b"a" * 4000 + b'"}'
    request = (
        b"POST /pooling HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )

    def run(served: Served) -> Measure:
        def attack() -> str:
            sockets = []
            for _ in range(count):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(served.address)
                sock.sendall(request)
                sockets.append(sock)
            # The answers come one after another (about 2 s each here); each has 30 s.
            return _open_after(sockets, 45.0)

        return measured(served, attack, _through(served))

    return run


def gateway_half_open(scale: float) -> Callable[[Served], Measure]:
    count = max(10, int(500 * scale))

    def run(served: Served) -> Measure:
        def attack() -> str:
            sockets = [socket.create_connection(served.address) for _ in range(count)]
            return _open_after(sockets, 12.0)

        return measured(served, attack, _through(served))

    return run


def run_side(
    name: str,
    server_dir: Path,
    flags: list[str],
    cross: Path,
    rows: list[Any],
    upstream_dir: Path = REPO / "server",
) -> None:
    logs = OUT / "abuse-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for row, attack, needs in rows:
        if needs == GATEWAY:
            # The same upstream for both sides (the after side's server); the gateway's
            # code is the side's.
            upstream_log, log = logs / f"{name}-upstream.log", logs / f"{name}-gateway.log"
            with (
                serve(upstream_dir, upstream_log, "--model", FAKE_POOLING) as upstream,
                serve_gateway(server_dir, log, upstream.url) as served,
            ):
                print(f"{name:>6}: {row.attack} ...", flush=True)
                measure = attack(served)
        elif isinstance(needs, Own):
            own = [*flags, "--model", needs.model, *needs.both]
            probe_port = None
            if name == "after" and PROBE_PORT_FLAG in needs.after:
                probe_port = free_port()
                own += [PROBE_PORT_FLAG, str(probe_port)]
            with serve(server_dir, logs / f"{name}.log", *own) as served:
                if probe_port is not None:
                    served.probe_url = f"http://127.0.0.1:{probe_port}"
                print(f"{name:>6}: {row.attack} ...", flush=True)
                measure = attack(served)
        else:
            # A fresh server per attack: what one attack leaves behind is not the next one's.
            model = ["--model", str(cross)] if needs else []
            with serve(server_dir, logs / f"{name}.log", *flags, *model) as served:
                print(f"{name:>6}: {row.attack} ...", flush=True)
                measure = attack(served)
        setattr(row, name, measure)
        print(f"{'':>8}{_cells(measure)}", flush=True)


def _cells(m: Measure | None) -> str:
    if m is None:
        return "not measured"
    return (
        f"{m.seconds:7.1f} s  peak {m.peak_mib:+7.0f} MiB  kept {m.kept_mib:+6.0f} MiB  "
        f"others {m.others_worst_ms:7.0f} ms  {m.outcome}"
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| Attack | Limit that stops it | Before: time, peak (kept) memory, others' worst "
        "latency, outcome | After |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        cells = []
        for m in (row.before, row.after):
            if m is None:
                cells.append("not measured")
                continue
            cells.append(
                f"{m.seconds:.1f} s, {m.peak_mib:+.0f} MiB ({m.kept_mib:+.0f}), "
                f"{m.others_worst_ms:.0f} ms, {m.outcome}"
            )
        lines.append(f"| {row.attack} | {row.limit} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="a checkout's server/ folder to compare")
    parser.add_argument(
        "--after",
        type=Path,
        default=REPO / "server",
        help="the server/ folder measured after (default: this tree's)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="attack sizes (1: the table's)")
    parser.add_argument("--only", default="", help="run the attacks whose name has this text")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    cross = build_tiny_bert(OUT / "abuse-cross-encoder", cross_encoder=True)
    rows = [r for r in attacks(args.scale) if args.only.lower() in r[0].attack.lower()]
    if any(isinstance(needs, Own) and needs.model == str(QWEN3_RERANKER) for *_, needs in rows):
        build_tiny_qwen3_reranker(QWEN3_RERANKER)
    after = args.after.resolve()
    if args.before is not None:
        run_side("before", args.before.resolve(), [], cross, rows, after)
    # This tree's defaults, plus the one check a server has only when asked for.
    after_flags = ["--allowed-hosts", "localhost"]
    run_side("after", after, after_flags, cross, rows, after)
    results = [row for row, _, _ in rows]
    print()
    print(table(results))
    written = write_results(
        "abuse", {"scale": args.scale, "rows": [asdict(row) for row in results]}
    )
    print(f"\nwrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

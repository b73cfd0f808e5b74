"""Raw-socket helpers for the abuse tests, which speak HTTP by hand to a server or a gateway
(half-sent heads, stalled bodies, unread answers) where an HTTP client would not let them."""

from __future__ import annotations

import contextlib
import multiprocessing
import select
import socket
import time
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as EventType

import httpx

ATTACKER_ADDRESS = "127.0.0.2"
"""Where a probe port's attacker connects from: a loopback address other than the probes'
127.0.0.1, as an attacking pod's address is not the node's."""


def peer_closed(sock: socket.socket) -> bool:
    """Whether the peer has closed ``sock`` (whatever it sent first), without waiting."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the peer sends on ``sock`` until it closes it (or ``timeout`` passes
    without a byte)."""
    sock.settimeout(timeout)
    chunks = []
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _hog(
    address: tuple[str, int],
    source: str | None,
    count: int,
    ready: EventType,
    stop: EventType,
    reopened: Synchronized[int],
) -> None:
    """The hog's own process: keep ``count`` connections open, sending nothing, and open a
    new one as soon as the server closes one."""
    sockets: list[socket.socket] = []

    def fill() -> None:
        while len(sockets) < count and not stop.is_set():
            with contextlib.suppress(OSError):
                sockets.append(
                    socket.create_connection(
                        address, timeout=5, source_address=(source, 0) if source else None
                    )
                )

    fill()
    ready.set()
    while not stop.is_set():
        fill()
        readable, _, _ = select.select(sockets, [], [], 0.02)
        for sock in readable:  # answered (503/408) or closed: open another
            sock.close()
            sockets.remove(sock)
            with reopened.get_lock():
                reopened.value += 1
    for sock in sockets:
        sock.close()


class Hog:
    """A client that keeps ``count`` connections to ``address`` open, sending nothing, and
    opens a new one as soon as the server closes one (503 past the cap, 408 at the header
    timeout), from the local address ``source`` if given.

    It runs in a process of its own, as an attacker does. As a thread of the test's process
    it held the GIL while it reopened connections by the hundred, between the moment a probe
    of the test had connected and the moment that probe could send its request: the probe sat
    idle for long enough to become the oldest idle connection on the probe port, and was
    closed to make room (a 503 in CI). A kubelet sends its request as soon as it connects."""

    def __init__(self, address: tuple[str, int], count: int, source: str | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._ready = context.Event()
        self._stop = context.Event()
        self._reopened = context.Value("i", 0)
        self._process = context.Process(
            target=_hog,
            args=(address, source, count, self._ready, self._stop, self._reopened),
            daemon=True,
        )

    @property
    def reopened(self) -> int:
        """Connections the server closed and the hog opened again."""
        return int(self._reopened.value)

    def __enter__(self) -> Hog:
        self._process.start()
        if not self._ready.wait(timeout=60):
            self._process.kill()
            raise AssertionError("the hog did not open its connections within 60 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)


def probe(url: str) -> tuple[int, float]:
    """One probe as the kubelet sends it: a new connection, no keep-alive. Its status (0 when
    refused or timed out) and how long it took."""
    started = time.monotonic()
    try:
        status = httpx.get(url, headers={"connection": "close"}, timeout=5).status_code
    except httpx.HTTPError:
        status = 0
    return status, time.monotonic() - started


def probes_during(url: str, seconds: float) -> list[tuple[int, float]]:
    """Probes of ``url`` every 100 ms for ``seconds``."""
    results = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        results.append(probe(url))
        time.sleep(0.1)
    return results

"""H6 of the third hardening review (docs/security.md): answers waiting to be sent had no
budget and no timeout. An unread ``/pooling`` answer pinned ~44 MiB for as long as its
client liked, and the next request was admitted at once, so a crowd of clients that never
read grew the server without bound. Replayed against a real ``embedding-server serve`` (the
fake backend at 1024 dimensions, whose per-token answers are big and cheap to make): clients
that send a request and never read its ~40 MiB answer."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.server.api.test_abuse import Served, Watch, batches_run, embed_ok, serve
from tests.support.api import wait_for

pytestmark = pytest.mark.timeout(300)

SEND_TIMEOUT = 5.0
SENDING_BYTES = 32 * 2**20
"""Less than one answer: once one waits, the budget is full."""
BODY = json.dumps({"input": ["w " * 250] * 8}).encode()
"""8 inputs of 252 tokens, 1024 numbers each as JSON: a ~40 MiB answer."""
ANSWER_MIB = 40


@pytest.fixture(scope="module")
def sending_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("abuse-sending") / "server.log"
    with serve(
        log,
        "--model", "fake?dim=1024",
        "--send-timeout", str(SEND_TIMEOUT),
        "--max-sending-bytes", str(SENDING_BYTES),
    ) as served:  # fmt: skip
        # One answer read whole first: the allocator's first growth is not what a test sees.
        warm = post_pooling(served)
        assert warm.status_code == 200, warm.text[:300]
        yield served


def _address(served: Served) -> tuple[str, int]:
    host, port = served.url.removeprefix("http://").split(":")
    return host, int(port)


def _request(count: int = 1) -> bytes:
    head = (
        b"POST /pooling HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    )
    return (head + BODY) * count


def non_reader(served: Served, pipelined: int = 1) -> tuple[socket.socket, bytes]:
    """A client that sends ``pipelined`` requests for a big answer and reads only the first
    bytes of what comes back (a small receive buffer, so the answer stays the server's);
    the socket and those bytes."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(_address(served))
    sock.sendall(_request(pipelined))
    sock.settimeout(60)
    return sock, sock.recv(256)


def closed(served: Served, sock: socket.socket) -> bool:
    """Whether the server has closed its end of ``sock``, seen from the server process (the
    client must not read to find out: reading would take the answer)."""
    here = sock.getsockname()
    return not any(
        c.raddr and tuple(c.raddr) == here
        for c in psutil.Process(served.process.pid).net_connections(kind="tcp")
    )


def post_pooling(served: Served) -> httpx.Response:
    """The big answer, read whole."""
    return httpx.post(
        served.url + "/pooling",
        content=BODY,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def test_an_unread_answer_is_dropped_at_the_send_timeout_and_others_are_served(
    sending_server: Served,
) -> None:
    baseline = sending_server.rss_bytes()
    sock, head = non_reader(sending_server)
    started = time.monotonic()
    try:
        assert head.startswith(b"HTTP/1.1 200"), head
        # Another client is served meanwhile (a small request: the budget refuses big work
        # only while it is full, and a GET never waits).
        assert httpx.get(sending_server.url + "/health", timeout=10).status_code == 200
        wait_for(
            lambda: closed(sending_server, sock),
            timeout=SEND_TIMEOUT + 10,
            what="the connection to close",
        )
        assert time.monotonic() - started < SEND_TIMEOUT + 5
    finally:
        sock.close()
    # What it held is given back: memory, and the budget (a normal request is served).
    assert embed_ok(sending_server.url).status_code == 200
    grown = (sending_server.rss_bytes() - baseline) / 2**20
    assert grown < ANSWER_MIB / 2, f"the server still holds {grown:.0f} MiB"
    assert "Traceback" not in sending_server.log_text()


def test_a_flood_of_clients_that_never_read_gets_429_not_memory(sending_server: Served) -> None:
    # Before: every one of them was answered 200 and held its ~40 MiB answer for good.
    sockets: list[socket.socket] = []
    heads = []
    with Watch(sending_server) as watch:
        try:
            for _ in range(8):
                sock, head = non_reader(sending_server)
                sockets.append(sock)
                if closed(sending_server, sockets[0]):
                    break  # the first answer's time is up (a slow machine): its share is back
                heads.append(head)
        finally:
            wait_for(
                lambda: closed(sending_server, sockets[0]),
                timeout=SEND_TIMEOUT + 10,
                what="the unread answer's connection to close",
            )
            for sock in sockets:
                sock.close()
    statuses = [head[:12] for head in heads]
    assert len(statuses) >= 4, f"only {len(statuses)} requests within the send timeout"
    assert statuses[0] == b"HTTP/1.1 200", statuses
    assert statuses[1:] == [b"HTTP/1.1 429"] * (len(statuses) - 1), statuses
    assert all(b"retry-after: 1" in head.lower() for head in heads[1:]), heads[1]
    # One answer's worth, and the encoding's transients: not eight answers.
    watch.assert_unharmed(loop_s=1.0, memory_mib=3 * ANSWER_MIB)


def test_the_next_request_on_a_connection_waits_for_its_previous_answer(
    sending_server: Served,
) -> None:
    # Two pipelined requests on a connection that never reads: the second used to be worked
    # on at once (its answer made and held) while the first's was still unread.
    before = batches_run(sending_server.url)
    assert post_pooling(sending_server).status_code == 200
    per_request = batches_run(sending_server.url) - before
    before = batches_run(sending_server.url)
    sock, head = non_reader(sending_server, pipelined=2)
    try:
        assert head.startswith(b"HTTP/1.1 200"), head
        with contextlib.suppress(AssertionError):
            # Give a wrongly admitted second request the time it would take to run.
            wait_for(
                lambda: batches_run(sending_server.url) - before > per_request,
                timeout=2.0,
                what="a second request's forward passes",
            )
        assert batches_run(sending_server.url) - before == per_request
        wait_for(
            lambda: closed(sending_server, sock),
            timeout=SEND_TIMEOUT + 10,
            what="the connection to close",
        )
    finally:
        sock.close()
    # Cut with its connection: the second request was never worked on.
    assert batches_run(sending_server.url) - before == per_request

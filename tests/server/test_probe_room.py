"""Which connection a full probe port closes (embedding_server.probe_room): the rule the
server's and the gateway's probe ports share. The attacks themselves are replayed against
real processes in tests/server/api/test_abuse_probes.py and the gateway's abuse tests."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from embedding_server.probe_room import peer_host, to_close, unread_bytes


@dataclass
class Transport:
    """What to_close reads of a transport: its peer, its socket, whether it is closing."""

    peer: tuple[str, int] | None
    sock: socket.socket | None = None
    closing: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.peer, "socket": self.sock}.get(name, default)

    def is_closing(self) -> bool:
        return self.closing


def connections(*rows: tuple[str, str, bool]) -> list[tuple[str, asyncio.BaseTransport, bool]]:
    """``(name, peer host, idle)`` rows, oldest first, as to_close takes them."""
    return [
        (name, Transport((host, 40000 + i)), idle)  # type: ignore[misc]
        for i, (name, host, idle) in enumerate(rows)
    ]


def test_the_oldest_idle_connection_of_the_peer_holding_the_most_is_closed() -> None:
    rows = connections(
        ("kubelet", "10.0.0.1", True),  # the oldest, idle: not the one closed
        ("attack-1", "10.1.2.3", True),
        ("attack-2", "10.1.2.3", True),
        ("prometheus", "10.0.0.9", True),
        ("attack-3", "10.1.2.3", True),
    )
    assert to_close(rows) == "attack-1"


def test_a_connection_in_a_request_is_never_closed() -> None:
    rows = connections(
        ("attack-busy", "10.1.2.3", False),
        ("attack-busy-2", "10.1.2.3", False),
        ("kubelet", "10.0.0.1", True),
    )
    # The attacker's peer holds the most, but none of its connections is idle: the next
    # peer's idle one goes, rather than none.
    assert to_close(rows) == "kubelet"
    assert to_close(connections(("a", "10.1.2.3", False), ("b", "10.0.0.1", False))) is None


def test_closing_connections_neither_count_nor_are_chosen() -> None:
    rows = connections(("kubelet", "10.0.0.1", True), ("attack", "10.1.2.3", True))
    for name in ("gone-1", "gone-2", "gone-3"):
        rows.insert(0, (name, Transport(("10.0.0.1", 1), closing=True), True))  # type: ignore[arg-type]
    # 10.0.0.1 holds four, three of them closing: one open each, the first to open goes.
    assert to_close(rows) == "kubelet"


def test_ties_go_to_the_first_to_open() -> None:
    rows = connections(("a", "10.0.0.1", True), ("b", "10.0.0.2", True))
    assert to_close(rows) == "a"
    assert to_close([]) is None


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair()
    try:
        yield left, right
    finally:
        left.close()
        right.close()


def test_a_connection_whose_request_waits_unread_is_not_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Its request has arrived; the loop has not read it yet (a burst of connections is made
    before any is read)."""
    sent, received = pair
    sent.sendall(b"GET /health HTTP/1.1\r\n\r\n")
    waiting = Transport(("10.1.2.3", 1), received)
    assert unread_bytes(waiting) == len(b"GET /health HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
    silent_left, silent_right = socket.socketpair()
    try:
        silent = Transport(("10.1.2.3", 2), silent_right)
        assert unread_bytes(silent) == 0  # type: ignore[arg-type]
        rows = [("waiting", waiting, True), ("silent", silent, True)]
        assert to_close(rows) == "silent"  # type: ignore[arg-type]
        assert to_close(rows[:1]) is None  # type: ignore[arg-type]
    finally:
        silent_left.close()
        silent_right.close()


def test_what_cannot_be_told_counts_as_nothing() -> None:
    assert unread_bytes(Transport(None)) == 0  # type: ignore[arg-type]
    assert peer_host(Transport(None)) == ""  # type: ignore[arg-type]
    closed = socket.socket()
    closed.close()
    assert unread_bytes(Transport(("10.0.0.1", 1), closed)) == 0  # type: ignore[arg-type]

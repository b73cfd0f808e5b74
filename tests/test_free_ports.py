"""The test harness's free ports: outside the kernel's ephemeral range, distinct, and free.

CI once lost an e2e run to a port picked with bind(0) and released: an outgoing connection
took it as its source port before the operator bound it (EADDRINUSE)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from e2e.harness import proc


def _ephemeral_floor() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_are_distinct_below_the_ephemeral_range_and_bindable() -> None:
    first = proc.free_ports(20)
    second = proc.free_ports(20)
    assert len(set(first + second)) == 40  # never handed out twice
    ceiling = min(_ephemeral_floor(), proc._HIGHEST)
    assert all(proc._LOWEST <= port < ceiling for port in first + second)
    for port in first:
        for host in ("127.0.0.1", "0.0.0.0"):
            with socket.socket() as sock:
                sock.bind((host, port))  # raises if the port were taken


def test_a_port_someone_holds_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listener:
        # A port in the allowed range that a listener holds on one address only.
        taken = next(p for p in range(proc._LOWEST + 7, proc._LOWEST + 500) if _binds(listener, p))
        listener.listen()
        picks = iter([taken, taken, taken + 1000])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        monkeypatch.setattr(proc, "_GIVEN", set())  # taken + 1000 not handed out before
        assert proc.free_port("0.0.0.0") == taken + 1000


def _binds(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True

"""Which connection a full probe port closes to let a new one in: the rule the server's
``--probe-port`` (:mod:`embedding_server.api.probes`) and the gateway's
(:mod:`embedding_server.gateway.connections`) share.

A kubelet sends its probe's request as soon as it connects, so closing an idle connection
for each new one keeps a crowd of connections that send nothing from keeping it out. Closing
the oldest idle one was not enough: a client that reopened idle connections as fast as they
were closed (14,000 a second from one process, on a 2-core machine) gave each of the 64 slots
a life of a few milliseconds, and a probe whose request came later than that (a kubelet
short of CPU) was closed with a 503, about one probe in fifty. So the connection closed is
taken from the peer address that holds the most open connections (the kubelet probes from
the node's address, which holds one or two), the oldest of that peer's idle ones, and never
one whose request bytes already wait in the kernel, unread by the loop.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import struct
import termios
from collections.abc import Iterable
from typing import TypeVar

C = TypeVar("C")


def peer_host(transport: asyncio.BaseTransport) -> str:
    """The address ``transport``'s peer connects from, without its port ("" when unknown)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for ``transport``'s socket that the loop has not read yet (0
    when that cannot be told)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        answer = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", answer)[0])


def to_close(open_connections: Iterable[tuple[C, asyncio.BaseTransport, bool]]) -> C | None:
    """Of the open connections, oldest first, as ``(connection, transport, idle)`` (idle: not
    in a request, so still sending one's head or between requests), the one to close to make
    room; None when no idle one may be closed."""
    held: collections.Counter[str] = collections.Counter()
    idle: dict[str, list[tuple[C, asyncio.BaseTransport]]] = collections.defaultdict(list)
    for connection, transport, is_idle in open_connections:
        if transport.is_closing():
            continue
        host = peer_host(transport)
        held[host] += 1
        if is_idle:
            idle[host].append((connection, transport))
    for host in sorted(idle, key=lambda h: -held[h]):  # stable: the first to open, on ties
        for connection, transport in idle[host]:
            if unread_bytes(transport) == 0:
                return connection
    return None

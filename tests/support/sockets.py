"""Raw-socket helpers for the abuse tests, which speak HTTP by hand to a server or a gateway
(half-sent heads, stalled bodies, unread answers) where an HTTP client would not let them."""

from __future__ import annotations

import contextlib
import socket


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

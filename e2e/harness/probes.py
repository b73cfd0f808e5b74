"""Health probes of the e2e cluster: plain HTTP(S) GETs, admin reads of the API, one DNS query.

Every probe answers "not yet" with None or False and never raises for a component that is still
starting, so ``poll_until`` can call it until its deadline.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

from e2e.harness.pki import Pki

NOT_READY_TAINT = "node.kubernetes.io/not-ready"


def http_get(url: str, context: ssl.SSLContext | None) -> str | None:
    """The body of a 200 response, or None for anything else (not up yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            body: bytes = response.read()
            return body.decode() if response.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


class AdminApi:
    """Reads of the API server as the cluster's admin (client certificate), for probes."""

    def __init__(self, server: str, pki: Pki) -> None:
        self.server = server
        self.pki = pki

    def ssl_context(self, *, client_cert: bool) -> ssl.SSLContext:
        """Verifies servers against the cluster CA; presents the admin cert if asked."""
        context = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        if client_cert:
            context.load_cert_chain(str(self.pki.admin.cert), str(self.pki.admin.key))
        return context

    def get(self, path: str) -> Any:
        """GET an API path as admin; the decoded JSON, or None if it is not there (yet)."""
        body = http_get(self.server + path, self.ssl_context(client_cert=True))
        return json.loads(body) if body is not None else None

    def nodes_ready(self, expected: Iterable[str]) -> bool:
        """Every node named is Ready and has lost its ``not-ready`` taint."""
        listing = self.get("/api/v1/nodes")
        if listing is None:
            return False
        ready = set()
        for item in listing["items"]:
            conditions = item.get("status", {}).get("conditions") or []
            taints = item.get("spec", {}).get("taints") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) and not any(
                t["key"] == NOT_READY_TAINT for t in taints
            ):
                ready.add(item["metadata"]["name"])
        return set(expected) <= ready


def resolve_a(name: str, server: str) -> str | None:
    """The first A record for ``name`` from the DNS server at ``server`` (the cluster's, which
    the host's own resolver does not use), or None."""
    query = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    query += b"".join(bytes([len(part)]) + part.encode() for part in name.split(".")) + b"\0"
    query += struct.pack(">HH", 1, 1)  # type A, class IN
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(3)
        try:
            sock.sendto(query, (server, 53))
            answer = sock.recv(4096)
        except OSError:
            return None
    answers = struct.unpack(">H", answer[6:8])[0]
    if answer[3] & 0x0F != 0 or answers == 0 or len(answer) < 4:
        return None
    return socket.inet_ntoa(answer[-4:])

"""H8 of the third hardening review (docs/security.md): one client that holds every client
connection, reopening each as it is closed, kept ``/health`` at 503 for as long as it liked,
and the liveness probe would have restarted a pod that was fine. Replayed against real
``embedding-server serve`` processes (the fake backend, one process and ``--api-workers 2``):
with ``--probe-port``, the probes keep answering there, fast, while the client port stays
full; and the probe port itself cannot be filled by idle connections."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.harness.proc import free_port
from tests.server.api.test_abuse import Served, serve
from tests.support.sockets import ATTACKER_ADDRESS, Hog, probe, probes_during

pytestmark = pytest.mark.timeout(300)

MAX_CONNECTIONS = 40
HEADER_TIMEOUT = 2.0
PROBE_MAX_CONNECTIONS = 64  # embedding_server.api.probes.PROBE_MAX_CONNECTIONS


@contextlib.contextmanager
def probed_server(tmp_path: Path, *flags: str) -> Iterator[tuple[Served, str]]:
    probe_port = free_port()
    with serve(
        tmp_path / "server.log",
        "--model", "fake?dim=8",
        "--max-connections", str(MAX_CONNECTIONS),
        "--header-timeout", str(HEADER_TIMEOUT),
        "--probe-port", str(probe_port),
        *flags,
    ) as served:  # fmt: skip
        yield served, f"http://127.0.0.1:{probe_port}"


def _address(served: Served) -> tuple[str, int]:
    host, port = served.url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "api-workers-2"])
def test_a_client_holding_every_connection_leaves_the_probe_port_answering(
    tmp_path: Path, workers: int
) -> None:
    with probed_server(tmp_path, "--api-workers", str(workers)) as (served, probes):
        # Every client connection of every front-end held, and reopened as it is closed.
        with Hog(_address(served), MAX_CONNECTIONS * workers + 10) as hog:
            time.sleep(0.5)
            on_client_port = probes_during(served.url + "/health", 1.0)
            # Longer than the header timeout: the held connections are cut and reopened.
            health = probes_during(probes + "/health", 2 * HEADER_TIMEOUT + 1)
            ready = [probe(probes + "/ready") for _ in range(5)]
        assert hog.reopened > 0, "the attack never had a connection closed"
    # The attack is real: the client port is full, and probes there get 503 or nothing.
    assert any(status != 200 for status, _ in on_client_port), on_client_port
    # The probe port answers every probe, fast.
    assert all(status == 200 for status, _ in health + ready), health + ready
    worst = max(seconds for _, seconds in health + ready)
    assert worst < 1.0, f"a probe took {worst:.2f} s"


def test_the_probe_port_serves_only_the_probes_and_cannot_be_filled(tmp_path: Path) -> None:
    with probed_server(tmp_path) as (_served, probes):
        # Not a way around the client port's cap: only /health, /ready, /metrics, /golden.
        response = httpx.post(probes + "/v1/embeddings", json={"input": "hi"}, timeout=10)
        assert response.status_code == 404
        assert "only /health, /ready, /metrics and /golden" in response.json()["error"]["message"]
        assert "embedding_server_queue_requests" in httpx.get(probes + "/metrics").text
        # Idle connections past the probe port's own cap make room for new ones. The attacker
        # connects from an address of its own, as a pod does; the probes come from the node's.
        host, port = probes.removeprefix("http://").split(":")
        with Hog((host, int(port)), 3 * PROBE_MAX_CONNECTIONS, source=ATTACKER_ADDRESS):
            time.sleep(0.5)
            results = probes_during(probes + "/health", 4.0)
    assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200]

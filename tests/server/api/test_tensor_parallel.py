"""``embedding-server serve --tensor-parallel-size 2`` as users run it: the real process, the
real all-MiniLM-L6-v2 split over two gloo ranks, the official ``openai`` client.

It answers with the vectors one rank gives; SIGTERM drains and stops both ranks (exit 0); a
rank that is killed, or that hangs, takes the server down (``/ready`` stops answering 200,
exit status 1 within a bounded time) instead of leaving it answering probes while requests
hang; and no process of the tree outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import openai
import psutil
import pytest
from embedding_server.engine import Engine

from e2e.harness.proc import free_port
from tests.support.api import wait_for

pytestmark = pytest.mark.timeout(240)

SCRIPT = os.path.join(os.path.dirname(sys.executable), "embedding-server")
TEXTS = ["tensor parallel serving", "a second, somewhat longer input sentence", "x"]


@dataclass
class Served:
    process: subprocess.Popen[str]
    url: str

    def workers(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def ready_status(self) -> int | None:
        try:
            return httpx.get(self.url + "/ready", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def output(self) -> str:
        return self.process.stdout.read() if self.process.stdout else ""


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    """The server with two ranks (extra flags by indirect parametrization), ready."""
    flags: list[str] = getattr(request, "param", [])
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")}
    process = subprocess.Popen(
        [
            SCRIPT,
            "serve",
            "--tensor-parallel-size",
            "2",
            "--dtype",
            "float32",
            "--port",
            str(port),
            *flags,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = Served(process, f"http://127.0.0.1:{port}")
    tree: list[psutil.Process] = []
    try:

        def ready() -> bool:
            assert process.poll() is None, server.output()
            return server.ready_status() == 200

        wait_for(ready, timeout=120, what="the tensor-parallel server to become ready")
        tree = server.workers()
        assert len(tree) == 1, tree  # rank 1
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        # Whatever happened, no rank may outlive the server.
        wait_for(
            lambda: not any(p.is_running() and p.status() != "zombie" for p in tree),
            timeout=15,
            what="every tensor-parallel rank to exit with the server",
        )


def test_openai_client_gets_the_single_rank_vectors_and_sigterm_stops_both_ranks(
    served: Served,
) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    got = np.array([item.embedding for item in response.data], dtype=np.float32)
    with Engine.from_pretrained(dtype="float32") as single:
        expected = single.embed(TEXTS)
    assert (got * expected).sum(1).min() >= 0.99999
    assert response.usage.prompt_tokens > 0
    assert httpx.get(served.url + "/info").json()["tensor_parallel_size"] == 2
    # The ranks' store (and gloo's sockets) listen on loopback only: apart from the HTTP
    # port, nothing in the server's process tree can be reached from outside the pod.
    port = int(served.url.rsplit(":", 1)[1])
    listening = [
        c
        for p in [psutil.Process(served.process.pid), *served.workers()]
        for c in p.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port != port
    ]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), listening

    workers = served.workers()
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=60) == 0, served.output()
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, alive


def _expect_fatal_exit(served: Served, deadline_s: float) -> None:
    """The server must stop being ready within ``deadline_s``, never be ready again, and
    exit with status 1 within ``deadline_s`` more."""
    wait_for(
        lambda: served.ready_status() != 200,
        timeout=deadline_s,
        what="/ready to stop answering 200 after a rank failed",
    )

    def exited() -> bool:
        assert served.ready_status() != 200
        return served.process.poll() is not None

    wait_for(exited, timeout=deadline_s, what="the server to exit after a rank failed")
    output = served.output()
    assert served.process.returncode == 1, output
    assert "tensor-parallel rank" in output, output


def test_a_killed_rank_takes_the_server_down(served: Served) -> None:
    (worker,) = served.workers()
    worker.kill()
    # In-flight or new, a request gets an answer (an error), never a hang.
    try:
        status = httpx.post(served.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
        assert status.status_code >= 500
    except httpx.TransportError:
        pass  # the server already closed
    _expect_fatal_exit(served, deadline_s=15)


@pytest.mark.parametrize("served", [["--tensor-parallel-timeout", "3"]], indirect=True)
def test_a_hung_rank_takes_the_idle_server_down(served: Served) -> None:
    (worker,) = served.workers()
    worker.suspend()  # SIGSTOP: alive, but never answers the heartbeat
    try:
        # noticed by the heartbeat (after 5 s idle) + the 3 s timeout; then the exit
        _expect_fatal_exit(served, deadline_s=20)
    finally:
        if worker.is_running():
            worker.kill()

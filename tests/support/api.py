"""Helpers for the HTTP API tests: a real uvicorn server on a free loopback port.

The server runs in a background thread (its own event loop), bound to a socket we create
on 127.0.0.1 port 0 so there is no race for a port. ``start`` returns once ``/ready`` says
200, polling with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psutil
import uvicorn
from embedding_server.api import create_app
from embedding_server.api.lifecycle import Lifecycle
from embedding_server.api.server import DrainingServer
from embedding_server.engine import Engine, load_engine
from embedding_server.metrics import Metrics
from embedding_server.settings import ServerSettings

from e2e.harness.proc import free_port

MINILM_DIMS = 384


def wait_for(
    condition: Callable[[], bool],
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    what: str = "condition",
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class RunningServer:
    """A uvicorn server in a thread; ``url`` is its base URL."""

    def __init__(
        self, settings: ServerSettings, engine: Engine | None = None, **app_options: Any
    ) -> None:
        self.settings = settings
        self.app = create_app(settings, engine, connect=load_engine, **app_options)
        self.lifecycle: Lifecycle = self.app.state.lifecycle
        self.metrics: Metrics = self.app.state.metrics
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto says TCP, and without it every response waits ~40 ms for a delayed ACK.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="on",
            loop="asyncio",
            timeout_graceful_shutdown=10,
        )
        self.server = DrainingServer(config, self.lifecycle)
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self._socket]},
            daemon=True,
            name=f"uvicorn-{self.port}",
        )

    def start(self, timeout: float = 120.0) -> RunningServer:
        self._thread.start()

        def ready() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(self.url + "/ready", timeout=2).status_code == 200
            return False

        wait_for(ready, timeout=timeout, what=f"{self.url}/ready")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample, read in-process (does not count as a request)."""
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """Current value of one sample, read through GET /metrics like a scraper would."""
        return scrape(self.url, name, labels)


def post_json(server: RunningServer, path: str, body: dict[str, Any], status: int = 200) -> Any:
    """POST ``body`` to ``server``'s ``path``, check the answer's ``status`` and return its
    JSON."""
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def scrape(url: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sample(text, name, labels)


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of sample ``name{labels}`` in a Prometheus exposition; None when absent, so
    ``== 0`` tells a zero gauge from a metric that is not exported at all."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if labels is None or all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


@contextlib.contextmanager
def running_server(
    settings: ServerSettings,
    engine: Engine | None = None,
    timeout: float = 120.0,
    **app_options: Any,
) -> Iterator[RunningServer]:
    """A started :class:`RunningServer` (``app_options``: more arguments of ``create_app``)."""
    server = RunningServer(settings, engine, **app_options).start(timeout)
    try:
        yield server
    finally:
        server.stop()


def fake_settings(model: str = "fake", **overrides: Any) -> ServerSettings:
    return ServerSettings(model=model, **overrides)


SCRIPT = os.path.join(os.path.dirname(sys.executable), "embedding-server")


class ServerProcess:
    """A real ``embedding-server serve`` process (with ``--api-workers N``: its front-end
    processes too) on a free loopback port; ``url`` is its base URL."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")},
            **(env or {}),
        }
        self.process = subprocess.Popen(
            [SCRIPT, "serve", "--port", str(self.port), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.children: list[psutil.Process] = []

    def output(self) -> str:
        """Everything the server wrote (once it has exited)."""
        return self.process.stdout.read() if self.process.stdout else ""

    def start(self, timeout: float = 120.0, workers: int = 0) -> ServerProcess:
        """Wait until ``/ready`` answers 200 and ``workers`` front-end processes run."""

        def ready() -> bool:
            assert self.process.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
            self.children = frontend_processes(self.process.pid)
            return len(self.children) >= workers

        wait_for(ready, timeout=timeout, interval=0.1, what=f"{self.url}/ready")
        return self

    def wait_gone(self, timeout: float = 60.0) -> int:
        """Wait for the server and every front-end process to exit; the server's status."""
        code = self.process.wait(timeout=timeout)
        wait_for(
            lambda: not any(alive(child) for child in self.children),
            timeout=timeout,
            what="every front-end process to exit",
        )
        return code

    def stop(self) -> None:
        """SIGTERM (the server cleans up after itself), SIGKILL whatever is left after 30 s."""
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        for process in [self.process, *self.children]:
            with contextlib.suppress(psutil.Error, OSError):
                process.kill()
        self.process.wait(timeout=30)


def frontend_processes(pid: int) -> list[psutil.Process]:
    """The server's front-end processes (multiprocessing's resource tracker is not one)."""
    found = []
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):  # gone, or a zombie not yet reaped
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
    return found


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def server_process(
    args: list[str],
    *,
    workers: int = 0,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> Iterator[ServerProcess]:
    """A started :class:`ServerProcess`, stopped with its front-ends at the end."""
    server = ServerProcess(args, env)
    try:
        yield server.start(timeout, workers)
    finally:
        server.stop()

"""An ``--api-workers`` front-end process: the HTTP API, its jobs run by the engine process.

Started by :mod:`.workers` (``multiprocessing`` spawn), so this module is what a front-end
imports first. It and everything it imports stay free of the model runtime: a front-end never
loads torch (seconds of start-up and hundreds of MB of private memory per process: see
docs/performance-log.md, "torch in every process"), and ``tests/server/api/test_workers.py``
checks that on live processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import time

from embedding_server.api.app import create_app
from embedding_server.api.server import run_http
from embedding_server.ipc.client import AttachedEngine
from embedding_server.logging import configure_logging
from embedding_server.metrics import Metrics
from embedding_server.request.serving import ServingEngine
from embedding_server.settings import ServerSettings

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 0.5
"""How often a front-end checks that the engine process, its parent, is still there."""

ORPHAN_GRACE_S = 10.0
"""How long a front-end whose engine process is gone gives its own orderly exit before it
ends itself: losing the engine connection already failed every waiting request with 503
``engine_failed`` and asked the server to stop, and on a loaded machine writing those answers
took longer than one :data:`PARENT_CHECK_S` (the client saw a dropped connection instead)."""


def engine_address(shared_dir: str) -> str:
    """The engine process's socket in ``shared_dir``."""
    return os.path.join(shared_dir, "engine.sock")


def run_frontend(
    settings: ServerSettings,
    listener: socket.socket,
    shared_dir: str,
    parent: int,
    *,
    wait_for_engine: bool = False,
    probe_listener: socket.socket | None = None,
) -> None:
    """A front-end process: the HTTP API on the shared socket, its jobs run by the engine.

    ``wait_for_engine``: accept no connection before the engine has handed this front-end
    the model (one started in place of a front-end that died, while the others serve: a
    client it accepted earlier would be told the server is not ready). ``probe_listener``:
    the shared probe port's socket (``--probe-port``), served beside the client port."""
    configure_logging(settings.log_level, settings.log_format)
    # Out of the engine's process group: a terminal's Ctrl-C reaches the engine process only,
    # which sends one SIGTERM (a second signal would make uvicorn skip the drain).
    os.setpgid(0, 0)
    threading.Thread(target=_exit_with_parent, args=(parent, shared_dir), daemon=True).start()

    async def connect(settings: ServerSettings, metrics: Metrics) -> ServingEngine:
        return await AttachedEngine.connect(settings, engine_address(shared_dir), metrics=metrics)

    app = create_app(settings, connect=connect, accept_when_ready=wait_for_engine)
    probes = [probe_listener] if probe_listener is not None else None
    code = run_http(settings, app, sockets=[listener], probe_sockets=probes)
    _clean_up_after(parent, shared_dir)
    raise SystemExit(code)


def _clean_up_after(parent: int, shared_dir: str) -> None:
    """An engine process that was killed left its directory (socket, metrics) behind."""
    if os.getppid() != parent:
        shutil.rmtree(shared_dir, ignore_errors=True)


def _exit_with_parent(parent: int, shared_dir: str) -> None:
    """End this front-end if the engine process is gone without telling it (killed)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    logger.error("the engine process (pid %d) is gone; exiting", parent)
    # The orderly exit (run_frontend's return) usually wins: it answers what is in flight.
    time.sleep(ORPHAN_GRACE_S)
    logger.error("the front-end did not stop within %gs of its engine; ending it", ORPHAN_GRACE_S)
    _clean_up_after(parent, shared_dir)
    with contextlib.suppress(Exception):
        logging.shutdown()
    os._exit(1)

"""``--api-workers N``: N HTTP front-end processes around one engine process.

The process ``embedding-server serve`` started (PID 1 in a container) becomes the engine
process: it binds the HTTP port, binds the engine socket
(:class:`~.ipc.service.EngineService`), starts N front-ends (``multiprocessing`` spawn,
handed the listening socket as uvicorn's own workers are), then loads the model. Each
front-end (:mod:`.api.frontend`) serves the whole HTTP API through an
:class:`~.ipc.client.AttachedEngine`: it answers ``/health`` at once and
``/ready`` once the engine has handed it the model's configuration.

Lifecycle, all waits bounded:

* SIGTERM/SIGINT to the engine process: it sends SIGTERM to every front-end, which drops
  readiness and finishes its in-flight requests (the engine keeps serving them); once they
  have exited the engine drains its queue and exits 0 (1 if a front-end failed to drain);
* a front-end that exits on its own (a crash, ``kill -9``): the requests it held fail with
  its connections, the engine withdraws what it still had queued (its socket closed), and the
  engine process starts another in its place after a backoff (:data:`RESTART_BACKOFF_S`,
  doubling with each recent restart) while the others go on serving. A replacement started
  once the engine serves accepts no connection before the engine has welcomed it, so no
  client meets a front-end that is not ready. Restarts are bounded: one more death after
  :data:`RESTART_LIMIT` within :data:`RESTART_WINDOW_S` ends the server (exit 1), so that
  something a restart in place does not fix reaches Kubernetes, which restarts the pod;
* an engine that fails (a device error, a tensor-parallel rank lost, a model that does not
  load): every process stops, exit 1;
* the engine process killed outright: each front-end sees its engine socket disconnect, fails
  its waiting requests with 503, drops readiness and exits 1; a front-end also exits when its
  parent is gone, so none is left orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import multiprocess

from embedding_server.api.frontend import engine_address, run_frontend
from embedding_server.api.lifecycle import freeze_heap
from embedding_server.api.server import FATAL_EXIT_GRACE_S, best_available, listen
from embedding_server.engine import Engine
from embedding_server.ipc.service import EngineService
from embedding_server.logging import configure_logging
from embedding_server.metrics import Metrics
from embedding_server.settings import ServerSettings
from embedding_server.termination import report_model_load_failure

logger = logging.getLogger(__name__)

Finish = Callable[[int, str], None]
"""Ends the engine process's serving: exit status, and why."""

RESTART_LIMIT = 5
"""Front-end restarts allowed within :data:`RESTART_WINDOW_S`; the next death ends the
server with status 1."""
RESTART_WINDOW_S = 300.0
"""The window :data:`RESTART_LIMIT` counts restarts in."""
RESTART_BACKOFF_S = (0.25, 8.0)
"""The delay before a restart: the first, doubled for each restart within the window, and its
cap. A front-end that died for a passing reason is back at once; one that keeps dying is
started less and less often until the limit ends the server."""


def serve_workers(settings: ServerSettings, shared_dir: str) -> int:
    """Run the engine process and its front-ends until a signal; the exit status.
    ``shared_dir`` holds the engine socket (and the metrics directory)."""
    configure_logging(settings.log_level, settings.log_format)
    listeners = Listeners()
    for port, what in ((settings.port, ""), (settings.probe_port, " (--probe-port)")):
        if port is None:
            continue
        try:
            listeners.sockets.append(listen(settings.host, port))
        except OSError as error:
            logger.error("cannot listen on %s:%d%s: %s", settings.host, port, what, error)
            listeners.close()
            return 1
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if best_available("uvloop", "asyncio") == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with contextlib.closing(listeners), asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_engine_process(settings, listeners, shared_dir))


class Listeners:
    """The sockets the engine process binds for its front-ends: the client port's, then the
    probe port's (``--probe-port``) when there is one."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []

    @property
    def client(self) -> socket.socket:
        return self.sockets[0]

    @property
    def probe(self) -> socket.socket | None:
        return self.sockets[1] if len(self.sockets) > 1 else None

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


async def _engine_process(settings: ServerSettings, listeners: Listeners, shared_dir: str) -> int:
    loop = asyncio.get_running_loop()
    address = engine_address(shared_dir)
    metrics = Metrics()
    service = EngineService(address)
    stopping: asyncio.Future[tuple[int, str]] = loop.create_future()

    def finish(code: int, why: str) -> None:
        if not stopping.done():
            stopping.set_result((code, why))

    frontends = FrontEnds(settings, listeners, shared_dir, finish)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, finish, 0, signal.Signals(sig).name)
    frontends.start()
    logger.info("started %d API worker processes", settings.api_workers)

    engine: Engine | None = None
    serving: asyncio.Task[None] | None = None
    try:
        loading = _in_thread(lambda: Engine.from_settings(settings, metrics=metrics))
        first: list[asyncio.Future[Any]] = [loading, stopping]
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            engine = _loaded(settings, loading, finish)
        if engine is not None:
            serving = await _start(settings, engine, service, settings.api_workers, finish)
            frontends.serving = serving is not None
        code, why = await stopping
    finally:
        frontends.stopping()
    logger.info("stopping (%s): API workers drain first, then the engine", why)
    if code:
        # A failed engine may hang in its forward thread (a tensor-parallel collective);
        # the process still ends, bounded.
        grace = settings.shutdown_timeout + 2 * FATAL_EXIT_GRACE_S
        timer = threading.Timer(grace, os._exit, args=(code,))
        timer.daemon = True
        timer.start()
    failed = await frontends.stop(settings.shutdown_timeout + FATAL_EXIT_GRACE_S)
    if engine is not None:
        await engine.stop(drain=True, timeout=settings.shutdown_timeout)
    if serving is not None:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    service.close()
    return code or int(failed)


async def _start(
    settings: ServerSettings,
    engine: Engine,
    service: EngineService,
    front_ends: int,
    finish: Finish,
) -> asyncio.Task[None] | None:
    """Warm the engine up and serve the front-ends; None (and ``finish(1)``) if it fails."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    engine.on_failure(lambda message: _call_soon(loop, finish, message))
    try:
        await engine.start()
    except Exception as error:  # a failed warm-up ends the server, exit 1
        logger.debug("warm-up failed", exc_info=True)
        detail = f"{type(error).__name__}: {error}"
        report_model_load_failure()
        finish(1, f"the model failed its warm-up: {detail}")
        return None
    # The engine process holds the model's objects: without this, full collections of them
    # stall its event loop, the scheduler's, under load.
    freeze_heap()
    serving = asyncio.create_task(service.serve(engine.scheduler, engine.handoff(), front_ends))

    def ended(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("serving the API workers failed", exc_info=task.exception())
            finish(1, f"serving the API workers failed: {task.exception()!r}")

    serving.add_done_callback(ended)
    logger.info(
        "engine ready for %d API workers (%.1f s to warm up)",
        front_ends,
        time.monotonic() - started,
    )
    return serving


def _in_thread(load: Callable[[], Engine]) -> asyncio.Future[Engine]:
    """The model load on a daemon thread: a stop signal during a long load need not wait
    for it to end."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Engine] = loop.create_future()

    def work() -> None:
        try:
            result = load()
        except Exception as error:  # noqa: BLE001 - handed to the loop, which reports it
            loop.call_soon_threadsafe(_settle, future, None, error)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=work, name="load-model", daemon=True).start()
    return future


def _settle(
    future: asyncio.Future[Engine], result: Engine | None, error: BaseException | None
) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)


def _loaded(
    settings: ServerSettings, loading: asyncio.Future[Engine], finish: Finish
) -> Engine | None:
    error = loading.exception()
    if error is None:
        return loading.result()
    logger.debug("model load failed", exc_info=error)
    detail = f"{type(error).__name__}: {error}"
    report_model_load_failure()
    finish(1, f"could not load the model named by --model: {detail}")
    return None


def _call_soon(loop: asyncio.AbstractEventLoop, finish: Finish, message: str) -> None:
    """``finish(1, message)`` on the loop, from the forward or a watchdog thread."""
    loop.call_soon_threadsafe(finish, 1, message)


class FrontEnds:
    """The front-end processes: started, watched, restarted in place when one dies (bounded,
    with backoff: see the module docstring), and stopped."""

    def __init__(
        self, settings: ServerSettings, listeners: Listeners, shared_dir: str, finish: Finish
    ) -> None:
        self._settings, self._listener, self._shared_dir = settings, listeners, shared_dir
        self._finish = finish
        self._context = multiprocessing.get_context("spawn")
        self._running: dict[int, BaseProcess] = {}
        """Slot -> its front-end; a slot whose front-end died is empty until its restart."""
        self._restarts: deque[float] = deque()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._stopping = False
        self.serving = False
        """The engine serves the front-ends: a replacement waits for it before accepting."""

    def start(self) -> None:
        for slot in range(self._settings.api_workers):
            self._spawn(slot)

    def _spawn(self, slot: int) -> None:
        process = self._context.Process(
            target=run_frontend,
            args=(self._settings, self._listener.client, self._shared_dir, os.getpid()),
            kwargs={"wait_for_engine": self.serving, "probe_listener": self._listener.probe},
            name=f"api-worker-{slot}",
            daemon=True,
        )
        process.start()
        self._running[slot] = process
        asyncio.get_running_loop().add_reader(process.sentinel, self._exited, slot, process)

    def _exited(self, slot: int, process: BaseProcess) -> None:
        """A front-end ended while the server was serving: restart it, or past the limit
        stop everything (exit 1)."""
        asyncio.get_running_loop().remove_reader(process.sentinel)
        process.join(0)
        self._running.pop(slot, None)
        if process.pid is not None:
            # Its live gauges (in-flight requests) leave /metrics; its counters stay.
            multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]
        if self._stopping:
            return
        message = f"{process.name} (pid {process.pid}) exited with status {process.exitcode}"
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= RESTART_LIMIT:
            message += (
                f" after {len(self._restarts)} restarts within {RESTART_WINDOW_S:.0f} s (the limit)"
            )
            logger.error("cannot serve: %s", message)
            self._finish(1, message)
            return
        first, cap = RESTART_BACKOFF_S
        delay = min(cap, first * 2 ** len(self._restarts))
        self._restarts.append(now)
        logger.error(
            "%s; restarting it in %.2f s (restart %d of at most %d within %.0f s)",
            message,
            delay,
            len(self._restarts),
            RESTART_LIMIT,
            RESTART_WINDOW_S,
        )
        self._timers[slot] = asyncio.get_running_loop().call_later(delay, self._restart, slot)

    def _restart(self, slot: int) -> None:
        self._timers.pop(slot, None)
        if not self._stopping:
            self._spawn(slot)

    def stopping(self) -> None:
        """No more restarts, and no more watching: the server is stopping."""
        self._stopping = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        loop = asyncio.get_running_loop()
        for process in self._running.values():
            loop.remove_reader(process.sentinel)

    async def stop(self, timeout: float) -> bool:
        """SIGTERM every front-end and wait for them to drain and exit (killed after
        ``timeout``); whether any of them failed."""
        self.stopping()
        return await _stop_frontends(list(self._running.values()), timeout)


async def _stop_frontends(frontends: list[BaseProcess], timeout: float) -> bool:
    """SIGTERM every front-end and wait for them to drain and exit (killed after
    ``timeout``); whether any of them failed."""
    for process in frontends:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + timeout
    for process in frontends:
        await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            logger.error("%s did not stop within %.0f s; killing it", process.name, timeout)
            process.kill()
            await asyncio.to_thread(process.join, 5.0)
        if process.pid is not None:
            multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]
    # Killed by our own SIGTERM before it could set up its handlers (still starting): it had
    # no requests, so that is a clean stop too.
    failed = [p for p in frontends if p.exitcode not in (0, -signal.SIGTERM)]
    for process in failed:
        logger.error("%s exited with status %s", process.name, process.exitcode)
    return bool(failed)

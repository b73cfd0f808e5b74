"""Child processes of the e2e control plane: start, probe, stop, and never leave strays.

Also the helpers every runner of local servers needs (the e2e tier, the unit tests that start
``embedding-server serve``, the benchmarks): ``free_port()`` / ``free_ports()``, and
``child_process()`` / ``stop_child()`` for a plain ``subprocess.Popen`` that must not outlive
its block; and ``run_command()``, the harness's one way to run a command to completion
(node.py's host commands, the image tooling's, openssl, kubectl and helm), with a deadline
and an error that names it.

Every component runs in its own session (``start_new_session``), so its process group id is
its pid and ``killpg`` reaches anything it forks. Stopping is SIGTERM to the group, a bounded
wait, then SIGKILL. Attached processes (pytest) also get ``PR_SET_PDEATHSIG=SIGKILL`` so a
killed test runner cannot orphan them. Detached processes (``python -m e2e.harness.cluster up``)
are recorded as (pid, start time) pairs, so ``down`` never signals a recycled pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("e2e.cluster")

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0


class ClusterError(RuntimeError):
    """The control plane failed to start, became unhealthy, or a command against it failed."""


def poll_until(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.2,
    max_interval: float = 2.0,
) -> T:
    """Call ``probe`` until it returns something other than None/False; raise at the deadline.

    ``probe`` may raise ``ClusterError`` to abort early (e.g. the process died). Other
    exceptions propagate too: a probe should return None for "not yet".
    """
    deadline = time.monotonic() + timeout
    delay = interval
    while True:
        result = probe()
        if result is not None and result is not False:
            return result
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(min(delay, remaining))
        delay = min(delay * 1.5, max_interval)


def run_command(
    argv: Sequence[str],
    *,
    timeout: float,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    input: str | None = None,
    what: str | None = None,
    error: type[Exception] = ClusterError,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to completion, ``input`` on its stdin and its output captured as text.

    ``error`` (``ClusterError`` unless the caller has its own) is raised, naming ``what``
    (default: the command line), when the command cannot be started, outlives ``timeout``
    seconds, or, with ``check``, exits non-zero; then with the tail of its output."""
    label = what or f"`{' '.join(argv)}`"
    try:
        proc = subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise error(f"{label} timed out after {timeout:.0f}s") from exc
    except FileNotFoundError as exc:
        raise error(f"{label}: {argv[0]} not found") from exc
    except OSError as exc:
        raise error(f"{label} failed: {exc}") from exc
    if check and proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()[-4000:]
        raise error(f"{label} failed (rc={proc.returncode}):\n{output}")
    return proc


# Ports handed out by this process: a later call never repeats one, even after its holder exits.
_GIVEN: set[int] = set()
# Below the kernel's ephemeral range (32768 and up unless tuned) nothing is ever given out by
# connect() or bind(0). CI caught the kernel's own pick (bind to port 0, close, return) being
# taken in the gap by an outgoing connection's source port on a busy node, and the operator
# exited with EADDRINUSE. Ports here are taken only by an explicit bind. The window also stays
# clear of the well-known component ports (8080-10259) and Kubernetes' NodePorts (30000+).
_LOWEST = 20000
_HIGHEST = 30000


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that nothing is bound to now, on any address.

    Drawn at random below the kernel's ephemeral range, so no outgoing connection can take
    one before the caller binds it; only another explicit bind could. Each is checked free on
    the wildcard address, which fails if any socket holds the port on any address (``host``
    is only where the kernel picks, should a tuned range leave no room below it)."""
    ceiling = min(_ephemeral_floor(), _HIGHEST)
    if ceiling - _LOWEST < 1000:  # a tuned range that leaves no room: the kernel's own picks
        return [_kernel_pick(host) for _ in range(count)]
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(count * 200):
        if len(ports) == count:
            break
        port = rng.randrange(_LOWEST, ceiling)
        if port in _GIVEN or port in ports:
            continue
        if _bindable(port):
            ports.append(port)
    if len(ports) < count:
        raise RuntimeError(f"no {count} free ports in [{_LOWEST}, {ceiling}) after many tries")
    _GIVEN.update(ports)
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port nothing is bound to now: ``free_ports(1, host)[0]``."""
    return free_ports(1, host)[0]


def _bindable(port: int) -> bool:
    """Nothing holds ``port`` on any address (a bind on the wildcard address fails if so)."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def _kernel_pick(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def stop_child(
    popen: subprocess.Popen[Any], *, grace: float = STOP_GRACE_S, name: str | None = None
) -> int:
    """SIGTERM, then SIGKILL if it outlives ``grace`` seconds; always reaps. The exit status."""
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %.0fs; killing it", name or popen.pid, grace)
            popen.kill()
    return popen.wait()


@contextlib.contextmanager
def child_process(
    argv: Sequence[str], *, grace: float = STOP_GRACE_S, **popen_kwargs: Any
) -> Iterator[subprocess.Popen[Any]]:
    """``subprocess.Popen(argv, **popen_kwargs)`` for the duration of the block, stopped with
    ``stop_child`` however the block ends."""
    popen: subprocess.Popen[Any] = subprocess.Popen(list(argv), **popen_kwargs)
    try:
        yield popen
    finally:
        stop_child(popen, grace=grace)


def _set_pdeathsig() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _start_time(pid: int) -> int | None:
    """Clock ticks since boot at which ``pid`` started (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after it are space separated.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited; only its exit status is left to reap
        return None
    return int(fields[19])


@dataclass
class Process:
    """One running component."""

    name: str
    pid: int
    start_time: int | None
    log_path: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @classmethod
    def spawn(
        cls,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        detached: bool,
        env: Mapping[str, str] | None = None,
    ) -> Process:
        log.info("[cluster] starting %s (log: %s)", name, log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log_file:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if detached else _set_pdeathsig,
                env=dict(env) if env is not None else None,
                close_fds=True,
            )
        return cls(name, popen.pid, _start_time(popen.pid), log_path, popen)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": self.pid,
            "start_time": self.start_time,
            "log_path": str(self.log_path),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Process:
        return cls(data["name"], int(data["pid"]), data["start_time"], Path(data["log_path"]))

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        # Not our child (started by an earlier `cluster up`): compare start times so a
        # recycled pid is never mistaken for the component.
        started = _start_time(self.pid)
        return started is not None and started == self.start_time

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def ensure_running(self) -> None:
        if not self.alive():
            code = self.popen.returncode if self.popen is not None else "?"
            raise ClusterError(
                f"{self.name} exited (code {code}); last lines of {self.log_path}:\n"
                f"{self.log_tail()}"
            )

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except OSError as exc:
            if exc.errno not in (errno.ESRCH, errno.EPERM):
                raise

    def _wait_exit(self, timeout: float) -> bool:
        if self.popen is not None:
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        try:
            poll_until(
                lambda: not self.alive(),
                timeout=timeout,
                what=f"{self.name} to exit",
                interval=0.05,
                max_interval=0.5,
            )
        except TimeoutError:
            return False
        return True

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the process group, then SIGKILL it if it outlives ``grace`` seconds."""
        if self.popen is None and not self.alive():
            return  # gone, or the pid now belongs to someone else: do not signal it
        if self.alive():
            self._signal_group(signal.SIGTERM)
            if self._wait_exit(grace):
                log.info("[cluster] stopped %s", self.name)
            else:
                log.warning("[cluster] %s ignored SIGTERM for %.0fs; killing it", self.name, grace)
        # SIGKILL the group regardless: it reaches any child the leader left behind.
        self._signal_group(signal.SIGKILL)
        if not self._wait_exit(grace):
            raise ClusterError(f"{self.name} (pid {self.pid}) survived SIGKILL")

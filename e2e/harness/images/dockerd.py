"""A private dockerd for the image builds, so the system's dockerd (if any) is never touched.

It has its own data root under the cache dir (layers survive between runs), its own exec root,
pidfile and socket; no iptables, no bridge (builds use the host network). It runs for the
duration of a ``with private_dockerd()`` block and is stopped afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from e2e.harness.binaries import cache_root
from e2e.harness.images.host import SHORT_TIMEOUT_S, first_executable, run
from e2e.harness.images.refs import ImageError
from e2e.harness.mounts import unmount_under
from e2e.harness.proc import stop_child

log = logging.getLogger("e2e.images")

# docker.io's client: /usr/local/bin/docker on some machines is a newer client without the
# classic BuildKit builder, so prefer the one that matches the dockerd we start.
DOCKER_CANDIDATES = ("/usr/bin/docker",)
DOCKERD_CANDIDATES = ("/usr/sbin/dockerd", "/usr/bin/dockerd")

DOCKERD_READY_TIMEOUT_S = 180.0
DOCKERD_PROBE_TIMEOUT_S = 15.0
DOCKERD_STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class Docker:
    """A client bound to one dockerd socket."""

    binary: str
    socket: Path

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["DOCKER_HOST"] = f"unix://{self.socket}"
        env["DOCKER_BUILDKIT"] = "1"
        env.pop("DOCKER_CONTEXT", None)
        return env

    def argv(self, *args: str) -> list[str]:
        return [self.binary, *args]

    def run(
        self, *args: str, timeout: float = SHORT_TIMEOUT_S, what: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return run(self.argv(*args), timeout, env=self.env, what=what or f"docker {args[0]}")

    def image_id(self, ref: str) -> str | None:
        proc = subprocess.run(
            self.argv("image", "inspect", "--format", "{{.Id}}", ref),
            capture_output=True,
            text=True,
            env=self.env,
            timeout=SHORT_TIMEOUT_S,
            check=False,
        )
        return proc.stdout.strip() if proc.returncode == 0 else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _server_version(docker: Docker) -> str | None:
    """The daemon's version, or None while it does not answer yet.

    dockerd opens its socket before it has loaded its data root, and a request sent then waits
    until it has: on a loaded CI machine with a warm data root that took over 10 s, so a probe
    that times out means "not yet", like one that fails, until the readiness deadline."""
    try:
        probe = subprocess.run(
            docker.argv("version", "--format", "{{.Server.Version}}"),
            capture_output=True,
            text=True,
            env=docker.env,
            timeout=DOCKERD_PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        log.info("[images] dockerd has not answered within %.0fs yet", DOCKERD_PROBE_TIMEOUT_S)
        return None
    return probe.stdout.strip() if probe.returncode == 0 else None


@contextlib.contextmanager
def private_dockerd(cache: Path | None = None) -> Iterator[Docker]:
    """A dockerd of our own for the duration of the block, its state kept under the cache."""
    cache = cache or cache_root()
    client = first_executable(DOCKER_CANDIDATES, "docker")
    daemon = first_executable(DOCKERD_CANDIDATES, "dockerd")
    data_root = cache / "docker"
    exec_root = cache / "docker-exec"
    socket = cache / "docker.sock"
    pidfile = cache / "docker.pid"
    for directory in (data_root, exec_root):
        directory.mkdir(parents=True, exist_ok=True)
    if pidfile.exists():
        try:
            stale = int(pidfile.read_text().strip() or 0)
        except ValueError:
            stale = 0
        if stale and _pid_alive(stale):
            raise ImageError(
                f"a dockerd (pid {stale}) already runs on {data_root}; stop it first (kill {stale})"
            )
        pidfile.unlink()
    socket.unlink(missing_ok=True)
    log_path = cache / "dockerd.log"
    argv = [
        daemon,
        f"--data-root={data_root}",
        f"--exec-root={exec_root}",
        f"--pidfile={pidfile}",
        f"--host=unix://{socket}",
        "--storage-driver=overlay2",
        "--iptables=false",
        "--ip-masq=false",
        # Leave the host's net.ipv4.ip_forward alone (dockerd turns it on by default).
        "--ip-forward=false",
        "--bridge=none",
    ]
    log.info("[images] starting a private dockerd on %s", socket)
    started = time.monotonic()
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    docker = Docker(client, socket)
    try:
        deadline = started + DOCKERD_READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise ImageError(f"dockerd exited with {proc.returncode}:\n{tail}")
            if socket.exists():
                version = _server_version(docker)
                if version is not None:
                    log.info(
                        "[images] dockerd %s ready in %.1fs", version, time.monotonic() - started
                    )
                    break
            if time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise ImageError(f"dockerd not ready after {DOCKERD_READY_TIMEOUT_S:.0f}s:\n{tail}")
            time.sleep(0.2)
        yield docker
    finally:
        stop_child(proc, grace=DOCKERD_STOP_GRACE_S, name="dockerd")
        unmount_under(exec_root)
        log.info("[images] private dockerd stopped")

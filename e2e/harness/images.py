"""Build the project's container images on a machine that reaches no container registry.

Why: the real-node e2e tier runs pods from our own server and operator images, and CI machines
reach only package registries (PyPI, a Debian mirror). So every byte comes from those:

* base: ``debootstrap --variant=minbase bookworm`` from the mirror the machine's apt already
  uses, imported as ``embedding-operator.local/debian:bookworm``; the rootfs tarball is cached,
  so warm runs skip debootstrap.
* pause: the kubelet's sandbox image, a static C program (images/pause/pause.c) FROM scratch,
  tagged ``registry.k8s.io/pause:3.10``.
* server (CPU variant) and operator: images/*.Dockerfile with ``BASE_IMAGE`` set to the local
  base. pip inside ``docker build`` cannot reach PyPI here (TLS interception), so the wheels the
  lock files pin (images/*.lock) are downloaded on the host into the cache and bind-mounted into
  the build together with our own wheel (``pip wheel --no-deps .``).

Builds run on a private dockerd (own data root under the cache dir, so layers survive between
runs; own exec root, pidfile and socket; no iptables, no bridge; builds use the host network),
started for the build and stopped afterwards. The system dockerd, if any, is never touched.

``load`` imports the images into a containerd's ``k8s.io`` namespace (``docker save | ctr
images import``) and remembers which docker image IDs it imported into which containerd, so a
warm load of unchanged images costs one ``ctr images ls``.

Cache layout (``cache_root()`` as in binaries: ``~/.cache/embedding-operator``, honours
``XDG_CACHE_HOME``; ``EMBEDDING_OPERATOR_CACHE`` overrides the root)::

    docker/ docker-exec/ docker.sock docker.pid dockerd.log   the private dockerd
    wheels/                                                   host-downloaded wheels
    images/debian-bookworm-minbase.tar(.json)                 the cached base rootfs
    images/context-{server,operator,pause}/                   build contexts
    images/loaded-<socket hash>.json                          what `load` imported where

CLI::

    python -m e2e.harness.images build [--skip-server]
    python -m e2e.harness.images load (--containerd-socket SOCK | --cluster-state STATE_JSON)
    python -m e2e.harness.images lock      # rewrite images/*.lock from the project venv

(``STATE_JSON``: a running cluster's ``.cluster/state.json``.)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from e2e.harness.binaries import cache_root, locked
from e2e.harness.host_packages import IMAGE_PACKAGES, HostPackageError, ensure_packages

log = logging.getLogger("e2e.images")

ROOT = Path(__file__).resolve().parents[2]
IMAGES_DIR = ROOT / "images"
CHART_DIR = ROOT / "charts" / "embedding-operator"
SERVER_DOCKERFILE = IMAGES_DIR / "server.Dockerfile"
OPERATOR_DOCKERFILE = IMAGES_DIR / "operator.Dockerfile"
CLIENT_DOCKERFILE = IMAGES_DIR / "e2e-client.Dockerfile"
PAUSE_DOCKERFILE = IMAGES_DIR / "pause.Dockerfile"
PAUSE_SOURCE = IMAGES_DIR / "pause" / "pause.c"
LOCKS = {
    "server": IMAGES_DIR / "server.lock",
    "operator": IMAGES_DIR / "operator.lock",
    "e2e-client": IMAGES_DIR / "e2e-client.lock",
}
CLIENT_IMAGE_REPOSITORY = "embedding-operator.local/e2e-client"

BASE_IMAGE = "embedding-operator.local/debian:bookworm"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
SUITE = "bookworm"
# Bump when ensure_rootfs_tarball changes what goes into the tarball: cached ones are redone.
ROOTFS_RECIPE = 2
# The CPython the base's python3 is (bookworm: 3.11); host-downloaded wheels must match it.
IMAGE_PYTHON = (3, 11)
# What the Dockerfiles bind-mount from their context (their .dockerignore allows exactly these).
CONTEXT_ENTRIES = ("requirements.lock", "wheels", "dist")
CONTAINERD_NAMESPACE = "k8s.io"

# docker.io's client: /usr/local/bin/docker on some machines is a newer client without the
# classic BuildKit builder, so prefer the one that matches the dockerd we start.
DOCKER_CANDIDATES = ("/usr/bin/docker",)
DOCKERD_CANDIDATES = ("/usr/sbin/dockerd", "/usr/bin/dockerd")

DOCKERD_READY_TIMEOUT_S = 60.0
DOCKERD_STOP_GRACE_S = 20.0
DEBOOTSTRAP_TIMEOUT_S = 20 * 60
IMPORT_TIMEOUT_S = 5 * 60
BUILD_TIMEOUT_S = 45 * 60
PIP_TIMEOUT_S = 30 * 60
LOAD_TIMEOUT_S = 20 * 60
SHORT_TIMEOUT_S = 60.0
# The build cache our dockerd keeps after a build: the server's installed dependencies (6 GB)
# and its wheel context (3 GB) are what make the next build take seconds; older generations of
# them, left by each lock change, go.
BUILD_CACHE_KEEP = "10GB"
# Beyond what a load needs for the images themselves (their layers as content blobs, and the
# same again unpacked as snapshots).
LOAD_HEADROOM_BYTES = 2 << 30
WHEEL_EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can carry


class ImageError(RuntimeError):
    """An image could not be built or loaded; callers must fail, never skip."""


class ImportFailed(ImageError):
    """`ctr images import` itself failed on a stream `docker save` wrote whole: the store
    refused it. Seen once in CI on a store kept in the cache: "failed to prepare extraction
    snapshot ...: parent snapshot ... does not exist" (containerd's database and the
    snapshotter's disagreed about a layer the new image shares with an older one)."""


@dataclass(frozen=True)
class ImageSet:
    """The image references a node needs, as `docker build -t` tagged them."""

    base: str
    pause: str
    server: str
    operator: str
    # The e2e tier's client pods: the server image plus the official `openai` package.
    client: str
    # Seconds per step of the build that produced this set, and image sizes in bytes (for
    # the log and the CLI).
    timings: Mapping[str, float] = field(default_factory=dict, compare=False)
    sizes: Mapping[str, int] = field(default_factory=dict, compare=False)

    def for_node(self) -> tuple[str, ...]:
        """What a node's containerd needs: the sandbox image and the two workloads."""
        return (self.pause, self.server, self.operator, self.client)


# -- small helpers ---------------------------------------------------------------------------


def _run(
    argv: Sequence[str],
    timeout: float,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    what: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run to completion; ImageError with the output's tail on failure or timeout."""
    label = what or " ".join(argv[:3])
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"{label} timed out after {timeout:.0f}s") from exc
    except FileNotFoundError as exc:
        raise ImageError(f"{label}: {argv[0]} not found") from exc
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-4000:]
        raise ImageError(f"{label} failed (rc={proc.returncode}):\n{output}")
    return proc


def _first_executable(candidates: Sequence[str], name: str) -> str:
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found is None:
        raise ImageError(f"{name} not found (tried {', '.join(candidates)} and PATH)")
    return found


@contextlib.contextmanager
def _timed(timings: dict[str, float], step: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    timings[step] = round(time.monotonic() - started, 1)
    log.info("[images] %s: %.1fs", step, timings[step])


def images_cache() -> Path:
    return cache_root() / "images"


def image_refs() -> ImageSet:
    """Repositories from the chart's values.yaml, tags defaulting to its appVersion."""
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text(encoding="utf-8"))
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))
    app_version = str(chart["appVersion"])
    operator_tag = values["image"].get("tag") or app_version
    server_tag = values["serverImage"].get("tag") or app_version
    return ImageSet(
        base=BASE_IMAGE,
        pause=PAUSE_IMAGE,
        server=f"{values['serverImage']['repository']}:{server_tag}",
        operator=f"{values['image']['repository']}:{operator_tag}",
        client=f"{CLIENT_IMAGE_REPOSITORY}:{server_tag}",
    )


# -- the private dockerd ---------------------------------------------------------------------


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
        return _run(self.argv(*args), timeout, env=self.env, what=what or f"docker {args[0]}")

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


def _stop_process(proc: subprocess.Popen[bytes], name: str) -> None:
    """SIGTERM, then SIGKILL after the grace period; always reaps."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=DOCKERD_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        log.warning("[images] %s ignored SIGTERM for %.0fs; killing it", name, DOCKERD_STOP_GRACE_S)
        proc.kill()
        proc.wait(timeout=SHORT_TIMEOUT_S)


def _unmount_under(root: Path) -> None:
    """Lazily unmount whatever is still mounted under `root` (deepest first)."""
    try:
        mounts = Path("/proc/self/mounts").read_text(encoding="utf-8").splitlines()
    except OSError:
        return
    prefix = str(root.resolve())
    targets = []
    for line in mounts:
        parts = line.split()
        if len(parts) > 1:
            target = parts[1].replace("\\040", " ")
            if target == prefix or target.startswith(prefix + "/"):
                targets.append(target)
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, timeout=30, check=False)


@contextlib.contextmanager
def private_dockerd(cache: Path | None = None) -> Iterator[Docker]:
    """A dockerd of our own for the duration of the block, its state kept under the cache."""
    cache = cache or cache_root()
    client = _first_executable(DOCKER_CANDIDATES, "docker")
    daemon = _first_executable(DOCKERD_CANDIDATES, "dockerd")
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
                probe = subprocess.run(
                    docker.argv("version", "--format", "{{.Server.Version}}"),
                    capture_output=True,
                    text=True,
                    env=docker.env,
                    timeout=10,
                    check=False,
                )
                if probe.returncode == 0:
                    log.info(
                        "[images] dockerd %s ready in %.1fs",
                        probe.stdout.strip(),
                        time.monotonic() - started,
                    )
                    break
            if time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise ImageError(f"dockerd not ready after {DOCKERD_READY_TIMEOUT_S:.0f}s:\n{tail}")
            time.sleep(0.2)
        yield docker
    finally:
        _stop_process(proc, "dockerd")
        _unmount_under(exec_root)
        log.info("[images] private dockerd stopped")


# -- wheels and build contexts ---------------------------------------------------------------


def read_lock(path: Path) -> dict[str, str]:
    """canonical name -> pinned version of a `name==version` requirements file."""
    pins: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==":
            raise ImageError(f"{path}:{lineno}: pin with ==, got {raw!r}")
        pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def _wheel_index(directory: Path) -> dict[tuple[str, str], Path]:
    index: dict[tuple[str, str], Path] = {}
    for wheel in directory.glob("*.whl"):
        try:
            name, version, _build, _tags = parse_wheel_filename(wheel.name)
        except ValueError:
            continue
        index[(str(name), str(version))] = wheel
    return index


def ensure_wheels(lock: Path, wheel_dir: Path) -> list[Path]:
    """The wheels the lock pins, downloading into the shared wheel dir only what is missing."""
    if sys.version_info[:2] != IMAGE_PYTHON:
        raise ImageError(
            f"wheels are downloaded for this interpreter (Python {sys.version_info[0]}."
            f"{sys.version_info[1]}), but the image's python3 is "
            f"{IMAGE_PYTHON[0]}.{IMAGE_PYTHON[1]}: run e2e.harness.images with a 3.11 venv"
        )
    pins = read_lock(lock)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    index = _wheel_index(wheel_dir)
    missing = [f"{n}=={v}" for n, v in pins.items() if (n, v) not in index]
    if missing:
        log.info("[images] downloading %d wheels for %s", len(missing), lock.name)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req_file:
            req_file.write("\n".join(missing) + "\n")
        try:
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary=:all:",
                    "-d",
                    str(wheel_dir),
                    "-r",
                    req_file.name,
                ],
                PIP_TIMEOUT_S,
                what=f"pip download for {lock.name}",
            )
        finally:
            os.unlink(req_file.name)
        index = _wheel_index(wheel_dir)
    absent = [f"{n}=={v}" for n, v in pins.items() if (n, v) not in index]
    if absent:
        raise ImageError(f"no wheel for {absent} in {wheel_dir} after pip download")
    return sorted(index[(n, v)] for n, v in pins.items())


def build_project_wheel(out_dir: Path) -> Path:
    """`pip wheel --no-deps .` of this repository into an emptied `out_dir`."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out_dir),
            str(ROOT),
        ],
        PIP_TIMEOUT_S,
        # Fixed zip timestamps: the same sources give the same wheel bytes, so BuildKit keeps
        # the package layer cached when nothing changed.
        env=dict(os.environ, SOURCE_DATE_EPOCH=WHEEL_EPOCH),
        what="pip wheel of embedding-operator",
    )
    wheels = list(out_dir.glob("embedding_operator-*.whl"))
    if len(wheels) != 1:
        raise ImageError(f"pip wheel left {wheels} in {out_dir}, expected one wheel")
    return wheels[0]


def _sync_file(source: Path, target: Path) -> None:
    """Hard-link (or copy) `source` to `target` unless an identical file is already there."""
    if target.exists():
        if target.samefile(source):
            return
        if target.stat().st_size == source.stat().st_size and _digest(target) == _digest(source):
            return
        target.unlink()
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_context(name: str, project_wheel: Path, wheel_dir: Path) -> Path:
    """The build context of images/<name>.Dockerfile: lock, its wheels, our wheel.

    Kept between runs (hard links, so no copy of the wheels) and updated in place, so
    unchanged files keep their identity and BuildKit's cache keys stay the same.
    """
    lock = LOCKS[name]
    wheels = ensure_wheels(lock, wheel_dir)
    context = images_cache() / f"context-{name}"
    (context / "wheels").mkdir(parents=True, exist_ok=True)
    (context / "dist").mkdir(parents=True, exist_ok=True)
    _sync_file(lock, context / "requirements.lock")
    wanted = {wheel.name for wheel in wheels}
    for stale in (context / "wheels").iterdir():
        if stale.name not in wanted:
            stale.unlink()
    for wheel in wheels:
        _sync_file(wheel, context / "wheels" / wheel.name)
    for stale in (context / "dist").iterdir():
        if stale.name != project_wheel.name:
            stale.unlink()
    _sync_file(project_wheel, context / "dist" / project_wheel.name)
    return context


# -- the base image --------------------------------------------------------------------------


def _deb822_stanzas(text: str) -> list[dict[str, str]]:
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = ""
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if current:
                stanzas.append(current)
            current, key = {}, ""
            continue
        if raw[0] in " \t" and key:
            current[key] += " " + raw.strip()
            continue
        key, _, value = raw.partition(":")
        key = key.strip().lower()
        current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


def apt_mirror(
    sources_dir: Path = Path("/etc/apt/sources.list.d"),
    sources_list: Path = Path("/etc/apt/sources.list"),
    suite: str = SUITE,
) -> str:
    """The Debian mirror this machine's apt uses for `suite` (never a hard-coded host)."""
    candidates: list[str] = []
    for path in sorted(sources_dir.glob("*.sources")):
        for stanza in _deb822_stanzas(path.read_text(encoding="utf-8", errors="replace")):
            if stanza.get("enabled", "yes").lower() == "no":
                continue
            if "deb" not in stanza.get("types", "").split():
                continue
            if suite in stanza.get("suites", "").split():
                candidates += stanza.get("uris", "").split()
    lists = [sources_list, *sorted(sources_dir.glob("*.list"))]
    for path in lists:
        if not path.is_file():
            continue
        for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
            line = re.sub(r"\[[^\]]*\]", " ", raw.split("#", 1)[0]).split()
            if len(line) >= 3 and line[0] == "deb" and line[2] == suite:
                candidates.append(line[1])
    for uri in candidates:
        if uri.startswith(("http://", "https://", "file:/")):
            return uri.rstrip("/")
    raise ImageError(
        f"no `deb` source for {suite} in {sources_dir}/*.sources or {sources_list}; "
        "the base image is debootstrapped from the machine's own Debian mirror"
    )


def ensure_rootfs_tarball(mirror: str) -> Path:
    """A minbase bookworm rootfs as a tarball, debootstrapped once and then cached."""
    cache = images_cache()
    tarball = cache / f"debian-{SUITE}-minbase.tar"
    stamp = tarball.with_suffix(".json")
    if tarball.is_file() and stamp.is_file():
        recorded = json.loads(stamp.read_text())
        if recorded.get("mirror") == mirror and recorded.get("recipe") == ROOTFS_RECIPE:
            log.info("[images] base rootfs cached: %s", tarball)
            return tarball
    cache.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="debootstrap-", dir=cache))
    rootfs = workdir / "rootfs"
    try:
        log.info("[images] debootstrap --variant=minbase %s from %s (cold: minutes)", SUITE, mirror)
        _run(
            ["debootstrap", "--variant=minbase", SUITE, str(rootfs), mirror],
            DEBOOTSTRAP_TIMEOUT_S,
            what="debootstrap",
        )
        _unmount_under(rootfs)
        # Package lists and downloaded .debs only make the image bigger; builds run apt update.
        for leftover in ("var/cache/apt", "var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
        partial = workdir / "rootfs.tar"
        _run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."],
            IMPORT_TIMEOUT_S,
            what="tar of the rootfs",
        )
        partial.replace(tarball)
        stamp.write_text(
            json.dumps(
                {
                    "suite": SUITE,
                    "mirror": mirror,
                    "recipe": ROOTFS_RECIPE,
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
                indent=2,
            )
            + "\n"
        )
    finally:
        _unmount_under(rootfs)
        shutil.rmtree(workdir, ignore_errors=True)
    return tarball


def ensure_base_image(docker: Docker, timings: dict[str, float]) -> str:
    """Import the cached rootfs unless this dockerd already holds that exact import."""
    with _timed(timings, "base: debootstrap"):
        tarball = ensure_rootfs_tarball(apt_mirror())
    stamp = tarball.with_suffix(".json")
    recorded = json.loads(stamp.read_text())
    current = docker.image_id(BASE_IMAGE)
    if current and recorded.get("image_id") == current:
        log.info("[images] %s present: %s", BASE_IMAGE, current[:19])
        timings["base: import"] = 0.0
        return BASE_IMAGE
    with _timed(timings, "base: import"), tarball.open("rb") as handle:
        try:
            proc = subprocess.run(
                docker.argv("import", "-", BASE_IMAGE),
                stdin=handle,
                capture_output=True,
                text=True,
                env=docker.env,
                timeout=IMPORT_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ImageError(f"docker import timed out after {IMPORT_TIMEOUT_S}s") from exc
        if proc.returncode != 0:
            raise ImageError(f"docker import of {tarball} failed:\n{proc.stderr[-2000:]}")
    recorded["image_id"] = docker.image_id(BASE_IMAGE)
    stamp.write_text(json.dumps(recorded, indent=2) + "\n")
    return BASE_IMAGE


# -- image builds ----------------------------------------------------------------------------


# BuildKit's plain progress announces each step as `#7 [runtime 3/5] RUN ...`.
_STEP_LINE = re.compile(r"^#\d+ \[[^\]]+\] ")


def _stream(argv: list[str], env: Mapping[str, str], timeout: float, what: str) -> list[str]:
    """Run, logging build steps as they start (a cold server build takes minutes).

    Returns the output lines; ImageError with the tail on failure. A watchdog kills the process
    at the deadline, so a hung build cannot block the caller forever.
    """
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(env), text=True
    )
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            if _STEP_LINE.match(line):
                log.info("[images]   %s", line[:160])
            else:
                log.debug("[images]   %s", line)
        proc.wait(timeout=SHORT_TIMEOUT_S)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=SHORT_TIMEOUT_S)
    if proc.returncode != 0:
        reason = "timed out" if proc.returncode == -signal.SIGKILL else "failed"
        tail = "\n".join(lines[-60:])
        raise ImageError(f"{what} {reason} (rc={proc.returncode}):\n{tail}")
    return lines


def docker_build(
    docker: Docker,
    dockerfile: Path,
    context: Path,
    tag: str,
    build_args: Mapping[str, str] | None = None,
) -> str:
    """`docker build` with BuildKit on the host network; returns the image ID."""
    argv = ["build", "--network=host", "--progress=plain", "-f", str(dockerfile), "-t", tag]
    for key, value in (build_args or {}).items():
        argv += ["--build-arg", f"{key}={value}"]
    argv.append(str(context))
    log.info("[images] docker build %s -> %s", dockerfile.name, tag)
    output = _stream(docker.argv(*argv), docker.env, BUILD_TIMEOUT_S, f"docker build of {tag}")
    cached = sum(1 for line in output if line.endswith(" CACHED"))
    image_id = docker.image_id(tag)
    if image_id is None:
        raise ImageError(f"docker build reported success but {tag} does not exist")
    log.info("[images] %s = %s (%d cached steps)", tag, image_id[:19], cached)
    return image_id


def build_pause_image(docker: Docker) -> str:
    context = images_cache() / "context-pause"
    context.mkdir(parents=True, exist_ok=True)
    binary = context / "pause"
    compiler = shutil.which("gcc") or "gcc"
    _run(
        [
            compiler,
            "-Os",
            "-static",
            "-s",
            "-Wall",
            "-Wextra",
            "-o",
            str(binary),
            str(PAUSE_SOURCE),
        ],
        SHORT_TIMEOUT_S * 2,
        what="gcc of pause.c",
    )
    docker_build(docker, PAUSE_DOCKERFILE, context, PAUSE_IMAGE)
    return PAUSE_IMAGE


def build_images(*, server: bool = True, variant: str = "cpu") -> ImageSet:
    """Build (or reuse the cached layers of) base, pause, server and operator images.

    A private dockerd runs for the duration; the images stay in its data root under the cache,
    where `load_images` finds them.
    """
    ensure_packages(IMAGE_PACKAGES)
    refs = image_refs()
    timings: dict[str, float] = {}
    wheel_dir = cache_root() / "wheels"
    with locked(cache_root() / "docker.lock"), private_dockerd() as docker:
        ensure_base_image(docker, timings)
        base_arg = {"BASE_IMAGE": BASE_IMAGE}
        with _timed(timings, "pause"):
            build_pause_image(docker)
        with _timed(timings, "wheels"):
            project_wheel = build_project_wheel(images_cache() / "dist")
            contexts = {
                name: prepare_context(name, project_wheel, wheel_dir)
                for name in (("server", "operator", "e2e-client") if server else ("operator",))
            }
        if server:
            with _timed(timings, f"server ({variant})"):
                docker_build(
                    docker,
                    SERVER_DOCKERFILE,
                    contexts["server"],
                    refs.server,
                    base_arg | {"VARIANT": variant},
                )
            with _timed(timings, "e2e-client"):
                docker_build(
                    docker,
                    CLIENT_DOCKERFILE,
                    contexts["e2e-client"],
                    refs.client,
                    {"SERVER_IMAGE": refs.server},
                )
        with _timed(timings, "operator"):
            docker_build(docker, OPERATOR_DOCKERFILE, contexts["operator"], refs.operator, base_arg)
        sizes = {}
        built = (
            (refs.base, refs.pause, refs.server, refs.client) if server else (refs.base, refs.pause)
        )
        for ref in (*built, refs.operator):
            proc = docker.run(
                "image", "inspect", "--format", "{{.Size}}", ref, what="docker inspect"
            )
            sizes[ref] = int(proc.stdout.strip())
        prune_leftovers(docker)
    return ImageSet(refs.base, refs.pause, refs.server, refs.operator, refs.client, timings, sizes)


def prune_leftovers(docker: Docker) -> None:
    """Drop the images a rebuild untagged and the build cache beyond ``BUILD_CACHE_KEEP``.

    Each code change leaves the previous server image behind, untagged, and its build cache
    keeps the layers alive: left alone, this dockerd's data root grew to 28 GB in a day of
    work and the node's image load then ran out of disk. The dockerd is ours alone, so
    everything dangling in it is ours to drop."""
    docker.run("image", "prune", "--force", what="docker image prune")
    proc = docker.run(
        "builder",
        "prune",
        "--force",
        "--keep-storage",
        BUILD_CACHE_KEEP,
        what="docker builder prune",
        timeout=LOAD_TIMEOUT_S,
    )
    reclaimed = proc.stdout.strip().splitlines()[-1:] or [""]
    log.info("[images] pruned what the rebuild left behind: %s", reclaimed[0])


# -- loading into containerd -----------------------------------------------------------------


def _ctr() -> str:
    return _first_executable(("/usr/bin/ctr",), "ctr")


def _loaded_stamp(socket: Path) -> Path:
    key = hashlib.sha256(str(socket.resolve()).encode()).hexdigest()[:16]
    return images_cache() / f"loaded-{key}.json"


def containerd_images(socket: Path) -> tuple[set[str], set[str]]:
    """The refs containerd lists, and those of them that are ready: complete and unpacked, so
    a container can start from them. A listed image that is not ready (its snapshots gone from
    the snapshotter's database while containerd's still lists it) must be imported again."""
    proc = _run(
        [_ctr(), "-a", str(socket), "-n", CONTAINERD_NAMESPACE, "images", "check"],
        SHORT_TIMEOUT_S,
        what="ctr images check",
    )
    listed = {line.split()[0] for line in proc.stdout.splitlines()[1:] if line.strip()}
    return listed, ready_refs(proc.stdout)


def ready_refs(listing: str) -> set[str]:
    """The refs of a `ctr images check` table that are complete and unpacked. (`check -q`
    says it prints those, but containerd 1.6 prints every complete one, unpacked or not.)"""
    ready = set()
    for line in listing.splitlines()[1:]:
        # REF TYPE DIGEST STATUS SIZE UNPACKED, STATUS like "complete (3/3)".
        parts = line.split()
        if len(parts) >= 6 and parts[3] == "complete" and parts[-1] == "true":
            ready.add(parts[0])
    return ready


def import_stream(socket: Path, source_argv: list[str], env: Mapping[str, str]) -> None:
    """`source | ctr images import -` into containerd's k8s.io namespace, with one deadline for
    both; both are reaped. A refusal by containerd raises ImportFailed."""
    _pipe(
        source_argv,
        [_ctr(), "-a", str(socket), "-n", CONTAINERD_NAMESPACE, "images", "import", "-"],
        env,
    )


def _pipe(save_argv: list[str], import_argv: list[str], env: Mapping[str, str]) -> None:
    """`save | import` with one deadline for both; both processes are reaped."""
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    with tempfile.TemporaryFile() as save_err, tempfile.TemporaryFile() as import_out:
        saver = subprocess.Popen(save_argv, stdout=subprocess.PIPE, stderr=save_err, env=env)
        importer = subprocess.Popen(
            import_argv, stdin=saver.stdout, stdout=import_out, stderr=subprocess.STDOUT
        )
        assert saver.stdout is not None
        saver.stdout.close()  # the importer holds the pipe now
        try:
            importer.wait(timeout=max(1.0, deadline - time.monotonic()))
            saver.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            raise ImageError(f"{' '.join(save_argv[1:3])} | ctr import timed out") from exc
        finally:
            for proc in (importer, saver):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=SHORT_TIMEOUT_S)
        if saver.returncode != 0 or importer.returncode != 0:
            save_err.seek(0)
            import_out.seek(0)
            error = ImportFailed if saver.returncode == 0 else ImageError
            raise error(
                f"docker save (rc={saver.returncode}) | ctr import (rc={importer.returncode}):\n"
                f"{save_err.read().decode(errors='replace')[-2000:]}"
                f"{import_out.read().decode(errors='replace')[-2000:]}"
            )


def load_images(
    socket: Path,
    images: ImageSet,
    docker: Docker | None = None,
    *,
    store: Path | None = None,
) -> list[str]:
    """Import the node's images into containerd's k8s.io namespace; returns those imported.

    An image is skipped when this containerd has it ready (complete and unpacked) and the
    stamp says the same docker image ID was imported. ``store`` is containerd's root directory
    when it outlives the socket (the e2e node keeps it in the cache): the stamp follows the
    store, so a new cluster over the same store imports nothing. The missing images go in one
    `docker save` stream, so the layers the e2e client shares with the server cross once.
    Starts the private dockerd unless given a client.
    """
    if not socket.is_socket():
        raise ImageError(f"{socket} is not a containerd socket")
    if docker is None:
        with locked(cache_root() / "docker.lock"), private_dockerd() as own:
            return load_images(socket, images, own, store=store)
    stamp = _loaded_stamp(store or socket)
    try:
        recorded: dict[str, Any] = json.loads(stamp.read_text()) if stamp.is_file() else {}
    except ValueError:
        recorded = {}
    present, ready = containerd_images(socket)
    wanted: dict[str, str] = {}
    for ref in images.for_node():
        image_id = docker.image_id(ref)
        if image_id is None:
            raise ImageError(f"{ref} is not built; run `python -m e2e.harness.images build` first")
        if ref in ready and recorded.get(ref) == image_id:
            log.info("[images] %s already in %s (%s)", ref, socket, image_id[:19])
            continue
        wanted[ref] = image_id
    if not wanted:
        _forget_replaced(socket)
        return []
    _make_room(socket, store or socket.parent, wanted, present, docker)
    started = time.monotonic()
    import_stream(socket, docker.argv("save", *wanted), docker.env)
    recorded.update(wanted)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    seconds = time.monotonic() - started
    log.info("[images] %s imported into %s in %.1fs", ", ".join(wanted), socket, seconds)
    _forget_replaced(socket)
    return list(wanted)


def _make_room(
    socket: Path, store: Path, wanted: Mapping[str, str], present: set[str], docker: Docker
) -> None:
    """Make sure the store's disk can take ``wanted``, or fail saying what it lacks.

    An import writes every layer as a content blob and unpacks it as a snapshot, while the
    images it replaces still hold theirs until it ends. When the free space cannot cover the
    worst case (no layer shared), the replaced images go first: their shared layers are then
    unpacked again, which costs a minute, where running out of disk halfway costs the run."""
    layers: dict[str, tuple[list[str], int]] = {}
    for ref in wanted:
        proc = docker.run(
            "image",
            "inspect",
            "--format",
            "{{json .RootFS.Layers}} {{.Size}}",
            ref,
            what="docker inspect",
        )
        diff_ids, size = proc.stdout.rsplit(maxsplit=1)
        layers[ref] = (json.loads(diff_ids), int(size))
    sizes = distinct_sizes(layers)
    worst = 2 * sum(sizes.values()) + LOAD_HEADROOM_BYTES
    free = shutil.disk_usage(store).free
    replaced = sorted(ref for ref in wanted if ref in present)
    if free < worst and replaced:
        log.info(
            "[images] %.1f GB free on %s, up to %.1f GB needed: dropping %s before the import",
            free / 1e9,
            store,
            worst / 1e9,
            ", ".join(replaced),
        )
        base = [_ctr(), "-a", str(socket), "-n", CONTAINERD_NAMESPACE, "images"]
        _run([*base, "rm", "--sync", *replaced], LOAD_TIMEOUT_S, what="ctr images rm")
        _forget_replaced(socket)
        free = shutil.disk_usage(store).free
    # Even fully shared, the largest image is written once as blobs and once unpacked.
    least = 2 * max(size for _, size in layers.values()) + LOAD_HEADROOM_BYTES
    if free < least:
        raise ImageError(
            f"{free / 1e9:.1f} GB free on {store}, but importing {', '.join(wanted)} needs at "
            f"least {least / 1e9:.1f} GB; free disk space there (the node's image store is "
            f"{store}, our dockerd's is {cache_root() / 'docker'})"
        )


def distinct_sizes(images: Mapping[str, tuple[list[str], int]]) -> dict[str, int]:
    """Each image's bytes beyond the largest other image its layers start with.

    ``images`` maps a ref to its layer diff IDs and total size. The e2e client is the server
    image plus one layer: counted whole, the pair would look twice as large as it is."""
    distinct = {}
    for ref, (own, size) in images.items():
        parents = [
            other_size
            for other, (theirs, other_size) in images.items()
            if other != ref and len(theirs) < len(own) and own[: len(theirs)] == theirs
        ]
        distinct[ref] = size - max(parents, default=0)
    return distinct


_DIGEST_REF = re.compile(r"sha256:[0-9a-f]{64}")


def stale_refs(listing: str) -> list[str]:
    """The ``sha256:<image id>`` refs in a `ctr images ls` listing whose image no tag names.

    The CRI plugin adds an image-ID ref beside each tag it sees. When a rebuilt image takes
    the tag over, that ID ref alone still pins the old image (6 GB for the server), and the
    node's store, which the e2e cache keeps between runs, grows by one image per code change
    until the disk is full."""
    tagged: set[str] = set()
    by_id: list[tuple[str, str]] = []
    for line in listing.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 3:
            continue
        ref, target = parts[0], parts[2]
        if _DIGEST_REF.fullmatch(ref):
            by_id.append((ref, target))
        else:
            tagged.add(target)
    return [ref for ref, target in by_id if target not in tagged]


def _forget_replaced(socket: Path) -> None:
    """Drop the image-ID refs of images no tag names any more (containerd then collects
    their content and snapshots; a container still running one keeps its snapshot)."""
    base = [_ctr(), "-a", str(socket), "-n", CONTAINERD_NAMESPACE, "images"]
    listing = _run([*base, "ls"], SHORT_TIMEOUT_S, what="ctr images ls").stdout
    stale = stale_refs(listing)
    if stale:
        _run([*base, "rm", "--sync", *stale], LOAD_TIMEOUT_S, what="ctr images rm")
        log.info("[images] dropped %d replaced image(s) from %s", len(stale), socket)


# -- lock files ------------------------------------------------------------------------------


def dependency_closure(extra: str, project: str = "embedding-operator") -> dict[str, str]:
    """Name -> installed version of everything `project[extra]` pulls in, from this venv."""
    seen: dict[str, tuple[str, str, set[str]]] = {}
    todo: list[tuple[str, set[str]]] = [(project, {extra})]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and extras <= seen[key][2]:
            continue
        dist = importlib.metadata.distribution(name)
        done = seen[key][2] if key in seen else set()
        seen[key] = (dist.metadata["Name"], dist.version, done | extras)
        for line in dist.requires or []:
            req = Requirement(line)
            marker: Marker | None = req.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((req.name, set(req.extras)))
    seen.pop(canonicalize_name(project))
    return {name: version for name, version, _ in sorted(seen.values(), key=lambda v: v[0].lower())}


def write_locks() -> list[Path]:
    """Rewrite images/<image>.lock from the versions installed in this venv."""
    written = []
    for name, path in LOCKS.items():
        if name == "e2e-client":
            pins = {"openai": importlib.metadata.version("openai")} | dependency_closure(
                "", project="openai"
            )
            what = "openai"
        else:
            pins = dependency_closure(name)
            what = f"embedding-operator[{name}]"
        header = (
            f"# Pinned dependencies of {what} for the {name} image "
            "(CPython 3.11, x86_64 Linux).\n"
            "# Generated by `python -m e2e.harness.images lock` from the project venv; the image's "
            "dependency layer is\n"
            "# keyed on this file, so only a change here reinstalls them.\n"
        )
        path.write_text(header + "".join(f"{n}=={v}\n" for n, v in pins.items()))
        written.append(path)
    return written


# -- CLI -------------------------------------------------------------------------------------


def _from_state(path: Path, key: str) -> Path | None:
    """A path a running cluster's state.json records (`make cluster-up` writes it)."""
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    value = state.get(key) if isinstance(state, dict) else None
    return Path(value) if value else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build base, pause, server (cpu) and operator images")
    build.add_argument("--skip-server", action="store_true", help="only base, pause, operator")
    load = sub.add_parser("load", help="import the node's images into a containerd (k8s.io)")
    where = load.add_mutually_exclusive_group(required=True)
    where.add_argument("--containerd-socket", type=Path, help="containerd's gRPC socket")
    where.add_argument(
        "--cluster-state",
        type=Path,
        help="a state.json naming `containerd_socket`; nothing to do when absent",
    )
    sub.add_parser("lock", help="rewrite images/*.lock from the project venv")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        if args.command == "build":
            images = build_images(server=not args.skip_server)
            for step, seconds in images.timings.items():
                print(f"{step:24} {seconds:7.1f}s")
            for ref, size in images.sizes.items():
                print(f"{ref:56} {size / 1e6:7.0f} MB")
        elif args.command == "load":
            state = args.cluster_state
            socket = args.containerd_socket or _from_state(state, "containerd_socket")
            if socket is None:
                log.info(
                    "[images] %s names no containerd_socket: nothing to load", args.cluster_state
                )
                return 0
            store = _from_state(state, "node_images") if state else None
            imported = load_images(socket, image_refs(), store=store)
            print(f"imported {len(imported)} image(s) into {socket}: {' '.join(imported)}")
        else:
            for path in write_locks():
                print(f"wrote {path.relative_to(ROOT)}")
    except (ImageError, HostPackageError) as exc:
        print(f"[images] FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

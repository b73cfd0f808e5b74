"""Building the images: pause from C, then server, e2e client and operator with BuildKit.

* pause: the kubelet's sandbox image, a static C program (images/pause/pause.c) FROM scratch,
  tagged ``registry.k8s.io/pause:3.10``.
* server (CPU variant), e2e client and operator: images/*.Dockerfile with ``BASE_IMAGE`` set to
  the local base (base.py) and the context wheels.py prepares.

All on the private dockerd (dockerd.py), where ``load_images`` (store.py) finds them.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

from e2e.harness.binaries import cache_root, locked
from e2e.harness.host_packages import IMAGE_PACKAGES, ensure_packages
from e2e.harness.images.base import ensure_base_image
from e2e.harness.images.dockerd import Docker, private_dockerd
from e2e.harness.images.host import SHORT_TIMEOUT_S, run, timed
from e2e.harness.images.refs import (
    BASE_IMAGE,
    CLIENT_DOCKERFILE,
    OPERATOR_DOCKERFILE,
    PAUSE_DOCKERFILE,
    PAUSE_IMAGE,
    PAUSE_SOURCE,
    SERVER_DOCKERFILE,
    ImageError,
    ImageSet,
    image_refs,
    images_cache,
)
from e2e.harness.images.wheels import build_project_wheel, prepare_context

log = logging.getLogger("e2e.images")

BUILD_TIMEOUT_S = 45 * 60
PRUNE_TIMEOUT_S = 20 * 60
# The build cache our dockerd keeps after a build: the server's installed dependencies (6 GB)
# and its wheel context (3 GB) are what make the next build take seconds; older generations of
# them, left by each lock change, go.
BUILD_CACHE_KEEP = "10GB"


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
    run(
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


def build_images(
    *, server: bool = True, variant: str = "cpu", torch_source: str = "pypi"
) -> ImageSet:
    """Build (or reuse the cached layers of) base, pause, server and operator images.

    ``torch_source``: the server image's ``TORCH_SOURCE``, ``pypi`` (PyPI's torch, with its
    CUDA runtime: what CI builds) or ``cpu`` (PyTorch's CPU index, no CUDA). Either is tagged
    as the chart's default server image, so a local cluster runs the one built last.

    A private dockerd runs for the duration; the images stay in its data root under the cache,
    where `load_images` finds them.
    """
    if variant == "cuda" and torch_source != "pypi":
        raise ImageError("the cuda variant compiles flash-attn against PyPI's CUDA torch")
    ensure_packages(IMAGE_PACKAGES)
    refs = image_refs()
    timings: dict[str, float] = {}
    wheel_dir = cache_root() / "wheels"
    with locked(cache_root() / "docker.lock"), private_dockerd() as docker:
        ensure_base_image(docker, timings)
        base_arg = {"BASE_IMAGE": BASE_IMAGE}
        with timed(timings, "pause"):
            build_pause_image(docker)
        with timed(timings, "wheels"):
            project_wheel = build_project_wheel(images_cache() / "dist")
            contexts = {
                name: prepare_context(name, project_wheel, wheel_dir, torch_source=torch_source)
                for name in (("server", "operator", "e2e-client") if server else ("operator",))
            }
        if server:
            with timed(timings, f"server ({variant}, torch from {torch_source})"):
                docker_build(
                    docker,
                    SERVER_DOCKERFILE,
                    contexts["server"],
                    refs.server,
                    base_arg | {"VARIANT": variant, "TORCH_SOURCE": torch_source},
                )
            with timed(timings, "e2e-client"):
                docker_build(
                    docker,
                    CLIENT_DOCKERFILE,
                    contexts["e2e-client"],
                    refs.client,
                    {"SERVER_IMAGE": refs.server},
                )
        with timed(timings, "operator"):
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
        timeout=PRUNE_TIMEOUT_S,
    )
    reclaimed = proc.stdout.strip().splitlines()[-1:] or [""]
    log.info("[images] pruned what the rebuild left behind: %s", reclaimed[0])

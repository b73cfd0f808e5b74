"""Install the Debian packages a build or a real node needs, and only those that are missing.

Why a module of its own: building the images (docker, debootstrap, a C compiler for the pause
program) and running a real node (containerd, runc) both need host packages, and both must work
on a fresh CI machine that has only a Debian mirror. Asking dpkg first keeps warm runs free of
`apt-get update` (slow, and it needs the network); when something is missing, one update and one
install, non-interactive, without recommended packages. A package apt cannot install raises
``HostPackageError`` naming it, so the caller fails with a reason instead of a missing binary
three steps later.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence

log = logging.getLogger("e2e.host_packages")

# What `e2e.harness.images` needs: a docker engine (dockerd + client) and the runtime under it,
# containerd/ctr to load images into a node, debootstrap for the base image, gcc + libc6-dev
# for the static pause program.
IMAGE_PACKAGES: tuple[str, ...] = (
    "docker.io",
    "containerd",
    "runc",
    "debootstrap",
    "gcc",
    "libc6-dev",
)

DPKG_TIMEOUT_S = 30
APT_UPDATE_TIMEOUT_S = 5 * 60
APT_INSTALL_TIMEOUT_S = 15 * 60


class HostPackageError(RuntimeError):
    """A Debian package is missing and apt-get could not install it."""


def _run(
    argv: list[str], timeout: float, what: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end, output captured; a missing program, or a timeout (``what``
    timed out), is a :class:`HostPackageError`."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, env=env, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        raise HostPackageError(f"{argv[0]} not found: this is not a Debian-based machine") from exc
    except subprocess.TimeoutExpired as exc:
        raise HostPackageError(f"{what} timed out after {timeout:.0f}s") from exc


def is_installed(name: str) -> bool:
    """True when dpkg reports the package fully installed (not merely known or half-removed)."""
    proc = _run(["dpkg-query", "-W", "-f=${Status}", name], DPKG_TIMEOUT_S, f"dpkg-query {name}")
    return proc.returncode == 0 and proc.stdout.strip().endswith(" installed")


def missing_packages(names: Sequence[str]) -> list[str]:
    """The packages of `names` that are not installed, in the given order, deduplicated."""
    missing: list[str] = []
    for name in names:
        if name not in missing and not is_installed(name):
            missing.append(name)
    return missing


def _apt(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return _run(["apt-get", *args], timeout, f"apt-get {' '.join(args)}", env=env)


def ensure_packages(names: Sequence[str]) -> None:
    """Install whichever of `names` is missing; no apt-get at all when everything is there."""
    missing = missing_packages(names)
    if not missing:
        log.info("[packages] installed already: %s", " ".join(names))
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise HostPackageError(
            f"missing Debian packages {missing}; install them as root: "
            f"apt-get install --no-install-recommends {' '.join(missing)}"
        )
    log.info("[packages] installing %s", " ".join(missing))
    update = _apt(["update", "-q"], APT_UPDATE_TIMEOUT_S)
    if update.returncode != 0:
        raise HostPackageError(
            f"apt-get update failed (needed to install {missing}):\n{update.stderr[-2000:]}"
        )
    install = _apt(
        ["install", "-y", "-q", "--no-install-recommends", *missing], APT_INSTALL_TIMEOUT_S
    )
    still_missing = missing_packages(missing)
    if install.returncode != 0 or still_missing:
        failed = still_missing or missing
        raise HostPackageError(
            f"apt-get could not install {failed}:\n{(install.stderr or install.stdout)[-2000:]}"
        )
    log.info("[packages] installed %s", " ".join(missing))

"""The base image: a minbase Debian rootfs, debootstrapped from the machine's own mirror.

``debootstrap --variant=minbase bookworm`` from the mirror the machine's apt already uses,
imported as ``embedding-operator.local/debian:bookworm``. The rootfs tarball is cached, so warm
runs skip debootstrap; the import is skipped too when the private dockerd already holds it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from e2e.harness.images.dockerd import Docker
from e2e.harness.images.host import run, timed
from e2e.harness.images.refs import BASE_IMAGE, ImageError, images_cache
from e2e.harness.mounts import unmount_under

log = logging.getLogger("e2e.images")

SUITE = "bookworm"
# Bump when ensure_rootfs_tarball changes what goes into the tarball: cached ones are redone.
ROOTFS_RECIPE = 2
DEBOOTSTRAP_TIMEOUT_S = 20 * 60
IMPORT_TIMEOUT_S = 5 * 60


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
        run(
            ["debootstrap", "--variant=minbase", SUITE, str(rootfs), mirror],
            DEBOOTSTRAP_TIMEOUT_S,
            what="debootstrap",
        )
        unmount_under(rootfs)
        # Package lists and downloaded .debs only make the image bigger; builds run apt update.
        for leftover in ("var/cache/apt", "var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
        partial = workdir / "rootfs.tar"
        run(
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
        unmount_under(rootfs)
        shutil.rmtree(workdir, ignore_errors=True)
    return tarball


def ensure_base_image(docker: Docker, timings: dict[str, float]) -> str:
    """Import the cached rootfs unless this dockerd already holds that exact import."""
    with timed(timings, "base: debootstrap"):
        tarball = ensure_rootfs_tarball(apt_mirror())
    stamp = tarball.with_suffix(".json")
    recorded = json.loads(stamp.read_text())
    current = docker.image_id(BASE_IMAGE)
    if current and recorded.get("image_id") == current:
        log.info("[images] %s present: %s", BASE_IMAGE, current[:19])
        timings["base: import"] = 0.0
        return BASE_IMAGE
    with timed(timings, "base: import"), tarball.open("rb") as handle:
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

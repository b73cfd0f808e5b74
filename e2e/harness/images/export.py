"""Handing the built images to another cluster: one ``docker save`` archive of the workloads.

The existing-cluster mode of the e2e tier (e2e/README.md) builds and loads nothing: it runs
the images the user names. This is how the images built here get there: ``kind load
image-archive`` takes the archive as is; for a registry, ``docker load`` it, then tag and push.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from e2e.harness.binaries import cache_root, locked
from e2e.harness.images.dockerd import private_dockerd
from e2e.harness.images.refs import ImageError

log = logging.getLogger("e2e.images")

SAVE_TIMEOUT_S = 20 * 60


def save_images(archive: Path, refs: Sequence[str]) -> Path:
    """``docker save refs -o archive`` from the private dockerd the builds use."""
    archive = archive.resolve()
    archive.parent.mkdir(parents=True, exist_ok=True)
    with locked(cache_root() / "docker.lock"), private_dockerd() as docker:
        missing = [ref for ref in refs if docker.image_id(ref) is None]
        if missing:
            raise ImageError(
                f"{', '.join(missing)} not built; run `python -m e2e.harness.images build` first"
            )
        docker.run("save", "-o", str(archive), *refs, timeout=SAVE_TIMEOUT_S, what="docker save")
    log.info("[images] saved %s to %s", ", ".join(refs), archive)
    return archive

"""Loading the images into a containerd's ``k8s.io`` namespace (the real node's store).

``docker save | ctr images import`` in one stream, remembering which docker image IDs went into
which store, so a warm load of unchanged images costs one ``ctr images check``. The store
outlives clusters (it is in the cache): replaced images are dropped, and a load that the disk
cannot take fails saying so before it starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from e2e.harness.binaries import cache_root, drop_go_caches, locked
from e2e.harness.images.dockerd import Docker, private_dockerd
from e2e.harness.images.host import SHORT_TIMEOUT_S, first_executable, run
from e2e.harness.images.refs import ImageError, ImageSet, ImportFailed, images_cache

log = logging.getLogger("e2e.images")

CONTAINERD_NAMESPACE = "k8s.io"
LOAD_TIMEOUT_S = 20 * 60
# Beyond what a load needs for the images themselves (their layers as content blobs, and the
# same again unpacked as snapshots).
LOAD_HEADROOM_BYTES = 2 << 30


def _ctr() -> str:
    return first_executable(("/usr/bin/ctr",), "ctr")


def _loaded_stamp(socket: Path) -> Path:
    key = hashlib.sha256(str(socket.resolve()).encode()).hexdigest()[:16]
    return images_cache() / f"loaded-{key}.json"


def containerd_images(socket: Path) -> tuple[set[str], set[str]]:
    """The refs containerd lists, and those of them that are ready: complete and unpacked, so
    a container can start from them. A listed image that is not ready (its snapshots gone from
    the snapshotter's database while containerd's still lists it) must be imported again."""
    proc = run(
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
        run([*base, "rm", "--sync", *replaced], LOAD_TIMEOUT_S, what="ctr images rm")
        _forget_replaced(socket)
        free = shutil.disk_usage(store).free
    # Even fully shared, the largest image is written once as blobs and once unpacked.
    least = 2 * max(size for _, size in layers.values()) + LOAD_HEADROOM_BYTES
    if free < least:
        free = _reclaim_caches(store, docker)
    if free < least:
        raise ImageError(
            f"{free / 1e9:.1f} GB free on {store}, but importing {', '.join(wanted)} needs at "
            f"least {least / 1e9:.1f} GB; free disk space there (the node's image store is "
            f"{store}, our dockerd's is {cache_root() / 'docker'})"
        )


def _reclaim_caches(store: Path, docker: Docker) -> int:
    """Drop what a later run can make again, and return the store's free bytes after.

    First all of our dockerd's build cache: a server rebuild after a change of the lock keeps
    the old 6 GB dependency layer there (up to ``BUILD_CACHE_KEEP``), and the next build only
    reinstalls those wheels. Then our Go caches: every binary is already cached by version."""
    before = shutil.disk_usage(store).free
    docker.run(
        "builder", "prune", "--all", "--force", timeout=LOAD_TIMEOUT_S, what="docker builder prune"
    )
    drop_go_caches()
    free = shutil.disk_usage(store).free
    log.info(
        "[images] %.1f GB free on %s after dropping the build caches (was %.1f GB)",
        free / 1e9,
        store,
        before / 1e9,
    )
    return free


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
    listing = run([*base, "ls"], SHORT_TIMEOUT_S, what="ctr images ls").stdout
    stale = stale_refs(listing)
    if stale:
        run([*base, "rm", "--sync", *stale], LOAD_TIMEOUT_S, what="ctr images rm")
        log.info("[images] dropped %d replaced image(s) from %s", len(stale), socket)

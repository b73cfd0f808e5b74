"""The project's container images, built on a machine that reaches no container registry.

Why: the real-node e2e tier runs pods from our own server and operator images, and CI machines
reach only package registries (PyPI, a Debian mirror). So every byte comes from those. One
module per step:

* ``refs``: the image names (the chart's defaults), their sources, ``ImageSet``, ``ImageError``;
* ``base``: the Debian base, debootstrapped from the machine's own mirror and cached;
* ``wheels``: the wheels the lock files pin, downloaded on the host, and the build contexts;
* ``build``: pause from C, then server, e2e client and operator with BuildKit;
* ``dockerd``: the private dockerd the builds run on (the system's is never touched);
* ``store``: loading them into a containerd (the real node's store, kept in the cache);
* ``export``: one ``docker save`` archive of the workloads, for another cluster;
* ``lock``: rewriting ``images/*.lock`` from the project venv, and the server's CPU-only lock
  by pip's resolution against PyTorch's CPU index;
* ``host``: running host commands with deadlines; ``cli``: ``python -m e2e.harness.images``.

Cache layout (``cache_root()`` as in binaries: ``~/.cache/embedding-operator``, honours
``XDG_CACHE_HOME``; ``EMBEDDING_OPERATOR_CACHE`` overrides the root)::

    docker/ docker-exec/ docker.sock docker.pid dockerd.log   the private dockerd
    wheels/                                                   host-downloaded wheels
    images/debian-bookworm-minbase.tar(.json)                 the cached base rootfs
    images/context-{server,operator,pause}/                   build contexts
    images/loaded-<socket hash>.json                          what `load` imported where

The names below are the package's public surface (the e2e fixtures, tests/test_images.py).
"""

from e2e.harness.images.base import apt_mirror
from e2e.harness.images.build import build_images
from e2e.harness.images.export import save_images
from e2e.harness.images.lock import check_cpu_lock, cpu_requirements, pins_from_report
from e2e.harness.images.refs import (
    BASE_IMAGE,
    CLIENT_DOCKERFILE,
    CONTEXT_ENTRIES,
    CPU_TORCH_INDEX,
    LOCKS,
    PAUSE_IMAGE,
    SERVER_CONTEXT_ENTRIES,
    SERVER_CONTEXT_LOCKS,
    SERVER_LOCKS,
    TORCH_SOURCES,
    ImageError,
    ImageSet,
    ImportFailed,
    image_refs,
)
from e2e.harness.images.store import (
    containerd_images,
    distinct_sizes,
    import_stream,
    load_images,
    ready_refs,
    stale_refs,
)
from e2e.harness.images.wheels import download_command, prepare_context, read_lock, server_lock

__all__ = [
    "BASE_IMAGE",
    "CLIENT_DOCKERFILE",
    "CONTEXT_ENTRIES",
    "CPU_TORCH_INDEX",
    "LOCKS",
    "PAUSE_IMAGE",
    "SERVER_CONTEXT_ENTRIES",
    "SERVER_CONTEXT_LOCKS",
    "SERVER_LOCKS",
    "TORCH_SOURCES",
    "ImageError",
    "ImageSet",
    "ImportFailed",
    "apt_mirror",
    "build_images",
    "check_cpu_lock",
    "containerd_images",
    "cpu_requirements",
    "distinct_sizes",
    "download_command",
    "image_refs",
    "import_stream",
    "load_images",
    "pins_from_report",
    "prepare_context",
    "read_lock",
    "ready_refs",
    "save_images",
    "server_lock",
    "stale_refs",
]

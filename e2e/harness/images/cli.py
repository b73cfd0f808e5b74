"""Build the project's container images on a machine that reaches no container registry.

CLI (from the repository root)::

    python -m e2e.harness.images build [--skip-server] [--torch-source pypi|cpu]
    python -m e2e.harness.images load (--containerd-socket SOCK | --cluster-state STATE_JSON)
    python -m e2e.harness.images save ARCHIVE.tar   # the workloads, for another cluster
    python -m e2e.harness.images lock               # rewrite images/*.lock from the venv
    python -m e2e.harness.images lock --torch-source cpu  # images/server.cpu.lock, by pip

(``STATE_JSON``: a running cluster's ``.cluster/state.json``.)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from e2e.harness.host_packages import HostPackageError
from e2e.harness.images.build import build_images
from e2e.harness.images.export import save_images
from e2e.harness.images.lock import write_cpu_lock, write_locks
from e2e.harness.images.refs import (
    CPU_TORCH_INDEX,
    ROOT,
    TORCH_SOURCES,
    ImageError,
    image_refs,
)
from e2e.harness.images.store import load_images

log = logging.getLogger("e2e.images")


def _from_state(path: Path, key: str) -> Path | None:
    """A path a running cluster's state.json records (`make cluster-up` writes it)."""
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    value = state.get(key) if isinstance(state, dict) else None
    return Path(value) if value else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.harness.images", description=(__doc__ or "").split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build base, pause, server (cpu) and operator images")
    build.add_argument("--skip-server", action="store_true", help="only base, pause, operator")
    build.add_argument(
        "--torch-source",
        choices=TORCH_SOURCES,
        default="pypi",
        help="the server image's torch: PyPI's (with its CUDA runtime; the default) or the "
        f"CPU-only build of {CPU_TORCH_INDEX} (images/server.cpu.lock)",
    )
    load = sub.add_parser("load", help="import the node's images into a containerd (k8s.io)")
    where = load.add_mutually_exclusive_group(required=True)
    where.add_argument("--containerd-socket", type=Path, help="containerd's gRPC socket")
    where.add_argument(
        "--cluster-state",
        type=Path,
        help="a state.json naming `containerd_socket`; nothing to do when absent",
    )
    save = sub.add_parser(
        "save",
        help="write the built operator, server and e2e client images to one `docker save` "
        "archive (for `kind load image-archive`, or `docker load` then push to a registry)",
    )
    save.add_argument("archive", type=Path, help="the .tar file to write")
    lock = sub.add_parser("lock", help="rewrite images/*.lock from the project venv")
    lock.add_argument(
        "--torch-source",
        choices=TORCH_SOURCES,
        default="pypi",
        help="cpu: write only images/server.cpu.lock, by pip's resolution against "
        f"{CPU_TORCH_INDEX} (which must be reachable)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        if args.command == "build":
            images = build_images(server=not args.skip_server, torch_source=args.torch_source)
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
        elif args.command == "save":
            refs = image_refs()
            save_images(args.archive, refs.workloads())
            print(f"wrote {args.archive}: {' '.join(refs.workloads())}")
        else:
            written = [write_cpu_lock()] if args.torch_source == "cpu" else write_locks()
            for path in written:
                print(f"wrote {path.relative_to(ROOT)}")
    except (ImageError, HostPackageError) as exc:
        print(f"[images] FAILED: {exc}", file=sys.stderr)
        return 1
    return 0

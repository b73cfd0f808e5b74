"""``python -m e2e.harness.cluster up|env|down``: the local cluster for manual use.

State lives in ``.cluster/`` at the repository root (gitignored)::

    python -m e2e.harness.cluster up     # builds missing binaries, starts detached, prints exports
    python -m e2e.harness.cluster env    # prints the export lines again
    python -m e2e.harness.cluster down   # stops everything and removes the state

``up`` does not apply ``crds/`` (the chart's ``helm install`` does; ``--crds`` applies them) and
builds and loads the images (``--no-images`` skips that). Its GPU nodes are kwok's; there is no
fake CPU node, so CPU pods go to the real node and ``kubectl apply -f examples/minilm-cpu.yaml``
really serves.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from e2e.harness import node
from e2e.harness.binaries import BuildError, ensure_binaries
from e2e.harness.cluster.local import DEFAULT_CRD_DIR, REPO_ROOT, Cluster
from e2e.harness.cluster.state import detached_processes, read_state, stop_detached
from e2e.harness.host_packages import HostPackageError
from e2e.harness.images import ImageError, build_images, load_images
from e2e.harness.proc import ClusterError

CLI_WORKDIR = REPO_ROOT / ".cluster"


def _export_lines(state: Mapping[str, Any]) -> list[str]:
    path = os.pathsep.join([*state["bin_dirs"], "$PATH"])
    return [f'export PATH="{path}"', f"export KUBECONFIG={state['kubeconfig']}"]


USER_FAKE_NODES = ("gpu-h100-0", "gpu-l4-0")


def _image_loader() -> Callable[[Path], object]:
    """Build (or take from the cache) the project's images; load them once containerd is up."""
    images = build_images()
    return lambda socket_path: load_images(socket_path, images, store=node.containerd_store())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.harness.cluster",
        description="Local Kubernetes control plane for e2e tests.",
    )
    parser.add_argument("command", choices=["up", "down", "env"])
    parser.add_argument(
        "--workdir",
        type=Path,
        default=CLI_WORKDIR,
        help=f"state directory (default: {CLI_WORKDIR})",
    )
    parser.add_argument(
        "--crds",
        action="store_true",
        help=f"also apply the CRDs in {DEFAULT_CRD_DIR} (off by default: `helm install` of the "
        "chart installs them, and refuses a CRD it did not create)",
    )
    parser.add_argument(
        "--no-images",
        action="store_true",
        help="do not build and load the project's images into the real node (`make images` "
        "loads them later)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    workdir: Path = args.workdir.resolve()

    processes = detached_processes(workdir)
    running = bool(processes) and all(p.alive() for p in processes)
    state = read_state(workdir)
    try:
        if args.command == "down":
            count = stop_detached(workdir)
            print(f"stopped {count} running component(s) from {workdir}")
            return 0
        if args.command == "env":
            if not running or state is None:
                print(
                    f"no running cluster in {workdir}; run `python -m e2e.harness.cluster up`",
                    file=sys.stderr,
                )
                return 1
            print("\n".join(_export_lines(state)))
            return 0
        # up
        if running and state is not None:
            print(f"already running in {workdir}", file=sys.stderr)
            print("\n".join(_export_lines(state)))
            return 0
        stop_detached(workdir)  # clear a half-dead earlier cluster
        binaries = ensure_binaries()
        crd_dir = DEFAULT_CRD_DIR if args.crds else None
        loader = None if args.no_images else _image_loader()
        cluster = Cluster(
            binaries,
            workdir,
            crd_dir=crd_dir,
            detached=True,
            # The GPU nodes are fake; CPU pods go to the real node (no fake CPU node to
            # compete with it, so `kubectl apply -f examples/minilm-cpu.yaml` really serves).
            fake_nodes=USER_FAKE_NODES,
            image_loader=loader,
        ).start()
        print(
            f"cluster up in {cluster.startup_seconds:.1f}s: {cluster.server}; "
            f"logs in {cluster.log_dir}; stop with `python -m e2e.harness.cluster down`"
        )
        print("\n".join(_export_lines(read_state(workdir) or {})))
        return 0
    except (BuildError, ClusterError, HostPackageError, ImageError, TimeoutError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1

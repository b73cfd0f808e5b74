"""A detached cluster's state file (``<workdir>/state.json``), and ``down`` from it alone.

``python -m e2e.harness.cluster up`` leaves the processes running after it exits; the state
file records them as (pid, start time) pairs, with what the node's cleanup needs, so a later
``down`` (another Python process) stops exactly them and never a recycled pid.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from e2e.harness import node
from e2e.harness.cluster.real_node import node_cleanup
from e2e.harness.components import Teardown, stop_processes
from e2e.harness.proc import ClusterError, Process

STATE_FILE = "state.json"


def write_state(workdir: Path, state: Mapping[str, Any]) -> None:
    (workdir / STATE_FILE).write_text(json.dumps(dict(state), indent=2) + "\n")


def read_state(workdir: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((workdir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state


def detached_processes(workdir: Path) -> list[Process]:
    state = read_state(workdir)
    return [Process.from_json(p) for p in state["processes"]] if state else []


def stop_detached(workdir: Path) -> int:
    """Stop the processes an earlier ``up`` recorded in ``workdir``; returns how many ran."""
    processes = detached_processes(workdir)
    running = sum(p.alive() for p in processes)
    state = read_state(workdir) or {}
    paths = node.NodePaths(
        state=Path(state.get("node_state") or workdir / "node"),
        images=Path(state.get("node_images") or node.containerd_store()),
    )
    kube_proxy = state.get("kube_proxy")
    errors = stop_processes(
        processes, Teardown(node_paths=paths, kube_proxy=Path(kube_proxy) if kube_proxy else None)
    )
    if state:
        errors += node_cleanup(
            paths,
            state.get("network_restore") or {},
            state.get("netns_before") or [],
            state.get("host_paths_before", list(node.HOST_PATHS)),
            state.get("chains_before", node.kube_chains()),
            state.get("veths_before"),
        )
    if errors:
        raise ClusterError("; ".join(errors))
    for name in ("etcd", "pki", "kubeconfigs", "helm", STATE_FILE, "kubeconfig"):
        path = workdir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return running

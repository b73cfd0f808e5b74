"""kwok's fake GPU nodes: the nodes of ``e2e/nodes.yaml``, heartbeated by kwok.

kwok keeps their capacity, renews their leases and marks pods bound to them Running/Ready
without running anything, so scheduling on GPU types can be tested without GPUs. Ready when
every node is Ready and its ``not-ready`` taint is gone.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.cluster.context import ClusterContext
from e2e.harness.components import Kwok


class FakeNodes:
    """``names`` picks which nodes of ``nodes_file`` to create (default: all)."""

    def __init__(
        self, cluster: ClusterContext, *, nodes_file: Path | None, names: Collection[str] | None
    ) -> None:
        self.cluster = cluster
        self.nodes_file = nodes_file
        self.names = names

    def documents(self) -> list[dict[str, Any]]:
        if self.nodes_file is None:
            return []
        docs = yaml.safe_load_all(self.nodes_file.read_text())
        nodes = [d for d in docs if d and d.get("kind") == "Node"]
        if self.names is not None:
            nodes = [d for d in nodes if d["metadata"]["name"] in self.names]
        return nodes

    def start(self) -> None:
        """The fake nodes, then kwok, which heartbeats them."""
        cluster = self.cluster
        documents = self.documents()
        if documents:
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(documents))
        cluster.start_component(
            Kwok(
                cluster.launcher,
                cluster.binaries.kwok,
                cluster.api,
                kubeconfig=cluster.kubeconfig,
                port=cluster.ports.kwok,
                nodes=[d["metadata"]["name"] for d in documents],
                timeout=cluster.timeouts.nodes,
            )
        )

"""Namespace scoping: ``--namespaces`` (or EMBEDDING_OPERATOR_NAMESPACES) limits the operator.

An operator told to watch one namespace converges EmbeddingServices there and leaves those in
other namespaces untouched (no children, no status), so several teams can each run their own.
It runs with the chart's namespaced RBAC (``watchNamespaces``: a Role in each watched namespace,
no cluster-wide rights on workloads), which proves that mode's rules sufficient too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.harness.cluster import Cluster
from e2e.harness.operator import embedding_service, get_json, start_operator, wait_condition
from e2e.harness.proc import poll_until

# The server pods here only need to be Running and Ready: kwok's fake nodes make them so.
pytestmark = pytest.mark.kwok

MODEL = {"name": "sentence-transformers/all-MiniLM-L6-v2"}


def test_watches_only_its_namespaces(cluster: Cluster, tmp_path: Path) -> None:
    mine = cluster.create_namespace(f"scoped-mine-{tmp_path.name[-6:].lower()}")
    other = cluster.create_namespace(f"scoped-other-{tmp_path.name[-6:].lower()}")
    operator = start_operator(cluster, tmp_path, watch_namespaces=[mine])
    try:
        cluster.apply(embedding_service("outside", {"model": MODEL}), namespace=other)
        cluster.apply(embedding_service("inside", {"model": MODEL}), namespace=mine)
        wait_condition(cluster, mine, "inside", "Ready", "True")
        # The operator has had time to see "outside" had it been watching: assert it never
        # acted (it is also created first, so it would have been handled first).
        poll_until(
            lambda: get_json(cluster, "deployment", "inside", "-n", mine),
            timeout=30,
            what="the in-scope Deployment",
        )
        outside = get_json(cluster, "embsvc", "outside", "-n", other)
        assert outside is not None and not outside.get("status")
        assert get_json(cluster, "deployment", "outside", "-n", other) is None
    finally:
        operator.stop()
        cluster.kubectl("delete", "namespace", mine, other, "--wait=false")

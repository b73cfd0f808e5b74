"""What a person would look at when an e2e test fails: describe output, events and logs.

`namespace_report` is what the conftest attaches to every failed test that ran in a test
namespace, and what the real-node tests print for the namespaces they spread over."""

from __future__ import annotations

from e2e.harness.cluster import KubeClient
from e2e.harness.operator import get_json

LOG_TAIL_LINES = 60
NODE_DESCRIBE_CHARS = 4000


def namespace_report(cluster: KubeClient, *namespaces: str) -> str:
    """Describe, events and logs of every pod in ``namespaces``, and the nodes they run on
    (every node when none is scheduled: why does none take them?)."""
    parts: list[str] = []
    nodes: set[str] = set()
    for ns in namespaces:
        for args in (
            ("get", "embeddingservices,deploy,rs,pods,svc,endpointslices,hpa", "-o", "wide"),
            ("describe", "embeddingservices,deploy,pods,hpa"),
            ("get", "events", "--sort-by=.lastTimestamp"),
        ):
            out = cluster.kubectl(*args, "-n", ns, check=False)
            parts.append(f"$ kubectl {' '.join(args)} -n {ns}\n{out.stdout}{out.stderr}")
        listing = get_json(cluster, "pods", "-n", ns) or {}
        for pod in listing.get("items", []):
            name = pod["metadata"]["name"]
            nodes.add(pod["spec"].get("nodeName") or "")
            out = cluster.kubectl(
                "logs", "-n", ns, name, "--all-containers", f"--tail={LOG_TAIL_LINES}", check=False
            )
            parts.append(f"$ kubectl logs -n {ns} {name}\n{out.stdout}{out.stderr}")
    names = sorted(nodes - {""}) or [
        n["metadata"]["name"] for n in (get_json(cluster, "nodes") or {}).get("items", [])
    ]
    for node_name in names:
        out = cluster.kubectl("describe", "node", node_name, check=False)
        parts.append(f"$ kubectl describe node {node_name}\n{out.stdout[-NODE_DESCRIBE_CHARS:]}")
    return "\n\n".join(parts)

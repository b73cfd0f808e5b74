"""Every manifest in examples/ converges on the real control plane.

``kubectl apply -f examples/<file>`` with the operator running (as its least-privilege
ServiceAccount) yields a Deployment, a Service and, when autoscaled, an HPA with the fields the
spec asks for; the pods run on fake nodes with the matching GPU product; the EmbeddingService
reports Ready for its current generation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.cluster import Cluster
from e2e.harness.operator import (
    EXAMPLES_DIR,
    OperatorProcess,
    apply_file,
    get_json,
    pods,
    provide_volume,
    wait_condition,
)
from e2e.harness.proc import poll_until

# The examples' GPU pods run on kwok's fake nodes (test_real_node.py serves them for real).
pytestmark = pytest.mark.kwok

EXAMPLES = [
    path
    for path in sorted(EXAMPLES_DIR.glob("*.yaml"))
    if {doc.get("kind") for doc in yaml.safe_load_all(path.read_text()) if doc}
    == {"EmbeddingService"}
]
"""The EmbeddingService examples (examples/embeddingjob.yaml needs a store and a corpus)."""
PRODUCT_LABEL = "nvidia.com/gpu.product"
PRODUCTS = {"h100": "NVIDIA-H100-80GB-HBM3", "l4": "NVIDIA-L4"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_converges(
    path: Path, cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    # A file may hold several services (hybrid-search-l4.yaml: an embedder and a reranker).
    manifests: list[dict[str, Any]] = list(yaml.safe_load_all(path.read_text()))
    for manifest in manifests:
        name, spec = manifest["metadata"]["name"], manifest["spec"]
        if spec.get("modelCache", {}).get("mode") == "pvc":
            provide_volume(cluster, namespace, f"{name}-model-cache", spec["modelCache"]["size"])

    apply_file(cluster, path, namespace)
    for manifest in manifests:
        _converged(cluster, namespace, manifest)


def _converged(cluster: Cluster, namespace: str, manifest: dict[str, Any]) -> None:
    """One EmbeddingService of an applied example is Ready with what its spec asks for."""
    name, spec = manifest["metadata"]["name"], manifest["spec"]
    # Ready turns True once one replica serves; every replica is ready once Progressing is
    # False.
    wait_condition(cluster, namespace, name, "Progressing", "False", reason="RolloutComplete")
    es = wait_condition(cluster, namespace, name, "Ready", "True")
    autoscaled = spec.get("autoscaling", {}).get("enabled", False)
    want_replicas = (
        spec.get("autoscaling", {}).get("minReplicas", 1) if autoscaled else spec.get("replicas", 1)
    )
    status = es["status"]
    assert status["readyReplicas"] == want_replicas == status["replicas"]
    assert status["endpoint"] == f"http://{name}.{namespace}.svc.cluster.local:80/v1"
    assert (
        status["selector"] == f"app.kubernetes.io/instance={name},"
        "app.kubernetes.io/name=embedding-server"
    )

    deployment = get_json(cluster, "deployment", name, "-n", namespace)
    assert deployment is not None
    (owner,) = deployment["metadata"]["ownerReferences"]
    assert owner["kind"] == "EmbeddingService" and owner["controller"] is True
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "serve"
    assert args[args.index("--model") + 1] == spec["model"]["name"]
    gpu_type = spec.get("gpu", {}).get("type", "cpu")
    tp = spec.get("parallelism", {}).get("tensorParallelSize", 1)
    limits = container["resources"].get("limits", {})
    if gpu_type == "cpu":
        assert "nvidia.com/gpu" not in limits
    else:
        assert limits["nvidia.com/gpu"] == str(tp)
        assert (
            deployment["spec"]["template"]["spec"]["nodeSelector"][PRODUCT_LABEL]
            == PRODUCTS[gpu_type]
        )

    service = get_json(cluster, "service", name, "-n", namespace)
    assert service is not None
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"][0]["port"] == 80
    assert service["spec"]["ports"][0]["targetPort"] == "http"

    hpa = get_json(cluster, "hpa", name, "-n", namespace)
    if autoscaled:
        assert hpa is not None
        metric = hpa["spec"]["metrics"][0]
        assert metric["type"] == "Pods"
        assert (
            metric["pods"]["metric"]["name"]
            == {
                "backlogSeconds": "embedding_server_backlog_seconds",
                "queueRequests": "embedding_server_queue_requests",
                "queueTokens": "embedding_server_queue_tokens",
            }[spec["autoscaling"].get("metric", "backlogSeconds")]
        )
        assert metric["pods"]["target"]["type"] == "AverageValue"
    else:
        assert hpa is None

    running = poll_until(
        lambda: (
            [p for p in pods(cluster, namespace, name) if p["status"].get("phase") == "Running"]
            or None
        ),
        timeout=30,
        what=f"running pods of {name}",
    )
    for pod in running:
        node = get_json(cluster, "node", pod["spec"]["nodeName"])
        assert node is not None
        if gpu_type != "cpu":
            assert node["metadata"]["labels"][PRODUCT_LABEL] == PRODUCTS[gpu_type]
            assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= tp

    printed = cluster.kubectl("get", "embsvc", name, "-n", namespace).stdout
    assert spec["model"]["name"] in printed and gpu_type in printed

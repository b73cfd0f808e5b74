"""The e2e control plane is real: scheduling by extended resources onto fake GPU nodes,
garbage collection through ownerReferences, ServiceAccount tokens under RBAC, and real
kubectl and helm binaries driving it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.cluster import Cluster, poll_until

H100 = "NVIDIA-H100-80GB-HBM3"
VERSIONS = dict(
    line.split("=", 1)
    for line in (Path(__file__).parent / "versions.env").read_text().splitlines()
    if line and not line.startswith("#")
)


def _deployment(name: str, *, replicas: int, gpus: int = 0, product: str | None = None) -> str:
    resources: dict[str, Any] = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    pod_spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "registry.invalid/embedding-server:test",
                "resources": resources,
            }
        ],
    }
    if product:
        pod_spec["nodeSelector"] = {"nvidia.com/gpu.product": product}
    return json.dumps(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec},
            },
        }
    )


def _pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl_json(
        "get", "pods", "-n", namespace, "-l", selector
    )["items"]
    return items


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return pod.get("status", {}).get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


@pytest.mark.local_node  # our kubectl, the pinned version
@pytest.mark.kwok
def test_real_kubectl_sees_the_fake_nodes(cluster: Cluster) -> None:
    assert shutil.which("kubectl") == str(cluster.kubectl_bin)
    version = json.loads(
        subprocess.run(
            ["kubectl", "version", "-o", "json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    assert version["clientVersion"]["gitVersion"] == VERSIONS["KUBERNETES_VERSION"]
    assert version["serverVersion"]["gitVersion"] == VERSIONS["KUBERNETES_VERSION"]

    nodes = {n["metadata"]["name"]: n for n in cluster.kubectl_json("get", "nodes")["items"]}
    assert {"gpu-h100-0", "gpu-l4-0", "cpu-0"} <= set(nodes)
    assert nodes["gpu-h100-0"]["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert nodes["gpu-l4-0"]["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-L4"
    assert "nvidia.com/gpu" not in nodes["cpu-0"]["status"]["allocatable"]


@pytest.mark.kwok
def test_gpu_pods_run_only_on_the_requested_gpu_type(cluster: Cluster, namespace: str) -> None:
    cluster.apply(_deployment("h100", replicas=3, gpus=1, product=H100), namespace=namespace)

    def all_running() -> list[dict[str, Any]] | None:
        pods = _pods(cluster, namespace, "app=h100")
        return pods if len(pods) == 3 and all(_ready(p) for p in pods) else None

    pods = poll_until(all_running, timeout=90, what="3 H100 pods Running and Ready")
    assert {p["spec"]["nodeName"] for p in pods} == {"gpu-h100-0"}

    # The scheduler really counts the extended resource: 9 GPUs fit on no node.
    cluster.apply(_deployment("too-big", replicas=1, gpus=9, product=H100), namespace=namespace)

    def unschedulable() -> bool:
        pods = _pods(cluster, namespace, "app=too-big")
        conditions = pods[0].get("status", {}).get("conditions") or [] if pods else []
        return any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions
        )

    poll_until(unschedulable, timeout=60, what="the 9-GPU pod to be reported Unschedulable")
    assert not _pods(cluster, namespace, "app=too-big")[0]["spec"].get("nodeName")


@pytest.mark.kwok  # its pods run on cpu-0 without an image
def test_deleting_an_owner_garbage_collects_its_dependents(
    cluster: Cluster, namespace: str
) -> None:
    cluster.apply(_deployment("web", replicas=2), namespace=namespace)
    poll_until(
        lambda: len([p for p in _pods(cluster, namespace, "app=web") if _ready(p)]) == 2,
        timeout=90,
        what="2 web pods Ready",
    )
    assert cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", "app=web")["items"]

    owner = cluster.kubectl_json("create", "configmap", "owner", "-n", namespace)
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "dependent",
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "name": "owner",
                        "uid": owner["metadata"]["uid"],
                    }
                ],
            },
        },
        namespace=namespace,
    )

    cluster.kubectl("delete", "deployment", "web", "-n", namespace, "--wait=false")
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace, "--wait=false")

    def collected() -> bool:
        rs = cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", "app=web")
        dependent = cluster.kubectl(
            "get", "configmap", "dependent", "-n", namespace, "--ignore-not-found", "-o", "name"
        ).stdout.strip()
        return not rs["items"] and not _pods(cluster, namespace, "app=web") and not dependent

    poll_until(collected, timeout=90, what="ReplicaSet, Pods and dependent ConfigMap collected")


def test_service_account_kubeconfig_has_exactly_its_rbac(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    cluster.kubectl(
        "create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", namespace
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
        "-n",
        namespace,
    )
    config = cluster.service_account_kubeconfig(namespace, "reader")

    whoami = cluster.kubectl_json("auth", "whoami", kubeconfig=config)
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:reader"
    assert cluster.kubectl("get", "pods", kubeconfig=config).returncode == 0
    denied = cluster.kubectl("get", "secrets", kubeconfig=config, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr


@pytest.mark.local_node  # our helm, the pinned versions
@pytest.mark.kwok
def test_real_helm_installs_lists_and_uninstalls_a_chart(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    assert shutil.which("helm") == str(cluster.helm_bin)
    version = subprocess.run(
        ["helm", "version", "--short"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert version.strip() == VERSIONS["HELM_VERSION"]

    cluster.helm("create", str(tmp_path / "smoke"))
    (tmp_path / "smoke" / "templates" / "kube-version.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-kube-version\n"
        "data:\n  version: {{ .Capabilities.KubeVersion.Version | quote }}\n"
    )
    # Offline rendering assumes the Kubernetes minor helm was built for (ldflags).
    minor = ".".join(VERSIONS["KUBERNETES_VERSION"].split(".")[:2])
    rendered = cluster.helm("template", "smoke", str(tmp_path / "smoke")).stdout
    assert f'version: "{minor}.0"' in rendered

    cluster.helm(
        "install",
        "smoke",
        str(tmp_path / "smoke"),
        "-n",
        namespace,
        "--wait",
        "--timeout=2m",
        timeout=180,
    )
    releases = json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("smoke", "deployed")]
    server_version = cluster.kubectl_json(
        "get", "configmap", "smoke-kube-version", "-n", namespace
    )["data"]["version"]
    assert server_version == VERSIONS["KUBERNETES_VERSION"]
    assert any(_ready(p) for p in _pods(cluster, namespace, "app.kubernetes.io/instance=smoke"))

    cluster.helm("uninstall", "smoke", "-n", namespace, "--wait", "--timeout=2m", timeout=180)
    assert json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout) == []
    assert not cluster.kubectl_json("get", "deployments", "-n", namespace)["items"]

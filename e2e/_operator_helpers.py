"""The operator under e2e test: a real ``embedding-operator run`` subprocess, least privilege.

The operator runs as its own ServiceAccount bound to ``OPERATOR_RULES`` (the ClusterRole the
Helm chart is meant to ship), through a TokenRequest kubeconfig, so every e2e test also proves
the RBAC list complete: a missing verb shows up as a 403 in the operator's log and a test that
never converges.

Helpers poll with deadlines (``poll_until``) and never sleep-and-hope.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from _proc import Process, poll_until
from cluster import Cluster

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = REPO_ROOT / "examples"
GROUP = "embedding-operator.dev"
CONVERGE_TIMEOUT = 90.0

# The least privilege `embedding-operator run` needs (cluster-wide watch of all namespaces).
OPERATOR_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": [GROUP],
        "resources": ["embeddingservices"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {"apiGroups": [GROUP], "resources": ["embeddingservices/status"], "verbs": ["get", "patch"]},
    {"apiGroups": [GROUP], "resources": ["embeddingservices/finalizers"], "verbs": ["update"]},
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["services", "persistentvolumeclaims"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["autoscaling"],
        "resources": ["horizontalpodautoscalers"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]
# Leader election, in the operator's own namespace only.
LEASE_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    },
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def operator_binary() -> str:
    found = shutil.which("embedding-operator") or str(
        Path(sys.executable).parent / "embedding-operator"
    )
    return found


def install_rbac(cluster: Cluster, namespace: str, name: str = "embedding-operator") -> Path:
    """ServiceAccount + ClusterRole(Binding) + lease Role(Binding); a kubeconfig for it."""
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": namespace},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": f"{name}-{namespace}"},
            "rules": OPERATOR_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{name}-{namespace}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{name}-{namespace}",
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": f"{name}-leases", "namespace": namespace},
            "rules": LEASE_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{name}-leases", "namespace": namespace},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": f"{name}-leases",
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]
    cluster.apply(yaml.safe_dump_all(docs))
    cluster.wait_for_service_account(namespace, name)
    return cluster.service_account_kubeconfig(namespace, name)


@dataclass
class OperatorProcess:
    """One ``embedding-operator run`` subprocess."""

    cluster: Cluster
    kubeconfig: Path
    log_dir: Path
    extra_args: Sequence[str] = ()
    name: str = "embedding-operator"
    process: Process | None = None
    liveness_port: int = 0
    starts: int = 0

    def start(self) -> OperatorProcess:
        self.liveness_port = free_port()
        self.starts += 1
        env = self.cluster.env()
        env["KUBECONFIG"] = str(self.kubeconfig)
        env.pop("EMBEDDING_OPERATOR_NAMESPACES", None)
        argv = [
            operator_binary(),
            "run",
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--resync-seconds",
            "15",
            "--log-format",
            "json",
            *self.extra_args,
        ]
        log_path = self.log_dir / f"{self.name}-{self.starts}.log"
        self.process = Process.spawn(self.name, argv, log_path, detached=False, env=env)
        return self

    def wait_live(self, timeout: float = 60.0) -> None:
        """Until the liveness endpoint answers 200 (kopf, or the standby endpoint)."""
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"

        def probe() -> bool:
            assert self.process is not None
            self.process.ensure_running()
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    return bool(response.status == 200)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False

        poll_until(probe, timeout=timeout, what=f"{self.name} liveness", interval=0.2)

    def kill(self) -> None:
        """SIGKILL, as the OOM killer or a node failure would."""
        assert self.process is not None and self.process.popen is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def log_text(self) -> str:
        return "\n".join(
            p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{self.name}-*.log"))
        )


# --- reading state ----------------------------------------------------------------------------


def get_json(cluster: Cluster, *args: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr or "not found" in result.stderr:
            return None
        raise RuntimeError(f"kubectl get {' '.join(args)} failed: {result.stderr}")
    return dict(json.loads(result.stdout))


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def wait_condition(
    cluster: Cluster,
    namespace: str,
    name: str,
    kind: str,
    status: str,
    *,
    reason: str | None = None,
    timeout: float = CONVERGE_TIMEOUT,
    current_generation: bool = True,
) -> dict[str, Any]:
    """Poll the EmbeddingService until condition ``kind`` has ``status`` (and ``reason``)
    for its current generation; returns the object."""

    def probe() -> dict[str, Any] | None:
        obj = get_json(cluster, "embeddingservice", name, "-n", namespace)
        cond = condition(obj, kind)
        if obj is None or cond is None or cond["status"] != status:
            return None
        if reason is not None and cond["reason"] != reason:
            return None
        if current_generation and (
            cond.get("observedGeneration") != obj["metadata"]["generation"]
            or obj["status"].get("observedGeneration") != obj["metadata"]["generation"]
        ):
            return None
        return obj

    return poll_until(
        probe,
        timeout=timeout,
        what=f"{namespace}/{name} {kind}={status}" + (f" ({reason})" if reason else ""),
        interval=0.3,
    )


def wait_gone(cluster: Cluster, *args: str, timeout: float = 60.0) -> None:
    poll_until(
        lambda: get_json(cluster, *args) is None,
        timeout=timeout,
        what=f"{' '.join(args)} to be deleted",
        interval=0.5,
    )


def apply_file(cluster: Cluster, path: Path, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))


def apply_expect_refusal(
    cluster: Cluster, manifest: dict[str, Any], namespace: str
) -> subprocess.CompletedProcess[str]:
    result = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=False
    )
    assert result.returncode != 0, f"kubectl apply accepted an invalid manifest: {manifest}"
    return result


def embedding_service(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {"name": name},
        "spec": spec,
    }


def pods(cluster: Cluster, namespace: str, instance: str) -> list[dict[str, Any]]:
    listing = get_json(
        cluster, "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={instance}"
    )
    return list((listing or {}).get("items") or [])


# --- fixtures (imported by the e2e/test_operator_*.py modules) -------------------------------


def start_operator(
    cluster: Cluster,
    log_dir: Path,
    *,
    name: str = "embedding-operator",
    extra_args: Sequence[str] = (),
    system_namespace: str | None = None,
) -> OperatorProcess:
    """Install RBAC in a fresh system namespace and start one operator; wait until live."""
    namespace = system_namespace or cluster.create_namespace(
        f"embedding-operator-{secrets.token_hex(3)}"
    )
    kubeconfig = install_rbac(cluster, namespace)
    operator = OperatorProcess(
        cluster,
        kubeconfig,
        log_dir,
        name=name,
        extra_args=[*extra_args, "--lease-namespace", namespace],
    )
    operator.start()
    operator.wait_live()
    return operator

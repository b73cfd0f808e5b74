"""The operator under e2e test: a real ``embedding-operator run`` subprocess, least privilege.

The operator runs as the Helm chart's own ServiceAccount, bound to the chart's rendered RBAC
(``chart_rbac``), through a TokenRequest kubeconfig, so every e2e test also proves the chart's
rules complete: a missing verb shows up as a 403 in the operator's log and a test that never
converges.

Helpers poll with deadlines (``poll_until``) and never sleep-and-hope.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.cluster import KubeClient
from e2e.harness.proc import Process, free_port, poll_until

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = REPO_ROOT / "examples"
GROUP = "embedding-operator.dev"
CONVERGE_TIMEOUT = 90.0

CHART = REPO_ROOT / "charts" / "embedding-operator"
CLUSTER_SCOPED_KINDS = ("ClusterRole", "ClusterRoleBinding")


def operator_binary() -> str:
    found = shutil.which("embedding-operator") or str(
        Path(sys.executable).parent / "embedding-operator"
    )
    return found


def values_args(values: Mapping[str, Any], directory: Path) -> list[str]:
    """``--values <file>`` for helm, the file holding ``values``; nothing when they are empty
    (the local cluster installs the chart with its defaults)."""
    if not values:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"values-{secrets.token_hex(4)}.yaml"
    path.write_text(yaml.safe_dump(dict(values)))
    return ["--values", str(path)]


def chart_rbac(
    cluster: KubeClient, namespace: str, watch_namespaces: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """The chart's own ServiceAccount and RBAC for an operator in ``namespace``.

    Rendered with ``helm template`` so the e2e operator runs with exactly the permissions users
    install, not a copy of them. ``fullnameOverride`` keeps the names the operator defaults to
    (ServiceAccount and Lease ``embedding-operator``); cluster-scoped objects get the namespace
    as a suffix so the operators of several tests can coexist.
    """
    rendered = cluster.helm(
        "template",
        "embedding-operator",
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        "fullnameOverride=embedding-operator",
        "--set-json",
        f"watchNamespaces={json.dumps(list(watch_namespaces))}",
        "--show-only",
        "templates/serviceaccount.yaml",
        "--show-only",
        "templates/rbac.yaml",
    ).stdout
    docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
    for doc in docs:
        if doc["kind"] in CLUSTER_SCOPED_KINDS:
            doc["metadata"]["name"] += f"-{namespace}"
        if doc["kind"] == "ClusterRoleBinding":
            doc["roleRef"]["name"] += f"-{namespace}"
    assert {doc["kind"] for doc in docs} >= {"ServiceAccount", "ClusterRole", "Role"}, docs
    return docs


def install_rbac(
    cluster: KubeClient,
    namespace: str,
    name: str = "embedding-operator",
    watch_namespaces: Sequence[str] = (),
) -> Path:
    """Install the chart's ServiceAccount and RBAC; a TokenRequest kubeconfig for it."""
    cluster.apply(yaml.safe_dump_all(chart_rbac(cluster, namespace, watch_namespaces)))
    cluster.wait_for_service_account(namespace, name)
    return cluster.service_account_kubeconfig(namespace, name)


@dataclass
class OperatorProcess:
    """One ``embedding-operator run`` subprocess."""

    cluster: KubeClient
    kubeconfig: Path
    log_dir: Path
    extra_args: Sequence[str] = ()
    name: str = "embedding-operator"
    process: Process | None = None
    liveness_port: int = 0
    metrics_port: int = 0
    starts: int = 0

    def start(self) -> OperatorProcess:
        self.liveness_port = free_port()
        # The operator serves /metrics on every address, 8081 unless told: on a shared host
        # two operators (a leader-election test runs two beside the session's) would collide.
        self.metrics_port = free_port()
        self.starts += 1
        env = self.cluster.env()
        env["KUBECONFIG"] = str(self.kubeconfig)
        env.pop("EMBEDDING_OPERATOR_NAMESPACES", None)
        argv = [
            operator_binary(),
            "run",
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--metrics-port",
            str(self.metrics_port),
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


def get_json(cluster: KubeClient, *args: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr or "not found" in result.stderr:
            return None
        raise RuntimeError(f"kubectl get {' '.join(args)} failed: {result.stderr}")
    return dict(json.loads(result.stdout))


def field_of(obj: dict[str, Any] | None, *keys: str) -> Any:
    """``obj[keys[0]]...[keys[-1]]`` of a :func:`get_json` answer, each missing key read as
    an empty object and the last as None (``(obj or {}).get(a, {}).get(b)``)."""
    value: dict[str, Any] = obj or {}
    for key in keys[:-1]:
        value = value.get(key, {})
    return value.get(keys[-1])


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def wait_condition(
    cluster: KubeClient,
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


def wait_gone(cluster: KubeClient, *args: str, timeout: float = 60.0) -> None:
    poll_until(
        lambda: get_json(cluster, *args) is None,
        timeout=timeout,
        what=f"{' '.join(args)} to be deleted",
        interval=0.5,
    )


def apply_file(cluster: KubeClient, path: Path, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))


def apply_expect_refusal(
    cluster: KubeClient, manifest: dict[str, Any], namespace: str
) -> subprocess.CompletedProcess[str]:
    result = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=False
    )
    assert result.returncode != 0, f"kubectl apply accepted an invalid manifest: {manifest}"
    return result


def provide_volume(cluster: KubeClient, namespace: str, claim: str, size: str) -> str:
    """The test cluster has no provisioner: a static PV, pre-bound to the claim, stands in.
    Returns the PV's name (PVs are cluster-scoped: the caller deletes it)."""
    name = f"{namespace}-{claim}"[:253]
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "claimRef": {"namespace": namespace, "name": claim},
                "hostPath": {"path": f"/tmp/{name}"},
            },
        }
    )
    return name


def embedding_service(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {"name": name},
        "spec": spec,
    }


def pods(cluster: KubeClient, namespace: str, instance: str) -> list[dict[str, Any]]:
    listing = get_json(
        cluster, "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={instance}"
    )
    return list((listing or {}).get("items") or [])


CRD = "customresourcedefinition/embeddingservices.embedding-operator.dev"
CRDS = tuple(
    f"customresourcedefinition/{yaml.safe_load(path.read_text())['metadata']['name']}"
    for path in sorted((REPO_ROOT / "crds").glob("*.yaml"))
)
"""Every CRD in ``crds/`` (the chart templates each of them too)."""


def adopt_crd(cluster: KubeClient, release: str, namespace: str) -> None:
    """Hand the already-applied CRDs (``kubectl apply -f crds/``, as the cluster fixture does)
    to the release: Helm adopts an existing object carrying its ownership metadata, and refuses
    the install for any it finds without it. docs/helm.md gives users the same two commands."""
    for crd in CRDS:
        if get_json(cluster, crd) is None:
            continue
        cluster.kubectl("label", crd, "app.kubernetes.io/managed-by=Helm", "--overwrite")
        cluster.kubectl(
            "annotate",
            crd,
            f"meta.helm.sh/release-name={release}",
            f"meta.helm.sh/release-namespace={namespace}",
            "--overwrite",
        )


# --- fixtures (imported by the e2e/test_operator_*.py modules) -------------------------------


def start_operator(
    cluster: KubeClient,
    log_dir: Path,
    *,
    name: str = "embedding-operator",
    extra_args: Sequence[str] = (),
    system_namespace: str | None = None,
    watch_namespaces: Sequence[str] = (),
) -> OperatorProcess:
    """Install RBAC in a fresh system namespace and start one operator; wait until live."""
    namespace = system_namespace or cluster.create_namespace(
        f"embedding-operator-{secrets.token_hex(3)}"
    )
    kubeconfig = install_rbac(cluster, namespace, watch_namespaces=watch_namespaces)
    if watch_namespaces:
        extra_args = [*extra_args, "--namespaces", ",".join(watch_namespaces)]
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

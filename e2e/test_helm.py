"""The tested install path: the Helm chart on the real local control plane.

The user's story, in order: ``helm lint``; ``helm template`` accepted by the API server
(server-side dry run); ``helm install``; the operator running with exactly the chart's
ServiceAccount (a TokenRequest token) and the chart's ConfigMap, converging an example
EmbeddingService, and refused what its RBAC does not grant; ``helm upgrade`` rolling the
operator and updating the CRD; ``helm uninstall`` removing everything but the CRD it keeps.

On the local cluster the operator Deployment's pods land on kwok fake nodes (Running without
a container); the real operator is a local ``embedding-operator run`` subprocess given the same
identity and configuration the pod would have. On an existing cluster (``E2E_KUBECONFIG``) the
operator pod runs for real, from the image the settings name, and the test that needs kwok's
GPU nodes is skipped. The tests share one release and run in file order.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.cluster import KubeClient
from e2e.harness.operator import (
    adopt_crd,
    field_of,
    get_json,
    provide_volume,
    values_args,
    wait_condition,
    wait_gone,
)
from e2e.harness.proc import Process, free_port, poll_until

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART = REPO_ROOT / "charts" / "embedding-operator"
EXAMPLES = [
    path
    for path in sorted((REPO_ROOT / "examples").glob("*.yaml"))
    if {doc.get("kind") for doc in yaml.safe_load_all(path.read_text()) if doc}
    == {"EmbeddingService"}
]
"""The EmbeddingService examples: examples/embeddingjob.yaml needs a store and a corpus (it
was waited on as a service named corpus-minilm, which never came)."""
EXAMPLE = REPO_ROOT / "examples" / "bge-h100.yaml"  # autoscaled: has an HPA to edit
CANONICAL_CRD = REPO_ROOT / "crds" / "embeddingservices.yaml"
CRD = "customresourcedefinition/embeddingservices.embedding-operator.dev"
KEEP = "helm.sh/resource-policy"
RELEASE = "eo"
FULLNAME = f"{RELEASE}-embedding-operator"  # the chart's fullname for this release name
HELM_TIMEOUT_S = 180.0
CONVERGE_TIMEOUT_S = 120.0


def helm(cluster: KubeClient, *args: str, check: bool = True) -> Any:
    return cluster.helm(*args, check=check, timeout=HELM_TIMEOUT_S)


def sa_user(namespace: str, name: str = FULLNAME) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def can_i(cluster: KubeClient, user: str, *args: str) -> bool:
    result = cluster.kubectl("auth", "can-i", *args, f"--as={user}", check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), result.stderr
    return answer == "yes"


@pytest.fixture(scope="module")
def chart_args(chart_values: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The values every install here takes (on an existing cluster: its images and values)."""
    return values_args(chart_values, tmp_path_factory.mktemp("chart-values"))


@pytest.fixture(scope="module")
def release_namespace(cluster: KubeClient) -> Iterator[str]:
    name = cluster.create_namespace(f"embedding-operator-system-{secrets.token_hex(3)}")
    yield name
    helm(cluster, "uninstall", RELEASE, "--namespace", name, "--ignore-not-found", "--wait")
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def test_lint_and_server_side_dry_run(
    cluster: KubeClient, release_namespace: str, namespace: str, chart_args: list[str]
) -> None:
    lint = helm(cluster, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in lint.stdout
    for values in (
        [],
        ["--set-json", f'watchNamespaces=["{namespace}"]', "--set", "replicaCount=2"],
    ):
        rendered = helm(
            cluster,
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            release_namespace,
            *chart_args,
            *values,
        ).stdout
        kinds = [doc["kind"] for doc in yaml.safe_load_all(rendered) if doc]
        result = cluster.kubectl(
            "apply", "--dry-run=server", "-f", "-", input=rendered, check=False
        )
        assert result.returncode == 0, result.stderr
        # Every object went through admission and validation, none was skipped.
        assert result.stdout.count("(server dry run)") == len(kinds), result.stdout


def test_install(cluster: KubeClient, release_namespace: str, chart_args: list[str]) -> None:
    adopt_crd(cluster, RELEASE, release_namespace)
    installed = helm(
        cluster,
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        release_namespace,
        *chart_args,
        "--wait",
        "--timeout",
        f"{HELM_TIMEOUT_S:.0f}s",
    )
    # NOTES.txt tells the user the next commands.
    assert f"rollout status deployment/{FULLNAME}" in installed.stdout
    assert "kubectl apply" in installed.stdout
    deployment = get_json(cluster, "deployment", FULLNAME, "-n", release_namespace)
    assert deployment is not None
    assert deployment["status"].get("availableReplicas") == 1
    crd = get_json(cluster, CRD)
    assert crd is not None
    assert crd["metadata"]["annotations"][KEEP] == "keep"
    assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
    established = [c for c in crd["status"]["conditions"] if c["type"] == "Established"]
    assert established and established[0]["status"] == "True"


def operator_env(cluster: KubeClient, release_namespace: str, workdir: Path) -> dict[str, str]:
    """What the chart's operator pod would get: its ConfigMap's settings and GPU profile file,
    its identity, and a kubeconfig holding a TokenRequest token of the chart's ServiceAccount.
    Only the liveness and metrics ports move to free ports (the chart's are fixed, and this
    operator is a host process beside others)."""
    configmap = get_json(cluster, "configmap", f"{FULLNAME}-config", "-n", release_namespace)
    assert configmap is not None
    data: dict[str, str] = configmap["data"]
    profiles = workdir / "gpu-profiles.yaml"
    profiles.write_text(data["gpu-profiles.yaml"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_OPERATOR_")}
    env.update({k: v for k, v in data.items() if k.startswith("EMBEDDING_OPERATOR_")})
    env["EMBEDDING_OPERATOR_GPU_PROFILES"] = str(profiles)
    env["EMBEDDING_OPERATOR_LIVENESS"] = f"http://127.0.0.1:{free_port()}/healthz"
    env["EMBEDDING_OPERATOR_METRICS_PORT"] = str(free_port())
    env["EMBEDDING_OPERATOR_IDENTITY"] = "e2e-helm-operator"
    env["POD_NAMESPACE"] = release_namespace
    env["KUBECONFIG"] = str(
        cluster.service_account_kubeconfig(
            release_namespace, FULLNAME, path=workdir / "operator.kubeconfig"
        )
    )
    return env


def start_operator(env: dict[str, str], log_path: Path) -> Process:
    binary = Path(sys.executable).parent / "embedding-operator"
    process = Process.spawn(
        "embedding-operator", [str(binary), "run"], log_path, detached=False, env=env
    )
    url = env["EMBEDDING_OPERATOR_LIVENESS"]

    def live() -> bool:
        import urllib.error
        import urllib.request

        process.ensure_running()
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    poll_until(live, timeout=60, what="the operator's liveness endpoint")
    return process


def rbac_denials(log: str) -> list[str]:
    """The operator's log lines that carry a 403, less the API server's refusal to create in a
    namespace being deleted: the operator watches every namespace, and an earlier test's
    namespace may still be terminating with an EmbeddingService in it (seen in CI). That 403
    ("unable to create new content in namespace ... because it is being terminated") says
    nothing about the chart's RBAC; every other one might."""
    return [
        line
        for line in log.splitlines()
        if ("Forbidden" in line or " 403" in line) and "because it is being terminated" not in line
    ]


# Every child kind the operator can create, and which example makes it.
CHILD_KINDS = {
    "Deployment": "deployment",
    "Service": "service",
    "HorizontalPodAutoscaler": "horizontalpodautoscaler",
    "PodDisruptionBudget": "poddisruptionbudget",
    "PersistentVolumeClaim": "persistentvolumeclaim",
}


@pytest.mark.kwok  # the examples' GPU pods Running on its fake GPU nodes
def test_operator_runs_with_the_charts_service_account(
    cluster: KubeClient, release_namespace: str, namespace: str, tmp_path: Path
) -> None:
    """Every example converges under the chart's RBAC; together they make every child kind,
    so a verb missing from the chart for any of them fails here (with the 403 printed)."""
    env = operator_env(cluster, release_namespace, tmp_path)
    operator = start_operator(env, tmp_path / "operator.log")
    volumes: list[str] = []
    try:
        names = []
        for path in EXAMPLES:
            # A file may hold several services (hybrid-search-l4.yaml).
            for manifest in yaml.safe_load_all(path.read_text()):
                name, spec = manifest["metadata"]["name"], manifest["spec"]
                cache = spec.get("modelCache", {})
                if cache.get("mode") == "pvc":
                    volumes.append(
                        provide_volume(cluster, namespace, f"{name}-model-cache", cache["size"])
                    )
                names.append(name)
            cluster.kubectl("apply", "-n", namespace, "-f", str(path))
        made: set[str] = set()
        for name in names:
            es = wait_condition(
                cluster, namespace, name, "Ready", "True", timeout=CONVERGE_TIMEOUT_S
            )
            assert es["status"]["observedGeneration"] == es["metadata"]["generation"]
            for kind, resource in CHILD_KINDS.items():
                child = get_json(cluster, resource, name, "-n", namespace) or get_json(
                    cluster, resource, f"{name}-model-cache", "-n", namespace
                )
                if child is None:
                    continue
                (owner,) = child["metadata"]["ownerReferences"]
                assert owner["uid"] == es["metadata"]["uid"], f"{kind} {name} not owned"
                made.add(kind)
        assert made == set(CHILD_KINDS), f"the examples never made {set(CHILD_KINDS) - made}"

        # An edit converges too (patch rights on children, status for the new generation).
        name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
        patch = {"spec": {"autoscaling": {"maxReplicas": 6}}}
        cluster.kubectl(
            "patch", "embsvc", name, "-n", namespace, "--type=merge", "-p", json.dumps(patch)
        )
        wait_condition(cluster, namespace, name, "Ready", "True", timeout=CONVERGE_TIMEOUT_S)
        poll_until(
            lambda: (
                field_of(get_json(cluster, "hpa", name, "-n", namespace), "spec", "maxReplicas")
                == 6
            ),
            timeout=CONVERGE_TIMEOUT_S,
            what="the HPA to follow the edit",
        )
        # Leader election used the chart's Lease, in the release namespace.
        lease = get_json(cluster, "lease", FULLNAME, "-n", release_namespace)
        assert lease is not None
        assert lease["spec"]["holderIdentity"] == env["EMBEDDING_OPERATOR_IDENTITY"]
        log = operator.log_path.read_text(errors="replace")
        assert not rbac_denials(log), "\n".join(rbac_denials(log))
        cluster.kubectl("delete", "embsvc", "--all", "-n", namespace, "--timeout=60s")
    except BaseException:
        # A missing RBAC rule shows up here as a 403 in the operator's log.
        print(operator.log_tail(20))
        raise
    finally:
        operator.stop()
        for volume in volumes:
            cluster.kubectl("delete", "pv", volume, "--wait=false", "--ignore-not-found")


@pytest.mark.parametrize(
    ("allowed", "args"),
    [
        (True, ("create", "deployments.apps", "--all-namespaces")),
        (
            True,
            (
                "patch",
                "embeddingservices.embedding-operator.dev",
                "--subresource=status",
                "-n",
                "default",
            ),
        ),
        (True, ("delete", "horizontalpodautoscalers.autoscaling", "-n", "default")),
        (True, ("create", "networkpolicies.networking.k8s.io", "-n", "default")),
        (True, ("watch", "pods", "--all-namespaces")),
        (False, ("get", "secrets", "-n", "default")),
        (False, ("delete", "nodes")),
        (False, ("list", "secrets", "-n", "default")),
        (False, ("create", "pods", "--subresource=exec", "-n", "default")),
        (False, ("create", "pods", "-n", "default")),
        (False, ("delete", "embeddingservices.embedding-operator.dev", "-n", "default")),
        (False, ("delete", "customresourcedefinitions.apiextensions.k8s.io")),
        (False, ("create", "clusterrolebindings.rbac.authorization.k8s.io")),
        (False, ("update", "leases.coordination.k8s.io", "-n", "default")),
    ],
)
def test_rbac_grants_only_what_the_operator_uses(
    cluster: KubeClient, release_namespace: str, allowed: bool, args: tuple[str, ...]
) -> None:
    assert can_i(cluster, sa_user(release_namespace), *args) is allowed


def test_rbac_leader_lease_is_named(cluster: KubeClient, release_namespace: str) -> None:
    user = sa_user(release_namespace)
    ns = ("-n", release_namespace)
    assert can_i(cluster, user, "update", f"leases.coordination.k8s.io/{FULLNAME}", *ns)
    assert not can_i(cluster, user, "update", "leases.coordination.k8s.io/other", *ns)
    assert can_i(cluster, user, "create", "leases.coordination.k8s.io", *ns)


def test_upgrade_updates_operator_and_crd(cluster: KubeClient, release_namespace: str) -> None:
    before = get_json(cluster, "deployment", FULLNAME, "-n", release_namespace)
    assert before is not None
    marker = secrets.token_hex(4)
    helm(
        cluster,
        "upgrade",
        RELEASE,
        str(CHART),
        "--namespace",
        release_namespace,
        "--reuse-values",
        "--set",
        "operator.logLevel=debug",
        # --set-string: a marker of hex digits only (2% of them) would otherwise reach the
        # chart's schema as a number, which a label value is not.
        "--set-string",
        f"crds.labels.e2e-upgrade={marker}",
        "--wait",
        "--timeout",
        f"{HELM_TIMEOUT_S:.0f}s",
    )
    after = get_json(cluster, "deployment", FULLNAME, "-n", release_namespace)
    assert after is not None
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    annotations = after["spec"]["template"]["metadata"]["annotations"]
    assert (
        annotations["checksum/config"]
        != before["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    )
    configmap = get_json(cluster, "configmap", f"{FULLNAME}-config", "-n", release_namespace)
    assert configmap is not None and configmap["data"]["EMBEDDING_OPERATOR_LOG_LEVEL"] == "debug"
    poll_until(
        lambda: (
            field_of(
                get_json(cluster, "deployment", FULLNAME, "-n", release_namespace),
                "status",
                "updatedReplicas",
            )
            == 1
        ),
        timeout=HELM_TIMEOUT_S,
        what="the operator rollout",
    )
    # The CRD is a templated resource, so the upgrade reached it (crds/ would not have).
    crd = get_json(cluster, CRD)
    assert crd is not None and crd["metadata"]["labels"]["e2e-upgrade"] == marker
    canonical = yaml.safe_load(CANONICAL_CRD.read_text())
    assert crd["spec"]["versions"][0]["schema"] == canonical["spec"]["versions"][0]["schema"]
    history = json.loads(
        helm(cluster, "history", RELEASE, "--namespace", release_namespace, "-o", "json").stdout
    )
    assert [h["status"] for h in history][-1] == "deployed" and len(history) == 2


def test_uninstall_keeps_only_the_crd(
    cluster: KubeClient, release_namespace: str, namespace: str
) -> None:
    # An EmbeddingService that must survive uninstall with the CRD (no operator runs now).
    cluster.apply(
        {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingService",
            "metadata": {"name": "survivor"},
            "spec": {"model": {"name": "m"}},
        },
        namespace=namespace,
    )
    helm(
        cluster,
        "uninstall",
        RELEASE,
        "--namespace",
        release_namespace,
        "--wait",
        "--timeout",
        f"{HELM_TIMEOUT_S:.0f}s",
    )
    for args in (
        ("deployment", FULLNAME, "-n", release_namespace),
        ("serviceaccount", FULLNAME, "-n", release_namespace),
        ("configmap", f"{FULLNAME}-config", "-n", release_namespace),
        ("role", f"{FULLNAME}-leader-election", "-n", release_namespace),
        ("clusterrole", FULLNAME),
        ("clusterrolebinding", FULLNAME),
    ):
        wait_gone(cluster, *args, timeout=60)
    assert get_json(cluster, CRD) is not None, "crds.keep=true must keep the CRD"
    assert get_json(cluster, "embeddingservice", "survivor", "-n", namespace) is not None
    listed = helm(cluster, "list", "--namespace", release_namespace, "-q").stdout.split()
    assert RELEASE not in listed


def test_namespaced_install(cluster: KubeClient, namespace: str, chart_args: list[str]) -> None:
    """watchNamespaces: workload rights in the listed namespaces only, none elsewhere."""
    system = cluster.create_namespace(f"eo-ns-system-{secrets.token_hex(3)}")
    release = "eo-ns"
    try:
        # The CRD belongs to the other release (kept); this one must not manage it.
        helm(
            cluster,
            "install",
            release,
            str(CHART),
            "--namespace",
            system,
            *chart_args,
            "--set-json",
            f'watchNamespaces=["{namespace}"]',
            "--set",
            "crds.install=false",
            "--wait",
            "--timeout",
            f"{HELM_TIMEOUT_S:.0f}s",
        )
        user = sa_user(system, f"{release}-embedding-operator")
        assert can_i(cluster, user, "create", "deployments.apps", "-n", namespace)
        assert can_i(
            cluster, user, "watch", "embeddingservices.embedding-operator.dev", "-n", namespace
        )
        assert not can_i(cluster, user, "create", "deployments.apps", "-n", "default")
        assert not can_i(
            cluster, user, "list", "embeddingservices.embedding-operator.dev", "--all-namespaces"
        )
        assert can_i(cluster, user, "list", "namespaces")  # kopf tracks the listed ones
        assert not can_i(cluster, user, "delete", "namespaces")
    finally:
        helm(cluster, "uninstall", release, "--namespace", system, "--ignore-not-found", "--wait")
        cluster.kubectl("delete", "namespace", system, "--wait=false", "--ignore-not-found")

"""The Helm chart, checked without a cluster: CRD drift, values schema, and rendered output.

The chart's CRD is a copy of the canonical ``crds/embeddingservices.yaml`` (Helm can only read
files inside the chart); the first test fails the moment the two differ. The rendering tests
run the real ``helm template`` (the binary the e2e tier builds into ~/.cache; ``make test``
builds it before the unit tests run) and check what a cluster admin relies on: least-privilege
RBAC that still covers every call the operator makes, a hardened operator pod, configuration
the operator actually accepts, and a CRD that ``helm upgrade`` updates.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from e2e.harness.binaries import COMPONENTS, component_dir, read_versions

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "embedding-operator"
CANONICAL_CRD = ROOT / "crds" / "embeddingservices.yaml"
CHART_CRD = CHART / "files" / "crds" / "embeddingservices.yaml"
CRD_NAME = "embeddingservices.embedding-operator.dev"
JOB_CRD_NAME = "embeddingjobs.embedding-operator.dev"
KEEP = "helm.sh/resource-policy"
RENDER_TIMEOUT_S = 60

Manifest = dict[str, Any]


# --- no helm needed --------------------------------------------------------------------------


def test_chart_crd_is_the_canonical_crd() -> None:
    assert CHART_CRD.read_bytes() == CANONICAL_CRD.read_bytes(), (
        "the chart's CRD drifted from crds/embeddingservices.yaml; sync it with:\n"
        f"  cp {CANONICAL_CRD.relative_to(ROOT)} {CHART_CRD.relative_to(ROOT)}"
    )


def test_no_chart_comment_says_the_operator_reads_secrets() -> None:
    """The chart grants no access to Secrets (``assert_workload_rules``); an admin reading the
    templates must not be told otherwise."""
    claims = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in [CHART / "values.yaml", *sorted((CHART / "templates").iterdir())]
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(r"\bsecrets?\b", line, re.IGNORECASE)
        and re.search(r"\breads?\b", line, re.IGNORECASE)
        and not re.search(r"\b(never|no|not|cannot)\b", line, re.IGNORECASE)
    ]
    assert not claims, claims


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(loaded)
    return loaded


@pytest.fixture(scope="module")
def default_values() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "values.yaml").read_text()))


def test_values_yaml_satisfies_its_schema(
    schema: dict[str, Any], default_values: dict[str, Any]
) -> None:
    jsonschema.validate(default_values, schema)


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ({"replica": 2}, "a typo of replicaCount"),
        ({"replicaCount": "2"}, "a string where a number belongs"),
        ({"watchNamespaces": ["team-*"]}, "a glob: a Role cannot be created for a pattern"),
        ({"gpuProfiles": {"h100": {"resourcename": "nvidia.com/gpu"}}}, "a misspelt profile key"),
        ({"operator": {"logLevel": "verbose"}}, "a log level the operator does not know"),
        ({"image": {"repository": "x", "digest": "latest"}}, "a digest that is not sha256"),
        ({"policy": {"allowedServiceTypes": ["ExternalName"]}}, "a type the CRD never renders"),
        ({"policy": {"allowedEnv": ["HF_ENDPOINT,HTTPS_PROXY"]}}, "a list in one string"),
        ({"autoscaling": {"defaultAutoscaler": "KEDA"}}, "an autoscaler the operator lacks"),
        (
            {"autoscaling": {"keda": {"prometheusAddress": "prometheus:9090"}}},
            "an address KEDA cannot use (no scheme)",
        ),
        ({"operator": {"metricsPort": "8081"}}, "a port as a string"),
        (
            {"monitoring": {"prometheusRule": {"alerts": {"EmbeddingServiceSlow": {"for": "10"}}}}},
            "a duration without a unit",
        ),
        (
            {"monitoring": {"prometheusRule": {"alerts": {"EmbeddingServiceSlow": {"limit": 1}}}}},
            "a misspelt override (threshold)",
        ),
        ({"monitoring": {"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}}}, "a number"),
        ({"gateway": {"replica": 2}}, "a typo of gateway.replicas"),
        ({"gateway": {"replicas": 0}}, "a gateway that is enabled with no pod"),
        ({"gateway": {"service": {"type": "ExternalName"}}}, "a Service type with no pods"),
        ({"gateway": {"holdTimeoutSeconds": "30s"}}, "a duration as a string"),
        ({"gateway": {"holdTimeoutSeconds": 300000}}, "milliseconds given for seconds"),
        ({"gateway": {"requestTimeoutSeconds": 0}}, "a request that may take no time"),
        ({"gateway": {"maxBufferedMiB": "128Mi"}}, "a quantity, not a number of MiB"),
        ({"gateway": {"maxBufferedMiB": 8}}, "a budget smaller than the largest body"),
        ({"gateway": {"maxConnections": 0}}, "a gateway that takes no connection"),
        ({"gateway": {"bulkApiKeysSecret": {"name": "Keys"}}}, "a Secret name in capitals"),
        ({"gateway": {"bulkApiKeysSecret": {"name": "k", "key": ""}}}, "an empty Secret key"),
        ({"gateway": {"bulkApiKeysSecret": {"secretName": "k"}}}, "a typo of name"),
    ],
)
def test_schema_refuses_mistakes(
    schema: dict[str, Any], default_values: dict[str, Any], override: dict[str, Any], why: str
) -> None:
    values = _deep_merge(default_values, override)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, schema)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# --- helm template ---------------------------------------------------------------------------


def find_helm() -> Path | None:
    """$HELM, else the e2e build cache (e2e.harness.binaries), else PATH."""
    if os.environ.get("HELM"):
        return Path(os.environ["HELM"])
    helm = next(c for c in COMPONENTS if c.name == "helm")
    built = Path(component_dir(helm, read_versions()[helm.version_key])) / "helm"
    if built.is_file():
        return built
    found = shutil.which("helm")
    return Path(found) if found else None


@pytest.fixture(scope="module")
def helm() -> Path:
    path = find_helm()
    if path is None:
        pytest.skip("no helm binary: run `make binaries` (make test does) to build it")
    return path


def _helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), *args], capture_output=True, text=True, timeout=RENDER_TIMEOUT_S, check=False
    )


def _set_json_args(values: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in values.items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def render_with(
    helm: Path, values: dict[str, Any], namespace: str = "ops"
) -> subprocess.CompletedProcess[str]:
    return _helm(
        helm, "template", "eo", str(CHART), "--namespace", namespace, *_set_json_args(values)
    )


def objects(
    helm: Path, values: dict[str, Any] | None = None, namespace: str = "ops"
) -> list[Manifest]:
    proc = render_with(helm, values or {}, namespace)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def one(
    docs: Iterable[Manifest], kind: str, name: str | None = None, namespace: str | None = None
) -> Manifest:
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and (name is None or d["metadata"]["name"] == name)
        and (namespace is None or d["metadata"].get("namespace") == namespace)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def test_helm_lint_is_clean(helm: Path) -> None:
    proc = _helm(helm, "lint", "--strict", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    namespaced = _helm(
        helm,
        "lint",
        "--strict",
        str(CHART),
        "--set-json",
        'watchNamespaces=["a","b"]',
        "--set",
        "replicaCount=2",
    )
    assert namespaced.returncode == 0, namespaced.stdout + namespaced.stderr


def test_default_install_objects(helm: Path) -> None:
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in objects(helm))
    assert kinds == sorted(
        [
            "ClusterRole/eo-embedding-operator",
            "ClusterRoleBinding/eo-embedding-operator",
            "ConfigMap/eo-embedding-operator-config",
            f"CustomResourceDefinition/{CRD_NAME}",
            f"CustomResourceDefinition/{JOB_CRD_NAME}",
            "Deployment/eo-embedding-operator",
            "Role/eo-embedding-operator-leader-election",
            "RoleBinding/eo-embedding-operator-leader-election",
            "ServiceAccount/eo-embedding-operator",
        ]
    )


def test_rendered_crd_is_the_canonical_crd_plus_helm_metadata(helm: Path) -> None:
    canonical = yaml.safe_load(CANONICAL_CRD.read_text())
    crd = one(objects(helm, {"crds.labels": {"team": "ml"}}), "CustomResourceDefinition", CRD_NAME)
    assert crd["spec"] == canonical["spec"]
    assert crd["metadata"]["name"] == canonical["metadata"]["name"]
    assert crd["metadata"]["annotations"][KEEP] == "keep"
    assert crd["metadata"]["labels"]["team"] == "ml"
    for key, value in canonical["metadata"]["labels"].items():
        assert crd["metadata"]["labels"][key] == value


def test_crd_retention_and_opt_out(helm: Path) -> None:
    for name in (CRD_NAME, JOB_CRD_NAME):
        crd = one(objects(helm, {"crds.keep": False}), "CustomResourceDefinition", name)
        assert KEEP not in (crd["metadata"].get("annotations") or {})
    assert not [
        d for d in objects(helm, {"crds.install": False}) if d["kind"] == "CustomResourceDefinition"
    ]


def _env(deployment: Manifest, configmap: Manifest) -> dict[str, str]:
    """The operator container's environment, ConfigMap references resolved."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            assert ref["name"] == configmap["metadata"]["name"]
            env[var["name"]] = configmap["data"][ref["key"]]
    return env


def test_configuration_is_accepted_by_the_operator(
    helm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embedding_operator.profiles import GpuProfiles
    from embedding_operator.settings import OperatorSettings

    profile = {
        "resourceName": "nvidia.com/mig-3g.40gb",
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
    }
    docs = objects(
        helm,
        {
            "gpuProfiles": {"h100-mig": profile},
            "watchNamespaces": ["team-a", "team-b"],
            "serverImage": {"repository": "registry.example/srv", "tag": "1.2"},
            "policy": {
                "allowedImages": ["registry.example/*", "ghcr.io/x/srv:1"],
                "allowedPriorityClasses": ["inference"],
                "allowedEnv": ["HF_ENDPOINT", "HTTPS_PROXY"],
                "allowControlPlane": False,
                "allowedExtendedResources": ["example.com/*"],
                "allowedServiceTypes": ["ClusterIP"],
                "allowedServiceAnnotations": ["prometheus.io/*"],
            },
        },
    )
    configmap = one(docs, "ConfigMap")
    env = _env(one(docs, "Deployment"), configmap)
    prefixed = {k: v for k, v in env.items() if k.startswith("EMBEDDING_OPERATOR_")}
    for key in prefixed:
        field = key.removeprefix("EMBEDDING_OPERATOR_").lower()
        assert field in OperatorSettings.model_fields, f"{key} is no operator setting"
    for key in list(os.environ):
        if key.startswith("EMBEDDING_OPERATOR_"):
            monkeypatch.delenv(key)
    for key, value in prefixed.items():
        monkeypatch.setenv(key, value)
    from_env: dict[str, Any] = {}  # every field from the environment, as in the pod
    settings = OperatorSettings(**from_env)
    assert settings.namespaces == ["team-a", "team-b"]
    assert settings.default_image == "registry.example/srv:1.2"
    assert settings.policy.allowed_images == ("registry.example/*", "ghcr.io/x/srv:1")
    assert settings.policy.allowed_priority_classes == ("inference",)
    assert settings.policy.allowed_env == ("HF_ENDPOINT", "HTTPS_PROXY")
    assert settings.policy.allow_control_plane is False
    assert settings.policy.allowed_extended_resources == ("example.com/*",)
    assert settings.policy.allowed_service_types == ("ClusterIP",)
    assert settings.policy.allowed_service_annotations == ("prometheus.io/*",)
    assert settings.leader_elect is True
    assert settings.lease_namespace == "ops"
    assert str(settings.gpu_profiles) == "/etc/embedding-operator/gpu-profiles.yaml"
    # The profile file the Deployment mounts at that path.
    profiles_file = tmp_path / "gpu-profiles.yaml"
    profiles_file.write_text(configmap["data"]["gpu-profiles.yaml"])
    profiles = GpuProfiles.load(profiles_file)
    assert profiles.resolve("h100-mig").resource_name == "nvidia.com/mig-3g.40gb"
    assert profiles.resolve("l4").resource_name == "nvidia.com/gpu"  # built-ins stay


def test_default_configuration_has_no_profiles_but_the_builtins(helm: Path, tmp_path: Path) -> None:
    from embedding_operator.profiles import BUILTIN_PROFILES, GpuProfiles

    path = tmp_path / "p.yaml"
    path.write_text(one(objects(helm), "ConfigMap")["data"]["gpu-profiles.yaml"])
    assert GpuProfiles.load(path).names() == sorted(BUILTIN_PROFILES)


def test_operator_pod_is_hardened_and_probed(helm: Path) -> None:
    docs = objects(helm)
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["args"] == ["run"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    # The probe hits the endpoint the operator is told to serve (kopf's liveness URL).
    liveness_url = _env(deployment, one(docs, "ConfigMap"))["EMBEDDING_OPERATOR_LIVENESS"]
    probe = container["livenessProbe"]["httpGet"]
    port = next(p for p in container["ports"] if p["name"] == probe["port"])
    assert liveness_url == f"http://0.0.0.0:{port['containerPort']}{probe['path']}"
    # Leader identity is the pod name, so `kubectl get lease` names the leading pod.
    identity = next(v for v in container["env"] if v["name"] == "EMBEDDING_OPERATOR_IDENTITY")
    assert identity["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_config_change_rolls_the_operator(helm: Path) -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = one(objects(helm, values), "Deployment")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum({}) != checksum({"serverImage": {"repository": "r/s", "tag": "2"}})


def test_two_replicas_need_leader_election(helm: Path) -> None:
    assert one(objects(helm, {"replicaCount": 2}), "Deployment")["spec"]["replicas"] == 2
    refused = render_with(helm, {"replicaCount": 2, "leaderElection": {"enabled": False}})
    assert refused.returncode != 0
    assert "leaderElection.enabled" in refused.stderr
    single = one(objects(helm, {"leaderElection": {"enabled": False}}), "Deployment")
    assert single["spec"]["strategy"]["type"] == "Recreate"


def test_helm_enforces_the_values_schema(helm: Path) -> None:
    refused = render_with(helm, {"replica": 2})
    assert refused.returncode != 0
    assert "replica" in refused.stderr


# --- RBAC ------------------------------------------------------------------------------------


def grants(rules: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in rules:
        if (
            group in rule["apiGroups"]
            and resource in rule["resources"]
            and not rule.get("resourceNames")
        ):
            verbs |= set(rule["verbs"])
    return verbs


def _group(api_version: str) -> str:
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def operator_children() -> list[tuple[str, str]]:
    """(group, plural) of every child kind the operator watches and writes."""
    from embedding_operator.handlers import CHILD_RESOURCES

    return [(sel[0] if len(sel) == 3 else "", sel[-1]) for sel in CHILD_RESOURCES]


WORKLOAD_VERBS = {"get", "list", "watch", "create", "patch", "delete"}


def assert_workload_rules(rules: list[dict[str, Any]]) -> None:
    from embedding_operator.builders.common import GROUP, PLURAL

    for group, plural in operator_children():
        assert grants(rules, group, plural) == WORKLOAD_VERBS, plural
    assert grants(rules, GROUP, PLURAL) == {"get", "list", "watch", "patch"}
    assert grants(rules, GROUP, f"{PLURAL}/status") == {"patch"}
    assert grants(rules, GROUP, f"{PLURAL}/finalizers") == {"update"}  # blockOwnerDeletion
    # No Secret access at all (a missing one is reported from the pod's own status), and pods
    # only read, never written or exec'd into.
    assert not grants(rules, "", "secrets"), "the operator never reads Secrets"
    assert grants(rules, "", "pods") == {"list", "watch"}
    assert not grants(rules, "", "pods/exec")
    assert grants(rules, "", "events") == {"create"}


def assert_least_privilege(docs: list[Manifest]) -> None:
    for doc in docs:
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        for rule in doc["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{doc['metadata']['name']}: wildcard {key}"
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_cluster_wide_rbac(helm: Path) -> None:
    docs = objects(helm)
    assert_least_privilege(docs)
    cluster_role = one(docs, "ClusterRole")
    assert_workload_rules(cluster_role["rules"])
    assert grants(cluster_role["rules"], "apiextensions.k8s.io", "customresourcedefinitions") == {
        "list",
        "watch",
    }
    # Cluster-wide, kopf does not track namespaces; nodes and the like are never needed.
    assert not grants(cluster_role["rules"], "", "namespaces")
    assert not grants(cluster_role["rules"], "", "nodes")
    binding = one(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "eo-embedding-operator", "namespace": "ops"}
    ]


def test_namespaced_rbac(helm: Path) -> None:
    docs = objects(helm, {"watchNamespaces": ["team-a", "team-b"]})
    assert_least_privilege(docs)
    cluster_role = one(docs, "ClusterRole")
    assert {(tuple(r["apiGroups"]), tuple(r["resources"])) for r in cluster_role["rules"]} == {
        (("apiextensions.k8s.io",), ("customresourcedefinitions",)),
        (("",), ("namespaces",)),
    }
    for ns in ("team-a", "team-b"):
        role = one(docs, "Role", "eo-embedding-operator", ns)
        assert_workload_rules(role["rules"])
        binding = one(docs, "RoleBinding", "eo-embedding-operator", ns)
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"][0]["namespace"] == "ops"
    assert not [
        d
        for d in docs
        if d["kind"] == "Role" and d["metadata"]["namespace"] not in ("team-a", "team-b", "ops")
    ]


def test_leader_election_rbac_is_one_lease(helm: Path) -> None:
    docs = objects(helm, {"leaderElection": {"leaseName": "my-lease"}})
    role = one(docs, "Role", "eo-embedding-operator-leader-election", "ops")
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["my-lease"],
            "verbs": ["get", "update"],
        }
    ]
    assert grants(role["rules"], "coordination.k8s.io", "leases") == {"create"}
    env = _env(one(docs, "Deployment"), one(docs, "ConfigMap"))
    assert env["EMBEDDING_OPERATOR_LEASE_NAME"] == "my-lease"
    without = objects(helm, {"leaderElection": {"enabled": False}})
    assert not [d for d in without if d["kind"] == "Role"]


# --- monitoring and autoscaling glue ---------------------------------------------------------


def test_monitors_select_the_operators_server_pods(helm: Path) -> None:
    from embedding_operator.builders.common import PORT_NAME, Owner, common_labels

    server_labels = common_labels(Owner(name="any", namespace="x", uid=""))
    pod_monitor = one(
        objects(helm, {"monitoring": {"podMonitor": {"enabled": True}}}),
        "PodMonitor",
        "eo-embedding-operator-servers",
    )
    selector = pod_monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= server_labels.items()
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == PORT_NAME
    service_monitor = one(
        objects(
            helm, {"monitoring": {"serviceMonitor": {"enabled": True}}, "watchNamespaces": ["a"]}
        ),
        "ServiceMonitor",
        "eo-embedding-operator-servers",
    )
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= server_labels.items()
    assert service_monitor["spec"]["namespaceSelector"] == {"matchNames": ["a"]}
    both = render_with(
        helm, {"monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}}
    )
    assert both.returncode != 0
    assert not [d for d in objects(helm) if d["kind"] in ("PodMonitor", "ServiceMonitor")]


def test_adapter_rules_publish_every_metric_an_hpa_can_use(helm: Path) -> None:
    from embedding_operator.builders.hpa import METRICS

    docs = objects(
        helm,
        {"prometheusAdapter": {"namespace": "monitoring", "rulesConfigMap": {"enabled": True}}},
    )
    configmap = one(docs, "ConfigMap", "eo-embedding-operator-adapter-rules", "monitoring")
    rules = yaml.safe_load(configmap["data"]["config.yaml"])["rules"]
    published = {rule["name"]["as"] for rule in rules}
    assert set(METRICS.values()) <= published
    for rule in rules:
        # Per pod, so an HPA's Pods metric averages only its own Deployment's pods.
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }


# --- docs/autoscaling.md snippets ------------------------------------------------------------

DOCS = ROOT / "docs" / "autoscaling.md"


def yaml_blocks(path: Path) -> list[Any]:
    """Every ```yaml fenced block of a Markdown file, parsed (indented blocks included)."""
    blocks = re.findall(r"^( *)```yaml\n(.*?)^\1```", path.read_text(), re.S | re.M)
    return [yaml.safe_load(textwrap.dedent(body)) for _indent, body in blocks]


def test_documented_adapter_rules_are_the_charts(helm: Path) -> None:
    (documented,) = [b["rules"]["custom"] for b in yaml_blocks(DOCS) if "rules" in b]
    docs = objects(helm, {"prometheusAdapter": {"rulesConfigMap": {"enabled": True}}})
    configmap = one(docs, "ConfigMap", "eo-embedding-operator-adapter-rules")
    assert documented == yaml.safe_load(configmap["data"]["config.yaml"])["rules"]


def test_documented_keda_scaledobject_is_what_the_operator_writes() -> None:
    from dataclasses import replace

    from embedding_operator.builders.common import AutoscalingDefaults
    from embedding_operator.builders.keda import build_scaled_object

    from tests.support.operator import render_input

    blocks = yaml_blocks(DOCS)
    (service,) = [b for b in blocks if b.get("kind") == "EmbeddingService"]
    (scaled,) = [b for b in blocks if b.get("kind") == "ScaledObject"]
    (trigger,) = scaled["spec"]["triggers"]
    render = replace(
        render_input(
            service["spec"],
            name=service["metadata"]["name"],
            namespace=service["metadata"]["namespace"],
        ),
        # The operator's default is hpa: the documented service asks for keda by name.
        autoscaling=AutoscalingDefaults(
            autoscaler="hpa", prometheus_address=trigger["metadata"]["serverAddress"]
        ),
    )
    written = build_scaled_object(render)
    assert (scaled["apiVersion"], scaled["kind"]) == (written["apiVersion"], written["kind"])
    assert scaled["spec"] == written["spec"]


# --- the operator's metrics endpoint, alerts and the dashboard -------------------------------


def test_the_operator_pod_serves_metrics_the_monitors_scrape(helm: Path) -> None:
    docs = objects(helm, {"monitoring": {"podMonitor": {"enabled": True}}})
    deployment = one(docs, "Deployment")
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    port = next(p for p in container["ports"] if p["name"] == "metrics")
    env = _env(deployment, one(docs, "ConfigMap"))
    assert env["EMBEDDING_OPERATOR_METRICS_PORT"] == str(port["containerPort"]) == "8081"
    # Annotation-based scrape configs find it too (the e2e cluster's Prometheus does).
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8081"
    monitor = one(docs, "PodMonitor", "eo-embedding-operator-operator")
    assert (
        monitor["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    )
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    # Per-service series carry their EmbeddingService's namespace: keep it, as for
    # kube-state-metrics, instead of Prometheus renaming it exported_namespace.
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    via_services = objects(helm, {"monitoring": {"serviceMonitor": {"enabled": True}}})
    service = one(via_services, "Service", "eo-embedding-operator-metrics")
    monitor = one(via_services, "ServiceMonitor", "eo-embedding-operator-operator")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    off = objects(
        helm, {"operator": {"metricsPort": 0}, "monitoring": {"podMonitor": {"enabled": True}}}
    )
    assert (
        "prometheus.io/scrape"
        not in one(off, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    )
    assert [d["metadata"]["name"] for d in off if d["kind"] == "PodMonitor"] == [
        "eo-embedding-operator-servers"
    ]


def test_the_autoscaling_defaults_reach_the_operator(helm: Path) -> None:
    docs = objects(
        helm,
        {
            "autoscaling": {
                "defaultAutoscaler": "keda",
                "keda": {"prometheusAddress": "http://prometheus-operated.monitoring.svc:9090"},
            }
        },
    )
    env = _env(one(docs, "Deployment"), one(docs, "ConfigMap"))
    assert env["EMBEDDING_OPERATOR_DEFAULT_AUTOSCALER"] == "keda"
    assert (
        env["EMBEDDING_OPERATOR_KEDA_PROMETHEUS_ADDRESS"]
        == "http://prometheus-operated.monitoring.svc:9090"
    )
    # The wake-from-zero trigger's gateway: the release namespace, where the chart puts it.
    assert env["EMBEDDING_OPERATOR_KEDA_GATEWAY_NAMESPACE"] == "ops"
    assert env["EMBEDDING_OPERATOR_KEDA_GATEWAY_JOB"] == ""
    elsewhere = {"autoscaling": {"keda": {"gatewayNamespace": "edge", "gatewayJob": "edge/gw"}}}
    docs = objects(helm, elsewhere)
    env = _env(one(docs, "Deployment"), one(docs, "ConfigMap"))
    assert env["EMBEDDING_OPERATOR_KEDA_GATEWAY_NAMESPACE"] == "edge"
    assert env["EMBEDDING_OPERATOR_KEDA_GATEWAY_JOB"] == "edge/gw"


RULES = yaml.safe_load((CHART / "files" / "rules.yaml").read_text())
DASHBOARD = json.loads((CHART / "files" / "dashboards" / "embedding-operator.json").read_text())


def prometheus_rule(helm: Path, settings: dict[str, Any] | None = None) -> Manifest:
    values = {"monitoring": {"prometheusRule": {"enabled": True, **(settings or {})}}}
    return one(objects(helm, values), "PrometheusRule")


def rendered_alerts(rule: Manifest) -> dict[str, Manifest]:
    (alerts,) = [g for g in rule["spec"]["groups"] if g["name"] == "embedding-operator.alerts"]
    return {a["alert"]: a for a in alerts["rules"]}


def test_the_prometheus_rule_has_every_alert_with_its_overrides(helm: Path) -> None:
    assert not [d for d in objects(helm) if d["kind"] == "PrometheusRule"]  # off by default
    alerts = rendered_alerts(prometheus_rule(helm))
    assert set(alerts) == {
        "EmbeddingServiceSaturated",
        "EmbeddingServiceRateLimiting",
        "EmbeddingServiceServerErrors",
        "EmbeddingServiceSlow",
        "EmbeddingServiceModelLoadFailing",
        "EmbeddingServicePodsRestarting",
        "EmbeddingServiceDegraded",
        "EmbeddingOperatorReconcileErrors",
    }
    for source in RULES["alerts"]:
        alert = alerts[source["alert"]]
        assert alert["expr"] == f"{source['signal']} {source['op']} {source['threshold']}"
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
    changed = rendered_alerts(
        prometheus_rule(
            helm,
            {
                "alertLabels": {"team": "search"},
                "alerts": {
                    "EmbeddingServiceSlow": {"threshold": 0.5, "for": "5m", "severity": "page"},
                    "EmbeddingServiceDegraded": {"enabled": False},
                },
            },
        )
    )
    slow = changed["EmbeddingServiceSlow"]
    assert slow["expr"].endswith(" > 0.5") and slow["for"] == "5m"
    assert slow["labels"] == {"severity": "page", "team": "search"}
    assert "EmbeddingServiceDegraded" not in changed
    unknown = render_with(
        helm,
        {"monitoring": {"prometheusRule": {"enabled": True, "alerts": {"Nope": {"threshold": 1}}}}},
    )
    assert unknown.returncode != 0 and "no such alert" in unknown.stderr


def exported_sample_names() -> set[str]:
    """Every sample name the server's, the operator's and the gateway's /metrics can carry."""
    from embedding_operator.metrics import OperatorMetrics
    from embedding_server.gateway.metrics import GatewayMetrics
    from embedding_server.metrics import Metrics
    from prometheus_client import generate_latest

    texts = [
        Metrics().render(ready=True, loading=False).decode(),
        generate_latest(OperatorMetrics().registry).decode(),
        generate_latest(GatewayMetrics().registry).decode(),
    ]
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", "\n".join(texts), re.M):
        names.add(name)
        if kind == "counter":
            names.add(f"{name}_total")
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


METRIC_NAME = re.compile(
    r"\b(?:embedding_server|embedding_operator|embedding_gateway|controller_runtime|workqueue)"
    r"_[a-z_]+"
    r"|\b[a-z_]+:[a-z_0-9]+:[a-z_0-9]+\b"
)


def dashboard_queries() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in DASHBOARD["panels"]
        for target in panel.get("targets") or []
    ]


def test_every_metric_the_rules_and_the_dashboard_read_is_exported() -> None:
    """A renamed metric would leave an alert that never fires and a panel that shows
    nothing. Labels are not checked here: the promtool rule tests below cover the alerts'."""
    known = exported_sample_names() | {r["record"] for r in RULES["records"]}
    queries = [(r["record"], r["expr"]) for r in RULES["records"]]
    queries += [(a["alert"], a["signal"]) for a in RULES["alerts"]]
    queries += dashboard_queries()
    unknown = {
        (where, name)
        for where, expr in queries
        for name in METRIC_NAME.findall(expr)
        if name not in known
    }
    assert not unknown, unknown


def test_the_dashboard_configmap_is_labelled_for_grafanas_sidecar(helm: Path) -> None:
    assert not [
        d
        for d in objects(helm)
        if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]
    ]
    values = {"monitoring": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}}
    configmap = one(objects(helm, values), "ConfigMap", "eo-embedding-operator-dashboards")
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["embedding-operator.json"])
    assert dashboard == DASHBOARD
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    titles = {p["title"] for p in panels}
    # What the dashboard shows, per service, and the operator's own panels.
    assert {
        "Requests by endpoint and status",
        "Latency by stage (p99)",
        "Backlog seconds",
        "Queue",
        "Batch fill",
        "Model busy share",
        "Tokens per second",
        "Replicas against target",
        "Reconciles by result",
        "Work queue",
    } <= titles
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "service"}
    for title, expr in dashboard_queries():
        used = set(re.findall(r"\$(\w+)", expr)) - {"1"}  # $1: label_replace's group
        assert used <= variables | {"__rate_interval"}, (title, used)
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["description"]


def find_promtool() -> Path | None:
    """promtool from the e2e build cache (e2e/tools/promtool), else PATH."""
    component = next(c for c in COMPONENTS if c.name == "promtool")
    built = Path(component_dir(component, read_versions()[component.version_key])) / "promtool"
    if built.is_file():
        return built
    found = shutil.which("promtool")
    return Path(found) if found else None


@pytest.fixture(scope="module")
def promtool() -> Path:
    path = find_promtool()
    if path is None:
        pytest.skip("no promtool built: run `make binaries` (make test does, before the unit tier)")
    return path


def rules_file(helm: Path, directory: Path) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": prometheus_rule(helm)["spec"]["groups"]}))
    return path


def test_promtool_checks_the_rules(helm: Path, promtool: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(promtool), "check", "rules", str(rules_file(helm, tmp_path))],
        capture_output=True,
        text=True,
        timeout=RENDER_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = len(RULES["records"]) + len(RULES["alerts"])
    assert f"SUCCESS: {count} rules found" in proc.stdout


SERVER = 'namespace="team", pod="emb-7d4b9c8f5b-x2x9q"'
OPERATOR = 'namespace="team", service="emb"'
BACKLOG_TARGET = (
    f"embedding_operator_service_autoscaling_target{{{OPERATOR}, "
    'metric="embedding_server_backlog_seconds"}'
)


def requests(endpoint: str, status: str) -> str:
    return f'embedding_server_requests_total{{{SERVER}, endpoint="{endpoint}", status="{status}"}}'


def restarts(reason: str) -> str:
    return f'embedding_operator_server_restarts_total{{{OPERATOR}, reason="{reason}"}}'


ALERT_CASES: list[dict[str, Any]] = [
    {
        # Twice the target of backlog at maxReplicas: saturated (a load of 2x the target).
        "alert": "EmbeddingServiceSaturated",
        "series": {
            f"embedding_server_backlog_seconds{{{SERVER}}}": "4x30",
            BACKLOG_TARGET: "2x30",
            f'embedding_operator_service_replicas{{{OPERATOR}, state="desired"}}': "4x30",
            f'embedding_operator_service_replicas{{{OPERATOR}, state="max"}}': "4x30",
        },
        "samples": [({"metric": "embedding_server_backlog_seconds"}, 2.0)],
    },
    {
        # The same load below maxReplicas is the autoscaler's to handle: no alert.
        "alert": "EmbeddingServiceSaturated",
        "series": {
            f"embedding_server_backlog_seconds{{{SERVER}}}": "4x30",
            BACKLOG_TARGET: "2x30",
            f'embedding_operator_service_replicas{{{OPERATOR}, state="desired"}}': "3x30",
            f'embedding_operator_service_replicas{{{OPERATOR}, state="max"}}': "4x30",
        },
        "samples": [],
    },
    {
        # 1 request in 10 refused with 429.
        "alert": "EmbeddingServiceRateLimiting",
        "series": {
            requests("/v1/embeddings", "200"): "0+540x30",
            requests("/v1/embeddings", "429"): "0+60x30",
            requests("/metrics", "200"): "0+6000x30",  # scrapes are not traffic
        },
        "samples": [({}, 0.1)],
    },
    {
        # Two pods that could not load their model within 15 minutes.
        "alert": "EmbeddingServiceModelLoadFailing",
        "series": {
            restarts("ModelLoadFailed"): "0x9 1x2 2x7",  # 2 by 20m
            restarts("OOMKilled"): "0x20",
        },
        "samples": [({}, 2.0)],
    },
]


def test_the_alerts_fire_on_what_they_describe(helm: Path, promtool: Path, tmp_path: Path) -> None:
    """promtool's rule unit tests: synthetic series, the recording rules evaluated, and each
    alert's expression (threshold included) answering for the service, or not at all."""
    alerts = rendered_alerts(prometheus_rule(helm))
    signals = {a["alert"]: a["signal"] for a in RULES["alerts"]}
    tests = []
    for case in ALERT_CASES:
        service = {"namespace": "team", "service": "emb"}
        signal = signals[case["alert"]]
        if re.fullmatch(r"[a-z_:0-9]+", signal):
            # A comparison filter keeps the series' name: a recorded signal answers with it.
            service["__name__"] = signal
        expected = [
            {
                "labels": "{"
                + ", ".join(f'{k}="{v}"' for k, v in sorted({**service, **labels}.items()))
                + "}",
                "value": value,
            }
            for labels, value in case["samples"]
        ]
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in case["series"].items()],
                "promql_expr_test": [
                    {
                        "expr": alerts[case["alert"]]["expr"],
                        "eval_time": "20m",
                        "exp_samples": expected,
                    }
                ],
            }
        )
    path = tmp_path / "tests.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules_file(helm, tmp_path))],
                "evaluation_interval": "1m",
                "tests": tests,
            }
        )
    )
    proc = subprocess.run(
        [str(promtool), "test", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=RENDER_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- the gateway -----------------------------------------------------------------------------


def test_the_gateway_is_off_by_default_and_complete_when_on(helm: Path) -> None:
    assert not [d for d in objects(helm) if "gateway" in d["metadata"]["name"]]
    docs = objects(helm, {"gateway": {"enabled": True}})
    name = "eo-embedding-operator-gateway"
    deployment = one(docs, "Deployment", name)
    service = one(docs, "Service", name)
    pdb = one(docs, "PodDisruptionBudget", name)
    operator = one(docs, "Deployment", "eo-embedding-operator")
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod = deployment["spec"]["template"]
    # Its Service and PDB select exactly its pods, and the operator's selector none of them.
    assert service["spec"]["selector"] == selector == pdb["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    operator_selector = operator["spec"]["selector"]["matchLabels"]
    assert not operator_selector.items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert container["image"] == f"ghcr.io/embedding-operator/embedding-server:{app_version}"
    assert container["args"][:2] == ["gateway", "--discovery=kubernetes"]
    assert not any(a.startswith("--namespace") for a in container["args"])
    # A cold start's hold (300 s) before the pod's own 60 s: the two are separate deadlines.
    assert {"--hold-timeout=300", "--request-timeout=60"} <= set(container["args"])
    # 128 MiB of held bodies and answers: under a third of the 512 MiB memory limit.
    assert {"--max-buffered-bytes=134217728", "--max-connections=1024"} <= set(container["args"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["replicas"] == 2


def test_the_gateway_may_only_read_models_and_endpoints(helm: Path) -> None:
    docs = objects(helm, {"gateway": {"enabled": True}})
    name = "eo-embedding-operator-gateway"
    role = one(docs, "ClusterRole", name)
    binding = one(docs, "ClusterRoleBinding", name)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "ops"}]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        (group, resource, verb)
        for group, resource in (
            ("embedding-operator.dev", "embeddingservices"),
            ("discovery.k8s.io", "endpointslices"),
        )
        for verb in ("get", "list", "watch")
    }


def test_a_namespaced_gateway_watches_and_reads_that_namespace_only(helm: Path) -> None:
    docs = objects(helm, {"gateway": {"enabled": True}, "watchNamespaces": ["team"]})
    name = "eo-embedding-operator-gateway"
    assert not [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == name]
    one(docs, "Role", name, "team")
    one(docs, "RoleBinding", name, "team")
    args = one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team" in args
    proc = render_with(helm, {"gateway": {"enabled": True}, "watchNamespaces": ["a", "b"]})
    assert proc.returncode != 0
    assert "more than one watchNamespaces" in proc.stderr


def test_the_gateway_reads_bulk_api_keys_from_a_mounted_secret(helm: Path) -> None:
    """``gateway.bulkApiKeysSecret``: the Secret mounted read-only as a directory (so a changed
    Secret reaches the file the gateway reads again) and named by ``--bulk-api-keys-file``;
    the keys never appear in the pod spec (no env value, no argument)."""
    name = "eo-embedding-operator-gateway"
    plain = one(objects(helm, {"gateway": {"enabled": True}}), "Deployment", name)
    plain_pod = plain["spec"]["template"]["spec"]
    assert not any("bulk-api-keys" in a for a in plain_pod["containers"][0]["args"])
    assert [v["name"] for v in plain_pod["volumes"]] == ["tmp"]
    values = {"gateway": {"enabled": True, "bulkApiKeysSecret": {"name": "indexers"}}}
    pod = one(objects(helm, values), "Deployment", name)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    (flag,) = [a for a in container["args"] if a.startswith("--bulk-api-keys-file=")]
    path = flag.split("=", 1)[1]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "bulk-api-keys"]
    assert mount["readOnly"] is True and "subPath" not in mount
    (volume,) = [v for v in pod["volumes"] if v["name"] == "bulk-api-keys"]
    secret = volume["secret"]
    assert secret["secretName"] == "indexers"
    (item,) = secret["items"]
    assert item["key"] == "bulk-api-keys"
    assert path == f"{mount['mountPath']}/{item['path']}"
    assert "env" not in container


def test_reserved_model_names_reach_the_operator_and_the_gateway_alike(
    helm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``modelNames.reserved`` (issue 48, H3): the operator's setting and the gateway's flag
    say the same, in the order given (the first match decides), and each parses it."""
    from embedding_operator.names import ReservedNames as OperatorReserved
    from embedding_operator.settings import OperatorSettings
    from embedding_server.gateway.settings import GatewaySettings

    reserved = [
        {"name": "text-embedding-*", "namespaces": ["search", "ml"]},
        {"name": "bge-m3", "namespaces": ["ml"]},
    ]
    values = {"gateway": {"enabled": True}, "modelNames": {"reserved": reserved}}
    docs = objects(helm, values)
    env = _env(one(docs, "Deployment", "eo-embedding-operator"), one(docs, "ConfigMap"))
    gateway = one(docs, "Deployment", "eo-embedding-operator-gateway")
    (flag,) = [
        a
        for a in gateway["spec"]["template"]["spec"]["containers"][0]["args"]
        if a.startswith("--reserved-model-names=")
    ]
    expected = "text-embedding-*=search|ml,bge-m3=ml"
    assert env["EMBEDDING_OPERATOR_RESERVED_MODEL_NAMES"] == expected
    assert flag.split("=", 1)[1] == expected
    monkeypatch.setenv("EMBEDDING_OPERATOR_RESERVED_MODEL_NAMES", expected)
    operator = OperatorSettings()
    assert OperatorReserved(operator.reserved_model_names).rules == (
        ("text-embedding-*", frozenset({"search", "ml"})),
        ("bge-m3", frozenset({"ml"})),
    )
    gateway_settings = GatewaySettings(discovery="kubernetes", reserved_model_names=expected)
    assert gateway_settings.reserved_model_names == operator.reserved_model_names
    plain = objects(helm, {"gateway": {"enabled": True}})
    assert "EMBEDDING_OPERATOR_RESERVED_MODEL_NAMES" not in _env(
        one(plain, "Deployment", "eo-embedding-operator"), one(plain, "ConfigMap")
    )


def test_the_gateway_lists_names_only_unless_the_chart_says_otherwise(helm: Path) -> None:
    """``gateway.modelsListing`` (issue 48, L4): names by default, and what it says else."""
    name = "eo-embedding-operator-gateway"

    def args(values: dict[str, Any]) -> list[str]:
        deployment = one(objects(helm, values), "Deployment", name)
        return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])

    assert "--models-listing=names" in args({"gateway": {"enabled": True}})
    assert "--models-listing=none" in args({"gateway": {"enabled": True, "modelsListing": "none"}})
    refused = render_with(helm, {"gateway": {"enabled": True, "modelsListing": "all"}})
    assert refused.returncode != 0 and "modelsListing" in refused.stderr

"""Existing-cluster mode: the chart-level e2e tests against a cluster you already have.

As envtest's ``USE_EXISTING_CLUSTER``: with ``E2E_KUBECONFIG`` set, the e2e fixtures start no
cluster, build no binaries and build or load no images. The tests talk to the cluster that
kubeconfig names (its current context) with kubectl and helm, and its nodes run the images the
settings below name, which must already be where those nodes can pull them (a registry, or
``kind load``). What needs the harness's own cluster (its real node and host, kwok's fake GPU
nodes) is skipped, each test saying why; e2e/README.md lists what runs.

Settings (environment variables):

``E2E_KUBECONFIG``
    the cluster (required; it switches the mode on).
``E2E_IMAGE_REPOSITORY`` and ``E2E_IMAGE_TAG``
    where the three images are: ``<repository>/embedding-operator:<tag>``,
    ``<repository>/embedding-server:<tag>`` and ``<repository>/e2e-client:<tag>``;
``E2E_OPERATOR_IMAGE``, ``E2E_SERVER_IMAGE``, ``E2E_CLIENT_IMAGE``
    or each one's full reference (``repository:tag``), which wins over the pair above.
``E2E_HELM_VALUES``
    a values file merged into every ``helm install`` of the chart (optional): image pull
    secrets, the operator pod's tolerations, ``gpuProfiles`` for your node labels. Client
    pods are scheduled as its ``gpuProfiles.cpu`` says.
``E2E_NAMESPACE_PREFIX``
    put in front of every namespace the tests create (default ``e2e-``).
``E2E_STORAGE_CLASS``
    the StorageClass of the model-cache claims the examples ask for (default: the cluster's
    default class).
``E2E_KUBECTL``, ``E2E_HELM``
    the binaries to use (default: ``kubectl`` and ``helm`` on ``PATH``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.cluster.client import KubeClient
from e2e.harness.images.refs import BASE_IMAGE, PAUSE_IMAGE, ImageSet

KUBECONFIG_ENV = "E2E_KUBECONFIG"
IMAGE_NAMES = {
    "operator": "embedding-operator",
    "server": "embedding-server",
    "client": "e2e-client",
}
DEFAULT_NAMESPACE_PREFIX = "e2e-"
CUSTOM_METRICS_API = "v1beta1.custom.metrics.k8s.io"
EXTERNAL_METRICS_API = "v1beta1.external.metrics.k8s.io"

# Why each marker's tests cannot run here; the skip reasons the tests report.
SKIP_REASONS = {
    "local_node": (
        "needs the harness's own local cluster (its real node's containerd store, host paths "
        "or files, or its pinned binaries); E2E_KUBECONFIG points at an existing cluster"
    ),
    "kwok": (
        "needs kwok's fake GPU nodes (pods Running without containers), which only the "
        "harness's local cluster has; E2E_KUBECONFIG points at an existing cluster"
    ),
}


class SettingsError(ValueError):
    """The existing-cluster settings are incomplete or wrong: the run stops, saying which."""


def split_image(ref: str) -> tuple[str, str]:
    """``repository:tag`` -> (repository, tag), as the chart's image values take them."""
    last = ref.rsplit("/", 1)[-1]
    if "@" in ref or ":" not in last:
        raise SettingsError(f"image {ref!r}: expected repository:tag (the chart takes a tag)")
    repository, tag = ref.rsplit(":", 1)
    return repository, tag


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` as Helm merges values files (maps key by key)."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _binary(env: Mapping[str, str], variable: str, name: str) -> Path:
    given = env.get(variable)
    found = given or shutil.which(name, path=env.get("PATH"))
    if not found or not os.access(found, os.X_OK):
        raise SettingsError(
            f"{variable}={given}: not an executable"
            if given
            else f"no {name} on PATH: install it or set {variable}"
        )
    return Path(found).resolve()


@dataclass(frozen=True)
class ExistingCluster:
    """The settings of one run against an existing cluster (``from_env``)."""

    kubeconfig: Path
    images: ImageSet
    kubectl: Path
    helm: Path
    helm_values: Mapping[str, Any] = field(default_factory=dict)
    namespace_prefix: str = DEFAULT_NAMESPACE_PREFIX
    storage_class: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ExistingCluster | None:
        """The settings ``env`` (default: ``os.environ``) gives; None without
        ``E2E_KUBECONFIG`` (the harness's local cluster then runs the tests)."""
        env = os.environ if env is None else env
        if not env.get(KUBECONFIG_ENV):
            return None
        kubeconfig = Path(env[KUBECONFIG_ENV]).expanduser()
        if not kubeconfig.is_file():
            raise SettingsError(f"{KUBECONFIG_ENV}={kubeconfig}: no such file")
        repository = env.get("E2E_IMAGE_REPOSITORY", "").rstrip("/")
        tag = env.get("E2E_IMAGE_TAG", "")
        refs: dict[str, str] = {}
        missing = []
        for role, name in IMAGE_NAMES.items():
            variable = f"E2E_{role.upper()}_IMAGE"
            ref = env.get(variable) or (f"{repository}/{name}:{tag}" if repository and tag else "")
            if not ref:
                missing.append(variable)
                continue
            split_image(ref)
            refs[role] = ref
        if missing:
            raise SettingsError(
                f"{KUBECONFIG_ENV} is set, so the e2e tier runs on that cluster with images you "
                f"built and pushed; name them with E2E_IMAGE_REPOSITORY and E2E_IMAGE_TAG, or "
                f"set {', '.join(missing)} (see e2e/README.md)"
            )
        values: Mapping[str, Any] = {}
        if env.get("E2E_HELM_VALUES"):
            path = Path(env["E2E_HELM_VALUES"]).expanduser()
            try:
                values = yaml.safe_load(path.read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise SettingsError(f"E2E_HELM_VALUES={path}: {exc}") from exc
            if not isinstance(values, Mapping):
                raise SettingsError(f"E2E_HELM_VALUES={path}: not a mapping of chart values")
        return cls(
            kubeconfig=kubeconfig.resolve(),
            images=ImageSet(
                base=BASE_IMAGE,
                pause=PAUSE_IMAGE,
                server=refs["server"],
                operator=refs["operator"],
                client=refs["client"],
            ),
            kubectl=_binary(env, "E2E_KUBECTL", "kubectl"),
            helm=_binary(env, "E2E_HELM", "helm"),
            helm_values=values,
            namespace_prefix=env.get("E2E_NAMESPACE_PREFIX", DEFAULT_NAMESPACE_PREFIX),
            storage_class=env.get("E2E_STORAGE_CLASS") or None,
        )

    def client(self, workdir: Path) -> KubeClient:
        """kubectl and helm against the cluster; helm's state and the ServiceAccount
        kubeconfigs the tests write go to ``workdir``."""
        return KubeClient(
            self.kubeconfig,
            kubectl=self.kubectl,
            helm=self.helm,
            workdir=workdir,
            bin_dirs=sorted({self.kubectl.parent, self.helm.parent}),
            namespace_prefix=self.namespace_prefix,
        )

    def chart_values(self) -> dict[str, Any]:
        """The chart values every install needs here: the images, then E2E_HELM_VALUES."""
        operator_repository, operator_tag = split_image(self.images.operator)
        server_repository, server_tag = split_image(self.images.server)
        images = {
            "image": {"repository": operator_repository, "tag": operator_tag},
            "serverImage": {"repository": server_repository, "tag": server_tag},
        }
        return deep_merge(images, self.helm_values)

    def describe(self) -> str:
        """One line for the test report's header."""
        return (
            f"existing cluster from {KUBECONFIG_ENV}={self.kubeconfig} (kubectl {self.kubectl}, "
            f"helm {self.helm}); images {self.images.operator}, {self.images.server}, "
            f"{self.images.client}; namespaces {self.namespace_prefix}*"
        )


def custom_metrics_missing(client: KubeClient) -> str | None:
    """Why this cluster cannot autoscale on the servers' queue gauges, or None if it can:
    the HPAs read them from custom.metrics.k8s.io (prometheus-adapter with the chart's
    rules, docs/helm.md)."""
    return api_service_missing(
        client,
        CUSTOM_METRICS_API,
        "install prometheus-adapter with the chart's rules (docs/helm.md) to run the "
        "autoscaling tests",
    )


def keda_missing(client: KubeClient, values: Mapping[str, Any]) -> str | None:
    """Why this cluster cannot run the ``autoscaler: keda`` tests, or None if it can: KEDA
    serving external.metrics.k8s.io, and the chart told where its triggers find Prometheus."""
    missing = api_service_missing(
        client, EXTERNAL_METRICS_API, "install KEDA (docs/autoscaling.md) to run the KEDA tests"
    )
    if missing is not None:
        return missing
    address = ((values.get("autoscaling") or {}).get("keda") or {}).get("prometheusAddress")
    if not address:
        return (
            "E2E_HELM_VALUES sets no autoscaling.keda.prometheusAddress: KEDA's triggers "
            "need the Prometheus that scrapes the server pods"
        )
    return None


def api_service_missing(client: KubeClient, name: str, hint: str) -> str | None:
    """Why the aggregated API ``name`` cannot be used here (with ``hint``), or None."""
    found = client.kubectl("get", "apiservice", name, "-o", "json", check=False)
    if found.returncode != 0:
        return f"no {name} APIService on this cluster: {hint}"
    conditions = json.loads(found.stdout).get("status", {}).get("conditions") or []
    if not any(c.get("type") == "Available" and c.get("status") == "True" for c in conditions):
        return f"the {name} APIService is not Available on this cluster"
    return None

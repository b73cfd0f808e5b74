"""What every child manifest shares: names, labels, owner reference, the render inputs.

Builders are pure functions of a ``RenderInput`` so that the operator, ``embedding-operator
render`` and the unit tests produce byte-identical manifests from the same spec. Children get
deterministic names (the EmbeddingService's own name, the PVC ``<name>-model-cache``) so that
re-running a reconcile finds what an earlier run created, and each carries a controller
ownerReference so Kubernetes garbage collection, not a finalizer, removes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embedding_operator.profiles import GpuProfile
from embedding_operator.spec import Autoscaler, EmbeddingServiceSpec

GROUP = "embedding-operator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "EmbeddingService"
PLURAL = "embeddingservices"

APP_NAME = "embedding-server"
COMPONENT = "inference"
MANAGED_BY = "embedding-operator"

SERVER_PORT = 8000
PORT_NAME = "http"
PROBE_PORT = 8001
"""The server's probe port (``--probe-port``): the kubelet's probes go there, outside the
client port's connection cap, so clients that hold every connection cannot fail them."""
PROBE_PORT_NAME = "probe"
CACHE_MOUNT_PATH = "/cache"
DEFAULT_IMAGE = "ghcr.io/embedding-operator/embedding-server:0.1.0"

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Owner:
    """The EmbeddingService the children belong to."""

    name: str
    namespace: str
    uid: str
    generation: int = 0

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta.get("uid", ""),
            generation=int(meta.get("generation") or 0),
        )


DEFAULT_GATEWAY_NAMESPACE = "embedding-operator"
"""Where the gateway runs when nothing says otherwise: the chart's documented namespace
(``helm install ... --namespace embedding-operator``). ``run`` uses its own namespace."""


@dataclass(frozen=True)
class AutoscalingDefaults:
    """What the operator's configuration adds to ``spec.autoscaling``: the autoscaler a spec
    that names none gets, the Prometheus KEDA's triggers query (empty: not configured), and
    where the gateway's held-request series come from (its namespace, and Prometheus's job
    for it, empty: any job), which KEDA's wake-from-zero trigger matches."""

    autoscaler: Autoscaler = "hpa"
    prometheus_address: str = ""
    gateway_namespace: str = DEFAULT_GATEWAY_NAMESPACE
    gateway_job: str = ""


DEFAULT_AUTOSCALING = AutoscalingDefaults()


@dataclass(frozen=True)
class RenderInput:
    """Everything a builder may look at; nothing else (no cluster, no clock)."""

    owner: Owner
    spec: EmbeddingServiceSpec
    profile: GpuProfile
    default_image: str = DEFAULT_IMAGE
    autoscaling: AutoscalingDefaults = DEFAULT_AUTOSCALING
    operator_namespace: str = DEFAULT_GATEWAY_NAMESPACE
    """Where the operator runs: its NetworkPolicy admits it to the probe port (``/golden``)."""

    @property
    def autoscaler(self) -> Autoscaler | None:
        """The autoscaler in charge while autoscaling is enabled (the spec's, else the
        operator's default); None while it is off."""
        auto = self.spec.autoscaling
        if not auto.enabled:
            return None
        return auto.autoscaler or self.autoscaling.autoscaler

    @property
    def gpu_count(self) -> int:
        return self.spec.parallelism.tensor_parallel_size if self.profile.resource_name else 0


def selector_labels(owner: Owner) -> dict[str, str]:
    """The pod selector: immutable on a Deployment, so only labels that never change."""
    return {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": owner.name}


def common_labels(owner: Owner) -> dict[str, str]:
    return {
        **selector_labels(owner),
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def selector_string(owner: Owner) -> str:
    """``status.selector`` for the scale subresource (what ``kubectl scale``/HPA read)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(owner).items()))


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(
    owner: Owner, name: str | None = None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name or owner.name,
        "namespace": owner.namespace,
        "labels": common_labels(owner),
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


GENERATED_NAME_LIMIT = 58
"""How long a generateName base may be before the API server cuts it (63 less the five
random characters): a pod's name is ``<deployment>-<template hash>-<random>`` cut there."""


def pod_name_regex(owner: Owner) -> str:
    """A PromQL regex matching the names of this service's pods and of no other service's.

    Prometheus knows a series' pod by name only (its labels are not copied by every scrape
    setup), and a Deployment's pods are ``<name>-<template hash>-<5 random>``, the hash and
    the suffix lowercase alphanumeric without dashes, so ``<name>-x-y`` names a pod of
    ``<name>`` and not of ``<name>-x`` (whose pods have three dashed parts after the name).
    For names over 46 characters the API server cuts the hash short and drops its dash
    (``GENERATED_NAME_LIMIT``), so the second dash becomes optional: such a name could then
    also match a namesake with one more dashed part (``<name>-b``), which only a name of 48
    to 52 characters can have; docs/autoscaling.md says so."""
    name = owner.name
    if len(name) + len("-") + 10 + len("-") <= GENERATED_NAME_LIMIT:
        return f"{name}-[a-z0-9]+-[a-z0-9]+"
    return f"{name}-[a-z0-9]+(-[a-z0-9]+)?"


def pod_selector(owner: Owner) -> str:
    """The PromQL label matchers of this service's pods' series."""
    return f'namespace="{owner.namespace}",pod=~"{pod_name_regex(owner)}"'


def pvc_name(owner: Owner) -> str:
    return f"{owner.name}-model-cache"


def endpoint(owner: Owner, port: int) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc.cluster.local:{port}/v1"


RUN_AS_USER = 1000
"""The uid and gid every pod the operator makes runs as (the images' non-root user)."""


def pod_security_context() -> dict[str, Any]:
    """The pod-level security context of every pod the operator makes: non-root as
    :data:`RUN_AS_USER`, its volumes group-owned by it, the runtime's default seccomp."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """The container-level security context of every container the operator makes: no
    privilege escalation, no capabilities, a read-only root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
    }

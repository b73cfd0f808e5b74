"""The optional NetworkPolicy: who may connect to the server pods.

Off by default (``spec.networkPolicy.enabled``), because a NetworkPolicy that selects a pod
denies every source it does not list, and only the CR author knows where the clients run. When
on, ingress to the server port is admitted from pods in the EmbeddingService's own namespace
and in each of ``allowedNamespaces``, matched on the ``kubernetes.io/metadata.name`` label the
API server puts on every namespace (so a namespace cannot claim another's name by labelling
itself). Only ingress is restricted: the server's egress (a Hub download, DNS, the image URLs of
``spec.media.allowedDomains``) is untouched.

The probe port (``PROBE_PORT``) is admitted from the operator's namespace only, where the
operator reads each pod's golden vectors (``GET /golden``): the kubelet's probes come from the
node, and traffic from a pod's own node is always allowed whatever the policy says (the
Kubernetes NetworkPolicy contract), so the probes get through while clients in the admitted
namespaces cannot crowd the probe port.
"""

from __future__ import annotations

from typing import Any

from embedding_operator.builders.common import (
    PROBE_PORT,
    SERVER_PORT,
    Manifest,
    RenderInput,
    child_metadata,
    selector_labels,
)

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def wants_network_policy(render: RenderInput) -> bool:
    return render.spec.network_policy.enabled


def _namespaces(names: list[str]) -> dict[str, Any]:
    return {
        "namespaceSelector": {
            "matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": names}]
        }
    }


def build_network_policy(render: RenderInput) -> Manifest:
    owner = render.owner
    namespaces = sorted({owner.namespace, *render.spec.network_policy.allowed_namespaces})
    peer = _namespaces(namespaces)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(owner),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [peer], "ports": [{"protocol": "TCP", "port": SERVER_PORT}]},
                # The operator reads each pod's golden vectors there (golden.py).
                {
                    "from": [_namespaces([render.operator_namespace])],
                    "ports": [{"protocol": "TCP", "port": PROBE_PORT}],
                },
            ],
        },
    }

"""The KEDA ScaledObject: the same signal as the HPA's, through KEDA's Prometheus scaler.

KEDA turns the ScaledObject into an HPA of its own (``keda-hpa-<name>``) on an ``External``
metric that its metrics API server answers by running the trigger's PromQL. So the operator
writes the query, and the query decides what a replica counts for:

* ``sum`` over this service's pods, with ``metricType: AverageValue``: the HPA asks for
  ``ceil(sum / target)`` replicas, the work there is divided by what one replica should hold.
  A pod that is not ready exports no gauge (the server leaves it out), and a sum does not
  miss a term that was never there: a replica still loading its model neither adds work nor
  lowers anyone's share, so it never feeds a scale-down (an ``avg`` would count it as 0);
* with ``minReplicas: 0`` a second trigger keeps the service active while any replica is
  loading (``embedding_server_loading``, at most one replica's worth), so KEDA never takes the
  last replica away in the middle of its model load (superlinked/sie#293 is a user hit by
  exactly that). It cannot ask for more than one replica;
* with ``minReplicas: 0`` a third trigger wakes the service from zero on the requests the
  gateway (docs/gateway.md) holds for it while it has no ready pod
  (``embedding_gateway_held_requests`` of this EmbeddingService), also at most one replica's
  worth: once that replica is ready the gateway releases them to it and the work trigger
  takes over. Without the gateway nothing exports the series and the trigger stays inactive.
  The query matches the gateway's ``namespace`` as Prometheus labels its target (and its
  ``job``, when the operator is told it), not the ``embedding_service`` label alone: that
  label is whatever a scraped pod writes, so any pod Prometheus scrapes, in any namespace,
  could otherwise wake (and keep awake) another team's service.

The target is the Deployment, as the operator's own HPA's is: the operator leaves
``spec.replicas`` to the autoscaler while autoscaling is on, so they never fight over it.
"""

from __future__ import annotations

from typing import Any

from embedding_operator.builders.common import (
    Manifest,
    RenderInput,
    child_metadata,
    pod_selector,
)
from embedding_operator.builders.hpa import (
    LOADING_METRIC,
    METRICS,
    behavior,
    target,
    target_string,
)

WAKE_POLLING_SECONDS = 5
"""KEDA's ``pollingInterval`` for services that may be at zero: how often it asks the
triggers whether to wake one. A held request waits up to this long before KEDA notices it
(KEDA's default, 30 s, would be most of a cold start). Above one replica the HPA KEDA makes
scales, on its own sync period, so services that never go to zero keep KEDA's default."""
HELD_METRIC = "embedding_gateway_held_requests"
"""The gateway's gauge of requests it holds per EmbeddingService (``embedding_service`` is its
``namespace/name``): the demand that scales a service up from zero."""
API_VERSION = "keda.sh/v1alpha1"
KIND = "ScaledObject"


def wants_scaled_object(render: RenderInput) -> bool:
    return render.autoscaler == "keda"


def trigger_query(render: RenderInput) -> str:
    """The PromQL of the scaling trigger: the metric summed over this service's pods."""
    metric = METRICS[render.spec.autoscaling.metric]
    return f"sum({metric}{{{pod_selector(render.owner)}}})"


def loading_query(render: RenderInput) -> str:
    """1 while any replica of this service is loading its model, else 0 (or nothing)."""
    return f"clamp_max(sum({LOADING_METRIC}{{{pod_selector(render.owner)}}}), 1)"


def held_query(render: RenderInput) -> str:
    """1 while the gateway holds a request for this service (it has no ready pod), else 0:
    the gateway's series only, by the namespace (and job) Prometheus gives its target."""
    owner, defaults = render.owner, render.autoscaling
    labels = {
        "embedding_service": f"{owner.namespace}/{owner.name}",
        "namespace": defaults.gateway_namespace,
    }
    if defaults.gateway_job:
        labels["job"] = defaults.gateway_job
    matchers = ",".join(f'{label}="{_promql_string(value)}"' for label, value in labels.items())
    return f"clamp_max(sum({HELD_METRIC}{{{matchers}}}), 1)"


def _promql_string(value: str) -> str:
    """``value`` inside a PromQL double-quoted string (a job name is the operator's to
    choose, and may hold a quote or a backslash)."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _prometheus_trigger(name: str, server: str, query: str, threshold: str) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "name": name,
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": server,
            "query": query,
            "threshold": threshold,
            # No pod exports the metric (none ready yet, or none at all): 0, not an error.
            "ignoreNullValues": "true",
        },
    }


def build_scaled_object(render: RenderInput) -> Manifest:
    auto = render.spec.autoscaling
    server = render.autoscaling.prometheus_address
    triggers = [
        _prometheus_trigger(
            auto.metric, server, trigger_query(render), target_string(target(render))
        )
    ]
    if auto.min_replicas == 0:
        triggers.append(_prometheus_trigger("loading", server, loading_query(render), "1"))
        triggers.append(_prometheus_trigger("held", server, held_query(render), "1"))
    spec: dict[str, Any] = {
        "scaleTargetRef": {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": render.owner.name,
        },
        "minReplicaCount": auto.min_replicas,
        "maxReplicaCount": auto.max_replicas,
        # Used only on the way to zero: how long without work before the last replica goes.
        "cooldownPeriod": auto.scale_down_stabilization_seconds,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(render)}},
        "triggers": triggers,
    }
    if auto.min_replicas == 0:
        spec["pollingInterval"] = WAKE_POLLING_SECONDS
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": child_metadata(render.owner),
        "spec": spec,
    }

"""The HorizontalPodAutoscaler on per-pod queue depth.

Queue depth, not CPU or GPU utilisation, is the signal: an embedding server at 100% GPU with an
empty queue is keeping up, and one with a growing queue is not, whatever its utilisation. The
metric is a ``Pods`` metric averaged over this service's pods only (the HPA scopes Pods metrics
to the target's selector), so services in one namespace never share a signal. Serving it needs a
custom metrics API (prometheus-adapter mapping the gauge's ``namespace``/``pod`` labels).
"""

from __future__ import annotations

from typing import Any

from embedding_operator.builders.common import Manifest, RenderInput, child_metadata

QUEUE_METRICS = {
    "queueRequests": "embedding_server_queue_requests",
    "queueTokens": "embedding_server_queue_tokens",
}
DEFAULT_TARGETS = {"queueRequests": 8, "queueTokens": 32768}


def wants_hpa(render: RenderInput) -> bool:
    return render.spec.autoscaling.enabled


def build_hpa(render: RenderInput) -> Manifest:
    auto = render.spec.autoscaling
    target = auto.target_per_pod or DEFAULT_TARGETS[auto.metric]
    behavior: dict[str, Any] = auto.behavior or {
        "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_stabilization_seconds},
    }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(render.owner),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": render.owner.name,
            },
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": QUEUE_METRICS[auto.metric]},
                        "target": {"type": "AverageValue", "averageValue": str(target)},
                    },
                }
            ],
            "behavior": behavior,
        },
    }

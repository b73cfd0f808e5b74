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
DEFAULT_QUEUE_REQUESTS = 8
QUEUED_BATCHES = 2
"""Default queueTokens target: this many forward passes' worth of tokens waiting per pod."""
SERVER_BATCH_TOKENS = {"cpu": 2048, "gpu": 16384}
"""The bundled server's default ``--max-batch-tokens`` per device (the server's
CPU_BATCH_TOKENS / GPU_BATCH_TOKENS; a contract test keeps them equal)."""


def default_target(render: RenderInput) -> int:
    """The per-pod target when ``targetPerPod`` is unset: 8 queued requests, or two batches'
    worth of queued tokens at the pod's batch budget (the server's default budget is far
    smaller on CPU, so a fixed token target would let a CPU pod queue seconds of work)."""
    if render.spec.autoscaling.metric == "queueRequests":
        return DEFAULT_QUEUE_REQUESTS
    server = render.spec.server
    budget = server.max_batch_tokens
    if budget is None:
        device = "gpu" if render.profile.resource_name else "cpu"
        budget = max(SERVER_BATCH_TOKENS[device], render.spec.embedding.max_input_tokens or 0)
    return QUEUED_BATCHES * budget


def wants_hpa(render: RenderInput) -> bool:
    return render.spec.autoscaling.enabled


def build_hpa(render: RenderInput) -> Manifest:
    auto = render.spec.autoscaling
    target = auto.target_per_pod or default_target(render)
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

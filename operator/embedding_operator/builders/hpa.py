"""The HorizontalPodAutoscaler on the server's load signal, and what both autoscalers share.

The signal is the work waiting in the server, not CPU or GPU utilisation: an embedding server
at 100% GPU with an empty queue is keeping up, and one with a growing queue is not, whatever
its utilisation. By default it is ``embedding_server_backlog_seconds`` (queued and running
tokens over the rate the model measured), which weighs a 512-token passage and a one-word
query for what they cost; the request and token counts remain available.

The HPA reads a ``Pods`` metric averaged over this service's pods only (the HPA scopes Pods
metrics to the target's selector), so services in one namespace never share a signal. Serving
it needs a custom metrics API (prometheus-adapter mapping the gauge's ``namespace``/``pod``
labels). A pod that is not ready exports none of these gauges (the server leaves them out), and
the HPA counts a pod without a value at the target when it would scale down: a replica still
loading its model never drags the average down.
"""

from __future__ import annotations

from typing import Any

from embedding_operator.builders.common import Manifest, RenderInput, child_metadata

METRICS = {
    "backlogSeconds": "embedding_server_backlog_seconds",
    "queueRequests": "embedding_server_queue_requests",
    "queueTokens": "embedding_server_queue_tokens",
}
LOADING_METRIC = "embedding_server_loading"
DEFAULT_BACKLOG_SECONDS = 2.0
"""Default targetBacklogSeconds: two seconds of work per pod, about the wait a request sees
at that load; a CPU pod holds two or three of its batches, a GPU pod many more."""
DEFAULT_QUEUE_REQUESTS = 8
QUEUED_BATCHES = 2
"""Default queueTokens target: this many forward passes' worth of tokens waiting per pod."""
SERVER_BATCH_TOKENS = {"cpu": 2048, "gpu": 16384}
"""The bundled server's default ``--max-batch-tokens`` per device (the server's
CPU_BATCH_TOKENS / GPU_BATCH_TOKENS; a contract test keeps them equal)."""


def default_target(render: RenderInput) -> float:
    """The per-pod target when the spec sets none: two seconds of backlog, 8 queued requests,
    or two batches' worth of queued tokens at the pod's batch budget (the server's default
    budget is far smaller on CPU, so a fixed token target would let a CPU pod queue seconds of
    work)."""
    metric = render.spec.autoscaling.metric
    if metric == "backlogSeconds":
        return DEFAULT_BACKLOG_SECONDS
    if metric == "queueRequests":
        return DEFAULT_QUEUE_REQUESTS
    server = render.spec.server
    budget = server.max_batch_tokens
    if budget is None:
        device = "gpu" if render.profile.resource_name else "cpu"
        budget = max(SERVER_BATCH_TOKENS[device], render.spec.embedding.max_input_tokens or 0)
    return QUEUED_BATCHES * budget


def target(render: RenderInput) -> float:
    """The per-pod target the autoscaler aims for, in the metric's unit."""
    auto = render.spec.autoscaling
    given = auto.target_backlog_seconds if auto.metric == "backlogSeconds" else auto.target_per_pod
    return given if given is not None else default_target(render)


def target_string(value: float) -> str:
    """A target as Kubernetes quantities and KEDA thresholds both read it: ``8``, ``0.5``."""
    return str(int(value)) if float(value).is_integer() else format(value, "g")


def target_quantity(value: float) -> str:
    """An HPA ``averageValue``: whole numbers as they are, fractions in milli-units (``500m``),
    which is how the API server writes them back."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def behavior(render: RenderInput) -> dict[str, Any]:
    auto = render.spec.autoscaling
    return auto.behavior or {
        "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_stabilization_seconds},
    }


def wants_hpa(render: RenderInput) -> bool:
    return render.autoscaler == "hpa"


def build_hpa(render: RenderInput) -> Manifest:
    auto = render.spec.autoscaling
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
                        "metric": {"name": METRICS[auto.metric]},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": target_quantity(target(render)),
                        },
                    },
                }
            ],
            "behavior": behavior(render),
        },
    }

"""The PodDisruptionBudget: node drains take one replica at a time.

Only rendered when the service can have more than one replica; with one replica a budget of
``maxUnavailable: 1`` protects nothing and ``0`` would block node drains forever.

``unhealthyPodEvictionPolicy: AlwaysAllow``: a pod that is not ready serves nobody, so the
budget never protects it. Without it a service whose pods never become ready (a model that
will not load, an image that does not pull) would hold every node drain it touches.
"""

from __future__ import annotations

from embedding_operator.builders.common import (
    Manifest,
    RenderInput,
    child_metadata,
    selector_labels,
)


def wants_pdb(render: RenderInput) -> bool:
    spec = render.spec
    most = spec.autoscaling.max_replicas if spec.autoscaling.enabled else spec.replicas
    return most > 1


def build_pdb(render: RenderInput) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(render.owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(render.owner)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }

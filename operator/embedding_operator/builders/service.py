"""The Service: the stable name clients call (``http://<name>.<ns>.svc/v1/embeddings``)."""

from __future__ import annotations

from typing import Any

from embedding_operator.builders import golden
from embedding_operator.builders.common import (
    PORT_NAME,
    Manifest,
    RenderInput,
    child_metadata,
    selector_labels,
)


def build_service(render: RenderInput) -> Manifest:
    """As a new service gets it: with ``blueGreen``, the selector pinned to the spec's model
    (its contract key); the reconciler moves the pin during a model change (``bluegreen.py``)."""
    svc = render.spec.service
    selector = selector_labels(render.owner)
    if render.spec.rollout.strategy == "blueGreen":
        selector[golden.CONTRACT_LABEL] = golden.contract_key(render.spec)
    spec: dict[str, Any] = {
        "type": svc.type,
        "selector": selector,
        "ports": [
            {"name": PORT_NAME, "port": svc.port, "targetPort": PORT_NAME, "protocol": "TCP"}
        ],
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(render.owner, annotations=svc.annotations),
        "spec": spec,
    }

"""The Service: the stable name clients call (``http://<name>.<ns>.svc/v1/embeddings``)."""

from __future__ import annotations

from typing import Any

from embedding_operator.builders.common import (
    PORT_NAME,
    Manifest,
    RenderInput,
    child_metadata,
    selector_labels,
)


def build_service(render: RenderInput) -> Manifest:
    svc = render.spec.service
    spec: dict[str, Any] = {
        "type": svc.type,
        "selector": selector_labels(render.owner),
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

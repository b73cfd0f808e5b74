"""The model-cache PersistentVolumeClaim (``modelCache.mode: pvc``).

Owned by the EmbeddingService like every other child, so deleting the service frees the
storage; users who want the cache to outlive the service use ``mode: existing``.
"""

from __future__ import annotations

from typing import Any

from embedding_operator.builders.common import Manifest, RenderInput, child_metadata, pvc_name


def wants_pvc(render: RenderInput) -> bool:
    return render.spec.model_cache.mode == "pvc"


def build_pvc(render: RenderInput) -> Manifest:
    cache = render.spec.model_cache
    spec: dict[str, Any] = {
        "accessModes": list(cache.access_modes),
        "resources": {"requests": {"storage": str(cache.size)}},
    }
    if cache.storage_class_name is not None:
        spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": child_metadata(render.owner, name=pvc_name(render.owner)),
        "spec": spec,
    }

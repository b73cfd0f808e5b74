"""Kubernetes Events about EmbeddingServices, posted with our own client.

Why not ``kopf.event``: it only works inside kopf's handler context (it reads kopf's context
variables), while reconciles run on the operator's own work-queue threads. Posting a
core/v1 Event directly works from anywhere and needs only ``create`` on ``events``.
Posting is best effort: a failed Event is logged, never a failed reconcile.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, Protocol

from embedding_operator.kube import ApiError

log = logging.getLogger(__name__)

COMPONENT = "embedding-operator"
MAX_MESSAGE = 1024


class EventApi(Protocol):
    def create(self, manifest: dict[str, Any]) -> dict[str, Any]: ...


class ApiEventRecorder:
    """``EventRecorder`` that creates core/v1 Events through ``api``."""

    def __init__(self, api: EventApi, instance: str = COMPONENT) -> None:
        self._api = api
        self._instance = instance

    def __call__(self, body: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        meta = body["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type,
            "reason": reason,
            "message": message[:MAX_MESSAGE],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._api.create(event)
        except ApiError as exc:
            log.warning(
                "could not post %s event %s for %s/%s: %s",
                type,
                reason,
                meta["namespace"],
                meta["name"],
                exc,
            )

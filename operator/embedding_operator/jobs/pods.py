"""The job pods' few fields the reconciler reads, as the pod watch reports them.

Why: a running EmbeddingJob is reconciled on every event of its worker Job (a pod started, an
index completed), and its status counts rows from every worker pod's termination message.
Listing the pods each time costs O(shards) per event, O(shards²) over a job: at 10,000
shards, terabytes read from the API server. kopf already watches the operator's pods
(label-selected), so each job pod's name, owner, phase and terminated state are kept here as
the watch reports them (about 300 bytes a pod), and the reconcile reads them with no API
call. A pod whose container just terminated enqueues its EmbeddingJob too: its message may
arrive after the Job's own event. So does a pod that the kubelet starts blocking, or stops
blocking, on its configuration (a missing credentials Secret, then the Secret created).

Without a watch (tests, or a caller that passes none) the reconciler lists pods instead.
Written on the event loop by the kopf handler, read on the reconcile threads: one lock.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any

Key = tuple[str, str, str]  # (namespace, EmbeddingJob name, component)


def _essentials(pod: Mapping[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return {
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "labels": dict(meta.get("labels") or {}),
            "ownerReferences": copy.deepcopy(list(meta.get("ownerReferences") or [])),
        },
        "status": {
            "phase": status.get("phase"),
            "containerStatuses": [
                {"name": c.get("name"), "state": copy.deepcopy(dict(c.get("state") or {}))}
                for c in status.get("containerStatuses") or []
            ],
        },
    }


def config_blocked(pod: Mapping[str, Any] | None) -> bool:
    """Whether the kubelet cannot start the pod's container for its configuration: most often
    the credentials Secret, or a key of it, missing (``CreateContainerConfigError``)."""
    for container in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CreateContainerConfigError":
            return True
    return False


def terminated_now(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's container has terminated (its message is there to read)."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        if (container.get("state") or {}).get("terminated"):
            return True
    return False


class WatchedJobPods:
    """The job pods the watch reported, by EmbeddingJob and component (planner, worker)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[Key, dict[str, dict[str, Any]]] = {}

    def pod_event(
        self, namespace: str, job: str, component: str, pod: Mapping[str, Any], *, deleted: bool
    ) -> bool:
        """Keep (or forget) the pod; True when this event started or ended its being
        :func:`config_blocked` (the status says ``SecretNotFound`` while it is: a Secret
        created later unblocks the pod, and the status should say so then, not at the
        next resync)."""
        name = str((pod.get("metadata") or {}).get("name") or "")
        key = (namespace, job, component)
        with self._lock:
            before = (self._pods.get(key) or {}).get(name)
            if deleted:
                pods = self._pods.get(key)
                if pods is not None:
                    pods.pop(name, None)
                    if not pods:
                        del self._pods[key]
                return config_blocked(before)
            self._pods.setdefault(key, {})[name] = _essentials(pod)
            return config_blocked(before) != config_blocked(pod)

    def pods(self, namespace: str, job: str, component: str) -> list[dict[str, Any]]:
        with self._lock:
            found = self._pods.get((namespace, job, component)) or {}
            return [copy.deepcopy(pod) for _, pod in sorted(found.items())]

    def forget(self, namespace: str, job: str) -> None:
        with self._lock:
            for key in [k for k in self._pods if k[:2] == (namespace, job)]:
                del self._pods[key]

"""What the watches last reported: the resourceVersions of each EmbeddingService and its children.

Why: the periodic resync re-reconciles every EmbeddingService, and a reconcile reads the object
and each child (2 to 7 GETs). At 10,000 EmbeddingServices and a 60 s resync that is about 1,000
GETs a second against the API server for objects that did not change. kopf already watches the
EmbeddingServices and (label-selected) their children, and its events carry each object's
``resourceVersion``; the API server changes it on every write. So the reconciler remembers the
versions it last *verified* (read from, or written to, the API in a reconcile that found the
object settled: no problem, every replica ready) and a resync of an object whose watched
versions are still exactly those costs no API call at all: nothing it could look at has
changed. Any event (an edit, a drifted child, a deleted child, a Deployment status change, our
own writes seen through the watch) changes a version and the next reconcile reads everything
fresh. Objects that are not settled (a rollout, a Degraded condition, pods not ready) are read
on every resync as before, and every object is re-read at least every ``--full-resync-seconds``
whatever the watches say, the backstop for a watch that silently missed an event.

This keeps versions (a few short strings per object), never bodies: a cache of the children
themselves would cost tens of kilobytes per EmbeddingService in a Python process. The one
exception is ``WatchedPods``: the few container-status fields of each server pod that a
reconcile of a rolling-out service reads, so that it never lists pods from the API server.

Written on the event loop by the kopf handlers, read on the reconcile threads: one lock.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from embedding_operator.builders.golden import CONTRACT_LABEL

Key = tuple[str, str]  # (namespace, name) of an EmbeddingService
ChildVersion = tuple[str, str, str]  # (kind, name, resourceVersion)


@dataclass(frozen=True)
class Versions:
    """The EmbeddingService's resourceVersion and its children's (kind, name, version)."""

    owner: str
    children: frozenset[ChildVersion]


class WatchedVersions:
    """The latest resourceVersions the watches reported, per EmbeddingService."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[Key, str] = {}
        self._children: dict[Key, dict[tuple[str, str], str]] = {}

    def owner_event(self, namespace: str, name: str, resource_version: str | None) -> None:
        """The EmbeddingService was seen at this version (None: deleted)."""
        with self._lock:
            if resource_version is None:
                self._owners.pop((namespace, name), None)
                self._children.pop((namespace, name), None)
            else:
                self._owners[(namespace, name)] = resource_version

    def child_event(
        self, namespace: str, owner: str, kind: str, name: str, resource_version: str | None
    ) -> None:
        """A child controlled by ``owner`` was seen at this version (None: deleted)."""
        with self._lock:
            children = self._children.setdefault((namespace, owner), {})
            if resource_version is None:
                children.pop((kind, name), None)
            else:
                children[(kind, name)] = resource_version

    def current(self, namespace: str, name: str) -> Versions | None:
        """What the watches say now; None if the EmbeddingService was not seen."""
        with self._lock:
            owner = self._owners.get((namespace, name))
            if owner is None:
                return None
            children = self._children.get((namespace, name)) or {}
            return Versions(owner, frozenset((k, n, v) for (k, n), v in children.items()))


_CONTAINER_FIELDS = ("name", "state", "lastState", "restartCount")


def _slim(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What ``status.container_config_problem``, ``status.model_load_problem`` and
    ``golden.PodFacts`` read of a pod, and nothing else (a full pod is several kilobytes;
    1,000 of them would double RSS)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    slim_meta: dict[str, Any] = {
        "name": meta.get("name", ""),
        "namespace": meta.get("namespace", ""),
    }
    if CONTRACT_LABEL in labels:
        slim_meta["labels"] = {CONTRACT_LABEL: labels[CONTRACT_LABEL]}
    if meta.get("deletionTimestamp"):
        slim_meta["deletionTimestamp"] = meta["deletionTimestamp"]
    slim_status: dict[str, Any] = {
        which: [
            {k: copy.deepcopy(c[k]) for k in _CONTAINER_FIELDS if k in c}
            for c in status.get(which) or []
        ]
        for which in ("initContainerStatuses", "containerStatuses")
    }
    if status.get("podIP"):
        slim_status["podIP"] = status["podIP"]
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    if ready:
        slim_status["conditions"] = [{"type": "Ready", "status": ready[0].get("status")}]
    slim: dict[str, Any] = {"metadata": slim_meta, "status": slim_status}
    if (pod.get("spec") or {}).get("nodeName"):
        slim["spec"] = {"nodeName": pod["spec"]["nodeName"]}
    return slim


class WatchedPods:
    """The server pods the pod watch last reported, per EmbeddingService, as much of each as
    the reconciler reads.

    Why: while a Deployment rolls out, every reconcile looks at its pods for a container the
    kubelet cannot create (a missing Secret) or a model that will not load. Listing them from
    the API server costs a LIST per reconcile, filtered by label among every pod of the
    namespace: at 1,000 EmbeddingServices rolling out at once, several thousand LISTs over
    thousands of pods, on the API server that is the bound. The operator already watches these
    pods (``handlers.on_pod``), and every pod event enqueues its EmbeddingService *after*
    recording the pod here, so the reconcile it triggers sees the pod as the event did: the
    reconciler reads pods from here and makes no call at all.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[Key, dict[str, dict[str, Any]]] = {}

    def pod_event(
        self, namespace: str, owner: str, pod: Mapping[str, Any], *, deleted: bool
    ) -> None:
        """A pod of ``owner`` (its ``app.kubernetes.io/instance``) was seen, or deleted."""
        name = str((pod.get("metadata") or {}).get("name", ""))
        with self._lock:
            pods = self._pods.setdefault((namespace, owner), {})
            if deleted:
                pods.pop(name, None)
                if not pods:
                    del self._pods[(namespace, owner)]
            else:
                pods[name] = _slim(pod)

    def pods(self, namespace: str, owner: str) -> list[dict[str, Any]]:
        with self._lock:
            return list((self._pods.get((namespace, owner)) or {}).values())


def _minute(value: Any) -> str:
    """``2026-11-28T18:41:07Z`` -> ``2026-11-28T18:41``; anything else as it is."""
    text = str(value or "")
    return text[:16] if len(text) >= 16 and text[13] == ":" else text


def _digest(essence: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(
        json.dumps(essence, sort_keys=True, default=str).encode(), digest_size=16
    ).digest()


def scaledobject_essence(body: Mapping[str, Any]) -> bytes:
    """A digest of a KEDA ScaledObject without what KEDA rewrites at every poll.

    While a trigger is active, KEDA writes ``status.lastActiveTime`` at every poll (every 5 s
    for a scale-to-zero service), so each poll is a watch event. The reconciler reads that time
    to the minute (``status.last_active_time``) and nothing else of such a write, so the digest
    keeps it to the minute and drops ``resourceVersion`` and ``managedFields``; everything else
    (spec, labels, owners, conditions, health) is in it, so any other change still counts."""
    metadata = {
        k: v
        for k, v in (body.get("metadata") or {}).items()
        if k not in ("resourceVersion", "managedFields")
    }
    status = dict(body.get("status") or {})
    if "lastActiveTime" in status:
        status["lastActiveTime"] = _minute(status["lastActiveTime"])
    return _digest({"metadata": metadata, "spec": body.get("spec"), "status": status})


def owner_essence(body: Mapping[str, Any]) -> bytes:
    """A digest of what a user changes on an EmbeddingService: its spec, labels, annotations
    and deletion. Our own status writes leave it alone, as kopf's create/update handlers did,
    without the ``last-handled-configuration`` annotation kopf wrote on each object to know it
    (1,000 uncounted PATCHes at 1,000 services)."""
    metadata = body.get("metadata") or {}
    return _digest(
        {
            "spec": body.get("spec"),
            "labels": metadata.get("labels") or {},
            "annotations": metadata.get("annotations") or {},
            "deletionTimestamp": metadata.get("deletionTimestamp"),
        }
    )


class EssenceChanges:
    """Which watch events of one kind are worth a reconcile: those that change the object's
    ``essence`` (a digest of what the reconciler could act on) since the last one seen.

    For KEDA's ScaledObjects (:func:`scaledobject_essence`): at 1,000 busy scale-to-zero
    services KEDA's per-poll ``lastActiveTime`` writes would enqueue 200 reconciles a second,
    each reading the service and its children only to find nothing to do. For EmbeddingServices
    (:func:`owner_essence`): a change of spec or metadata, never our own status writes.
    Deletions and first sightings always count. Called on the event loop only (kopf handlers)."""

    def __init__(self, essence: Callable[[Mapping[str, Any]], bytes]) -> None:
        self._essence = essence
        self._last: dict[tuple[str, str], bytes] = {}

    def worth_a_reconcile(
        self, namespace: str, name: str, body: Mapping[str, Any], *, deleted: bool
    ) -> bool:
        key = (namespace, name)
        if deleted:
            self._last.pop(key, None)
            return True
        essence = self._essence(body)
        if self._last.get(key) == essence:
            return False
        self._last[key] = essence
        return True

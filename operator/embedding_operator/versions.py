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
themselves would cost tens of kilobytes per EmbeddingService in a Python process.

Written on the event loop by the kopf handlers, read on the reconcile threads: one lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

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

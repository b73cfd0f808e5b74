"""kopf handlers: thin adapters from kopf's triggers to ``Reconciler.reconcile``.

Three kinds of triggers feed the same level-based reconcile:

* the EmbeddingService was created, changed or found at startup (``create``/``update``/
  ``resume``): reconcile now; a retryable problem (a Secret not there yet) becomes a
  ``kopf.TemporaryError`` whose delay grows with each attempt (5s, 10s, ... capped at 60s);
* an owned child changed or was deleted (``event`` on Deployments, Services, HPAs, PDBs and
  PVCs, watched with a server-side label selector so the operator sees only its own children):
  reconcile the owner, which re-applies drifted fields and refreshes status from the
  Deployment's; events for one owner are coalesced so a rollout's burst of Deployment updates
  costs a few reconciles, not one per update;
* a periodic resync (``--resync-seconds``) as the backstop for anything a watch missed. It is
  one loop over the EmbeddingServices the watch has seen, not a ``kopf.timer``: kopf puts a
  finalizer on every object with a timer, and a finalizer makes ``kubectl delete`` hang
  whenever the operator is down or uninstalled.

No handler returns a value (kopf would store it in status), and kopf's own bookkeeping
(progress, diff base) lives in annotations under ``embedding-operator.dev``. No finalizer is
used: children carry ownerReferences, so garbage collection deletes them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import kopf

from embedding_operator.apply import ApiError
from embedding_operator.builders.common import GROUP, KIND, MANAGED_BY, PLURAL, VERSION
from embedding_operator.reconcile import Reconciler
from embedding_operator.settings import OperatorSettings

log = logging.getLogger(__name__)

MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
# kopf resource selectors (group/version/plural; core resources have no group).
CHILD_RESOURCES: tuple[tuple[str, str] | tuple[str, str, str], ...] = (
    ("apps", "v1", "deployments"),
    ("v1", "services"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("v1", "persistentvolumeclaims"),
)
MAX_RETRY_DELAY = 60.0


def retry_delay(retry: int) -> float:
    """5, 10, 20, 40, 60, 60, ... seconds."""
    return float(min(MAX_RETRY_DELAY, 5.0 * 2 ** min(retry, 10)))


def kopf_settings(config: OperatorSettings) -> kopf.OperatorSettings:
    """kopf's settings for this operator: our domain for its annotations, our thread pool."""
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.execution.max_workers = config.workers
    settings.posting.level = logging.INFO
    # A watch that silently stops is the classic stuck operator; recycle them.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    for selector in CHILD_RESOURCES:
        settings.watching.label_selectors[selector] = MANAGED_SELECTOR
    return settings


def _owner_name(body: kopf.Body) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if (ref.get("controller") and ref.get("kind") == KIND
                and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/")):
            return str(ref["name"])
    return None


class Resync:
    """The periodic backstop: re-reconcile every EmbeddingService the watch has seen."""

    def __init__(self, reconciler: Reconciler, interval: float, concurrency: int) -> None:
        self._reconciler = reconciler
        self._interval = interval
        self._concurrency = max(1, concurrency)
        self._known: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def seen(self, namespace: str, name: str) -> None:
        with self._lock:
            self._known.add((namespace, name))

    def gone(self, namespace: str, name: str) -> None:
        with self._lock:
            self._known.discard((namespace, name))

    def snapshot(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._known)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: every interval, reconcile each known object (bounded concurrency).

        API errors are logged and left to the next round; anything else propagates and stops
        the operator (a crashed process gets restarted; a silently dead loop would not).
        """
        gate = asyncio.Semaphore(self._concurrency)

        async def one(namespace: str, name: str) -> None:
            async with gate:
                try:
                    await asyncio.to_thread(self._reconciler.reconcile, namespace, name,
                                            coalesce=True)
                except ApiError as exc:
                    log.warning("resync of %s/%s: %s", namespace, name, exc)

        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self._interval)
            except TimeoutError:
                await asyncio.gather(*(one(ns, n) for ns, n in self.snapshot()))


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler,
             config: OperatorSettings) -> Resync:
    """Register the handlers on ``registry`` (explicit, so tests and the CLI build their own);
    the returned ``Resync`` must run next to kopf."""
    resync = Resync(reconciler, config.resync_seconds, concurrency=max(1, config.workers // 2))

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as our own client: in-cluster token or $KUBECONFIG.
        return kopf.login_via_client(**kwargs)

    @kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    def on_change(*, namespace: str | None, name: str, retry: int, **_: Any) -> None:
        assert namespace is not None  # a namespaced resource
        try:
            outcome = reconciler.reconcile(namespace, name)
        except ApiError as exc:
            raise kopf.TemporaryError(f"API error: {exc}", delay=retry_delay(retry)) from exc
        if outcome is not None and outcome.retry and outcome.problem is not None:
            raise kopf.TemporaryError(outcome.problem.message, delay=retry_delay(retry))

    @kopf.on.event(GROUP, VERSION, PLURAL, id="track", registry=registry)
    def on_owner_event(*, namespace: str | None, name: str, type: str, **_: Any) -> None:
        if namespace is None:
            return
        if type == "DELETED":
            resync.gone(namespace, name)
            reconciler.forget(namespace, name)
        else:
            resync.seen(namespace, name)

    def on_child(*, body: kopf.Body, namespace: str | None, **_: Any) -> None:
        owner = _owner_name(body)
        if owner is None or namespace is None:
            return
        try:
            reconciler.reconcile(namespace, owner, coalesce=True)
        except ApiError as exc:
            # Typical: the namespace is being deleted and refuses new children. The owner's
            # own handlers and the resync retry; a traceback per child event is just noise.
            log.warning("reconcile of %s/%s after a child event: %s", namespace, owner, exc)

    for selector in CHILD_RESOURCES:
        kopf.on.event(*selector, id=f"child-{selector[-1]}", registry=registry,
                      labels={"app.kubernetes.io/managed-by": MANAGED_BY})(on_child)
    return resync

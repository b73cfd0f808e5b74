"""kopf handlers: thin adapters from kopf's triggers to ``Reconciler.reconcile``.

Three kinds of triggers feed the same level-based reconcile:

* the EmbeddingService was created, changed or found at startup (``create``/``update``/
  ``resume``): reconcile now; a retryable problem (a Secret not there yet) becomes a
  ``kopf.TemporaryError`` whose delay grows with each attempt (5s, 10s, ... capped at 60s);
* an owned child changed or was deleted (``event`` on Deployments, Services, HPAs, PDBs and
  PVCs, watched with a server-side label selector so the operator sees only its own children):
  enqueue the owner on a deduplicating ``WorkQueue`` whose workers re-apply drifted fields and
  refresh status from the Deployment's;
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from embedding_operator.builders.common import GROUP, KIND, MANAGED_BY, PLURAL, VERSION
from embedding_operator.kube import ApiError, controller_of
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
        prefix=GROUP, key="last-handled-configuration"
    )
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
    """The EmbeddingService controlling a child, if one does."""
    ref = controller_of(body)
    if ref is None or ref.get("kind") != KIND:
        return None
    return str(ref["name"]) if str(ref.get("apiVersion", "")).startswith(f"{GROUP}/") else None


class WorkQueue:
    """Owners to reconcile, deduplicated, worked by a thread pool of their own.

    Child events and the periodic resync only *enqueue* the owner; a key already waiting is not
    added twice (the one waiting reads the object later anyway), so a rollout's burst of
    Deployment status updates costs a few reconciles. The queue's threads are separate from
    kopf's handler threads, so bursts of child events never delay a new EmbeddingService.
    """

    def __init__(self, reconciler: Reconciler, *, interval: float, workers: int) -> None:
        self._reconciler = reconciler
        self._interval = interval
        self._workers = max(1, workers)
        self._known: set[tuple[str, str]] = set()
        self._pending: set[tuple[str, str]] = set()
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    def seen(self, namespace: str, name: str) -> None:
        self._known.add((namespace, name))

    def gone(self, namespace: str, name: str) -> None:
        self._known.discard((namespace, name))

    def add(self, namespace: str, name: str) -> None:
        """Enqueue an owner (event-loop thread only)."""
        key = (namespace, name)
        if key not in self._pending:
            self._pending.add(key)
            self._queue.put_nowait(key)

    async def run(self, stop: asyncio.Event) -> None:
        """Work the queue and enqueue every known owner each interval, until ``stop``.

        API errors are logged and left to the next event or round; anything else ends a
        worker, which ends this coroutine with that error and so the operator (a crashed
        process gets restarted; a silently dead worker would not).
        """
        executor = ThreadPoolExecutor(self._workers, thread_name_prefix="reconcile")
        workers = [asyncio.create_task(self._work(executor)) for _ in range(self._workers)]
        ticker = asyncio.create_task(self._tick(stop))
        tasks = [ticker, *workers]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            executor.shutdown(wait=False, cancel_futures=True)

    async def _tick(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self._interval)
            except TimeoutError:
                for namespace, name in sorted(self._known):
                    self.add(namespace, name)

    async def _work(self, executor: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        while True:
            namespace, name = await self._queue.get()
            self._pending.discard((namespace, name))
            try:
                await loop.run_in_executor(executor, self._reconciler.reconcile, namespace, name)
            except ApiError as exc:
                # Typical: the namespace is being deleted and refuses new children.
                log.warning("reconcile of %s/%s: %s", namespace, name, exc)


def register(
    registry: kopf.OperatorRegistry, reconciler: Reconciler, config: OperatorSettings
) -> WorkQueue:
    """Register the handlers on ``registry`` (explicit, so tests and the CLI build their own);
    the returned ``WorkQueue`` must run next to kopf."""
    queue = WorkQueue(
        reconciler, interval=config.resync_seconds, workers=max(2, config.workers // 2)
    )

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
    async def on_owner_event(*, namespace: str | None, name: str, type: str, **_: Any) -> None:
        if namespace is None:
            return
        if type == "DELETED":
            queue.gone(namespace, name)
            reconciler.forget(namespace, name)
        else:
            queue.seen(namespace, name)

    async def on_child(*, body: kopf.Body, namespace: str | None, **_: Any) -> None:
        owner = _owner_name(body)
        if owner is not None and namespace is not None:
            queue.add(namespace, owner)

    for selector in CHILD_RESOURCES:
        kopf.on.event(
            *selector,
            id=f"child-{selector[-1]}",
            registry=registry,
            labels={"app.kubernetes.io/managed-by": MANAGED_BY},
        )(on_child)
    return queue

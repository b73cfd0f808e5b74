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
* a periodic timer (``--resync-seconds``) as the backstop for anything a watch missed.

No handler returns a value (kopf would store it in status), and kopf's own bookkeeping
(progress, diff base) lives in annotations under ``embedding-operator.dev``. No finalizer is
used: children carry ownerReferences, so garbage collection deletes them.
"""

from __future__ import annotations

import logging
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


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler,
             config: OperatorSettings) -> None:
    """Register the handlers on ``registry`` (explicit, so tests and the CLI build their own)."""

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

    @kopf.timer(GROUP, VERSION, PLURAL, id="resync", registry=registry,
                interval=config.resync_seconds, initial_delay=config.resync_seconds)
    def resync(*, namespace: str | None, name: str, **_: Any) -> None:
        assert namespace is not None
        reconciler.reconcile(namespace, name)

    @kopf.on.event(GROUP, VERSION, PLURAL, id="forget", registry=registry)
    def on_owner_event(*, namespace: str | None, name: str, type: str, **_: Any) -> None:
        if type == "DELETED" and namespace is not None:
            reconciler.forget(namespace, name)

    def on_child(*, body: kopf.Body, namespace: str | None, **_: Any) -> None:
        owner = _owner_name(body)
        if owner is not None and namespace is not None:
            reconciler.reconcile(namespace, owner, coalesce=True)

    for selector in CHILD_RESOURCES:
        kopf.on.event(*selector, id=f"child-{selector[-1]}", registry=registry,
                      labels={"app.kubernetes.io/managed-by": MANAGED_BY})(on_child)

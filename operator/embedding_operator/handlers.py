"""kopf handlers: they watch and enqueue; the ``Controller`` does all the reconciling.

Every trigger becomes one ``Controller.enqueue`` of the EmbeddingService's key:

* the EmbeddingService was created, changed or found at startup (its ``event`` handler, when
  the digest of its spec, labels, annotations and deletion differs from the last event's:
  ``versions.EssenceChanges``, so our own status writes do not trigger it). Not kopf's
  ``create``/``update``/``resume``: they would have kopf write a ``last-handled-configuration``
  annotation on every object to tell them apart, a PATCH per new service;
* an owned child changed or was deleted (``event`` on Deployments, Services, HPAs, KEDA
  ScaledObjects, PDBs, PVCs and NetworkPolicies, watched with a server-side label selector so
  the operator sees only its own children; kopf watches ScaledObjects once KEDA's CRD exists):
  the controlling EmbeddingService is enqueued, so drifted fields are re-applied and status
  follows the Deployment's (but not for a ScaledObject event that only moves KEDA's
  ``lastActiveTime`` within the minute: ``versions.EssenceChanges``);
* a server pod changed (``event`` on pods, label-selected the same way): its EmbeddingService,
  named by the pod's ``app.kubernetes.io/instance`` label, is enqueued, so a pod the kubelet
  cannot start (a missing Secret) or a model that will not load is reported as soon as the
  kubelet says so; its restarts are counted (``metrics.py``), and what the reconciler reads of
  it is kept in ``WatchedPods``, first, so that the reconcile sees it without a LIST;
* the same ``event`` handler keeps the set the periodic resync walks, and who claims which
  model name (``names.NameClaims``): when an object's names or its existence change, every
  other claimant of those names is enqueued too, since its ``NamesOwned`` may have changed.

The EmbeddingService and child handlers also record each object's ``resourceVersion`` in
``WatchedVersions``, so the reconciler can skip a resync of an object nothing has changed
(``versions.py``).

Handlers are coroutines that never call the API or raise, so kopf's own retry machinery is
never involved: retries and their backoff are the work queue's (``controller.py``). No handler
returns a value (kopf would store it in status), and kopf's own bookkeeping (progress, diff
base) lives in annotations under ``embedding-operator.dev``. No finalizer is used: children
carry ownerReferences, so garbage collection deletes them.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from embedding_operator.builders.common import (
    APP_NAME,
    GROUP,
    KIND,
    MANAGED_BY,
    PLURAL,
    VERSION,
)
from embedding_operator.controller import Controller
from embedding_operator.kube import controller_of
from embedding_operator.metrics import OperatorMetrics
from embedding_operator.names import NameClaims
from embedding_operator.reconcile import Reconciler
from embedding_operator.settings import OperatorSettings
from embedding_operator.versions import (
    EssenceChanges,
    WatchedPods,
    WatchedVersions,
    owner_essence,
    scaledobject_essence,
)

MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
# kopf resource selectors (group/version/plural; core resources have no group).
CHILD_RESOURCES: tuple[tuple[str, str] | tuple[str, str, str], ...] = (
    ("apps", "v1", "deployments"),
    ("v1", "services"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("keda.sh", "v1alpha1", "scaledobjects"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("v1", "persistentvolumeclaims"),
    ("networking.k8s.io", "v1", "networkpolicies"),
)
POD_RESOURCE = ("v1", "pods")
JOB_RESOURCE = ("batch", "v1", "jobs")
"""An EmbeddingJob's Jobs (``jobs/handlers.py`` registers their handler)."""


def kopf_settings(config: OperatorSettings) -> kopf.OperatorSettings:
    """kopf's settings: our domain for its annotations, label-selected watches on children."""
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
    for selector in (*CHILD_RESOURCES, POD_RESOURCE, JOB_RESOURCE):
        settings.watching.label_selectors[selector] = MANAGED_SELECTOR
    return settings


def _owner_name(body: kopf.Body) -> str | None:
    """The EmbeddingService controlling a child, if one does."""
    ref = controller_of(body)
    if ref is None or ref.get("kind") != KIND:
        return None
    return str(ref["name"]) if str(ref.get("apiVersion", "")).startswith(f"{GROUP}/") else None


def _version(body: kopf.Body, type: str | None) -> str | None:
    """The resourceVersion an event reports; None for a deletion."""
    if type == "DELETED":
        return None
    return str(body.get("metadata", {}).get("resourceVersion") or "") or None


def register(
    registry: kopf.OperatorRegistry,
    reconciler: Reconciler,
    config: OperatorSettings,
    versions: WatchedVersions | None = None,
    metrics: OperatorMetrics | None = None,
    pods: WatchedPods | None = None,
    names: NameClaims | None = None,
) -> Controller:
    """Register the handlers on ``registry`` (explicit, so tests and the CLI build their own);
    the returned ``Controller`` does the work and must run next to kopf. ``versions``, when
    given, is told every resourceVersion the watches report (the reconciler's skip of settled,
    unchanged objects, ``versions.py``); ``pods``, every server pod the pod watch reports."""
    controller = Controller(
        reconciler, resync_seconds=config.resync_seconds, workers=config.workers, metrics=metrics
    )

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as our own client: in-cluster token or $KUBECONFIG.
        return kopf.login_via_client(**kwargs)

    owners = EssenceChanges(owner_essence)
    scaledobjects = EssenceChanges(scaledobject_essence)

    @kopf.on.event(GROUP, VERSION, PLURAL, id="track", registry=registry)
    async def on_owner_event(
        *, body: kopf.Body, namespace: str | None, name: str, type: str | None, **_: Any
    ) -> None:
        if namespace is None:  # never: a namespaced resource
            return
        if versions is not None:
            versions.owner_event(namespace, name, _version(body, type))
        deleted = type == "DELETED"
        if deleted:
            controller.gone(namespace, name)
        else:
            controller.seen(namespace, name)
        # Created, found at startup (type None: kopf's initial listing), or its spec or
        # metadata changed; not our own status writes.
        if owners.worth_a_reconcile(namespace, name, body, deleted=deleted) and not deleted:
            controller.enqueue(namespace, name)
        if names is not None:
            for other in names.update(namespace, name, None if deleted else body):
                controller.enqueue(*other)

    async def on_child(
        *, body: kopf.Body, namespace: str | None, name: str, type: str | None, **_: Any
    ) -> None:
        owner = _owner_name(body)
        if owner is not None and namespace is not None:
            kind = str(body.get("kind") or "")
            if versions is not None:
                versions.child_event(namespace, owner, kind, name, _version(body, type))
            if kind == "ScaledObject" and not scaledobjects.worth_a_reconcile(
                namespace, name, body, deleted=type == "DELETED"
            ):
                return  # KEDA's per-poll lastActiveTime, within the minute: nothing to see
            controller.enqueue(namespace, owner)

    for selector in CHILD_RESOURCES:
        kopf.on.event(
            *selector,
            id=f"child-{selector[-1]}",
            registry=registry,
            labels={"app.kubernetes.io/managed-by": MANAGED_BY},
        )(on_child)

    @kopf.on.event(
        *POD_RESOURCE,
        id="server-pods",
        registry=registry,
        labels={"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/name": APP_NAME},
    )
    async def on_pod(
        *,
        body: kopf.Body,
        labels: kopf.Labels,
        namespace: str | None,
        type: str | None,
        **_: Any,
    ) -> None:
        instance = labels.get("app.kubernetes.io/instance")
        if instance and namespace is not None:
            controller.metrics.pod(namespace, instance, dict(body), deleted=type == "DELETED")
            if pods is not None:
                pods.pod_event(namespace, instance, body, deleted=type == "DELETED")
            controller.enqueue(namespace, instance)

    return controller

"""kopf handlers for EmbeddingJobs: they watch and enqueue; a ``Controller`` of its own does
the reconciling (one concern per controller, and one queue per kind, so a key is the
``(namespace, name)`` of an EmbeddingJob there and of an EmbeddingService in the other).

Triggers: an EmbeddingJob was created, changed (its spec or metadata, not our status writes:
``versions.EssenceChanges``) or found at startup; one of its Jobs changed (label-selected,
``app.kubernetes.io/name=embedding-job``: a pod started or finished, an index completed or
failed, the Job finished); a job pod's container terminated (its message is kept in
``jobs.pods.WatchedJobPods`` first, so the reconcile reads no pod from the API); the
EmbeddingService an unfinished job names changed (it turned
Ready: the workers may start); a job pod that starts or stops waiting for its configuration
(the credentials Secret missing, then created: ``SecretNotFound`` is reported and cleared at
once). The periodic resync covers the rest and is also what deletes a finished job after
``ttlSecondsAfterFinished``, with the work queue's delayed add for the exact time.
"""

from __future__ import annotations

from typing import Any

import kopf

from embedding_operator.builders.common import GROUP, MANAGED_BY, PLURAL, VERSION
from embedding_operator.controller import Controller
from embedding_operator.handlers import JOB_RESOURCE, POD_RESOURCE
from embedding_operator.jobs.builders import APP_NAME, JOB_KIND, JOB_PLURAL
from embedding_operator.jobs.pods import WatchedJobPods, terminated_now
from embedding_operator.jobs.reconcile import JobReconciler
from embedding_operator.jobs.status import TERMINAL_PHASES
from embedding_operator.kube import controller_of
from embedding_operator.metrics import OperatorMetrics
from embedding_operator.settings import OperatorSettings
from embedding_operator.versions import EssenceChanges, owner_essence

JOB_CONTROLLER = "embeddingjob"
"""The ``controller`` (and work queue ``name``) label of the EmbeddingJob controller's metrics."""
JOB_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/name": APP_NAME}


def job_workers(config: OperatorSettings) -> int:
    """Reconcile threads for EmbeddingJobs: a quarter of the EmbeddingServices' (jobs are
    few and each reconcile is a handful of calls)."""
    return max(1, config.workers // 4)


def register_jobs(
    registry: kopf.OperatorRegistry,
    reconciler: JobReconciler,
    config: OperatorSettings,
    pods: WatchedJobPods | None = None,
    metrics: OperatorMetrics | None = None,
) -> Controller:
    """Register the EmbeddingJob handlers; run the returned ``Controller`` next to kopf. Its
    reconciles and queue are counted in ``metrics`` under the controller name
    :data:`JOB_CONTROLLER` (controller-runtime's series, as the EmbeddingServices')."""
    controller = Controller(
        reconciler,
        resync_seconds=config.resync_seconds,
        workers=job_workers(config),
        metrics=metrics,
        name=JOB_CONTROLLER,
    )
    owners = EssenceChanges(owner_essence)
    # (namespace, EmbeddingService) -> the unfinished EmbeddingJobs that name it: a service
    # turning Ready starts their workers at once, not at the job's next retry.
    waiting: dict[tuple[str, str], set[str]] = {}

    def track(namespace: str, name: str, body: kopf.Body, deleted: bool) -> None:
        for (ns, _), names in waiting.items():
            if ns == namespace:
                names.discard(name)
        service = str((body.get("spec") or {}).get("service") or "")
        phase = (body.get("status") or {}).get("phase")
        if service and not deleted and phase not in TERMINAL_PHASES:
            waiting.setdefault((namespace, service), set()).add(name)

    @kopf.on.event(GROUP, VERSION, JOB_PLURAL, id="track-jobs", registry=registry)
    async def on_embedding_job(
        *, body: kopf.Body, namespace: str | None, name: str, type: str | None, **_: Any
    ) -> None:
        if namespace is None:
            return
        deleted = type == "DELETED"
        track(namespace, name, body, deleted)
        if deleted:
            controller.gone(namespace, name)
        else:
            controller.seen(namespace, name)
        if owners.worth_a_reconcile(namespace, name, body, deleted=deleted) and not deleted:
            controller.enqueue(namespace, name)

    @kopf.on.event(*JOB_RESOURCE, id="embedding-job-jobs", registry=registry, labels=JOB_LABELS)
    async def on_job(*, body: kopf.Body, namespace: str | None, **_: Any) -> None:
        ref = controller_of(body)
        if ref is None or ref.get("kind") != JOB_KIND or namespace is None:
            return
        if str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            controller.enqueue(namespace, str(ref["name"]))

    @kopf.on.event(*POD_RESOURCE, id="embedding-job-pods", registry=registry, labels=JOB_LABELS)
    async def on_pod(
        *, body: kopf.Body, labels: kopf.Labels, namespace: str | None, type: str | None, **_: Any
    ) -> None:
        job = labels.get("app.kubernetes.io/instance")
        component = labels.get("app.kubernetes.io/component")
        if not job or not component or namespace is None:
            return
        if pods is not None:
            blocking_changed = pods.pod_event(
                namespace, job, component, body, deleted=type == "DELETED"
            )
            if terminated_now(body) or blocking_changed:
                controller.enqueue(namespace, job)

    @kopf.on.event(GROUP, VERSION, PLURAL, id="embedding-job-services", registry=registry)
    async def on_service(*, namespace: str | None, name: str, **_: Any) -> None:
        if namespace is None:
            return
        for job in sorted(waiting.get((namespace, name), ())):
            controller.enqueue(namespace, job)

    return controller

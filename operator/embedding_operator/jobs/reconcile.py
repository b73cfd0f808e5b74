"""``JobReconciler.reconcile(namespace, name)``: move one EmbeddingJob one step forward.

Each reconcile reads the facts (the EmbeddingJob, its Jobs and, once they ran, their pods),
creates what the next phase needs, and writes the status computed from the facts
(``jobs/status.py``) when it differs:

1. the ServiceAccount and the planner Job, once the EmbeddingService exists (its image runs
   the planner and the workers; with ``spec.model``, no service is waited for and the
   operator's default image runs them);
2. when the planner succeeded, and the EmbeddingService is Ready (``spec.model``: at once),
   the worker Job of the planner's S shards (none when S is 0: the job is Complete);
3. afterwards only ``spec.suspend`` and ``spec.parallelism`` are kept in step on the Jobs
   (their pod templates are immutable; the CRD makes the fields that shape them immutable
   too).

Complete and Failed are final: a reconcile of a finished EmbeddingJob creates nothing, even if
its Jobs were deleted, and only waits for ``ttlSecondsAfterFinished`` to delete it (within a
second of the deadline: the reconcile asks the work queue to come back then).

A name held by an object this EmbeddingJob does not control is never written (as
``apply.py``'s rule for EmbeddingServices): ``ChildConflict``, retried until the name is
free. A Job the API server refuses fails the EmbeddingJob (``ChildRejected``, with the API
server's message). The operator never reads the credentials Secret: a missing one is
reported from the pods' ``CreateContainerConfigError``. API errors propagate to the work
queue, which retries them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from embedding_operator.bluegreen import next_name
from embedding_operator.builders.common import (
    API_VERSION,
    DEFAULT_IMAGE,
    KIND,
    Manifest,
    Owner,
)
from embedding_operator.jobs.builders import (
    JOB_API_VERSION,
    JOB_KIND,
    PLANNER,
    ROWS_ANNOTATION,
    WORKER,
    ServiceTarget,
    build_planner_job,
    build_service_account,
    build_worker_job,
    mutable_fields,
    planner_name,
    pod_selector,
    service_account_name,
    worker_name,
)
from embedding_operator.jobs.pods import WatchedJobPods
from embedding_operator.jobs.spec import EmbeddingJobSpec, InvalidSpecError, parse_job_spec
from embedding_operator.jobs.status import (
    CHILD_CONFLICT,
    CHILD_REJECTED,
    FAILED,
    INVALID_SPEC,
    SERVICE_NOT_FOUND,
    SERVICE_NOT_READY,
    TERMINAL_PHASES,
    JobFacts,
    Plan,
    WorkerFacts,
    compute_job_status,
    container_config_problem,
    job_condition,
    plan_result,
    planner_message,
)
from embedding_operator.kube import ApiError, Cluster, ObjectRef, controller_of
from embedding_operator.reconcile import EventRecorder, Outcome, utc_now
from embedding_operator.spec import parse_spec
from embedding_operator.status import Problem, merge_conditions, status_patch

log = logging.getLogger(__name__)


def job_ref(namespace: str, name: str) -> ObjectRef:
    return ObjectRef(JOB_API_VERSION, JOB_KIND, namespace, name)


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


class _Conflict(Exception):
    """A child's name is held by an object this EmbeddingJob does not control."""


class _Rejected(Exception):
    """The API server refused a child (400/422): a cluster without Indexed Jobs'
    backoffLimitPerIndex (Kubernetes before 1.29), an admission policy."""


class JobReconciler:
    """Reconciles EmbeddingJobs against a ``Cluster`` (one object at a time, per the queue)."""

    def __init__(
        self,
        *,
        cluster: Cluster,
        recorder: EventRecorder,
        default_image: str = DEFAULT_IMAGE,
        clock: Callable[[], str] = utc_now,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        pods: WatchedJobPods | None = None,
    ) -> None:
        self._cluster = cluster
        self._watched = pods
        self._recorder = recorder
        self._default_image = default_image
        self._clock = clock
        self._now = now

    def forget(self, namespace: str, name: str) -> None:
        """Drop the deleted job's pods from the watch's cache (status keeps no state)."""
        if self._watched is not None:
            self._watched.forget(namespace, name)

    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        started = time.monotonic()
        body = self._cluster.get(job_ref(namespace, name))
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        outcome = self._reconcile(body)
        log.debug(
            "reconciled EmbeddingJob %s/%s in %.3fs: applied=%s problem=%s",
            namespace,
            name,
            time.monotonic() - started,
            list(outcome.applied),
            outcome.problem and outcome.problem.reason,
        )
        return outcome

    # --- the steps ------------------------------------------------------------------------

    def _reconcile(self, body: dict[str, Any]) -> Outcome:
        owner = Owner.from_body(body)
        old = dict(body.get("status") or {})
        if old.get("phase") in TERMINAL_PHASES:
            return self._finished(body, old)
        try:
            spec = parse_job_spec(body.get("spec") or {})
        except InvalidSpecError as exc:
            facts = JobFacts(suspend=False, problem=Problem(INVALID_SPEC, str(exc)))
            outcome = self._write(body, owner, facts, ())
            ttl = (body.get("spec") or {}).get("ttlSecondsAfterFinished")
            if isinstance(ttl, int) and ttl >= 0:  # come back to delete it (_finished)
                outcome = dataclasses.replace(outcome, requeue_after=float(ttl) + 1)
            return outcome
        applied: list[str] = []
        try:
            facts = self._advance(owner, spec, applied)
        except _Conflict as exc:
            facts = JobFacts(
                suspend=spec.suspend, problem=Problem(CHILD_CONFLICT, str(exc), retryable=True)
            )
        except _Rejected as exc:
            facts = JobFacts(suspend=spec.suspend, problem=Problem(CHILD_REJECTED, str(exc)))
        return self._write(body, owner, facts, tuple(applied))

    def _advance(self, owner: Owner, spec: EmbeddingJobSpec, applied: list[str]) -> JobFacts:
        ns = owner.namespace
        worker = self._owned(ObjectRef("batch/v1", "Job", ns, worker_name(owner)), owner)
        planner = self._owned(ObjectRef("batch/v1", "Job", ns, planner_name(owner)), owner)
        if worker is not None:
            worker = self._keep_in_step(worker, spec, applied)
            pods = self._pods(owner, WORKER, worker)
            workers = WorkerFacts.from_live(worker, pods)
            if self._watched is not None and workers.reported < workers.shards_done:
                # The watch has not delivered every committed shard's pod yet (the Job's
                # event came first, or the operator just started): read them all once.
                pods = self._pods(owner, WORKER, worker, listed=True)
                workers = WorkerFacts.from_live(worker, pods)
            problem = None if workers.suspended else container_config_problem(pods)
            return JobFacts(spec.suspend, planner, None, workers, problem)
        if planner is None:
            service, problem = self._service(owner, spec, need_ready=False)
            if problem is not None or service is None:
                return JobFacts(spec.suspend, problem=problem)
            self._create(build_service_account(owner), owner, applied, check=True)
            planner = self._create(
                build_planner_job(owner, spec, service.image, service.pull_policy), owner, applied
            )
            return JobFacts(spec.suspend, planner)
        planner = self._keep_in_step(planner, spec, applied)
        pods = self._pods(owner, PLANNER, planner)
        finished = job_condition(planner, "Complete") or job_condition(planner, FAILED)
        if self._watched is not None and finished and planner_message(pods) is None:
            pods = self._pods(owner, PLANNER, planner, listed=True)
        message = planner_message(pods)
        facts = JobFacts(spec.suspend, planner, message)
        plan = plan_result(facts)
        if not isinstance(plan, Plan):
            problem = None
            if plan is None and job_condition(planner, "Complete") is None and not spec.suspend:
                problem = container_config_problem(pods)
            return JobFacts(spec.suspend, planner, message, problem=problem)
        if plan.shards == 0:
            return facts
        service, problem = self._service(owner, spec, need_ready=True)
        if problem is not None or service is None:
            return JobFacts(spec.suspend, planner, message, problem=problem)
        manifest = build_worker_job(
            owner,
            spec,
            shards=plan.shards,
            rows=plan.rows,
            image=service.image,
            service_url=service.url,
            model=service.model,
            pull_policy=service.pull_policy,
            api_key=service.api_key,
        )
        self._create(build_service_account(owner), owner, applied, check=True)
        worker = self._create(manifest, owner, applied)
        return JobFacts(spec.suspend, planner, message, WorkerFacts.from_live(worker, []))

    def _finished(self, body: dict[str, Any], old: dict[str, Any]) -> Outcome:
        """A finished job: nothing to create; delete it once its TTL has passed."""
        ttl = (body.get("spec") or {}).get("ttlSecondsAfterFinished")
        # A job refused before any Job ran (InvalidSpec) has no completion time: it finished
        # when its Failed condition turned True.
        ended = [
            c.get("lastTransitionTime")
            for c in old.get("conditions") or []
            if c.get("type") in ("Complete", FAILED) and c.get("status") == "True"
        ]
        finished = _parse_time(old.get("completionTime") or (ended[0] if ended else None))
        if not isinstance(ttl, int) or finished is None:
            return Outcome(problem=None, status_written=False)
        left = finished.timestamp() + int(ttl) - self._now().timestamp()
        if left > 0:
            return Outcome(problem=None, status_written=False, requeue_after=left)
        meta = body["metadata"]
        self._cluster.delete(job_ref(meta["namespace"], meta["name"]), uid=meta.get("uid"))
        log.info(
            "deleted EmbeddingJob %s/%s: ttlSecondsAfterFinished (%ss) passed",
            meta["namespace"],
            meta["name"],
            ttl,
        )
        return Outcome(problem=None, status_written=False, applied=("-EmbeddingJob",))

    # --- reading and writing children -----------------------------------------------------

    def _owned(self, ref: ObjectRef, owner: Owner) -> dict[str, Any] | None:
        """The child at ``ref`` if this EmbeddingJob controls it; None if the name is free;
        ``_Conflict`` if someone else holds it."""
        live = self._cluster.get(ref)
        if live is None:
            return None
        controller = controller_of(live)
        if controller is not None and controller.get("uid") == owner.uid:
            return live
        holder = (
            "has no controller ownerReference"
            if controller is None
            else f"is controlled by {controller.get('kind')} {controller.get('name')}"
        )
        raise _Conflict(
            f"{ref.kind} {ref.namespace}/{ref.name} already exists and {holder}: the operator "
            "never adopts or changes objects it did not create; delete or rename it, or "
            "rename the EmbeddingJob"
        )

    def _create(
        self, manifest: Manifest, owner: Owner, applied: list[str], *, check: bool = False
    ) -> dict[str, Any]:
        """Create ``manifest`` (an apply without force: a namesake created meanwhile is a
        conflict, not ours); with ``check``, an existing child of ours is kept as it is."""
        meta = manifest["metadata"]
        ref = ObjectRef(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        if check:
            live = self._owned(ref, owner)
            if live is not None:
                return live
        try:
            created = self._cluster.apply(manifest, force=False)
        except ApiError as exc:
            if exc.status in (400, 422):
                raise _Rejected(f"{ref.kind} {ref.name} was refused: {exc.message}") from None
            raise
        if (controller_of(created) or {}).get("uid") != owner.uid:
            raise _Conflict(f"{ref.kind} {ref.namespace}/{ref.name} is held by another object")
        applied.append(ref.kind)
        log.info("created %s %s/%s", ref.kind, ref.namespace, ref.name)
        return created

    def _keep_in_step(
        self, job: dict[str, Any], spec: EmbeddingJobSpec, applied: list[str]
    ) -> dict[str, Any]:
        """Patch ``suspend`` (and the workers' ``parallelism``) when the spec changed them."""
        if job_condition(job, "Complete") or job_condition(job, FAILED):
            return job
        live_spec = job.get("spec") or {}
        is_worker = live_spec.get("completionMode") == "Indexed"
        wanted = mutable_fields(spec, int(live_spec.get("completions") or 1) if is_worker else None)
        if all(live_spec.get(k) == v for k, v in wanted.items()):
            return job
        meta = job["metadata"]
        patched = self._cluster.merge_patch(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "spec": wanted,
            }
        )
        applied.append("Job")
        log.info("patched Job %s/%s: %s", meta["namespace"], meta["name"], wanted)
        return patched

    def _pods(
        self, owner: Owner, component: str, job: dict[str, Any], *, listed: bool = False
    ) -> list[dict[str, Any]]:
        """The Job's pods (label-selected, and controlled by this very Job): from the pod
        watch when there is one, unless ``listed``; else a LIST."""
        uid = (job.get("metadata") or {}).get("uid")
        if self._watched is not None and not listed:
            pods = self._watched.pods(owner.namespace, owner.name, component)
        else:
            pods = self._cluster.list_pods(owner.namespace, pod_selector(owner, component))
        return [p for p in pods if (controller_of(p) or {}).get("uid") == uid]

    def _service(
        self, owner: Owner, spec: EmbeddingJobSpec, *, need_ready: bool
    ) -> tuple[ServiceTarget | None, Problem | None]:
        """What ``spec.service`` gives the job's pods, or why it cannot yet. A job whose own
        pods load the model (``spec.model``) waits for no service: they run the operator's
        image, and the worker checks ``spec.fingerprint`` against the model it loaded."""
        if spec.service is None:
            return ServiceTarget.own_pods(self._default_image), None
        ref = ObjectRef(API_VERSION, KIND, owner.namespace, spec.service)
        service = self._cluster.get(ref)
        if service is None:
            return None, Problem(
                SERVICE_NOT_FOUND,
                f"spec.service: EmbeddingService {owner.namespace}/{spec.service} does not "
                "exist (the job waits for it)",
                retryable=True,
            )
        try:
            parsed = parse_spec(service.get("spec") or {})
        except InvalidSpecError:
            parsed = None
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (service.get("status") or {}).get("conditions") or []
        )
        if parsed is None or (need_ready and not ready):
            return None, Problem(
                SERVICE_NOT_READY,
                f"spec.service: EmbeddingService {spec.service} is not Ready; the workers "
                "start once it is",
                retryable=True,
            )
        if spec.fingerprint is None or not need_ready:  # the planner embeds nothing
            target = ServiceTarget.of(owner.namespace, spec.service, parsed, self._default_image)
            return target, None
        status = service.get("status") or {}
        rollout = status.get("rollout") or {}
        active = str(
            rollout.get("activeFingerprint")
            or (status.get("contract") or {}).get("fingerprint")
            or ""
        )
        pending = str(rollout.get("pendingFingerprint") or "")
        if active.startswith(spec.fingerprint):
            target = ServiceTarget.of(owner.namespace, spec.service, parsed, self._default_image)
            return target, None
        if pending.startswith(spec.fingerprint) and pending:
            # The new model of a change under way, by itself (bluegreen.py's <name>-next).
            target = ServiceTarget.of(
                owner.namespace,
                spec.service,
                parsed,
                self._default_image,
                service=next_name(Owner(spec.service, owner.namespace, "")),
            )
            return target, None
        serves = f"serves {active or 'no recorded fingerprint yet'}"
        if pending:
            serves += f" and prepares {pending}"
        return None, Problem(
            SERVICE_NOT_READY,
            f"spec.fingerprint: EmbeddingService {spec.service} {serves}, not {spec.fingerprint}; "
            "the workers start once it serves that computation",
            retryable=True,
        )

    # --- status -----------------------------------------------------------------------------

    def _write(
        self, body: dict[str, Any], owner: Owner, facts: JobFacts, applied: tuple[str, ...]
    ) -> Outcome:
        old: dict[str, Any] = dict(body.get("status") or {})
        status, conditions, phase = compute_job_status(owner.generation, facts)
        status["conditions"] = merge_conditions(
            old.get("conditions"), conditions, generation=owner.generation, now=self._clock()
        )
        problem = facts.problem
        patch = status_patch(old, status)
        written = False
        if patch is not None:
            self._cluster.patch_status(job_ref(owner.namespace, owner.name), patch)
            written = True
            self._announce(body, old, status)
        requeue = None
        if (
            phase in TERMINAL_PHASES
            and (body.get("spec") or {}).get("ttlSecondsAfterFinished") is not None
        ):
            requeue = 0.0  # the next reconcile sees the final phase and keeps the TTL
        return Outcome(
            problem=problem, status_written=written, applied=applied, requeue_after=requeue
        )

    def _announce(self, body: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> None:
        """An Event per phase change, and per problem when it first appears."""
        before = {c.get("type"): c for c in old.get("conditions") or []}
        for cond in new["conditions"]:
            prev = before.get(cond["type"]) or {}
            if (prev.get("status"), prev.get("reason")) == (cond["status"], cond["reason"]):
                continue
            if (
                cond["type"] == "Complete"
                and cond["status"] == "False"
                and cond["reason"]
                in (
                    SERVICE_NOT_FOUND,
                    SERVICE_NOT_READY,
                    "SecretNotFound",
                    CHILD_CONFLICT,
                )
            ):
                self._recorder(body, type="Warning", reason=cond["reason"], message=cond["message"])
        phase = new.get("phase")
        if phase != old.get("phase"):
            warning = phase == "Failed"
            message = next(
                (
                    c["message"]
                    for c in new["conditions"]
                    if c["type"] == ("Failed" if warning else "Complete")
                ),
                "",
            )
            self._recorder(
                body,
                type="Warning" if warning else "Normal",
                reason=str(phase),
                message=message or f"phase {phase}",
            )
            log.info(
                "EmbeddingJob %s/%s: %s -> %s",
                body["metadata"]["namespace"],
                body["metadata"]["name"],
                old.get("phase") or "-",
                phase,
            )


__all__ = ["ROWS_ANNOTATION", "JobReconciler", "job_ref", "service_account_name"]

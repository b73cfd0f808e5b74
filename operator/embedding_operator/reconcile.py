"""One reconcile of one EmbeddingService: facts in, children and status out.

Level-based and idempotent: every trigger (the resource changed, a child changed, the periodic
resync, the operator restarted) runs the same ``Reconciler.reconcile`` on a freshly read object,
so a reconcile cut short by a crash is simply finished by the next one. The only caller is the
work queue's ``Controller``, which never runs two reconciles of one object at once; different
objects run in parallel on its worker threads.

Problems are sorted by who can fix them:

* the API server refuses what it can see (schema, CEL) before we ever run;
* what only the operator can see and only an edit can fix (unknown GPU type, a spec the schema
  let through but the model refuses, a name conflict, a child the API server refuses) is
  reported as ``Degraded`` plus a Warning Event, and the operator waits for the next edit;
* what may fix itself (a Secret not created yet) is reported the same way and retried with a
  growing delay by the work queue (``Outcome.retry``).

While a problem found before applying stands (invalid spec, unknown GPU type, missing
Secret), no child is created, changed or deleted: an edit that breaks a running service (say,
a gpu.type this cluster has no profile for) leaves its Deployment on the last spec that
worked, still serving, with ``Ready`` False because the current spec is not what runs. The
edit that fixes the problem clears ``Degraded`` and converges as usual.

API errors (server down, 5xx, timeouts) propagate: the work queue retries them with the same
growing delay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from embedding_operator.apply import ChildConflictError, ChildRejectedError, sync_children
from embedding_operator.builders.common import API_VERSION, KIND, Owner, RenderInput
from embedding_operator.kube import Cluster, ObjectRef, controller_of
from embedding_operator.plan import Planned, Refused, plan
from embedding_operator.profiles import GpuProfiles
from embedding_operator.spec import EmbeddingServiceSpec
from embedding_operator.status import (
    AVAILABLE,
    CHILD_CONFLICT,
    CHILD_REJECTED,
    DEGRADED,
    READY,
    SECRET_NOT_FOUND,
    Problem,
    compute_status,
    merge_conditions,
    status_patch,
)

log = logging.getLogger(__name__)


class EventRecorder(Protocol):
    def __call__(self, body: dict[str, Any], *, type: str, reason: str, message: str) -> None: ...


@dataclass(frozen=True)
class Outcome:
    """What a reconcile found; ``problem.retryable`` asks the caller to retry later."""

    problem: Problem | None
    status_written: bool
    applied: tuple[str, ...] = ()

    @property
    def retry(self) -> bool:
        return self.problem is not None and self.problem.retryable


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_ref(namespace: str, name: str) -> ObjectRef:
    return ObjectRef(API_VERSION, KIND, namespace, name)


class Reconciler:
    """Reconciles EmbeddingServices against a ``Cluster``.

    Threads may reconcile different objects at once, never the same one (the work queue's
    guarantee), so per-object state needs no lock.
    """

    def __init__(
        self,
        *,
        cluster: Cluster,
        profiles: GpuProfiles,
        default_image: str,
        recorder: EventRecorder,
        clock: Callable[[], str] = utc_now,
    ) -> None:
        self._cluster = cluster
        self._profiles = profiles
        self._default_image = default_image
        self._recorder = recorder
        self._clock = clock
        # (namespace, name) -> (uid, generation) whose unwanted children are known to be gone;
        # the uid keeps a re-created object of the same name from inheriting the check.
        self._absent_checked: dict[tuple[str, str], tuple[str, int]] = {}

    def forget(self, namespace: str, name: str) -> None:
        """Drop per-object state of a deleted EmbeddingService."""
        self._absent_checked.pop((namespace, name), None)

    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        """Reconcile the current state of one object; None if it is gone or going."""
        started = time.monotonic()
        body = self._cluster.get(owner_ref(namespace, name))
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return None
        outcome = self._reconcile(body)
        log.debug(
            "reconciled %s/%s in %.3fs: applied=%s status_written=%s problem=%s",
            namespace,
            name,
            time.monotonic() - started,
            list(outcome.applied),
            outcome.status_written,
            outcome.problem and outcome.problem.reason,
        )
        return outcome

    def _reconcile(self, body: dict[str, Any]) -> Outcome:
        owner = Owner.from_body(body)
        planned = plan(owner, body.get("spec") or {}, self._profiles, self._default_image)
        problem: Problem | None
        if isinstance(planned, Refused):
            problem = planned.problem
        else:
            # A spec that can never start outranks a Secret that may still appear.
            problem = self._missing_secret(owner, planned.render.spec)

        deployment: dict[str, Any] | None = None
        applied: tuple[str, ...] = ()
        if isinstance(planned, Planned) and problem is None:
            try:
                key, seen = (owner.namespace, owner.name), (owner.uid, owner.generation)
                checked = self._absent_checked.get(key) == seen
                result = sync_children(
                    self._cluster, owner, planned.children, check_absent=not checked
                )
                self._absent_checked[key] = seen
                deployment = result.live.get("Deployment")
                applied = tuple(result.applied + [f"-{k}" for k in result.deleted])
            except ChildConflictError as exc:
                problem = Problem(CHILD_CONFLICT, str(exc))
            except ChildRejectedError as exc:
                problem = Problem(CHILD_REJECTED, str(exc))
        if deployment is None:
            ref = ObjectRef("apps/v1", "Deployment", owner.namespace, owner.name)
            live = self._cluster.get(ref)
            if live is not None and (controller_of(live) or {}).get("uid") == owner.uid:
                deployment = live

        render = planned.render if isinstance(planned, Planned) else None
        written = self._write_status(body, owner, render, deployment, problem)
        return Outcome(problem=problem, status_written=written, applied=applied)

    def _missing_secret(self, owner: Owner, spec: EmbeddingServiceSpec) -> Problem | None:
        for field, ref in (
            ("spec.model.hubTokenSecretRef", spec.model.hub_token_secret_ref),
            ("spec.apiKeySecretRef", spec.api_key_secret_ref),
        ):
            if ref is None:
                continue
            secret = self._cluster.get(ObjectRef("v1", "Secret", owner.namespace, ref.name))
            if secret is None:
                return Problem(
                    SECRET_NOT_FOUND,
                    f"{field}: Secret {owner.namespace}/{ref.name} not found",
                    retryable=True,
                )
            if ref.key not in (secret.get("data") or {}) and ref.key not in (
                secret.get("stringData") or {}
            ):
                return Problem(
                    SECRET_NOT_FOUND,
                    f"{field}: Secret {owner.namespace}/{ref.name} has no key {ref.key!r}",
                    retryable=True,
                )
        return None

    def _write_status(
        self,
        body: dict[str, Any],
        owner: Owner,
        render: RenderInput | None,
        deployment: dict[str, Any] | None,
        problem: Problem | None,
    ) -> bool:
        old: dict[str, Any] = dict(body.get("status") or {})
        status, conditions = compute_status(
            generation=owner.generation, render=render, deployment=deployment, problem=problem
        )
        status["conditions"] = merge_conditions(
            old.get("conditions"), conditions, generation=owner.generation, now=self._clock()
        )
        patch = status_patch(old, status)
        if patch is None:
            return False
        self._cluster.patch_status(owner_ref(owner.namespace, owner.name), patch)
        self._announce(body, old.get("conditions") or [], status["conditions"])
        return True

    def _announce(
        self, body: dict[str, Any], before: list[dict[str, Any]], after: list[dict[str, Any]]
    ) -> None:
        """Events on transitions only, so a resource stuck in a state does not spam."""
        old = {c.get("type"): c for c in before}
        for cond in after:
            prev = old.get(cond["type"]) or {}
            flipped = (prev.get("status"), prev.get("reason")) != (cond["status"], cond["reason"])
            if not flipped:
                continue
            if cond["type"] == DEGRADED and cond["status"] == "True":
                self._recorder(body, type="Warning", reason=cond["reason"], message=cond["message"])
                log.warning(
                    "%s/%s degraded: %s",
                    body["metadata"]["namespace"],
                    body["metadata"]["name"],
                    cond["message"],
                )
            elif cond["type"] == READY and cond["status"] == "True":
                self._recorder(body, type="Normal", reason=AVAILABLE, message=cond["message"])

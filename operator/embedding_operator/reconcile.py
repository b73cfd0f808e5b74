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
* what may fix itself (a Secret the pods cannot find yet, as their kubelet reports it; a model
  the server could not load, as its termination message says) is reported the same way and
  retried with a growing delay by the work queue (``Outcome.retry``).

The operator never reads Secrets: a referenced Secret is the pods' business. While the
Deployment is not fully ready, the reconcile looks at its pods and reports a container the
kubelet cannot create (``CreateContainerConfigError``: a Secret or key missing) as
``SecretNotFound``, naming the spec field; a ready Deployment costs no look at pods. The pods
come from the operator's pod watch (``versions.WatchedPods``) when it runs one, else from a
label-selected LIST.

While a problem found before applying stands (invalid spec, unknown GPU type, an image or
priority class outside the allowlist, a child's name held by an object we do not control), no
child is created, changed or deleted: an edit that breaks a running service (say, a gpu.type
this cluster has no profile for) leaves its Deployment on the last spec that worked, still
serving, with ``Ready`` False because the current spec is not what runs. The edit that fixes
the problem clears ``Degraded`` and converges as usual.

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
from embedding_operator.bluegreen import (
    Decision,
    decide,
    hold_floor,
    next_deployment,
    next_name,
    next_service,
    pin_service,
    replace_at_once,
    template_key,
)
from embedding_operator.bluegreen import Facts as BlueGreenFacts
from embedding_operator.builders import DesiredChildren
from embedding_operator.builders.common import (
    API_VERSION,
    DEFAULT_AUTOSCALING,
    DEFAULT_GATEWAY_NAMESPACE,
    KIND,
    AutoscalingDefaults,
    Owner,
    RenderInput,
    selector_string,
)
from embedding_operator.builders.golden import contract_key
from embedding_operator.golden import Fetch, GoldenKeeper, GoldenOutcome, http_fetch, record_of
from embedding_operator.kube import Cluster, ObjectRef, controller_of
from embedding_operator.metrics import OperatorMetrics, service_state
from embedding_operator.names import NameClaims, Refusal, claimed_names
from embedding_operator.plan import Planned, Refused, plan
from embedding_operator.policy import DEFAULT_POLICY, WorkloadPolicy
from embedding_operator.profiles import GpuProfiles
from embedding_operator.spec import EmbeddingServiceSpec
from embedding_operator.status import (
    AUTOSCALER_KINDS,
    AUTOSCALER_NOT_READY,
    AUTOSCALER_READY,
    AVAILABLE,
    CHILD_CONFLICT,
    CHILD_REJECTED,
    DEGRADED,
    MODEL_CHANGE_PREPARED,
    MODEL_CHANGE_PREPARING,
    MODEL_CHANGE_SWITCHING,
    NAMES_OWNED,
    PROGRESSING,
    READY,
    SCALED_TO_ZERO,
    Condition,
    DeploymentFacts,
    Problem,
    compute_status,
    container_config_problem,
    merge_conditions,
    model_load_problem,
    names_condition,
    status_patch,
)
from embedding_operator.versions import Versions, WatchedPods, WatchedVersions

log = logging.getLogger(__name__)


class EventRecorder(Protocol):
    def __call__(self, body: dict[str, Any], *, type: str, reason: str, message: str) -> None: ...


@dataclass(frozen=True)
class Outcome:
    """What a reconcile found; ``problem.retryable`` asks the caller to retry later.

    ``skipped``: the object was settled and the watches report no change since it was last
    verified, so nothing was read or written (``versions.py``). ``requeue_after``: come back
    in that many seconds though nothing failed (an EmbeddingJob's ``ttlSecondsAfterFinished``).
    """

    problem: Problem | None
    status_written: bool
    applied: tuple[str, ...] = ()
    skipped: bool = False
    requeue_after: float | None = None

    @property
    def retry(self) -> bool:
        return self.problem is not None and self.problem.retryable


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_ref(namespace: str, name: str) -> ObjectRef:
    return ObjectRef(API_VERSION, KIND, namespace, name)


ROLLOUT_POLL_SECONDS = 5.0


@dataclass
class Rollout:
    """One reconcile's blue/green decision and what it read (``bluegreen.py``)."""

    decision: Decision
    facts: BlueGreenFacts
    children: DesiredChildren
    known: dict[ObjectRef, dict[str, Any] | None]
    main: dict[str, Any] | None
    next_live: dict[str, Any] | None
    next_manifest: dict[str, Any] | None
    next_ref: ObjectRef
    service_ref: ObjectRef
    next_service_live: dict[str, Any] | None
    next_service_manifest: dict[str, Any] | None
    next_service_ref: ObjectRef
    fingerprints: dict[str, str]
    """Contract key -> fingerprint, of the records the golden ConfigMap held."""

    def status(self, contract: dict[str, Any]) -> dict[str, Any]:
        decision = self.decision
        known = dict(self.fingerprints)
        if contract.get("key") and contract.get("fingerprint"):
            known[str(contract["key"])] = str(contract["fingerprint"])  # recorded just now
        out: dict[str, Any] = {"strategy": self.facts.strategy, "phase": decision.phase}
        if decision.active_key:
            out["activeKey"] = decision.active_key
            if decision.active_key in known:
                out["activeFingerprint"] = known[decision.active_key]
        if decision.pending_key:
            out["pendingKey"] = decision.pending_key
            if decision.pending_key in known:
                out["pendingFingerprint"] = known[decision.pending_key]
            upcoming = (
                DeploymentFacts.from_live(self.next_live) if self.next_live is not None else None
            )
            out["pendingReady"] = (
                f"{upcoming.ready if upcoming else 0}/{max(1, self.facts.main_replicas)}"
            )
        if decision.message:
            out["message"] = decision.message
        return out

    def conditions(self, conditions: list[Condition]) -> list[Condition]:
        """Progressing says a model change is under way; the rest is the Deployment's."""
        if self.decision.phase == "Stable":
            return conditions
        reason = {
            "Preparing": MODEL_CHANGE_PREPARING,
            "Prepared": MODEL_CHANGE_PREPARED,
        }.get(self.decision.phase, MODEL_CHANGE_SWITCHING)
        said = self.decision.message
        if self.decision.phase == "Preparing":
            upcoming = (
                DeploymentFacts.from_live(self.next_live) if self.next_live is not None else None
            )
            ready = upcoming.ready if upcoming else 0
            said += f"; {self.next_ref.name}: {ready}/{max(1, self.facts.main_replicas)} ready"
        return [
            Condition(PROGRESSING, "True", reason, said) if c.type == PROGRESSING else c
            for c in conditions
        ]


class _Once:
    """A reconcile's pods, read at most once however many steps look at them."""

    def __init__(self, read: Callable[[], list[dict[str, Any]]]) -> None:
        self._read = read
        self._pods: list[dict[str, Any]] | None = None

    def __call__(self) -> list[dict[str, Any]]:
        if self._pods is None:
            self._pods = self._read()
        return self._pods


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
        policy: WorkloadPolicy = DEFAULT_POLICY,
        versions: WatchedVersions | None = None,
        full_resync_seconds: float = 3600.0,
        clock: Callable[[], str] = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
        autoscaling: AutoscalingDefaults = DEFAULT_AUTOSCALING,
        metrics: OperatorMetrics | None = None,
        pods: WatchedPods | None = None,
        names: NameClaims | None = None,
        golden_fetch: Fetch = http_fetch,
        operator_namespace: str = DEFAULT_GATEWAY_NAMESPACE,
    ) -> None:
        self._operator_namespace = operator_namespace
        self._cluster = cluster
        self._golden = GoldenKeeper(cluster, golden_fetch, clock)
        self._pods = pods
        # Who claims which model name (None: not watched, no NamesOwned condition), and per
        # object the refusals its status last said, so a settled object is not skipped once
        # another object's claim changed them.
        self._names = names
        self._refusals_said: dict[tuple[str, str], tuple[Refusal, ...]] = {}
        self._profiles = profiles
        self._default_image = default_image
        self._policy = policy
        self._autoscaling = autoscaling
        self._metrics = metrics
        self._recorder = recorder
        self._clock = clock
        # (namespace, name) -> (uid, generation) whose unwanted children are known to be gone;
        # the uid keeps a re-created object of the same name from inheriting the check.
        self._absent_checked: dict[tuple[str, str], tuple[str, int]] = {}
        # What the watches report (None: always read everything), and per object the versions
        # a reconcile last verified it settled at, with when (``versions.py``).
        self._versions = versions
        self._full_resync_seconds = full_resync_seconds
        self._monotonic = monotonic
        self._settled: dict[tuple[str, str], tuple[Versions, float]] = {}

    def forget(self, namespace: str, name: str) -> None:
        """Drop per-object state of a deleted EmbeddingService."""
        self._absent_checked.pop((namespace, name), None)
        self._settled.pop((namespace, name), None)
        self._golden.forget(namespace, name)
        self._refusals_said.pop((namespace, name), None)

    def _unchanged_since_settled(self, namespace: str, name: str) -> bool:
        settled = self._settled.get((namespace, name))
        if settled is None or self._versions is None:
            return False
        versions, verified_at = settled
        if self._names is not None and self._names.refused(
            namespace, name
        ) != self._refusals_said.get((namespace, name)):
            return False
        fresh = self._monotonic() - verified_at < self._full_resync_seconds
        return fresh and self._versions.current(namespace, name) == versions

    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        """Reconcile the current state of one object; None if it is gone or going."""
        if self._unchanged_since_settled(namespace, name):
            return Outcome(problem=None, status_written=False, skipped=True)
        started = time.monotonic()
        self._settled.pop((namespace, name), None)
        body = self._cluster.get(owner_ref(namespace, name))
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return None
        outcome, settled = self._reconcile(body)
        if settled is not None:
            self._settled[(namespace, name)] = (settled, self._monotonic())
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

    def _reconcile(self, body: dict[str, Any]) -> tuple[Outcome, Versions | None]:
        """The outcome, and the versions it verified if the object is settled."""
        owner = Owner.from_body(body)
        planned = plan(
            owner,
            body.get("spec") or {},
            self._profiles,
            self._default_image,
            self._policy,
            self._autoscaling,
            (body.get("metadata") or {}).get("annotations"),
            self._operator_namespace,
        )
        problem: Problem | None = None
        if isinstance(planned, Refused):
            problem = planned.problem

        deployment: dict[str, Any] | None = None
        applied: tuple[str, ...] = ()
        children_live: dict[str, dict[str, Any]] = {}
        rollout: Rollout | None = None
        golden_live: dict[str, Any] | None = None
        if isinstance(planned, Planned) and problem is None:
            try:
                key, seen = (owner.namespace, owner.name), (owner.uid, owner.generation)
                # Nothing to look for on an object no reconcile has finished yet, at its first
                # generation: any child of it was rendered from this very spec (a reconcile
                # cut short before its status write), so none can be one it no longer wants
                # (unless the operator was reconfigured in between, say another default
                # autoscaler: that leftover goes at the object's next edit). Five GETs fewer
                # on each new EmbeddingService.
                fresh = owner.generation == 1 and not body.get("status")
                checked = fresh or self._absent_checked.get(key) == seen
                if planned.render.spec.contract.policy != "disabled":
                    golden_live = self._golden.read(owner)
                rollout = self._rollout(body, owner, planned, golden_live, look=not checked)
                result = sync_children(
                    self._cluster,
                    owner,
                    rollout.children,
                    check_absent=not checked,
                    known=rollout.known,
                )
                self._absent_checked[key] = seen
                applied_next = self._sync_next(owner, rollout)
                if self._metrics is not None:
                    for kind in result.applied + applied_next:
                        self._metrics.wrote(kind, "apply")
                    for kind in result.deleted:
                        self._metrics.wrote(kind, "delete")
                children_live = result.live
                deployment = result.live.get("Deployment") or rollout.main
                applied = tuple(result.applied + applied_next + [f"-{k}" for k in result.deleted])
            except ChildConflictError as exc:
                problem = Problem(CHILD_CONFLICT, str(exc))
            except ChildRejectedError as exc:
                problem = Problem(CHILD_REJECTED, str(exc))
        if deployment is None:
            ref = ObjectRef("apps/v1", "Deployment", owner.namespace, owner.name)
            live = self._cluster.get(ref)
            if live is not None and (controller_of(live) or {}).get("uid") == owner.uid:
                deployment = live
        golden: GoldenOutcome | None = None
        if problem is None and deployment is not None and isinstance(planned, Planned):
            pods = _Once(lambda: self._server_pods(owner))
            problem = self._pods_problem(planned.render.spec, deployment, pods)
            if problem is None:
                upcoming = rollout.next_live if rollout is not None else None
                golden = self._golden.step(
                    owner,
                    planned.render.spec,
                    pods,
                    settled=DeploymentFacts.from_live(deployment).settled
                    and (upcoming is None or DeploymentFacts.from_live(upcoming).settled),
                    live=golden_live
                    if rollout is not None or planned.render.spec.contract.policy == "disabled"
                    else self._golden.read(owner),
                    keep=(rollout.decision.active_key,)
                    if rollout is not None and rollout.decision.active_key
                    else (),
                )
                problem = golden.problem

        render = planned.render if isinstance(planned, Planned) else None
        autoscaler = None
        if render is not None and render.autoscaler is not None:
            autoscaler = children_live.get(AUTOSCALER_KINDS[render.autoscaler])
        owner_version = self._write_status(
            body, owner, render, deployment, problem, autoscaler, golden, rollout
        )
        moving = rollout is not None and rollout.decision.phase != "Stable"
        requeue = golden.retry_after if golden is not None else None
        if moving and rollout is not None and rollout.decision.phase != "Prepared":
            # The switch waits on readiness and the record, neither of which makes an event
            # that comes back here in time: look again soon while a model change is under way.
            requeue = min(requeue or ROLLOUT_POLL_SECONDS, ROLLOUT_POLL_SECONDS)
        outcome = Outcome(
            problem=problem,
            status_written=owner_version is not None,
            applied=applied,
            requeue_after=requeue,
        )
        if not (
            isinstance(planned, Planned)
            and problem is None
            and not moving
            and (golden is None or golden.retry_after is None)
            and deployment is not None
            and DeploymentFacts.from_live(deployment).settled
            and set(children_live) == {m["kind"] for m in planned.children.present}
        ):
            return outcome, None
        children = frozenset(
            (kind, obj["metadata"]["name"], str(obj["metadata"].get("resourceVersion")))
            for kind, obj in children_live.items()
        )
        version = owner_version or str(body["metadata"].get("resourceVersion"))
        return outcome, Versions(version, children)

    def _rollout(
        self,
        body: dict[str, Any],
        owner: Owner,
        planned: Planned,
        golden_live: dict[str, Any] | None,
        *,
        look: bool,
    ) -> Rollout:
        """Read what the blue/green decision needs and make it (``bluegreen.py``). The
        Deployment and Service read here are handed to ``sync_children``, which reads them no
        more; ``<name>-next`` is read only while a change is under way (or on a first look
        after a restart, ``look``), so a settled service costs no extra GET."""
        spec = planned.render.spec
        spec_key = contract_key(spec)
        main_ref = ObjectRef("apps/v1", "Deployment", owner.namespace, owner.name)
        service_ref = ObjectRef("v1", "Service", owner.namespace, owner.name)
        next_ref = ObjectRef("apps/v1", "Deployment", owner.namespace, next_name(owner))
        next_service_ref = ObjectRef("v1", "Service", owner.namespace, next_name(owner))
        main = self._cluster.get(main_ref)
        service = self._cluster.get(service_ref)
        mine = main is not None and (controller_of(main) or {}).get("uid") == owner.uid
        was = ((body.get("status") or {}).get("rollout") or {}).get("phase")
        upcoming = upcoming_service = None
        if look or was not in (None, "Stable") or (mine and template_key(main) != spec_key):
            upcoming = self._owned(next_ref, owner)
            upcoming_service = self._owned(next_service_ref, owner)
        old_contract = (body.get("status") or {}).get("contract") or {}
        record = record_of(golden_live, owner, spec_key)
        unsupported = old_contract.get("key") == spec_key and old_contract.get("state") in (
            "Unsupported",
            "Conflict",
        )
        facts = BlueGreenFacts.read(
            strategy=spec.rollout.strategy,
            spec_key=spec_key,
            main=main if mine else None,
            service=service,
            upcoming=upcoming,
            recorded=record is not None or unsupported or spec.contract.policy == "disabled",
            pending_fingerprint=str(record["fingerprint"]) if record else None,
            cut_over=spec.rollout.active_fingerprint,
        )
        decision = decide(facts)
        present = []
        for manifest in planned.children.present:
            if manifest["kind"] == "Deployment" and not decision.apply_main:
                continue
            if manifest["kind"] == "Deployment" and decision.phase == "Switching":
                manifest = replace_at_once(manifest)
            if manifest["kind"] == "Service":
                manifest = pin_service(manifest, decision.pin)
            if manifest["kind"] == "HorizontalPodAutoscaler" and decision.phase in (
                "Preparing",
                "Prepared",
            ):
                manifest = hold_floor(manifest, facts.main_replicas)
            present.append(manifest)
        children = DesiredChildren(present=present, absent=planned.children.absent)
        main_manifest = next(m for m in planned.children.present if m["kind"] == "Deployment")
        next_manifest = (
            next_deployment(main_manifest, owner, facts.main_replicas)
            if decision.want_next
            else None
        )
        service_manifest = next(m for m in planned.children.present if m["kind"] == "Service")
        next_service_manifest = (
            next_service(service_manifest, owner, spec_key) if decision.want_next else None
        )
        return Rollout(
            decision=decision,
            facts=facts,
            children=children,
            known={main_ref: main, service_ref: service},
            main=main if mine else None,
            next_live=upcoming,
            next_manifest=next_manifest,
            next_ref=next_ref,
            service_ref=service_ref,
            next_service_live=upcoming_service,
            next_service_manifest=next_service_manifest,
            next_service_ref=next_service_ref,
            fingerprints={
                key: str(found["fingerprint"])
                for key in {spec_key, facts.main_key or spec_key}
                if (found := record_of(golden_live, owner, key)) and found.get("fingerprint")
            },
        )

    def _sync_next(self, owner: Owner, rollout: Rollout) -> list[str]:
        """Apply or delete ``<name>-next`` as decided, and unpin the Service when decided; the
        kinds written."""
        written = []
        service = rollout.known.get(rollout.service_ref)
        if rollout.decision.pin is None and rollout.facts.pinned is not None and service:
            # The unpinned selector is a subset of the pinned one, which sync_children takes
            # for no change: the apply that drops the key is sent here.
            manifest = next(m for m in rollout.children.present if m["kind"] == "Service")
            manifest = {
                **manifest,
                "metadata": {**manifest["metadata"], "uid": service["metadata"].get("uid")},
            }
            self._cluster.apply(manifest, force=True)
            written.append("Service")
        if rollout.next_manifest is not None and rollout.next_service_manifest is not None:
            result = sync_children(
                self._cluster,
                owner,
                DesiredChildren(
                    present=[rollout.next_manifest, rollout.next_service_manifest], absent=[]
                ),
                check_absent=False,
                known={
                    rollout.next_ref: rollout.next_live,
                    rollout.next_service_ref: rollout.next_service_live,
                },
            )
            rollout.next_live = result.live.get("Deployment")
            return written + result.applied
        if rollout.decision.delete_next or rollout.next_service_live is not None:
            for ref, live in (
                (rollout.next_ref, rollout.next_live),
                (rollout.next_service_ref, rollout.next_service_live),
            ):
                if live is None:
                    continue
                self._cluster.delete(ref, uid=(live.get("metadata") or {}).get("uid"))
                log.info(
                    "%s/%s: deleted %s %s: the model it prepared serves from the Deployment, "
                    "or was given up",
                    owner.namespace,
                    owner.name,
                    ref.kind,
                    ref.name,
                )
            rollout.next_live = None
        return written

    def _owned(self, ref: ObjectRef, owner: Owner) -> dict[str, Any] | None:
        """The object, if this EmbeddingService controls it (else never touched: None)."""
        live = self._cluster.get(ref)
        if live is not None and (controller_of(live) or {}).get("uid") != owner.uid:
            return None
        return live

    def _pods_problem(
        self,
        spec: EmbeddingServiceSpec,
        deployment: dict[str, Any],
        pods: Callable[[], list[dict[str, Any]]],
    ) -> Problem | None:
        """A pod the kubelet cannot start (a missing Secret), read only while pods are unready."""
        if DeploymentFacts.from_live(deployment).settled:
            return None
        return container_config_problem(pods(), spec) or model_load_problem(pods())

    def _server_pods(self, owner: Owner) -> list[dict[str, Any]]:
        """The service's pods, from the pod watch when it runs one, else a labelled LIST."""
        if self._pods is not None:
            return self._pods.pods(owner.namespace, owner.name)
        return self._cluster.list_pods(owner.namespace, selector_string(owner))

    def _write_status(
        self,
        body: dict[str, Any],
        owner: Owner,
        render: RenderInput | None,
        deployment: dict[str, Any] | None,
        problem: Problem | None,
        autoscaler: dict[str, Any] | None = None,
        golden: GoldenOutcome | None = None,
        rollout: Rollout | None = None,
    ) -> str | None:
        """Write status if it changed; the object's new resourceVersion, None if unchanged."""
        old: dict[str, Any] = dict(body.get("status") or {})
        names = None
        if self._names is not None:
            refusals = self._names.refused(owner.namespace, owner.name)
            self._refusals_said[(owner.namespace, owner.name)] = refusals
            names = names_condition(len(claimed_names(body)), refusals)
        status, conditions = compute_status(
            generation=owner.generation,
            render=render,
            deployment=deployment,
            problem=problem,
            autoscaler=autoscaler,
            names=names,
        )
        if golden is not None:
            status["contract"] = golden.status
        elif "contract" in old:
            status["contract"] = old["contract"]  # not looked at this time: still what it was
        if rollout is not None:
            status["rollout"] = rollout.status(status.get("contract") or {})
            conditions = rollout.conditions(conditions)
        elif "rollout" in old:
            status["rollout"] = old["rollout"]
        status["conditions"] = merge_conditions(
            old.get("conditions"), conditions, generation=owner.generation, now=self._clock()
        )
        if self._metrics is not None:
            spec = render.spec if render is not None else None
            self._metrics.service(owner.namespace, owner.name, service_state(status, spec))
        patch = status_patch(old, status)
        if patch is None:
            return None
        written = self._cluster.patch_status(owner_ref(owner.namespace, owner.name), patch)
        self._announce(body, old.get("conditions") or [], status["conditions"])
        return str((written.get("metadata") or {}).get("resourceVersion"))

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
            elif cond["type"] == NAMES_OWNED and cond["status"] == "False":
                self._recorder(body, type="Warning", reason=cond["reason"], message=cond["message"])
                log.warning(
                    "%s/%s: %s",
                    body["metadata"]["namespace"],
                    body["metadata"]["name"],
                    cond["message"],
                )
            elif cond["type"] == READY and cond["status"] == "True":
                # Available, or ScaledToZero: at zero by design (status.py), said as such.
                reason = SCALED_TO_ZERO if cond["reason"] == SCALED_TO_ZERO else AVAILABLE
                self._recorder(body, type="Normal", reason=reason, message=cond["message"])
            elif cond["type"] == AUTOSCALER_READY and cond["status"] == "True":
                self._recorder(
                    body, type="Normal", reason=AUTOSCALER_READY, message=cond["message"]
                )
            elif cond["type"] == AUTOSCALER_READY and cond["status"] == "False":
                self._recorder(
                    body,
                    type="Warning",
                    reason=AUTOSCALER_NOT_READY,
                    message=cond["message"],
                )

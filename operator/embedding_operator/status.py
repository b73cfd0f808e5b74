"""Status of an EmbeddingService: conditions in the shape of metav1.Condition, and counts.

Three conditions, following Kubernetes API conventions (and the ClusterOperator trio), a
fourth while autoscaling is enabled, and a fifth while it may scale the service to zero:

* ``Ready``: the current spec is being served (the Deployment rolled out the current pod
  template and reports itself Available with at least one ready pod).
* ``Progressing``: the operator or the Deployment is moving toward the spec (rolling out,
  scaling). False once converged.
* ``Degraded``: the desired state cannot be reached without someone acting: a spec only the
  operator can judge (UnknownGPUType), an image, priority class, env name, placement,
  extended resource or Service outside the operator's policy, a child's name held by an
  object we do not control (ChildConflict), a Secret the pods cannot find (as their kubelet
  reports it), a child the API server refuses, a rollout past its progress deadline.
* ``AutoscalerReady``: whether the HPA or ScaledObject says it can scale.
* ``ScaledToZero`` (autoscaling with ``minReplicas: 0``): True, reason ``NoDemand``, once the
  autoscaler has taken the Deployment to 0 replicas and none is left; False while replicas
  serve or are still stopping. A service at zero by design is not failing, so then ``Ready``
  stays True (reason ``ScaledToZero``): as a Knative revision's, it says that the spec is
  served as meant, and requests through the gateway are held while KEDA starts a replica.
  ``Ready`` False at zero is kept for ``replicas: 0`` set by hand, where nothing wakes it.
  ``status.autoscaling.lastActiveTime`` is when KEDA last saw demand (its ScaledObject's
  own ``lastActiveTime``, to the minute): the last request, to within a minute. The gateway's
  ``embedding_gateway_last_request_timestamp_seconds`` metric has it to the second.

* ``NamesOwned`` (the operator watches who claims which model name, ``names.py``): True when
  the service owns every name it claims; False, reason ``NameTaken`` (an older
  EmbeddingService owns one) or ``NameReserved`` (``--reserved-model-names`` keeps it for
  other namespaces), naming each such name and its owner. The gateway routes the others.

Everything here is pure: the reconciler gathers the facts, ``compute_status`` turns them into
the status document, ``merge_conditions`` keeps ``lastTransitionTime`` unless a condition's
status flipped, so that writing status only when it differs never loops.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from embedding_operator.builders.common import RenderInput, endpoint, selector_string
from embedding_operator.builders.hpa import METRICS, target, target_string
from embedding_operator.names import Refusal
from embedding_operator.spec import EmbeddingServiceSpec

AUTOSCALER_KINDS = {"hpa": "HorizontalPodAutoscaler", "keda": "ScaledObject"}

ConditionStatus = Literal["True", "False", "Unknown"]

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"

# Reasons (CamelCase, stable: users and alerts match on them).
AVAILABLE = "Available"
AS_EXPECTED = "AsExpected"
ROLLOUT_COMPLETE = "RolloutComplete"
ROLLOUT_IN_PROGRESS = "RolloutInProgress"
MODEL_CHANGE_PREPARING = "NewModelStarting"
MODEL_CHANGE_PREPARED = "NewModelAwaitingCutOver"
MODEL_CHANGE_SWITCHING = "NewModelRollingOut"
SCALING = "Scaling"
MINIMUM_REPLICAS_UNAVAILABLE = "MinimumReplicasUnavailable"
SCALED_TO_ZERO = "ScaledToZero"
"""A Ready/Progressing reason at zero replicas, and the condition type of a service that
the autoscaler may take to zero."""
NO_DEMAND = "NoDemand"
SERVING = "Serving"
SCALING_TO_ZERO = "ScalingToZero"
DEPLOYMENT_PENDING = "DeploymentPending"
PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
INVALID_SPEC = "InvalidSpec"
UNKNOWN_GPU_TYPE = "UnknownGPUType"
SECRET_NOT_FOUND = "SecretNotFound"
CHILD_CONFLICT = "ChildConflict"
CHILD_REJECTED = "ChildRejected"
CONTAINER_CONFIG_ERROR = "ContainerConfigError"
IMAGE_NOT_ALLOWED = "ImageNotAllowed"
PRIORITY_CLASS_NOT_ALLOWED = "PriorityClassNotAllowed"
ENV_NOT_ALLOWED = "EnvNotAllowed"
PLACEMENT_NOT_ALLOWED = "PlacementNotAllowed"
RESOURCE_NOT_ALLOWED = "ResourceNotAllowed"
SERVICE_NOT_ALLOWED = "ServiceNotAllowed"
AUTOSCALER_NOT_CONFIGURED = "AutoscalerNotConfigured"
MODEL_LOAD_FAILED = "ModelLoadFailed"

SERVER_MODEL_LOAD_FAILED = "embedding-server: the model could not be loaded"
"""How the server's termination message begins when it exits because its model would not
load (embedding_server.termination; the contract test keeps the two equal). The kubelet puts
it in the pod's ``lastState.terminated.message``."""

NAMES_OWNED = "NamesOwned"
"""The condition type, and its True reason: every name the service claims is its own."""
NAME_TAKEN = "NameTaken"
NAME_RESERVED = "NameReserved"

AUTOSCALER_READY = "AutoscalerReady"
AUTOSCALER_PENDING = "AutoscalerPending"
AUTOSCALER_NOT_READY = "AutoscalerNotReady"
"""The Warning event's reason when the autoscaler reports that it cannot scale (the
condition carries the autoscaler's own reason)."""

# The kubelet's wording when a pod's env names a missing Secret or key (pkg/kubelet:
# makeEnvironmentVariables), stable since Kubernetes 1.0.
_SECRET_MISSING = re.compile(r'secrets? "(?P<name>[^"]+)" not found', re.IGNORECASE)
_KEY_MISSING = re.compile(
    r"couldn't find key (?P<key>\S+) in Secret (?P<namespace>[^/\s]+)/(?P<name>\S+)"
)


@dataclass(frozen=True)
class Condition:
    type: str
    status: ConditionStatus
    reason: str
    message: str


@dataclass(frozen=True)
class Problem:
    """Why the desired state cannot be reached; ``retryable`` if it may fix itself."""

    reason: str
    message: str
    retryable: bool = False


@dataclass(frozen=True)
class DeploymentFacts:
    """What the Deployment reports, reduced to what the conditions need."""

    desired: int
    replicas: int
    ready: int
    updated: int
    available: int
    up_to_date_generation: bool
    available_condition: bool
    deadline_exceeded: bool

    @classmethod
    def from_live(cls, live: dict[str, Any]) -> DeploymentFacts:
        spec = live.get("spec") or {}
        status = live.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        progressing = conditions.get("Progressing") or {}
        return cls(
            desired=int(spec.get("replicas", 1)),
            replicas=int(status.get("replicas") or 0),
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            available=int(status.get("availableReplicas") or 0),
            up_to_date_generation=int(status.get("observedGeneration") or 0)
            >= int(live.get("metadata", {}).get("generation") or 0),
            available_condition=(conditions.get("Available") or {}).get("status") == "True",
            deadline_exceeded=progressing.get("reason") == PROGRESS_DEADLINE_EXCEEDED,
        )

    @property
    def settled(self) -> bool:
        """Nothing is moving: scaled to zero, or rolled out with every replica ready."""
        if self.desired == 0:
            return self.replicas == 0
        return self.rolled_out and self.ready >= self.desired and self.available_condition

    @property
    def rolled_out(self) -> bool:
        """The current template runs everywhere and no old pod is left."""
        return (
            self.up_to_date_generation
            and self.updated >= self.desired
            and self.replicas <= self.updated
        )


@dataclass(frozen=True)
class AutoscalerFacts:
    """What the HPA or ScaledObject reports about itself: whether it can scale, and why not.

    ``ready`` is None until its controller wrote conditions. An HPA can scale when
    ``AbleToScale`` and ``ScalingActive`` are True; a ScaledObject when ``Ready`` is."""

    ready: bool | None
    reason: str
    message: str

    @classmethod
    def from_live(cls, live: dict[str, Any]) -> AutoscalerFacts:
        conditions = {c.get("type"): c for c in (live.get("status") or {}).get("conditions") or []}
        wanted = (
            ("Ready",) if live.get("kind") == "ScaledObject" else ("AbleToScale", "ScalingActive")
        )
        found = [conditions.get(name) for name in wanted]
        if any(c is None or c.get("status") not in ("True", "False") for c in found):
            return cls(ready=None, reason="", message="")
        failing = [c for c in found if c is not None and c.get("status") != "True"]
        shown = failing[0] if failing else found[-1]
        assert shown is not None
        return cls(
            ready=not failing,
            reason=str(shown.get("reason") or ""),
            message=str(shown.get("message") or ""),
        )


def autoscaling_status(render: RenderInput) -> dict[str, Any] | None:
    """``status.autoscaling``: which autoscaler, which object, on what metric and target."""
    autoscaler = render.autoscaler
    if autoscaler is None:
        return None
    metric = render.spec.autoscaling.metric
    return {
        "autoscaler": autoscaler,
        "kind": AUTOSCALER_KINDS[autoscaler],
        "name": render.owner.name,
        "metric": METRICS[metric],
        "target": target_string(target(render)),
    }


def last_active_time(live: dict[str, Any] | None) -> str | None:
    """When KEDA last saw a trigger active (a ScaledObject's ``status.lastActiveTime``): the
    last demand, polled every ``pollingInterval``. An HPA reports nothing like it.

    To the minute: KEDA moves it at every poll while there is work, and a status write per
    poll and busy service is not worth the seconds (the gateway's metric has them)."""
    if live is None or live.get("kind") != "ScaledObject":
        return None
    value = str((live.get("status") or {}).get("lastActiveTime") or "")
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d):\d\d(\.\d+)?Z", value)
    return f"{match.group(1)}:00Z" if match else None


def autoscaler_condition(
    render: RenderInput, live: dict[str, Any] | None, ready_replicas: int
) -> Condition | None:
    """The ``AutoscalerReady`` condition from the autoscaler object's own report (None while
    autoscaling is off)."""
    autoscaler = render.autoscaler
    if autoscaler is None:
        return None
    kind, name = AUTOSCALER_KINDS[autoscaler], render.owner.name
    what = f"{kind} {name}"
    if live is None:
        return Condition(
            AUTOSCALER_READY, "Unknown", AUTOSCALER_PENDING, f"{what} is not created yet"
        )
    facts = AutoscalerFacts.from_live(live)
    controller = "the HPA controller" if autoscaler == "hpa" else "KEDA"
    if facts.ready is None:
        return Condition(
            AUTOSCALER_READY,
            "Unknown",
            AUTOSCALER_PENDING,
            f"{what} is waiting for {controller} to report on it",
        )
    metric = METRICS[render.spec.autoscaling.metric]
    if facts.ready:
        return Condition(
            AUTOSCALER_READY,
            "True",
            facts.reason or "Ready",
            f"{what} ({autoscaler}) scales on {metric}, target "
            f"{target_string(target(render))} per pod",
        )
    said = f"{facts.reason}: {facts.message}" if facts.message else facts.reason
    if ready_replicas == 0:
        return Condition(
            AUTOSCALER_READY,
            "Unknown",
            AUTOSCALER_PENDING,
            f"{what}: no replica is ready, and only a ready replica exports {metric} "
            f"({controller} says {said})",
        )
    return Condition(
        AUTOSCALER_READY, "False", facts.reason or AUTOSCALER_NOT_READY, f"{what}: {said}"
    )


def scales_to_zero(render: RenderInput | None) -> str | None:
    """Who takes the service to zero and wakes it (``ScaledObject emb (keda)``), when its
    autoscaling may (``minReplicas: 0``); None otherwise."""
    if render is None or render.autoscaler is None or render.spec.autoscaling.min_replicas:
        return None
    return f"{AUTOSCALER_KINDS[render.autoscaler]} {render.owner.name} ({render.autoscaler})"


def scaled_to_zero_condition(render: RenderInput, facts: DeploymentFacts) -> Condition | None:
    """``ScaledToZero`` from the Deployment's replicas (None unless the service may be
    scaled to zero)."""
    autoscaler = scales_to_zero(render)
    if autoscaler is None:
        return None
    idle = render.spec.autoscaling.scale_down_stabilization_seconds
    if facts.desired == 0 and facts.replicas == 0:
        return Condition(
            SCALED_TO_ZERO,
            "True",
            NO_DEMAND,
            f"{autoscaler} scaled the Deployment to 0 replicas after {idle}s without work; "
            "a request through the gateway is held while it starts one",
        )
    if facts.desired == 0:
        return Condition(
            SCALED_TO_ZERO,
            "False",
            SCALING_TO_ZERO,
            f"{autoscaler} scales the Deployment to 0; {facts.replicas} replicas still stop",
        )
    return Condition(
        SCALED_TO_ZERO,
        "False",
        SERVING,
        f"{facts.ready}/{facts.desired} replicas ready; {autoscaler} scales to 0 after "
        f"{idle}s without work",
    )


def names_condition(claimed: int, refusals: Iterable[Refusal]) -> Condition:
    """``NamesOwned`` from the names the service claims (how many) and those it does not own."""
    refused = list(refusals)
    if not refused:
        return Condition(
            NAMES_OWNED, "True", NAMES_OWNED, f"the gateway routes all {claimed} model names here"
        )
    said = []
    for refusal in refused:
        if refusal.owner is None:
            said.append(
                f"model name {refusal.name!r} is reserved for other namespaces "
                "(--reserved-model-names)"
            )
        else:
            said.append(
                f"model name {refusal.name!r} is taken by {refusal.owner[0]}/{refusal.owner[1]} "
                "(the older claim)"
            )
    reason = NAME_TAKEN if any(r.owner is not None for r in refused) else NAME_RESERVED
    return Condition(
        NAMES_OWNED,
        "False",
        reason,
        "; ".join(said) + f"; the gateway does not route {'it' if len(said) == 1 else 'them'} here",
    )


def _deployment_conditions(
    facts: DeploymentFacts | None, zero_by: str | None = None
) -> list[Condition]:
    """Ready, Progressing and Degraded from the Deployment; ``zero_by`` names the autoscaler
    when zero replicas is one of its intended states (:func:`scales_to_zero`)."""
    if facts is None:
        return [
            Condition(READY, "False", DEPLOYMENT_PENDING, "the Deployment does not exist yet"),
            Condition(PROGRESSING, "True", DEPLOYMENT_PENDING, "creating the Deployment"),
            Condition(DEGRADED, "False", AS_EXPECTED, ""),
        ]
    counts = f"{facts.ready}/{facts.desired} replicas ready"
    if facts.deadline_exceeded:
        degraded = Condition(
            DEGRADED,
            "True",
            PROGRESS_DEADLINE_EXCEEDED,
            f"the rollout made no progress within its deadline; {counts}",
        )
    else:
        degraded = Condition(DEGRADED, "False", AS_EXPECTED, "")
    if facts.desired == 0 and zero_by is not None:
        message = f"scaled to 0 replicas by {zero_by}, for lack of demand"
        if facts.replicas:
            stopping = f"{message}; {facts.replicas} replicas still stop"
            progressing = Condition(PROGRESSING, "True", SCALING, stopping)
        else:
            progressing = Condition(PROGRESSING, "False", SCALED_TO_ZERO, message)
        return [Condition(READY, "True", SCALED_TO_ZERO, message), progressing, degraded]
    if facts.desired == 0:
        return [
            Condition(READY, "False", SCALED_TO_ZERO, "replicas is 0"),
            Condition(PROGRESSING, "False", SCALED_TO_ZERO, "replicas is 0"),
            degraded,
        ]
    if not facts.rolled_out:
        message = f"{facts.updated}/{facts.desired} replicas run the current spec; {counts}"
        return [
            Condition(READY, "False", ROLLOUT_IN_PROGRESS, message),
            Condition(PROGRESSING, "True", ROLLOUT_IN_PROGRESS, message),
            degraded,
        ]
    if facts.ready >= 1 and facts.available_condition:
        ready = Condition(READY, "True", AVAILABLE, counts)
    else:
        ready = Condition(READY, "False", MINIMUM_REPLICAS_UNAVAILABLE, counts)
    if facts.ready < facts.desired:
        progressing = Condition(PROGRESSING, "True", SCALING, counts)
    else:
        progressing = Condition(PROGRESSING, "False", ROLLOUT_COMPLETE, counts)
    return [ready, progressing, degraded]


def _problem_conditions(problem: Problem) -> list[Condition]:
    return [
        Condition(READY, "False", problem.reason, problem.message),
        Condition(PROGRESSING, "False", problem.reason, problem.message),
        Condition(DEGRADED, "True", problem.reason, problem.message),
    ]


def compute_status(
    *,
    generation: int,
    render: RenderInput | None,
    deployment: dict[str, Any] | None,
    problem: Problem | None,
    autoscaler: dict[str, Any] | None = None,
    names: Condition | None = None,
) -> tuple[dict[str, Any], list[Condition]]:
    """The status document (conditions without timestamps) and the conditions themselves;
    ``autoscaler`` is the live HPA or ScaledObject, if the operator has one; ``names`` the
    ``NamesOwned`` condition, when the operator watches the names' claims."""
    facts = DeploymentFacts.from_live(deployment) if deployment is not None else None
    conditions = (
        _problem_conditions(problem)
        if problem is not None
        else _deployment_conditions(facts, scales_to_zero(render))
    )
    if problem is None and render is not None:
        scaling = autoscaler_condition(render, autoscaler, facts.ready if facts else 0)
        if scaling is not None:
            conditions.append(scaling)
        at_zero = scaled_to_zero_condition(render, facts) if facts is not None else None
        if at_zero is not None:
            conditions.append(at_zero)
    if names is not None:
        conditions.append(names)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": facts.replicas if facts else 0,
        "readyReplicas": facts.ready if facts else 0,
        "updatedReplicas": facts.updated if facts else 0,
    }
    if render is not None:
        spec = render.spec
        status["selector"] = selector_string(render.owner)
        status["endpoint"] = endpoint(render.owner, spec.service.port)
        model: dict[str, Any] = {
            "name": spec.model.server_model,
            "servedModelName": spec.served_name,
        }
        if spec.model.revision:
            model["revision"] = spec.model.revision
        status["model"] = model
        status["gpu"] = {
            "type": spec.gpu.type,
            "resourceName": render.profile.resource_name or "",
            "count": render.gpu_count,
        }
        scaling_status = autoscaling_status(render)
        if scaling_status is not None:
            if facts is not None:
                scaling_status["desiredReplicas"] = facts.desired
            last_active = last_active_time(autoscaler) if scales_to_zero(render) else None
            if last_active is not None:
                scaling_status["lastActiveTime"] = last_active
            status["autoscaling"] = scaling_status
    return status, conditions


def merge_conditions(
    old: list[dict[str, Any]] | None, new: list[Condition], *, generation: int, now: str
) -> list[dict[str, Any]]:
    """metav1.Condition dicts; ``lastTransitionTime`` moves only when ``status`` flips."""
    previous = {c.get("type"): c for c in old or []}
    merged = []
    for cond in new:
        before = previous.get(cond.type)
        since = (
            before.get("lastTransitionTime")
            if before is not None and before.get("status") == cond.status
            else None
        )
        merged.append(
            {
                "type": cond.type,
                "status": cond.status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": since or now,
                "observedGeneration": generation,
            }
        )
    return merged


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch turning ``old`` into ``new`` (None when equal: write nothing)."""
    if old == new:
        return None
    return _merge_patch(old, new)


def _merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            if value != before:
                patch[key] = _merge_patch(before, value)
        elif value != before or key not in old:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


def _secret_fields(spec: EmbeddingServiceSpec) -> dict[str, tuple[str, str]]:
    """Secret name -> the spec field that names it and the key it reads (first mention
    wins)."""
    fields: dict[str, tuple[str, str]] = {}
    for path, ref in (
        ("spec.model.hubTokenSecretRef", spec.model.hub_token_secret_ref),
        ("spec.apiKeySecretRef", spec.api_key_secret_ref),
    ):
        if ref is not None:
            fields.setdefault(ref.name, (path, ref.key))
    for i, var in enumerate(spec.server.env):
        secret_ref = (var.value_from or {}).get("secretKeyRef") or {}
        if secret_ref.get("name"):
            key = str(secret_ref.get("key", ""))
            fields.setdefault(str(secret_ref["name"]), (f"spec.server.env[{i}]", key))
    return fields


def restart_reason(terminated: dict[str, Any]) -> str:
    """Why a container last ended, from its ``lastState.terminated``: ``ModelLoadFailed``
    when the server says its model would not load, else the kubelet's reason (``Error``,
    ``OOMKilled``, ...)."""
    if str(terminated.get("message") or "").startswith(SERVER_MODEL_LOAD_FAILED):
        return MODEL_LOAD_FAILED
    return str(terminated.get("reason") or "Unknown")


def model_load_problem(pods: Iterable[dict[str, Any]]) -> Problem | None:
    """A server container that exited because its model would not load, or None.

    Retryable: the kubelet restarts it (a Hub outage, a model cache being filled may pass).
    The message names the pod and where the reason is, never the reason itself (the log may
    quote a Secret; the status is read by more people)."""
    for pod in pods:
        meta = pod.get("metadata") or {}
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("lastState") or {}).get("terminated") or {}
            if restart_reason(terminated) != MODEL_LOAD_FAILED:
                continue
            name, namespace = meta.get("name", ""), meta.get("namespace", "")
            return Problem(
                MODEL_LOAD_FAILED,
                f"pod {name} could not load its model (exit code "
                f"{terminated.get('exitCode', '?')}, {container.get('restartCount', 0)} "
                f"restarts); `kubectl logs -n {namespace} {name} --previous` says why",
                retryable=True,
            )
    return None


def container_config_problem(
    pods: Iterable[dict[str, Any]], spec: EmbeddingServiceSpec
) -> Problem | None:
    """What the kubelet says keeps the pods' containers from being created, or None.

    The operator never reads Secrets (it would need ``get`` on every Secret in the cluster,
    and its status would tell CR authors which Secrets and keys exist). A missing Secret or key
    shows up where Kubernetes itself reports it: the pod's container waits in
    ``CreateContainerConfigError`` with the kubelet's message, which names the Secret. That
    message is mapped back to the spec field naming the Secret, and reported in one wording
    whether the Secret or only its key is missing: the kubelet's text, which tells the two
    apart, never reaches status. Retryable: the kubelet retries on its own, and the pod starts
    once the Secret appears.
    """
    fields = _secret_fields(spec)
    for pod in pods:
        status = pod.get("status") or {}
        for container in [
            *(status.get("initContainerStatuses") or []),
            *(status.get("containerStatuses") or []),
        ]:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") != "CreateContainerConfigError":
                continue
            message = str(waiting.get("message") or "")
            pod_name = (pod.get("metadata") or {}).get("name", "")
            found = _SECRET_MISSING.search(message) or _KEY_MISSING.search(message)
            if found is None:
                return Problem(
                    CONTAINER_CONFIG_ERROR,
                    f"pod {pod_name} cannot start its containers: {message}",
                    retryable=True,
                )
            name = found["name"]
            field, key = fields.get(name, ("a Secret referenced by the pod", ""))
            its_key = f"its key {key!r}" if key else "the key the pod reads"
            return Problem(
                SECRET_NOT_FOUND,
                f"{field}: Secret {name!r} or {its_key} is missing (pod {pod_name} waits; it "
                "starts once the Secret holds the key)",
                retryable=True,
            )
    return None

"""Model changes that never mix two models behind one name (issue 47, item 3).

A spec change that changes the contract key (``builders/golden.py``: the model, its revision,
the task, the embedding fields, dtype, backend, quantization) is a new model. Rolled as an
ordinary update, the Service would answer with both for the minutes of the rollout, at random,
and an index written meanwhile would hold vectors of two models that no client can tell apart
when the dimensions agree. So, with ``spec.rollout.strategy: blueGreen`` (the default):

1. The Service's selector is pinned to the running model's key (the pod template's
   ``embedding-operator.dev/contract`` label), and the Deployment ``<name>`` is left as it is.
2. The new model comes up beside it in the Deployment ``<name>-next``, as many replicas as
   ``<name>`` has. Its pods are outside the Service; its first ready pod records the new
   model's golden vectors, and every other one compares before it reports ready.
3. When ``<name>-next`` has every replica ready and the record is taken, the Service's selector
   moves to the new key in one write: kube-proxy and the gateway move every new connection to
   the new model at once. Requests in flight finish on the pods they started on (those pods are
   out of the Service, not stopped).
4. ``<name>`` is then updated to the new model, all its old pods at once (``<name>-next``
   serves at full strength): a client whose keep-alive connection still reached one is moved
   off within that pod's drain. Its new pods join the Service as they turn ready (the same
   model as ``<name>-next``'s, checked against the same record), and once it has rolled out,
   ``<name>-next`` is deleted.

Changes that keep the key (replicas, resources, scaling, names, aliases, ``server.extraArgs``)
stay ordinary rolling updates of ``<name>``: they change no vector on purpose, and a pod they
move anyway is kept out by its golden check. ``strategy: rolling`` is the old behaviour (one
Deployment, models mixed during a model change), for clusters that cannot hold both at once.

Everything is decided from what the cluster shows (the live Deployments' template keys and
readiness, the live Service's selector, the golden record), so an operator restarted midway
carries on where it was. The one case that rolls as before is a Service that predates the pin
while its Deployment is still rolling: its pods cannot yet be told apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from embedding_operator.builders.common import Manifest, Owner
from embedding_operator.builders.deployment import NEXT_SERVICE_SUFFIX
from embedding_operator.builders.golden import CONTRACT_LABEL
from embedding_operator.status import DeploymentFacts

NEXT_SUFFIX = NEXT_SERVICE_SUFFIX

Phase = Literal["Stable", "Preparing", "Prepared", "Switching"]


def next_name(owner: Owner) -> str:
    return f"{owner.name}{NEXT_SUFFIX}"


def template_key(deployment: Mapping[str, Any] | None) -> str | None:
    """The contract key a Deployment's pod template carries (None: none, or no Deployment)."""
    labels = (((deployment or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}
    key = (labels.get("labels") or {}).get(CONTRACT_LABEL)
    return str(key) if key else None


def selector_key(service: Mapping[str, Any] | None) -> str | None:
    """The contract key a Service's selector is pinned to (None: not pinned)."""
    selector = ((service or {}).get("spec") or {}).get("selector") or {}
    key = selector.get(CONTRACT_LABEL)
    return str(key) if key else None


@dataclass(frozen=True)
class Facts:
    """What the decision reads: the spec's key, the live Deployment ``<name>`` (its template's
    key, whether it rolled out with every replica ready, its replica count), the live
    Service's pin, ``<name>-next`` (its key and readiness) and whether the spec key's golden
    vectors are recorded (or cannot be, for a task that embeds nothing)."""

    strategy: str
    spec_key: str
    main_exists: bool
    main_key: str | None
    main_settled: bool
    main_replicas: int
    pinned: str | None
    next_exists: bool
    next_key: str | None
    next_settled: bool
    recorded: bool
    pending_fingerprint: str | None = None
    cut_over: str | None = None
    """``spec.rollout.activeFingerprint``: with ``manual``, the fingerprint the user switched to."""

    @classmethod
    def read(
        cls,
        *,
        strategy: str,
        spec_key: str,
        main: Mapping[str, Any] | None,
        service: Mapping[str, Any] | None,
        upcoming: Mapping[str, Any] | None,
        recorded: bool,
        pending_fingerprint: str | None = None,
        cut_over: str | None = None,
    ) -> Facts:
        main_facts = DeploymentFacts.from_live(dict(main)) if main is not None else None
        next_facts = DeploymentFacts.from_live(dict(upcoming)) if upcoming is not None else None
        return cls(
            strategy=strategy,
            spec_key=spec_key,
            main_exists=main is not None,
            main_key=template_key(main),
            main_settled=main_facts is not None and main_facts.settled,
            main_replicas=main_facts.desired if main_facts is not None else 0,
            pinned=selector_key(service),
            next_exists=upcoming is not None,
            next_key=template_key(upcoming),
            next_settled=(
                next_facts is not None
                and next_facts.settled
                and next_facts.desired > 0
                and template_key(upcoming) == spec_key
            ),
            recorded=recorded,
            pending_fingerprint=pending_fingerprint,
            cut_over=cut_over,
        )


@dataclass(frozen=True)
class Decision:
    """What this reconcile does: the Service's pin (None: the unpinned selector), whether
    ``<name>`` gets the spec's template, whether ``<name>-next`` is wanted (applied) or
    goes, and the phase the status reports."""

    phase: Phase
    pin: str | None
    apply_main: bool
    want_next: bool
    delete_next: bool
    active_key: str | None
    pending_key: str | None = None
    message: str = ""


def decide(facts: Facts) -> Decision:
    key = facts.spec_key
    if facts.strategy == "rolling":  # the old behaviour: one Deployment, updated in place
        return Decision(
            "Stable", None, True, False, facts.next_exists, active_key=facts.main_key or key
        )
    if not facts.main_exists:
        # A new service: every pod it will ever have carries the key.
        return Decision("Stable", key, True, False, facts.next_exists, active_key=key)
    if facts.main_key == key:
        # Pinned already, or safe to pin now: every pod of a rolled-out Deployment carries its
        # template's label. A Service from before the pin stays unpinned until then.
        pin = key if facts.pinned is not None or facts.main_settled else None
        # After a switch, <name>-next serves until <name> has rolled out; a reverted change
        # leaves it superseded, and it goes the same way.
        delete = facts.next_exists and (facts.main_settled or facts.next_key != key)
        if facts.next_exists and not delete:
            return Decision(
                "Switching",
                pin,
                True,
                True,
                False,
                key,
                message=f"the Service serves the new model ({key}); the Deployment rolls out to "
                f"it, and the one named with {NEXT_SUFFIX} goes once it has",
            )
        return Decision("Stable", pin, True, False, delete, key)
    # The spec names another model than <name> runs.
    isolated = facts.main_key is not None and (
        facts.pinned == facts.main_key or (facts.pinned is None and facts.main_settled)
    )
    if not isolated:
        # The running pods cannot be told apart from the new ones (they predate the label, or
        # a Service from before the pin while they roll): unpinned, this change rolls in place.
        why = "the running pods predate the contract label: this change rolls in place"
        return Decision("Stable", None, True, False, facts.next_exists, key, message=why)
    if facts.main_replicas == 0:
        why = "scaled to zero: the new model starts in place"
        return Decision("Stable", key, True, False, facts.next_exists, key, message=why)
    active = facts.main_key
    ready = facts.next_settled and facts.recorded
    cut_over = (
        facts.cut_over is not None
        and facts.pending_fingerprint is not None
        and facts.pending_fingerprint.startswith(facts.cut_over)
    )
    if ready and facts.strategy == "manual" and not cut_over:
        fingerprint = facts.pending_fingerprint or key
        return Decision(
            "Prepared",
            active,
            False,
            True,
            False,
            active_key=active,
            pending_key=key,
            message=(
                f"the new model ({fingerprint}) is ready beside the running one and reachable "
                f"through the Service named with {NEXT_SUFFIX}; set spec.rollout.activeFingerprint "
                f"to {fingerprint} to switch the Service to it"
            ),
        )
    if ready:
        return Decision(
            "Switching",
            key,
            True,
            True,
            False,
            active_key=key,
            pending_key=None,
            message=f"the Service moved to the new model ({key}); {active} is being replaced",
        )
    return Decision(
        "Preparing",
        active,
        False,
        True,
        False,
        active_key=active,
        pending_key=key,
        message=(
            f"the new model ({key}) starts beside the running one ({active}); the Service "
            "stays on the running one until every new replica is ready and its golden vectors "
            "are recorded"
        ),
    )


def pin_service(manifest: Manifest, pin: str | None) -> Manifest:
    """The Service as built, its selector pinned to ``pin`` (or left unpinned)."""
    pinned = dict(manifest)
    spec = dict(pinned["spec"])
    selector = {k: v for k, v in spec["selector"].items() if k != CONTRACT_LABEL}
    if pin is not None:
        selector[CONTRACT_LABEL] = pin
    spec["selector"] = selector
    pinned["spec"] = spec
    return pinned


def replace_at_once(main: Manifest) -> Manifest:
    """``<name>`` while it moves to the new model after the switch: every old pod at once.
    They are out of the Service and ``<name>-next`` serves at full strength, so nothing is
    lost, and a client whose keep-alive connection still reaches an old pod is moved off it
    within the pod's drain rather than one pod at a time over the rollout."""
    updated = dict(main)
    spec = dict(updated["spec"])
    spec["strategy"] = {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "100%"},
    }
    updated["spec"] = spec
    return updated


def next_service(service: Manifest, owner: Owner, key: str) -> Manifest:
    """``<name>-next``: the new model's pods only, while it prepares, for a re-embedding job to
    target or a client to try; always ClusterIP and without the Service's annotations (a second
    load balancer is not what a model change asks for)."""
    pinned = pin_service(service, key)
    metadata = {k: v for k, v in pinned["metadata"].items() if k != "annotations"}
    metadata["name"] = next_name(owner)
    spec = {k: v for k, v in pinned["spec"].items() if k not in ("type",)}
    spec["type"] = "ClusterIP"
    spec["ports"] = [{k: v for k, v in port.items() if k != "nodePort"} for port in spec["ports"]]
    return {**pinned, "metadata": metadata, "spec": spec}


def hold_floor(hpa: Manifest, replicas: int) -> Manifest:
    """The HPA while a new model prepares: it averages its Pods metric over the pods of the
    Deployment's selector, which ``<name>-next``'s idle pods match too, so it would read half
    the load and scale ``<name>`` (and with it ``<name>-next``) down. Its floor is held at the
    running count until the switch; it may still scale up."""
    held = dict(hpa)
    spec = dict(held["spec"])
    spec["minReplicas"] = min(max(int(spec.get("minReplicas") or 1), replicas), spec["maxReplicas"])
    held["spec"] = spec
    return held


def next_deployment(main: Manifest, owner: Owner, replicas: int) -> Manifest:
    """``<name>-next``: the Deployment as built for the spec, under its own name, with the
    running one's replica count (no autoscaler follows it: it lives for one change)."""
    upcoming = dict(main)
    metadata = dict(upcoming["metadata"])
    metadata["name"] = next_name(owner)
    upcoming["metadata"] = metadata
    spec = {k: v for k, v in upcoming["spec"].items() if k != "replicas"}
    upcoming["spec"] = {"replicas": max(1, replicas), **spec}
    return upcoming

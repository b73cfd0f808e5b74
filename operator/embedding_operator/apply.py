"""Create-or-patch of owned children, idempotent, touching only the fields we own.

Server-side apply (``PATCH`` with ``application/apply-patch+yaml``, field manager
``embedding-operator``, ``force``) is the write: it creates missing objects, restores fields
someone edited, drops fields we stopped rendering (``replicas`` once an HPA owns it) and leaves
fields other managers own alone (the HPA's replica count, defaults the API server filled in).

Before writing, the desired manifest is compared with the live object *as a subset*: only the
fields we render count, so API-server defaults never look like drift. An unchanged child costs
one GET and no write, which is what keeps the watch on children from looping: our write makes
an event, the event makes a reconcile, the reconcile finds nothing to write.

No adoption: ``force`` would take over any object that happens to have a child's name (a CR
named ``postgres`` rewriting the team's ``postgres`` Service, which garbage collection would
then delete with the CR). So ``force`` is only ever sent to objects whose controller
ownerReference is this EmbeddingService: every desired child is read first, and if any name
is held by an object we do not control (no controller reference, or another controller),
``ChildConflictError`` names them all and *nothing* is written for this EmbeddingService, so a
conflict never leaves half a service (a Deployment without its Service).

The check and the write are two calls, and each write carries what the check found, so that
nothing can slip in between:

* a child that was ours is written with its ``metadata.uid``: if it was replaced since (deleted
  and re-created by someone else under the same name), the API server refuses the write (the
  uid is immutable) instead of changing the new object;
* a child that was absent is created by an apply without ``force``: if someone created the
  name since, every field they set to another value is a conflict (409) instead of ours.

Either way the object is read again and reported as a ``ChildConflictError`` when someone
else now holds the name. What is left: a namesake created in that instant with exactly the
values we render would be shared, not refused (server-side apply only conflicts on values).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from embedding_operator.builders import DesiredChildren
from embedding_operator.builders.common import Manifest, Owner
from embedding_operator.kube import ApiError, Cluster, ObjectRef, controller_of, ref_of

log = logging.getLogger(__name__)


class ChildConflictError(Exception):
    """Children's names are taken by objects this EmbeddingService does not control."""

    def __init__(self, conflicts: list[str]) -> None:
        self.conflicts = conflicts
        super().__init__(
            "; ".join(conflicts) + ": the operator never adopts or changes objects it did not "
            "create; delete or rename them, or rename the EmbeddingService"
        )


class ChildRejectedError(Exception):
    """The API server refused a rendered child (400/422): the spec asks for the impossible."""


def _as_quantity(value: object) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    from kubernetes.utils.quantity import parse_quantity

    try:
        return Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]
    except (ValueError, InvalidOperation, TypeError):
        return None


def is_subset(desired: object, live: object) -> bool:
    """Every field we render has the same value live (quantities compared by value)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and is_subset(value, live[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(is_subset(d, item) for d, item in zip(desired, live, strict=True))
        )
    if desired == live and type(desired) is type(live):
        return True
    # "1Gi" may come back as "1Gi", "32000" as "32k": same quantity, not drift.
    if isinstance(desired, str) and isinstance(live, str):
        want, have = _as_quantity(desired), _as_quantity(live)
        return want is not None and want == have
    return False


@dataclass
class SyncResult:
    """What reconciling the children did; ``live`` maps kind to the live object."""

    live: dict[str, dict[str, Any]] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


def _write(
    cluster: Cluster, owner: Owner, manifest: Manifest, live: dict[str, Any] | None
) -> dict[str, Any]:
    """Server-side apply of ``manifest`` over ``live`` (ours, or None: the name was free);
    for an edited object it refuses, a merge patch of our manifest. Conditional on what
    ``live`` was (see the module docstring).

    Apply merges list entries by key, so a hand edit that changed a key (a Service port
    80 -> 9999, both named ``http``) would make apply add our entry next to the edited one, an
    invalid object. A JSON merge patch replaces such lists wholesale with ours.
    """
    ref = ref_of(manifest)
    if live is None:
        try:
            return cluster.apply(manifest, force=False)
        except ApiError as exc:
            if exc.status == 409:
                _raise_if_taken(cluster, owner, manifest, exc, existed=False)
                raise
            if exc.status in (400, 422):
                _raise_if_taken(cluster, owner, manifest, exc, existed=False)
                raise ChildRejectedError(
                    f"{ref.kind} {ref.name} was refused: {exc.message}"
                ) from None
            if exc.status == 404:
                # The namespace exists (the owner is in it): the API does not. A KEDA
                # ScaledObject where KEDA is not installed; the resync retries once it is.
                raise ChildRejectedError(
                    f"{ref.kind} {ref.name} cannot be created: the API server does not serve "
                    f"{ref.api_version} {ref.kind}"
                    + (" (is KEDA installed?)" if ref.kind == "ScaledObject" else "")
                ) from None
            raise
    checked = {**manifest, "metadata": {**manifest["metadata"], "uid": live["metadata"]["uid"]}}
    try:
        return cluster.apply(checked)
    except ApiError as exc:
        if exc.status not in (400, 422):
            raise
        _raise_if_taken(cluster, owner, manifest, exc, existed=True)
        log.info(
            "apply of %s %s/%s refused (%s); replacing edited lists",
            ref.kind,
            ref.namespace,
            ref.name,
            exc.message,
        )
    try:
        return cluster.merge_patch(checked)
    except ApiError as exc:
        if exc.status in (400, 422):
            _raise_if_taken(cluster, owner, manifest, exc, existed=True)
            raise ChildRejectedError(f"{ref.kind} {ref.name} was refused: {exc.message}") from None
        raise


def _raise_if_taken(
    cluster: Cluster, owner: Owner, manifest: Manifest, exc: ApiError, *, existed: bool
) -> None:
    """After a refused write: a ``ChildConflictError`` if the name is now held by an object
    we do not control (created or swapped in since it was checked); a retryable error if the
    child that ``existed`` is gone; nothing otherwise (the refusal is about our manifest)."""
    live = cluster.get(ref_of(manifest))
    conflict = _conflict(owner, manifest, live)
    if conflict is not None:
        raise ChildConflictError([conflict]) from None
    if existed and live is None:
        raise ApiError(409, f"{ref_of(manifest).kind} deleted while written: {exc.message}")


def _conflict(owner: Owner, manifest: Manifest, live: dict[str, Any] | None) -> str | None:
    """Why ``live`` (the object holding a child's name) is not ours to write, or None."""
    if live is None:
        return None
    controller = controller_of(live)
    if controller is not None and controller.get("uid") == owner.uid:
        return None
    ref = ref_of(manifest)
    if controller is None:
        holder = "has no controller ownerReference"
    else:
        holder = f"is controlled by {controller.get('kind')} {controller.get('name')}"
    return f"{ref.kind} {ref.namespace}/{ref.name} already exists and {holder}"


def sync_children(
    cluster: Cluster,
    owner: Owner,
    desired: DesiredChildren,
    *,
    check_absent: bool = True,
    known: Mapping[ObjectRef, dict[str, Any] | None] | None = None,
) -> SyncResult:
    """Make the children match ``desired``; write only what differs.

    ``check_absent=False`` skips looking for children that must not exist, for callers that
    already confirmed them gone for this generation (three GETs saved per reconcile).
    ``known``: children the caller read this reconcile (None: absent), not read again.
    """
    result = SyncResult()
    known = known or {}
    found = [
        (manifest, known[ref] if (ref := ref_of(manifest)) in known else cluster.get(ref))
        for manifest in desired.present
    ]
    conflicts = [
        conflict for manifest, live in found if (conflict := _conflict(owner, manifest, live))
    ]
    if conflicts:
        raise ChildConflictError(conflicts)
    for manifest, live in found:
        ref = ref_of(manifest)
        if live is None or not is_subset(manifest, live):
            live = _write(cluster, owner, manifest, live)
            result.applied.append(ref.kind)
            log.info("applied %s %s/%s", ref.kind, ref.namespace, ref.name)
        result.live[ref.kind] = live
    for ref in desired.absent if check_absent else ():
        live = cluster.get(ref)
        if live is not None and (controller_of(live) or {}).get("uid") == owner.uid:
            cluster.delete(ref, uid=live["metadata"].get("uid"))
            result.deleted.append(ref.kind)
            log.info("deleted %s %s/%s (no longer wanted)", ref.kind, ref.namespace, ref.name)
    return result

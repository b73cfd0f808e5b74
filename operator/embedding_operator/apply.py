"""Create-or-patch of owned children, idempotent, touching only the fields we own.

Server-side apply (``PATCH`` with ``application/apply-patch+yaml``, field manager
``embedding-operator``, ``force``) is the write: it creates missing objects, restores fields
someone edited, drops fields we stopped rendering (``replicas`` once an HPA owns it) and leaves
fields other managers own alone (the HPA's replica count, defaults the API server filled in).

Before writing, the desired manifest is compared with the live object *as a subset*: only the
fields we render count, so API-server defaults never look like drift. An unchanged child costs
one GET and no write, which is what keeps the watch on children from looping: our write makes
an event, the event makes a reconcile, the reconcile finds nothing to write.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol

from embedding_operator.builders import ChildRef, DesiredChildren, ref_of
from embedding_operator.builders.common import Manifest, Owner

FIELD_MANAGER = "embedding-operator"

log = logging.getLogger(__name__)

_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Secret": "secrets",
    "EmbeddingService": "embeddingservices",
    "Lease": "leases",
    "Event": "events",
}


class ApiError(Exception):
    """An API call failed; ``status`` is the HTTP status (0: no response)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message


class ChildConflictError(Exception):
    """A child's name is taken by an object another controller owns."""


class ChildRejectedError(Exception):
    """The API server refused a rendered child (400/422): the spec asks for the impossible."""


class Cluster(Protocol):
    """The few API calls reconciliation needs; the real one and an in-memory fake."""

    def get(self, ref: ChildRef) -> dict[str, Any] | None: ...

    def apply(self, manifest: Manifest) -> dict[str, Any]: ...

    def merge_patch(self, manifest: Manifest) -> dict[str, Any]: ...

    def delete(self, ref: ChildRef) -> None: ...

    def patch_status(self, ref: ChildRef, status: dict[str, Any]) -> dict[str, Any]: ...


def resource_path(ref: ChildRef, subresource: str | None = None) -> str:
    """REST path of a namespaced object (``/apis/apps/v1/namespaces/x/deployments/y``)."""
    plural = _PLURALS[ref.kind]
    base = f"/api/{ref.api_version}" if "/" not in ref.api_version else f"/apis/{ref.api_version}"
    path = f"{base}/namespaces/{ref.namespace}/{plural}/{ref.name}"
    return f"{path}/{subresource}" if subresource else path


class KubeCluster:
    """``Cluster`` over the official kubernetes client (sync; runs in kopf's worker threads)."""

    def __init__(self, api_client: Any, *, timeout: float = 30.0) -> None:
        self._api = api_client
        self._timeout = (5.0, timeout)

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> dict[str, Any]:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        _, url, headers, serialized, _ = self._api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self._api.call_api(
                method, url, header_params=headers, body=serialized, _request_timeout=self._timeout
            )
            data = response.read()
        except ApiException as exc:
            raise ApiError(
                int(exc.status or 0), _error_message(exc.body) or str(exc.reason)
            ) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # Connection refused, timeouts, TLS errors: retryable like a 5xx.
            raise ApiError(0, f"{method} {path}: {exc}") from exc
        if not 200 <= response.status < 300:
            raise ApiError(int(response.status), _error_message(data) or str(response.reason))
        return dict(json.loads(data)) if data else {}

    def get(self, ref: ChildRef) -> dict[str, Any] | None:
        try:
            return self._call("GET", resource_path(ref))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, manifest: Manifest) -> dict[str, Any]:
        # A pre-serialised body: the client sends strings as they are, whatever the type.
        return self._call(
            "PATCH",
            resource_path(ref_of(manifest)),
            body=json.dumps(manifest),
            content_type="application/apply-patch+yaml",
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
        )

    def merge_patch(self, manifest: Manifest) -> dict[str, Any]:
        return self._call(
            "PATCH",
            resource_path(ref_of(manifest)),
            body=manifest,
            content_type="application/merge-patch+json",
        )

    def create(self, manifest: Manifest) -> dict[str, Any]:
        meta = manifest["metadata"]
        ref = ChildRef(
            manifest["apiVersion"], manifest["kind"], meta["namespace"], meta.get("name", "-")
        )
        collection = resource_path(ref).rsplit("/", 1)[0]
        return self._call("POST", collection, body=manifest)

    def replace(self, manifest: Manifest) -> dict[str, Any]:
        """PUT; with ``metadata.resourceVersion`` set it is a compare-and-swap (409 if stale)."""
        return self._call("PUT", resource_path(ref_of(manifest)), body=manifest)

    def delete(self, ref: ChildRef) -> None:
        try:
            self._call(
                "DELETE",
                resource_path(ref),
                body={
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "propagationPolicy": "Background",
                },
            )
        except ApiError as exc:
            if exc.status != 404:
                raise

    def patch_status(self, ref: ChildRef, status: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            "PATCH",
            resource_path(ref, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )


def _error_message(body: object) -> str:
    if isinstance(body, (bytes, str)):
        try:
            parsed = json.loads(body)
        except ValueError:
            return body.decode() if isinstance(body, bytes) else body
        if isinstance(parsed, dict):
            return str(parsed.get("message", ""))
    return ""


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


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


@dataclass
class SyncResult:
    """What reconciling the children did; ``live`` maps kind to the live object."""

    live: dict[str, dict[str, Any]] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


def _write(cluster: Cluster, manifest: Manifest, *, exists: bool) -> dict[str, Any]:
    """Server-side apply; for an edited object it refuses, a merge patch of our manifest.

    Apply merges list entries by key, so a hand edit that changed a key (a Service port
    80 -> 9999, both named ``http``) would make apply add our entry next to the edited one, an
    invalid object. A JSON merge patch replaces such lists wholesale with ours.
    """
    ref = ref_of(manifest)
    try:
        return cluster.apply(manifest)
    except ApiError as exc:
        if exc.status not in (400, 422):
            raise
        if not exists:
            raise ChildRejectedError(f"{ref.kind} {ref.name} was refused: {exc.message}") from None
        log.info(
            "apply of %s %s/%s refused (%s); replacing edited lists",
            ref.kind,
            ref.namespace,
            ref.name,
            exc.message,
        )
    try:
        return cluster.merge_patch(manifest)
    except ApiError as exc:
        if exc.status in (400, 422):
            raise ChildRejectedError(f"{ref.kind} {ref.name} was refused: {exc.message}") from None
        raise


def sync_children(
    cluster: Cluster, owner: Owner, desired: DesiredChildren, *, check_absent: bool = True
) -> SyncResult:
    """Make the children match ``desired``; write only what differs.

    ``check_absent=False`` skips looking for children that must not exist, for callers that
    already confirmed them gone for this generation (three GETs saved per reconcile).
    """
    result = SyncResult()
    for manifest in desired.present:
        ref = ref_of(manifest)
        live = cluster.get(ref)
        if live is not None:
            uid = controller_uid(live)
            if uid is not None and uid != owner.uid:
                raise ChildConflictError(
                    f"{ref.kind} {ref.namespace}/{ref.name} exists and is controlled by "
                    f"another owner (uid {uid}); rename or delete it"
                )
        if live is None or not is_subset(manifest, live):
            live = _write(cluster, manifest, exists=live is not None)
            result.applied.append(ref.kind)
            log.info("applied %s %s/%s", ref.kind, ref.namespace, ref.name)
        result.live[ref.kind] = live
    for ref in desired.absent if check_absent else ():
        live = cluster.get(ref)
        if live is not None and controller_uid(live) == owner.uid:
            cluster.delete(ref)
            result.deleted.append(ref.kind)
            log.info("deleted %s %s/%s (no longer wanted)", ref.kind, ref.namespace, ref.name)
    return result

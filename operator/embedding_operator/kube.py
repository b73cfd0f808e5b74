"""The Kubernetes API as the operator sees it: object refs, API errors, the REST client.

Everything that knows how to name an object (``ObjectRef``, ``resource_path``), how an API call
fails (``ApiError``), who controls an object (``controller_of``) and how to talk to the API
server (``api_client``, ``KubeCluster``) lives here, once. The rest of the operator talks to
the ``Cluster`` protocol, which ``KubeCluster`` implements over the official client and the
tests implement in memory, so reconciliation never imports ``kubernetes`` itself.

The official client is imported lazily: ``embedding-operator render`` and the pure builders
need refs but no cluster.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

FIELD_MANAGER = "embedding-operator"

_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "NetworkPolicy": "networkpolicies",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "EmbeddingService": "embeddingservices",
    "EmbeddingJob": "embeddingjobs",
    "Job": "jobs",
    "ServiceAccount": "serviceaccounts",
    "Lease": "leases",
    "Event": "events",
}


@dataclass(frozen=True)
class ObjectRef:
    """Which namespaced object: enough to GET, PATCH or DELETE it."""

    api_version: str
    kind: str
    namespace: str
    name: str


def ref_of(manifest: Mapping[str, Any]) -> ObjectRef:
    meta = manifest["metadata"]
    return ObjectRef(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])


def resource_path(ref: ObjectRef, subresource: str | None = None) -> str:
    """REST path of a namespaced object (``/apis/apps/v1/namespaces/x/deployments/y``)."""
    plural = _PLURALS[ref.kind]
    base = f"/api/{ref.api_version}" if "/" not in ref.api_version else f"/apis/{ref.api_version}"
    path = f"{base}/namespaces/{ref.namespace}/{plural}/{ref.name}"
    return f"{path}/{subresource}" if subresource else path


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ownerReference with ``controller: true`` (Kubernetes allows at most one), or None."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


RequestObserver = Callable[[str, str, str, float], None]
"""Told of every API request once it ended: ``(verb, resource, code, seconds)``."""


def request_labels(method: str, path: str, content_type: str) -> tuple[str, str]:
    """The ``(verb, resource)`` of a REST request, as the API server names them in its own
    ``apiserver_request_total``: ``get``/``list`` (a name, or a collection), ``apply`` (a
    server-side apply patch), ``patch``, ``create``, ``update``, ``delete``; the resource is
    the plural, with its subresource (``embeddingservices/status``)."""
    parts = path.strip("/").split("/")
    # /api/v1/namespaces/ns/<plural>[/name[/sub]] or /apis/group/v1/namespaces/ns/...
    rest = parts[parts.index("namespaces") + 2 :] if "namespaces" in parts else parts[-2:]
    resource = rest[0] if rest else "unknown"
    named = len(rest) >= 2
    if len(rest) >= 3:
        resource = f"{resource}/{rest[2]}"
    if method == "GET":
        verb = "get" if named else "list"
    elif method == "PATCH":
        verb = "apply" if content_type == "application/apply-patch+yaml" else "patch"
    else:
        verb = {"POST": "create", "PUT": "update", "DELETE": "delete"}.get(method, method.lower())
    return verb, resource


NAMESPACE_TERMINATING = "NamespaceTerminating"
"""The cause the API server gives when it refuses to create an object in a namespace that is
being deleted (``metav1.StatusCause``, serialized under ``details.causes[].reason``)."""


class ApiError(Exception):
    """An API call failed; ``status`` is the HTTP status (0: no response), ``causes`` the
    reasons of the Status body's ``details.causes``."""

    def __init__(self, status: int, message: str, causes: tuple[str, ...] = ()) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.causes = causes

    @property
    def namespace_terminating(self) -> bool:
        """The write was refused because its namespace is being deleted: retrying cannot
        help, and the object being reconciled goes with the namespace."""
        return NAMESPACE_TERMINATING in self.causes


class Cluster(Protocol):
    """The few API calls reconciliation needs; the real one and an in-memory fake."""

    def get(self, ref: ObjectRef) -> dict[str, Any] | None: ...

    def apply(self, manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]: ...

    def merge_patch(self, manifest: dict[str, Any]) -> dict[str, Any]: ...

    def delete(self, ref: ObjectRef, uid: str | None = None) -> None: ...

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...

    def patch_status(self, ref: ObjectRef, status: dict[str, Any]) -> dict[str, Any]: ...


def api_client(pool_size: int) -> Any:
    """A ``kubernetes.client.ApiClient``: in-cluster credentials, else ``$KUBECONFIG``."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    configuration = client.Configuration.get_default_copy()
    # One connection per reconcile thread, or urllib3 churns connections under load.
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


class KubeCluster:
    """``Cluster`` over the official kubernetes client (sync; runs in worker threads)."""

    def __init__(
        self,
        api_client: Any,
        *,
        timeout: float = 30.0,
        observe: RequestObserver | None = None,
    ) -> None:
        self._api = api_client
        self._timeout = (5.0, timeout)
        self._observe = observe

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> dict[str, Any]:
        """One request; each is told to ``observe`` with its HTTP status (``<error>``: none
        came back) and how long it took, whatever its outcome."""
        started = time.monotonic()
        code = "<error>"
        try:
            status, result = self._request(
                method, path, body=body, content_type=content_type, query=query
            )
            code = str(status)
            return result
        except ApiError as exc:
            code = str(exc.status) if exc.status else "<error>"
            raise
        finally:
            if self._observe is not None:
                verb, resource = request_labels(method, path, content_type)
                self._observe(verb, resource, code, time.monotonic() - started)

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """The HTTP status and the decoded body of a successful request; else ``ApiError``."""
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
            message, causes = _error_status(exc.body)
            raise ApiError(int(exc.status or 0), message or str(exc.reason), causes) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # Connection refused, timeouts, TLS errors: retryable like a 5xx.
            raise ApiError(0, f"{method} {path}: {exc}") from exc
        if not 200 <= response.status < 300:
            message, causes = _error_status(data)
            raise ApiError(int(response.status), message or str(response.reason), causes)
        return int(response.status), (dict(json.loads(data)) if data else {})

    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        try:
            return self._call("GET", resource_path(ref))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        """Server-side apply; without ``force``, a field another manager set to another
        value is a conflict (409) instead of being taken over."""
        # A pre-serialised body: the client sends strings as they are, whatever the type.
        return self._call(
            "PATCH",
            resource_path(ref_of(manifest)),
            body=json.dumps(manifest),
            content_type="application/apply-patch+yaml",
            query=[("fieldManager", FIELD_MANAGER), ("force", "true" if force else "false")],
        )

    def merge_patch(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            "PATCH",
            resource_path(ref_of(manifest)),
            body=manifest,
            content_type="application/merge-patch+json",
        )

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        ref = ObjectRef(
            manifest["apiVersion"], manifest["kind"], meta["namespace"], meta.get("name", "-")
        )
        collection = resource_path(ref).rsplit("/", 1)[0]
        return self._call("POST", collection, body=manifest)

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """PUT; with ``metadata.resourceVersion`` set it is a compare-and-swap (409 if stale)."""
        return self._call("PUT", resource_path(ref_of(manifest)), body=manifest)

    def delete(self, ref: ObjectRef, uid: str | None = None) -> None:
        """DELETE; with ``uid``, only that object (a re-created namesake is left alone)."""
        options: dict[str, Any] = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
        }
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", resource_path(ref), body=options)
        except ApiError as exc:
            if exc.status != 404:
                raise

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        listing = self._call(
            "GET",
            f"/api/v1/namespaces/{namespace}/pods",
            query=[("labelSelector", label_selector)],
        )
        return list(listing.get("items") or [])

    def patch_status(self, ref: ObjectRef, status: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            "PATCH",
            resource_path(ref, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )


def _error_status(body: object) -> tuple[str, tuple[str, ...]]:
    """The message of an error response's Status body and the reasons of its causes (the
    body itself as the message when it is not JSON)."""
    if isinstance(body, (bytes, str)):
        try:
            parsed = json.loads(body)
        except ValueError:
            return (body.decode(errors="replace") if isinstance(body, bytes) else body), ()
        if isinstance(parsed, dict):
            details = parsed.get("details")
            causes = details.get("causes") if isinstance(details, dict) else None
            reasons = tuple(
                str(cause["reason"])
                for cause in (causes if isinstance(causes, list) else [])
                if isinstance(cause, dict) and cause.get("reason")
            )
            return str(parsed.get("message", "")), reasons
    return "", ()

"""Discovery from the cluster: EmbeddingServices for the models and their names,
EndpointSlices for where each is served.

Two list-then-watch loops (one per kind) run in threads with the ``kubernetes`` client, each
handing every event to the event loop, where :class:`ClusterState` applies it and the
catalog is published again. The state logic is pure (events in, catalog out), so the tests
drive it with replayed events; only :meth:`KubernetesDiscovery.in_cluster` talks to an API
server.

Names of an EmbeddingService (the first is what ``/v1/models`` lists):
``status.model.servedModelName``, ``spec.servedModelName``, the last path component of
``spec.model.name`` (the server's default name), ``spec.model.name`` itself (the server
accepts it too), ``spec.servedModelAliases`` (the server's ``--served-model-aliases``), and
the deprecated comma-separated annotation :data:`ALIASES_ANNOTATION` (the union: the
operator passes its names to the server too, so both keep routing while users move). Its
endpoints are the ready addresses of the EndpointSlices labelled
``kubernetes.io/service-name`` with its name (the operator names the Service after the
EmbeddingService), on the port named ``http``; only slices that Kubernetes' own
endpoint-slice controller manages for that Service (its ``managed-by`` label and a controller
ownerReference to the Service of that name), and only their endpoints that are pods (a
``targetRef`` of kind Pod): a slice anyone else writes, labelled with a service's name, is
not routed to (issue 48, L8).

A model name is owned by one EmbeddingService (issue 48, H3): when several claim it, the
oldest claim wins (``metadata.creationTimestamp``, then ``namespace/name``), so a newer object
can never take a name that routes another team's traffic; the later claimant keeps its other
names, and the log says once which names it was refused. A name that
:class:`ReservedNames` reserves (``--reserved-model-names``) may be claimed only from the
namespaces it lists, whatever the age of the claim. The operator applies the same rule and
reports a refused claim on the object (``NamesOwned`` False: ``operator/.../names.py``; the
contract test keeps the two equal).

Versions (issue 47, item 4): where the status reports the fingerprint of the model the Service
routes to (``status.rollout.activeFingerprint``) and, while a model change prepares, of the
one in ``<name>-next`` (``pendingFingerprint``), each is also an entry of its own under the
versioned names ``<name>@<fingerprint>`` of every name the service owns: the active one on the
Service's endpoints, the pending one on ``<name>-next``'s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal

import orjson

from embedding_server.fingerprint import is_fingerprint, versioned_name
from embedding_server.gateway.discovery import Publish, Service, Version

logger = logging.getLogger(__name__)

GROUP = "embedding-operator.dev"
VERSION = "v1alpha1"
PLURAL = "embeddingservices"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
SLICE_CONTROLLER = "endpointslice-controller.k8s.io"
"""The value of :data:`MANAGED_BY_LABEL` on the slices Kubernetes derives from a Service's
selector; a slice written by anyone else (a mirroring controller, a CR author with write
access to EndpointSlices) carries another value or none."""
PORT_NAME = "http"
ALIASES_ANNOTATION = "embedding-operator.dev/aliases"
"""Deprecated: extra model names of an EmbeddingService, comma-separated, from before
``spec.servedModelAliases``; still read (its names are added to the field's), with a warning
in the log once per object."""
HF_PREFIX = "hf://"

Kind = Literal["EmbeddingService", "EndpointSlice"]
Event = tuple[str, Any]
"""``(type, payload)``: type ADDED, MODIFIED or DELETED with one object, or SYNC with the
whole list (after a (re)list, which replaces what was known of that kind)."""

WatchSource = Callable[[Kind, threading.Event], Iterator[Event]]
"""Yields one kind's events until the stop event is set (a real watch, or a replay)."""


def model_names(resource: Mapping[str, Any]) -> tuple[str, ...]:
    """The names an EmbeddingService answers to, the served name first, no duplicates."""
    spec = resource.get("spec") or {}
    status = resource.get("status") or {}
    model = str((spec.get("model") or {}).get("name") or "").removeprefix(HF_PREFIX)
    annotations = (resource.get("metadata") or {}).get("annotations") or {}
    candidates = [
        ((status.get("model") or {}).get("servedModelName")),
        spec.get("servedModelName"),
        model.rstrip("/").rsplit("/", 1)[-1] if model else None,
        model or None,
        *(spec.get("servedModelAliases") or []),
        *str(annotations.get(ALIASES_ANNOTATION, "")).split(","),
    ]
    names: list[str] = []
    for candidate in candidates:
        name = str(candidate).strip() if candidate else ""
        if name and name not in names:
            names.append(name)
    return tuple(names)


def slice_service(endpoint_slice: Mapping[str, Any]) -> str | None:
    """The Service whose endpoints an EndpointSlice holds, if the endpoint-slice controller
    made it for that Service: its ``kubernetes.io/service-name`` label, when the slice is
    also labelled managed by the controller and controlled (ownerReference) by the v1
    Service of that name. None for any other slice, which is never routed to."""
    metadata = endpoint_slice.get("metadata") or {}
    labels = metadata.get("labels") or {}
    service = labels.get(SERVICE_NAME_LABEL)
    if not service or labels.get(MANAGED_BY_LABEL) != SLICE_CONTROLLER:
        return None
    for owner in metadata.get("ownerReferences") or []:
        if (
            owner.get("controller") is True
            and owner.get("apiVersion") == "v1"
            and owner.get("kind") == "Service"
            and owner.get("name") == service
        ):
            return str(service)
    return None


def slice_endpoints(endpoint_slice: Mapping[str, Any]) -> frozenset[str]:
    """Base URLs of an EndpointSlice's ready pod endpoints on the ``http`` port (an endpoint
    without a Pod ``targetRef``, an address written by hand, is skipped)."""
    ports = endpoint_slice.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == PORT_NAME), None)
    if port is None and len(ports) == 1:
        port = ports[0].get("port")
    if port is None or endpoint_slice.get("addressType") not in ("IPv4", "IPv6"):
        return frozenset()
    urls = set()
    for endpoint in endpoint_slice.get("endpoints") or []:
        # An unset condition means ready (discovery.k8s.io/v1); terminating ones are not.
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        if (endpoint.get("targetRef") or {}).get("kind") != "Pod":
            continue
        for address in (endpoint.get("addresses") or [])[:1]:
            host = f"[{address}]" if ":" in address else address
            urls.add(f"http://{host}:{port}")
    return frozenset(urls)


class ReservedNames:
    """Model names that only some namespaces may claim: ``PATTERN=NAMESPACE|NAMESPACE``
    items (shell patterns such as ``text-embedding-*``). The first pattern that matches a
    name decides; a name no pattern matches may be claimed from any namespace (and is then
    its oldest claimant's)."""

    def __init__(self, items: Iterable[str] = ()) -> None:
        rules: list[tuple[str, frozenset[str]]] = []
        for item in items:
            pattern, sep, namespaces = item.partition("=")
            allowed = frozenset(n.strip() for n in namespaces.split("|") if n.strip())
            if not sep or not pattern.strip() or not allowed:
                raise ValueError(
                    f"--reserved-model-names: {item!r} is not PATTERN=NAMESPACE[|NAMESPACE...]"
                )
            rules.append((pattern.strip(), allowed))
        self.rules = tuple(rules)

    def allows(self, name: str, namespace: str) -> bool:
        for pattern, allowed in self.rules:
            if fnmatchcase(name, pattern):
                return namespace in allowed
        return True


@dataclass(frozen=True)
class _Claim:
    """What an EmbeddingService claims: its names, and when it was created (the claim's age;
    an object without a timestamp sorts last); ``keyed``: its pods need an API key."""

    names: tuple[str, ...]
    created: str
    keyed: bool = False
    active: str | None = None
    """The fingerprint the Service routes to (``status.rollout.activeFingerprint``)."""
    pending: str | None = None
    """The fingerprint being prepared in ``<name>-next`` (``pendingFingerprint``, while the
    phase is Preparing or Prepared: in Switching the Service already routes to it)."""


PREPARING_PHASES = frozenset({"Preparing", "Prepared"})
"""``status.rollout.phase`` values in which ``<name>-next`` serves a model the Service does
not (operator/embedding_operator/bluegreen.py)."""

NEXT_SERVICE_SUFFIX = "-next"
"""The operator's Service of the model being prepared is the EmbeddingService's name with
this suffix (``builders/deployment.py``'s ``NEXT_SERVICE_SUFFIX``; the contract test keeps
the two equal)."""


def rollout_fingerprints(resource: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The active and pending fingerprints an EmbeddingService's status reports (None where
    it reports none, or no fingerprint: the golden record is not taken yet, or the contract
    is disabled)."""
    rollout = (resource.get("status") or {}).get("rollout") or {}
    active = rollout.get("activeFingerprint")
    active = active if isinstance(active, str) and is_fingerprint(active) else None
    pending = rollout.get("pendingFingerprint")
    if (
        not isinstance(pending, str)
        or not is_fingerprint(pending)
        or pending == active
        or rollout.get("phase") not in PREPARING_PHASES
    ):
        pending = None
    return active, pending


def _created(resource: Mapping[str, Any]) -> str:
    return str((resource.get("metadata") or {}).get("creationTimestamp") or "~")


def name_owners(
    claims: Mapping[tuple[str, str], tuple[tuple[str, ...], str]],
    reserved: ReservedNames | None = None,
) -> dict[str, tuple[str, str]]:
    """Each claimed name's owner: of the claims the reservations allow, the oldest (by
    creation time, then ``(namespace, name)``). ``claims`` maps ``(namespace, name)`` to the
    object's names and creation time."""
    reserved = reserved or ReservedNames()
    owners: dict[str, tuple[str, str]] = {}
    for key in sorted(claims, key=lambda k: (claims[k][1], k)):
        for name in claims[key][0]:
            if name not in owners and reserved.allows(name, key[0]):
                owners[name] = key
    return owners


def _key(resource: Mapping[str, Any]) -> tuple[str, str]:
    metadata = resource.get("metadata") or {}
    return (str(metadata.get("namespace") or ""), str(metadata.get("name") or ""))


class ClusterState:
    """What the watches have said: EmbeddingServices' names and EndpointSlices' ready
    endpoints, and the catalog that follows from them."""

    def __init__(self, reserved: ReservedNames | None = None) -> None:
        self.reserved = reserved or ReservedNames()
        self.models: dict[tuple[str, str], _Claim] = {}
        self.slices: dict[tuple[str, str], tuple[str, frozenset[str]]] = {}
        self._warned_annotation: set[tuple[str, str]] = set()
        self._refused: set[tuple[str, tuple[str, str], tuple[str, str] | None]] = set()

    def apply(self, kind: Kind, event_type: str, payload: Any) -> None:
        if kind == "EmbeddingService":
            self._apply_model(event_type, payload)
        else:
            self._apply_slice(event_type, payload)

    def _apply_model(self, event_type: str, payload: Any) -> None:
        if event_type == "SYNC":
            self.models = {}
            for item in payload:
                self._apply_model("ADDED", item)
        elif event_type == "DELETED":
            self.models.pop(_key(payload), None)
        elif event_type in ("ADDED", "MODIFIED"):
            names = model_names(payload)
            if names:
                keyed = bool((payload.get("spec") or {}).get("apiKeySecretRef"))
                active, pending = rollout_fingerprints(payload)
                self.models[_key(payload)] = _Claim(
                    names, _created(payload), keyed, active, pending
                )
            else:
                self.models.pop(_key(payload), None)
            annotations = (payload.get("metadata") or {}).get("annotations") or {}
            key = _key(payload)
            if ALIASES_ANNOTATION in annotations and key not in self._warned_annotation:
                self._warned_annotation.add(key)
                logger.warning(
                    "%s/%s: the annotation %s is deprecated; move its names to "
                    "spec.servedModelAliases",
                    *key,
                    ALIASES_ANNOTATION,
                )

    def _apply_slice(self, event_type: str, payload: Any) -> None:
        if event_type == "SYNC":
            self.slices = {}
            for item in payload:
                self._apply_slice("ADDED", item)
        elif event_type == "DELETED":
            self.slices.pop(_key(payload), None)
        elif event_type in ("ADDED", "MODIFIED"):
            service = slice_service(payload)
            if service is not None:
                self.slices[_key(payload)] = (service, slice_endpoints(payload))
            else:  # relabelled or re-owned: it no longer counts for any service
                self.slices.pop(_key(payload), None)

    def catalog(self) -> list[Service]:
        by_service: dict[tuple[str, str], set[str]] = {}
        for (namespace, _), (service, urls) in self.slices.items():
            by_service.setdefault((namespace, service), set()).update(urls)
        owners = name_owners(
            {key: (claim.names, claim.created) for key, claim in self.models.items()},
            self.reserved,
        )
        services: list[Service] = []
        for key, claim in sorted(self.models.items()):
            owned = tuple(name for name in claim.names if owners.get(name) == key)
            for name in claim.names:
                if owners.get(name) != key:
                    self._refuse(name, key, owners.get(name))
            if owned:
                services.extend(self._entries(key, claim, owned, by_service))
        return services

    @staticmethod
    def _entries(
        key: tuple[str, str],
        claim: _Claim,
        owned: tuple[str, ...],
        by_service: Mapping[tuple[str, str], set[str]],
    ) -> Iterator[Service]:
        """An EmbeddingService's catalog entries: the service under its owned names (its
        Service's endpoints), then each version whose fingerprint the status reports under
        the versioned names (``name@fingerprint``): the active one on the same endpoints, the
        pending one on ``<name>-next``'s. A version's names derive from names the service
        owns, so they are its owner's too."""
        base = f"{key[0]}/{key[1]}"
        listed = not claim.keyed
        yield Service(
            base, owned, frozenset(by_service.get(key, ())), listed, fingerprint=claim.active
        )
        versions: list[tuple[Version, str | None, tuple[str, str]]] = [
            ("active", claim.active, key),
            ("pending", claim.pending, (key[0], key[1] + NEXT_SERVICE_SUFFIX)),
        ]
        for version, fingerprint, service in versions:
            if fingerprint is not None:
                yield Service(
                    versioned_name(base, fingerprint),
                    tuple(versioned_name(name, fingerprint) for name in owned),
                    frozenset(by_service.get(service, ())),
                    listed,
                    version=version,
                    fingerprint=fingerprint,
                    parent=owned[0],
                )

    def _refuse(self, name: str, key: tuple[str, str], owner: tuple[str, str] | None) -> None:
        """Log once that ``key``'s claim on ``name`` is ignored, and why."""
        if (name, key, owner) in self._refused:
            return
        self._refused.add((name, key, owner))
        if owner is None:
            logger.warning(
                "%s/%s: model name %r is reserved for other namespaces "
                "(--reserved-model-names); not routing it there",
                *key,
                name,
            )
        else:
            logger.warning(
                "%s/%s: model name %r is taken by %s/%s (the older claim); not routing it there",
                *key,
                name,
                *owner,
            )


class KubernetesDiscovery:
    """The catalog from the API server (or from ``source``: a replay, in tests)."""

    def __init__(self, source: WatchSource, reserved: ReservedNames | None = None) -> None:
        self._source = source
        self.state = ClusterState(reserved)

    @classmethod
    def in_cluster(
        cls, namespace: str | None, reserved: ReservedNames | None = None
    ) -> KubernetesDiscovery:
        """Watch with the pod's service account (or ``~/.kube/config`` outside a pod);
        ``namespace`` None watches every namespace."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        return cls(ApiWatchSource.for_api(client.ApiClient(), namespace), reserved)

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        queue: asyncio.Queue[tuple[Kind, str, Any]] = asyncio.Queue()
        synced: set[Kind] = set()
        published: list[Service] | None = None

        def pump(kind: Kind) -> None:
            for event_type, payload in self._source(kind, stop):
                if stop.is_set():
                    return
                loop.call_soon_threadsafe(queue.put_nowait, (kind, event_type, payload))

        threads = [
            threading.Thread(target=pump, args=(kind,), daemon=True, name=f"watch-{kind}")
            for kind in ("EmbeddingService", "EndpointSlice")
        ]
        for thread in threads:
            thread.start()
        try:
            while True:
                kind, event_type, payload = await queue.get()
                self.state.apply(kind, event_type, payload)
                if event_type == "SYNC":
                    synced.add(kind)
                # Publish once both kinds are listed (a catalog without endpoints would
                # hold every request), then on every event, coalesced with those queued.
                while not queue.empty():
                    kind, event_type, payload = queue.get_nowait()
                    self.state.apply(kind, event_type, payload)
                    if event_type == "SYNC":
                        synced.add(kind)
                catalog = self.state.catalog()
                if len(synced) == 2 and catalog != published:  # status updates change nothing
                    publish(catalog)
                    published = catalog
        finally:
            stop.set()


ListFunction = tuple[Callable[..., Any], tuple[Any, ...]]
"""A ``kubernetes`` client list function and its positional arguments; with ``watch=True``
the same function streams the changes (as the client's ``watch.Watch`` calls it)."""


class ApiWatchSource:
    """List-then-watch one kind with the ``kubernetes`` client, forever: a SYNC with the
    listing, then its events; on a broken or expired watch (410 Gone), list again."""

    WATCH_SECONDS = 60
    """A watch is renewed this often, so a stop is noticed within it."""

    RETRY_SECONDS = 2.0
    """Pause before listing again after an error other than 410 Gone."""

    def __init__(self, functions: Mapping[Kind, ListFunction]) -> None:
        self._functions = functions

    @classmethod
    def for_api(cls, api: Any, namespace: str | None) -> ApiWatchSource:
        """EmbeddingServices and EndpointSlices in ``namespace`` (None: all namespaces)."""
        from kubernetes import client

        custom = client.CustomObjectsApi(api)
        slices = client.DiscoveryV1Api(api)
        if namespace:
            return cls(
                {
                    "EmbeddingService": (
                        custom.list_namespaced_custom_object,
                        (GROUP, VERSION, namespace, PLURAL),
                    ),
                    "EndpointSlice": (slices.list_namespaced_endpoint_slice, (namespace,)),
                }
            )
        return cls(
            {
                "EmbeddingService": (custom.list_cluster_custom_object, (GROUP, VERSION, PLURAL)),
                "EndpointSlice": (slices.list_endpoint_slice_for_all_namespaces, ()),
            }
        )

    def __call__(self, kind: Kind, stop: threading.Event) -> Iterator[Event]:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        function, args = self._functions[kind]
        while not stop.is_set():
            try:
                listing = orjson.loads(function(*args, _preload_content=False).data)
                version = (listing.get("metadata") or {}).get("resourceVersion")
                yield "SYNC", listing.get("items") or []
                while not stop.is_set():
                    watcher = watch.Watch()  # type: ignore[no-untyped-call]
                    for event in watcher.stream(  # type: ignore[no-untyped-call]
                        function,
                        *args,
                        resource_version=version,
                        timeout_seconds=self.WATCH_SECONDS,
                        allow_watch_bookmarks=True,
                    ):
                        raw = event.get("raw_object") or {}
                        version = (raw.get("metadata") or {}).get("resourceVersion") or version
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            yield event["type"], raw
                        if stop.is_set():
                            watcher.stop()  # type: ignore[no-untyped-call]
                            return
            except ApiException as error:
                if error.status != 410:
                    logger.warning("watching %ss failed (%s); listing again", kind, error.reason)
                    stop.wait(self.RETRY_SECONDS)
            except Exception as error:  # noqa: BLE001 - network trouble: list again after a pause
                logger.warning("watching %ss failed (%s); listing again", kind, error)
                stop.wait(self.RETRY_SECONDS)

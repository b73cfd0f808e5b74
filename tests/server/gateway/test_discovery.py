"""Discovery: static routes from flags and files (reloaded on change), and the Kubernetes
source driven by replayed watch events (the real API server is the e2e tier's)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from embedding_server.gateway.discovery import (
    DiscoveryError,
    Service,
    StaticDiscovery,
    parse_route_flags,
)
from embedding_server.gateway.kubernetes import (
    ALIASES_ANNOTATION,
    ApiWatchSource,
    ClusterState,
    Event,
    Kind,
    KubernetesDiscovery,
    ReservedNames,
    model_names,
)
from embedding_server.gateway.proxy import Catalog

pytestmark = pytest.mark.timeout(30)


def test_route_flags_group_endpoints_by_model() -> None:
    services = parse_route_flags(
        ["a=http://10.0.0.1:8000", "a=http://10.0.0.2:8000/", "b=https://b.example"]
    )
    assert {s.name: s.endpoints for s in services} == {
        "a": {"http://10.0.0.1:8000", "http://10.0.0.2:8000"},
        "b": {"https://b.example"},
    }
    with pytest.raises(DiscoveryError, match="not MODEL=URL"):
        parse_route_flags(["http://10.0.0.1:8000"])
    with pytest.raises(DiscoveryError, match="not an http"):
        parse_route_flags(["a=10.0.0.1:8000"])


def test_a_routes_file_is_read_and_bad_ones_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(
        "models:\n"
        "  - name: minilm\n"
        "    aliases: [all-MiniLM-L6-v2]\n"
        "    endpoints: [http://127.0.0.1:8001]\n"
        "  - name: cold\n"
    )
    discovery = StaticDiscovery((), str(path))
    assert discovery.catalog() == [
        Service(
            "file/minilm", ("minilm", "all-MiniLM-L6-v2"), frozenset({"http://127.0.0.1:8001"})
        ),
        Service("file/cold", ("cold",), frozenset()),
    ]
    path.write_text("models:\n  - name: x\n    endpoint: [http://a]\n")
    with pytest.raises(DiscoveryError, match=r"models\[0\]: unknown field\(s\) endpoint"):
        StaticDiscovery((), str(path))


async def test_a_changed_routes_file_is_published_again_and_a_broken_one_is_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "routes.json"
    path.write_text('{"models": [{"name": "m", "endpoints": []}]}')
    published: list[Sequence[Service]] = []
    discovery = StaticDiscovery(["f=http://127.0.0.1:1"], str(path), check_interval=0.02)
    task = asyncio.create_task(discovery.run(published.append))
    try:
        await _until(lambda: len(published) == 1)
        path.write_text('{"models": [{"name": "m", "endpoints": ["http://127.0.0.1:2"]}]}')
        os.utime(path, ns=(1, 2_000_000_000))  # a different mtime even on coarse clocks
        await _until(lambda: len(published) == 2)
        path.write_text("{not json")
        os.utime(path, ns=(1, 3_000_000_000))
        await asyncio.sleep(0.1)
    finally:
        task.cancel()
    assert len(published) == 2  # the broken file kept the last good catalog
    assert {s.name: s.endpoints for s in published[1]} == {
        "f": {"http://127.0.0.1:1"},
        "m": {"http://127.0.0.1:2"},
    }


def _service(name: str, spec: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name, **extra}, "spec": spec}


def _slice(name: str, service: str, *endpoints: tuple[str, bool | None]) -> dict[str, Any]:
    """An EndpointSlice as Kubernetes' endpoint-slice controller writes it for ``service``."""
    return {
        "metadata": {
            "namespace": "ns",
            "name": name,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": service,
                    "uid": f"uid-{service}",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {} if ready is None else {"ready": ready},
                "targetRef": {"kind": "Pod", "namespace": "ns", "name": f"pod-{address}"},
            }
            for address, ready in endpoints
        ],
    }


def test_model_names_come_from_status_spec_model_and_the_aliases_annotation() -> None:
    resource = _service(
        "bge",
        {"model": {"name": "hf://BAAI/bge-small-en-v1.5"}},
        annotations={ALIASES_ANNOTATION: "bge, small ,"},
    )
    assert model_names(resource) == ("bge-small-en-v1.5", "BAAI/bge-small-en-v1.5", "bge", "small")
    resource["spec"]["servedModelName"] = "bge-s"
    resource["status"] = {"model": {"servedModelName": "bge-s"}}
    assert model_names(resource)[:2] == ("bge-s", "bge-small-en-v1.5")


def test_model_names_take_the_specs_aliases_with_the_deprecated_annotations() -> None:
    """``spec.servedModelAliases`` after the served name and the model's own names; the
    annotation's names, still read, after them, with no name twice."""
    spec = {
        "model": {"name": "hf://BAAI/bge-small-en-v1.5"},
        "servedModelName": "bge",
        "servedModelAliases": ["text-embedding-3-small", "small"],
    }
    resource = _service("bge", spec)
    assert model_names(resource) == (
        "bge",
        "bge-small-en-v1.5",
        "BAAI/bge-small-en-v1.5",
        "text-embedding-3-small",
        "small",
    )
    resource["metadata"]["annotations"] = {ALIASES_ANNOTATION: "small,old-name"}
    assert model_names(resource)[3:] == ("text-embedding-3-small", "small", "old-name")


def test_an_alias_routes_to_its_service_and_the_deprecated_annotation_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each service's aliases route to it; the annotation's use is logged as deprecated
    once per object."""
    a = _service("a", {"model": {"name": "org/a"}, "servedModelAliases": ["only-a"]})
    b = _service("b", {"model": {"name": "org/b"}, "servedModelAliases": ["only-b"]})
    b["metadata"]["annotations"] = {ALIASES_ANNOTATION: "legacy-b"}
    state = ClusterState()
    with caplog.at_level(logging.WARNING):
        state.apply("EmbeddingService", "SYNC", [b, a])
        state.apply("EmbeddingService", "MODIFIED", b)
        state.apply("EndpointSlice", "SYNC", [])
        catalog = Catalog()
        catalog.replace(state.catalog())
    assert catalog.by_name["only-a"].key == "ns/a"
    assert catalog.by_name["legacy-b"].key == "ns/b"
    assert catalog.by_name["only-b"].key == "ns/b"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("ns/b: the annotation" in m and "deprecated" in m for m in messages) == 1


def _claim(namespace: str, name: str, created: str, *aliases: str) -> dict[str, Any]:
    resource = _service(
        name,
        {"model": {"name": f"org/{name}"}, "servedModelAliases": list(aliases)},
        creationTimestamp=created,
    )
    resource["metadata"]["namespace"] = namespace
    return resource


def test_a_model_name_is_the_oldest_claimants_and_a_newer_one_cannot_take_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 48, H3: team-b's newer EmbeddingService claims team-a's served name as an
    alias, from a namespace that sorts first. The name stays team-a's (the older claim), the
    thief keeps routing its own names, and the log says so once."""
    victim = _claim("team-a", "search", "2026-01-01T00:00:00Z", "text-embedding-3-small")
    thief = _claim("a-thief", "grab", "2026-06-01T00:00:00Z", "search", "text-embedding-3-small")
    state = ClusterState()
    with caplog.at_level(logging.WARNING):
        state.apply("EmbeddingService", "SYNC", [thief, victim])
        state.apply("EndpointSlice", "SYNC", [])
        first = state.catalog()
        state.apply("EmbeddingService", "MODIFIED", thief)
        catalog = Catalog()
        catalog.replace(state.catalog())
    assert catalog.by_name["search"].key == "team-a/search"
    assert catalog.by_name["text-embedding-3-small"].key == "team-a/search"
    assert catalog.by_name["grab"].key == "a-thief/grab"
    assert {s.key: s.names for s in first} == {
        "a-thief/grab": ("grab", "org/grab"),
        "team-a/search": ("search", "org/search", "text-embedding-3-small"),
    }
    messages = [r.getMessage() for r in caplog.records]
    assert sum("a-thief/grab: model name 'search' is taken by team-a/search" in m for m in messages)
    assert sum("'search' is taken" in m for m in messages) == 1  # once, not per catalog
    # The owner goes away: the name is the remaining claimant's.
    state.apply("EmbeddingService", "DELETED", victim)
    assert {s.key: s.names for s in state.catalog()}["a-thief/grab"][-2:] == (
        "search",
        "text-embedding-3-small",
    )


def test_equal_ages_are_decided_by_namespace_and_name_and_a_spec_edit_does_not_steal() -> None:
    """Same creation second: namespace/name decides, the same way every time; an older
    object that adds a name later still wins it (the object's age, not the edit's), and a
    re-created owner is a new, younger claim."""
    a = _claim("ns", "a", "2026-01-01T00:00:00Z", "shared")
    b = _claim("ns", "b", "2026-01-01T00:00:00Z", "shared")
    state = ClusterState()
    state.apply("EmbeddingService", "SYNC", [b, a])
    assert [s.key for s in state.catalog() if "shared" in s.names] == ["ns/a"]
    old = _claim("other", "old", "2025-01-01T00:00:00Z")
    state.apply("EmbeddingService", "ADDED", old)
    state.apply(
        "EmbeddingService",
        "MODIFIED",
        _claim("other", "old", old["metadata"]["creationTimestamp"], "shared"),
    )
    assert [s.key for s in state.catalog() if "shared" in s.names] == ["other/old"]


def test_reserved_names_may_be_claimed_only_from_their_namespaces() -> None:
    """``--reserved-model-names``: a reserved name goes to a listed namespace's claim even
    when an unlisted one claimed it first, and an unlisted claim alone is not routed."""
    reserved = ReservedNames(["text-embedding-*=search|ml", "bge=ml"])
    early = _claim("squatter", "early", "2025-01-01T00:00:00Z", "text-embedding-3-large")
    late = _claim("search", "late", "2026-01-01T00:00:00Z", "text-embedding-3-large")
    alone = _claim("squatter", "bge", "2025-01-01T00:00:00Z")
    state = ClusterState(reserved)
    state.apply("EmbeddingService", "SYNC", [early, late, alone])
    names = {s.key: s.names for s in state.catalog()}
    assert "text-embedding-3-large" in names["search/late"]
    assert "text-embedding-3-large" not in names["squatter/early"]
    assert names["squatter/bge"] == ("org/bge",)  # "bge" is ml's, its other name still routes
    assert reserved.allows("anything-else", "squatter")
    with pytest.raises(ValueError, match="PATTERN=NAMESPACE"):
        ReservedNames(["text-embedding-*"])


def test_cluster_state_joins_services_to_their_ready_slice_endpoints() -> None:
    state = ClusterState()
    state.apply("EmbeddingService", "SYNC", [_service("a", {"model": {"name": "org/a"}})])
    state.apply(
        "EndpointSlice",
        "SYNC",
        [
            _slice("a-1", "a", ("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None)),
            _slice("other-1", "other", ("10.0.0.9", True)),
        ],
    )
    state.apply("EndpointSlice", "ADDED", _slice("a-2", "a", ("10.0.0.4", True)))
    assert state.catalog() == [
        Service(
            "ns/a",
            ("a", "org/a"),
            frozenset({"http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://10.0.0.4:8000"}),
        )
    ]
    state.apply("EndpointSlice", "DELETED", _slice("a-1", "a"))
    assert state.catalog()[0].endpoints == {"http://10.0.0.4:8000"}
    state.apply("EmbeddingService", "DELETED", _service("a", {}))
    assert state.catalog() == []


def test_only_the_slice_controllers_slices_of_the_service_and_their_pods_are_routed_to() -> None:
    """Issue 48, L8: a slice labelled with a service's name but written by someone else
    (without the endpoint-slice controller's label, or not controlled by the Service of that
    name), and an endpoint that is not a pod, are not routed to; the controller's own slice
    of the Service is."""
    state = ClusterState()
    state.apply("EmbeddingService", "SYNC", [_service("a", {"model": {"name": "org/a"}})])
    genuine = _slice("a-1", "a", ("10.0.0.1", True))
    unmanaged = _slice("a-forged-1", "a", ("10.6.6.1", True))
    del unmanaged["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"]
    mirrored = _slice("a-forged-2", "a", ("10.6.6.2", True))
    mirrored["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] = "someone-else"
    foreign_owner = _slice("a-forged-3", "a", ("10.6.6.3", True))
    foreign_owner["metadata"]["ownerReferences"][0]["name"] = "attacker"
    not_controller = _slice("a-forged-4", "a", ("10.6.6.4", True))
    not_controller["metadata"]["ownerReferences"][0]["controller"] = False
    no_owner = _slice("a-forged-5", "a", ("10.6.6.5", True))
    del no_owner["metadata"]["ownerReferences"]
    not_a_pod = _slice("a-2", "a", ("10.0.0.2", True), ("10.6.6.6", True))
    not_a_pod["endpoints"][1]["targetRef"]["kind"] = "Node"
    del not_a_pod["endpoints"][0]["targetRef"]
    state.apply(
        "EndpointSlice",
        "SYNC",
        [genuine, unmanaged, mirrored, foreign_owner, not_controller, no_owner, not_a_pod],
    )
    assert state.catalog()[0].endpoints == {"http://10.0.0.1:8000"}
    # A slice that was the controller's and is relabelled by hand stops counting.
    relabelled = _slice("a-1", "a", ("10.0.0.1", True))
    relabelled["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] = "me"
    state.apply("EndpointSlice", "MODIFIED", relabelled)
    assert state.catalog()[0].endpoints == frozenset()


def test_a_service_whose_pods_need_an_api_key_is_routed_but_not_listed() -> None:
    """Issue 48, L4: the gateway cannot check a service's API key, so it never tells a caller
    of a service that has one (``listed`` False); requests for it still route."""
    keyed = _service("k", {"model": {"name": "org/k"}, "apiKeySecretRef": {"name": "s"}})
    state = ClusterState()
    state.apply("EmbeddingService", "SYNC", [keyed, _service("a", {"model": {"name": "org/a"}})])
    assert {s.key: s.listed for s in state.catalog()} == {"ns/a": True, "ns/k": False}


def _changing(phase: str, active: str | None, pending: str | None) -> dict[str, Any]:
    rollout: dict[str, Any] = {"strategy": "blueGreen", "phase": phase}
    if active:
        rollout["activeFingerprint"] = active
    if pending:
        rollout["pendingFingerprint"] = pending
    resource = _service("a", {"model": {"name": "org/a"}, "servedModelAliases": ["short"]})
    resource["status"] = {"rollout": rollout}
    return resource


def test_each_version_of_a_changing_model_is_an_entry_of_its_versioned_names() -> None:
    """Issue 47, item 4: the status's fingerprints make versions: the active one on the
    Service's pods and, while <name>-next prepares the new model, the pending one on
    <name>-next's; in Switching the Service already routes to the new model, and a service
    with no recorded fingerprint has no versions."""
    old, new = "0123456789abcdef", "fedcba9876543210"
    state = ClusterState()
    state.apply("EmbeddingService", "SYNC", [_changing("Preparing", old, new)])
    state.apply(
        "EndpointSlice",
        "SYNC",
        [_slice("a-1", "a", ("10.0.0.1", True)), _slice("a-next-1", "a-next", ("10.0.0.2", True))],
    )
    main, nxt = frozenset({"http://10.0.0.1:8000"}), frozenset({"http://10.0.0.2:8000"})
    names = ("a", "org/a", "short")
    assert state.catalog() == [
        Service("ns/a", names, main, fingerprint=old),
        Service(
            f"ns/a@{old}",
            tuple(f"{n}@{old}" for n in names),
            main,
            version="active",
            fingerprint=old,
            parent="a",
        ),
        Service(
            f"ns/a@{new}",
            tuple(f"{n}@{new}" for n in names),
            nxt,
            version="pending",
            fingerprint=new,
            parent="a",
        ),
    ]
    state.apply("EmbeddingService", "MODIFIED", _changing("Prepared", old, new))
    assert [s.version for s in state.catalog()] == [None, "active", "pending"]
    state.apply("EmbeddingService", "MODIFIED", _changing("Switching", new, new))
    assert [(s.key, s.endpoints) for s in state.catalog()] == [
        ("ns/a", main),
        (f"ns/a@{new}", main),
    ]
    state.apply("EmbeddingService", "MODIFIED", _changing("Preparing", None, None))
    assert [s.key for s in state.catalog()] == ["ns/a"]
    malformed = _changing("Preparing", "not-a-fingerprint", "FEDCBA9876543210")
    state.apply("EmbeddingService", "MODIFIED", malformed)
    assert [s.key for s in state.catalog()] == ["ns/a"]


class Replay:
    """A watch source that yields scripted events per kind, then blocks until stopped."""

    def __init__(self, events: dict[Kind, list[Event]]) -> None:
        self.events = events

    def __call__(self, kind: Kind, stop: threading.Event) -> Iterator[Event]:
        yield from self.events[kind]
        stop.wait()


async def test_kubernetes_discovery_publishes_once_both_kinds_are_listed_then_each_change() -> None:
    replay = Replay(
        {
            "EmbeddingService": [
                ("SYNC", [_service("a", {"model": {"name": "a"}})]),
                ("ADDED", _service("b", {"model": {"name": "b"}, "servedModelName": "bee"})),
            ],
            "EndpointSlice": [
                ("SYNC", []),
                ("ADDED", _slice("b-1", "b", ("10.0.0.7", True))),
            ],
        }
    )
    published: list[list[Service]] = []
    task = asyncio.create_task(KubernetesDiscovery(replay).run(published.append))  # type: ignore[arg-type]
    try:
        await _until(
            lambda: bool(published) and any(s.endpoints for s in published[-1]), what="b's pod"
        )
    finally:
        task.cancel()
    final = {s.key: (s.names, s.endpoints) for s in published[-1]}
    assert final == {
        "ns/a": (("a",), frozenset()),
        "ns/b": (("bee", "b"), frozenset({"http://10.0.0.7:8000"})),
    }
    # Nothing was published before both listings arrived (no half-empty catalog).
    assert all({s.key for s in catalog} >= {"ns/a"} for catalog in published)


async def _until(condition: Any, what: str = "condition", timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class _Response:
    """What the kubernetes client's functions return with ``_preload_content=False``."""

    status = 200

    def __init__(self, lines: list[dict[str, Any]] | None = None, data: Any = None) -> None:
        self.lines = lines or []
        self.data = orjson.dumps(data) if data is not None else b""

    def stream(self, amt: Any = None, decode_content: Any = None) -> Iterator[bytes]:
        for line in self.lines:
            yield orjson.dumps(line) + b"\n"

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


def _es(name: str, version: str) -> dict[str, Any]:
    resource = _service(name, {"model": {"name": name}})
    resource["metadata"]["resourceVersion"] = version
    return resource


def test_the_api_source_lists_watches_and_lists_again_when_the_watch_expires() -> None:
    calls: list[dict[str, Any]] = []
    gone = {"code": 410, "reason": "Expired", "message": "too old", "kind": "Status"}
    script = [
        _Response(data={"metadata": {"resourceVersion": "1"}, "items": [_es("a", "1")]}),
        _Response(
            [
                {"type": "ADDED", "object": _es("b", "2")},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "3"}}},
                {"type": "ERROR", "object": gone},
            ]
        ),
        _Response(
            data={"metadata": {"resourceVersion": "4"}, "items": [_es("a", "1"), _es("b", "2")]}
        ),
        _Response([{"type": "DELETED", "object": _es("a", "5")}]),
    ]

    def list_things(*args: Any, **kwargs: Any) -> _Response:
        calls.append({"args": args, **kwargs})
        return script[len(calls) - 1]

    source = ApiWatchSource({"EmbeddingService": (list_things, ("ns",))})
    stop = threading.Event()
    events = source("EmbeddingService", stop)
    got = [next(events) for _ in range(4)]
    stop.set()
    # The bookmark moved the version on and is not an event; 410 Gone lists again rather
    # than resuming from a version the API server no longer has.
    assert [(kind, _names(payload)) for kind, payload in got] == [
        ("SYNC", ["a"]),
        ("ADDED", ["b"]),
        ("SYNC", ["a", "b"]),
        ("DELETED", ["a"]),
    ]
    assert all(call["args"] == ("ns",) for call in calls)
    assert calls[1]["watch"] is True and calls[1]["resource_version"] == "1"
    assert calls[3]["resource_version"] == "4"


def _names(payload: Any) -> list[str]:
    items = payload if isinstance(payload, list) else [payload]
    return [item["metadata"]["name"] for item in items]

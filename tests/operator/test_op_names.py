"""Model names are owned (issue 48, H3): the oldest claim of a name owns it, a later claim is
refused on its status (``NamesOwned`` False) with a Warning Event, and the operator decides
exactly as the gateway routes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from embedding_operator.names import NameClaims, Refusal, ReservedNames, claimed_names
from embedding_operator.profiles import GpuProfiles
from embedding_operator.reconcile import Reconciler, owner_ref
from embedding_operator.settings import OperatorSettings

from tests.support.operator import FakeCluster


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str, str]] = []

    def __call__(self, body: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        self.posted.append((body["metadata"]["namespace"], type, reason, message))


def service(
    namespace: str, name: str, created: str, *aliases: str, served: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": f"org/{name}-model"}, "gpu": {"type": "cpu"}}
    if aliases:
        spec["servedModelAliases"] = list(aliases)
    if served:
        spec["servedModelName"] = served
    return {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "generation": 1,
            "creationTimestamp": created,
        },
        "spec": spec,
    }


VICTIM = service(
    "team-a", "search", "2026-01-01T00:00:00Z", "text-embedding-3-small", served="search"
)
THIEF = service("a-thief", "grab", "2026-06-01T00:00:00Z", "search", "text-embedding-3-small")


def claims_of(*bodies: dict[str, Any], reserved: ReservedNames | None = None) -> NameClaims:
    claims = NameClaims(reserved)
    for body in bodies:
        claims.update(body["metadata"]["namespace"], body["metadata"]["name"], body)
    return claims


def test_the_oldest_claim_owns_a_name_whatever_the_namespaces_sort_order() -> None:
    claims = claims_of(THIEF, VICTIM)
    assert claims.refused("team-a", "search") == ()
    assert claims.refused("a-thief", "grab") == (
        Refusal("search", ("team-a", "search")),
        Refusal("text-embedding-3-small", ("team-a", "search")),
    )
    # Deleting the owner hands its names on, and says whom to reconcile again.
    assert claims.update("team-a", "search", None) == {("a-thief", "grab")}
    assert claims.refused("a-thief", "grab") == ()


def test_an_edit_that_adds_or_drops_a_name_names_the_other_claimants() -> None:
    claims = claims_of(VICTIM, service("b", "plain", "2026-02-01T00:00:00Z"))
    edited = service("b", "plain", "2026-02-01T00:00:00Z", "search")
    assert claims.update("b", "plain", edited) == {("team-a", "search")}
    assert claims.refused("b", "plain") == (Refusal("search", ("team-a", "search")),)
    assert claims.update("b", "plain", service("b", "plain", "2026-02-01T00:00:00Z")) == {
        ("team-a", "search")
    }
    assert claims.refused("b", "plain") == ()


def test_a_reserved_name_goes_to_its_namespaces_however_old_the_other_claim() -> None:
    reserved = ReservedNames(["text-embedding-*=search|ml", "bge=ml"])
    squatter = service("squatter", "early", "2025-01-01T00:00:00Z", "text-embedding-3-large")
    owner = service("search", "late", "2026-01-01T00:00:00Z", "text-embedding-3-large")
    claims = claims_of(squatter, owner, reserved=reserved)
    assert claims.refused("search", "late") == ()
    assert claims.refused("squatter", "early") == (
        Refusal("text-embedding-3-large", ("search", "late")),
    )
    alone = claims_of(service("squatter", "sq", "2025-01-01T00:00:00Z", "bge"), reserved=reserved)
    assert alone.refused("squatter", "sq") == (Refusal("bge", None),)
    with pytest.raises(ValueError, match="PATTERN=NAMESPACE"):
        OperatorSettings(reserved_model_names="bge")
    assert OperatorSettings(reserved_model_names="a=x|y,b*=z").reserved_model_names == [
        "a=x|y",
        "b*=z",
    ]


def reconciler(cluster: FakeCluster, events: Events, claims: NameClaims) -> Reconciler:
    clock = iter(f"2026-07-01T00:00:{i:02d}Z" for i in range(60))
    return Reconciler(
        cluster=cluster,
        profiles=GpuProfiles.builtin(),
        default_image="img:1",
        recorder=events,
        clock=lambda: next(clock),
        names=claims,
    )


def names_owned(cluster: FakeCluster, namespace: str, name: str) -> dict[str, Any]:
    body = cluster.objects[owner_ref(namespace, name)]
    return {c["type"]: c for c in body["status"]["conditions"]}["NamesOwned"]


def test_a_later_claim_is_refused_on_its_status_with_a_warning_and_the_owner_is_told_nothing(
    cluster: FakeCluster,
) -> None:
    """The thief's EmbeddingService (newer, in a namespace that sorts first: the old gateway
    gave it the name) is told which names it does not own and whose they are; the victim's
    says it owns all of its names; a Warning Event goes to the thief's namespace only."""
    cluster.add(VICTIM)
    cluster.add(THIEF)
    events = Events()
    claims = claims_of(VICTIM, THIEF)
    rec = reconciler(cluster, events, claims)
    rec.reconcile("team-a", "search")
    rec.reconcile("a-thief", "grab")
    refused = names_owned(cluster, "a-thief", "grab")
    assert refused["status"] == "False" and refused["reason"] == "NameTaken"
    assert "'search' is taken by team-a/search" in refused["message"]
    assert "'text-embedding-3-small' is taken by team-a/search" in refused["message"]
    owned = names_owned(cluster, "team-a", "search")
    assert owned["status"] == "True" and owned["reason"] == "NamesOwned"
    warnings = [e for e in events.posted if e[1] == "Warning"]
    assert [(e[0], e[2]) for e in warnings] == [("a-thief", "NameTaken")]
    assert "taken by team-a/search" in warnings[0][3]
    # The status is written on change only: another reconcile posts nothing more.
    rec.reconcile("a-thief", "grab")
    assert [e for e in events.posted if e[1] == "Warning"] == warnings
    # The owner is deleted: the thief's next reconcile owns the names.
    del cluster.objects[owner_ref("team-a", "search")]
    claims.update("team-a", "search", None)
    rec.reconcile("a-thief", "grab")
    assert names_owned(cluster, "a-thief", "grab")["status"] == "True"


def test_the_operator_and_the_gateway_decide_alike() -> None:
    """The names an object claims and each name's owner are computed twice (the operator's
    image has no server package): every ordering of a few clashing objects, with a
    reservation, gets the same owners from both."""
    from embedding_server.gateway.kubernetes import ReservedNames as GatewayReserved
    from embedding_server.gateway.kubernetes import model_names, name_owners

    bodies = [
        VICTIM,
        THIEF,
        service("team-a", "older", "2026-01-01T00:00:00Z", "shared", "bge"),
        service("team-b", "same-second", "2026-01-01T00:00:00Z", "shared"),
        service("ml", "reserver", "2027-01-01T00:00:00Z", "bge", served="grab"),
    ]
    for body in bodies:
        assert claimed_names(body) == model_names(body)
    body = dict(
        VICTIM,
        metadata={**VICTIM["metadata"], "annotations": {"embedding-operator.dev/aliases": "x, y"}},
    )
    assert claimed_names(body) == model_names(body)
    rules = ["bge=ml"]
    for order in itertools.permutations(bodies):
        claims = claims_of(*order, reserved=ReservedNames(rules))
        gateway = name_owners(
            {
                (b["metadata"]["namespace"], b["metadata"]["name"]): (
                    model_names(b),
                    b["metadata"]["creationTimestamp"],
                )
                for b in order
            },
            GatewayReserved(rules),
        )
        for b in order:
            key = (b["metadata"]["namespace"], b["metadata"]["name"])
            refused = {r.name for r in claims.refused(*key)}
            lost = {n for n in model_names(b) if gateway.get(n) != key}
            assert refused == lost, (key, order)


def test_two_teams_serving_one_model_share_its_default_names_without_a_refusal() -> None:
    """Every service of a model answers to the model's name and its last path component;
    only a name the CR's author wrote (servedModelName, servedModelAliases) is refused when an
    older service holds it (the real node's e2e found every later MiniLM refused)."""
    first = service("team-a", "minilm", "2026-01-01T00:00:00Z", served="minilm-a")
    second = service("team-b", "minilm", "2026-06-01T00:00:00Z", served="minilm-b")
    claims = claims_of(first, second)
    assert "minilm-model" in claimed_names(second), "the default name is still routed"
    assert claims.refused("team-b", "minilm") == ()
    # A written name is another matter.
    taker = service("team-c", "minilm", "2026-07-01T00:00:00Z", served="minilm-a")
    claims.update("team-c", "minilm", taker)
    assert [r.name for r in claims.refused("team-c", "minilm")] == ["minilm-a"]

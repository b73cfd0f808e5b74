"""Model changes never mix two models behind one name: the blue/green rollout, through the
reconciler against an in-memory API (issue 47, item 3)."""

from __future__ import annotations

import json
import typing
from typing import Any

from embedding_operator.bluegreen import Facts, Phase, decide
from embedding_operator.builders.golden import CONTRACT_LABEL, contract_key
from embedding_operator.kube import ObjectRef
from embedding_operator.profiles import GpuProfiles
from embedding_operator.reconcile import Outcome, Reconciler, owner_ref
from embedding_operator.spec import parse_spec

from tests.support.operator import (
    FakeCluster,
    FakeGolden,
    golden_answer,
    rolled_out,
    server_pod,
)

NS = "team"
OLD: dict[str, Any] = {"model": {"name": "sentence-transformers/all-MiniLM-L6-v2"}, "replicas": 2}
# Same dimensions, another computation: no client could tell the vectors apart.
NEW: dict[str, Any] = {**OLD, "embedding": {"pooling": "cls"}}
OLD_KEY, NEW_KEY = contract_key(parse_spec(OLD)), contract_key(parse_spec(NEW))
MAIN = ObjectRef("apps/v1", "Deployment", NS, "emb")
NEXT = ObjectRef("apps/v1", "Deployment", NS, "emb-next")
SERVICE = ObjectRef("v1", "Service", NS, "emb")
CONFIGMAP = ObjectRef("v1", "ConfigMap", NS, "emb-golden")
NEXT_SERVICE = ObjectRef("v1", "Service", NS, "emb-next")


class Events:
    def __call__(self, body: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        pass


def _key_of(cluster: FakeCluster, ref: ObjectRef) -> str:
    return str(cluster.objects[ref]["spec"]["template"]["metadata"]["labels"][CONTRACT_LABEL])


def _pin(cluster: FakeCluster) -> str | None:
    return cluster.objects[SERVICE]["spec"]["selector"].get(CONTRACT_LABEL)


def _status(cluster: FakeCluster) -> dict[str, Any]:
    return dict(cluster.objects[owner_ref(NS, "emb")].get("status") or {})


def _condition(cluster: FakeCluster, kind: str) -> dict[str, Any]:
    return next(c for c in _status(cluster)["conditions"] if c["type"] == kind)


def _serving(spec: dict[str, Any]) -> tuple[FakeCluster, Reconciler, FakeGolden]:
    """A service of ``spec`` rolled out, its golden vectors recorded from its first pod."""
    cluster = FakeCluster()
    cluster.add(
        {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingService",
            "metadata": {"name": "emb", "namespace": NS, "uid": "owner-uid", "generation": 1},
            "spec": spec,
        }
    )
    key = contract_key(parse_spec(spec))
    golden = FakeGolden({"10.0.0.1": golden_answer("01d01d01d01d01d0")})
    rec = Reconciler(
        cluster=cluster,
        profiles=GpuProfiles.builtin(),
        default_image="img:1",
        recorder=Events(),
        golden_fetch=golden,
    )
    rec.reconcile(NS, "emb")
    rolled_out(cluster, MAIN)
    cluster.add(server_pod("emb-a", key=key, ip="10.0.0.1"))
    rec.reconcile(NS, "emb")
    assert _status(cluster)["contract"]["state"] == "Recorded"
    return cluster, rec, golden


def _edit(cluster: FakeCluster, spec: dict[str, Any]) -> None:
    body = cluster.objects[owner_ref(NS, "emb")]
    body["spec"] = spec
    body["metadata"]["generation"] += 1


def test_a_model_change_serves_one_model_at_every_step() -> None:
    cluster, rec, golden = _serving(OLD)
    assert _pin(cluster) == OLD_KEY, "a settled service's Service is pinned to its model"
    assert _status(cluster)["rollout"]["activeFingerprint"] == "01d01d01d01d01d0"

    # 1. The new model starts beside the old one; the Service and <name> stay as they were.
    _edit(cluster, NEW)
    outcome = rec.reconcile(NS, "emb")
    assert isinstance(outcome, Outcome) and outcome.requeue_after == 5.0
    assert _key_of(cluster, MAIN) == OLD_KEY
    assert _pin(cluster) == OLD_KEY
    assert _key_of(cluster, NEXT) == NEW_KEY
    assert cluster.objects[NEXT]["spec"]["replicas"] == 2, "as many replicas as run now"
    assert cluster.objects[NEXT]["metadata"]["ownerReferences"][0]["uid"] == "owner-uid"
    rollout = _status(cluster)["rollout"]
    assert (rollout["phase"], rollout["activeKey"], rollout["pendingKey"]) == (
        "Preparing",
        OLD_KEY,
        NEW_KEY,
    )
    assert rollout["activeFingerprint"] == "01d01d01d01d01d0"
    # The new model is reachable by itself, for a re-embedding job or a try, as ClusterIP.
    next_service = cluster.objects[NEXT_SERVICE]["spec"]
    assert next_service["selector"][CONTRACT_LABEL] == NEW_KEY
    assert next_service["type"] == "ClusterIP"
    progressing = _condition(cluster, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "NewModelStarting")
    assert "emb-next: 0/2 ready" in progressing["message"]
    assert _condition(cluster, "Ready")["status"] == "True", "the old model still serves"

    # 2. Its replicas are ready, but nothing is switched before its golden vectors are taken.
    rolled_out(cluster, NEXT)
    golden.answers["10.0.0.2"] = golden_answer("2ew2ew2ew2ew2ew2")
    rec.reconcile(NS, "emb")  # records from the new model's first ready pod (none yet)
    assert _pin(cluster) == OLD_KEY
    cluster.add(server_pod("emb-next-a", key=NEW_KEY, ip="10.0.0.2"))
    rec.reconcile(NS, "emb")  # records now; the switch waits for the next look
    data = cluster.objects[CONFIGMAP]["data"]
    assert json.loads(data[f"{NEW_KEY}.json"])["fingerprint"] == "2ew2ew2ew2ew2ew2"
    assert f"{OLD_KEY}.json" in data, "the running model's record stays while it serves"
    assert _pin(cluster) == OLD_KEY
    assert _status(cluster)["rollout"]["pendingFingerprint"] == "2ew2ew2ew2ew2ew2"

    # 3. The switch: the Service moves to the new model in one write; <name> follows, all
    # its old pods at once (<name>-next serves at full strength meanwhile).
    rec.reconcile(NS, "emb")
    assert _pin(cluster) == NEW_KEY
    assert _key_of(cluster, MAIN) == NEW_KEY
    assert cluster.objects[MAIN]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": "100%",
    }
    assert NEXT in cluster.objects, "the new model's first replicas serve while <name> rolls"
    assert _status(cluster)["rollout"]["phase"] == "Switching"

    # 4. <name> rolled out on the new model: <name>-next goes, and all is stable.
    rolled_out(cluster, MAIN)
    rec.reconcile(NS, "emb")
    assert NEXT not in cluster.objects and NEXT_SERVICE not in cluster.objects
    rollout = _status(cluster)["rollout"]
    assert (rollout["phase"], rollout["activeKey"]) == ("Stable", NEW_KEY)
    assert rollout["activeFingerprint"] == "2ew2ew2ew2ew2ew2"
    assert _condition(cluster, "Progressing")["reason"] != "NewModelStarting"
    # Back to the spec's own limits for the ordinary updates that follow.
    assert cluster.objects[MAIN]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }


def test_a_change_that_keeps_the_model_is_a_rolling_update() -> None:
    cluster, rec, _ = _serving(OLD)
    _edit(cluster, {**OLD, "replicas": 3, "server": {"maxBatchSize": 16}})
    rec.reconcile(NS, "emb")
    assert NEXT not in cluster.objects
    args = cluster.objects[MAIN]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-batch-size") + 1] == "16"
    assert _pin(cluster) == OLD_KEY
    assert _status(cluster)["rollout"]["phase"] == "Stable"


def test_the_rolling_strategy_changes_the_model_in_place_and_unpins() -> None:
    cluster, rec, _ = _serving(OLD)
    _edit(cluster, {**NEW, "rollout": {"strategy": "rolling"}})
    rec.reconcile(NS, "emb")
    assert NEXT not in cluster.objects
    assert _key_of(cluster, MAIN) == NEW_KEY
    assert _pin(cluster) is None, "rolling: the Service selects both models while it rolls"


def test_a_reverted_change_deletes_the_new_model_and_leaves_the_old_untouched() -> None:
    cluster, rec, _ = _serving(OLD)
    _edit(cluster, NEW)
    rec.reconcile(NS, "emb")
    assert NEXT in cluster.objects
    generation = cluster.objects[MAIN]["metadata"]["generation"]
    _edit(cluster, OLD)
    rec.reconcile(NS, "emb")
    assert NEXT not in cluster.objects
    assert cluster.objects[MAIN]["metadata"]["generation"] == generation
    assert _pin(cluster) == OLD_KEY


def test_an_operator_restarted_midway_carries_on_from_what_the_cluster_shows() -> None:
    cluster, rec, golden = _serving(OLD)
    _edit(cluster, NEW)
    rec.reconcile(NS, "emb")
    rolled_out(cluster, NEXT)
    golden.answers["10.0.0.2"] = golden_answer("2ew2ew2ew2ew2ew2")
    cluster.add(server_pod("emb-next-a", key=NEW_KEY, ip="10.0.0.2"))
    fresh = Reconciler(
        cluster=cluster,
        profiles=GpuProfiles.builtin(),
        default_image="img:1",
        recorder=Events(),
        golden_fetch=golden,
    )
    fresh.reconcile(NS, "emb")
    fresh.reconcile(NS, "emb")
    assert _pin(cluster) == NEW_KEY


def test_a_service_from_before_the_pin_rolls_in_place_once_then_pins() -> None:
    """Pods created by an operator without the contract label cannot be told apart: pinning
    the Service to a label they lack would leave it without endpoints."""
    cluster, rec, _ = _serving(OLD)
    template = cluster.objects[MAIN]["spec"]["template"]["metadata"]["labels"]
    del template[CONTRACT_LABEL]
    del cluster.objects[SERVICE]["spec"]["selector"][CONTRACT_LABEL]
    _edit(cluster, NEW)
    rec.reconcile(NS, "emb")
    assert NEXT not in cluster.objects
    assert _key_of(cluster, MAIN) == NEW_KEY
    assert _pin(cluster) is None
    assert "predate the contract label" in _status(cluster)["rollout"]["message"]
    rolled_out(cluster, MAIN)
    rec.reconcile(NS, "emb")
    assert _pin(cluster) == NEW_KEY


def _facts(**changes: Any) -> Facts:
    base: dict[str, Any] = {
        "strategy": "blueGreen",
        "spec_key": "new",
        "main_exists": True,
        "main_key": "old",
        "main_settled": True,
        "main_replicas": 2,
        "pinned": "old",
        "next_exists": False,
        "next_key": None,
        "next_settled": False,
        "recorded": False,
    }
    return Facts(**{**base, **changes})


def test_the_decision_table() -> None:
    assert decide(_facts()).phase == "Preparing"
    assert decide(_facts(next_exists=True, next_key="new", next_settled=True)).phase == (
        "Preparing"
    ), "ready but not recorded"
    switching = decide(_facts(next_exists=True, next_key="new", next_settled=True, recorded=True))
    assert (switching.phase, switching.pin, switching.apply_main) == ("Switching", "new", True)
    # Scaled to zero: nothing serves, so nothing can mix.
    at_zero = decide(_facts(main_replicas=0))
    assert (at_zero.phase, at_zero.pin, at_zero.apply_main) == ("Stable", "new", True)
    # Unpinned but settled: every pod carries the label, so the pin can go on first.
    assert decide(_facts(pinned=None)).pin == "old"
    # Unpinned and mid-roll: not isolated, in place.
    assert decide(_facts(pinned=None, main_settled=False)).pin is None


def test_manual_keeps_both_models_until_the_new_fingerprint_is_set_active() -> None:
    manual = {**OLD, "rollout": {"strategy": "manual"}}
    cluster, rec, golden = _serving(manual)
    _edit(cluster, {**NEW, "rollout": {"strategy": "manual"}})
    rec.reconcile(NS, "emb")
    rolled_out(cluster, NEXT)
    golden.answers["10.0.0.2"] = golden_answer("2ee2ee2ee2ee2ee2")
    cluster.add(server_pod("emb-next-a", key=NEW_KEY, ip="10.0.0.2"))
    rec.reconcile(NS, "emb")
    outcome = rec.reconcile(NS, "emb")
    # Ready and recorded, but manual: both served, the Service still on the old model.
    assert _pin(cluster) == OLD_KEY and _key_of(cluster, MAIN) == OLD_KEY
    assert cluster.objects[NEXT_SERVICE]["spec"]["selector"][CONTRACT_LABEL] == NEW_KEY
    rollout = _status(cluster)["rollout"]
    assert rollout["phase"] == "Prepared"
    assert rollout["pendingFingerprint"] == "2ee2ee2ee2ee2ee2"
    progressing = _condition(cluster, "Progressing")
    assert progressing["reason"] == "NewModelAwaitingCutOver"
    assert "spec.rollout.activeFingerprint to 2ee2ee2ee2ee2ee2" in progressing["message"]
    assert isinstance(outcome, Outcome) and outcome.requeue_after is None, (
        "waiting on a person: the edit wakes it, no polling"
    )
    # A fingerprint that is not the new model's changes nothing.
    _edit(cluster, {**NEW, "rollout": {"strategy": "manual", "activeFingerprint": "deadbeef"}})
    rec.reconcile(NS, "emb")
    assert _pin(cluster) == OLD_KEY
    # The cut-over, by a prefix of the new fingerprint.
    _edit(cluster, {**NEW, "rollout": {"strategy": "manual", "activeFingerprint": "2ee2ee2e"}})
    rec.reconcile(NS, "emb")
    assert _pin(cluster) == NEW_KEY and _key_of(cluster, MAIN) == NEW_KEY
    rolled_out(cluster, MAIN)
    rec.reconcile(NS, "emb")
    assert NEXT not in cluster.objects and NEXT_SERVICE not in cluster.objects
    assert _status(cluster)["rollout"]["phase"] == "Stable"


def _slice_of(service: dict[str, Any], address: str) -> dict[str, Any]:
    """The EndpointSlice Kubernetes' endpoint-slice controller writes for ``service`` (one
    ready pod at ``address``)."""
    name = service["metadata"]["name"]
    return {
        "metadata": {
            "namespace": NS,
            "name": f"{name}-abc12",
            "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Service", "name": name, "controller": True}
            ],
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [address], "targetRef": {"kind": "Pod", "name": "p"}}],
    }


def test_the_gateway_routes_each_version_the_operator_reports_to_its_own_service() -> None:
    """Contract (the operator's image has no server package, so the gateway reads the
    status by its own code): during a manual change the gateway, fed the EmbeddingService
    and the slices of the Services the operator made, routes ``<name>@<active>`` to the
    Service ``<name>`` and ``<name>@<pending>`` to ``<name>-next``; after the cut-over only the
    new version is left, on ``<name>``."""
    from embedding_operator.builders.deployment import NEXT_SERVICE_SUFFIX
    from embedding_server.gateway.kubernetes import NEXT_SERVICE_SUFFIX as GATEWAY_SUFFIX
    from embedding_server.gateway.kubernetes import PREPARING_PHASES, ClusterState

    assert GATEWAY_SUFFIX == NEXT_SERVICE_SUFFIX
    # The phases in which <name>-next serves a model the Service does not.
    assert set(typing.get_args(Phase)) - {"Stable", "Switching"} == PREPARING_PHASES
    old, new = "01d01d01d01d01d0", "fedcba9876543210"
    manual = {**OLD, "rollout": {"strategy": "manual"}}
    cluster, rec, golden = _serving(manual)
    _edit(cluster, {**NEW, "rollout": {"strategy": "manual"}})
    rec.reconcile(NS, "emb")
    rolled_out(cluster, NEXT)
    golden.answers["10.0.0.2"] = golden_answer(new)
    cluster.add(server_pod("emb-next-a", key=NEW_KEY, ip="10.0.0.2"))
    rec.reconcile(NS, "emb")
    rec.reconcile(NS, "emb")
    assert _status(cluster)["rollout"]["phase"] == "Prepared"

    def routes() -> dict[str, frozenset[str]]:
        state = ClusterState()
        state.apply("EmbeddingService", "SYNC", [cluster.objects[owner_ref(NS, "emb")]])
        services = [SERVICE, NEXT_SERVICE] if NEXT_SERVICE in cluster.objects else [SERVICE]
        slices = [
            _slice_of(cluster.objects[ref], address)
            for ref, address in zip(services, ("10.0.0.1", "10.0.0.2"), strict=False)
        ]
        state.apply("EndpointSlice", "SYNC", slices)
        return {s.name: s.endpoints for s in state.catalog()}

    main, upcoming = frozenset({"http://10.0.0.1:8000"}), frozenset({"http://10.0.0.2:8000"})
    assert routes() == {
        "all-MiniLM-L6-v2": main,
        f"all-MiniLM-L6-v2@{old}": main,
        f"all-MiniLM-L6-v2@{new}": upcoming,
    }
    _edit(cluster, {**NEW, "rollout": {"strategy": "manual", "activeFingerprint": new[:8]}})
    rec.reconcile(NS, "emb")
    rolled_out(cluster, MAIN)
    rec.reconcile(NS, "emb")
    assert routes() == {"all-MiniLM-L6-v2": main, f"all-MiniLM-L6-v2@{new}": main}


def test_active_fingerprint_needs_manual() -> None:
    import pytest
    from embedding_operator.spec import InvalidSpecError

    with pytest.raises(InvalidSpecError, match="activeFingerprint needs strategy manual"):
        parse_spec({**OLD, "rollout": {"activeFingerprint": "0123abcd"}})
    with pytest.raises(InvalidSpecError, match="activeFingerprint"):
        parse_spec({**OLD, "rollout": {"strategy": "manual", "activeFingerprint": "xyz"}})


def test_with_golden_vectors_disabled_the_switch_waits_on_readiness_alone() -> None:
    off = {"contract": {"policy": "disabled"}}
    cluster = FakeCluster()
    cluster.add(
        {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingService",
            "metadata": {"name": "emb", "namespace": NS, "uid": "owner-uid", "generation": 1},
            "spec": {**OLD, **off},
        }
    )
    rec = Reconciler(
        cluster=cluster,
        profiles=GpuProfiles.builtin(),
        default_image="img:1",
        recorder=Events(),
        golden_fetch=FakeGolden(),
    )
    rec.reconcile(NS, "emb")
    rolled_out(cluster, MAIN)
    rec.reconcile(NS, "emb")
    _edit(cluster, {**NEW, **off})
    rec.reconcile(NS, "emb")
    assert _pin(cluster) == OLD_KEY and NEXT in cluster.objects
    rolled_out(cluster, NEXT)
    rec.reconcile(NS, "emb")
    assert _pin(cluster) == NEW_KEY


def test_the_hpa_cannot_scale_the_running_model_down_while_the_new_one_prepares() -> None:
    """The HPA's Pods metric is averaged over the Deployment's selector, which the new model's
    idle pods match too: it would read half the load. Its floor holds at the running count."""
    auto = {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6}}
    old, new = {**OLD, **auto}, {**NEW, **auto}
    cluster, rec, _ = _serving(old)
    hpa = ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", NS, "emb")
    cluster.objects[MAIN]["spec"]["replicas"] = 3  # where the HPA had it
    rolled_out(cluster, MAIN)
    rec.reconcile(NS, "emb")
    assert cluster.objects[hpa]["spec"]["minReplicas"] == 1
    _edit(cluster, new)
    rec.reconcile(NS, "emb")
    assert cluster.objects[hpa]["spec"]["minReplicas"] == 3
    assert cluster.objects[NEXT]["spec"]["replicas"] == 3

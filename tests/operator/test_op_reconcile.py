"""Reconciliation against an in-memory API: converge, stay quiet, correct drift, report."""

from __future__ import annotations

from typing import Any

import pytest
from embedding_operator.builders.common import AutoscalingDefaults
from embedding_operator.builders.golden import contract_key
from embedding_operator.kube import ApiError, ObjectRef
from embedding_operator.profiles import GpuProfiles
from embedding_operator.reconcile import Reconciler, owner_ref
from embedding_operator.spec import parse_spec
from embedding_operator.versions import WatchedPods, WatchedVersions

from tests.support.operator import (
    FakeCluster,
    FakeGolden,
    golden_answer,
    golden_record,
    rolled_out,
    server_pod,
)

NS = "team"


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def __call__(self, body: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        self.posted.append((type, reason, message))


def make(
    cluster: FakeCluster,
    events: Events | None = None,
    times: list[str] | None = None,
    **options: Any,
) -> Reconciler:
    clock = iter(times or [f"2025-01-01T00:00:{i:02d}Z" for i in range(60)])
    return reconciler(cluster, events, clock=lambda: next(clock), **options)


def make_with_keda(cluster: FakeCluster, events: Events) -> Reconciler:
    """``make`` with KEDA as the platform's autoscaler and ten minutes of clock ticks."""
    times = [f"2025-01-01T00:{i // 60:02d}:{i % 60:02d}Z" for i in range(600)]
    return make(
        cluster, events, times, autoscaling=AutoscalingDefaults("keda", "http://prometheus:9090")
    )


def reconciler(cluster: FakeCluster, events: Events | None = None, **options: Any) -> Reconciler:
    """A Reconciler with the built-in GPU profiles, image img:1 and ``events`` (else a fresh
    Events) as its recorder; ``options`` as given (the real clock unless one is)."""
    return Reconciler(
        cluster=cluster,
        profiles=GpuProfiles.builtin(),
        default_image="img:1",
        recorder=events or Events(),
        **options,
    )


def add_service(cluster: FakeCluster, spec: dict[str, Any], name: str = "emb") -> None:
    cluster.add(
        {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingService",
            "metadata": {"name": name, "namespace": NS, "uid": "owner-uid", "generation": 1},
            "spec": spec,
        }
    )


def dep_ref(name: str = "emb") -> ObjectRef:
    return ObjectRef("apps/v1", "Deployment", NS, name)


def owner(cluster: FakeCluster, name: str = "emb") -> dict[str, Any]:
    return cluster.objects[owner_ref(NS, name)]


def conditions(cluster: FakeCluster) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in owner(cluster)["status"]["conditions"]}


def mark_rolled_out(cluster: FakeCluster, ready: int | None = None) -> None:
    """What kube-controller-manager does once pods are ready."""
    rolled_out(cluster, dep_ref(), ready)


MODEL = {"model": {"name": "BAAI/bge-small-en-v1.5"}, "gpu": {"type": "h100"}}


def test_converges_then_goes_quiet(cluster: FakeCluster) -> None:
    add_service(cluster, MODEL)
    events = Events()
    rec = make(cluster, events)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert {c[1] for c in cluster.writes() if c[0] == "apply"} == {"Deployment", "Service"}
    cond = conditions(cluster)
    assert cond["Ready"]["status"] == "False" and cond["Progressing"]["status"] == "True"
    status = owner(cluster)["status"]
    assert status["endpoint"] == "http://emb.team.svc.cluster.local:80/v1"
    assert status["selector"] == (
        "app.kubernetes.io/instance=emb,app.kubernetes.io/name=embedding-server"
    )
    assert status["model"] == {
        "name": "BAAI/bge-small-en-v1.5",
        "servedModelName": "bge-small-en-v1.5",
    }
    assert status["gpu"] == {"type": "h100", "resourceName": "nvidia.com/gpu", "count": 1}

    mark_rolled_out(cluster)
    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert cluster.writes() == [("status", "EmbeddingService")]
    cond = conditions(cluster)
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("True", "Available")
    assert cond["Ready"]["observedGeneration"] == 1
    assert cond["Progressing"]["status"] == "False"
    assert cond["Degraded"]["status"] == "False"
    assert ("Normal", "Available", "1/1 replicas ready") in events.posted

    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert cluster.writes() == [], "an unchanged object must cost no writes"


def _reads_writes(cluster: FakeCluster) -> tuple[int, int]:
    reads = sum(1 for verb, _ in cluster.calls if verb == "get")
    return reads, len(cluster.calls) - reads


def test_api_calls_per_reconcile(cluster: FakeCluster) -> None:
    """What each reconcile costs the API server, counted exactly, so that a change that adds a
    read or a write to every reconcile (x 1,000 services, x every pod event) fails here
    before it halves the operator's throughput at scale (bench.operator_scale prints the
    same counts from a real run's /metrics)."""
    add_service(cluster, MODEL)
    golden = FakeGolden({"10.0.0.1": golden_answer()})
    rec = make(cluster, golden_fetch=golden)
    # New (generation 1, no status yet): the owner, its 2 children, the golden record, the
    # pods (not ready yet, listed once for both steps that look at them); 2 applies and the
    # first status. Nothing to look for that it must not have.
    rec.reconcile(NS, "emb")
    assert _reads_writes(cluster) == (5, 3)
    # Rolling out, woken by a pod event: an unchanged status is not written.
    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert _reads_writes(cluster) == (5, 0)
    # Rolled out: the first ready pod's golden vectors are recorded (one pod list, one
    # write), and Ready is written once.
    mark_rolled_out(cluster)
    key = contract_key(parse_spec(MODEL))
    cluster.add(server_pod("emb-abc", key=key, ip="10.0.0.1"))
    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert _reads_writes(cluster) == (5, 2)
    # Converged: four reads (the record's included), no write, no pod list, no pod asked.
    cluster.calls.clear()
    golden.asked.clear()
    rec.reconcile(NS, "emb")
    assert _reads_writes(cluster) == (4, 0)
    assert cluster.calls == [
        ("get", "EmbeddingService"),
        ("get", "ConfigMap"),
        ("get", "Deployment"),
        ("get", "Service"),
    ]
    assert golden.asked == []
    # A fresh operator (a restart, a failover) checks once that the five children this spec
    # does not want (PVC, HPA, ScaledObject, PDB, NetworkPolicy) are gone, and looks for a
    # model change's <name>-next (Deployment and Service) left behind: the object has a
    # status, so an earlier reconcile may have created them for an earlier spec.
    cluster.calls.clear()
    make(cluster, golden_fetch=golden).reconcile(NS, "emb")
    assert _reads_writes(cluster) == (4 + 5 + 2, 0)


def test_an_unwanted_child_left_by_an_earlier_spec_is_deleted_by_a_fresh_operator(
    cluster: FakeCluster,
) -> None:
    """Skipping the absent-children check on a new object must not skip it on one whose spec
    changed while no operator ran."""
    add_service(cluster, {**MODEL, "autoscaling": {"enabled": True, "maxReplicas": 3}})
    make(cluster).reconcile(NS, "emb")
    hpa = ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", NS, "emb")
    assert hpa in cluster.objects
    # The spec is edited while no operator runs; a new one starts.
    owner(cluster)["spec"] = dict(MODEL)
    owner(cluster)["metadata"]["generation"] = 2
    make(cluster).reconcile(NS, "emb")
    assert hpa not in cluster.objects


def _watch_delivers(cluster: FakeCluster, versions: WatchedVersions) -> None:
    """What kopf's watches report: every object's current resourceVersion."""
    for ref, obj in cluster.objects.items():
        version = obj["metadata"]["resourceVersion"]
        if ref.kind == "EmbeddingService":
            versions.owner_event(ref.namespace, ref.name, version)
            continue
        controller = next(
            (o for o in obj["metadata"].get("ownerReferences") or [] if o.get("controller")), None
        )
        if controller is not None and controller["kind"] == "EmbeddingService":
            versions.child_event(ref.namespace, controller["name"], ref.kind, ref.name, version)


def test_resync_of_a_settled_unchanged_object_costs_no_api_call(cluster: FakeCluster) -> None:
    """At 10k EmbeddingServices a resync must not re-read every object every minute: an object
    that is settled and that no watch event has touched since it was verified is skipped."""
    add_service(cluster, {**MODEL, "replicas": 2})
    versions = WatchedVersions()
    now = [0.0]
    rec = reconciler(cluster, versions=versions, full_resync_seconds=600, monotonic=lambda: now[0])
    rec.reconcile(NS, "emb")
    _watch_delivers(cluster, versions)
    # Rolling out: not settled, read every time.
    cluster.calls.clear()
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and not outcome.skipped and cluster.calls
    mark_rolled_out(cluster)
    _watch_delivers(cluster, versions)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and not outcome.skipped
    assert conditions(cluster)["Ready"]["status"] == "True"
    _watch_delivers(cluster, versions)  # our own status write comes back through the watch

    cluster.calls.clear()
    for _ in range(3):
        outcome = rec.reconcile(NS, "emb")
        assert outcome is not None and outcome.skipped
    assert cluster.calls == [], "a settled, unchanged object costs no API call"

    # Someone edits the Service: its watch event carries a new version; read and corrected.
    svc = cluster.objects[ObjectRef("v1", "Service", NS, "emb")]
    svc["spec"]["ports"][0]["port"] = 9999
    svc["metadata"]["resourceVersion"] += "+edit"
    _watch_delivers(cluster, versions)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and not outcome.skipped and outcome.applied == ("Service",)
    _watch_delivers(cluster, versions)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.skipped

    # A deleted child: the watch reports the deletion; the child comes back.
    del cluster.objects[ObjectRef("policy/v1", "PodDisruptionBudget", NS, "emb")]
    versions.child_event(NS, "emb", "PodDisruptionBudget", "emb", None)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.applied == ("PodDisruptionBudget",)
    _watch_delivers(cluster, versions)

    # A missed event is caught by the periodic full re-read.
    cluster.objects[ObjectRef("v1", "Service", NS, "emb")]["spec"]["ports"][0]["port"] = 1
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.skipped
    now[0] = 601
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and not outcome.skipped and outcome.applied == ("Service",)


def test_unsettled_objects_are_read_on_every_resync(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "gpu": {"type": "tpu"}})
    versions = WatchedVersions()
    rec = reconciler(cluster, versions=versions)
    for _ in range(2):
        _watch_delivers(cluster, versions)
        cluster.calls.clear()
        outcome = rec.reconcile(NS, "emb")
        assert outcome is not None and outcome.problem is not None and not outcome.skipped
        assert ("get", "EmbeddingService") in cluster.calls


def test_last_transition_time_moves_only_on_flip(cluster: FakeCluster) -> None:
    add_service(cluster, MODEL)
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    first = conditions(cluster)["Degraded"]["lastTransitionTime"]
    owner(cluster)["metadata"]["generation"] = 2  # e.g. an edit that changes no child
    rec.reconcile(NS, "emb")
    assert conditions(cluster)["Degraded"]["lastTransitionTime"] == first
    assert conditions(cluster)["Degraded"]["observedGeneration"] == 2
    assert owner(cluster)["status"]["observedGeneration"] == 2


def test_drift_is_corrected(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "replicas": 2})
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    mark_rolled_out(cluster)
    rec.reconcile(NS, "emb")
    # Someone scales the Deployment by hand and changes the image; we own both fields.
    dep = cluster.objects[dep_ref()]
    dep["spec"]["replicas"] = 5
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    # A field the API server defaulted is not ours: it must not look like drift.
    dep["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/x"
    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert ("apply", "Deployment") in cluster.writes()
    dep = cluster.objects[dep_ref()]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    # A deleted Service comes back.
    del cluster.objects[ObjectRef("v1", "Service", NS, "emb")]
    rec.reconcile(NS, "emb")
    assert ObjectRef("v1", "Service", NS, "emb") in cluster.objects


def test_spec_change_rolls_out_and_switches_children(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "replicas": 1})
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    hpa = ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", NS, "emb")
    pdb = ObjectRef("policy/v1", "PodDisruptionBudget", NS, "emb")
    assert hpa not in cluster.objects and pdb not in cluster.objects

    body = owner(cluster)
    body["spec"] = {**MODEL, "autoscaling": {"enabled": True, "maxReplicas": 3}}
    body["metadata"]["generation"] = 2
    rec.reconcile(NS, "emb")
    assert hpa in cluster.objects and pdb in cluster.objects
    # The HPA now owns the replica count: the Deployment's rendered spec no longer has one
    # (and, still matching, the Deployment is not rewritten just for that).
    assert cluster.objects[hpa]["spec"]["maxReplicas"] == 3

    # A change that keeps the model (bluegreen.py has the others) is a rolling update.
    body["spec"] = {**MODEL, "replicas": 1, "server": {"maxBatchSize": 16}}
    body["metadata"]["generation"] = 3
    rec.reconcile(NS, "emb")
    assert hpa not in cluster.objects and pdb not in cluster.objects
    args = cluster.objects[dep_ref()]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-batch-size") + 1] == "16"
    cond = conditions(cluster)
    assert cond["Ready"]["reason"] == "RolloutInProgress"
    assert cond["Ready"]["observedGeneration"] == 3


def test_unknown_gpu_type_is_degraded_with_event(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "gpu": {"type": "tpu-v5"}})
    events = Events()
    rec = make(cluster, events)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None and not outcome.retry
    assert [c for c in cluster.writes() if c[0] == "apply"] == []
    cond = conditions(cluster)
    assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("True", "UnknownGPUType")
    assert "spec.gpu.type" in cond["Degraded"]["message"]
    assert "tpu-v5" in cond["Degraded"]["message"] and "h100" in cond["Degraded"]["message"]
    assert cond["Ready"]["status"] == "False"
    assert [e[:2] for e in events.posted] == [("Warning", "UnknownGPUType")]
    # Stuck in the same state: no more events, no more writes.
    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert cluster.writes() == [] and len(events.posted) == 1


def _pod(name: str, waiting: dict[str, str] | None) -> dict[str, Any]:
    state = {"waiting": waiting} if waiting else {"running": {}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "app.kubernetes.io/name": "embedding-server",
                "app.kubernetes.io/instance": "emb",
            },
        },
        "status": {"containerStatuses": [{"name": "embedding-server", "state": state}]},
    }


def test_missing_secret_is_reported_from_the_pod_never_read(cluster: FakeCluster) -> None:
    """The operator never GETs a Secret: the kubelet's CreateContainerConfigError on our pod
    says which one is missing, and the condition names the spec field that references it."""
    add_service(cluster, {**MODEL, "apiKeySecretRef": {"name": "auth"}})
    events = Events()
    rec = make(cluster, events)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert dep_ref() in cluster.objects, "the Deployment is created; its pods wait for the Secret"

    waiting = {
        "reason": "CreateContainerConfigError",
        "message": 'secret "auth" not found',
    }
    cluster.add(_pod("emb-abc", waiting))
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.retry
    cond = conditions(cluster)
    assert cond["Degraded"]["reason"] == "SecretNotFound"
    missing_secret = cond["Degraded"]["message"]
    assert missing_secret.startswith("spec.apiKeySecretRef: ")
    assert "'auth'" in missing_secret and "'api-key'" in missing_secret
    assert "emb-abc" in missing_secret
    assert ("Warning", "SecretNotFound") in [e[:2] for e in events.posted]

    # Status never tells a CR author which Secrets exist: a Secret that exists without the
    # key reads exactly like one that does not exist.
    waiting["message"] = "couldn't find key api-key in Secret team/auth"
    cluster.add(_pod("emb-abc", waiting))
    rec.reconcile(NS, "emb")
    assert conditions(cluster)["Degraded"]["message"] == missing_secret

    # The Secret appears; the kubelet starts the container and the pod becomes ready.
    cluster.add(_pod("emb-abc", None))
    mark_rolled_out(cluster)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert conditions(cluster)["Ready"]["status"] == "True"
    assert not [c for c in cluster.calls if c[1] == "Secret"], "Secrets are never read"

    # A ready Deployment whose golden vectors are recorded costs no pod list.
    cluster.add(golden_record(contract_key(parse_spec(owner(cluster)["spec"])), golden_answer()))
    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert ("get", "Pod") not in cluster.calls


def test_pods_come_from_the_pod_watch_without_a_list(cluster: FakeCluster) -> None:
    """With the operator's pod watch feeding ``WatchedPods``, a rolling-out service's
    reconcile reads its pods from there: the same SecretNotFound, and no LIST at all."""
    add_service(cluster, {**MODEL, "apiKeySecretRef": {"name": "auth"}})
    watched = WatchedPods()
    rec = reconciler(cluster, pods=watched)
    rec.reconcile(NS, "emb")
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "auth" not found'}
    watched.pod_event(NS, "emb", _pod("emb-abc", waiting), deleted=False)
    watched.pod_event(NS, "other", _pod("other-abc", None), deleted=False)
    cluster.calls.clear()
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.retry
    assert conditions(cluster)["Degraded"]["reason"] == "SecretNotFound"
    assert "emb-abc" in conditions(cluster)["Degraded"]["message"]
    assert ("get", "Pod") not in cluster.calls
    # The pod is replaced by one that starts: the deletion is seen, the Secret is no longer
    # reported.
    watched.pod_event(NS, "emb", _pod("emb-abc", waiting), deleted=True)
    watched.pod_event(NS, "emb", _pod("emb-def", None), deleted=False)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert [p["metadata"]["name"] for p in watched.pods(NS, "emb")] == ["emb-def"]


def test_secret_in_server_env_and_other_config_errors(cluster: FakeCluster) -> None:
    env = [
        {
            "name": "EMBEDDING_SERVER_REVISION",
            "valueFrom": {"secretKeyRef": {"name": "xs", "key": "k"}},
        }
    ]
    add_service(cluster, {**MODEL, "server": {"env": env}})
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    msg = "couldn't find key k in Secret team/xs"
    cluster.add(_pod("p1", {"reason": "CreateContainerConfigError", "message": msg}))
    rec.reconcile(NS, "emb")
    message = conditions(cluster)["Degraded"]["message"]
    assert message.startswith("spec.server.env[0]: ") and "'xs'" in message and "'k'" in message
    assert "couldn't find" not in message and "not found" not in message

    msg = 'configmap "cm" not found'
    cluster.add(_pod("p1", {"reason": "CreateContainerConfigError", "message": msg}))
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    assert outcome.problem.reason == "ContainerConfigError" and msg in outcome.problem.message

    # Other waiting reasons (image pulls, crash loops) are the Deployment's story, not ours.
    cluster.add(_pod("p1", {"reason": "ContainerCreating", "message": ""}))
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None


def test_image_outside_the_allowlist_applies_nothing(cluster: FakeCluster) -> None:
    from embedding_operator.policy import WorkloadPolicy

    add_service(cluster, {**MODEL, "server": {"image": "me/srv:1"}})
    events = Events()
    rec = reconciler(cluster, events, policy=WorkloadPolicy(allowed_images=("corp/*",)))
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None and not outcome.retry
    assert cluster.writes() == [("status", "EmbeddingService")]
    assert conditions(cluster)["Degraded"]["reason"] == "ImageNotAllowed"
    assert [e[:2] for e in events.posted] == [("Warning", "ImageNotAllowed")]

    owner(cluster)["spec"]["server"]["image"] = "corp/srv:1"
    owner(cluster)["metadata"]["generation"] = 2
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert dep_ref() in cluster.objects


def test_invalid_spec_names_the_field(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "rollout": {"maxSurge": 0, "maxUnavailable": "0%"}})
    rec = make(cluster)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    cond = conditions(cluster)["Degraded"]
    assert cond["reason"] == "InvalidSpec"
    assert cond["message"].startswith("spec.rollout:")


def test_child_owned_by_someone_else_is_not_taken_over(cluster: FakeCluster) -> None:
    add_service(cluster, MODEL)
    cluster.add(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "emb",
                "namespace": NS,
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": "x",
                        "uid": "other",
                        "controller": True,
                    }
                ],
            },
            "spec": {"ports": [{"port": 1}]},
        }
    )
    rec = make(cluster)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    degraded = conditions(cluster)["Degraded"]
    assert degraded["reason"] == "ChildConflict"
    assert (
        "Service team/emb already exists and is controlled by Deployment x" in (degraded["message"])
    )
    svc = cluster.objects[ObjectRef("v1", "Service", NS, "emb")]
    assert svc["spec"] == {"ports": [{"port": 1}]}
    # Nothing at all is created while the conflict stands: no Deployment without its Service.
    assert cluster.writes() == [("status", "EmbeddingService")]


# A spec that wants every kind of child, and for each kind the name it would take.
ALL_CHILDREN = {
    **MODEL,
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3},
    "modelCache": {"mode": "pvc", "size": "10Gi"},
}
FOREIGN = [
    ("apps/v1", "Deployment", "emb"),
    ("v1", "Service", "emb"),
    ("autoscaling/v2", "HorizontalPodAutoscaler", "emb"),
    ("policy/v1", "PodDisruptionBudget", "emb"),
    ("v1", "PersistentVolumeClaim", "emb-model-cache"),
]


@pytest.mark.parametrize(("api_version", "kind", "name"), FOREIGN, ids=[f[1] for f in FOREIGN])
def test_unowned_namesake_is_a_conflict_never_adopted(
    cluster: FakeCluster, api_version: str, kind: str, name: str
) -> None:
    """An object with a child's name but no controller reference (a team's own ``postgres``
    Service) is reported, never written: server-side apply with force would adopt it, and
    garbage collection would then delete it with the EmbeddingService."""
    add_service(cluster, ALL_CHILDREN)
    theirs = cluster.add(
        {
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {"name": name, "namespace": NS, "labels": {"team": "theirs"}},
            "spec": {"theirs": True},
        }
    )
    events = Events()
    rec = make(cluster, events)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    assert outcome.problem.reason == "ChildConflict"
    assert cluster.objects[ObjectRef(api_version, kind, NS, name)] == theirs
    assert cluster.writes() == [("status", "EmbeddingService")]
    cond = conditions(cluster)
    assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("True", "ChildConflict")
    assert cond["Ready"]["status"] == "False"
    named = f"{kind} {NS}/{name} already exists and has no controller ownerReference"
    assert named in cond["Degraded"]["message"]
    assert [e for e in events.posted if e[:2] == ("Warning", "ChildConflict")]
    assert named in events.posted[-1][2]

    # Steady while it stands: no writes, no repeated Event.
    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert cluster.writes() == []
    assert len(events.posted) == 1

    # The owner of the namesake removes it: the next reconcile creates every child.
    del cluster.objects[ObjectRef(api_version, kind, NS, name)]
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert {c[1] for c in cluster.writes() if c[0] == "apply"} == {f[1] for f in FOREIGN}
    assert conditions(cluster)["Degraded"]["status"] == "False"


class RacingCluster(FakeCluster):
    """An API where, right after the operator's GET of the child ``ref``, someone else
    creates (or replaces) the object of that name: the gap between the adoption check and
    the write."""

    def __init__(self, ref: ObjectRef, foreign: dict[str, Any]) -> None:
        super().__init__()
        self.ref, self.foreign = ref, foreign
        self.armed = False
        self.raced = False

    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        found = super().get(ref)
        if ref == self.ref and not self.raced and self.armed:
            self.raced = True
            self.objects.pop(ref, None)
            self.add(self.foreign)
        return found


def _foreign_service() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "emb", "namespace": NS, "labels": {"team": "theirs"}},
        "spec": {"type": "ClusterIP", "selector": {"app": "theirs"}, "ports": [{"port": 5432}]},
    }


def test_a_namesake_created_after_the_check_is_not_adopted() -> None:
    """The name was free when read, and taken before the write: the write creates only,
    so the foreign object keeps its fields and gets no ownerReference (garbage collection
    would delete it with the EmbeddingService)."""
    service = ObjectRef("v1", "Service", NS, "emb")
    cluster = RacingCluster(service, _foreign_service())
    cluster.armed = True
    add_service(cluster, MODEL)
    outcome = make(cluster).reconcile(NS, "emb")
    assert cluster.raced
    theirs = cluster.objects[service]
    assert "ownerReferences" not in theirs["metadata"], theirs
    assert theirs["spec"] == _foreign_service()["spec"]
    assert outcome is not None and outcome.problem is not None
    assert outcome.problem.reason == "ChildConflict"
    assert "Service team/emb already exists" in outcome.problem.message


def test_a_child_replaced_after_the_check_is_not_written() -> None:
    """Our Service was ours when read, and replaced by someone else's of the same name
    before the write: the write is for the object that was checked (its uid), so the new
    one is left as it is."""
    service = ObjectRef("v1", "Service", NS, "emb")
    cluster = RacingCluster(service, _foreign_service())
    add_service(cluster, MODEL)
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    cluster.objects[service]["spec"]["ports"][0]["port"] = 9999  # drift: the next one writes
    cluster.armed = True
    outcome = rec.reconcile(NS, "emb")
    assert cluster.raced
    theirs = cluster.objects[service]
    assert "ownerReferences" not in theirs["metadata"], theirs
    assert theirs["spec"] == _foreign_service()["spec"]
    assert outcome is not None and outcome.problem is not None
    assert outcome.problem.reason == "ChildConflict"


def test_every_conflict_is_named(cluster: FakeCluster) -> None:
    add_service(cluster, MODEL)
    for api_version, kind in (("apps/v1", "Deployment"), ("v1", "Service")):
        cluster.add(
            {"apiVersion": api_version, "kind": kind, "metadata": {"name": "emb", "namespace": NS}}
        )
    outcome = make(cluster).reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    assert "Deployment team/emb" in outcome.problem.message
    assert "Service team/emb" in outcome.problem.message


def test_unwanted_namesake_we_do_not_control_is_not_deleted(cluster: FakeCluster) -> None:
    """Switching autoscaling off deletes our HPA, never someone else's of the same name."""
    add_service(cluster, MODEL)
    hpa = cluster.add(
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "emb", "namespace": NS},
        }
    )
    outcome = make(cluster).reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert cluster.objects[ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", NS, "emb")] == hpa
    assert ("delete", "HorizontalPodAutoscaler") not in cluster.calls


def test_gone_or_deleting_objects_are_left_alone(cluster: FakeCluster) -> None:
    rec = make(cluster)
    assert rec.reconcile(NS, "missing") is None
    add_service(cluster, MODEL)
    owner(cluster)["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert rec.reconcile(NS, "emb") is None
    assert cluster.writes() == []


def test_scaled_to_zero(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "replicas": 0})
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    mark_rolled_out(cluster)
    rec.reconcile(NS, "emb")
    cond = conditions(cluster)
    # replicas: 0 by hand: nothing wakes it, so not Ready, and no autoscaler to name.
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("False", "ScaledToZero")
    assert "ScaledToZero" not in cond


def test_scaled_to_zero_by_keda_is_ready_not_degraded_and_says_so(cluster: FakeCluster) -> None:
    """minReplicas 0: KEDA takes the Deployment to zero when the service has no work. The
    status says so (ScaledToZero True, NoDemand, naming the ScaledObject), Ready stays True
    (a service at zero by design is not failing), and waking up reads as serving again."""
    auto = {"enabled": True, "autoscaler": "keda", "minReplicas": 0, "maxReplicas": 2}
    add_service(cluster, {**MODEL, "autoscaling": auto})
    events = Events()
    rec = make_with_keda(cluster, events)
    rec.reconcile(NS, "emb")
    mark_rolled_out(cluster)
    rec.reconcile(NS, "emb")
    cond = conditions(cluster)
    assert (cond["ScaledToZero"]["status"], cond["ScaledToZero"]["reason"]) == (
        "False",
        "Serving",
    )
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("True", "Available")

    def keda_scales(replicas: int, running: int) -> None:
        dep = cluster.objects[dep_ref()]
        dep["spec"]["replicas"] = replicas
        dep["metadata"]["resourceVersion"] += "+scale"
        mark_rolled_out(cluster)
        dep["status"]["replicas"] = dep["status"]["updatedReplicas"] = running

    keda_scales(0, running=1)  # the last pod is still stopping
    rec.reconcile(NS, "emb")
    cond = conditions(cluster)
    assert (cond["ScaledToZero"]["status"], cond["ScaledToZero"]["reason"]) == (
        "False",
        "ScalingToZero",
    )
    assert cond["Progressing"]["status"] == "True"

    keda_scales(0, running=0)
    rec.reconcile(NS, "emb")
    cond = conditions(cluster)
    at_zero = cond["ScaledToZero"]
    assert (at_zero["status"], at_zero["reason"]) == ("True", "NoDemand")
    assert "ScaledObject emb (keda)" in at_zero["message"] and "300s" in at_zero["message"]
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("True", "ScaledToZero")
    assert (cond["Progressing"]["status"], cond["Degraded"]["status"]) == ("False", "False")
    assert owner(cluster)["status"]["readyReplicas"] == 0
    assert any(e[:2] == ("Normal", "ScaledToZero") for e in events.posted)
    assert not [e for e in events.posted if e[0] == "Warning"]
    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert cluster.writes() == [], "at zero and unchanged: no status write"

    # A request held at the gateway wakes it: one replica starting, then serving.
    keda_scales(1, running=1)
    cluster.objects[dep_ref()]["status"]["readyReplicas"] = 0
    cluster.objects[dep_ref()]["status"]["conditions"][0]["status"] = "False"
    rec.reconcile(NS, "emb")
    cond = conditions(cluster)
    assert (cond["ScaledToZero"]["status"], cond["ScaledToZero"]["reason"]) == (
        "False",
        "Serving",
    )
    assert cond["Ready"]["status"] == "False" and cond["Degraded"]["status"] == "False"
    mark_rolled_out(cluster)
    rec.reconcile(NS, "emb")
    assert conditions(cluster)["Ready"]["reason"] == "Available"

    # When KEDA last saw demand, from its ScaledObject, to the minute: a service's "idle since".
    so = cluster.objects[ObjectRef("keda.sh/v1alpha1", "ScaledObject", NS, "emb")]
    so.setdefault("status", {})["lastActiveTime"] = "2025-01-01T00:07:41Z"
    rec.reconcile(NS, "emb")
    assert owner(cluster)["status"]["autoscaling"]["lastActiveTime"] == "2025-01-01T00:07:00Z"
    cluster.calls.clear()
    so["status"]["lastActiveTime"] = "2025-01-01T00:07:46Z"  # KEDA's next poll, same minute
    rec.reconcile(NS, "emb")
    assert cluster.writes() == [], "a busy service's status is not rewritten at every poll"


@pytest.mark.parametrize("ready", [0, 1])
def test_partial_availability(cluster: FakeCluster, ready: int) -> None:
    add_service(cluster, {**MODEL, "replicas": 2})
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    mark_rolled_out(cluster, ready=ready)
    rec.reconcile(NS, "emb")
    cond = conditions(cluster)
    assert cond["Ready"]["status"] == ("True" if ready else "False")
    assert cond["Progressing"]["reason"] == "Scaling"
    assert owner(cluster)["status"]["readyReplicas"] == ready


def test_refused_apply_of_edited_child_falls_back_to_merge_patch(cluster: FakeCluster) -> None:
    add_service(cluster, MODEL)
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    svc_ref = ObjectRef("v1", "Service", NS, "emb")
    cluster.objects[svc_ref]["spec"]["ports"][0]["port"] = 9999
    real_apply = cluster.apply

    def refusing_apply(manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        if manifest["kind"] == "Service":
            raise ApiError(422, 'spec.ports[1].name: Duplicate value: "http"')
        return real_apply(manifest, force=force)

    cluster.apply = refusing_apply  # type: ignore[method-assign]
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert ("merge_patch", "Service") in cluster.writes()
    assert cluster.objects[svc_ref]["spec"]["ports"][0]["port"] == 80


def test_refused_new_child_is_degraded(cluster: FakeCluster) -> None:
    add_service(cluster, MODEL)

    def refusing_apply(manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        raise ApiError(422, "nope")

    cluster.apply = refusing_apply  # type: ignore[method-assign]
    outcome = make(cluster).reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    assert conditions(cluster)["Degraded"]["reason"] == "ChildRejected"


def test_rollout_past_its_deadline_is_degraded(cluster: FakeCluster) -> None:
    add_service(cluster, MODEL)
    events = Events()
    rec = make(cluster, events)
    rec.reconcile(NS, "emb")
    dep = cluster.objects[dep_ref()]
    dep["metadata"]["resourceVersion"] += "+status"
    dep["status"] = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 0,
        "conditions": [
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
        ],
    }
    rec.reconcile(NS, "emb")
    cond = conditions(cluster)
    assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == (
        "True",
        "ProgressDeadlineExceeded",
    )
    assert cond["Ready"]["reason"] == "MinimumReplicasUnavailable"
    assert ("Warning", "ProgressDeadlineExceeded") in [e[:2] for e in events.posted]


TP2 = {**MODEL, "parallelism": {"tensorParallelSize": 2}}


def _edit(cluster: FakeCluster, spec: dict[str, Any]) -> None:
    body = owner(cluster)
    body["spec"] = spec
    body["metadata"]["generation"] += 1


def test_tensor_parallel_on_the_bundled_server_deploys_one_pod_with_n_gpus(
    cluster: FakeCluster,
) -> None:
    add_service(cluster, TP2)
    events = Events()
    rec = make(cluster, events)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    container = cluster.objects[dep_ref()]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "img:1"
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert conditions(cluster)["Degraded"]["status"] == "False"
    assert not [e for e in events.posted if e[0] == "Warning"]


def test_tensor_parallel_edit_rolls_out_like_any_edit(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "replicas": 2})
    rec = make(cluster, Events())
    rec.reconcile(NS, "emb")
    mark_rolled_out(cluster)
    rec.reconcile(NS, "emb")
    assert conditions(cluster)["Ready"]["status"] == "True"

    _edit(cluster, {**TP2, "replicas": 2})
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    container = cluster.objects[dep_ref()]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    cond = conditions(cluster)
    assert cond["Degraded"]["status"] == "False" and cond["Ready"]["status"] == "False"


def test_status_and_events_say_which_autoscaler_runs_and_whether_it_can_scale(
    cluster: FakeCluster,
) -> None:
    """The platform's default autoscaler (KEDA here) writes a ScaledObject; status names it,
    and AutoscalerReady follows what KEDA reports about it, with events on the way."""
    add_service(cluster, {**MODEL, "autoscaling": {"enabled": True, "maxReplicas": 3}})
    events = Events()
    rec = make_with_keda(cluster, events)
    rec.reconcile(NS, "emb")
    so_ref = ObjectRef("keda.sh/v1alpha1", "ScaledObject", NS, "emb")
    assert so_ref in cluster.objects
    assert owner(cluster)["status"]["autoscaling"] == {
        "autoscaler": "keda",
        "kind": "ScaledObject",
        "name": "emb",
        "metric": "embedding_server_backlog_seconds",
        "target": "2",
        "desiredReplicas": 1,
    }
    scaling = conditions(cluster)["AutoscalerReady"]
    assert (scaling["status"], scaling["reason"]) == ("Unknown", "AutoscalerPending")

    def keda_reports(status: str, reason: str, message: str) -> None:
        so = cluster.objects[so_ref]
        so["status"] = {
            "conditions": [
                {"type": "Ready", "status": status, "reason": reason, "message": message}
            ]
        }
        so["metadata"]["resourceVersion"] += "+status"

    keda_reports("False", "ScaledObjectCheckFailed", "Prometheus query failed")
    mark_rolled_out(cluster, ready=0)
    rec.reconcile(NS, "emb")
    # No replica is ready, so none exports the metric yet: waiting, not failing.
    scaling = conditions(cluster)["AutoscalerReady"]
    assert (scaling["status"], scaling["reason"]) == ("Unknown", "AutoscalerPending")
    assert "Prometheus query failed" in scaling["message"]
    assert not [e for e in events.posted if e[0] == "Warning"]

    mark_rolled_out(cluster, ready=1)
    rec.reconcile(NS, "emb")
    scaling = conditions(cluster)["AutoscalerReady"]
    assert (scaling["status"], scaling["reason"]) == ("False", "ScaledObjectCheckFailed")
    assert (
        "Warning",
        "AutoscalerNotReady",
        "ScaledObject emb: ScaledObjectCheckFailed: Prometheus query failed",
    ) in events.posted

    keda_reports("True", "ScaledObjectReady", "ScaledObject is defined correctly")
    rec.reconcile(NS, "emb")
    scaling = conditions(cluster)["AutoscalerReady"]
    assert (scaling["status"], scaling["reason"]) == ("True", "ScaledObjectReady")
    assert (
        "Normal",
        "AutoscalerReady",
        "ScaledObject emb (keda) scales on embedding_server_backlog_seconds, target 2 per pod",
    ) in events.posted

    # The service chooses the HPA: the ScaledObject goes, the HPA comes, status follows.
    body = owner(cluster)
    body["spec"]["autoscaling"]["autoscaler"] = "hpa"
    body["metadata"]["generation"] += 1
    rec.reconcile(NS, "emb")
    assert so_ref not in cluster.objects
    assert ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", NS, "emb") in cluster.objects
    assert owner(cluster)["status"]["autoscaling"]["kind"] == "HorizontalPodAutoscaler"

    # Autoscaling off: no autoscaler, no condition about one.
    body = owner(cluster)
    body["spec"]["autoscaling"]["enabled"] = False
    body["metadata"]["generation"] += 1
    rec.reconcile(NS, "emb")
    assert "AutoscalerReady" not in conditions(cluster)
    assert "autoscaling" not in owner(cluster)["status"]


def test_hpa_readiness_is_able_to_scale_and_scaling_active(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "autoscaling": {"enabled": True, "maxReplicas": 3}})
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    mark_rolled_out(cluster, ready=1)
    hpa = cluster.objects[ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", NS, "emb")]
    hpa["status"] = {
        "conditions": [
            {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale"},
            {
                "type": "ScalingActive",
                "status": "False",
                "reason": "FailedGetPodsMetric",
                "message": "unable to get metric embedding_server_backlog_seconds",
            },
        ]
    }
    hpa["metadata"]["resourceVersion"] += "+status"
    rec.reconcile(NS, "emb")
    scaling = conditions(cluster)["AutoscalerReady"]
    assert (scaling["status"], scaling["reason"]) == ("False", "FailedGetPodsMetric")
    assert "unable to get metric" in scaling["message"]


def test_keda_without_a_prometheus_is_refused_before_anything_is_applied(
    cluster: FakeCluster,
) -> None:
    auto = {"enabled": True, "autoscaler": "keda", "maxReplicas": 3}
    add_service(cluster, {**MODEL, "autoscaling": auto})
    rec = make(cluster)  # the operator was given no --keda-prometheus-address
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    assert outcome.problem.reason == "AutoscalerNotConfigured"
    assert "keda-prometheus-address" in outcome.problem.message
    assert [w for w in cluster.writes() if w[0] == "apply"] == []
    assert conditions(cluster)["Degraded"]["reason"] == "AutoscalerNotConfigured"


def test_a_scaled_object_where_keda_is_not_installed_is_reported(cluster: FakeCluster) -> None:
    auto = {"enabled": True, "autoscaler": "keda", "maxReplicas": 3}
    add_service(cluster, {**MODEL, "autoscaling": auto})
    real_apply = cluster.apply

    def no_keda(manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        if manifest["kind"] == "ScaledObject":
            raise ApiError(404, "the server could not find the requested resource")
        return real_apply(manifest, force=force)

    cluster.apply = no_keda  # type: ignore[method-assign]
    rec = reconciler(cluster, autoscaling=AutoscalingDefaults("hpa", "http://prometheus:9090"))
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    assert outcome.problem.reason == "ChildRejected"
    assert "is KEDA installed?" in outcome.problem.message


def test_a_model_that_will_not_load_is_reported_from_the_pods(cluster: FakeCluster) -> None:
    """The server writes a fixed termination message when its model will not load; the
    kubelet puts it in the pod's status, and the operator says so without quoting the log."""
    add_service(cluster, MODEL)
    rec = make(cluster)
    rec.reconcile(NS, "emb")
    cluster.add(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "emb-abc-1",
                "namespace": NS,
                "labels": {
                    "app.kubernetes.io/name": "embedding-server",
                    "app.kubernetes.io/instance": "emb",
                },
            },
            "status": {
                "containerStatuses": [
                    {
                        "name": "server",
                        "restartCount": 3,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {
                            "terminated": {
                                "exitCode": 1,
                                "reason": "Error",
                                "message": "embedding-server: the model could not be loaded; "
                                "the log says why\n",
                            }
                        },
                    }
                ]
            },
        }
    )
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.retry
    degraded = conditions(cluster)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "ModelLoadFailed")
    assert degraded["message"] == (
        "pod emb-abc-1 could not load its model (exit code 1, 3 restarts); "
        "`kubectl logs -n team emb-abc-1 --previous` says why"
    )


def test_the_deprecated_aliases_annotation_reaches_the_pods(cluster: FakeCluster) -> None:
    """The reconciler hands the object's annotations to the plan: the pods are started with
    the annotation's names too, so the names the gateway routes by it are accepted there."""
    add_service(cluster, {**MODEL, "servedModelAliases": ["bge"]})
    owner(cluster)["metadata"]["annotations"] = {"embedding-operator.dev/aliases": "old,bge"}
    outcome = make(cluster).reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    args = cluster.objects[dep_ref()]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--served-model-aliases") + 1] == "bge,old"

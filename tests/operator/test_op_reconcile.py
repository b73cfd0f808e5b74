"""Reconciliation against an in-memory API: converge, stay quiet, correct drift, report."""

from __future__ import annotations

from typing import Any

import pytest
from embedding_operator.kube import ApiError, ObjectRef
from embedding_operator.profiles import GpuProfiles
from embedding_operator.reconcile import Reconciler, owner_ref

from tests.support.operator import FakeCluster

NS = "team"


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def __call__(self, body: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        self.posted.append((type, reason, message))


def make(
    cluster: FakeCluster, events: Events | None = None, times: list[str] | None = None
) -> Reconciler:
    clock = iter(times or [f"2025-01-01T00:00:{i:02d}Z" for i in range(60)])
    return Reconciler(
        cluster=cluster,
        profiles=GpuProfiles.builtin(),
        default_image="img:1",
        recorder=events or Events(),
        clock=lambda: next(clock),
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
    dep = cluster.objects[dep_ref()]
    want = dep["spec"].get("replicas", 1)
    ready = want if ready is None else ready
    dep["status"] = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": want,
        "updatedReplicas": want,
        "readyReplicas": ready,
        "availableReplicas": ready,
        "conditions": [{"type": "Available", "status": "True" if ready else "False"}],
    }


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

    body["spec"] = {**MODEL, "replicas": 1, "server": {"dtype": "float16"}}
    body["metadata"]["generation"] = 3
    rec.reconcile(NS, "emb")
    assert hpa not in cluster.objects and pdb not in cluster.objects
    args = cluster.objects[dep_ref()]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--dtype") + 1] == "float16"
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


def test_missing_secret_is_retryable_until_created(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "apiKeySecretRef": {"name": "auth"}})
    events = Events()
    rec = make(cluster, events)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.retry
    cond = conditions(cluster)
    assert cond["Degraded"]["reason"] == "SecretNotFound"
    assert "spec.apiKeySecretRef" in cond["Degraded"]["message"]
    assert dep_ref() not in cluster.objects
    cluster.add(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "auth", "namespace": NS},
            "data": {"other": "eA=="},
        }
    )
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.retry
    assert "has no key 'api-key'" in conditions(cluster)["Degraded"]["message"]
    cluster.objects[ObjectRef("v1", "Secret", NS, "auth")]["data"] = {"api-key": "eA=="}
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert dep_ref() in cluster.objects
    assert conditions(cluster)["Degraded"]["status"] == "False"


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
    assert conditions(cluster)["Degraded"]["reason"] == "ChildConflict"
    svc = cluster.objects[ObjectRef("v1", "Service", NS, "emb")]
    assert svc["spec"] == {"ports": [{"port": 1}]}


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
    assert conditions(cluster)["Ready"]["reason"] == "ScaledToZero"


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

    def refusing_apply(manifest: dict[str, Any]) -> dict[str, Any]:
        if manifest["kind"] == "Service":
            raise ApiError(422, 'spec.ports[1].name: Duplicate value: "http"')
        return real_apply(manifest)

    cluster.apply = refusing_apply  # type: ignore[method-assign]
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert ("merge_patch", "Service") in cluster.writes()
    assert cluster.objects[svc_ref]["spec"]["ports"][0]["port"] == 80


def test_refused_new_child_is_degraded(cluster: FakeCluster) -> None:
    add_service(cluster, MODEL)

    def refusing_apply(manifest: dict[str, Any]) -> dict[str, Any]:
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


def test_tensor_parallel_on_bundled_server_is_degraded_until_edited(
    cluster: FakeCluster,
) -> None:
    add_service(cluster, TP2)
    events = Events()
    rec = make(cluster, events)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None and not outcome.retry
    assert [c for c in cluster.writes() if c[0] == "apply"] == []
    assert dep_ref() not in cluster.objects
    cond = conditions(cluster)
    degraded = cond["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "TensorParallelUnsupported")
    assert degraded["message"].startswith("spec.parallelism.tensorParallelSize: 2 ")
    assert "'img:1'" in degraded["message"]
    assert "set spec.parallelism.tensorParallelSize to 1" in degraded["message"]
    assert "spec.server.image" in degraded["message"]
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == (
        "False",
        "TensorParallelUnsupported",
    )
    assert cond["Progressing"]["status"] == "False"
    assert events.posted == [("Warning", "TensorParallelUnsupported", degraded["message"])]
    # Stuck in the same state: no more events, no more writes.
    cluster.calls.clear()
    rec.reconcile(NS, "emb")
    assert cluster.writes() == [] and len(events.posted) == 1

    # The fix is an edit: back to one GPU per replica converges as usual.
    _edit(cluster, {**MODEL, "parallelism": {"tensorParallelSize": 1}})
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    container = cluster.objects[dep_ref()]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert conditions(cluster)["Degraded"]["status"] == "False"
    mark_rolled_out(cluster)
    rec.reconcile(NS, "emb")
    cond = conditions(cluster)
    assert (cond["Ready"]["status"], cond["Ready"]["observedGeneration"]) == ("True", 2)
    assert [e[:2] for e in events.posted] == [
        ("Warning", "TensorParallelUnsupported"),
        ("Normal", "Available"),
    ]


def test_tensor_parallel_edit_leaves_running_children_alone(cluster: FakeCluster) -> None:
    add_service(cluster, {**MODEL, "replicas": 2})
    events = Events()
    rec = make(cluster, events)
    rec.reconcile(NS, "emb")
    mark_rolled_out(cluster)
    rec.reconcile(NS, "emb")
    before = {ref: obj["metadata"]["resourceVersion"] for ref, obj in cluster.objects.items()}
    assert conditions(cluster)["Ready"]["status"] == "True"

    _edit(cluster, {**TP2, "replicas": 2})
    cluster.calls.clear()
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    # Nothing applied or deleted: the pods of the last good spec keep serving.
    assert cluster.writes() == [("status", "EmbeddingService")]
    assert {
        ref: obj["metadata"]["resourceVersion"]
        for ref, obj in cluster.objects.items()
        if ref != owner_ref(NS, "emb")
    } == {ref: rv for ref, rv in before.items() if ref != owner_ref(NS, "emb")}
    cond = conditions(cluster)
    assert (cond["Degraded"]["reason"], cond["Ready"]["status"]) == (
        "TensorParallelUnsupported",
        "False",
    )
    assert "pods of an earlier spec keep running" in cond["Degraded"]["message"]
    assert cond["Degraded"]["observedGeneration"] == 2
    assert owner(cluster)["status"]["readyReplicas"] == 2  # what still runs
    assert ("Warning", "TensorParallelUnsupported") in [e[:2] for e in events.posted]

    _edit(cluster, {**MODEL, "replicas": 2})
    cluster.calls.clear()
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert cluster.writes() == [("status", "EmbeddingService")], "the children still match"
    cond = conditions(cluster)
    assert cond["Degraded"]["status"] == "False"
    assert (cond["Ready"]["status"], cond["Ready"]["observedGeneration"]) == ("True", 3)


def test_tensor_parallel_with_custom_image_renders_as_asked(cluster: FakeCluster) -> None:
    add_service(cluster, {**TP2, "server": {"image": "me/tp-server:1"}})
    events = Events()
    rec = make(cluster, events)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    container = cluster.objects[dep_ref()]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "me/tp-server:1"
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert conditions(cluster)["Degraded"]["status"] == "False"
    assert not [e for e in events.posted if e[0] == "Warning"]


def test_tensor_parallel_outranks_a_missing_secret(cluster: FakeCluster) -> None:
    add_service(cluster, {**TP2, "apiKeySecretRef": {"name": "auth"}})
    outcome = make(cluster).reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    assert outcome.problem.reason == "TensorParallelUnsupported" and not outcome.retry

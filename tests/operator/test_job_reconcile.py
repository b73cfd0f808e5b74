"""An EmbeddingJob reconciled against the in-memory API: plan, work, suspend, finish, expire.

The Job controller and the kubelet are played by the test (a Job's status, its pods'
termination messages), the way the real ones report; the reconciler sees only what a real
API server would return.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from embedding_operator.jobs.pods import WatchedJobPods
from embedding_operator.jobs.reconcile import JobReconciler, job_ref
from embedding_operator.kube import ObjectRef

from tests.support.operator import FakeCluster

NS = "team"
SERVICE = "minilm"


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def __call__(self, body: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        self.posted.append((type, reason, message))

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.posted]


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 3, 10, 0, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def make(
    cluster: FakeCluster,
    events: Events,
    clock: Clock | None = None,
    pods: WatchedJobPods | None = None,
) -> JobReconciler:
    clock = clock or Clock()
    return JobReconciler(
        cluster=cluster,
        recorder=events,
        default_image="img:1",
        clock=lambda: clock.now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        now=clock,
        pods=pods,
    )


def add_service(cluster: FakeCluster, *, ready: bool = True) -> None:
    cluster.add(
        {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingService",
            "metadata": {"name": SERVICE, "namespace": NS},
            "spec": {
                "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
                "server": {"image": "registry.example/embedding-server:2"},
                "service": {"port": 8080},
            },
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }
    )


def set_service_ready(cluster: FakeCluster, ready: bool) -> None:
    ref = ObjectRef("embedding-operator.dev/v1alpha1", "EmbeddingService", NS, SERVICE)
    cluster.objects[ref]["status"]["conditions"][0]["status"] = "True" if ready else "False"


def add_job(cluster: FakeCluster, **spec: Any) -> None:
    cluster.add(
        {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingJob",
            "metadata": {"name": "corpus", "namespace": NS},
            "spec": {
                "service": SERVICE,
                "input": {"urls": ["s3://corpus/docs/*.parquet"], "format": "parquet"},
                "output": {"url": "s3://corpus/out/"},
                "storage": {"s3": {"credentialsSecret": {"name": "corpus-s3"}}},
                "parallelism": 2,
                **spec,
            },
        }
    )


def body(cluster: FakeCluster) -> dict[str, Any]:
    return cluster.objects[job_ref(NS, "corpus")]


def status(cluster: FakeCluster) -> dict[str, Any]:
    return dict(body(cluster).get("status") or {})


def conditions(cluster: FakeCluster) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status(cluster).get("conditions") or []}


def batch_job(cluster: FakeCluster, name: str) -> dict[str, Any] | None:
    return cluster.objects.get(ObjectRef("batch/v1", "Job", NS, name))


def finish_pod(
    cluster: FakeCluster, job: dict[str, Any], component: str, name: str, message: dict[str, Any]
) -> None:
    """A pod of ``job`` that succeeded with ``message`` as its termination message."""
    cluster.add(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": dict(job["spec"]["template"]["metadata"]["labels"]),
                "ownerReferences": [
                    {"kind": "Job", "name": job["metadata"]["name"], "uid": job["metadata"]["uid"]}
                    | {"controller": True, "apiVersion": "batch/v1"}
                ],
            },
            "status": {
                "phase": "Succeeded",
                "containerStatuses": [
                    {
                        "name": "job",
                        "state": {
                            "terminated": {
                                "exitCode": 0,
                                "message": json.dumps(message),
                                "finishedAt": f"2026-12-03T10:0{len(name) % 10}:00Z",
                            }
                        },
                    }
                ],
            },
        }
    )
    assert component in name


def plan_done(cluster: FakeCluster, shards: int, rows: int) -> None:
    planner = batch_job(cluster, "corpus-plan")
    assert planner is not None
    planner["status"] = {
        "startTime": "2026-12-03T10:00:00Z",
        "completionTime": "2026-12-03T10:00:30Z",
        "conditions": [{"type": "Complete", "status": "True"}],
    }
    finish_pod(cluster, planner, "plan", "corpus-plan-abcde", {"shards": shards, "rows": rows})


def test_a_job_plans_then_works_then_completes(cluster: FakeCluster) -> None:
    events = Events()
    add_service(cluster)
    add_job(cluster)
    reconciler = make(cluster, events)

    reconciler.reconcile(NS, "corpus")
    planner = batch_job(cluster, "corpus-plan")
    assert planner is not None and batch_job(cluster, "corpus-work") is None
    container = planner["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example/embedding-server:2"  # the service's image
    account = cluster.objects[ObjectRef("v1", "ServiceAccount", NS, "corpus-embedding-job")]
    assert account["automountServiceAccountToken"] is False
    assert status(cluster)["phase"] == "Planning"
    assert events.reasons() == ["Planning"]

    plan_done(cluster, shards=3, rows=300)
    reconciler.reconcile(NS, "corpus")
    worker = batch_job(cluster, "corpus-work")
    assert worker is not None
    assert worker["spec"]["completions"] == 3 and worker["spec"]["parallelism"] == 2
    args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--service") + 1] == "http://minilm.team.svc.cluster.local:8080"
    assert args[args.index("--model") + 1] == "all-MiniLM-L6-v2"
    assert (status(cluster)["phase"], status(cluster)["shards"], status(cluster)["rows"]) == (
        "Running",
        3,
        300,
    )

    worker["status"] = {"startTime": "2026-12-03T10:01:00Z", "completedIndexes": "0-1"}
    for index in (0, 1):
        finish_pod(
            cluster,
            worker,
            "work",
            f"corpus-work-{index}-abc",
            {"shard": index, "rows": 100, "failed": index, "seconds": 5.0, "skipped": False},
        )
    reconciler.reconcile(NS, "corpus")
    now = status(cluster)
    assert (now["shardsDone"], now["rowsDone"], now["failedRows"]) == (2, 200, 1)
    assert now["rowsPerSecond"] > 0 and now["eta"]

    # Nothing changed: nothing written.
    writes = len(cluster.writes())
    outcome = reconciler.reconcile(NS, "corpus")
    assert outcome is not None and not outcome.status_written
    assert len(cluster.writes()) == writes

    worker["status"].update(
        completedIndexes="0-2",
        completionTime="2026-12-03T10:05:00Z",
        conditions=[{"type": "Complete", "status": "True"}],
    )
    finish_pod(
        cluster,
        worker,
        "work",
        "corpus-work-2-abc",
        {"shard": 2, "rows": 100, "failed": 0, "seconds": 5.0, "skipped": False},
    )
    reconciler.reconcile(NS, "corpus")
    final = status(cluster)
    assert final["phase"] == "Complete" and final["rowsDone"] == 300
    assert final["completionTime"] == "2026-12-03T10:05:00Z"
    assert conditions(cluster)["Complete"]["status"] == "True"
    assert events.reasons() == ["Planning", "Running", "Complete"]

    # Final: the Jobs going away (deleted by hand) re-creates nothing.
    del cluster.objects[ObjectRef("batch/v1", "Job", NS, "corpus-work")]
    reconciler.reconcile(NS, "corpus")
    assert batch_job(cluster, "corpus-work") is None and status(cluster)["phase"] == "Complete"


def test_workers_wait_for_the_service(cluster: FakeCluster) -> None:
    events = Events()
    add_job(cluster)
    reconciler = make(cluster, events)
    outcome = reconciler.reconcile(NS, "corpus")
    assert outcome is not None and outcome.retry
    assert batch_job(cluster, "corpus-plan") is None
    assert conditions(cluster)["Complete"]["reason"] == "ServiceNotFound"
    assert "spec.service" in conditions(cluster)["Complete"]["message"]
    assert ("Warning", "ServiceNotFound") in [(t, r) for t, r, _ in events.posted]

    add_service(cluster, ready=False)
    reconciler.reconcile(NS, "corpus")  # the planner needs no ready service
    plan_done(cluster, shards=2, rows=20)
    outcome = reconciler.reconcile(NS, "corpus")
    assert outcome is not None and outcome.retry
    assert batch_job(cluster, "corpus-work") is None
    assert status(cluster)["phase"] == "Pending"
    assert conditions(cluster)["Complete"]["reason"] == "ServiceNotReady"

    set_service_ready(cluster, True)
    outcome = reconciler.reconcile(NS, "corpus")
    assert outcome is not None and not outcome.retry
    assert batch_job(cluster, "corpus-work") is not None


def test_suspend_and_parallelism_reach_the_running_job(cluster: FakeCluster) -> None:
    add_service(cluster)
    add_job(cluster)
    reconciler = make(cluster, Events())
    reconciler.reconcile(NS, "corpus")
    plan_done(cluster, shards=10, rows=1000)
    reconciler.reconcile(NS, "corpus")
    body(cluster)["spec"].update(suspend=True, parallelism=4)
    reconciler.reconcile(NS, "corpus")
    worker = batch_job(cluster, "corpus-work")
    assert worker is not None
    assert worker["spec"]["suspend"] is True and worker["spec"]["parallelism"] == 4
    assert status(cluster)["phase"] == "Suspended"
    assert conditions(cluster)["Suspended"]["status"] == "True"
    body(cluster)["spec"]["suspend"] = False
    reconciler.reconcile(NS, "corpus")
    assert worker["spec"]["suspend"] is False
    assert status(cluster)["phase"] == "Running"
    assert conditions(cluster)["Suspended"]["status"] == "False"


def test_an_empty_input_completes_without_workers(cluster: FakeCluster) -> None:
    add_service(cluster)
    add_job(cluster)
    reconciler = make(cluster, Events())
    reconciler.reconcile(NS, "corpus")
    plan_done(cluster, shards=0, rows=0)
    reconciler.reconcile(NS, "corpus")
    assert batch_job(cluster, "corpus-work") is None
    assert status(cluster)["phase"] == "Complete"


def test_failed_shards_fail_the_job_naming_them(cluster: FakeCluster) -> None:
    events = Events()
    add_service(cluster)
    add_job(cluster)
    reconciler = make(cluster, events)
    reconciler.reconcile(NS, "corpus")
    plan_done(cluster, shards=4, rows=40)
    reconciler.reconcile(NS, "corpus")
    worker = batch_job(cluster, "corpus-work")
    assert worker is not None
    worker["status"] = {
        "completedIndexes": "0-2",
        "failedIndexes": "3",
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": "FailedIndexes",
                "lastTransitionTime": "2026-12-03T10:09:00Z",
            }
        ],
    }
    reconciler.reconcile(NS, "corpus")
    assert status(cluster)["phase"] == "Failed"
    assert conditions(cluster)["Failed"]["reason"] == "ShardsFailed"
    assert ("Warning", "Failed") in [(t, r) for t, r, _ in events.posted]


def test_ttl_deletes_a_finished_job_once_it_passed(cluster: FakeCluster) -> None:
    clock = Clock()
    add_service(cluster)
    add_job(cluster, ttlSecondsAfterFinished=600)
    reconciler = make(cluster, Events(), clock)
    reconciler.reconcile(NS, "corpus")
    plan_done(cluster, shards=0, rows=0)  # completed at 10:00:30
    reconciler.reconcile(NS, "corpus")
    assert status(cluster)["phase"] == "Complete"
    outcome = reconciler.reconcile(NS, "corpus")
    assert outcome is not None and outcome.requeue_after == 630.0
    clock.now = clock.now.replace(minute=10, second=31)
    reconciler.reconcile(NS, "corpus")
    assert job_ref(NS, "corpus") not in cluster.objects


def test_a_name_held_by_someone_else_is_never_written(cluster: FakeCluster) -> None:
    add_service(cluster)
    add_job(cluster)
    cluster.add(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "corpus-plan", "namespace": NS},
            "spec": {"template": {}},
        }
    )
    outcome = make(cluster, Events()).reconcile(NS, "corpus")
    assert outcome is not None and outcome.retry
    assert conditions(cluster)["Complete"]["reason"] == "ChildConflict"
    assert (cluster.objects[ObjectRef("batch/v1", "Job", NS, "corpus-plan")]["spec"]) == {
        "template": {}
    }
    assert status(cluster)["phase"] == "Pending"


def test_an_invalid_spec_fails_naming_the_field(cluster: FakeCluster) -> None:
    add_service(cluster)
    add_job(cluster, storage=None)
    body(cluster)["spec"].pop("storage")
    make(cluster, Events()).reconcile(NS, "corpus")
    assert status(cluster)["phase"] == "Failed"
    assert conditions(cluster)["Failed"]["reason"] == "InvalidSpec"
    assert conditions(cluster)["Failed"]["message"].startswith("spec: storage.s3 is required")
    assert batch_job(cluster, "corpus-plan") is None


def test_a_job_the_api_server_refuses_fails_with_its_reason(cluster: FakeCluster) -> None:
    from embedding_operator.kube import ApiError

    add_service(cluster)
    add_job(cluster)
    real_apply = cluster.apply

    def refuse_jobs(manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        if manifest["kind"] == "Job":
            raise ApiError(422, 'Job.batch "corpus-plan" is invalid: spec.podFailurePolicy')
        return real_apply(manifest, force=force)

    cluster.apply = refuse_jobs  # type: ignore[method-assign]
    outcome = make(cluster, Events()).reconcile(NS, "corpus")
    assert outcome is not None and not outcome.retry
    assert status(cluster)["phase"] == "Failed"
    assert conditions(cluster)["Failed"]["reason"] == "ChildRejected"
    assert "spec.podFailurePolicy" in conditions(cluster)["Failed"]["message"]


def test_pods_come_from_the_watch_and_a_lagging_watch_is_backed_by_a_list(
    cluster: FakeCluster,
) -> None:
    """With the pod watch's cache the reconcile of a running job lists no pods; while the
    cache lacks a committed shard's pod (the Job's event came first, or the operator just
    started), it lists them once, so rowsDone never drops below the truth."""
    watched = WatchedJobPods()
    add_service(cluster)
    add_job(cluster)
    reconciler = make(cluster, Events(), pods=watched)
    reconciler.reconcile(NS, "corpus")
    plan_done(cluster, shards=2, rows=200)
    reconciler.reconcile(NS, "corpus")  # the planner's pod is not in the cache: listed
    worker = batch_job(cluster, "corpus-work")
    assert worker is not None and status(cluster)["shards"] == 2
    worker["status"] = {"startTime": "2026-12-03T10:01:00Z", "completedIndexes": "0-1"}
    for index in (0, 1):
        finish_pod(
            cluster,
            worker,
            "work",
            f"corpus-work-{index}-abc",
            {"shard": index, "rows": 100, "failed": 0, "seconds": 5.0, "skipped": False},
        )
    pod_ref = ObjectRef("v1", "Pod", NS, "corpus-work-0-abc")
    watched.pod_event(NS, "corpus", "worker", cluster.objects[pod_ref], deleted=False)
    cluster.calls.clear()
    reconciler.reconcile(NS, "corpus")
    assert ("get", "Pod") in cluster.calls  # shard 1's pod is not in the cache yet
    assert status(cluster)["rowsDone"] == 200
    other = ObjectRef("v1", "Pod", NS, "corpus-work-1-abc")
    watched.pod_event(NS, "corpus", "worker", cluster.objects[other], deleted=False)
    cluster.calls.clear()
    reconciler.reconcile(NS, "corpus")
    assert ("get", "Pod") not in cluster.calls
    assert status(cluster)["rowsDone"] == 200


def test_a_job_pinned_to_a_fingerprint_calls_the_version_that_has_it(
    cluster: FakeCluster,
) -> None:
    """spec.fingerprint: the active model through <service>, the model a change prepares
    through <service>-next (re-index before the cut-over), and a wait while neither has it;
    every request carries X-Expect-Embedding-Fingerprint (the worker's --expect-fingerprint)."""
    active, pending = "aaaa0000aaaa0000", "bbbb1111bbbb1111"
    add_service(cluster)
    ref = ObjectRef("embedding-operator.dev/v1alpha1", "EmbeddingService", NS, SERVICE)
    cluster.objects[ref]["status"]["rollout"] = {
        "phase": "Prepared",
        "activeFingerprint": active,
        "pendingFingerprint": pending,
    }
    events = Events()
    add_job(cluster, fingerprint="cccc2222")
    reconciler = make(cluster, events)
    reconciler.reconcile(NS, "corpus")
    plan_done(cluster, shards=2, rows=20)
    outcome = reconciler.reconcile(NS, "corpus")
    assert outcome is not None and outcome.retry
    assert batch_job(cluster, "corpus-work") is None
    waiting = conditions(cluster)["Complete"]["message"]
    assert f"serves {active} and prepares {pending}, not cccc2222" in waiting

    for fingerprint, host in ((pending[:8], f"{SERVICE}-next"), (active, SERVICE)):
        job = body(cluster)
        job["spec"]["fingerprint"] = fingerprint
        reconciler.reconcile(NS, "corpus")
        worker = batch_job(cluster, "corpus-work")
        assert worker is not None
        args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--service") + 1] == f"http://{host}.{NS}.svc.cluster.local:8080"
        assert args[args.index("--expect-fingerprint") + 1] == fingerprint
        cluster.delete(ObjectRef("batch/v1", "Job", NS, "corpus-work"))


def test_the_workers_send_the_services_api_key_from_its_secret(cluster: FakeCluster) -> None:
    """A service with apiKeySecretRef refuses requests without its key: the workers get it as
    a secretKeyRef the kubelet resolves (the operator never reads a Secret)."""
    add_service(cluster)
    ref = ObjectRef("embedding-operator.dev/v1alpha1", "EmbeddingService", NS, SERVICE)
    cluster.objects[ref]["spec"]["apiKeySecretRef"] = {"name": "minilm-auth", "key": "token"}
    add_job(cluster)
    reconciler = make(cluster, Events())
    reconciler.reconcile(NS, "corpus")
    plan_done(cluster, shards=2, rows=20)
    reconciler.reconcile(NS, "corpus")
    worker = batch_job(cluster, "corpus-work")
    assert worker is not None
    env = {e["name"]: e for e in worker["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["EMBEDDING_JOB_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "minilm-auth", "key": "token"}
    }
    assert not [c for c in cluster.calls if c[1] == "Secret"], "Secrets are never read"
    planner = batch_job(cluster, "corpus-plan")
    assert planner is not None
    planner_env = planner["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "EMBEDDING_JOB_API_KEY" not in {e["name"] for e in planner_env}, (
        "the planner calls no service"
    )


def test_ttl_deletes_a_job_refused_for_its_spec_too(cluster: FakeCluster) -> None:
    """An InvalidSpec failure never runs a Job, so it has no completion time: it finished when
    it was refused, and ttlSecondsAfterFinished counts from then."""
    clock = Clock()
    add_service(cluster)
    add_job(cluster, storage=None, ttlSecondsAfterFinished=60)
    body(cluster)["spec"].pop("storage")
    reconciler = make(cluster, Events(), clock)
    outcome = reconciler.reconcile(NS, "corpus")
    assert status(cluster)["phase"] == "Failed"
    assert outcome is not None and outcome.requeue_after == 61.0
    clock.now = clock.now.replace(second=30)
    reconciler.reconcile(NS, "corpus")
    assert job_ref(NS, "corpus") in cluster.objects
    clock.now = clock.now.replace(minute=1, second=1)
    reconciler.reconcile(NS, "corpus")
    assert job_ref(NS, "corpus") not in cluster.objects


def test_a_model_job_waits_for_no_service(cluster: FakeCluster) -> None:
    """spec.model: no EmbeddingService exists, and none is waited for (no ServiceNotFound or
    ServiceNotReady): the planner and then the workers start, on the operator's image, the
    workers loading the model themselves."""
    events = Events()
    add_job(cluster, service=None, model={"name": "BAAI/bge-small-en-v1.5"})
    spec = body(cluster)["spec"]
    del spec["service"]
    reconciler = make(cluster, events)

    outcome = reconciler.reconcile(NS, "corpus")
    assert outcome is not None and not outcome.retry and outcome.problem is None
    planner = batch_job(cluster, "corpus-plan")
    assert planner is not None
    assert planner["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    assert status(cluster)["phase"] == "Planning"

    plan_done(cluster, shards=2, rows=20)
    outcome = reconciler.reconcile(NS, "corpus")
    assert outcome is not None and not outcome.retry and outcome.problem is None
    worker = batch_job(cluster, "corpus-work")
    assert worker is not None
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "img:1"
    args = container["args"]
    assert "--service" not in args and "--local" in args
    assert args[args.index("--model") + 1] == "BAAI/bge-small-en-v1.5"
    assert status(cluster)["phase"] == "Running"
    reasons = {c["reason"] for c in conditions(cluster).values()}
    assert not reasons & {"ServiceNotFound", "ServiceNotReady"}
    assert "ServiceNotFound" not in events.reasons() and "ServiceNotReady" not in events.reasons()

"""The EmbeddingJob watches only enqueue, into their own queue: an EmbeddingJob's changes and
its Jobs' (by their controller reference), never another owner's Jobs."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
from embedding_operator.jobs.handlers import register_jobs
from embedding_operator.jobs.pods import WatchedJobPods
from embedding_operator.jobs.reconcile import JobReconciler
from embedding_operator.settings import OperatorSettings

from tests.support.operator import FakeCluster


def _handlers(pods: WatchedJobPods | None = None) -> tuple[dict[str, Any], Any]:
    registry = kopf.OperatorRegistry()
    reconciler = JobReconciler(cluster=FakeCluster(), recorder=lambda *a, **k: None)
    controller = register_jobs(registry, reconciler, OperatorSettings(), pods)
    found = {h.id: h.fn for h in registry._watching.get_all_handlers()}
    return found, controller


def _job(owner_kind: str, owner: str = "corpus") -> dict[str, Any]:
    return {
        "kind": "Job",
        "metadata": {
            "name": f"{owner}-work",
            "namespace": "team",
            "ownerReferences": [
                {
                    "apiVersion": "embedding-operator.dev/v1alpha1",
                    "kind": owner_kind,
                    "name": owner,
                    "uid": "u",
                    "controller": True,
                }
            ],
        },
    }


def test_jobs_and_their_owners_are_enqueued() -> None:
    handlers, controller = _handlers()
    assert set(handlers) == {
        "track-jobs",
        "embedding-job-jobs",
        "embedding-job-services",
        "embedding-job-pods",
    }

    async def events() -> None:
        body = {"metadata": {"name": "corpus", "namespace": "team"}, "spec": {"service": "m"}}
        await handlers["track-jobs"](body=body, namespace="team", name="corpus", type=None)
        await handlers["embedding-job-jobs"](body=_job("EmbeddingJob", "other"), namespace="team")
        await handlers["embedding-job-jobs"](body=_job("EmbeddingService", "svc"), namespace="team")

    asyncio.run(events())
    keys = []
    while (key := controller.queue.get_nowait()) is not None:
        keys.append(key)
    assert sorted(keys) == [("team", "corpus"), ("team", "other")]


def test_a_service_event_wakes_the_unfinished_jobs_that_name_it() -> None:
    """A service turning Ready starts the waiting job's workers now, not at its next retry;
    a finished job, or one naming another service, is left alone."""
    handlers, controller = _handlers()

    def job(name: str, service: str, phase: str | None = None) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "namespace": "team"},
            "spec": {"service": service},
            "status": {"phase": phase} if phase else {},
        }

    async def events() -> None:
        for name, service, phase in (
            ("waits", "minilm", "Pending"),
            ("done", "minilm", "Complete"),
            ("other", "bge", None),
        ):
            body = job(name, service, phase)
            await handlers["track-jobs"](body=body, namespace="team", name=name, type=None)
        while (key := controller.queue.get_nowait()) is not None:
            controller.queue.done(key)
        await handlers["embedding-job-services"](namespace="team", name="minilm")

    asyncio.run(events())
    assert controller.queue.get_nowait() == ("team", "waits")
    assert controller.queue.get_nowait() is None


def test_a_terminated_job_pod_is_kept_and_wakes_its_job() -> None:
    pods = WatchedJobPods()
    handlers, controller = _handlers(pods)
    labels = {"app.kubernetes.io/instance": "corpus", "app.kubernetes.io/component": "worker"}

    def pod(state: dict[str, Any]) -> dict[str, Any]:
        return {
            "metadata": {"name": "corpus-work-0-x", "namespace": "team", "labels": labels},
            "spec": {"containers": [{"name": "job", "image": "big" * 100}]},
            "status": {"phase": "Running", "containerStatuses": [{"name": "job", "state": state}]},
        }

    async def events() -> None:
        await handlers["embedding-job-pods"](
            body=pod({"running": {}}), labels=labels, namespace="team", type=None
        )
        assert controller.queue.get_nowait() is None  # still running: nothing to read yet
        done = pod({"terminated": {"exitCode": 0, "message": '{"shard": 0}'}})
        await handlers["embedding-job-pods"](body=done, labels=labels, namespace="team", type=None)

    asyncio.run(events())
    assert controller.queue.get_nowait() == ("team", "corpus")
    (kept,) = pods.pods("team", "corpus", "worker")
    assert "spec" not in kept  # only what the reconcile reads
    state = kept["status"]["containerStatuses"][0]["state"]
    assert state["terminated"]["message"] == '{"shard": 0}'
    pods.forget("team", "corpus")
    assert pods.pods("team", "corpus", "worker") == []


def test_a_pod_blocked_on_a_missing_secret_wakes_its_job_when_blocked_and_when_freed() -> None:
    """SecretNotFound is reported as soon as the kubelet says the pod cannot start, and
    cleared as soon as it starts (the Secret created), not at the next resync: the pod's
    change of state enqueues its job, its other events while it waits do not."""
    pods = WatchedJobPods()
    handlers, controller = _handlers(pods)
    labels = {"app.kubernetes.io/instance": "corpus", "app.kubernetes.io/component": "worker"}
    blocked = {"waiting": {"reason": "CreateContainerConfigError", "message": "secret x"}}

    def pod(state: dict[str, Any]) -> dict[str, Any]:
        return {
            "metadata": {"name": "corpus-work-0-x", "namespace": "team", "labels": labels},
            "status": {"phase": "Pending", "containerStatuses": [{"name": "job", "state": state}]},
        }

    def woken() -> list[Any]:
        keys = []
        while (key := controller.queue.get_nowait()) is not None:
            keys.append(key)
            controller.queue.done(key)
        return keys

    async def event(state: dict[str, Any], type: str | None = None) -> None:
        await handlers["embedding-job-pods"](
            body=pod(state), labels=labels, namespace="team", type=type
        )

    asyncio.run(event({"waiting": {"reason": "ContainerCreating"}}))
    assert woken() == []
    asyncio.run(event(blocked))
    assert woken() == [("team", "corpus")], "blocked: the status says SecretNotFound now"
    asyncio.run(event(blocked))
    assert woken() == [], "still blocked: nothing new to say"
    asyncio.run(event({"running": {}}))
    assert woken() == [("team", "corpus")], "the Secret is there: the status says so now"
    asyncio.run(event(blocked))
    assert woken() == [("team", "corpus")]
    asyncio.run(event(blocked, type="DELETED"))
    assert woken() == [("team", "corpus")], "a blocked pod gone: the problem may be too"


def test_the_job_controller_is_counted_beside_the_service_controller() -> None:
    """One /metrics: controller-runtime's series for both controllers, told apart by their
    controller (and work-queue name) label; deleting a job forgets no service's series."""
    from embedding_operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    registry = kopf.OperatorRegistry()
    reconciler = JobReconciler(cluster=FakeCluster(), recorder=lambda *a, **k: None)
    controller = register_jobs(registry, reconciler, OperatorSettings(), metrics=metrics)
    controller.metrics.reconciled("success", 0.01, "embeddingjob")
    sample = metrics.registry.get_sample_value
    assert sample(
        "controller_runtime_reconcile_total", {"controller": "embeddingjob", "result": "success"}
    )
    assert (
        sample(
            "controller_runtime_reconcile_total",
            {"controller": "embeddingservice", "result": "success"},
        )
        == 0
    )
    assert sample("workqueue_depth", {"name": "embeddingjob"}) == 0
    assert sample("workqueue_depth", {"name": "embeddingservice"}) == 0
    assert sample("controller_runtime_max_concurrent_reconciles", {"controller": "embeddingjob"})

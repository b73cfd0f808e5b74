"""The operator's /metrics: what a platform team's controller-runtime dashboards and alerts
read, counted from real reconciles, the work queue and the status the operator wrote."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import pytest
import urllib3
from embedding_operator.controller import Controller
from embedding_operator.kube import ApiError, KubeCluster, ObjectRef
from embedding_operator.metrics import OperatorMetrics, serve
from embedding_operator.profiles import GpuProfiles
from embedding_operator.reconcile import Reconciler
from embedding_operator.status import SERVER_MODEL_LOAD_FAILED
from embedding_operator.workqueue import RateLimitingQueue
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness.proc import free_port
from tests.operator.test_op_workqueue import FINE, RETRY, Clock, Scripted, _api_error, _until
from tests.support.operator import FakeCluster

SERVICE = {"model": {"name": "BAAI/bge-small-en-v1.5"}, "replicas": 2}


def samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as a scrape shows it: (name, sorted labels) -> value."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: OperatorMetrics, metric: str, /, **labels: str) -> float | None:
    return samples(metrics).get((metric, tuple(sorted(labels.items()))))


def test_reconciles_are_counted_by_result_under_controller_runtimes_names() -> None:
    metrics = OperatorMetrics()
    assert (
        value(
            metrics,
            "controller_runtime_reconcile_total",
            controller="embeddingservice",
            result="error",
        )
        == 0
    )
    reconciler = Scripted([lambda: RETRY, _api_error, lambda: FINE])
    reconciler.gate.set()
    queue: RateLimitingQueue[tuple[str, str]] = RateLimitingQueue(clock=Clock())
    controller = Controller(
        reconciler, resync_seconds=3600, workers=3, queue=queue, metrics=metrics
    )
    key = ("ns", "emb")

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        for retries in (1, 2):
            controller.enqueue(*key)
            await _until(lambda r=retries: queue.num_requeues(key) == r, f"retry {retries}")
        controller.enqueue(*key)
        await _until(lambda: reconciler.calls == 3 and queue.num_requeues(key) == 0, "success")
        stop.set()
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(main())
    ours = {"controller": "embeddingservice"}
    for result in ("success", "error", "requeue"):
        assert value(metrics, "controller_runtime_reconcile_total", **ours, result=result) == 1
    assert value(metrics, "controller_runtime_reconcile_errors_total", **ours) == 1
    assert value(metrics, "controller_runtime_reconcile_time_seconds_count", **ours) == 3
    assert value(metrics, "controller_runtime_max_concurrent_reconciles", **ours) == 3
    assert value(metrics, "controller_runtime_active_workers", **ours) == 0
    assert value(metrics, "workqueue_retries_total", name="embeddingservice") == 2
    assert value(metrics, "workqueue_adds_total", name="embeddingservice") == 3
    assert value(metrics, "workqueue_depth", name="embeddingservice") == 0


def test_queue_depth_and_the_longest_running_reconcile() -> None:
    clock = Clock()
    queue: RateLimitingQueue[str] = RateLimitingQueue(clock=clock)
    metrics = OperatorMetrics()
    metrics.watch_queue(queue.stats, workers=2)
    queue.add("a")
    assert queue.get_nowait() == "a"
    clock.now += 7.0
    queue.add("b")
    assert queue.get_nowait() == "b"
    clock.now += 2.0
    queue.add("a")  # an event for "a" while it is reconciled: waits for it, counts as depth
    queue.add("c")
    queue.add("c")  # already waiting: not an add
    name = {"name": "embeddingservice"}
    assert value(metrics, "workqueue_depth", **name) == 2
    assert value(metrics, "workqueue_adds_total", **name) == 4
    assert value(metrics, "workqueue_longest_running_processor_seconds", **name) == 9.0
    assert value(metrics, "workqueue_unfinished_work_seconds", **name) == 9.0 + 2.0
    queue.done("a")
    queue.done("b")
    assert value(metrics, "workqueue_longest_running_processor_seconds", **name) == 0


def test_how_long_keys_waited_in_the_queue() -> None:
    clock = Clock()
    queue: RateLimitingQueue[str] = RateLimitingQueue(clock=clock)
    metrics = OperatorMetrics()
    Controller(Scripted([]), resync_seconds=3600, workers=1, queue=queue, metrics=metrics)
    name = {"name": "embeddingservice"}
    queue.add("a")
    clock.now += 0.3
    queue.add("b")
    queue.add("a")  # already waiting: still counted from its first add
    clock.now += 4.0
    assert queue.get_nowait() == "a" and queue.get_nowait() == "b"
    assert value(metrics, "workqueue_queue_duration_seconds_count", **name) == 2
    assert value(metrics, "workqueue_queue_duration_seconds_sum", **name) == pytest.approx(8.3)
    assert value(metrics, "workqueue_queue_duration_seconds_bucket", **name, le="5.0") == 2
    assert value(metrics, "workqueue_queue_duration_seconds_bucket", **name, le="2.5") == 0


class _Response:
    def __init__(self, status: int, body: object) -> None:
        self.status, self.reason, self._body = status, "", json.dumps(body).encode()

    def read(self) -> bytes:
        return self._body


class _ApiClient:
    """The two calls ``KubeCluster`` makes of kubernetes' ApiClient, answering from a script
    of (method, path) -> (status, body), or raising what the script holds."""

    def __init__(self, script: dict[tuple[str, str], tuple[int, object] | Exception]) -> None:
        self.script = script

    def param_serialize(self, *, method: str, resource_path: str, **_: object) -> tuple[Any, ...]:
        return method, resource_path, {}, None, []

    def call_api(self, method: str, url: str, **_: object) -> _Response:
        answer = self.script[(method, url)]
        if isinstance(answer, Exception):
            raise answer
        return _Response(*answer)


def test_every_api_request_is_counted_by_verb_resource_and_status() -> None:
    dep = "/apis/apps/v1/namespaces/team/deployments/emb"
    owner = "/apis/embedding-operator.dev/v1alpha1/namespaces/team/embeddingservices/emb"
    client = _ApiClient(
        {
            ("GET", dep): (404, {"message": "not found"}),
            ("PATCH", dep): (201, {"metadata": {"name": "emb"}}),
            ("GET", "/api/v1/namespaces/team/pods"): (200, {"items": []}),
            ("PATCH", f"{owner}/status"): (200, {}),
            ("POST", "/api/v1/namespaces/team/events"): urllib3.exceptions.ReadTimeoutError(
                None, "/api/v1/namespaces/team/events", "read timed out"
            ),
        }
    )
    metrics = OperatorMetrics()
    cluster = KubeCluster(client, observe=metrics.requested)
    ref = ObjectRef("apps/v1", "Deployment", "team", "emb")
    assert cluster.get(ref) is None
    cluster.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"namespace": "team", "name": "emb"},
        }
    )
    assert cluster.list_pods("team", "app=x") == []
    kind = ("embedding-operator.dev/v1alpha1", "EmbeddingService")
    cluster.patch_status(ObjectRef(*kind, "team", "emb"), {})
    try:
        cluster.create({"apiVersion": "v1", "kind": "Event", "metadata": {"namespace": "team"}})
    except ApiError as exc:
        assert exc.status == 0
    else:
        raise AssertionError("a timed-out request must raise")
    requests = "embedding_operator_api_requests_total"
    assert value(metrics, requests, verb="get", resource="deployments", code="404") == 1
    assert value(metrics, requests, verb="apply", resource="deployments", code="201") == 1
    assert value(metrics, requests, verb="list", resource="pods", code="200") == 1
    assert (
        value(metrics, requests, verb="patch", resource="embeddingservices/status", code="200") == 1
    )
    assert value(metrics, requests, verb="create", resource="events", code="<error>") == 1
    assert sum(v for (n, _), v in samples(metrics).items() if n == requests) == 5, (
        "one count per request, no more"
    )
    latency = "embedding_operator_api_request_duration_seconds_count"
    assert value(metrics, latency, verb="get") == 1 and value(metrics, latency, verb="apply") == 1


def test_a_refusal_in_a_terminating_namespace_is_told_apart() -> None:
    """The API server's Status for a create in a namespace being deleted carries the
    ``NamespaceTerminating`` cause; other refusals (a plain RBAC 403) do not."""
    dep = "/apis/apps/v1/namespaces/team/deployments/emb"
    terminating = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": 'deployments.apps "emb" is forbidden: unable to create new content in '
        "namespace team because it is being terminated",
        "reason": "Forbidden",
        "details": {
            "name": "emb",
            "group": "apps",
            "kind": "deployments",
            "causes": [
                {
                    "reason": "NamespaceTerminating",
                    "message": "namespace team is being terminated",
                    "field": "metadata.namespace",
                }
            ],
        },
        "code": 403,
    }
    rbac = {
        "kind": "Status",
        "status": "Failure",
        "message": 'deployments.apps "emb" is forbidden: User "x" cannot patch resource',
        "reason": "Forbidden",
        "details": {"name": "emb", "group": "apps", "kind": "deployments"},
        "code": 403,
    }
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"namespace": "team", "name": "emb"},
    }
    for body, expected in ((terminating, True), (rbac, False)):
        cluster = KubeCluster(_ApiClient({("PATCH", dep): (403, body)}))
        try:
            cluster.apply(manifest)
        except ApiError as exc:
            assert exc.status == 403 and exc.message == body["message"]
            assert exc.namespace_terminating is expected
        else:
            raise AssertionError("a 403 must raise")
    plain = KubeCluster(_ApiClient({("PATCH", dep): (502, "<html>bad gateway</html>")}))
    try:
        plain.apply(manifest)
    except ApiError as exc:
        assert exc.status == 502 and not exc.namespace_terminating
    else:
        raise AssertionError("a 502 must raise")


def test_children_written_and_each_services_conditions_and_replicas() -> None:
    cluster = FakeCluster()
    cluster.add(
        {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingService",
            "metadata": {"name": "emb", "namespace": "team", "uid": "u1", "generation": 1},
            "spec": SERVICE,
        }
    )
    metrics = OperatorMetrics()
    reconciler = Reconciler(
        cluster=cluster,
        profiles=GpuProfiles.builtin(),
        default_image="img:1",
        recorder=lambda body, **_: None,
        metrics=metrics,
    )
    reconciler.reconcile("team", "emb")
    writes = "embedding_operator_child_writes_total"
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        assert value(metrics, writes, kind=kind, operation="apply") == 1, kind
    svc = {"namespace": "team", "service": "emb"}
    condition = "embedding_operator_service_condition"
    assert (
        value(metrics, condition, **svc, type="Ready", status="False", reason="RolloutInProgress")
        == 1
    )
    assert (
        value(metrics, condition, **svc, type="Degraded", status="False", reason="AsExpected") == 1
    )
    replicas = "embedding_operator_service_replicas"
    assert value(metrics, replicas, **svc, state="desired") == 2
    assert value(metrics, replicas, **svc, state="ready") == 0
    assert value(metrics, replicas, **svc, state="max") is None  # no autoscaling, no bounds

    reconciler.reconcile("team", "emb")  # nothing changed: nothing written again
    assert value(metrics, writes, kind="Deployment", operation="apply") == 1

    restarts = "embedding_operator_server_restarts_total"
    assert value(metrics, restarts, **svc, reason="ModelLoadFailed") == 0  # there before any

    metrics.forget("team", "emb")  # the EmbeddingService was deleted
    left = {key[0] for key in samples(metrics) if ("service", "emb") in key[1]}
    assert not left, left


def _pod(restarts: int, message: str = "", reason: str = "Error") -> dict[str, Any]:
    last = {"terminated": {"exitCode": 1, "reason": reason, "message": message}}
    return {
        "metadata": {"name": "emb-7d4b9c8f5b-x2x9q", "namespace": "team"},
        "status": {
            "containerStatuses": [
                {"name": "server", "restartCount": restarts, "lastState": last if restarts else {}}
            ]
        },
    }


def test_restarts_are_counted_by_why_the_server_ended() -> None:
    metrics = OperatorMetrics()
    svc = {"namespace": "team", "service": "emb"}
    restarts = "embedding_operator_server_restarts_total"
    # First sight of a pod that restarted before this operator started: a baseline.
    metrics.pod("team", "emb", _pod(4, reason="OOMKilled"), deleted=False)
    assert value(metrics, restarts, **svc, reason="OOMKilled") is None
    metrics.pod("team", "emb", _pod(5, reason="OOMKilled"), deleted=False)
    assert value(metrics, restarts, **svc, reason="OOMKilled") == 1
    # The server's termination message says its model would not load.
    load = f"{SERVER_MODEL_LOAD_FAILED}; the log says why"
    metrics.pod("team", "emb", _pod(7, message=load), deleted=False)
    assert value(metrics, restarts, **svc, reason="ModelLoadFailed") == 2
    metrics.pod("team", "emb", _pod(7, message=load), deleted=False)  # an unrelated update
    assert value(metrics, restarts, **svc, reason="ModelLoadFailed") == 2
    metrics.pod("team", "emb", _pod(7), deleted=True)
    metrics.pod("team", "emb", _pod(8), deleted=False)  # same name again: a new baseline
    assert value(metrics, restarts, **svc, reason="Error") is None


def test_metrics_are_served_over_http() -> None:
    port = free_port()
    metrics = OperatorMetrics()
    metrics.leader.set(1)
    server = serve(metrics, port, host="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
    assert "embedding_operator_leader 1.0" in text
    assert (
        'controller_runtime_reconcile_total{controller="embeddingservice",result="success"}' in text
    )
    assert 'workqueue_depth{name="embeddingservice"} 0.0' in text

"""The operator's own Prometheus metrics, under controller-runtime's names where they fit.

Platform teams already have dashboards and alerts for Go operators built on
controller-runtime; naming the same things the same way lets those work here unchanged:

* ``controller_runtime_reconcile_total{controller, result}``: reconciles by result,
  ``success``, ``error`` (an API error: retried with backoff) or ``requeue`` (a problem that
  may fix itself, such as a Secret not created yet: retried with backoff);
  ``controller_runtime_reconcile_errors_total{controller}``;
  ``controller_runtime_reconcile_panics_total{controller}`` (a reconcile that raised an
  unexpected exception: a bug, logged with its traceback and retried with backoff);
  ``controller_runtime_reconcile_time_seconds{controller}`` (a histogram);
  ``controller_runtime_active_workers`` and ``controller_runtime_max_concurrent_reconciles``;
* ``workqueue_depth``, ``workqueue_adds_total``, ``workqueue_retries_total``,
  ``workqueue_longest_running_processor_seconds`` and ``workqueue_unfinished_work_seconds``,
  labelled ``name``, read from the work queue at each scrape (``workqueue.py``);
  ``workqueue_queue_duration_seconds{name}`` (a histogram): how long a key waited in the
  queue before a worker took it, the first thing to read when reconciles fall behind.

And what only this operator knows:

* ``embedding_operator_api_requests_total{verb, resource, code}``: every Kubernetes API request
  the operator made (reconciles, Events, the leader Lease; not kopf's watches), by the API
  server's verb (``get``, ``list``, ``apply``, ``patch``, ``create``, ``update``,
  ``delete``), resource (``deployments``, ``embeddingservices/status``...) and HTTP status
  (``<error>``: no answer); with ``controller_runtime_reconcile_total`` it gives the calls a
  reconcile costs, so a change that adds reads or writes to every reconcile shows;
  ``embedding_operator_api_request_duration_seconds{verb}`` (a histogram): their latency as
  the operator waited for them (the API server's answer, and any wait for a connection);
* ``embedding_operator_child_writes_total{kind, operation}``: children written (``apply``) or
  deleted (``delete``) by kind; steady state writes nothing, so a rate that stays up is drift
  someone keeps re-introducing, or a bug;
* ``embedding_operator_service_condition{namespace, service, type, status, reason}``: 1 for
  each condition of each EmbeddingService as its status says it, like kube-state-metrics'
  condition gauges (without kube-state-metrics, which cannot read custom resources'
  conditions by default);
* ``embedding_operator_service_replicas{namespace, service, state}``: ``desired`` (what the
  autoscaler or ``spec.replicas`` asks), ``current``, ``ready``, and with autoscaling ``min``
  and ``max``: replicas against their target on a dashboard;
* ``embedding_operator_service_autoscaling_target{namespace, service, metric}``: the per-pod
  target of the metric the autoscaler scales on (an alert compares the pods' average to it);
* ``embedding_operator_server_restarts_total{namespace, service, reason}``: server container
  restarts this operator saw happen (from the pod watch), by why the container last ended:
  ``ModelLoadFailed`` (the server's termination message says so), ``OOMKilled``, ``Error``...;
  the first sight of a pod is its baseline, so an operator restart counts nothing twice;
* ``embedding_operator_leader``: 1 while this replica reconciles (holds the Lease).

Per-service series carry ``namespace`` (the EmbeddingService's) and ``service`` (its name, as
the dashboards derive it from server pod names), so scrape the operator with
``honor_labels: true``, as kube-state-metrics is (the chart's PodMonitor does): otherwise
Prometheus renames ``namespace`` to ``exported_namespace``. They are set by each reconcile and
dropped when the EmbeddingService is deleted. A standby replica serves the same endpoint with
zero counts and ``leader`` 0.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from embedding_operator.spec import EmbeddingServiceSpec
from embedding_operator.status import restart_reason

CONTROLLER = "embeddingservice"
"""The ``controller`` label (controller-runtime's: the lowercased kind) and the work queue's
``name``."""

RESULTS = ("success", "error", "requeue")
RESTART_REASONS = ("ModelLoadFailed", "OOMKilled", "Error")
"""Restart reasons whose series exist (at 0) for every service, so alerts read them before
the first restart; others appear when they happen."""

# controller-runtime's buckets for reconcile_time_seconds (pkg/internal/controller/metrics).
_RECONCILE_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.15,
    0.2,
    0.25,
    0.3,
    0.35,
    0.4,
    0.45,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    1.0,
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    4.5,
    5.0,
    6.0,
    7.0,
    8.0,
    9.0,
    10.0,
    15.0,
    20.0,
    25.0,
    30.0,
    40.0,
    50.0,
    60.0,
)
# client-go's buckets for rest_client_request_duration_seconds.
_REQUEST_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
# A key's wait in the queue: milliseconds when idle, minutes when a batch floods it.
_QUEUE_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class QueueStats:
    """What the work queue holds now (``RateLimitingQueue.stats``)."""

    depth: int
    adds: int
    retries: int
    longest_running_seconds: float
    unfinished_seconds: float


@dataclass(frozen=True)
class ServiceState:
    """One EmbeddingService as its last reconcile left its status."""

    conditions: tuple[tuple[str, str, str], ...]  # (type, status, reason)
    replicas: Mapping[str, int]
    target: tuple[str, float] | None = None  # (metric, per-pod target) while autoscaling


def service_state(status: Mapping[str, Any], spec: EmbeddingServiceSpec | None) -> ServiceState:
    """The series of one EmbeddingService, from the status a reconcile computed (and its
    parsed spec, when valid: ``spec.replicas`` and the autoscaling bounds)."""
    conditions = tuple(
        (str(c.get("type")), str(c.get("status")), str(c.get("reason") or ""))
        for c in status.get("conditions") or []
    )
    replicas = {
        "current": int(status.get("replicas") or 0),
        "ready": int(status.get("readyReplicas") or 0),
    }
    auto = status.get("autoscaling")
    if auto is not None and "desiredReplicas" in auto:
        replicas["desired"] = int(auto["desiredReplicas"])
    elif spec is not None and not spec.autoscaling.enabled:
        replicas["desired"] = int(spec.replicas)
    if spec is not None and spec.autoscaling.enabled:
        replicas["min"] = int(spec.autoscaling.min_replicas)
        replicas["max"] = int(spec.autoscaling.max_replicas)
    target = (str(auto["metric"]), float(auto["target"])) if auto is not None else None
    return ServiceState(conditions, replicas, target)


class OperatorMetrics:
    """Every metric of one operator process, on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.reconciles = Counter(
            "controller_runtime_reconcile_total",
            "Total number of reconciliations per controller.",
            ["controller", "result"],
            registry=r,
        )
        self.reconcile_errors = Counter(
            "controller_runtime_reconcile_errors_total",
            "Total number of reconciliation errors per controller.",
            ["controller"],
            registry=r,
        )
        self.reconcile_panics = Counter(
            "controller_runtime_reconcile_panics_total",
            "Total number of reconciliation panics per controller.",
            ["controller"],
            registry=r,
        )
        self.reconcile_time = Histogram(
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation per controller.",
            ["controller"],
            buckets=_RECONCILE_BUCKETS,
            registry=r,
        )
        self.active_workers = Gauge(
            "controller_runtime_active_workers",
            "Number of currently used workers per controller.",
            ["controller"],
            registry=r,
        )
        self.max_workers = Gauge(
            "controller_runtime_max_concurrent_reconciles",
            "Maximum number of concurrent reconciles per controller.",
            ["controller"],
            registry=r,
        )
        self.api_requests = Counter(
            "embedding_operator_api_requests_total",
            "Kubernetes API requests the operator made, by verb, resource and HTTP status "
            "(<error>: no answer).",
            ["verb", "resource", "code"],
            registry=r,
        )
        self.api_request_time = Histogram(
            "embedding_operator_api_request_duration_seconds",
            "Latency of the operator's Kubernetes API requests, by verb.",
            ["verb"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "workqueue_queue_duration_seconds",
            "How long in seconds an item stays in workqueue before being requested.",
            ["name"],
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self.child_writes = Counter(
            "embedding_operator_child_writes_total",
            "Children of EmbeddingServices written (operation apply) or deleted (delete), by kind.",
            ["kind", "operation"],
            registry=r,
        )
        self.restarts = Counter(
            "embedding_operator_server_restarts_total",
            "Server container restarts the operator saw, by why the container last ended "
            "(ModelLoadFailed: its model would not load; else the kubelet's reason).",
            ["namespace", "service", "reason"],
            registry=r,
        )
        self.leader = Gauge(
            "embedding_operator_leader",
            "1 while this replica reconciles (it holds the leader Lease, or runs without "
            "leader election), 0 while it stands by.",
            registry=r,
        )
        # Series exist from the start, at zero: a rate() over them answers before the first
        # error, as controller-runtime's do.
        self._lock = threading.Lock()
        self._services: dict[tuple[str, str], ServiceState] = {}
        self._pod_restarts: dict[tuple[str, str], int] = {}
        self._queue_stats: dict[str, Callable[[], QueueStats]] = {}
        self.controller_series(CONTROLLER)
        r.register(_Collected(self))

    def controller_series(self, controller: str) -> None:
        """Create a controller's work-path series at zero: a rate() over them answers
        before its first error, as controller-runtime's do."""
        for result in RESULTS:
            self.reconciles.labels(controller, result)
        self.reconcile_errors.labels(controller)
        self.reconcile_panics.labels(controller)
        self.active_workers.labels(controller)
        self.max_workers.labels(controller)
        self.queue_time.labels(controller)

    # -- the work path ----------------------------------------------------------------------
    def reconciled(
        self, result: str, seconds: float, controller: str = CONTROLLER, *, panicked: bool = False
    ) -> None:
        """One reconcile ended with ``result`` (one of :data:`RESULTS`) after ``seconds``;
        ``panicked``: by an unexpected exception (a bug), an ``error`` counted as a panic too."""
        self.reconciles.labels(controller, result).inc()
        if result == "error":
            self.reconcile_errors.labels(controller).inc()
        if panicked:
            self.reconcile_panics.labels(controller).inc()
        self.reconcile_time.labels(controller).observe(seconds)

    def requested(self, verb: str, resource: str, code: str, seconds: float) -> None:
        """One API request ended (``kube.RequestObserver``; called from worker threads)."""
        self.api_requests.labels(verb, resource, code).inc()
        self.api_request_time.labels(verb).observe(seconds)

    def queued(self, seconds: float, controller: str = CONTROLLER) -> None:
        """A worker took a key that had waited ``seconds`` in the queue."""
        self.queue_time.labels(controller).observe(seconds)

    def wrote(self, kind: str, operation: str) -> None:
        self.child_writes.labels(kind, operation).inc()

    def watch_queue(
        self, stats: Callable[[], QueueStats], workers: int, controller: str = CONTROLLER
    ) -> None:
        """Read the work queue's state at each scrape (``stats`` must be safe to call from
        the scraping thread)."""
        if controller != CONTROLLER:
            self.controller_series(controller)
        self._queue_stats[controller] = stats
        self.max_workers.labels(controller).set(workers)

    # -- per service ------------------------------------------------------------------------
    def service(self, namespace: str, name: str, state: ServiceState) -> None:
        with self._lock:
            new = (namespace, name) not in self._services
            self._services[(namespace, name)] = state
        if new:
            for reason in RESTART_REASONS:
                self.restarts.labels(namespace, name, reason)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._services.pop((namespace, name), None)
        for labels in [
            labels for labels in _label_sets(self.restarts) if labels[:2] == (namespace, name)
        ]:
            self.restarts.remove(*labels)

    def pod(self, namespace: str, service: str, pod: Mapping[str, Any], deleted: bool) -> None:
        """A server pod as the watch reports it: count the restarts since it was last seen."""
        key = (namespace, str((pod.get("metadata") or {}).get("name", "")))
        if deleted:
            with self._lock:
                self._pod_restarts.pop(key, None)
            return
        containers = (pod.get("status") or {}).get("containerStatuses") or []
        total = sum(int(c.get("restartCount") or 0) for c in containers)
        with self._lock:
            before = self._pod_restarts.get(key)
            self._pod_restarts[key] = total
        if before is None or total <= before:
            return  # first sight (a baseline), or nothing new
        reasons = [
            restart_reason((c.get("lastState") or {}).get("terminated") or {})
            for c in containers
            if (c.get("lastState") or {}).get("terminated")
        ]
        self.restarts.labels(namespace, service, reasons[0] if reasons else "Unknown").inc(
            total - before
        )

    def _snapshot(self) -> dict[tuple[str, str], ServiceState]:
        with self._lock:
            return dict(self._services)

    def _collect(self) -> Iterator[Metric]:
        conditions = GaugeMetricFamily(
            "embedding_operator_service_condition",
            "1 for each condition an EmbeddingService's status holds (type, status, reason).",
            labels=["namespace", "service", "type", "status", "reason"],
        )
        replicas = GaugeMetricFamily(
            "embedding_operator_service_replicas",
            "Replicas of an EmbeddingService: desired (as the autoscaler or spec.replicas "
            "asks), current, ready, and with autoscaling min and max.",
            labels=["namespace", "service", "state"],
        )
        targets = GaugeMetricFamily(
            "embedding_operator_service_autoscaling_target",
            "The per-pod target of the metric an EmbeddingService's autoscaler scales on.",
            labels=["namespace", "service", "metric"],
        )
        for (namespace, name), state in sorted(self._snapshot().items()):
            for type_, status, reason in state.conditions:
                conditions.add_metric([namespace, name, type_, status, reason], 1.0)
            for which, count in sorted(state.replicas.items()):
                replicas.add_metric([namespace, name, which], float(count))
            if state.target is not None:
                targets.add_metric([namespace, name, state.target[0]], state.target[1])
        yield conditions
        yield replicas
        yield targets
        # The EmbeddingService queue's series exist from the start, as they always have.
        queues = {CONTROLLER: lambda: QueueStats(0, 0, 0, 0.0, 0.0), **self._queue_stats}
        snapshots = {name: stats() for name, stats in sorted(queues.items())}
        labels = ["name"]
        for family in (
            GaugeMetricFamily("workqueue_depth", "Current depth of workqueue.", labels=labels),
            GaugeMetricFamily(
                "workqueue_longest_running_processor_seconds",
                "How many seconds has the longest running processor for workqueue been running.",
                labels=labels,
            ),
            GaugeMetricFamily(
                "workqueue_unfinished_work_seconds",
                "How many seconds of work has been done that is in progress and hasn't been "
                "observed by work_duration.",
                labels=labels,
            ),
        ):
            for name, stats in snapshots.items():
                value = {
                    "workqueue_depth": float(stats.depth),
                    "workqueue_longest_running_processor_seconds": stats.longest_running_seconds,
                    "workqueue_unfinished_work_seconds": stats.unfinished_seconds,
                }[family.name]
                family.add_metric([name], value)
            yield family
        adds = CounterMetricFamily(
            "workqueue_adds", "Total number of adds handled by workqueue.", labels=labels
        )
        retries = CounterMetricFamily(
            "workqueue_retries", "Total number of retries handled by workqueue.", labels=labels
        )
        for name, stats in snapshots.items():
            adds.add_metric([name], float(stats.adds))
            retries.add_metric([name], float(stats.retries))
        yield adds
        yield retries


def _label_sets(counter: Counter) -> list[tuple[str, ...]]:
    """The label values of every child of a labelled metric."""
    return [
        tuple(sample.labels[name] for name in ("namespace", "service", "reason"))
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    ]


class _Collected:
    """The metrics computed at scrape time (per-service series, the work queue's state)."""

    def __init__(self, metrics: OperatorMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics._collect()

    def describe(self) -> list[Metric]:
        return []  # computed at scrape time: nothing to check for name clashes up front


def serve(metrics: OperatorMetrics, port: int, host: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the server."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return server

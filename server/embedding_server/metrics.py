"""Prometheus metrics, defined once.

The engine and the HTTP layer both record into these. The autoscaling signals are
``embedding_server_backlog_seconds`` (the work queued and running, in seconds at the rate the
model has measured recently), ``embedding_server_queue_requests`` and
``embedding_server_queue_tokens``: the operator's HPA or KEDA ScaledObject scales on one of
them, so those names are part of the operator contract and must not change casually.

A server that is not ready (loading its model, draining, failed) leaves the autoscaling
signals out of ``/metrics`` (:data:`AUTOSCALING_METRICS`, ``routes_ops``): a loading replica
has no traffic, and a 0 from it would lower the average an HPA scales on and so feed a
scale-down (superlinked/sie#293 is a user hit by that). Absent, the HPA counts such a pod
at the target when scaling down and at 0 when scaling up, and KEDA's sum over pods does not
see it at all. ``embedding_server_loading`` says instead that a replica is still loading.

With ``--api-workers N`` the server is several processes: N front-ends count requests and
one engine process owns the queue. Then prometheus_client's multiprocess mode is on
(``PROMETHEUS_MULTIPROC_DIR`` is set before any process imports prometheus_client): every
process writes its samples to files there, and ``/metrics`` of any front-end reads them all
(:attr:`Metrics.exposition`), counters and histograms summed, in-flight requests summed over
the live processes, and the queue gauges the engine's (the largest over live processes; a
front-end's copy stays 0).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

PREFIX = "embedding_server"

QUEUE_REQUESTS_METRIC = f"{PREFIX}_queue_requests"
QUEUE_TOKENS_METRIC = f"{PREFIX}_queue_tokens"
BACKLOG_SECONDS_METRIC = f"{PREFIX}_backlog_seconds"
LOADING_METRIC = f"{PREFIX}_loading"
GOLDEN_MIN_COSINE_METRIC = f"{PREFIX}_golden_min_cosine"
AUTOSCALING_METRICS = frozenset(
    {QUEUE_REQUESTS_METRIC, QUEUE_TOKENS_METRIC, BACKLOG_SECONDS_METRIC}
)
"""The gauges autoscalers read: exported only while the server is ready."""

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's own variable: set, every process of the server shares its samples."""

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class Metrics:
    """All server metrics, registered on one registry (a fresh one per server in tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        shared_dir = os.environ.get(MULTIPROCESS_DIR_ENV)
        self.exposition = r
        """What ``/metrics`` renders: this registry, or every process's samples."""
        if shared_dir:
            self.exposition = CollectorRegistry()
            MultiProcessCollector(self.exposition, path=shared_dir)  # type: ignore[no-untyped-call]
        self.queue_requests = Gauge(
            QUEUE_REQUESTS_METRIC,
            "Requests admitted and waiting for a forward pass.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.queue_tokens = Gauge(
            QUEUE_TOKENS_METRIC,
            "Tokens admitted and waiting for a forward pass.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.backlog_seconds = Gauge(
            BACKLOG_SECONDS_METRIC,
            "Seconds of work waiting: tokens queued and running over the tokens per second "
            "the model measured recently (a decaying average of batch tokens over batch "
            "seconds; one batch budget per second before the first batch). Absent while the "
            "server is not ready.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.in_flight = Gauge(
            f"{PREFIX}_in_flight_requests",
            "HTTP requests being handled now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_seconds",
            "Seconds from a request's arrival to its response's first byte, by endpoint.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._request_seconds_children: dict[str, Histogram] = {}
        self.input_tokens = Counter(
            f"{PREFIX}_input_tokens", "Tokens of all inputs embedded.", registry=r
        )
        self.truncated_inputs = Counter(
            f"{PREFIX}_truncated_inputs", "Inputs truncated to the maximum length.", registry=r
        )
        self.stage_seconds = Histogram(
            f"{PREFIX}_stage_seconds",
            "Per-request latency by pipeline stage.",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._stage_children: dict[str, Histogram] = {}
        self._request_children: dict[tuple[str, int], Counter] = {}
        self.batch_size = Histogram(
            f"{PREFIX}_batch_size", "Sequences per forward pass.", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            f"{PREFIX}_batch_tokens", "Tokens per forward pass.", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.batch_budget_tokens = Gauge(
            f"{PREFIX}_batch_budget_tokens",
            "Tokens one forward pass may hold (--max-batch-tokens): batch tokens over it is "
            "how full the batches run.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.batch_seconds = Histogram(
            f"{PREFIX}_batch_seconds",
            "Seconds per forward pass, pooling and batch head included. The model is busy "
            "for their sum: its rate near 1 means the model is the limit; well below 1 "
            "while requests wait elsewhere means the front end is (see --api-workers).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            f"{PREFIX}_prefix_cache_hits",
            "Sequences that ran after a prompt prefix cached by an earlier batch "
            "(--prefix-cache-bytes).",
            registry=r,
        )
        self.prefix_cache_misses = Counter(
            f"{PREFIX}_prefix_cache_misses",
            "Sequences whose prompt prefix was not cached: computed for their batch (and kept, "
            "within --prefix-cache-bytes).",
            registry=r,
        )
        self.prefix_cache_bytes = Gauge(
            f"{PREFIX}_prefix_cache_bytes",
            "Bytes the cached prompt prefixes hold (keys and values of every layer, and the "
            "final states), at most --prefix-cache-bytes.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_load_seconds = Gauge(
            f"{PREFIX}_model_load_seconds",
            "Seconds it took to load and warm up the model.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_info = Gauge(
            f"{PREFIX}_model_info",
            "1, labelled with what serves the model: backend (native, transformers or fake), "
            "model_type, architecture, attention (the kernel, or transformers' sdpa/eager) "
            "and fingerprint (the embedding fingerprint, as /info and every answer say).",
            ["backend", "model_type", "architecture", "attention", "fingerprint"],
            registry=r,
            multiprocess_mode="livemax",
        )

    def render(
        self, *, ready: bool, loading: bool, golden_min_cosine: float | None = None
    ) -> bytes:
        """What ``/metrics`` serves now: every metric, less the autoscaling gauges unless the
        server is ``ready``, plus ``embedding_server_loading`` (1 while ``loading``) and
        ``embedding_server_golden_min_cosine`` (when not None): the process's state at this
        scrape, not a sample any process wrote."""
        scrape = _Scrape(
            self.exposition, ready=ready, loading=loading, golden_min_cosine=golden_min_cosine
        )
        return generate_latest(scrape)

    # Every request observes these, and prometheus_client's ``labels()`` validates and locks
    # on each call; the labelled children are looked up once and kept.
    def observe_stage(self, stage: str, seconds: float) -> None:
        """One request's time in a pipeline stage (``stage_seconds{stage=...}``)."""
        child = self._stage_children.get(stage)
        if child is None:
            child = self._stage_children[stage] = self.stage_seconds.labels(stage)
        child.observe(seconds)

    def observe_request(self, endpoint: str, seconds: float) -> None:
        """One request's time to its response (``request_seconds{endpoint=...}``)."""
        child = self._request_seconds_children.get(endpoint)
        if child is None:
            child = self._request_seconds_children[endpoint] = self.request_seconds.labels(endpoint)
        child.observe(seconds)

    def count_request(self, endpoint: str, status: int) -> None:
        """One finished HTTP request (``requests_total{endpoint=..., status=...}``)."""
        key = (endpoint, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(endpoint, str(status))
        child.inc()


class _Scrape(CollectorRegistry):
    """One scrape's view of a registry (``Metrics.render``)."""

    def __init__(
        self,
        source: CollectorRegistry,
        *,
        ready: bool,
        loading: bool,
        golden_min_cosine: float | None = None,
    ) -> None:
        super().__init__(auto_describe=False)
        self._source = source
        self._ready = ready
        self._loading = loading
        self._golden_min_cosine = golden_min_cosine

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            if self._ready or family.name not in AUTOSCALING_METRICS:
                yield family
        yield GaugeMetricFamily(
            LOADING_METRIC,
            "1 while the server loads and warms up its model (not ready yet, not draining, "
            "not failed), else 0. KEDA keeps a service scaled to zero from scaling a "
            "loading replica away on it.",
            value=1.0 if self._loading else 0.0,
        )
        if self._golden_min_cosine is not None:
            yield GaugeMetricFamily(
                GOLDEN_MIN_COSINE_METRIC,
                "The lowest cosine, over the golden probe set, between this server's vectors "
                "and those of --golden-vectors (NaN when their dimensions differ); below "
                "--golden-min-cosine the server is not ready. Absent while nothing is "
                "compared (no file, or a model without pooled vectors).",
                value=self._golden_min_cosine,
            )

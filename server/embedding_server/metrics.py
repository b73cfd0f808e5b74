"""Prometheus metrics, defined once.

The engine and the HTTP layer both record into these. Queue depth (requests and tokens) is the
autoscaling signal: the operator's HorizontalPodAutoscaler scales on
``embedding_server_queue_requests`` (or ``embedding_server_queue_tokens``) averaged per pod, so
those names are part of the operator contract and must not change casually.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "embedding_server"

QUEUE_REQUESTS_METRIC = f"{PREFIX}_queue_requests"
QUEUE_TOKENS_METRIC = f"{PREFIX}_queue_tokens"

_LATENCY_BUCKETS = (
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
        self.queue_requests = Gauge(
            QUEUE_REQUESTS_METRIC, "Requests admitted and waiting for a forward pass.", registry=r
        )
        self.queue_tokens = Gauge(
            QUEUE_TOKENS_METRIC, "Tokens admitted and waiting for a forward pass.", registry=r
        )
        self.in_flight = Gauge(
            f"{PREFIX}_in_flight_requests", "HTTP requests being handled now.", registry=r
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
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
            buckets=_LATENCY_BUCKETS,
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
        self.model_load_seconds = Gauge(
            f"{PREFIX}_model_load_seconds",
            "Seconds it took to load and warm up the model.",
            registry=r,
        )

    # Every request observes these, and prometheus_client's ``labels()`` validates and locks
    # on each call; the labelled children are looked up once and kept.
    def observe_stage(self, stage: str, seconds: float) -> None:
        """One request's time in a pipeline stage (``stage_seconds{stage=...}``)."""
        child = self._stage_children.get(stage)
        if child is None:
            child = self._stage_children[stage] = self.stage_seconds.labels(stage)
        child.observe(seconds)

    def count_request(self, endpoint: str, status: int) -> None:
        """One finished HTTP request (``requests_total{endpoint=..., status=...}``)."""
        key = (endpoint, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(endpoint, str(status))
        child.inc()

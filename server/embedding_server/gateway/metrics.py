"""The gateway's Prometheus metrics (``GET /metrics`` on the gateway).

``embedding_gateway_held_requests{model, service}`` is the scale-from-zero signal: requests
waiting for a model with no ready endpoint (``service``: the discovery's key of the model's
service, ``namespace/name`` of its EmbeddingService with Kubernetes discovery, so an
autoscaler's query selects one service even where two namespaces serve one model name).
An HPA (external metric through the Prometheus adapter) or a KEDA ScaledObject scales the
model's service 0 -> 1 on it, and
``embedding_gateway_last_request_timestamp_seconds{model, service}`` says when a model was
last asked for (the operator's ScaledToZero status can read it). Both are part of the contract
with the chart and the operator: do not rename them casually.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from embedding_server.metrics import LATENCY_BUCKETS

PREFIX = "embedding_gateway"
HELD_REQUESTS_METRIC = f"{PREFIX}_held_requests"
LAST_REQUEST_METRIC = f"{PREFIX}_last_request_timestamp_seconds"

# The server's request-latency buckets, then up to ten minutes: a request held through a
# cold start waits minutes (--hold-timeout, 300 s, before its --request-timeout, 60 s).
_LATENCY_BUCKETS = (*LATENCY_BUCKETS, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    """All gateway metrics on one registry (a fresh one per gateway in tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests",
            'Requests answered, by model and HTTP status (unknown models count as model="").',
            ["model", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_seconds",
            "Seconds from a request's arrival at the gateway to its answer, holding included.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            f"{PREFIX}_retries",
            "Requests sent again to another endpoint, by model and reason "
            "(connection: refused, reset or closed before an answer; unavailable: a 503).",
            ["model", "reason"],
            registry=r,
        )
        self.held_requests = Gauge(
            HELD_REQUESTS_METRIC,
            "Requests held now because their model has no ready endpoint (the scale-from-zero "
            "demand signal); embedding_service: namespace/name of its EmbeddingService.",
            ["model", "embedding_service"],
            registry=r,
        )
        self.last_request = Gauge(
            LAST_REQUEST_METRIC,
            "Unix time of the last request for each model; embedding_service: namespace/name "
            "of its EmbeddingService.",
            ["model", "embedding_service"],
            registry=r,
        )
        self.decisions = Counter(
            f"{PREFIX}_routing_decisions",
            "How each attempt was routed, by model and decision: picked (of two or more ready "
            "endpoints), only (one ready endpoint), held (no ready endpoint), hold_timeout, "
            "hold_full, saturated (bulk refused with 429), shutdown (held when the gateway "
            "stopped).",
            ["model", "decision"],
            registry=r,
        )
        self.buffered_bytes = Gauge(
            f"{PREFIX}_buffered_bytes",
            "Bytes of request bodies and answers held against --max-buffered-bytes (each "
            "one's first 64 KiB not counted).",
            registry=r,
        )
        self.ready_endpoints = Gauge(
            f"{PREFIX}_ready_endpoints",
            "Endpoints of each model that are ready for requests.",
            ["model"],
            registry=r,
        )

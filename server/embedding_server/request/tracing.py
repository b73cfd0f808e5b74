"""OpenTelemetry traces of a request's stages: off unless ``--otlp-traces-endpoint`` is set.

A traced request (one of the model routes: ``/v1/embeddings``, ``/v2/embed``, ``/pooling``,
``/score``, ``/rerank``, ...) gets one SERVER span, ``POST /v1/embeddings``, in the caller's
trace when its W3C ``traceparent`` header names one (the propagators are OpenTelemetry's
global ones: tracecontext and baggage unless ``OTEL_PROPAGATORS`` says otherwise), else in a
trace of its own. Its children, one per stage of each job the request runs:

* ``tokenize``: the tokenizer call, on the event loop or a tokenizer thread;
* ``queue``: waiting in the scheduler for the forward pass that took its last sequences;
* ``inference``: the forward passes and pooling of the batches that carried its sequences;
* ``encode``: from the engine's answer to the response's first byte (the per-request head,
  then JSON, base64 or binary encoding).

The spans carry what a trace reader asks first: the model (``gen_ai.request.model``), the
tokens, the number of inputs, and the batches (how many, the largest one's sequences and
tokens: a request that waited behind a full batch shows it).

**Where the engine's stages become spans.** With ``--api-workers`` the HTTP request lives
in a front-end process while queueing and the forward passes happen in the engine process.
Two designs were possible: carry the trace context to the engine in every ``Run`` message
and have the engine process make the ``queue`` and ``inference`` spans with a tracer (and an
exporter) of its own, or have the front-end make them from what the engine's answer already
carries. This module does the second:

1. The engine process is the one place every request of every front-end passes through, and
   its scheduler loop is the server's throughput ceiling (docs/performance-log.md); span work
   there, per request, would cost on the one loop that cannot scale out. A front-end's span
   work is spread over as many front-ends as there are.
2. The answer already carries the stage seconds (:class:`~.results.StageTimings`'s queue,
   forward and pool); three small integers about the batches joined them in the IPC's
   ``Output`` header. No context is serialized, and a request that is not traced costs the
   engine nothing at all.
3. One code path (:class:`~.jobs.ThreadedRunner`, shared by the one-process server and the
   front-ends) makes the spans, so a trace looks the same in both layouts, and only the
   processes that serve HTTP run an exporter.

The price is that the engine's stages are placed on the front-end's clock, anchored where its
answer arrived: ``inference`` ends then and lasts the forward and pool seconds; ``queue`` ends
where ``inference`` begins and lasts the queue seconds, never starting before tokenization
ended. Any gap between ``tokenize`` and ``queue`` is the trip to the engine process. For a
request whose sequences rode several batches, ``inference`` lasts the sum of those passes and
``queue`` the wait until the last one began, so the two can overlap by up to a pass; the
``embedding_server.batches`` attribute says when that is the case.

**Whose sampling decision counts** (``--trace-parent-policy``). OpenTelemetry's default
sampler is parent-based: a request whose ``traceparent`` has the sampled flag set is traced
whatever the ratio says, so any client can have every one of its requests traced and
exported (five spans each) against a ``samplingRatio`` of 0.01, and even a plain ratio
sampler decides on the trace id, which the client chose too. So the policy decides:

* ``ratio`` (the default): a caller may decline (a parent that is not sampled gets no
  spans here) but not insist: a sampled parent is traced only when the server's own random
  draw at the ratio picks it, a draw on an id the server makes, never the caller's. The
  spans still join the caller's trace. This is ``ParentBased`` with the root sampler also
  deciding for sampled remote parents (:func:`parent_policy_sampler`);
* ``respect``: OpenTelemetry's ``ParentBased`` as the ``OTEL_TRACES_SAMPLER`` variables
  configure it, for callers the operator trusts (one team's own services);
* ``ignore``: the ``traceparent`` is not read; every request starts a trace of its own and
  the ratio decides, for servers that must not be linked into traces their clients name.

**Cost when off.** Nothing of the OpenTelemetry SDK is imported and the tracing ASGI layer
is not installed; the job runner reads one context variable per job (``None``). When on, a
sampled request costs five spans, exported in batches by the SDK's background thread, and one
that the sampler drops costs its ``traceparent`` parsing only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from embedding_server.request.scheduler import ScheduledOutput
from embedding_server.request.truncation import TokenizedInput

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler

TraceParentPolicy = Literal["ratio", "respect", "ignore"]
"""Whose decision samples a request that names a parent trace (``--trace-parent-policy``)."""

logger = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
"""Where an OTLP/HTTP collector takes spans (added to an endpoint given without a path)."""
SERVICE_NAME = "embedding-server"
"""``service.name`` of the spans unless ``OTEL_SERVICE_NAME`` or
``OTEL_RESOURCE_ATTRIBUTES`` name another."""
INSTRUMENTATION = "embedding_server"

current_trace: ContextVar[RequestTrace | None] = ContextVar(
    "embedding_server_request_trace", default=None
)
"""The trace of the request this task serves; ``None`` when it is not traced (always, with
tracing off). Set by the tracing ASGI layer, read by the job runner."""


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP URL spans are posted to: ``endpoint`` as given when it has a path (as
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is read), else with ``/v1/traces`` added (as
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` is)."""
    parts = urlsplit(endpoint)
    if parts.path.strip("/"):
        return endpoint
    return urlunsplit(parts._replace(path=TRACES_PATH))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass(eq=False, slots=True)
class RequestTrace:
    """One traced request: its span, and the child spans of its stages as they are known."""

    span: trace.Span
    context: Context
    """The request span's context, the parent of the stage spans."""
    tracer: trace.Tracer
    model: str
    answered_ns: int = 0
    """When the engine's last answer for this request arrived (the ``encode`` span starts)."""
    tokens: int = 0

    def _stage(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
        span = self.tracer.start_span(
            name, context=self.context, start_time=start_ns, attributes=attributes
        )
        span.end(end_time=max(start_ns, end_ns))

    def job(
        self,
        tokenize_start_ns: int,
        tokenize_s: float,
        answered_ns: int,
        out: ScheduledOutput,
        tokenized: Sequence[TokenizedInput],
    ) -> None:
        """Record a job's ``tokenize``, ``queue`` and ``inference`` spans (see the module doc
        for how the engine's stages are placed on this process's clock)."""
        tokens = sum(len(t.ids) for t in tokenized)
        tokenized_ns = tokenize_start_ns + _ns(tokenize_s)
        self._stage(
            "tokenize",
            tokenize_start_ns,
            tokenized_ns,
            {
                "embedding_server.inputs": len(tokenized),
                "embedding_server.tokens": tokens,
                "embedding_server.truncated_inputs": sum(t.truncated for t in tokenized),
            },
        )
        inference_ns = max(tokenized_ns, answered_ns - _ns(out.forward_s + out.pool_s))
        queued_ns = max(tokenized_ns, inference_ns - _ns(out.queue_s))
        self._stage("queue", queued_ns, inference_ns, {"embedding_server.tokens": tokens})
        self._stage(
            "inference",
            inference_ns,
            answered_ns,
            {
                "gen_ai.request.model": self.model,
                "embedding_server.tokens": tokens,
                "embedding_server.batches": out.batches,
                "embedding_server.batch.size": out.batch_size,
                "embedding_server.batch.tokens": out.batch_tokens,
                "embedding_server.forward_seconds": out.forward_s,
                "embedding_server.pool_seconds": out.pool_s,
            },
        )
        self.answered_ns = answered_ns
        self.tokens += tokens

    def responded(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """The response starts: the ``encode`` span ends (when the engine answered), and the
        request span learns the status and the request id."""
        now = time.time_ns()
        length: int | None = None
        for key, value in headers:
            if key == b"content-length" and value.isdigit():
                length = int(value)
            elif key == b"x-request-id":
                self.span.set_attribute("embedding_server.request_id", value.decode("latin-1"))
        if self.answered_ns:
            attributes: dict[str, Any] = {"http.response.status_code": status}
            if length is not None:
                attributes["http.response.body.size"] = length
            self._stage("encode", self.answered_ns, now, attributes)
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:  # a 4xx is the caller's error, not the server's (HTTP semconv)
            self.span.set_status(Status(StatusCode.ERROR))

    def failed(self, error: BaseException) -> None:
        self.span.record_exception(error)
        self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))

    def end(self) -> None:
        if self.tokens:
            self.span.set_attribute("gen_ai.usage.input_tokens", self.tokens)
        self.span.end()


def parent_policy_sampler(configured: Sampler, policy: TraceParentPolicy) -> Sampler:
    """The sampler that decides under ``policy``, from the one the ``OTEL_TRACES_SAMPLER``
    variables configure (``configured``; its root when it is parent-based). The SDK is
    imported here, only once tracing is on."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_OFF,
        ALWAYS_ON,
        ParentBased,
        Sampler,
        SamplingResult,
    )
    from opentelemetry.trace import get_current_span

    ids = RandomIdGenerator()

    class OwnDraw(Sampler):
        """``root``'s decision on a trace id of the server's own: a ratio sampler decides on
        the trace id, and a remote parent's trace id is its sender's choice (one below the
        ratio's bound would be sampled every time)."""

        def __init__(self, root: Sampler) -> None:
            self._root = root

        def should_sample(
            self,
            parent_context: Context | None,
            trace_id: int,
            name: str,
            kind: SpanKind | None = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            parent = get_current_span(parent_context).get_span_context()
            if parent.is_valid and parent.is_remote:
                trace_id = ids.generate_trace_id()
            return self._root.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )

        def get_description(self) -> str:
            return f"OwnDraw{{{self._root.get_description()}}}"

    if policy == "respect":
        return configured
    root: Sampler = getattr(configured, "_root", configured)  # ParentBased has no public one
    own = OwnDraw(root)
    if policy == "ignore":
        return own  # and no parent is extracted (Tracing.begin): every span is a root
    return ParentBased(
        root=own,
        remote_parent_sampled=own,
        remote_parent_not_sampled=ALWAYS_OFF,
        local_parent_sampled=ALWAYS_ON,
        local_parent_not_sampled=ALWAYS_OFF,
    )


class Tracing:
    """The server's tracer and the provider that exports its spans."""

    def __init__(
        self, provider: TracerProvider, model: str, parent_policy: TraceParentPolicy = "ratio"
    ) -> None:
        from opentelemetry import propagate
        from opentelemetry.sdk.trace import Tracer

        self.provider = provider
        self.tracer = provider.get_tracer(INSTRUMENTATION)
        if isinstance(self.tracer, Tracer):  # the SDK's (a proxy or no-op one samples nothing)
            self.tracer.sampler = parent_policy_sampler(provider.sampler, parent_policy)
            logger.info(
                "tracing: sampler %s (--trace-parent-policy %s)",
                self.tracer.sampler.get_description(),
                parent_policy,
            )
        self.model = model
        self.parent_policy = parent_policy
        self._extract = propagate.extract

    @classmethod
    def configure(
        cls, endpoint: str | None, model: str, parent_policy: TraceParentPolicy = "ratio"
    ) -> Tracing | None:
        """Spans exported over OTLP/HTTP to ``endpoint`` in batches, or ``None`` (no
        endpoint, or ``OTEL_SDK_DISABLED=true``)."""
        if not endpoint:
            return None
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            logger.info("tracing: --otlp-traces-endpoint is set but OTEL_SDK_DISABLED=true")
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=service_resource())
        url = traces_url(endpoint)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        logger.info("tracing: spans of the model routes go to %s", url)
        return cls(provider, model, parent_policy)

    def begin(
        self, method: str, route: str, headers: Iterable[tuple[bytes, bytes]]
    ) -> RequestTrace | None:
        """Start a request's span, in the trace its ``traceparent`` names if any (unless the
        parent policy is ``ignore``); ``None`` when the sampler drops it (then nothing else
        is recorded for it)."""
        parent: Context | None = None
        if self.parent_policy != "ignore":
            carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in headers}
            parent = self._extract(carrier)
        span = self.tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "http.route": route,
                "url.path": route,
                "gen_ai.request.model": self.model,
            },
        )
        if not span.is_recording():
            return None
        return RequestTrace(span, trace.set_span_in_context(span), self.tracer, self.model)

    def shutdown(self) -> None:
        """Export what is still buffered and stop the exporter's thread."""
        self.provider.shutdown()


def service_resource() -> Any:
    """The SDK's resource from the environment (``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_SERVICE_NAME``), with :data:`SERVICE_NAME` where they name no service."""
    from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_NAME_KEY
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME_KEY, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME_KEY: SERVICE_NAME}))
    return resource

"""OpenTelemetry traces of the request stages (``--otlp-traces-endpoint``), as a trace reader
sees them: a request that sends a W3C ``traceparent`` gets its span in that trace, with one
child per stage (tokenize, queue, inference, encode) in order and carrying the model, the
tokens and the batches; the engine process's stages arrive over the IPC with ``--api-workers``;
the flag really exports over OTLP/HTTP; and with tracing off nothing of it runs.

Spans are read with the SDK's in-memory exporter, except in the OTLP test, which runs a
collector on 127.0.0.1 and decodes what the server posts to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.server
import itertools
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from embedding_server.api import create_app
from embedding_server.api.tracing import TracingMiddleware
from embedding_server.cli import load_settings
from embedding_server.engine import Engine
from embedding_server.ipc.client import AttachedEngine, EngineClient
from embedding_server.ipc.service import EngineService
from embedding_server.request.tracing import Tracing, current_trace, service_resource, traces_url
from embedding_server.settings import ServerSettings
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio, Sampler, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import ValidationError

from tests.support.api import fake_settings, running_server, server_process, wait_for

pytestmark = pytest.mark.timeout(120)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
STAGES = ["tokenize", "queue", "inference", "encode"]


def traceparent(sampled: bool = True) -> str:
    return f"00-{TRACE_ID}-{CALLER_SPAN_ID}-{'01' if sampled else '00'}"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def check_stages(spans: dict[str, ReadableSpan], request: ReadableSpan) -> None:
    """The four stage spans are the request span's children, in order, within it."""
    assert request.context is not None and request.start_time and request.end_time
    for name in STAGES:
        stage = spans[name]
        assert stage.parent is not None and stage.parent.span_id == request.context.span_id
        assert stage.context is not None
        assert stage.context.trace_id == request.context.trace_id
        assert stage.start_time is not None and stage.end_time is not None
        assert request.start_time <= stage.start_time <= stage.end_time <= request.end_time
    ends = [spans[name] for name in STAGES]
    for earlier, later in itertools.pairwise(ends):
        assert earlier.end_time is not None and later.start_time is not None
        assert earlier.end_time <= later.start_time, (earlier.name, later.name)


def test_a_request_with_a_traceparent_gets_its_stages_as_spans_of_that_trace(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    settings = fake_settings("fake?dim=16&delay_ms=30", served_model_name="tiny")
    with running_server(settings, tracer_provider=provider) as server:
        response = httpx.post(
            server.url + "/v1/embeddings",
            json={"input": ["ab", "abcd"]},
            headers={"traceparent": traceparent(), "x-request-id": "req-1"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        tokens = response.json()["usage"]["prompt_tokens"]
        wait_for(lambda: len(exporter.get_finished_spans()) == 5, what="five spans")
    spans = by_name(exporter.get_finished_spans())
    request = spans["POST /v1/embeddings"]
    # In the caller's trace, under the caller's span.
    assert request.context is not None and request.context.trace_id == int(TRACE_ID, 16)
    assert request.parent is not None and request.parent.span_id == int(CALLER_SPAN_ID, 16)
    assert request.parent.is_remote
    assert request.kind is SpanKind.SERVER
    assert request.attributes is not None
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gen_ai.request.model"] == "tiny"
    assert request.attributes["gen_ai.usage.input_tokens"] == tokens == 10
    assert request.attributes["embedding_server.request_id"] == "req-1"
    check_stages(spans, request)
    tokenize = spans["tokenize"].attributes
    assert tokenize is not None
    assert tokenize["embedding_server.inputs"] == 2
    assert tokenize["embedding_server.tokens"] == tokens
    inference = spans["inference"]
    assert inference.attributes is not None
    assert inference.attributes["gen_ai.request.model"] == "tiny"
    assert inference.attributes["embedding_server.batches"] == 1
    assert inference.attributes["embedding_server.batch.size"] == 2
    assert inference.attributes["embedding_server.batch.tokens"] == tokens
    # The fake model sleeps 30 ms per forward pass: the span lasts at least that.
    assert inference.end_time is not None and inference.start_time is not None
    assert inference.end_time - inference.start_time >= 30e6
    encode = spans["encode"].attributes
    assert encode is not None
    assert encode["http.response.body.size"] == len(response.content)


def test_a_request_that_waited_behind_a_batch_shows_it(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Four requests to a model that takes 800 ms a pass: the first runs alone, the other
    three arrive during its pass, wait for it, then share one batch."""
    settings = fake_settings("fake?dim=16&delay_ms=800")
    with running_server(settings, tracer_provider=provider) as server:

        async def burst() -> list[httpx.Response]:
            async with contextlib.AsyncExitStack() as stack:
                clients = [
                    await stack.enter_async_context(
                        httpx.AsyncClient(base_url=server.url, timeout=30)
                    )
                    for _ in range(4)
                ]
                for client in clients:  # connected before the clock starts
                    assert (await client.get("/health")).status_code == 200
                first = asyncio.create_task(clients[0].post("/v1/embeddings", json={"input": "a"}))
                await asyncio.sleep(0.2)  # in the forward pass before the others arrive
                rest = [c.post("/v1/embeddings", json={"input": "b"}) for c in clients[1:]]
                return await asyncio.gather(first, *rest)

        assert all(r.status_code == 200 for r in asyncio.run(burst()))
        wait_for(lambda: len(exporter.get_finished_spans()) == 20, what="twenty spans")
    spans = exporter.get_finished_spans()
    sizes, waits = [], []
    for span in spans:
        if span.name == "inference":
            assert span.attributes is not None
            sizes.append(span.attributes["embedding_server.batch.size"])
        if span.name == "queue":
            assert span.end_time is not None and span.start_time is not None
            waits.append((span.end_time - span.start_time) / 1e9)
    assert sorted(sizes) == [1, 3, 3, 3]
    # Three of them waited for the rest of the first pass (600 ms left when they came).
    assert sorted(waits)[1] >= 0.3, waits
    # Each request is a trace of its own: no traceparent was sent.
    roots = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert all(s.parent is None for s in roots)
    assert len({s.context.trace_id for s in roots if s.context is not None}) == 4


def test_what_is_not_traced(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A caller that sampled its trace out gets no spans here (parent-based sampling), and
    probes and scrapes are never traced; a refused request is, with its status and no
    stages."""
    with running_server(fake_settings("fake?dim=16"), tracer_provider=provider) as server:
        sampled_out = httpx.post(
            server.url + "/v1/embeddings",
            json={"input": "ab"},
            headers={"traceparent": traceparent(sampled=False)},
            timeout=30,
        )
        assert sampled_out.status_code == 200
        for path in ("/health", "/ready", "/metrics", "/v1/models"):
            assert httpx.get(server.url + path, timeout=30).status_code == 200
        assert exporter.get_finished_spans() == ()
        refused = httpx.post(
            server.url + "/v1/embeddings", json={"input": ""}, timeout=30
        )  # an empty input is a 400
        assert refused.status_code == 400
        wait_for(lambda: len(exporter.get_finished_spans()) == 1, what="one span")
    (span,) = exporter.get_finished_spans()
    assert span.name == "POST /v1/embeddings"
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 400
    assert span.status.status_code is StatusCode.UNSET  # the caller's error, not the server's


@contextlib.asynccontextmanager
async def attached(path: str, engine: Engine) -> Any:
    """A front-end's engine attached over a real unix socket to ``engine``, which serves it
    from this process (as the engine process does with ``--api-workers``)."""
    await engine.start()
    service = EngineService(path)
    serving = asyncio.create_task(service.serve(engine.scheduler, engine.handoff(), 1))
    client = EngineClient(path)
    try:
        handoff = await asyncio.wait_for(client.connect(), 30)
        front = AttachedEngine(ServerSettings(model="fake"), handoff, client)
        await front.start()
        yield front
        await front.stop()
    finally:
        client.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        service.close()
        await engine.stop(drain=False)


def ratio_provider(exporter: InMemorySpanExporter, sampler: Sampler) -> TracerProvider:
    """A provider sampling as ``OTEL_TRACES_SAMPLER[_ARG]`` would configure it."""
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


CRAFTED_TRACE_ID = "4bf92f3577b34da60000000000000001"
"""A trace id whose low 64 bits (what a ratio sampler compares with its bound) are 1: under
any ratio above 2^-64, a sampler deciding on the trace id samples it every time."""


def test_a_clients_sampled_traceparent_does_not_override_the_sampling_ratio(
    exporter: InMemorySpanExporter,
) -> None:
    """Issue 48, L3. The operator's ``samplingRatio`` is ``parentbased_traceidratio``: with
    OpenTelemetry's parent-based sampling, a client that sends a sampled ``traceparent``
    had every request traced and exported whatever the ratio. By default
    (``--trace-parent-policy ratio``) the ratio decides: a sampled parent is traced only as
    often as a request without one, and a trace id chosen under the ratio's bound does not
    pick itself either (the server draws on an id of its own)."""
    provider = ratio_provider(exporter, ParentBasedTraceIdRatio(1e-9))
    settings = fake_settings("fake?dim=16")
    assert settings.trace_parent_policy == "ratio"
    try:
        with running_server(settings, tracer_provider=provider) as server:
            for trace_id in (TRACE_ID, CRAFTED_TRACE_ID):
                for _ in range(10):
                    response = httpx.post(
                        server.url + "/v1/embeddings",
                        json={"input": "ab"},
                        headers={"traceparent": f"00-{trace_id}-{CALLER_SPAN_ID}-01"},
                        timeout=30,
                    )
                    assert response.status_code == 200
            assert exporter.get_finished_spans() == ()
    finally:
        provider.shutdown()


@pytest.mark.parametrize(
    "sampler",
    [ParentBasedTraceIdRatio(1e-9), TraceIdRatioBased(1e-9)],
    ids=["parentbased_traceidratio", "traceidratio"],
)
def test_under_the_ratio_policy_neither_the_flag_nor_the_trace_id_forces_a_span(
    exporter: InMemorySpanExporter, sampler: Sampler
) -> None:
    provider = ratio_provider(exporter, sampler)
    tracing = Tracing(provider, "m", "ratio")
    for trace_id in (TRACE_ID, CRAFTED_TRACE_ID):
        header = [(b"traceparent", f"00-{trace_id}-{CALLER_SPAN_ID}-01".encode())]
        assert all(tracing.begin("POST", "/v1/embeddings", header) is None for _ in range(50))
    provider.shutdown()


def test_the_parent_policy_decides_whose_sampling_counts(
    exporter: InMemorySpanExporter,
) -> None:
    """``respect`` is OpenTelemetry's parent-based sampling (a trusted caller's sampled flag
    decides); ``ratio`` still lets a caller decline; ``ignore`` never joins the caller's
    trace. With every request sampled (no ratio), ``ratio`` keeps the caller's trace."""
    sampled = [(b"traceparent", traceparent().encode())]
    declined = [(b"traceparent", traceparent(sampled=False).encode())]
    never = ratio_provider(exporter, ParentBasedTraceIdRatio(0.0))
    assert Tracing(never, "m", "respect").begin("POST", "/v1/embeddings", sampled) is not None
    assert Tracing(never, "m", "ratio").begin("POST", "/v1/embeddings", sampled) is None
    always = ratio_provider(exporter, ParentBasedTraceIdRatio(1.0))
    joined = Tracing(always, "m", "ratio").begin("POST", "/v1/embeddings", sampled)
    assert joined is not None and joined.span.get_span_context().trace_id == int(TRACE_ID, 16)
    assert Tracing(always, "m", "ratio").begin("POST", "/v1/embeddings", declined) is None
    own = Tracing(always, "m", "ignore").begin("POST", "/v1/embeddings", declined)
    assert own is not None and own.span.get_span_context().trace_id != int(TRACE_ID, 16)
    assert isinstance(own.span, ReadableSpan) and own.span.parent is None
    for provider in (never, always):
        provider.shutdown()


def test_the_parent_policy_is_a_flag_and_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(["serve"]).trace_parent_policy == "ratio"
    flag = load_settings(["serve", "--trace-parent-policy", "respect"])
    assert flag.trace_parent_policy == "respect"
    monkeypatch.setenv("EMBEDDING_SERVER_TRACE_PARENT_POLICY", "ignore")
    assert load_settings(["serve"]).trace_parent_policy == "ignore"
    with pytest.raises(ValidationError, match="trace_parent_policy"):
        ServerSettings(trace_parent_policy="always")


def test_a_front_ends_spans_carry_the_engine_process_stages(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """With ``--api-workers`` the queue and the forward passes happen in the engine process:
    the front-end's spans take them from the engine's answer (two requests of one text, the
    second queued behind the first's 400 ms pass)."""
    tracing = Tracing(provider, "fake")

    async def scenario() -> None:
        engine = Engine.from_pretrained("fake?delay_ms=400&max_len=64", max_batch_size=1)
        async with attached(str(tmp_path / "engine.sock"), engine) as front:

            async def traced_embed(text: str) -> None:
                traced = tracing.begin("POST", "/v1/embeddings", [])
                assert traced is not None
                token = current_trace.set(traced)
                try:
                    await front.aembed([text])
                finally:
                    current_trace.reset(token)
                    traced.end()

            first = asyncio.create_task(traced_embed("ab"))
            await asyncio.sleep(0.1)
            await asyncio.gather(first, traced_embed("abc"))

    asyncio.run(scenario())
    spans = exporter.get_finished_spans()
    inference = [s for s in spans if s.name == "inference"]
    queue = [s for s in spans if s.name == "queue"]
    assert len(inference) == len(queue) == 2
    for span in inference:
        assert span.attributes is not None and span.start_time and span.end_time
        assert span.attributes["embedding_server.batches"] == 1
        assert span.attributes["embedding_server.batch.size"] == 1
        assert span.attributes["embedding_server.forward_seconds"] >= 0.4
        assert span.end_time - span.start_time >= 400e6
    # The second request waited for the first one's pass in the engine's queue.
    waits = sorted((s.end_time or 0) - (s.start_time or 0) for s in queue)
    assert waits[1] >= 200e6, waits
    for span in (*inference, *queue):
        assert span.parent is not None
        assert any(
            r.context is not None and r.context.span_id == span.parent.span_id
            for r in spans
            if r.name == "POST /v1/embeddings"
        )


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        self.bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_the_flag_exports_spans_over_otlp_http() -> None:
    with collector() as (endpoint, bodies):
        settings = fake_settings("fake?dim=16", otlp_traces_endpoint=endpoint)
        with running_server(settings) as server:
            response = httpx.post(
                server.url + "/v1/embeddings",
                json={"input": "ab"},
                headers={"traceparent": traceparent()},
                timeout=30,
            )
            assert response.status_code == 200
        # Stopping the server flushed the spans to the collector.
    assert bodies and {path for path, _ in bodies} == {"/v1/traces"}
    spans, services = exported_spans(bodies)
    assert sorted(span.name for span in spans) == sorted(["POST /v1/embeddings", *STAGES])
    assert {span.trace_id.hex() for span in spans} == {TRACE_ID}
    assert services == {"embedding-server"}


@contextlib.contextmanager
def collector() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """An OTLP/HTTP receiver on 127.0.0.1: its base URL, and the (path, body) of each export
    posted to it so far."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Collector.bodies = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Collector.bodies
    finally:
        server.shutdown()
        thread.join(timeout=10)


def exported_spans(bodies: list[tuple[str, bytes]]) -> tuple[list[Any], set[str]]:
    """The spans in the OTLP protobuf exports a collector received, and their services."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    spans, services = [], set()
    for _, body in list(bodies):
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    services.add(attribute.value.string_value)
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
    return spans, services


def int_attribute(span: Any, key: str) -> int:
    (value,) = [a.value.int_value for a in span.attributes if a.key == key]
    return int(value)


def test_a_real_model_behind_api_workers_exports_its_stages_to_a_collector(
    minilm_dir: Path,
) -> None:
    """The packaged all-MiniLM-L6-v2 served by a real ``embedding-server serve`` with two
    front-ends: a request with a traceparent reaches the collector as five spans of the
    caller's trace, its stages under its span, counting the tokens the response reports,
    while the server runs (the SDK's batch export, not only the flush at exit)."""
    with collector() as (endpoint, bodies):
        args = [
            "--model",
            str(minilm_dir),
            "--dtype",
            "float32",
            "--api-workers",
            "2",
            "--otlp-traces-endpoint",
            endpoint,
        ]
        env = {"OTEL_SERVICE_NAME": "minilm-traced", "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with server_process(args, workers=2, env=env) as server:
            response = httpx.post(
                server.url + "/v1/embeddings",
                json={"input": ["a traced request", "to a real model"]},
                headers={"traceparent": traceparent()},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            body = response.json()
            assert [len(row["embedding"]) for row in body["data"]] == [384, 384]
            wait_for(lambda: len(exported_spans(bodies)[0]) >= 5, timeout=60, what="5 spans")
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    spans, services = exported_spans(bodies)
    assert {path for path, _ in bodies} == {"/v1/traces"}
    assert services == {"minilm-traced"}
    named = {span.name: span for span in spans}
    assert sorted(named) == sorted(["POST /v1/embeddings", *STAGES]), [s.name for s in spans]
    request = named["POST /v1/embeddings"]
    assert {span.trace_id.hex() for span in spans} == {TRACE_ID}
    assert request.parent_span_id.hex() == CALLER_SPAN_ID
    for stage in STAGES:
        assert named[stage].parent_span_id == request.span_id, stage
        assert request.start_time_unix_nano <= named[stage].start_time_unix_nano
        assert named[stage].end_time_unix_nano <= request.end_time_unix_nano
    tokens = body["usage"]["prompt_tokens"]
    assert int_attribute(request, "gen_ai.usage.input_tokens") == tokens
    assert int_attribute(named["tokenize"], "embedding_server.inputs") == 2
    assert int_attribute(named["inference"], "embedding_server.batch.tokens") == tokens
    assert int_attribute(request, "http.response.status_code") == 200


def test_the_endpoint_is_a_flag_and_a_variable_and_must_be_a_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flag = load_settings(["serve", "--otlp-traces-endpoint", "http://collector:4318"])
    assert flag.otlp_traces_endpoint == "http://collector:4318"
    monkeypatch.setenv("EMBEDDING_SERVER_OTLP_TRACES_ENDPOINT", "https://otel.example/v1/traces")
    assert load_settings(["serve"]).otlp_traces_endpoint == "https://otel.example/v1/traces"
    monkeypatch.setenv("EMBEDDING_SERVER_OTLP_TRACES_ENDPOINT", "")
    assert load_settings(["serve"]).otlp_traces_endpoint is None
    with pytest.raises(ValidationError, match="otlp_traces_endpoint"):
        ServerSettings(otlp_traces_endpoint="collector:4318")
    # A collector's base URL gets the traces path; a full URL is used as given.
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://otel.example/custom/path") == "https://otel.example/custom/path"


def test_the_standard_otel_variables_name_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert service_resource().attributes["service.name"] == "embedding-server"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.namespace.name=search")
    resource = service_resource()
    assert resource.attributes["service.name"] == "embedding-server"
    assert resource.attributes["k8s.namespace.name"] == "search"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "minilm")
    assert service_resource().attributes["service.name"] == "minilm"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert Tracing.configure("http://127.0.0.1:4318", "m") is None


def test_with_tracing_off_nothing_of_it_runs() -> None:
    """No endpoint: no tracing layer in the app, and the SDK and exporter are never imported
    (checked in a fresh interpreter, since this one has imported them for the tests above;
    the API is FastAPI's own dependency)."""
    app = create_app(fake_settings())
    assert all(m.cls is not TracingMiddleware for m in app.user_middleware)
    traced = create_app(fake_settings(otlp_traces_endpoint="http://127.0.0.1:9"))
    assert any(m.cls is TracingMiddleware for m in traced.user_middleware)
    code = (
        "import sys\n"
        "from embedding_server.api import create_app\n"
        "from embedding_server.settings import ServerSettings\n"
        "create_app(ServerSettings(model='fake'))\n"
        "otel = ('opentelemetry.sdk', 'opentelemetry.exporter')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(otel))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# An interpreter without the OpenTelemetry SDK and exporter (the API stays: FastAPI needs it):
# every import of them fails as it would were they not installed.
WITHOUT_OTEL = """
import importlib.abc, sys

class NoOpenTelemetrySDK(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoOpenTelemetrySDK())
"""


def test_without_the_sdk_the_server_serves_and_refuses_the_flag_by_name() -> None:
    """The SDK is the server extra's; a server installed without it must still start and
    serve, and asking it for traces must fail at start naming the flag and what to install,
    not on the first request."""
    serves = WITHOUT_OTEL + (
        "import time\n"
        "from fastapi.testclient import TestClient\n"
        "from embedding_server.api import create_app\n"
        "from embedding_server.engine import load_engine\n"
        "from embedding_server.settings import ServerSettings\n"
        "app = create_app(ServerSettings(model='fake?dim=4'), connect=load_engine)\n"
        "with TestClient(app) as client:\n"
        "    for _ in range(1200):  # the model loads in the background\n"
        "        if client.get('/ready').status_code == 200:\n"
        "            break\n"
        "        time.sleep(0.05)\n"
        "    response = client.post('/v1/embeddings', json={'input': 'ab'})\n"
        "    assert response.status_code == 200, response.text\n"
        "    assert len(response.json()['data'][0]['embedding']) == 4\n"
    )
    subprocess.run([sys.executable, "-c", serves], check=True, timeout=120)
    refuses = WITHOUT_OTEL + (
        "from embedding_server.cli import main\n"
        "main(['serve', '--model', 'fake', '--otlp-traces-endpoint', 'http://127.0.0.1:4318'])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", refuses], capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0
    message = run.stderr.strip().splitlines()[-1]
    assert "--otlp-traces-endpoint" in message, run.stderr
    assert "OpenTelemetry SDK" in message and "embedding-operator[server]" in message

"""Schema-driven fuzzing: schemathesis generates requests (valid and invalid) for every
operation in the app's own OpenAPI document and sends them to a real server. Whatever it
sends, the server must never answer 5xx, and every error must use the one error shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.support.api import RunningServer, fake_settings, running_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[RunningServer]:
    with running_server(
        fake_settings("fake?max_len=64&dim=16", max_inputs_per_request=16, max_request_bytes=65536)
    ) as running:
        yield running


OPERATIONS = [
    "POST /v1/embeddings",
    "POST /v2/embed",
    "POST /pooling",
    "POST /score",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /info",
    "GET /health",
    "GET /ready",
    "GET /metrics",
]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_makes_the_server_fail(fuzz_server: RunningServer, mode: GenerationMode) -> None:
    api = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = {
        f"{op.method.upper()} {op.path}": op
        for op in (result.ok() for result in api.get_all_operations())
    }
    assert set(OPERATIONS) <= set(operations), sorted(operations)
    for label, operation in operations.items():
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to get wrong in a GET without parameters
        _fuzz(operation, mode, label)
    statuses = _requests_by_status(fuzz_server)
    assert sum(statuses.values()) >= 40, statuses  # the fuzzer really sent requests
    if mode is GenerationMode.NEGATIVE:
        assert statuses.get("400", 0) >= 20, statuses  # ... and they were refused cleanly


def _fuzz(operation: Any, mode: GenerationMode, label: str) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def no_5xx(case: schemathesis.Case) -> None:
        response = case.call(timeout=30)
        assert response.status_code < 500, (label, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, label

    no_5xx()


def _requests_by_status(server: RunningServer) -> dict[str, float]:
    totals: dict[str, float] = {}
    for metric in server.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "embedding_server_requests_total":
                status = sample.labels["status"]
                totals[status] = totals.get(status, 0.0) + sample.value
    return totals

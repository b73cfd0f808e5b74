"""A server killed under load through the gateway: no request fails, the ones the dead
server dropped are retried on the other."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import httpx
import pytest

from tests.server.gateway.gateway_process import gateway_process
from tests.support.api import server_process, wait_for

pytestmark = pytest.mark.timeout(240)

MODEL = "fake-embedder"


def test_killing_a_server_under_load_loses_no_request(tmp_path: Path) -> None:
    args = ["--model", "fake?dim=16&delay_ms=20", "--served-model-name", MODEL]
    with server_process(args) as doomed, server_process(args) as survivor:
        routes = tmp_path / "routes.json"
        endpoints = [doomed.url, survivor.url]
        routes.write_text(json.dumps({"models": [{"name": MODEL, "endpoints": endpoints}]}))
        with gateway_process(["--routes-file", str(routes), "--poll-interval", "0.05"]) as gw:
            wait_for(lambda: gw.ready_endpoints() == {MODEL: 2}, what="both endpoints ready")

            async def load() -> list[int]:
                statuses: list[int] = []
                async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:

                    async def worker(index: int) -> None:
                        for n in range(30):
                            body = {"model": MODEL, "input": f"request {index}-{n}"}
                            answer = await client.post("/v1/embeddings", json=body)
                            statuses.append(answer.status_code)
                            if index == 0 and n == 10:
                                doomed.process.send_signal(signal.SIGKILL)

                    await asyncio.gather(*(worker(i) for i in range(8)))
                return statuses

            statuses = asyncio.run(load())
            metrics = httpx.get(gw.url + "/metrics").text
            served = httpx.get(survivor.url + "/metrics").text
        assert doomed.process.wait(timeout=5) == -signal.SIGKILL
    assert len(statuses) == 240
    assert statuses.count(200) == 240, sorted(set(statuses))
    assert 'embedding_gateway_requests_total{model="fake-embedder",status="200"} 240.0' in metrics
    assert "embedding_server_requests_total" in served
    # Eight clients, about four requests in flight to each server when one was killed: those
    # were dropped mid-request and answered by the other server.
    retried = [line for line in metrics.splitlines() if "retries_total{" in line]
    assert retried and float(retried[0].rsplit(" ", 1)[1]) >= 1

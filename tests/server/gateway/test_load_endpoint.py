"""``GET /load`` on the server: what a gateway polls to pick the least-loaded pod."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.api import fake_settings, running_server

pytestmark = pytest.mark.timeout(120)


async def test_load_reports_the_work_queued_and_running_and_needs_no_api_key() -> None:
    # 200 ms per forward pass, one sequence per pass: four requests keep it busy ~0.8 s.
    settings = fake_settings(
        "fake?delay_ms=200&max_len=64", max_batch_tokens=64, max_batch_size=1, api_key="k"
    )
    with running_server(settings) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            idle = await client.get("/load")
            assert idle.status_code == 200
            assert idle.json() == {
                "ready": True,
                "queued_tokens": 0,
                "running_tokens": 0,
                "backlog_seconds": 0.0,
            }
            auth = {"Authorization": "Bearer k"}
            body = {"input": "a few words to embed"}
            work = [
                asyncio.create_task(client.post("/v1/embeddings", json=body, headers=auth))
                for _ in range(4)
            ]
            await asyncio.sleep(0.3)
            busy = (await client.get("/load")).json()
            answers = await asyncio.gather(*work)
            after = (await client.get("/load")).json()
        assert all(a.status_code == 200 for a in answers)
        assert busy["ready"] is True
        assert busy["queued_tokens"] > 0 and busy["running_tokens"] > 0
        assert busy["backlog_seconds"] > 0
        assert after["queued_tokens"] == after["running_tokens"] == 0
        server.lifecycle.begin_drain("test")
        draining = httpx.get(server.url + "/load")
        assert draining.status_code == 503 and draining.json()["ready"] is False

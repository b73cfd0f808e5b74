"""Graceful shutdown of the real ``embedding-server serve`` process: on SIGTERM the work in
flight finishes with 200s, new connections are refused, and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from e2e.harness.proc import free_port
from tests.support.api import scrape, wait_for

pytestmark = pytest.mark.timeout(180)

SCRIPT = os.path.join(os.path.dirname(sys.executable), "embedding-server")


def test_sigterm_drains_in_flight_requests_and_exits_0() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")}
    # 250 ms per forward pass, one sequence per pass: 6 requests take ~1.5 s to drain.
    process = subprocess.Popen(
        [
            SCRIPT,
            "serve",
            "--model",
            "fake?delay_ms=250&max_len=64",
            "--port",
            str(port),
            "--max-batch-tokens",
            "64",
            "--max-batch-size",
            "1",
            "--log-format",
            "json",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def ready() -> bool:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=60, what="the server to become ready")

        async def scenario() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as http:
                tasks = [
                    asyncio.create_task(
                        http.post(url + "/v1/embeddings", json={"input": f"request {i}"})
                    )
                    for i in range(6)
                ]
                await asyncio.to_thread(
                    wait_for,
                    lambda: scrape(url, "embedding_server_in_flight_requests") >= 7,
                    timeout=20,
                    what="all six requests in flight",
                )
                process.send_signal(signal.SIGTERM)
                responses = await asyncio.gather(*tasks)
                return [r.status_code for r in responses]

        assert asyncio.run(scenario()) == [200] * 6
        assert process.wait(timeout=30) == 0
        output = process.stdout.read() if process.stdout else ""
        assert "Traceback" not in output
        records = [json.loads(line) for line in output.splitlines() if line.strip()]
        messages = [r["message"] for r in records]  # --log-format json: all JSON
        assert any("draining (SIGTERM)" in m for m in messages), messages
        assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

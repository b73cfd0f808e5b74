"""A gateway stopped (SIGTERM, as in a rollout) while it holds requests answers them at once
with a 503 to retry elsewhere, rather than closing their connections at the grace period's end."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from e2e.harness.proc import free_port
from tests.server.gateway.gateway_process import gateway_process
from tests.support.api import wait_for

pytestmark = pytest.mark.timeout(120)


def test_held_requests_get_a_503_to_retry_when_the_gateway_stops(tmp_path: Path) -> None:
    # A model whose only endpoint never answers (nothing listens there): requests are held.
    routes = tmp_path / "routes.json"
    dead = f"http://127.0.0.1:{free_port()}"
    routes.write_text(json.dumps({"models": [{"name": "cold", "endpoints": [dead]}]}))
    args = ["--routes-file", str(routes), "--poll-interval", "0.05", "--hold-timeout", "300"]
    answers: list[httpx.Response] = []

    def client() -> None:
        body = {"model": "cold", "input": "x"}
        answers.append(httpx.post(gw.url + "/v1/embeddings", json=body, timeout=60))

    with gateway_process(args) as gw:
        clients = [threading.Thread(target=client) for _ in range(3)]
        for thread in clients:
            thread.start()

        def held() -> bool:
            metrics = httpx.get(gw.url + "/metrics", timeout=5).text
            gauge = 'embedding_gateway_held_requests{embedding_service="file/cold",model="cold"}'
            return f"{gauge} 3.0" in metrics

        wait_for(held, timeout=30, interval=0.05, what="three requests held")
        stopped = time.monotonic()
        assert gw.stop() == 0
        for thread in clients:
            thread.join(timeout=30)
        elapsed = time.monotonic() - stopped
        output = gw.output()

    assert len(answers) == 3, output
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "model_unavailable"
        assert "shutting down" in answer.json()["error"]["message"]
        assert answer.headers["Retry-After"] == "1"
    # Well within the 30 s shutdown grace: answered at SIGTERM, not cut off at its end.
    assert elapsed < 10, f"{elapsed:.1f} s\n{output}"
    assert "3 held requests answered 503" in output

"""``X-Priority``: at the same queue depth a bulk request gets 429 while an interactive one is
admitted and runs ahead of the bulk requests queued before it; in one process and across
``--api-workers`` (the priority travels to the engine process in each ``Run`` message).

The fake model (one 32-token sequence per slow forward pass, four in the queue) makes the
queue depth exact: bulk may fill 75% of ``--max-queue-tokens 128``, so three queued bulk
requests leave no room for a fourth, and room for one more interactive request."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from embedding_server.metrics import QUEUE_REQUESTS_METRIC

from tests.support.api import fake_settings, running_server, scrape, server_process, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TEXT = "q" * 30  # 32 tokens with <s> and </s>
DELAY_MS = 2500  # one pass: the checks below must fit while it runs, also on a busy machine
ARGS = {"max_batch_tokens": 64, "max_batch_size": 1, "max_queue_tokens": 128}


def _post_raw(port: int, priority: str | None) -> socket.socket:
    """A request on a plain socket, so the test decides when its client hangs up."""
    body = json.dumps({"input": TEXT}).encode()
    header = b"X-Priority: " + priority.encode() + b"\r\n" if priority is not None else b""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + header
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    return sock


def _post(url: str, priority: str | None) -> httpx.Response:
    headers = {"X-Priority": priority} if priority is not None else {}
    return httpx.post(url + "/v1/embeddings", json={"input": TEXT}, headers=headers, timeout=60)


@contextmanager
def _bulk_crowd(url: str, port: int, bulk: str | None) -> Iterator[list[socket.socket]]:
    """One bulk request in the forward pass, one prepared beside it, three queued (96 of 128
    tokens: bulk's share is full); they hang up on leaving."""
    crowd: list[socket.socket] = []
    try:
        for sent in range(1, 6):
            crowd.append(_post_raw(port, bulk))
            queued = max(0, sent - 2)
            wait_for(
                lambda queued=queued: scrape(url, QUEUE_REQUESTS_METRIC) == queued,
                timeout=60,
                what=f"{queued} bulk request(s) queued",
            )
        yield crowd
    finally:
        for sock in crowd:
            sock.close()


def _interactive_admitted_bulk_refused(url: str, port: int, bulk: str | None) -> None:
    """``bulk``: the X-Priority header bulk requests send (None: bulk by their route)."""
    with _bulk_crowd(url, port, bulk), ThreadPoolExecutor(1) as pool:
        refused = _post(url, bulk)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "bulk" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        # The same depth admits a query; it runs next, ahead of the three bulk requests
        # queued before it, which are still waiting when it is answered.
        query = pool.submit(_post, url, "interactive")
        answered = query.result(timeout=120)
        assert answered.status_code == 200, answered.text
        assert len(answered.json()["data"][0]["embedding"]) == 384
        still_queued = scrape(url, QUEUE_REQUESTS_METRIC)
        assert still_queued is not None and still_queued >= 1


def test_bulk_by_route_is_refused_where_interactive_is_admitted() -> None:
    # --bulk-routes /v1/embeddings: without the header, requests there are bulk.
    settings = fake_settings(
        f"fake?delay_ms={DELAY_MS}&max_len=64", bulk_routes="/v1/embeddings", **ARGS
    )
    with running_server(settings) as server:
        _interactive_admitted_bulk_refused(server.url, server.port, None)


def test_priority_crosses_the_process_boundary() -> None:
    args = ["--model", f"fake?delay_ms={DELAY_MS}&max_len=64", "--api-workers", "2"]
    for name, value in ARGS.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    with server_process(args, workers=2) as server:
        _interactive_admitted_bulk_refused(server.url, server.port, "bulk")


def test_a_bad_priority_is_a_400_naming_the_header() -> None:
    with running_server(fake_settings("fake")) as server:
        bad = _post(server.url, "urgent")
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "X-Priority" and error["type"] == "invalid_request_error"
        assert "'interactive' or 'bulk'" in error["message"]
        for priority in (None, "bulk", "Interactive"):  # case does not matter, as HTTP's
            assert _post(server.url, priority).status_code == 200

"""``--api-workers N``: N front-end processes around one engine process, as real
``embedding-server serve`` processes on loopback ports.

What a user relies on must hold across the process boundary: every request gets its own
vectors, a client that goes away has its queued work withdrawn in the engine, overload is a
429 with Retry-After, SIGTERM drains then every process exits 0, an engine that fails or dies
takes the front-ends down with it, a front-end that dies is replaced while the others serve
(bounded: one that keeps dying ends the server with status 1), and ``/metrics`` of any
front-end tells the whole server's story (the engine's queue depth, requests summed over
front-ends, no dead front-end's requests in flight)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from embedding_server.engine import Engine
from embedding_server.metrics import BACKLOG_SECONDS_METRIC, QUEUE_REQUESTS_METRIC

from tests.support.api import (
    ServerProcess,
    alive,
    frontend_processes,
    sample,
    scrape,
    server_process,
    wait_for,
)
from tests.support.tasks import build_classifier

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WORKERS = ["--api-workers", "2"]
# One sequence per forward pass, each taking a while: requests visibly queue.
SLOW = ["--max-batch-tokens", "64", "--max-batch-size", "1"]


def texts(n: int) -> list[str]:
    """Inputs of mixed lengths, all different."""
    return [f"input {i}: " + "abcdefghij"[i % 10] * (i % 41) for i in range(n)]


def test_each_request_gets_its_own_vectors_and_metrics_sum_over_front_ends() -> None:
    reference = Engine.from_pretrained("fake")
    inputs = texts(120)
    requests = [[inputs[i], inputs[(7 * i + 3) % len(inputs)]] for i in range(len(inputs))]
    with server_process(["--model", "fake", *WORKERS], workers=2) as server:

        async def burst() -> list[httpx.Response]:
            async with contextlib.AsyncExitStack() as stack:
                # Four clients, each with its own pool of connections, all at once.
                clients = [
                    await stack.enter_async_context(httpx.AsyncClient(timeout=60)) for _ in range(4)
                ]
                url = server.url + "/v1/embeddings"
                return await asyncio.gather(
                    *(
                        clients[i % 4].post(url, json={"input": body})
                        for i, body in enumerate(requests)
                    )
                )

        responses = asyncio.run(burst())
        for body, response in zip(requests, responses, strict=True):
            assert response.status_code == 200, response.text
            got = np.array([row["embedding"] for row in response.json()["data"]])
            np.testing.assert_allclose(got, reference.embed(body), atol=1e-6)
        # Per-token output crosses the process boundary too.
        tokens = httpx.post(
            server.url + "/pooling", json={"input": inputs[:3], "task": "token_embed"}, timeout=30
        )
        assert tokens.status_code == 200, tokens.text
        for row, want in zip(
            tokens.json()["data"], reference.embed_tokens(inputs[:3]), strict=True
        ):
            np.testing.assert_allclose(row["data"], want, atol=1e-6)
        # Every scrape, on a new connection to whichever front-end accepts it, counts the
        # requests of both.
        for _ in range(6):
            text = httpx.get(server.url + "/metrics", timeout=10).text
            labels = {"endpoint": "/v1/embeddings", "status": "200"}
            assert sample(text, "embedding_server_requests_total", labels) == len(requests)
            assert sample(text, "embedding_server_input_tokens_total") is not None
            assert sample(text, QUEUE_REQUESTS_METRIC) == 0
            assert sample(text, BACKLOG_SECONDS_METRIC) == 0  # the engine's, idle
            assert (sample(text, "embedding_server_model_load_seconds") or 0) > 0
            # The engine process times every forward pass, and any front-end reports it.
            passes = sample(text, "embedding_server_batch_size_count")
            assert passes and sample(text, "embedding_server_batch_seconds_count") == passes
        # Only the engine process loads the model runtime: a front-end of an embedding model
        # has no torch (about 2 s of start-up and 270 MB of memory each).
        assert _maps_torch(server.process.pid)
        for child in server.children:
            assert not _maps_torch(child.pid), f"front-end {child.pid} loaded torch"


def _maps_torch(pid: int) -> bool:
    return any("libtorch" in Path(m.path).name for m in psutil.Process(pid).memory_maps())


@pytest.mark.parametrize("per_token", [False, True], ids=["classify", "token_classify"])
def test_classifiers_answer_through_front_ends_without_torch(
    tmp_path: Path, per_token: bool
) -> None:
    """A classifier's head runs in the engine's batches (a token classifier's too, on the
    token states), its activation per request in numpy: the front-ends still load no torch,
    and the answers are the one-process engine's."""
    path = build_classifier(tmp_path / "model", "bert", 3, per_token=per_token)
    reference = Engine.from_pretrained(str(path), dtype="float32")
    inputs = texts(12)
    task = "token_classify" if per_token else "classify"
    with server_process(["--model", str(path), "--dtype", "float32", *WORKERS], workers=2) as s:
        for _ in range(4):  # whichever front-end accepts each connection
            response = httpx.post(
                s.url + "/pooling", json={"input": inputs, "task": task}, timeout=60
            )
            assert response.status_code == 200, response.text
            rows = [row["data"] for row in response.json()["data"]]
            want = reference.encode(inputs, task=task)
            for got, expected in zip(rows, want, strict=True):
                np.testing.assert_allclose(got, expected, atol=1e-5)
        for child in s.children:
            assert not _maps_torch(child.pid), f"front-end {child.pid} loaded torch"


def _post_raw(port: int, text: str) -> socket.socket:
    """A request on a plain socket, so the test decides when its client hangs up."""
    body = json.dumps({"input": text}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return sock


def test_queue_depth_429_and_cancellation_cross_the_process_boundary() -> None:
    # 8 s per one-sequence pass (the checks below must fit in the first pass, also on a busy
    # machine); 32-token inputs; the queue holds 4 of them.
    args = ["--model", "fake?delay_ms=8000&max_len=64", *SLOW, "--max-queue-tokens", "128"]
    text = "q" * 30  # 32 tokens with <s> and </s>
    with server_process([*args, *WORKERS], workers=2) as server:
        crowd: list[socket.socket] = []
        try:
            # One request in the forward pass, the next prepared beside it (it has left the
            # queue), then four queued, sent one at a time so that none is refused for
            # arriving before the first two left the queue: every front-end, whichever
            # accepts the scrape, reports the engine's queue.
            for sent in range(1, 7):
                crowd.append(_post_raw(server.port, text))
                queued = max(0, sent - 2)
                wait_for(
                    lambda queued=queued: scrape(server.url, QUEUE_REQUESTS_METRIC) == queued,
                    timeout=60,
                    what=f"{queued} request(s) queued in the engine",
                )
            for _ in range(4):
                assert scrape(server.url, QUEUE_REQUESTS_METRIC) == 4
            refused = httpx.post(server.url + "/v1/embeddings", json={"input": text}, timeout=30)
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
        finally:
            for sock in crowd:  # the crowd hangs up
                sock.close()
        wait_for(
            lambda: scrape(server.url, QUEUE_REQUESTS_METRIC) == 0,
            timeout=30,
            what="the cancelled requests to leave the engine's queue",
        )
        # Batches run oldest first: once a later request is answered, any pass for the
        # cancelled ones would have run before it.
        # (The front-end that answered 429 hears that the queue drained a moment after the
        # engine's gauge shows it: a request in that moment may still be refused.)
        answers: list[httpx.Response] = []

        def late_answered() -> bool:
            late = httpx.post(server.url + "/v1/embeddings", json={"input": "late"}, timeout=60)
            answers.append(late)
            return late.status_code != 429

        wait_for(late_answered, timeout=10, what="a request to be admitted once the queue drained")
        assert answers[-1].status_code == 200, answers[-1].text
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        # The first request's pass, perhaps one more taken as it ended (on a slow machine the
        # checks above can outlast a pass; a prepared batch whose requests all hung up is
        # dropped) and the late one's; without the withdrawal, 7.
        passes = sample(metrics, "embedding_server_batch_size_count")
        assert passes is not None and 2 <= passes <= 3, passes
        cancelled = {"endpoint": "/v1/embeddings", "status": "499"}
        assert sample(metrics, "embedding_server_requests_total", cancelled) == 6


def test_sigterm_drains_in_flight_requests_then_every_process_exits_0() -> None:
    args = ["--model", "fake?delay_ms=250&max_len=64", *SLOW, "--log-format", "json"]
    with server_process([*args, *WORKERS], workers=2) as server:

        async def scenario() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as http:
                tasks = [
                    asyncio.create_task(
                        http.post(server.url + "/v1/embeddings", json={"input": f"request {i}"})
                    )
                    for i in range(6)
                ]
                await asyncio.to_thread(
                    wait_for,
                    lambda: (scrape(server.url, "embedding_server_in_flight_requests") or 0) >= 7,
                    timeout=30,
                    what="six requests in flight (and the scrape)",
                )
                server.process.send_signal(signal.SIGTERM)
                return [r.status_code for r in await asyncio.gather(*tasks)]

        assert asyncio.run(scenario()) == [200] * 6
        assert server.wait_gone(timeout=60) == 0
        output = server.output()
        assert "Traceback" not in output
        messages = [json.loads(line)["message"] for line in output.splitlines() if line.strip()]
        assert sum("draining (SIGTERM)" in m for m in messages) == 2, messages
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=2)


def test_an_engine_failure_stops_every_process_with_status_1() -> None:
    # Pass 1 is the warm-up; each front-end's golden probe set takes pass 2 or 3 (the two
    # share a batch when they meet in the queue); the first request is then pass 3 or 4,
    # and 5 and later meet a poisoned device.
    with server_process(["--model", "fake?device_error_after=4", *WORKERS], workers=2) as server:
        url = server.url + "/v1/embeddings"
        assert httpx.post(url, json={"input": "fine"}, timeout=30).status_code == 200
        failed = httpx.post(url, json={"input": "poisoned"}, timeout=30)
        if failed.status_code == 200:  # the probe sets took one pass: this was pass 4
            failed = httpx.post(url, json={"input": "poisoned"}, timeout=30)
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["code"] == "engine_failed"

        def not_ready() -> bool:
            try:
                return httpx.get(server.url + "/ready", timeout=2).status_code != 200
            except httpx.HTTPError:
                return True  # no front-end listens any more

        wait_for(not_ready, timeout=30, what="readiness to drop")
        assert server.wait_gone(timeout=60) == 1
        assert "illegal memory access" in server.output()


def test_front_ends_exit_when_the_engine_process_is_killed(tmp_path: Path) -> None:
    args = ["--model", "fake?delay_ms=3000", *WORKERS]
    with server_process(args, workers=2, env={"TMPDIR": str(tmp_path)}) as server:
        assert list(tmp_path.glob("embedding-server-*"))  # the engine socket, the metrics
        assert len(server.children) == 2

        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as http:
                waiting = asyncio.create_task(
                    http.post(server.url + "/v1/embeddings", json={"input": "x"})
                )
                await asyncio.to_thread(
                    wait_for,
                    lambda: (scrape(server.url, "embedding_server_in_flight_requests") or 0) >= 2,
                    timeout=30,
                    what="the request in flight",
                )
                server.process.kill()
                return await waiting

        answered = asyncio.run(scenario())
        assert answered.status_code == 503, answered.text
        assert answered.json()["error"]["code"] == "engine_failed"
        assert server.wait_gone(timeout=60) == -signal.SIGKILL
        # The front-ends clean up what the killed engine process left.
        assert not list(tmp_path.glob("embedding-server-*"))


def _serving_pid(server: ServerProcess, conn: http.client.HTTPConnection) -> int | None:
    """The front-end process that accepted ``conn`` (None until one has)."""
    assert conn.sock is not None
    local = conn.sock.getsockname()[1]
    for child in frontend_processes(server.process.pid):
        with contextlib.suppress(psutil.Error):
            for c in child.net_connections("tcp"):
                if c.laddr.port == server.port and c.raddr and c.raddr.port == local:
                    return child.pid
    return None


def _connections_on_each(
    server: ServerProcess, pids: set[int], each: int
) -> dict[int, list[http.client.HTTPConnection]]:
    """Keep-alive connections, opened until each front-end in ``pids`` has accepted
    ``each`` of them (the kernel, not the client, picks the front-end).

    Polled to a deadline, not a count: a front-end just started in place of a killed one
    accepts nothing until it listens, and on a loaded machine that took longer than 200 quick
    attempts."""
    by_pid: dict[int, list[http.client.HTTPConnection]] = {pid: [] for pid in pids}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(len(conns) >= each for conns in by_pid.values()):
            break
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().read() is not None
        pid = _serving_pid(server, conn)
        if pid in by_pid and len(by_pid[pid]) < each:
            by_pid[pid].append(conn)
        else:
            conn.close()
            time.sleep(0.02)
    assert all(len(conns) >= each for conns in by_pid.values()), by_pid
    return by_pid


def _embed(conn: http.client.HTTPConnection, text: str) -> int:
    conn.request(
        "POST",
        "/v1/embeddings",
        body=json.dumps({"input": text}),
        headers={"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    response.read()
    return response.status


def test_a_killed_front_end_is_restarted_and_only_its_own_requests_fail() -> None:
    """kill -9 of one front-end under load: the engine process starts another in its place;
    the requests on the killed one's connections fail, no request on the other front-end
    does, the new one serves, and /metrics counts no request of the dead one as in flight."""
    with server_process(["--model", "fake?delay_ms=20", *WORKERS], workers=2) as server:
        pids = {child.pid for child in server.children}
        victim, survivor = sorted(pids)
        by_pid = _connections_on_each(server, pids, each=3)
        statuses: dict[int, list[int | str]] = {}
        stop = threading.Event()

        def drive(conn: http.client.HTTPConnection) -> None:
            seen = statuses.setdefault(id(conn), [])
            while not stop.is_set():
                try:
                    seen.append(_embed(conn, f"request {len(seen)}"))
                except (OSError, http.client.HTTPException) as error:
                    seen.append(type(error).__name__)
                    return

        threads = [
            threading.Thread(target=drive, args=(conn,), daemon=True)
            for conns in by_pid.values()
            for conn in conns
        ]
        for thread in threads:
            thread.start()
        wait_for(
            lambda: len(statuses) == len(threads) and all(len(s) >= 3 for s in statuses.values()),
            timeout=60,
            what="every connection to be answered a few times",
        )
        psutil.Process(victim).kill()

        def replaced() -> bool:
            current = {p.pid for p in frontend_processes(server.process.pid) if alive(p)}
            return len(current) == 2 and victim not in current and survivor in current

        wait_for(replaced, timeout=60, what="a new front-end in place of the killed one")
        (fresh,) = {p.pid for p in frontend_processes(server.process.pid)} - {survivor}
        # The survivor keeps serving while the new one comes up, and after.
        answered = {id(c): len(statuses[id(c)]) for c in by_pid[survivor]}
        wait_for(
            lambda: all(len(statuses[i]) >= n + 5 for i, n in answered.items()),
            timeout=60,
            what="the surviving front-end to go on answering",
        )
        (new_conn,) = _connections_on_each(server, {fresh}, each=1)[fresh]
        assert _embed(new_conn, "served by the new front-end") == 200
        stop.set()
        for thread in threads:
            thread.join(timeout=60)

        for conn in by_pid[survivor]:
            assert set(statuses[id(conn)]) == {200}, statuses[id(conn)]
        for conn in by_pid[victim]:  # its in-flight (or next) request failed
            assert isinstance(statuses[id(conn)][-1], str), statuses[id(conn)]
        assert server.process.poll() is None
        served = sum(s.count(200) for s in statuses.values()) + 1  # + the new front-end's
        labels = {"endpoint": "/v1/embeddings", "status": "200"}
        scraped: list[tuple[float | None, float | None]] = []

        def settled() -> bool:
            """In flight: this scrape alone (none of the dead front-end's); counted: every
            request answered (the dead one's count survives it; a request of it may have been
            counted but never reached its client). A request's count lands a moment after
            its answer, so this is polled."""
            text = httpx.get(server.url + "/metrics", timeout=10).text
            in_flight = sample(text, "embedding_server_in_flight_requests")
            counted = sample(text, "embedding_server_requests_total", labels)
            scraped.append((in_flight, counted))
            return (
                in_flight == 1
                and counted is not None
                and 0 <= counted - served <= len(by_pid[victim])
            )

        try:
            wait_for(settled, timeout=10, interval=0.2, what=f"sane metrics ({served} answered)")
        except AssertionError as error:
            raise AssertionError(f"{error}; (in flight, counted): {scraped[-3:]}") from None
    assert "restarting it" in server.output()


def test_a_front_end_that_keeps_dying_ends_the_server_with_status_1() -> None:
    """The restarts are bounded: past RESTART_LIMIT within RESTART_WINDOW_S the engine
    process stops every process and exits 1, as before restarts existed, so that
    Kubernetes restarts the pod."""
    from embedding_server.workers import RESTART_LIMIT

    with server_process(["--model", "fake", *WORKERS], workers=2) as server:
        killed: set[int] = set()
        for _ in range(RESTART_LIMIT + 1):
            wait_for(
                lambda: (
                    server.process.poll() is not None
                    or any(
                        p.pid not in killed and alive(p)
                        for p in frontend_processes(server.process.pid)
                    )
                ),
                timeout=60,
                what="a front-end to kill",
            )
            if server.process.poll() is not None:
                break
            child = min(
                (p for p in frontend_processes(server.process.pid) if p.pid not in killed),
                key=lambda p: p.pid,
            )
            killed.add(child.pid)
            with contextlib.suppress(psutil.Error):
                child.kill()
        assert server.wait_gone(timeout=60) == 1
        output = server.output()
        assert output.count("restarting it") == RESTART_LIMIT, output
        assert f"{RESTART_LIMIT} restarts within" in output, output


def test_images_through_front_ends_get_the_vectors_of_one_process() -> None:
    """A front-end decodes and preprocesses the image itself (its processor came in the
    handoff) and sends the pixels to the engine process: the vector is the image's."""
    from tests.support.images import data_uri, picture

    model = "fake?dim=32&image_tokens=8"
    reference = Engine.from_pretrained(model)
    images = [picture(1), picture(2)]
    with server_process(["--model", model, *WORKERS], workers=2) as server:
        for image in images:
            part = {"type": "image_url", "image_url": {"url": data_uri(image)}}
            body = {"messages": [{"role": "user", "content": [part]}]}
            response = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
            assert response.status_code == 200, response.text
            got = np.array(response.json()["data"][0]["embedding"])
            np.testing.assert_allclose(got, reference.embed(image)[0], atol=1e-6)

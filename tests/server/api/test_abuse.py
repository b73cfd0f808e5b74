"""Every attack of the hardening review (issue 14), replayed against the real server.

Each test starts from what one unauthenticated client could do to a shared
``embedding-server serve`` process (real CLI, real all-MiniLM-L6-v2, 127.0.0.1) and checks
what the other clients and the operator would notice: the attacker gets a 4xx with an
OpenAI-shaped body naming the limit or the field, another client keeps being served, the
event loop keeps answering ``/health``, no traceback reaches the log, and the process's
memory comes back near where it started. Sizes are picked so that each attack would
succeed without its fix (lock the queue, block the loop, grow the pod's memory) yet every
test stays within seconds on two CPU cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.harness.proc import free_port
from tests.support.api import scrape, wait_for

pytestmark = pytest.mark.timeout(300)

SCRIPT = os.path.join(os.path.dirname(sys.executable), "embedding-server")
MAX_LEN = 64
"""The served model's input limit here (MiniLM allows 256): small inputs keep forward
passes short on CPU, and every limit below scales from it."""
MAX_REQUEST_TOKENS = 8192
MAX_RESPONSE_BYTES = 16_000_000


@dataclass
class Served:
    """A running ``embedding-server serve`` process and where its log goes."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))
        return int(kib) * 1024

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def serve(log: Path, *flags: str) -> Iterator[Served]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [SCRIPT, "serve", "--port", str(port), "--log-format", "json", *flags],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    served = Served(process, f"http://127.0.0.1:{port}", log)
    try:

        def ready() -> bool:
            assert process.poll() is None, served.log_text()
            try:
                return httpx.get(served.url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=120, what="the server to become ready")
        yield served
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """MiniLM with small, explicit limits: 16384 tokens may wait, one request may hold 8192."""
    log = tmp_path_factory.mktemp("abuse") / "server.log"
    with serve(
        log,
        "--max-model-len", str(MAX_LEN),
        "--max-queue-tokens", "16384",
        "--max-request-tokens", str(MAX_REQUEST_TOKENS),
        "--max-response-bytes", str(MAX_RESPONSE_BYTES),
        "--tokenizer-workers", "2",
    ) as served:  # fmt: skip
        yield served


def assert_refused(response: httpx.Response, status: int, *, param: str | None = None) -> str:
    """The response is ``status`` with the OpenAI error body; returns its message."""
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return str(error["message"])


def embed_ok(url: str, text: str = "a short question") -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json={"input": text}, timeout=30)


def batches_run(url: str) -> float:
    return scrape(url, "embedding_server_batch_tokens_count") or 0.0


# -- 1. a request's cost is bounded before any work -------------------------------------------


def test_a_request_bigger_than_the_per_request_limit_is_refused_and_others_are_served(
    server: Served,
) -> None:
    # 2048 inputs of 64 token ids: 16 x the per-request limit and 8 x what may wait. An
    # empty queue used to admit it, and every other client then got 429 until it drained.
    flood = {"input": [[1000 + i % 5000] * MAX_LEN for i in range(2048)]}
    before = batches_run(server.url)
    message = assert_refused(
        httpx.post(server.url + "/v1/embeddings", json=flood, timeout=60), 413, param="input"
    )
    assert "max_request_tokens" in message and str(MAX_REQUEST_TOKENS) in message
    assert batches_run(server.url) == before  # not a single forward pass for it
    assert embed_ok(server.url).status_code == 200


def test_a_crowd_of_long_texts_is_refused_before_tokenizing_and_memory_comes_back(
    server: Served,
) -> None:
    # 24 clients at once, each with 48 texts of 60 000 characters (2.9 MB): each text is
    # clipped to what 64 tokens can use, and what the queue cannot take is refused (429)
    # before it is tokenized. Unclipped, the admitted ones alone grew the process by ~300 MiB
    # that it kept (measured: ~35 MiB with clipping).
    text = " ".join(f"word{i} lorem ipsum" for i in range(3500))[:60_000]
    body = {"input": [text] * 48, "truncate_prompt_tokens": -1}
    embed_ok(server.url)
    baseline = server.rss_bytes()

    async def crowd() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(timeout=120) as http:
            attack = [
                asyncio.create_task(http.post(server.url + "/v1/embeddings", json=body))
                for _ in range(24)
            ]
            bystander: list[int] = []
            while not all(task.done() for task in attack) or not bystander:
                reply = await http.post(server.url + "/v1/embeddings", json={"input": "hi"})
                bystander.append(reply.status_code)
                await asyncio.sleep(0.05)
            return [t.result().status_code for t in attack], bystander

    attack, bystander = asyncio.run(crowd())
    assert set(attack) <= {200, 429} and 200 in attack and 429 in attack, attack
    assert 200 in bystander and set(bystander) <= {200, 429}, bystander
    grown = server.rss_bytes() - baseline
    assert grown < 150 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


# -- 2. output size is bounded ------------------------------------------------------------------


def test_per_token_pooling_output_over_the_response_limit_is_refused_before_the_forward_pass(
    server: Served,
) -> None:
    # 64 inputs of 64 tokens per token x 384 floats as JSON: ~25 MB from a 20 KB request.
    body = {"input": [" ".join(["word"] * 70)] * 64, "truncate_prompt_tokens": -1}
    before = batches_run(server.url)
    message = assert_refused(
        httpx.post(server.url + "/pooling", json=body, timeout=60), 400, param="input"
    )
    assert "max_response_bytes" in message
    assert batches_run(server.url) == before
    # The pooled vector, or per-token output that fits, is still served.
    pooled = httpx.post(server.url + "/pooling", json={**body, "task": "embed"}, timeout=60)
    assert pooled.status_code == 200 and len(pooled.json()["data"][0]["data"]) == 384
    small = httpx.post(server.url + "/pooling", json={"input": "hello world"}, timeout=60)
    assert small.status_code == 200 and len(small.json()["data"][0]["data"]) == 4


def test_a_bytes_metadata_header_too_big_for_clients_points_at_bytes_only(
    server: Served,
) -> None:
    body = {"input": [f"text {i}" for i in range(300)], "encoding_format": "bytes"}
    message = assert_refused(
        httpx.post(server.url + "/v1/embeddings", json=body, timeout=60),
        400,
        param="encoding_format",
    )
    assert "bytes_only" in message
    raw = httpx.post(
        server.url + "/v1/embeddings", json={**body, "encoding_format": "bytes_only"}, timeout=60
    )
    assert raw.status_code == 200 and len(raw.content) == 300 * 384 * 4


def test_tokenize_and_detokenize_inputs_are_capped(server: Served) -> None:
    too_many = [2000] * (MAX_REQUEST_TOKENS + 1)
    message = assert_refused(
        httpx.post(server.url + "/detokenize", json={"tokens": too_many}, timeout=30),
        413,
        param="tokens",
    )
    assert "max_request_tokens" in message
    long_prompt = "word " * (MAX_REQUEST_TOKENS + 10)
    assert_refused(
        httpx.post(server.url + "/tokenize", json={"prompt": long_prompt}, timeout=30),
        413,
        param="prompt",
    )
    fits = httpx.post(server.url + "/detokenize", json={"tokens": [7592, 2088]}, timeout=30)
    assert fits.json() == {"prompt": "hello world"}


# -- 4. text that is not Unicode ----------------------------------------------------------------

LONE = "\\ud800"  # what a JSON body carries: the escape, not a character
SURROGATE_CASES = [
    ("/v1/embeddings", '{"input": "a%sb"}', "input"),
    ("/v1/embeddings", '{"input": ["fine", "%s"]}', "input"),
    ("/v1/embeddings", '{"input": "fine", "model": "%s"}', "model"),
    ("/v2/embed", '{"texts": ["%s"]}', "texts"),
    ("/score", '{"text_1": "%s", "text_2": "b"}', "text_1"),
    ("/tokenize", '{"prompt": "%s"}', "prompt"),
    ("/pooling", '{"input": "%s"}', "input"),
    ("/rerank", '{"query": "%s", "documents": ["a"]}', "query"),
    ("/v1/rerank", '{"query": "q", "documents": ["a", "%s"]}', "documents"),
    ("/v2/rerank", '{"query": "q", "documents": [{"text": "%s"}]}', "documents"),
    ("/rerank", '{"query": "q", "documents": ["a"], "model": "%s"}', "model"),
    ("/classify", '{"input": "%s"}', "input"),
    ("/v1/classify", '{"input": ["a", "%s"]}', "input"),
]


@pytest.mark.parametrize(("path", "template", "param"), SURROGATE_CASES)
def test_a_lone_surrogate_is_a_400_naming_the_field_without_a_traceback(
    server: Served, path: str, template: str, param: str
) -> None:
    raw = (template % LONE).encode()
    response = httpx.post(
        server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    message = assert_refused(response, 400, param=param)
    assert "surrogate" in message
    assert "Traceback" not in server.log_text()


# -- 9. only JSON bodies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_a_post_that_is_not_labelled_json_is_a_415(
    server: Served, content_type: str | None
) -> None:
    # What a web page may send to any address without a CORS preflight.
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(
        server.url + "/v1/embeddings", content=b'{"input": "a"}', headers=headers, timeout=30
    )
    assert_refused(response, 415)
    labelled = httpx.post(
        server.url + "/v1/embeddings",
        content=b'{"input": "a"}',
        headers={"content-type": "application/json; charset=utf-8"},
        timeout=30,
    )
    assert labelled.status_code == 200


def test_token_ids_outside_the_vocabulary_are_a_400(server: Served) -> None:
    # MiniLM's table and vocabulary agree; test_engine.py covers a table smaller than the
    # vocabulary, whose extra ids would be out-of-range rows (a device assert on CUDA).
    response = httpx.post(server.url + "/v1/embeddings", json={"input": [[101, 30522]]}, timeout=30)
    assert "30522" in assert_refused(response, 400, param="input")


# -- 3. the event loop stays free -----------------------------------------------------------


@pytest.fixture(scope="module")
def roomy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Limits high enough for one request to keep the CPU busy for seconds."""
    log = tmp_path_factory.mktemp("abuse-roomy") / "server.log"
    with serve(
        log,
        "--max-model-len", str(MAX_LEN),
        "--max-queue-tokens", "4000000",
        "--max-request-tokens", "4000000",
        "--max-request-bytes", str(32 * 2**20),
    ) as served:  # fmt: skip
        yield served


def test_health_answers_while_a_huge_detokenize_runs(roomy_server: Served) -> None:
    # 2 million token ids: seconds of decoding (and of checking the ids), which used to run
    # on the event loop; two such requests in a row failed the liveness probe.
    ids = [1000 + (i * 7919) % 29000 for i in range(2_000_000)]
    result: dict[str, Any] = {}

    def attack() -> None:
        result["response"] = httpx.post(
            roomy_server.url + "/detokenize", json={"tokens": ids}, timeout=120
        )

    thread = threading.Thread(target=attack)
    thread.start()
    answered_while_busy = 0
    try:
        while thread.is_alive():
            started = time.monotonic()
            # A generous deadline (a liveness probe's default is 1 s): the request body's
            # JSON is still parsed on the loop, everything after it is not.
            health = httpx.get(roomy_server.url + "/health", timeout=2.0)
            assert health.status_code == 200
            if thread.is_alive():
                answered_while_busy += 1
            time.sleep(max(0.0, 0.05 - (time.monotonic() - started)))
    finally:
        thread.join(timeout=120)
    assert result["response"].status_code == 200
    assert answered_while_busy >= 3

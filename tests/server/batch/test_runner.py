"""The send loop against a stand-in server (httpx2.MockTransport): the window it keeps in
flight, what it reads ahead, and how it waits out 429, 503 and a server that is not there."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx2
import orjson
import pytest
from embedding_server.batch.lines import BatchFileError, Key
from embedding_server.batch.output import BatchOutput
from embedding_server.batch.runner import BatchCounts, Progress, run_batch, scan_input

URLS = frozenset({"/v1/embeddings"})
Handler = Callable[[httpx2.Request], Awaitable[httpx2.Response]]


def write_input(path: Path, count: int, *, sizes: list[int] | None = None) -> Path:
    with path.open("wb") as handle:
        for index in range(count):
            text = "x" * (sizes[index] if sizes else 1)
            body = {"model": "m", "input": text}
            line = {
                "custom_id": f"r{index}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": body,
            }
            handle.write(orjson.dumps(line) + b"\n")
    return path


def run(
    tmp_path: Path,
    handler: Handler,
    *,
    count: int = 20,
    answered: set[Key] | None = None,
    **options: object,
) -> tuple[BatchCounts, list[dict[str, object]]]:
    source = tmp_path / "in.jsonl"
    if not source.exists():
        write_input(source, count)
    output = BatchOutput(tmp_path / "out.jsonl")
    known = output.recover() if answered is None else answered
    scan = scan_input(source, known)

    async def main() -> BatchCounts:
        output.open()
        try:
            transport = httpx2.MockTransport(handler)
            async with httpx2.AsyncClient(transport=transport, base_url="http://t") as client:
                return await run_batch(
                    source,
                    output,
                    client,
                    urls=URLS,
                    answered=known,
                    total=scan.total,
                    progress=Progress(scan.total, len(known)),
                    **options,  # type: ignore[arg-type]
                )
        finally:
            output.close()

    counts = asyncio.run(main())
    lines = [orjson.loads(raw) for raw in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    return counts, lines


def ok(request: httpx2.Request) -> httpx2.Response:
    body = orjson.loads(request.content)
    return httpx2.Response(200, json={"echo": body["input"]}, headers={"x-request-id": "srv"})


def test_at_most_max_in_flight_requests_are_out_at_once(tmp_path: Path) -> None:
    in_flight = 0
    peak = 0

    async def handler(request: httpx2.Request) -> httpx2.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.005)
        in_flight -= 1
        return ok(request)

    counts, lines = run(tmp_path, handler, count=60, max_in_flight=4)
    assert peak == 4
    assert counts.succeeded == 60 and counts.answered == 60
    assert sorted(line["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(60))
    assert all(line["response"]["status_code"] == 200 for line in lines)  # type: ignore[index]
    assert {line["response"]["request_id"] for line in lines} == {"srv"}  # type: ignore[index]


def test_the_input_is_read_a_bounded_window_ahead_of_what_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory stays bounded whatever the file's size: the reader is never more than the read
    ahead (a few windows of max_in_flight) past the answers written."""
    write_input(tmp_path / "in.jsonl", 400)
    written = 0
    farthest = 0
    original = BatchOutput.write

    def counting_write(self: BatchOutput, line: bytes) -> None:
        nonlocal written
        written += 1
        original(self, line)

    async def handler(request: httpx2.Request) -> httpx2.Response:
        nonlocal farthest
        line = int(request.headers["x-request-id"].removeprefix("batch_req_"))
        farthest = max(farthest, line - written)
        await asyncio.sleep(0)
        return ok(request)

    monkeypatch.setattr(BatchOutput, "write", counting_write)
    counts, _ = run(tmp_path, handler, max_in_flight=8)
    assert counts.succeeded == 400 and written == 400
    # The read-ahead (4 windows of 8), the queue (8) and the 8 in flight, at most.
    assert 8 <= farthest <= 8 * 4 + 8 + 8


def test_requests_of_one_size_go_out_together(tmp_path: Path) -> None:
    sizes = [1, 500, 1, 500, 1, 500, 1, 500]
    write_input(tmp_path / "in.jsonl", len(sizes), sizes=sizes)
    seen: list[int] = []

    async def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(len(orjson.loads(request.content)["input"]))
        return ok(request)

    run(tmp_path, handler, max_in_flight=2)  # one read-ahead of 8 holds them all
    assert seen == [500, 500, 500, 500, 1, 1, 1, 1]


def test_429_and_503_wait_their_retry_after_then_the_answer_is_written(tmp_path: Path) -> None:
    refusals: dict[str, int] = {}

    async def handler(request: httpx2.Request) -> httpx2.Response:
        key = request.headers["x-request-id"]
        refusals[key] = refusals.get(key, 0) + 1
        if refusals[key] == 1:
            return httpx2.Response(
                429, json={"error": {"code": "queue_full"}}, headers={"Retry-After": "0"}
            )
        if refusals[key] == 2:
            return httpx2.Response(
                503, json={"error": {"code": "not_ready"}}, headers={"Retry-After": "0"}
            )
        return ok(request)

    counts, lines = run(tmp_path, handler, count=5)
    assert counts.succeeded == 5 and counts.failed == 0
    assert set(refusals.values()) == {3}
    assert [line["error"] for line in lines] == [None] * 5


def test_a_429_past_retry_for_is_written_as_the_answer(tmp_path: Path) -> None:
    async def handler(request: httpx2.Request) -> httpx2.Response:
        body = {"error": {"message": "queue full", "code": "queue_full"}}
        return httpx2.Response(429, json=body, headers={"Retry-After": "5"})

    counts, lines = run(tmp_path, handler, count=2, retry_for=1.0)
    assert counts.failed == 2
    assert {line["error"]["code"] for line in lines} == {"queue_full"}  # type: ignore[index]
    assert {line["response"]["status_code"] for line in lines} == {429}  # type: ignore[index]


def test_a_server_that_never_answers_gets_a_failure_line_per_request(tmp_path: Path) -> None:
    async def handler(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused", request=request)

    counts, lines = run(tmp_path, handler, count=3, retry_for=0.2)
    assert counts.failed == 3
    assert {line["error"]["code"] for line in lines} == {"server_unreachable"}  # type: ignore[index]
    assert all("connection refused" in line["error"]["message"] for line in lines)  # type: ignore[index]
    assert [line["response"] for line in lines] == [None] * 3


def test_what_the_output_answers_is_not_sent_again(tmp_path: Path) -> None:
    sent: list[str] = []

    async def handler(request: httpx2.Request) -> httpx2.Response:
        sent.append(request.headers["x-request-id"])
        return ok(request)

    first, _ = run(tmp_path, handler, count=10)
    assert first.succeeded == 10
    sent.clear()
    again, lines = run(tmp_path, handler, count=10)
    assert sent == [] and again.already == 10 and len(lines) == 10


def test_a_repeated_custom_id_is_refused_naming_both_lines(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    row = b'{"custom_id": "same", "url": "/v1/embeddings", "body": {}}\n'
    source.write_bytes(row + b"\n" + row)
    with pytest.raises(BatchFileError, match="'same' is on line 1 and line 3"):
        scan_input(source, set())


def test_the_scan_counts_requests_and_what_is_left(tmp_path: Path) -> None:
    source = write_input(tmp_path / "in.jsonl", 6)
    source.write_bytes(source.read_bytes() + b"\n   \nnot json\n")
    scan = scan_input(source, {"r0", "r1", 9})
    assert (scan.total, scan.remaining) == (7, 4)

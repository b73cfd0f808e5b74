"""``embedding-server job plan`` and ``job work``, as an EmbeddingJob's pods run them, on local
files and on an S3 store (moto on 127.0.0.1), in Parquet, JSONL and CSV: the plan cuts and is
kept, the packaged MiniLM served by a real server embeds every row once with
sentence-transformers' vectors, refused rows land in the errors file, a worker killed
mid-shard leaves no part and its rerun commits it, and a shard answered by two computations
is not committed."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from embedding_server.cli import main
from embedding_server.settings import ServerSettings
from sentence_transformers import SentenceTransformer

from e2e.harness.proc import free_port
from tests.support.api import RunningServer, fake_settings, running_server, wait_for
from tests.support.models import MINILM_DIR
from tests.support.s3 import S3Store, moto_s3

SCRIPT = os.path.join(os.path.dirname(sys.executable), "embedding-server")
FORMATS = ["parquet", "jsonl", "csv"]
LONG_TEXT = "word " * 700  # beyond MiniLM's 256 tokens: the API refuses it (400)
Row = tuple[Any, str | None]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Store]:
    with moto_s3() as store:
        yield store


@dataclass
class Place:
    """Where a test's corpus and output live: a local folder or an S3 bucket."""

    fs: pafs.FileSystem
    root: str
    """The folder's path in ``fs``."""
    url_root: str
    env: dict[str, str]

    def url(self, name: str) -> str:
        return f"{self.url_root}/{name}"

    def write(self, name: str, data: bytes) -> None:
        if isinstance(self.fs, pafs.LocalFileSystem):
            self.fs.create_dir(os.path.dirname(f"{self.root}/{name}"), recursive=True)
        with self.fs.open_output_stream(f"{self.root}/{name}") as stream:
            stream.write(data)

    def read(self, name: str) -> bytes:
        with self.fs.open_input_stream(f"{self.root}/{name}") as stream:
            data: bytes = stream.read()
        return data

    def exists(self, name: str) -> bool:
        return bool(self.fs.get_file_info(f"{self.root}/{name}").type == pafs.FileType.File)

    def files(self, folder: str) -> list[str]:
        selector = pafs.FileSelector(f"{self.root}/{folder}", allow_not_found=True)
        return sorted(
            info.base_name
            for info in self.fs.get_file_info(selector)
            if info.type == pafs.FileType.File
        )


@pytest.fixture(params=["local", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Place:
    if request.param == "local":
        return Place(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path), {})
    store: S3Store = request.getfixturevalue("s3")
    for name, value in store.environment.items():
        monkeypatch.setenv(name, value)
    bucket = store.new_bucket()
    return Place(store.filesystem(), bucket, f"s3://{bucket}", store.environment)


def corpus_bytes(fmt: str, rows: list[Row]) -> bytes:
    """One file of ``rows`` (id, text) with columns doc_id and body; a None text is left out
    (JSONL), null (Parquet) or empty (CSV). Parquet in row groups of 5 rows."""
    if fmt == "jsonl":
        return b"".join(
            orjson.dumps({"doc_id": i, **({"body": t} if t is not None else {})}) + b"\n"
            for i, t in rows
        )
    table = pa.table({"doc_id": [i for i, _ in rows], "body": [t for _, t in rows]})
    sink = pa.BufferOutputStream()
    if fmt == "parquet":
        pq.write_table(table, sink, row_group_size=5)
    else:
        pacsv.write_csv(table, sink)
    return bytes(sink.getvalue().to_pybytes())


def write_corpus(place: Place, fmt: str, files: list[list[Row]]) -> str:
    """The files under ``corpus/``; the glob that names them."""
    for number, rows in enumerate(files):
        place.write(f"corpus/part-{number}.{fmt}", corpus_bytes(fmt, rows))
    return place.url(f"corpus/*.{fmt}")


def row_id(fmt: str, n: int) -> Any:
    return n if fmt == "parquet" else f"d-{n}"


def run(*args: str, log: Path | None = None) -> tuple[int, dict[str, Any] | None]:
    """``embedding-server job ARGS`` in this process; its exit status and termination log."""
    extra = ["--termination-log", str(log)] if log is not None else []
    code = main(["job", *args, *extra])
    summary = json.loads(log.read_text()) if log is not None and log.exists() else None
    return code, summary


def plan_args(glob: str, fmt: str, output: str, shard_rows: int) -> list[str]:
    return [
        "plan",
        "--input",
        glob,
        "--format",
        fmt,
        "--id-field",
        "doc_id",
        "--text-field",
        "body",
        "--output",
        output,
        "--shard-rows",
        str(shard_rows),
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_plan_cuts_every_file_and_is_kept_for_the_same_arguments(
    place: Place, fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [[(row_id(fmt, 100 * f + n), f"text {n}") for n in range(23)] for f in range(2)]
    glob = write_corpus(place, fmt, files)
    output = place.url("out")
    log = tmp_path / "plan.log"
    code, summary = run(*plan_args(glob, fmt, output, 10), log=log)
    assert code == 0, capsys.readouterr().err
    assert summary == {"shards": 6, "rows": 46}
    plan = orjson.loads(place.read("out/_plan.json"))
    assert plan["files"] == [place.url(f"corpus/part-{n}.{fmt}") for n in range(2)]
    # Parquet: row groups of 5 rows taken whole (10, 10, 3); JSONL and CSV: rows (10, 10, 3).
    unit_ranges = [[0, 2], [2, 4], [4, 5]] if fmt == "parquet" else [[0, 10], [10, 20], [20, 23]]
    assert [s["range"] for s in plan["shards"]] == unit_ranges * 2
    assert [s["rows"] for s in plan["shards"]] == [10, 10, 3] * 2
    written = place.read("out/_plan.json")

    # Planned again (an operator's restart): the plan there is kept as it is.
    assert run(*plan_args(glob, fmt, output, 10), log=log) == (0, {"shards": 6, "rows": 46})
    assert place.read("out/_plan.json") == written
    # Other arguments for the same output: refused, naming the plan and what differs.
    capsys.readouterr()
    code, _ = run(*plan_args(glob, fmt, output, 20))
    error = capsys.readouterr().err
    assert code == 2
    assert f"{output}/_plan.json is the plan of another job" in error
    assert "shard_rows 10, not 20" in error


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--text-field": "nope"}, "no text field 'nope'"),
        ({"--input": "/nowhere/*.jsonl"}, "the pattern matches no file"),
    ],
)
def test_plan_refuses_inputs_it_cannot_read_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, str], message: str
) -> None:
    place = Place(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path), {})
    glob = write_corpus(place, "jsonl", [[("d-1", "x")]])
    args = plan_args(glob, "jsonl", place.url("out"), 10)
    for flag, value in change.items():
        args[args.index(flag) + 1] = value
    code, summary = run(*args, log=tmp_path / "log")
    assert code == 2
    assert message in capsys.readouterr().err
    assert summary is not None and message in summary["error"]
    assert not place.exists("out/_plan.json")


@pytest.fixture(scope="module")
def minilm_server() -> Iterator[RunningServer]:
    with running_server(ServerSettings()) as server:
        yield server


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(MINILM_DIR), device="cpu")


def read_parts(place: Place) -> pa.Table:
    names = place.files("out/parts")
    tables = [pq.read_table(pa.BufferReader(place.read(f"out/parts/{n}"))) for n in names]
    return pa.concat_tables(tables)


def errors_of(place: Place) -> list[dict[str, Any]]:
    lines = [place.read(f"out/errors/{n}") for n in place.files("out/errors")]
    return [orjson.loads(line) for data in lines for line in data.splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_work_embeds_every_row_once_with_sentence_transformers_vectors(
    place: Place,
    fmt: str,
    minilm_server: RunningServer,
    reference: SentenceTransformer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    texts = {n: f"passage {n}: the {['cat', 'sea', 'tax', 'moon'][n % 4]} story" for n in range(24)}
    texts[3] = LONG_TEXT
    texts[17] = None  # missing (JSONL), null (Parquet), empty (CSV: the API refuses "")
    files = [[(row_id(fmt, n), texts[n]) for n in range(f * 12, f * 12 + 12)] for f in range(2)]
    glob = write_corpus(place, fmt, files)
    output = place.url("out")
    assert run(*plan_args(glob, fmt, output, 5))[0] == 0
    shards = len(orjson.loads(place.read("out/_plan.json"))["shards"])
    summaries = []
    for index in range(shards):
        log = tmp_path / f"work-{index}.log"
        code, summary = run(
            "work",
            "--output",
            output,
            "--service",
            minilm_server.url,
            "--index",
            str(index),
            "--batch-size",
            "4",
            log=log,
        )
        assert code == 0, capsys.readouterr().err
        summaries.append(summary)
    assert sum(s["rows"] for s in summaries) == 22
    assert sum(s["failed"] for s in summaries) == 2
    assert not any(s["skipped"] for s in summaries)

    table = read_parts(place)
    ids = table.column("doc_id").to_pylist()
    good = [n for n in range(24) if n not in (3, 17)]
    assert sorted(ids, key=str) == sorted((row_id(fmt, n) for n in good), key=str)
    assert len(set(ids)) == len(ids)
    # The id as the input has it; the vector a fixed-size list of float32.
    assert table.schema.field("doc_id").type == (pa.int64() if fmt == "parquet" else pa.string())
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    metadata = table.schema.metadata
    served = httpx.get(minilm_server.url + "/v1/models").json()["data"][0]["id"]
    assert metadata[b"model"] == served.encode() and metadata[b"dimensions"] == b"384"
    # The computation's fingerprint, as the server sends it with every answer.
    probe = httpx.post(minilm_server.url + "/v1/embeddings", json={"input": "x"})
    sent = probe.headers.get("x-embedding-fingerprint")
    assert metadata.get(b"fingerprint") == (sent.encode() if sent is not None else None)

    by_id = dict(zip(ids, np.asarray(table.column("embedding").to_pylist()), strict=True))
    want = reference.encode([texts[n] for n in good], normalize_embeddings=True)
    got = np.stack([by_id[row_id(fmt, n)] for n in good])
    cosines = (
        np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    )
    assert cosines.min() >= 0.9999

    errors = {e["id"]: e for e in errors_of(place)}
    assert set(errors) == {row_id(fmt, 3), row_id(fmt, 17)}
    refused = errors[row_id(fmt, 3)]
    assert refused["error"]["status"] == 400
    assert refused["error"]["code"] == "context_length_exceeded"
    assert refused["file"] == place.url(f"corpus/part-0.{fmt}") and refused["row"] == 3
    missing = errors[row_id(fmt, 17)]["error"]
    assert missing["code"] == ("invalid_value" if fmt == "csv" else "invalid_row")
    assert errors[row_id(fmt, 17)]["row"] == 5  # the sixth row of the second file

    # A shard run again is skipped, and says what its part holds.
    code, summary = run(
        "work", "--output", output, "--service", minilm_server.url, "--index", "0",
        log=tmp_path / "again.log",
    )  # fmt: skip
    assert code == 0
    assert summary is not None and summary["skipped"] is True
    assert (summary["rows"], summary["failed"]) == (summaries[0]["rows"], summaries[0]["failed"])


@pytest.mark.slow
def test_a_worker_killed_mid_shard_leaves_no_part_and_its_rerun_commits_it(
    place: Place, tmp_path: Path
) -> None:
    rows = [(f"d-{n}", f"text {n}") for n in range(120)]
    glob = write_corpus(place, "jsonl", [rows])
    output = place.url("out")
    assert run(*plan_args(glob, "jsonl", output, 60))[0] == 0
    counted = {"endpoint": "/v1/embeddings", "status": "200"}
    with running_server(fake_settings("fake?delay_ms=40")) as server:
        work = ["work", "--output", output, "--service", server.url, "--batch-size", "1"]
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")},
            **place.env,
            "JOB_COMPLETION_INDEX": "0",
        }
        process = subprocess.Popen(
            [SCRIPT, "job", *work, "--max-in-flight", "1"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_for(
                lambda: (
                    process.poll() is None
                    and server.value("embedding_server_requests_total", counted) >= 10
                ),
                timeout=120,
                what="the worker to be halfway through its shard",
            )
            assert server.value("embedding_server_requests_total", counted) < 60
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert place.files("out/parts") == []
        assert place.files("out/errors") == []

        log = tmp_path / "rerun.log"
        code, summary = run(*work, "--index", "0", log=log)
        assert code == 0
        assert summary is not None and summary["rows"] == 60 and summary["skipped"] is False
        assert run(*work, "--index", "1")[0] == 0
    assert place.files("out/parts") == ["part-000000.parquet", "part-000001.parquet"]
    ids = read_parts(place).column("doc_id").to_pylist()
    assert sorted(ids) == sorted(i for i, _ in rows)


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """A stub service's handler: JSON answers, no request log."""

    def _send(self, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
        content = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(content)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(content)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on 127.0.0.1 for the block; its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class StubEmbeddings(JsonHandler):
    """/v1/embeddings answered with 4-dimensional base64 vectors; the server's ``fingerprints``
    go out one per request in turn, after ``busy`` answers of 429 with Retry-After."""

    fingerprints: list[str] = []
    busy = 0
    requests = 0
    api_key: str | None = None

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.requests += 1
        if cls.api_key is not None and self.headers.get("Authorization") != f"Bearer {cls.api_key}":
            self._send(401, {"error": {"message": "bad key", "code": "invalid_api_key"}}, {})
            return
        if cls.busy > 0:
            cls.busy -= 1
            self._send(429, {"error": {"message": "busy"}}, {"Retry-After": "0.1"})
            return
        vector = base64.b64encode(np.arange(4, dtype="<f4").tobytes()).decode()
        data = [
            {"object": "embedding", "index": i, "embedding": vector}
            for i in range(len(body["input"]))
        ]
        headers = {}
        if cls.fingerprints:
            headers["X-Embedding-Fingerprint"] = cls.fingerprints[
                cls.requests % len(cls.fingerprints)
            ]
        self._send(200, {"object": "list", "data": data, "model": "stub"}, headers)


@contextlib.contextmanager
def stub_service(
    fingerprints: list[str], busy: int = 0, api_key: str | None = None
) -> Iterator[str]:
    attributes = {"fingerprints": fingerprints, "busy": busy, "api_key": api_key}
    with serving(type("Stub", (StubEmbeddings,), attributes)) as url:
        yield url


def planned(tmp_path: Path, rows: int = 10) -> Place:
    place = Place(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path), {})
    glob = write_corpus(place, "jsonl", [[(f"d-{n}", f"t {n}") for n in range(rows)]])
    assert run(*plan_args(glob, "jsonl", place.url("out"), rows))[0] == 0
    return place


def test_a_shard_answered_by_two_computations_is_not_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    place = planned(tmp_path)
    work = ["work", "--output", place.url("out"), "--index", "0", "--batch-size", "2"]
    with stub_service(["fp-a", "fp-b"]) as url:
        code, summary = run(*work, "--service", url, log=tmp_path / "log")
    assert code == 1
    assert "two computations in one shard" in capsys.readouterr().err
    assert summary is not None and summary["shard"] == 0 and "fp-" in summary["error"]
    assert place.files("out/parts") == []

    # One computation throughout (after two 429s waited out): committed, with its fingerprint.
    with stub_service(["fp-a"], busy=2) as url:
        code, summary = run(*work, "--service", url, log=tmp_path / "log")
    assert code == 0 and summary is not None and summary["rows"] == 10
    metadata = read_parts(place).schema.metadata
    assert metadata[b"fingerprint"] == b"fp-a" and metadata[b"model"] == b"stub"


def test_an_unreachable_service_exits_1_and_commits_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    place = planned(tmp_path)
    started = time.monotonic()
    code, summary = run(
        "work", "--output", place.url("out"), "--index", "0", "--retry-for", "2",
        "--service", f"http://127.0.0.1:{free_port()}", log=tmp_path / "log",
    )  # fmt: skip
    assert code == 1
    assert time.monotonic() - started < 30
    assert "no answer" in capsys.readouterr().err
    assert summary is not None and summary["shard"] == 0
    assert place.files("out/parts") == []


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--index", "1"], {}, "--index 1: the plan has 1 shards"),
        ([], {}, "--index: not given, and JOB_COMPLETION_INDEX is None"),
        ([], {"JOB_COMPLETION_INDEX": "x"}, "JOB_COMPLETION_INDEX is 'x'"),
    ],
)
def test_work_refuses_a_shard_the_plan_does_not_have_with_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    place = planned(tmp_path)
    code, _ = run("work", "--output", place.url("out"), "--service", "http://127.0.0.1:1", *args)
    assert code == 2
    assert message in capsys.readouterr().err


def test_work_without_a_plan_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run(
        "work", "--output", str(tmp_path / "out"), "--service", "http://x", "--index", "0"
    )
    assert code == 2
    assert "no plan; run 'embedding-server job plan' first" in capsys.readouterr().err


def test_a_shard_with_no_row_to_embed_commits_an_empty_part_of_the_same_schema(
    tmp_path: Path,
) -> None:
    """Every row without text: the errors file lists them all, and the part (the shard's
    commit) holds no row but the vector size the service embeds at, so that the output's
    parts still read as one table."""
    place = Place(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path), {})
    glob = write_corpus(place, "parquet", [[(n, None) for n in range(3)]])
    assert run(*plan_args(glob, "parquet", place.url("out"), 10))[0] == 0
    with stub_service(["fp-a"]) as url:
        code, summary = run(
            "work", "--output", place.url("out"), "--index", "0", "--service", url,
            log=tmp_path / "log",
        )  # fmt: skip
    assert code == 0
    assert summary is not None and (summary["rows"], summary["failed"]) == (0, 3)
    table = read_parts(place)
    assert table.num_rows == 0
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 4)
    assert table.schema.metadata[b"fingerprint"] == b"fp-a"
    assert [e["id"] for e in errors_of(place)] == [0, 1, 2]


@pytest.mark.slow
def test_a_job_pinned_to_a_fingerprint_commits_nothing_from_another_computation(
    tmp_path: Path, minilm_server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--expect-fingerprint`` (an EmbeddingJob's spec.fingerprint): the real server's 409
    stops the shard uncommitted, with exit 1, and is never written down as a row's error; the
    server's own fingerprint commits."""
    place = planned(tmp_path)
    work = ["work", "--output", place.url("out"), "--index", "0", "--service", minilm_server.url]
    code, summary = run(*work, "--expect-fingerprint", "00000000", log=tmp_path / "log")
    assert code == 1
    assert summary is not None and "no longer serves fingerprint 00000000" in summary["error"]
    assert place.files("out/parts") == [] and place.files("out/errors") == []

    with urllib.request.urlopen(f"{minilm_server.url}/info", timeout=30) as info:
        fingerprint = json.load(info)["fingerprint"]
    code, summary = run(*work, "--expect-fingerprint", fingerprint[:8], log=tmp_path / "log")
    assert code == 0 and summary is not None and summary["rows"] == 10
    assert read_parts(place).schema.metadata[b"fingerprint"] == fingerprint.encode()


def test_a_service_that_needs_an_api_key_gets_it_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without it every row would be committed as a 401 error: the key is sent as the bearer
    token, read from EMBEDDING_JOB_API_KEY (never a flag)."""
    place = planned(tmp_path)
    work = ["work", "--output", place.url("out"), "--index", "0"]
    monkeypatch.setenv("EMBEDDING_JOB_API_KEY", "s3cret")
    with stub_service(["fp-a"], api_key="s3cret") as url:
        code, summary = run(*work, "--service", url, log=tmp_path / "log")
    assert code == 0 and summary is not None
    assert (summary["rows"], summary["failed"]) == (10, 0)
    assert place.files("out/errors") == [] or errors_of(place) == []


def read_jsonl_parts(place: Place) -> list[dict[str, Any]]:
    names = place.files("out/parts")
    assert names and all(name.endswith(".jsonl") for name in names), names
    return [orjson.loads(line) for n in names for line in place.read(f"out/parts/{n}").splitlines()]


@pytest.mark.slow
def test_jsonl_parts_are_batch_output_lines_with_the_same_vectors(
    place: Place,
    minilm_server: RunningServer,
    reference: SentenceTransformer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--output-format jsonl``: a line per embedded row in run-batch's output format (the
    line an earlier run-batch would recognise), ``custom_id`` the row's id as a string, the
    /v1/embeddings answer for that row as the body, the fingerprint where run-batch puts it;
    the errors file as for Parquet, and a committed part is counted by its lines."""
    from embedding_server.batch.lines import answered_key

    texts = {n: f"row {n}: a {['red', 'blue'][n % 2]} thing" for n in range(14)}
    texts[4] = LONG_TEXT
    glob = write_corpus(place, "parquet", [[(n, texts[n]) for n in range(14)]])
    output = place.url("out")
    args = [*plan_args(glob, "parquet", output, 5), "--output-format", "jsonl"]
    assert run(*args)[0] == 0
    shards = len(orjson.loads(place.read("out/_plan.json"))["shards"])
    assert shards == 3
    work = ["work", "--output", output, "--service", minilm_server.url, "--batch-size", "3"]
    summaries = []
    for index in range(shards):
        code, summary = run(*work, "--index", str(index), log=tmp_path / f"w{index}.log")
        assert code == 0, capsys.readouterr().err
        summaries.append(summary)
    assert [s["rows"] for s in summaries] == [4, 5, 4] and sum(s["failed"] for s in summaries) == 1
    assert place.files("out/parts") == [f"part-{n:06d}.jsonl" for n in range(3)]

    lines = read_jsonl_parts(place)
    good = [n for n in range(14) if n != 4]
    assert [line["custom_id"] for line in lines] == [str(n) for n in good]
    # Parquet row groups of 5: the shard of row n is n // 5, its row in the file is n.
    assert [line["id"] for line in lines] == [f"batch_req_{n // 5}_{n}" for n in good]
    assert [answered_key(orjson.dumps(line)) for line in lines] == [str(n) for n in good]
    served = httpx.get(minilm_server.url + "/v1/models").json()["data"][0]["id"]
    with urllib.request.urlopen(f"{minilm_server.url}/info", timeout=30) as info:
        fingerprint = json.load(info)["fingerprint"]
    for line in lines:
        assert line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["fingerprint"] == fingerprint
        assert isinstance(response["request_id"], str) and response["request_id"]
        body = response["body"]
        assert body["object"] == "list" and body["model"] == served
        ((item),) = body["data"]
        assert (item["object"], item["index"], len(item["embedding"])) == ("embedding", 0, 384)
    got = np.array([line["response"]["body"]["data"][0]["embedding"] for line in lines], "<f4")
    want = reference.encode([texts[n] for n in good], normalize_embeddings=True)
    cosines = (
        np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    )
    assert cosines.min() >= 0.9999
    # The floats are the server's float32 values, as its own float answer writes them.
    direct = httpx.post(minilm_server.url + "/v1/embeddings", json={"input": texts[0]}).json()
    assert lines[0]["response"]["body"]["data"][0]["embedding"] == direct["data"][0]["embedding"]

    (refused,) = errors_of(place)
    assert (refused["id"], refused["row"], refused["error"]["status"]) == (4, 4, 400)

    # Run again: skipped, counted from the part's lines.
    code, summary = run(*work, "--index", "1", log=tmp_path / "again.log")
    assert code == 0 and summary is not None and summary["skipped"] is True
    assert (summary["rows"], summary["failed"]) == (5, 0)
    # The output holds JSONL parts: planning it for Parquet is another job's plan.
    capsys.readouterr()
    assert run(*plan_args(glob, "parquet", output, 5))[0] == 2
    assert "output_format 'jsonl', not 'parquet'" in capsys.readouterr().err


def test_a_jsonl_shard_with_no_row_to_embed_commits_an_empty_part(tmp_path: Path) -> None:
    place = Place(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path), {})
    glob = write_corpus(place, "parquet", [[(n, None) for n in range(3)]])
    args = [*plan_args(glob, "parquet", place.url("out"), 10), "--output-format", "jsonl"]
    assert run(*args)[0] == 0
    work = ["work", "--output", place.url("out"), "--index", "0"]
    with stub_service(["fp-a"]) as url:
        code, summary = run(*work, "--service", url, log=tmp_path / "log")
        assert code == 0 and summary is not None
        assert (summary["rows"], summary["failed"]) == (0, 3)
        assert place.read("out/parts/part-000000.jsonl") == b""
        code, again = run(*work, "--service", url, log=tmp_path / "log")
    assert code == 0 and again is not None and again["skipped"] is True
    assert (again["rows"], again["failed"]) == (0, 3)


def test_a_plan_written_before_images_and_jsonl_reads_as_text_and_parquet() -> None:
    from embedding_server.batch.plan import Plan

    old = {
        "version": 1,
        "arguments": {
            "inputs": ["/data/in/*.jsonl"],
            "format": "jsonl",
            "id_field": "id",
            "text_field": "text",
            "shard_rows": 10,
        },
        "files": ["/data/in/a.jsonl"],
        "rows": 1,
        "shards": [{"file": "/data/in/a.jsonl", "range": [0, 1], "rows": 1, "offset": 0}],
    }
    plan = Plan.from_bytes(orjson.dumps(old), "old")
    assert plan.arguments.output_format == "parquet" and plan.arguments.image_field is None
    assert plan.arguments.fields.content == "text" and not plan.arguments.fields.image


@pytest.fixture(scope="module")
def clip_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A tiny random CLIP (text and images, one vector space) served as a real server."""
    from tests.support.vision import build_clip

    model = build_clip(tmp_path_factory.mktemp("clip") / "clip")
    with running_server(ServerSettings(model=str(model))) as server:
        yield server


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_image_field_sends_each_rows_image_and_commits_its_vector(
    fmt: str, clip_server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--image-field``: each row's data: URL goes to /v1/embeddings as an image (the vector
    is the one the server gives that image in a request of its own); a value that is not an
    image URL, or none, is listed in the errors file, and the API's refusal of a broken image
    lands on its row."""
    from tests.support.images import data_uri, picture

    place = Place(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path), {})
    images: dict[int, str | None] = {n: data_uri(picture(n)) for n in range(7)}
    images[2] = "a red square"  # a text, not an image URL
    images[3] = None
    images[5] = "data:image/png;base64,AAAA"  # not a PNG: the server refuses it
    files = [[(row_id(fmt, n), images[n]) for n in range(7)]]
    glob = write_corpus(place, fmt, files)
    args = plan_args(glob, fmt, place.url("out"), 4)
    args[args.index("--text-field")] = "--image-field"
    assert run(*args)[0] == 0, capsys.readouterr().err
    work = ["work", "--output", place.url("out"), "--service", clip_server.url]
    for index in range(len(orjson.loads(place.read("out/_plan.json"))["shards"])):
        code, _ = run(*work, "--index", str(index), log=tmp_path / "log")
        assert code == 0, capsys.readouterr().err

    table = read_parts(place)
    good = [0, 1, 4, 6]
    ids = table.column("doc_id").to_pylist()
    assert sorted(ids, key=str) == sorted((row_id(fmt, n) for n in good), key=str)
    by_id = dict(zip(ids, table.column("embedding").to_pylist(), strict=True))
    for n in good:
        part = {"type": "image_url", "image_url": {"url": images[n]}}
        body = {"messages": [{"role": "user", "content": [part]}]}
        direct = httpx.post(clip_server.url + "/v1/embeddings", json=body).json()
        want = np.array(direct["data"][0]["embedding"], "<f4")
        np.testing.assert_allclose(np.array(by_id[row_id(fmt, n)], "<f4"), want, atol=1e-5)

    errors = {e["id"]: e["error"] for e in errors_of(place)}
    assert set(errors) == {row_id(fmt, n) for n in (2, 3, 5)}
    assert "is not an http://, https:// or data: URL" in errors[row_id(fmt, 2)]["message"]
    if fmt != "csv":  # CSV reads a missing value as "", which is not a URL either
        assert "no image (field 'body')" in errors[row_id(fmt, 3)]["message"]
    assert errors[row_id(fmt, 5)]["status"] == 400


def test_plan_takes_a_text_field_or_an_image_field_not_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    place = Place(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path), {})
    glob = write_corpus(place, "jsonl", [[("d-1", "x")]])
    args = [*plan_args(glob, "jsonl", place.url("out"), 10), "--image-field", "body"]
    with pytest.raises(SystemExit) as exited:
        run(*args)
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    # An image field the rows do not have: refused as the text field would be.
    args = plan_args(glob, "jsonl", place.url("out"), 10)
    args[args.index("--text-field") : args.index("--text-field") + 2] = ["--image-field", "pic"]
    assert run(*args)[0] == 2
    assert "no image field 'pic'" in capsys.readouterr().err


@pytest.mark.slow
def test_images_for_a_service_that_takes_none_are_refused_with_exit_2(
    minilm_server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every row would be refused alike (a text model takes no image): the shard exits 2,
    which fails an EmbeddingJob at once, instead of committing a part of errors only."""
    from tests.support.images import data_uri, picture

    place = Place(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path), {})
    glob = write_corpus(place, "jsonl", [[("d-1", data_uri(picture(1)))]])
    args = plan_args(glob, "jsonl", place.url("out"), 10)
    args[args.index("--text-field")] = "--image-field"
    assert run(*args)[0] == 0
    work = ["work", "--output", place.url("out"), "--index", "0", "--service", minilm_server.url]
    code, summary = run(*work, log=tmp_path / "log")
    assert code == 2
    assert "takes no images (its modalities: text)" in capsys.readouterr().err
    assert summary is not None and summary["shard"] == 0
    assert place.files("out/parts") == [] and place.files("out/errors") == []

"""Bulk indexing: ``run-batch`` and the EmbeddingJob worker against their peers, same run.

Not a test: a measurement (issue 46, item 5), side by side on one machine, the same model
(default: the packaged all-MiniLM-L6-v2, the server's default) in the same dtype (default
float32, for every system, so the vectors compare at 0.9999), on the deterministic
mixed-length corpus of ``bench/corpus.py``. One row is one text, with its id. In order:

1. **offline engine**: our ``Engine.embed`` on the whole corpus in this process (as
   ``bench.offline`` drives it), after a warm-up; the model's load is not timed.
2. **run-batch**: ``embedding-server run-batch -i IN -o OUT`` as a subprocess, IN an
   OpenAI-batch-format JSONL file of ``/v1/embeddings`` lines (``--texts-per-line`` texts a
   line, float vectors). Two figures: the whole command (start, model load and all), and
   its rate once the model is loaded: from the moment OUT appears (run-batch creates it
   once its engine is ready, before the first request) to its last answered line, this
   process polling the file every 50 ms. That one is what the offline engine and the loop
   below are compared with, as they are timed warm too.
3. **naive client loop**: the loop of vLLM's docs (its ``openai_embedding_client.py``
   example, one request after another): 64 texts per request, ``encoding_format: float``,
   the JSON decoded, sequentially, against ``embedding-server serve`` on 127.0.0.1 started
   here (timed after a warm-up request).
4. **EmbeddingJob**: the corpus as ``--job-shards`` Parquet files on local disk (one row
   group each: one shard each), ``embedding-server job plan`` once, then ``embedding-server
   job work --index I`` once per shard, at most W at a time (W from ``--job-workers``, 1 and
   2 by default), against the same server: what an Indexed Job with ``parallelism: W`` runs,
   one pod per index, without Kubernetes (local paths go through ``pyarrow.fs`` as
   ``s3://`` ones do). Timed from the plan to the last committed part, the server warm (a
   service is up before a job starts); a worker's process start is part of its shard, as a
   pod's is. Compared with run-batch of the same rows (its whole command, which loads its
   own model, and its rate once loaded).
5. **peak memory against input size**: run-batch on files of ``--memory-rows`` lines
   (2,000 and 20,000 by default; ``--memory-rows 10000,100000,1000000`` for the issue's
   range), short texts (``--memory-max-words``, so a million rows takes minutes, not hours:
   the window of work in flight is what should bound memory, not the texts' length) and
   base64 vectors (a million float-JSON answers would take 5 GB of disk). Peak RSS is the
   child's ``VmHWM`` (the kernel's high-water mark of its resident memory, read every 50 ms
   until it exits), not ``ru_maxrss``: a child forked from this process, which holds the
   offline engine, inherits this process's size in that figure. The target is flat.

6. **queries beside a job**: for each of ``--query-caps`` (``--bulk-batch-ms`` values, 10 (the
   default) and 0 (no cap) by default), a server of its own with that cap, one interactive
   query at a time (a short text, 20 ms apart, as a user's search box sends them): their p50
   and p95 on the idle server, then while the 2-worker EmbeddingJob runs against it (bulk
   priority), and the job's rows/s beside them. The target is a p50 within 2x of idle while
   bulk fills the slack (issue 46, item 4).

Every system must answer every row: a row missing, or answered with an error, is printed and
fails the run (exit 1) after the figures. The vectors of run-batch, the loop and the job are
compared with the offline engine's (cosine >= 0.9999 in float32, 0.999 otherwise).

    .venv/bin/python -m bench.bulk                     # 2,000 rows; memory at 2k and 20k
    .venv/bin/python -m bench.bulk --rows 5000 --memory-rows 10000,100000,1000000
    .venv/bin/python -m bench.bulk --rows 128 --max-words 32 --memory-rows 100,300  # smoke

Prints a table and the ratios against the targets (run-batch / offline engine >= 0.9x,
run-batch / naive loop >= 1.5x, peak RSS flat); writes ``bulk.json`` to ``bench/out``
(or ``$BENCH_OUT``). Working files go to a temporary folder there and are removed.
"""

from __future__ import annotations

import argparse
import base64
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import out_dir, write_results
from bench.corpus import make_corpus
from e2e.harness.proc import child_process, free_port

BIN = Path(sys.executable).parent
EMBEDDINGS = "/v1/embeddings"
POLL_S = 0.05
QUERY_GAP_S = 0.02
IDLE_PROBE_S = 5.0
COMMAND_TIMEOUT_S = 3600.0
"""The longest one command may run: a million rows on two cores takes well under this."""
SERVER_START_S = 300.0
TARGET_OFFLINE = 0.9
TARGET_NAIVE = 1.5
TARGET_QUERY_P50 = 2.0
MEMORY_CHUNK = 10_000
"""Rows of the memory files generated at a time (each chunk its own seed): a million rows'
texts are never all in this process at once."""


@dataclass
class Run:
    """One system's pass over the corpus."""

    name: str
    rows: int
    seconds: float
    answered: int
    failed: int = 0
    peak_rss_mib: float | None = None
    cos_min: float | None = None
    note: str = ""
    """What went wrong, if anything."""
    shards: int | None = None

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "rows_per_s": round(self.rows_per_s, 2)}


@dataclass
class Command:
    """A finished subprocess: exit status, wall seconds, its own peak RSS and CPU seconds,
    and (with a watched output file) when the file appeared and when its last line did."""

    returncode: int
    seconds: float
    peak_rss_mib: float
    cpu_seconds: float
    created_at: float | None = None
    last_line_at: float | None = None
    lines: int = 0
    log: str = ""


@dataclass
class Memory:
    rows: int
    peak_rss_mib: float
    seconds: float
    answered: int
    failed: int


@dataclass
class Beside:
    """Interactive queries on an idle server, then beside an EmbeddingJob, at one cap."""

    bulk_batch_ms: float
    idle_p50_ms: float
    idle_p95_ms: float
    busy_p50_ms: float
    busy_p95_ms: float
    queries: int
    failed_queries: int
    job: Run

    @property
    def ratio(self) -> float:
        return self.busy_p50_ms / self.idle_p50_ms if self.idle_p50_ms else float("nan")


@dataclass
class Report:
    runs: list[Run] = field(default_factory=list)
    memory: list[Memory] = field(default_factory=list)
    beside: list[Beside] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


# -- running and watching a child -------------------------------------------------------------


class LineCounter:
    """The lines of a file that another process appends to, read as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0
        self._offset = 0

    def poll(self) -> int:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return self.lines
        self._offset += len(chunk)
        self.lines += chunk.count(b"\n")
        return self.lines


def high_water_kib(pid: int) -> int:
    """``VmHWM`` of ``pid`` (its peak resident memory so far), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def run_command(
    argv: list[str], log: Path, *, watch: Path | None = None, timeout: float = COMMAND_TIMEOUT_S
) -> Command:
    """Run ``argv`` to its end, its output in ``log``; SIGKILL past ``timeout``. Its peak RSS
    is the kernel's high-water mark of its memory (``VmHWM``), read until it exits: not
    ``ru_maxrss``, which for a child forked from this (large) process starts at this
    process's size (Linux carries the old memory's high-water mark over ``exec``). With
    ``watch`` (a file the command creates, then appends lines to), also when the file
    appeared and when its last line came, to :data:`POLL_S`."""
    counter = LineCounter(watch) if watch is not None else None
    created_at: float | None = None
    last_at: float | None = None
    last_count = 0
    peak_kib = 0
    started = time.perf_counter()
    deadline = started + timeout
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        try:
            while True:
                peak_kib = max(peak_kib, high_water_kib(process.pid))
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                now = time.perf_counter()
                if counter is not None:
                    if created_at is None and counter.path.exists():
                        created_at = now
                    count = counter.poll()
                    if count > last_count:
                        last_at, last_count = now, count
                if pid:
                    break
                if now > deadline:
                    process.kill()
                    _, status, usage = os.wait4(process.pid, 0)
                    break
                time.sleep(POLL_S)
        except BaseException:
            if process.poll() is None:
                process.kill()
                process.wait()
            raise
    seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    return Command(
        returncode=process.returncode,
        seconds=seconds,
        peak_rss_mib=peak_kib / 1024.0,
        cpu_seconds=usage.ru_utime + usage.ru_stime,
        created_at=None if created_at is None else created_at - started,
        last_line_at=None if last_at is None else last_at - started,
        lines=last_count,
        log=log.read_text(errors="replace")[-3000:],
    )


# -- inputs ----------------------------------------------------------------------------------


def row_id(index: int) -> str:
    return f"doc-{index:07d}"


def batch_lines(texts: list[str], first: int, per_line: int, encoding: str) -> Iterator[bytes]:
    """``texts`` (rows ``first``...) as batch-file lines of ``per_line`` texts each; the
    ``custom_id`` is the first row's id (with one text a line, the row's own)."""
    for start in range(0, len(texts), per_line):
        chunk = texts[start : start + per_line]
        body: dict[str, Any] = {
            "input": chunk[0] if per_line == 1 else chunk,
            "encoding_format": encoding,
        }
        line = {
            "custom_id": row_id(first + start),
            "method": "POST",
            "url": EMBEDDINGS,
            "body": body,
        }
        yield orjson.dumps(line) + b"\n"


def write_batch_file(path: Path, texts: list[str], per_line: int, encoding: str) -> None:
    with path.open("wb") as sink:
        for line in batch_lines(texts, 0, per_line, encoding):
            sink.write(line)


def write_memory_file(path: Path, rows: int, max_words: int) -> None:
    """``rows`` short texts, one a line, base64: generated :data:`MEMORY_CHUNK` at a time."""
    with path.open("wb") as sink:
        for first in range(0, rows, MEMORY_CHUNK):
            count = min(MEMORY_CHUNK, rows - first)
            texts = make_corpus(count, seed=1 + first // MEMORY_CHUNK, max_words=max_words)
            for line in batch_lines(texts, first, 1, "base64"):
                sink.write(line)


def write_parquet_corpus(folder: Path, texts: list[str], files: int) -> None:
    """The corpus as ``files`` Parquet files of about equal rows, one row group each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per_file = math.ceil(len(texts) / files)
    for index in range(files):
        start = index * per_file
        chunk = texts[start : start + per_file]
        if not chunk:
            break
        table = pa.table({"id": [row_id(start + i) for i in range(len(chunk))], "text": chunk})
        pq.write_table(table, folder / f"corpus-{index:03d}.parquet", row_group_size=len(chunk))


# -- reading answers ---------------------------------------------------------------------------


def _vector(item: Any) -> np.ndarray:
    embedding = item["embedding"]
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float32)


def read_batch_output(path: Path, rows: int, per_line: int) -> tuple[np.ndarray, int, int]:
    """The vectors of run-batch's answers in row order (NaN where a row has none), how many
    rows were answered with a vector, and how many lines were errors."""
    vectors: np.ndarray | None = None
    answered = failed = 0
    with path.open("rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            line = orjson.loads(raw)
            response = line.get("response") or {}
            if line.get("error") or response.get("status_code") != 200:
                failed += 1
                continue
            first = int(line["custom_id"].removeprefix("doc-"))
            for item in response["body"]["data"]:
                vector = _vector(item)
                if vectors is None:
                    vectors = np.full((rows, vector.shape[0]), np.nan, dtype=np.float32)
                vectors[first + int(item["index"])] = vector
                answered += 1
    assert per_line >= 1
    return (vectors if vectors is not None else np.zeros((0, 0), np.float32)), answered, failed


def count_answers(path: Path) -> tuple[int, int]:
    """Lines answered 200 and lines that were not, without decoding a million lines."""
    answered = failed = 0
    with path.open("rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            if b'"status_code":200' in raw and b'"error":null' in raw:
                answered += 1
            else:
                failed += 1
    return answered, failed


def read_parts(folder: Path, rows: int) -> tuple[np.ndarray, int]:
    """The job's vectors in row order (NaN where a row has none) and the rows it committed."""
    import pyarrow.parquet as pq

    vectors: np.ndarray | None = None
    found = 0
    for part in sorted((folder / "parts").glob("part-*.parquet")):
        table = pq.read_table(part)
        ids = table.column("id").to_pylist()
        embedding = table.column("embedding").combine_chunks()
        width = embedding.type.list_size
        flat = embedding.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
        if vectors is None:
            vectors = np.full((rows, width), np.nan, dtype=np.float32)
        for position, name in enumerate(ids):
            vectors[int(name.removeprefix("doc-"))] = flat[position]
            found += 1
    return (vectors if vectors is not None else np.zeros((0, 0), np.float32)), found


def cos_min(vectors: np.ndarray, reference: np.ndarray) -> float | None:
    """The lowest cosine between matching rows that both have (None when none do)."""
    if vectors.shape != reference.shape:
        return None
    have = ~np.isnan(vectors).any(axis=1)
    if not have.any():
        return None
    a, b = vectors[have].astype(np.float64), reference[have].astype(np.float64)
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


# -- the systems -------------------------------------------------------------------------------


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The model and engine flags every one of our processes gets."""
    return ["--model", args.model, "--dtype", args.dtype, "--device", args.device]


def bench_offline(engine: Any, texts: list[str]) -> tuple[Run, np.ndarray]:
    started = time.perf_counter()
    vectors = np.asarray(engine.embed(texts), dtype=np.float32)
    seconds = time.perf_counter() - started
    return Run("offline engine (Engine.embed)", len(texts), seconds, len(vectors)), vectors


def bench_run_batch(
    args: argparse.Namespace, texts: list[str], work: Path, reference: np.ndarray
) -> tuple[Run, Run]:
    """run-batch on the corpus: (its rate once the model is loaded, its whole command)."""
    source, answers = work / "batch-in.jsonl", work / "batch-out.jsonl"
    write_batch_file(source, texts, args.texts_per_line, "float")
    answers.unlink(missing_ok=True)
    argv = [
        str(BIN / "embedding-server"),
        "run-batch",
        *("-i", str(source), "-o", str(answers)),
        *("--max-in-flight", str(args.max_in_flight)),
        *engine_flags(args),
        *("--log-level", "warning"),
    ]
    done = run_command(argv, work / "run-batch.log", watch=answers)
    vectors, answered, failed = read_batch_output(answers, len(texts), args.texts_per_line)
    note = "" if done.returncode == 0 else f"exit {done.returncode}: {done.log[-400:]}"
    agreement = cos_min(vectors, reference)
    whole = Run(
        "run-batch, whole command",
        len(texts),
        done.seconds,
        answered,
        failed,
        round(done.peak_rss_mib, 1),
        agreement,
        note,
    )
    # The rate once loaded: run-batch creates OUT when its model is loaded and ready, before
    # it sends a request; from then to the last answer it does the work, all of it.
    if done.created_at is not None and done.last_line_at is not None:
        steady_seconds = done.last_line_at - done.created_at
    else:
        steady_seconds = done.seconds
    steady = Run(
        "run-batch, model loaded",
        len(texts),
        steady_seconds,
        answered,
        failed,
        round(done.peak_rss_mib, 1),
        agreement,
        note,
    )
    answers.unlink(missing_ok=True)
    return steady, whole


def bench_naive(url: str, model: str, texts: list[str], batch: int, reference: np.ndarray) -> Run:
    """vLLM's example client loop: one request at a time, ``batch`` texts, float JSON."""
    import httpx

    vectors = np.full_like(reference, np.nan)
    answered = failed = 0
    with httpx.Client(base_url=url, timeout=600.0) as client:
        warm = client.post(
            EMBEDDINGS, json={"model": model, "input": texts[:batch], "encoding_format": "float"}
        )
        warm.raise_for_status()
        started = time.perf_counter()
        for start in range(0, len(texts), batch):
            chunk = texts[start : start + batch]
            response = client.post(
                EMBEDDINGS, json={"model": model, "input": chunk, "encoding_format": "float"}
            )
            if response.status_code != 200:
                failed += len(chunk)
                continue
            for item in response.json()["data"]:
                vectors[start + int(item["index"])] = np.asarray(
                    item["embedding"], dtype=np.float32
                )
                answered += 1
        seconds = time.perf_counter() - started
    return Run(
        f"naive client loop ({batch} texts/request, float, sequential)",
        len(texts),
        seconds,
        answered,
        failed,
        None,
        cos_min(vectors, reference),
    )


def bench_job(
    args: argparse.Namespace,
    url: str,
    corpus: Path,
    rows: int,
    workers: int,
    work: Path,
    reference: np.ndarray,
) -> Run:
    """An Indexed Job of ``workers`` parallelism, as processes: plan, then one ``job work``
    per shard, at most ``workers`` at a time."""
    output = work / f"job-out-{workers}"
    shutil.rmtree(output, ignore_errors=True)
    logs = work / f"job-logs-{workers}"
    logs.mkdir(parents=True, exist_ok=True)
    job = [str(BIN / "embedding-server"), "job"]
    common = ["--output", str(output), "--log-level", "warning"]
    name = f"EmbeddingJob, {workers} worker{'s' if workers > 1 else ''}"
    started = time.perf_counter()
    plan = subprocess.run(
        [
            *job,
            "plan",
            *("--input", str(corpus / "*.parquet"), "--format", "parquet"),
            *("--id-field", "id", "--text-field", "text"),
            *("--shard-rows", str(math.ceil(rows / args.job_shards))),
            *("--termination-log", str(logs / "plan.json")),
            *common,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if plan.returncode != 0:
        return Run(name, rows, 0.0, 0, rows, note=f"plan exited {plan.returncode}: {plan.stderr}")
    shards = int(orjson.loads((logs / "plan.json").read_bytes())["shards"])
    pending = list(range(shards))
    running: dict[int, subprocess.Popen[bytes]] = {}
    problems: list[str] = []
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    try:
        while pending or running:
            while pending and len(running) < workers:
                index = pending.pop(0)
                argv = [
                    *job,
                    "work",
                    *("--service", url, "--index", str(index)),
                    *("--termination-log", str(logs / f"work-{index}.json")),
                    *common,
                ]
                sink = (logs / f"work-{index}.log").open("wb")
                running[index] = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
                sink.close()
            for index, process in list(running.items()):
                if process.poll() is not None:
                    del running[index]
                    if process.returncode != 0:
                        tail = (logs / f"work-{index}.log").read_text(errors="replace")[-400:]
                        problems.append(f"shard {index} exited {process.returncode}: {tail}")
            if time.monotonic() > deadline:
                problems.append(f"not done after {COMMAND_TIMEOUT_S:.0f} s")
                break
            time.sleep(POLL_S)
    finally:
        for process in running.values():
            process.send_signal(signal.SIGKILL)
            process.wait()
    seconds = time.perf_counter() - started
    failed = 0
    for index in range(shards):
        summary_file = logs / f"work-{index}.json"
        if summary_file.exists():
            failed += int(orjson.loads(summary_file.read_bytes()).get("failed", 0))
    vectors, found = read_parts(output, rows)
    agreement = cos_min(vectors, reference)
    run = Run(name, rows, seconds, found, failed, None, agreement, "; ".join(problems), shards)
    shutil.rmtree(output, ignore_errors=True)
    return run


def bench_memory(args: argparse.Namespace, sizes: list[int], work: Path) -> list[Memory]:
    results = []
    for rows in sizes:
        source, answers = work / f"memory-{rows}.jsonl", work / f"memory-{rows}-out.jsonl"
        write_memory_file(source, rows, args.memory_max_words)
        answers.unlink(missing_ok=True)
        argv = [
            str(BIN / "embedding-server"),
            "run-batch",
            *("-i", str(source), "-o", str(answers)),
            *("--max-in-flight", str(args.max_in_flight)),
            *engine_flags(args),
            *("--log-level", "warning"),
        ]
        done = run_command(argv, work / f"memory-{rows}.log")
        answered, failed = count_answers(answers) if answers.exists() else (0, rows)
        if done.returncode != 0:
            failed = max(failed, rows - answered)
        memory = Memory(rows, round(done.peak_rss_mib, 1), round(done.seconds, 2), answered, failed)
        results.append(memory)
        print(
            f"  run-batch, {rows:>9,} rows: peak RSS {memory.peak_rss_mib:8.1f} MiB, "
            f"{memory.seconds:8.1f} s ({rows / done.seconds:7.1f} rows/s, whole command), "
            f"{answered} answered, {failed} failed",
            flush=True,
        )
        source.unlink(missing_ok=True)
        answers.unlink(missing_ok=True)
    return results


class QueryProbe:
    """One interactive query at a time, ``QUERY_GAP_S`` apart, on a thread, until stopped:
    each one's latency, and how many were not answered with 200."""

    def __init__(self, url: str, texts: list[str]) -> None:
        import threading

        self.url, self.texts = url, texts
        self.latencies: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=60) as client:
            index = 0
            while not self._stop.is_set():
                text = self.texts[index % len(self.texts)]
                index += 1
                started = time.perf_counter()
                try:
                    answer = client.post(
                        f"{self.url}{EMBEDDINGS}",
                        json={"input": text, "encoding_format": "base64"},
                        headers={"X-Priority": "interactive"},
                    )
                    ok = answer.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.latencies.append(time.perf_counter() - started)
                else:
                    self.failed += 1
                self._stop.wait(QUERY_GAP_S)

    def __enter__(self) -> QueryProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def quantiles_ms(self) -> tuple[float, float]:
        if not self.latencies:
            return float("nan"), float("nan")
        p50, p95 = np.percentile(np.array(self.latencies) * 1e3, [50, 95])
        return float(p50), float(p95)


def bench_beside(
    args: argparse.Namespace,
    cap: float,
    corpus: Path,
    rows: int,
    work: Path,
    reference: np.ndarray,
) -> Beside:
    """A server with ``--bulk-batch-ms cap``: queries idle, then beside a 2-worker job."""
    queries = make_corpus(64, seed=7, min_words=3, max_words=12)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [
        str(BIN / "embedding-server"),
        "serve",
        *engine_flags(args),
        *("--bulk-batch-ms", f"{cap:g}"),
        *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
    ]
    with (
        (work / f"serve-cap-{cap:g}.log").open("wb") as server_log,
        child_process(serve, stdout=server_log, stderr=subprocess.STDOUT, grace=30) as server,
    ):
        wait_ready(url, server, SERVER_START_S)
        with QueryProbe(url, queries) as idle:
            time.sleep(IDLE_PROBE_S)
        with QueryProbe(url, queries) as busy:
            job = bench_job(args, url, corpus, rows, 2, work, reference)
    job.name = f"EmbeddingJob, 2 workers, beside queries, --bulk-batch-ms {cap:g}"
    idle_p50, idle_p95 = idle.quantiles_ms()
    busy_p50, busy_p95 = busy.quantiles_ms()
    return Beside(
        cap,
        idle_p50,
        idle_p95,
        busy_p50,
        busy_p95,
        len(busy.latencies),
        idle.failed + busy.failed,
        job,
    )


def served_model(url: str) -> str:
    import httpx

    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"embedding-server serve exited {process.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


# -- report ------------------------------------------------------------------------------------


def best(runs: list[Run]) -> Run:
    """The fastest of one system's rounds (a shared machine is noisy)."""
    return max(runs, key=lambda run: run.rows_per_s)


def ratio_line(label: str, ours: Run, theirs: Run, target: float | None) -> tuple[str, float]:
    value = ours.rows_per_s / theirs.rows_per_s if theirs.rows_per_s else float("nan")
    goal = f"  (target >= {target}x{'' if value >= target else ', MISSED'})" if target else ""
    return f"{label}: {value:.2f}x{goal}", value


def parse_sizes(value: str) -> list[int]:
    return [int(part) for part in value.split(",") if part.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the server's (packaged MiniLM)")
    parser.add_argument("--rows", type=int, default=2000, help="corpus rows (default 2000)")
    parser.add_argument("--max-words", type=int, default=200, help="longest text, in words")
    parser.add_argument("--dtype", default="float32", help="every system's dtype")
    parser.add_argument("--device", default="cpu", help="every system's device (cpu, cuda, auto)")
    parser.add_argument(
        "--texts-per-line", type=int, default=1, help="texts in one run-batch line (default 1)"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=64, help="run-batch's --max-in-flight (default 64)"
    )
    parser.add_argument(
        "--naive-batch", type=int, default=64, help="texts per request of the naive loop"
    )
    parser.add_argument(
        "--job-workers", default="1,2", help="EmbeddingJob parallelisms (default 1,2)"
    )
    parser.add_argument(
        "--job-shards", type=int, default=4, help="Parquet files, one shard each (default 4)"
    )
    parser.add_argument(
        "--memory-rows",
        default="2000,20000",
        help="run-batch input sizes for peak memory, comma-separated ('' skips)",
    )
    parser.add_argument(
        "--memory-max-words", type=int, default=16, help="longest text of the memory files"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of every throughput system; best kept"
    )
    parser.add_argument(
        "--query-caps",
        default="10,0",
        help="--bulk-batch-ms values to measure queries beside a job at ('' skips)",
    )
    args = parser.parse_args()

    import torch
    from embedding_server.device.dtypes import cpu_thread_budget
    from embedding_server.engine import Engine
    from embedding_server.settings import DEFAULT_MODEL

    args.model = args.model or DEFAULT_MODEL
    threads = cpu_thread_budget()
    torch.set_num_threads(threads)
    texts = make_corpus(args.rows, max_words=args.max_words)
    workers = parse_sizes(args.job_workers)
    sizes = parse_sizes(args.memory_rows)
    threshold = 0.9999 if args.dtype == "float32" else 0.999
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    info = engine.info()
    tokens = sum(min(len(ids), info.max_input_tokens) for ids in engine.tokenize(texts))
    print(
        f"model {args.model} ({info.dtype} on {info.device}); {len(texts)} rows, {tokens} "
        f"tokens (mean {tokens / len(texts):.0f}); {threads} threads; run-batch lines of "
        f"{args.texts_per_line} text(s), --max-in-flight {args.max_in_flight}",
        flush=True,
    )
    engine.embed(texts[:32])

    report = Report()
    rounds: dict[str, list[Run]] = {}
    base = out_dir()
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bulk-", dir=base) as folder:
        work = Path(folder)
        corpus = work / "corpus"
        write_parquet_corpus(corpus, texts, args.job_shards)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = [
            str(BIN / "embedding-server"),
            "serve",
            *engine_flags(args),
            # The naive loop's requests are queries (interactive): a job started within the
            # minute after them would be cut to short batches. The job alone is measured
            # here, beside queries in section 6.
            *("--bulk-batch-ms", "0"),
            *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
        ]
        reference: np.ndarray | None = None
        with (
            (work / "serve.log").open("wb") as server_log,
            child_process(serve, stdout=server_log, stderr=subprocess.STDOUT, grace=30) as server,
        ):
            wait_ready(url, server, SERVER_START_S)
            model = served_model(url)
            for round_ in range(args.rounds):
                if args.rounds > 1:
                    print(f"round {round_ + 1} of {args.rounds}", flush=True)
                offline, vectors = bench_offline(engine, texts)
                reference = vectors if reference is None else reference
                offline.cos_min = cos_min(vectors, reference)
                results = [offline, *bench_run_batch(args, texts, work, reference)]
                results.append(bench_naive(url, model, texts, args.naive_batch, reference))
                for count in workers:
                    results.append(bench_job(args, url, corpus, len(texts), count, work, reference))
                for run in results:
                    rounds.setdefault(run.name, []).append(run)
                    print(
                        f"  {run.name:58s} {run.seconds:8.2f} s {run.rows_per_s:8.1f} rows/s"
                        f"  cos min {run.cos_min if run.cos_min is None else f'{run.cos_min:.6f}'}"
                        f" {run.note}",
                        flush=True,
                    )
        engine.close()
        report.runs = [best(runs) for runs in rounds.values()]
        assert reference is not None
        for cap in [float(part) for part in args.query_caps.split(",") if part.strip()]:
            print(f"queries beside a 2-worker job, --bulk-batch-ms {cap:g}:", flush=True)
            beside = bench_beside(args, cap, corpus, len(texts), work, reference)
            report.beside.append(beside)
            print(
                f"  idle p50 {beside.idle_p50_ms:.1f} ms, beside the job p50 "
                f"{beside.busy_p50_ms:.1f} ms ({beside.ratio:.2f}x), job "
                f"{beside.job.rows_per_s:.1f} rows/s",
                flush=True,
            )
        if sizes:
            print("peak memory of run-batch against input size:", flush=True)
            report.memory = bench_memory(args, sizes, work)

    for run in report.runs:
        if run.answered != args.rows or run.failed:
            report.problems.append(
                f"{run.name}: {run.answered} of {args.rows} rows answered, {run.failed} failed"
            )
        if run.cos_min is None or run.cos_min < threshold:
            report.problems.append(f"{run.name}: cosine min {run.cos_min} < {threshold}")
        if run.note:
            report.problems.append(f"{run.name}: {run.note}")
    for memory in report.memory:
        if memory.answered != memory.rows or memory.failed:
            report.problems.append(
                f"run-batch at {memory.rows} rows: {memory.answered} answered, "
                f"{memory.failed} failed"
            )

    for beside in report.beside:
        run = beside.job
        if run.answered != args.rows or run.failed or run.note:
            report.problems.append(
                f"{run.name}: {run.answered} of {args.rows} rows answered, {run.failed} "
                f"failed {run.note}"
            )
        if beside.failed_queries:
            report.problems.append(
                f"--bulk-batch-ms {beside.bulk_batch_ms:g}: {beside.failed_queries} queries "
                "not answered with 200"
            )

    by_name = {run.name: run for run in report.runs}
    steady = by_name["run-batch, model loaded"]
    whole = by_name["run-batch, whole command"]
    naive = next(run for run in report.runs if run.name.startswith("naive"))
    lines_and_values = [
        ratio_line(
            "run-batch (model loaded) / offline engine",
            steady,
            by_name["offline engine (Engine.embed)"],
            TARGET_OFFLINE,
        ),
        ratio_line("run-batch (model loaded) / naive client loop", steady, naive, TARGET_NAIVE),
        ratio_line("run-batch (whole command) / naive client loop", whole, naive, None),
    ]
    for run in report.runs:
        if run.name.startswith("EmbeddingJob"):
            lines_and_values.append(
                ratio_line(f"{run.name} / run-batch (model loaded)", run, steady, None)
            )
            lines_and_values.append(
                ratio_line(f"{run.name} / run-batch (whole command)", run, whole, None)
            )
    ratios = {line.split(":")[0]: round(value, 3) for line, value in lines_and_values}
    memory_line = ""
    if len(report.memory) >= 2:
        low, high = report.memory[0], report.memory[-1]
        growth = high.peak_rss_mib / low.peak_rss_mib
        per_10k = (high.peak_rss_mib - low.peak_rss_mib) / ((high.rows - low.rows) / 1e4)
        memory_line = (
            f"peak RSS at {high.rows:,} rows / at {low.rows:,} rows: {growth:.2f}x "
            f"({per_10k:+.1f} MiB per 10k rows)  (target: flat from 10k to 1M rows)"
        )
        ratios["peak RSS largest / smallest input"] = round(growth, 3)
        ratios["peak RSS MiB per 10k rows"] = round(per_10k, 2)

    print("\n| system | rows | seconds | rows/s | peak RSS MiB | cosine min vs offline |")
    print("|---|---:|---:|---:|---:|---:|")
    for run in report.runs:
        rss = "" if run.peak_rss_mib is None else f"{run.peak_rss_mib:.0f}"
        cos = "" if run.cos_min is None else f"{run.cos_min:.6f}"
        print(
            f"| {run.name} | {run.rows} | {run.seconds:.2f} | {run.rows_per_s:.1f} | {rss} "
            f"| {cos} |"
        )
    if report.memory:
        print("\n| run-batch input rows | peak RSS MiB | seconds | rows/s |")
        print("|---:|---:|---:|---:|")
        for memory in report.memory:
            print(
                f"| {memory.rows:,} | {memory.peak_rss_mib:.0f} | {memory.seconds:.1f} | "
                f"{memory.rows / memory.seconds:.1f} |"
            )
    if report.beside:
        print(
            "\n| --bulk-batch-ms | query p50 idle ms | p95 idle | p50 beside the job | p95 "
            "beside | p50 beside / idle | job rows/s |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for beside in report.beside:
            print(
                f"| {beside.bulk_batch_ms:g} | {beside.idle_p50_ms:.1f} | "
                f"{beside.idle_p95_ms:.1f} | {beside.busy_p50_ms:.1f} | "
                f"{beside.busy_p95_ms:.1f} | {beside.ratio:.2f}x | "
                f"{beside.job.rows_per_s:.1f} |"
            )
        for beside in report.beside:
            missed = "" if beside.ratio <= TARGET_QUERY_P50 else ", MISSED"
            line = (
                f"query p50 beside the job / idle, --bulk-batch-ms {beside.bulk_batch_ms:g}: "
                f"{beside.ratio:.2f}x  (target <= {TARGET_QUERY_P50}x{missed})"
            )
            print(line)
    print("\nratios (rows/s):")
    for line, _ in lines_and_values:
        print(f"  {line}")
    if memory_line:
        print(f"  {memory_line}")
    for problem in report.problems:
        print(f"PROBLEM: {problem}")

    written = write_results(
        "bulk",
        {
            "model": args.model,
            "dtype": info.dtype,
            "device": str(info.device),
            "rows": args.rows,
            "tokens": tokens,
            "threads": threads,
            "texts_per_line": args.texts_per_line,
            "max_in_flight": args.max_in_flight,
            "naive_batch": args.naive_batch,
            "job_shards": args.job_shards,
            "memory_max_words": args.memory_max_words,
            "rounds": args.rounds,
            "runs": [run.summary() for run in report.runs],
            "memory": [asdict(memory) for memory in report.memory],
            "beside": [
                {**asdict(beside), "job": beside.job.summary(), "ratio": round(beside.ratio, 3)}
                for beside in report.beside
            ],
            "ratios": ratios,
            "targets": {
                "run-batch (model loaded) / offline engine": f">= {TARGET_OFFLINE}x",
                "run-batch (model loaded) / naive client loop": f">= {TARGET_NAIVE}x",
                "peak RSS": "flat from 10k to 1M rows",
                "query p50 beside the job / idle": f"<= {TARGET_QUERY_P50}x",
            },
            "problems": report.problems,
        },
    )
    print(f"\nwrote {written}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())

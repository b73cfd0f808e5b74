"""Every benchmark script still runs: a small run of each, checked for what it measured.

The benchmarks are not tests (their figures go to docs/benchmarks, never into an assertion), but
they are deliverables, and nothing else runs them: ``bench.tensor_parallel`` once failed at
start on main for rounds without anyone noticing. So each script runs here on a few texts
and a second or two of load, and the test checks what a person running it would look at:
that it exited 0, that every system it drove answered every request, and that the vectors
it compared agree. No figure is compared with a target here.

They run in this tier, not with the unit tests, because ``bench.frontend`` needs ``wrk``
(a Debian package, installed here like the node's) and the runs take a couple of minutes.
``$BENCH_OUT`` points them at a temporary folder, so a real run's figures in ``bench/out``
are never overwritten.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import OUT_ENV
from e2e.harness.host_packages import ensure_packages

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600


def run_bench(module: str, *args: str, out: Path) -> str:
    """``python -m bench.<module> args`` from the repository root; its output. Fails with
    the output's tail when it exits non-zero."""
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=REPO,
        env={**os.environ, OUT_ENV: str(out)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"bench.{module} exited {result.returncode}:\n{output[-4000:]}"
    return result.stdout


def read_json(path: Path) -> Any:
    assert path.exists(), f"the benchmark wrote no {path.name}"
    return json.loads(path.read_text())


def test_offline(tmp_path: Path) -> None:
    run_bench("offline", "--texts", "8", out=tmp_path)
    runs = {run["name"]: run for run in read_json(tmp_path / "offline.json")["runs"]}
    assert set(runs) == {
        "sentence-transformers float32",
        "sentence-transformers bfloat16",
        "embedding-server float32",
        "embedding-server bfloat16",
    }
    assert all(run["texts_per_s"] > 0 for run in runs.values())
    assert runs["embedding-server float32"]["cos_min"] > 0.9999  # against sentence-transformers


def test_offline_int8_says_why_infinity_did_not_run(tmp_path: Path) -> None:
    """``--quantization int8`` adds our int8 row (cosine >= 0.99 to sentence-transformers
    float32, the quality bar); an infinity-emb virtualenv that is not there is said, not
    skipped in silence or replaced by another runner."""
    missing = tmp_path / "no-venv" / "bin" / "python"
    out = run_bench(
        "offline",
        *("--texts", "8", "--skip-bf16", "--quantization", "int8"),
        *("--infinity-python", str(missing)),
        out=tmp_path,
    )
    report = read_json(tmp_path / "offline.json")
    runs = {run["name"]: run for run in report["runs"]}
    assert set(runs) == {
        "sentence-transformers float32",
        "embedding-server float32",
        "embedding-server int8",
    }
    assert runs["embedding-server int8"]["cos_min"] >= 0.99
    (note,) = report["infinity_notes"]
    assert f"{missing} does not exist" in note and note in out
    assert "ours int8 / sentence-transformers float32" in out and "(target >= 2x)" in out


def test_generic(tmp_path: Path) -> None:
    run_bench("generic", "--texts", "8", "--t5-layers", "2", out=tmp_path)
    runs = {(run["model"], run["name"]) for run in read_json(tmp_path / "generic.json")["runs"]}
    assert runs == {
        ("t5", "sentence-transformers"),
        ("t5", "embedding-server transformers"),
        ("minilm", "sentence-transformers"),
        ("minilm", "embedding-server transformers"),
        ("minilm", "embedding-server native"),
    }
    for run in read_json(tmp_path / "generic.json")["runs"]:
        assert run["texts_per_s"] > 0 and run["cos_min"] > 0.9999, run


def test_scheduler(tmp_path: Path) -> None:
    stdout = run_bench("scheduler", "--texts", "16", "--repeats", "1", out=tmp_path)
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["best"]["batches"] >= 1
    assert report["best"]["texts_per_s"] > 0


def test_tensor_parallel(tmp_path: Path) -> None:
    run_bench("tensor_parallel", "--texts", "8", "--requests", "3", out=tmp_path)
    runs = {
        run["tensor_parallel_size"]: run
        for run in read_json(tmp_path / "tensor_parallel.json")["runs"]
    }
    assert set(runs) == {1, 2}
    (whole,) = runs[1]["weight_bytes_per_rank"]
    assert all(part < 0.55 * whole for part in runs[2]["weight_bytes_per_rank"])
    assert runs[2]["cos_min_vs_tp1"] > 0.9999


def test_http_load(tmp_path: Path) -> None:
    args = ("--texts", "8", "--repeats", "1", "--skip-infinity", "--dtype", "float32")
    run_bench("http_load", *args, out=tmp_path)
    results = read_json(tmp_path / "http_load.json")["results"]
    served = [r for r in results if r["name"].startswith("embedding-server: ")]
    assert len(served) == 2, [r["name"] for r in results]  # both load shapes
    for result in served:
        assert result["texts"] == 8 and not result["note"], result  # every text answered


def test_frontend(tmp_path: Path) -> None:
    ensure_packages(("wrk",))
    args = ("--seconds", "1", "--texts", "64", "--api-workers", "1,2")
    run_bench("frontend", *args, out=tmp_path)
    report = read_json(tmp_path / "frontend.json")
    results = report["results"]
    measured = {(r["server"], r["load"]) for r in results}
    servers = {"embedding-server", "embedding-server x2", "ceiling"}
    assert measured == {(s, load) for s in servers for load in ("1-text", "32-text")}
    for result in results:
        assert result["failed"] == 0, result
        assert result["requests_per_s"] > 0 and result["cpu_us_per_request"] > 0, result
        # The event loops' share is part of the whole, read from the same processes. A
        # one-thread process (the ceiling) has them equal, up to the clock tick each of the
        # four readings may round to (the kernel counts a thread's and a process's CPU
        # separately) over the second's requests.
        ticks_us = 4 * 1e6 / os.sysconf("SC_CLK_TCK") / result["requests_per_s"]
        whole = result["cpu_us_per_request"] + ticks_us
        assert 0 < result["loop_cpu_us_per_request"] <= whole, result
        if result["server"].startswith("embedding-server"):
            # Our model runs off the event loop, so some CPU is always spent elsewhere.
            assert result["loop_cpu_us_per_request"] < result["cpu_us_per_request"], result
    budgets = [line for line in report["ratios"] if "leaves" in line]
    assert [line.split(":")[0] for line in budgets] == ["1-text", "32-text"], report["ratios"]
    # Each ratio to the ceiling carries its targets, met or missed.
    targets = [line for line in report["ratios"] if "/ ceiling =" in line and "x2" not in line]
    assert len(targets) == 2, report["ratios"]
    assert all("target >= 0.6x" in line and "ms: " in line for line in targets), targets


def test_gateway(tmp_path: Path) -> None:
    args = ("--rounds", "1", "--sequential", "50", "--seconds", "1", "--requests", "60")
    run_bench("gateway", *args, out=tmp_path)
    report = read_json(tmp_path / "gateway.json")
    overhead = report["overhead"]
    assert overhead["gateway_p50"] > 0 and overhead["rps_gateway"] > 0, overhead
    assert set(report["balancing"]) == {"least-backlog", "random"}
    for figures in report["balancing"].values():
        assert 0 < figures["short_p50"] <= figures["short_p99"], figures


def test_gpu_smoke_on_the_cpu(tmp_path: Path) -> None:
    report = tmp_path / "gpu_smoke.json"
    args = ("--device", "cpu", "--quick", "--no-scale", "--json", str(report))
    run_bench("gpu_smoke", *args, out=tmp_path)
    checks = read_json(report)["checks"]
    assert checks and all(check["passed"] for check in checks)


def test_cold_start(tmp_path: Path) -> None:
    # The packaged MiniLM only: the 1B decoder's 2.5 GB build is for real runs.
    run_bench("cold_start", "--runs", "1", "--no-decoder", out=tmp_path)
    report = read_json(tmp_path / "cold_start.json")
    assert [s["model"] for s in report["starts"]] == ["MiniLM (packaged)"], report
    assert 0 < report["starts"][0]["seconds"] < 120, report
    assert "2.3-2.5 s" in report["summary"][0], report  # the target's figure beside ours


def test_prefix_cache(tmp_path: Path) -> None:
    out = run_bench(
        "prefix_cache",
        *("--shape", "tiny", "--dtypes", "float32", "--queries", "8", "--rounds", "1"),
        *("--latency", "2", "--lengths", "24"),
        out=tmp_path,
    )
    (run,) = read_json(tmp_path / "prefix_cache.json")["runs"]
    assert run["cos_min"] > 0.99999  # the cached vectors are the uncached ones
    assert run["cache_entries"] == 1 and run["cache_hits"] > 0
    assert run["qps"]["on"] > 0 and run["qps"]["off"] > 0
    assert "(target >= 2x)" in out


def test_bulk(tmp_path: Path) -> None:
    """Every system of ``bench.bulk`` (our offline engine, run-batch, the naive client loop
    against our server, the EmbeddingJob worker with 1 and 2 processes, and run-batch at two
    input sizes for peak memory) answers every row, with the offline engine's vectors."""
    rows = 128
    args = ("--rows", str(rows), "--max-words", "32", "--memory-rows", "100,300")
    out = run_bench("bulk", *args, "--job-shards", "2", out=tmp_path)
    report = read_json(tmp_path / "bulk.json")
    runs = {run["name"]: run for run in report["runs"]}
    assert set(runs) == {
        "offline engine (Engine.embed)",
        "run-batch, model loaded",
        "run-batch, whole command",
        "naive client loop (64 texts/request, float, sequential)",
        "EmbeddingJob, 1 worker",
        "EmbeddingJob, 2 workers",
    }
    for run in runs.values():
        assert run["answered"] == rows and run["failed"] == 0 and not run["note"], run
        assert run["rows_per_s"] > 0 and run["cos_min"] >= 0.9999, run
    assert runs["EmbeddingJob, 2 workers"]["shards"] == 2
    assert [memory["rows"] for memory in report["memory"]] == [100, 300]
    for memory in report["memory"]:
        assert memory["answered"] == memory["rows"] and memory["failed"] == 0, memory
        assert memory["peak_rss_mib"] > 0, memory
    assert report["problems"] == []
    # Each ratio is printed beside its target, met or missed.
    assert "run-batch (model loaded) / offline engine" in out and "(target >= 0.9x" in out
    assert "run-batch (model loaded) / naive client loop" in out and "(target >= 1.5x" in out
    assert "(target: flat from 10k to 1M rows)" in out

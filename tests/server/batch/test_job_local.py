"""``job work --local``: a shard embedded by the engine in the worker's own process (an
EmbeddingJob's ``spec.model``), on the packaged MiniLM, gets what a service would give it:
the same vectors (sentence-transformers' too), the same error per refused row, and the
engine's fingerprint in the part's metadata."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import orjson
import pyarrow.fs as pafs
import pytest
from sentence_transformers import SentenceTransformer

from tests.server.batch.test_job import (
    LONG_TEXT,
    Place,
    errors_of,
    minilm_server,  # noqa: F401 (a fixture)
    plan_args,
    read_parts,
    reference,  # noqa: F401 (a fixture)
    run,
    write_corpus,
)
from tests.support.api import RunningServer
from tests.support.models import MINILM_DIR


def _place(root: Path) -> Place:
    return Place(pafs.LocalFileSystem(), str(root), str(root), {})


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))


def _work_every_shard(place: Place, engine: list[str], tmp_path: Path) -> list[dict[str, object]]:
    shards = len(orjson.loads(place.read("out/_plan.json"))["shards"])
    summaries = []
    for index in range(shards):
        log = tmp_path / f"{place.root.replace('/', '_')}-{index}.log"
        args = ["work", "--output", place.url("out"), "--index", str(index), "--batch-size", "4"]
        code, summary = run(*args, *engine, log=log)
        assert code == 0, summary
        assert summary is not None
        summaries.append(summary)
    return summaries


@pytest.mark.slow
def test_local_work_gives_the_vectors_errors_and_fingerprint_a_service_gives(
    minilm_server: RunningServer,  # noqa: F811
    reference: SentenceTransformer,  # noqa: F811
    tmp_path: Path,
) -> None:
    texts: dict[int, str | None] = {
        n: f"passage {n}: the {['cat', 'sea', 'tax', 'moon'][n % 4]} story" for n in range(20)
    }
    texts[3] = LONG_TEXT  # the API refuses it: context_length_exceeded
    texts[8] = ""  # the API refuses an empty text
    texts[14] = None  # null: the worker's own invalid_row
    files = [[(n, texts[n]) for n in range(f * 10, f * 10 + 10)] for f in range(2)]
    local, remote = _place(tmp_path / "local"), _place(tmp_path / "http")
    for place in (local, remote):
        glob = write_corpus(place, "parquet", files)
        assert run(*plan_args(glob, "parquet", place.url("out"), 10))[0] == 0

    # No --model: the packaged MiniLM the server serves by default (the service's model),
    # pinned to its fingerprint by a prefix, as an EmbeddingJob's spec.fingerprint may be.
    info = httpx.get(minilm_server.url + "/info").json()
    pinned = ["--local", "--expect-fingerprint", info["fingerprint"][:8]]
    by_local = _work_every_shard(local, pinned, tmp_path)
    by_http = _work_every_shard(remote, ["--service", minilm_server.url], tmp_path)
    assert [(s["rows"], s["failed"]) for s in by_local] == [
        (s["rows"], s["failed"]) for s in by_http
    ]
    assert sum(int(s["rows"]) for s in by_local) == 17  # type: ignore[call-overload]

    good = [n for n in range(20) if n not in (3, 8, 14)]
    tables = {"local": read_parts(local), "http": read_parts(remote)}
    vectors = {}
    for name, table in tables.items():
        ids = table.column("doc_id").to_pylist()
        assert sorted(ids) == good
        by_id = dict(zip(ids, np.asarray(table.column("embedding").to_pylist()), strict=True))
        vectors[name] = np.stack([by_id[n] for n in good])
    want = reference.encode([texts[n] for n in good], normalize_embeddings=True)
    assert _cosines(vectors["local"], vectors["http"]).min() >= 0.9999
    assert _cosines(vectors["local"], want).min() >= 0.9999

    # The part says which computation made it, as a service's part does: the served name,
    # the vector size and the engine's fingerprint (the one the server sends with answers).
    local_meta, http_meta = tables["local"].schema.metadata, tables["http"].schema.metadata
    served = httpx.get(minilm_server.url + "/v1/models").json()["data"][0]["id"]
    assert local_meta[b"model"] == http_meta[b"model"] == served.encode()
    assert local_meta[b"dimensions"] == http_meta[b"dimensions"] == b"384"
    assert local_meta[b"fingerprint"] == http_meta[b"fingerprint"] == info["fingerprint"].encode()

    # Each refused row gets the very error the HTTP API answers it.
    local_errors = {e["id"]: e for e in errors_of(local)}
    http_errors = {e["id"]: e for e in errors_of(remote)}
    assert set(local_errors) == {3, 8, 14}
    for n in (3, 8, 14):
        assert local_errors[n]["error"] == http_errors[n]["error"]
        assert local_errors[n]["row"] == http_errors[n]["row"] == n % 10
    assert local_errors[3]["error"]["status"] == 400
    assert local_errors[3]["error"]["code"] == "context_length_exceeded"
    assert local_errors[8]["error"]["status"] == 400
    assert local_errors[14]["error"]["code"] == "invalid_row"


@pytest.mark.slow
def test_local_work_for_another_computation_exits_2_and_commits_nothing(tmp_path: Path) -> None:
    place = _place(tmp_path)
    glob = write_corpus(place, "parquet", [[(n, f"text {n}") for n in range(4)]])
    assert run(*plan_args(glob, "parquet", place.url("out"), 10))[0] == 0
    code, summary = run(
        "work", "--output", place.url("out"), "--index", "0", "--local",
        "--model", str(MINILM_DIR), "--expect-fingerprint", "0123456789abcdef",
        log=tmp_path / "work.log",
    )  # fmt: skip
    assert code == 2
    assert summary is not None and "0123456789abcdef" in summary["error"]
    assert place.files("out/parts") == []
    # Not a fingerprint at all: a bad argument, refused before the model loads.
    code, summary = run(
        "work", "--output", place.url("out"), "--index", "0", "--local",
        "--expect-fingerprint", "abc", log=tmp_path / "bad.log",
    )  # fmt: skip
    assert code == 2
    assert summary is not None and "--expect-fingerprint" in summary["error"]


def test_engine_settings_without_local_are_refused_with_exit_2(tmp_path: Path) -> None:
    place = _place(tmp_path)
    glob = write_corpus(place, "parquet", [[(n, f"text {n}") for n in range(4)]])
    assert run(*plan_args(glob, "parquet", place.url("out"), 10))[0] == 0
    code, summary = run(
        "work", "--output", place.url("out"), "--index", "0",
        "--service", "http://127.0.0.1:9", "--dtype", "float32",
        log=tmp_path / "work.log",
    )  # fmt: skip
    assert code == 2
    assert summary is not None and "--dtype" in summary["error"] and "--local" in summary["error"]
    assert place.files("out/parts") == []


def test_a_model_that_cannot_be_loaded_exits_1_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 1: the shard is tried again (a Hub that did not answer may next time)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    place = _place(tmp_path)
    glob = write_corpus(place, "parquet", [[(n, f"text {n}") for n in range(4)]])
    assert run(*plan_args(glob, "parquet", place.url("out"), 10))[0] == 0
    code, summary = run(
        "work", "--output", place.url("out"), "--index", "0", "--local",
        "--model", "no-such-org/no-such-model",
        log=tmp_path / "work.log",
    )  # fmt: skip
    assert code == 1
    assert summary is not None and "no-such-org/no-such-model" in summary["error"]
    assert place.files("out/parts") == [] and place.files("out/errors") == []

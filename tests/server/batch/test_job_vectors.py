"""``job work --vectors``: an EmbeddingJob that keeps sparse and multi-vector outputs, on real
servers of the tiny bge-m3-shaped model (dense, sparse and multi-vector from one forward
pass) and the tiny stanford-colbert checkpoint the API tests build.

Each part's values must be what the API gives the same texts in requests of their own:
bge-m3's through ``/pooling`` task hybrid (another endpoint than the worker's ``/v2/embed``),
the dense vector through ``/v1/embeddings``, ColBERT's through ``/v2/embed`` with the side
the job says. A part's schema is the same whether its shard embedded rows or none, a row the
API refuses is listed in the errors file, and a job asking for an output the model does not
give exits 2 before any part is written."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from embedding_server.settings import ServerSettings

from tests.server.batch.test_job import JsonHandler, Place, plan_args, run, serving, write_corpus
from tests.server.device.test_colbert_engine import build_hf_colbert
from tests.support.api import RunningServer, fake_settings, running_server
from tests.support.api import post_json as post
from tests.support.models import build_bge_m3
from tests.support.tasks import build_splade

pytestmark = pytest.mark.timeout(180)

TEXTS = [
    "hybrid search",
    "dense, sparse and multi-vector in one request",
    "z",
    "",  # the API refuses an empty text (400): its row is listed, its batch still embedded
    "the the the: repeated tokens keep the max",
    "late interaction",
]
ALL = "dense,sparse,multi_vector"
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def bge_m3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bge_m3(tmp_path_factory.mktemp("bge-m3") / "xlmr")


@pytest.fixture(scope="module")
def bge_m3(bge_m3_dir: Path) -> Iterator[RunningServer]:
    with running_server(fake_settings(str(bge_m3_dir), dtype="float32")) as running:
        yield running


@pytest.fixture(scope="module")
def splade(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    path = build_splade(tmp_path_factory.mktemp("splade") / "splade", "bert")
    with running_server(fake_settings(str(path), dtype="float32")) as running:
        yield running


@pytest.fixture(scope="module")
def colbert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    path = build_hf_colbert(tmp_path_factory.mktemp("colbert") / "hf_colbert")
    with running_server(fake_settings(str(path), dtype="float32")) as running:
        yield running


@pytest.fixture
def place(tmp_path: Path) -> Place:
    return Place(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path), {})


def plan(place: Place, texts: list[str | None], shard_rows: int, *extra: str) -> int:
    """A JSONL corpus of ``texts`` (ids d-0, d-1...) planned into ``out``; its shards."""
    glob = write_corpus(place, "jsonl", [[(f"d-{n}", t) for n, t in enumerate(texts)]])
    assert run(*plan_args(glob, "jsonl", place.url("out"), shard_rows), *extra)[0] == 0
    return len(orjson.loads(place.read("out/_plan.json"))["shards"])


def work(place: Place, server: RunningServer, index: int, *extra: str) -> int:
    return run(
        "work", "--output", place.url("out"), "--service", server.url, "--index", str(index),
        "--batch-size", "2", *extra,
    )[0]  # fmt: skip


def part(place: Place, index: int) -> pa.Table:
    return pq.read_table(pa.BufferReader(place.read(f"out/parts/part-{index:06d}.parquet")))


def assert_same_sparse_values(got: Sequence[float], want: Sequence[float]) -> None:
    """A sparse vector's weights (its indices compared apart) equal the API's up to float32's
    batching noise: the job's rows and the API's request are batched apart, and a GEMM of
    another shape rounds differently (1.3e-6 at most on weights up to 1.1, seen in CI on a
    2-core EPYC: 0.7% of a weight of 2e-4). Relative 1e-4, absolute 1e-5."""
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1)
    return np.asarray(np.sum(got * want, axis=-1) / norms)


def errors_of(place: Place) -> dict[str, dict[str, Any]]:
    lines = [place.read(f"out/errors/{n}") for n in place.files("out/errors")]
    return {e["id"]: e for data in lines for e in map(orjson.loads, data.splitlines())}


@pytest.mark.slow
def test_a_bge_m3_job_keeps_the_dense_sparse_and_multi_vectors_the_api_gives(
    place: Place, bge_m3: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    texts: list[str | None] = [*TEXTS, None, None, None]  # the last shards have no text
    shards = plan(place, texts, 3)
    assert shards == 3
    for index in range(shards):
        assert work(place, bge_m3, index, "--vectors", ALL) == 0, capsys.readouterr().err
    tables = [part(place, index) for index in range(shards)]
    # The same schema, metadata widths included, whether a shard embedded rows or none.
    schema = tables[0].schema
    assert [t.schema.remove_metadata() for t in tables[1:]] == [schema.remove_metadata()] * 2
    assert tables[2].num_rows == 0
    assert schema.names == ["doc_id", "embedding", "sparse", "multi_vector"]
    info = httpx.get(bge_m3.url + "/info", timeout=10).json()
    dims, width = info["dimensions"], info["multi_vector_dim"]
    assert schema.field("embedding").type == pa.list_(pa.float32(), dims)
    assert schema.field("sparse").type == pa.struct(
        [("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float32()))]
    )
    assert schema.field("multi_vector").type == pa.list_(pa.list_(pa.float32(), width))
    sent = httpx.post(bge_m3.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
    for table in tables:
        metadata = table.schema.metadata
        assert metadata[b"vectors"] == ALL.encode()
        assert metadata[b"dimensions"] == str(dims).encode()
        assert metadata[b"multi_vector_dimensions"] == str(width).encode()
        assert metadata[b"model"] == info["served_model_name"].encode()
        fingerprint = sent.headers.get("x-embedding-fingerprint")
        assert metadata.get(b"fingerprint") == (fingerprint.encode() if fingerprint else None)

    table = pa.concat_tables(tables)
    good = [n for n, text in enumerate(texts) if text]
    assert table.column("doc_id").to_pylist() == [f"d-{n}" for n in good]
    want = post(bge_m3, "/pooling", {"input": [texts[n] for n in good], "task": "hybrid"})
    dense = post(bge_m3, "/v1/embeddings", {"input": [texts[n] for n in good]})["data"]
    rows = table.to_pylist()
    assert any(row["sparse"]["indices"] for row in rows)  # the tiny heads weight some tokens
    for row, answer, plain in zip(rows, want["data"], dense, strict=True):
        hybrid = answer["data"]
        assert cosines(np.array(row["embedding"]), np.array(plain["embedding"])) >= MIN_COSINE
        assert cosines(np.array(row["embedding"]), np.array(hybrid["dense"])) >= MIN_COSINE
        assert row["sparse"]["indices"] == hybrid["sparse"]["indices"]
        assert_same_sparse_values(row["sparse"]["values"], hybrid["sparse"]["values"])
        got, expected = np.array(row["multi_vector"]), np.array(hybrid["multi_vector"])
        assert got.shape == expected.shape and got.shape[1] == width
        assert cosines(got, expected).min() >= MIN_COSINE

    errors = errors_of(place)
    assert set(errors) == {"d-3", "d-6", "d-7", "d-8"}
    assert errors["d-3"]["error"]["status"] == 400  # the API's refusal of ""
    assert errors["d-6"]["error"]["code"] == "invalid_row"  # no text at all


@pytest.mark.slow
def test_a_jsonl_part_holds_each_rows_v2_embed_answer(
    place: Place, bge_m3: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    texts: list[str | None] = [TEXTS[0], TEXTS[1], TEXTS[4]]
    assert plan(place, texts, 10, "--output-format", "jsonl") == 1
    assert work(place, bge_m3, 0, "--vectors", "sparse,multi_vector") == 0, capsys.readouterr()
    lines = [orjson.loads(line) for line in place.read("out/parts/part-000000.jsonl").splitlines()]
    assert [line["custom_id"] for line in lines] == ["d-0", "d-1", "d-2"]
    for line, text in zip(lines, texts, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["response_type"] == "embeddings_by_type"
        assert set(body["embeddings"]) == {"sparse", "multi_vector"}  # no dense asked for
        answer = post(
            bge_m3, "/v2/embed", {"texts": [text], "embedding_types": ["sparse", "multi_vector"]}
        )["embeddings"]
        (sparse,) = body["embeddings"]["sparse"]
        assert sparse["indices"] == answer["sparse"][0]["indices"]
        assert_same_sparse_values(sparse["values"], answer["sparse"][0]["values"])
        got = np.array(body["embeddings"]["multi_vector"][0])
        want = np.array(answer["multi_vector"][0])
        assert got.shape == want.shape and cosines(got, want).min() >= MIN_COSINE


@pytest.mark.slow
def test_a_colbert_job_embeds_documents_unless_told_the_texts_are_queries(
    place: Place, colbert: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    texts: list[str | None] = [TEXTS[0], TEXTS[1], TEXTS[5]]
    assert plan(place, texts, 10) == 1
    for side, extra in (
        ("search_document", []),
        ("search_query", ["--input-type", "search_query"]),
    ):
        for name in place.files("out/parts"):
            place.fs.delete_file(f"{place.root}/out/parts/{name}")
        assert work(place, colbert, 0, "--vectors", "multi_vector", *extra) == 0, (
            capsys.readouterr()
        )
        table = part(place, 0)
        assert table.schema.names == ["doc_id", "multi_vector"]
        assert table.schema.metadata[b"vectors"] == b"multi_vector"
        body = {"texts": texts, "input_type": side, "embedding_types": ["multi_vector"]}
        want = post(colbert, "/v2/embed", body)["embeddings"]["multi_vector"]
        for got, expected in zip(table.column("multi_vector").to_pylist(), want, strict=True):
            assert np.array(got).shape == np.array(expected).shape
            assert cosines(np.array(got), np.array(expected)).min() >= MIN_COSINE
        if side == "search_query":  # queries are expanded to the query length: all alike long
            assert len({len(m) for m in table.column("multi_vector").to_pylist()}) == 1


@pytest.fixture(scope="module")
def minilm_server() -> Iterator[RunningServer]:
    with running_server(ServerSettings()) as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize(
    ("which", "vectors", "message"),
    [
        ("minilm", "sparse", "gives dense, not sparse"),
        ("minilm", "dense,multi_vector", "gives dense, not multi_vector"),
        ("colbert", "dense", "gives multi_vector, not dense"),
        ("splade", "dense,sparse", "gives sparse, not dense"),
    ],
)
def test_an_output_the_model_does_not_give_is_refused_with_exit_2_before_any_row(
    place: Place,
    request: pytest.FixtureRequest,
    which: str,
    vectors: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server: RunningServer = request.getfixturevalue({"minilm": "minilm_server"}.get(which, which))
    plan(place, [TEXTS[0], TEXTS[1]], 10)
    log = tmp_path / "work.log"
    code, summary = run(
        "work", "--output", place.url("out"), "--service", server.url, "--index", "0",
        "--vectors", vectors, log=log,
    )  # fmt: skip
    assert code == 2
    assert message in capsys.readouterr().err
    assert summary is not None and summary["shard"] == 0 and message in summary["error"]
    assert place.files("out/parts") == [] and place.files("out/errors") == []


@pytest.mark.parametrize(
    ("vectors", "message"),
    [("dense,dense", "names an output twice"), ("colbert", "'colbert': not one of")],
)
def test_vectors_that_are_not_outputs_are_bad_arguments(
    vectors: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        run("work", "--output", "/tmp/x", "--service", "http://127.0.0.1:1", "--vectors", vectors)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_images_have_dense_vectors_only(place: Place, capsys: pytest.CaptureFixture[str]) -> None:
    glob = write_corpus(place, "jsonl", [[("d-0", "data:image/png;base64,AAAA")]])
    args = plan_args(glob, "jsonl", place.url("out"), 10)
    args[args.index("--text-field")] = "--image-field"
    assert run(*args)[0] == 0
    code, _ = run(
        "work", "--output", place.url("out"), "--service", "http://127.0.0.1:1", "--index", "0",
        "--vectors", "sparse",
    )  # fmt: skip
    assert code == 2
    assert "images have dense vectors only" in capsys.readouterr().err
    assert place.files("out/parts") == []


@pytest.mark.slow
def test_an_input_type_the_service_refuses_is_refused_with_exit_2_not_per_row(
    place: Place, minilm_server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    plan(place, [TEXTS[0], TEXTS[1], TEXTS[4]], 10)
    assert work(place, minilm_server, 0, "--input-type", "no_such_side") == 2
    assert "refused input_type 'no_such_side'" in capsys.readouterr().err
    assert place.files("out/parts") == [] and place.files("out/errors") == []
    # One the model takes (its search_query selects no prompt here) embeds every row.
    assert work(place, minilm_server, 0, "--input-type", "search_query") == 0
    assert part(place, 0).num_rows == 3


@pytest.mark.slow
def test_a_splade_job_keeps_the_sparse_vectors_the_api_gives(
    place: Place, splade: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    texts: list[str | None] = [TEXTS[0], TEXTS[1], TEXTS[2]]
    assert plan(place, texts, 10) == 1
    assert work(place, splade, 0, "--vectors", "sparse") == 0, capsys.readouterr().err
    table = part(place, 0)
    assert table.schema.names == ["doc_id", "sparse"]
    assert table.schema.metadata[b"vectors"] == b"sparse"
    assert b"dimensions" not in table.schema.metadata  # no dense vector to size
    want = post(splade, "/pooling", {"input": texts, "task": "sparse"})["data"]
    for got, answer in zip(table.column("sparse").to_pylist(), want, strict=True):
        assert got["indices"] and got["indices"] == answer["data"]["indices"]
        assert_same_sparse_values(got["values"], answer["data"]["values"])


@pytest.mark.slow
def test_a_job_of_a_model_loaded_in_the_worker_keeps_the_same_outputs(
    place: Place, bge_m3: RunningServer, bge_m3_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--local`` (an EmbeddingJob's spec.model) with ``--vectors``: the in-process server
    answers /info and /v2/embed as the service does, so the part is the service's."""
    texts: list[str | None] = [TEXTS[0], TEXTS[1], TEXTS[4]]
    assert plan(place, texts, 10) == 1
    code, _ = run(
        "work", "--output", place.url("out"), "--index", "0", "--local",
        "--model", str(bge_m3_dir), "--dtype", "float32", "--vectors", ALL,
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    local = part(place, 0)
    for name in place.files("out/parts"):
        place.fs.delete_file(f"{place.root}/out/parts/{name}")
    assert work(place, bge_m3, 0, "--vectors", ALL) == 0
    served = part(place, 0)
    assert local.schema.remove_metadata() == served.schema.remove_metadata()
    for mine, theirs in zip(local.to_pylist(), served.to_pylist(), strict=True):
        assert mine["doc_id"] == theirs["doc_id"]
        assert cosines(np.array(mine["embedding"]), np.array(theirs["embedding"])) >= MIN_COSINE
        assert mine["sparse"]["indices"] == theirs["sparse"]["indices"]
        assert_same_sparse_values(mine["sparse"]["values"], theirs["sparse"]["values"])
        got, want = np.array(mine["multi_vector"]), np.array(theirs["multi_vector"])
        assert got.shape == want.shape and cosines(got, want).min() >= MIN_COSINE


class StubSparse(JsonHandler):
    """A SPLADE service as the worker sees it: ``/info`` (task sparse) and ``/v2/embed``
    answering one sparse vector per text, with the ``fingerprints`` one per request in turn."""

    fingerprints: list[str] = []
    requests = 0

    def do_GET(self) -> None:
        info = {"served_model_name": "stub-splade", "task": "sparse", "outputs": []}
        self._send(200 if self.path == "/info" else 404, info if self.path == "/info" else {}, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.requests += 1
        assert self.path == "/v2/embed" and body["embedding_types"] == ["sparse"]
        sparse = [{"indices": [1, 7], "values": [0.5, 0.25]} for _ in body["texts"]]
        fingerprint = cls.fingerprints[cls.requests % len(cls.fingerprints)]
        answer = {"embeddings": {"sparse": sparse}, "response_type": "embeddings_by_type"}
        self._send(200, answer, {"X-Embedding-Fingerprint": fingerprint})


@contextlib.contextmanager
def stub_sparse(fingerprints: list[str]) -> Iterator[str]:
    with serving(type("Stub", (StubSparse,), {"fingerprints": fingerprints})) as url:
        yield url


def test_sparse_vectors_of_two_computations_are_not_committed(
    place: Place, capsys: pytest.CaptureFixture[str]
) -> None:
    """As for dense vectors: two fingerprints in one shard exit 1 uncommitted; one throughout
    commits, the model named by the service's /info (a /v2/embed answer names none)."""
    plan(place, [f"text {n}" for n in range(6)], 10)
    args = ["--vectors", "sparse", "--batch-size", "2"]
    with stub_sparse(["fp-a", "fp-b"]) as url:
        code, _ = run("work", "--output", place.url("out"), "--service", url, "--index", "0", *args)
    assert code == 1
    assert "two computations in one shard" in capsys.readouterr().err
    assert place.files("out/parts") == []
    with stub_sparse(["fp-a"]) as url:
        code, _ = run("work", "--output", place.url("out"), "--service", url, "--index", "0", *args)
    assert code == 0
    table = part(place, 0)
    assert table.schema.metadata[b"fingerprint"] == b"fp-a"
    assert table.schema.metadata[b"model"] == b"stub-splade"
    assert table.column("sparse").to_pylist() == [{"indices": [1, 7], "values": [0.5, 0.25]}] * 6


@pytest.mark.slow
@pytest.mark.parametrize("output_format", ["parquet", "jsonl"])
def test_a_committed_part_of_other_vectors_is_refused_not_skipped(
    place: Place, bge_m3: RunningServer, capsys: pytest.CaptureFixture[str], output_format: str
) -> None:
    # A second job to the same output asking for other outputs would otherwise skip the shard
    # as done, and the user would find parts without the columns the job asked for.
    assert plan(place, [TEXTS[0], TEXTS[1]], 10, "--output-format", output_format) == 1
    assert work(place, bge_m3, 0, "--vectors", "dense,sparse") == 0, capsys.readouterr()
    name = f"out/parts/part-000000.{output_format}"
    committed = place.read(name)
    capsys.readouterr()
    assert work(place, bge_m3, 0, "--vectors", ALL) == 2
    err = capsys.readouterr().err
    assert "holds dense,sparse" in err and "new output" in err, err
    assert place.read(name) == committed  # left as it was
    # The same vectors again: the shard is done, skipped.
    assert work(place, bge_m3, 0, "--vectors", "dense,sparse") == 0
    assert place.read(name) == committed

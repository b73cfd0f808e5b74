"""A shard's output: ``OUTPUT/parts/part-NNNNNN.parquet`` (or ``.jsonl``) and its errors file,
committed once.

A Parquet part holds the shard's embedded rows: the id column, named and typed as the input
has it, and ``embedding``, a ``fixed_size_list<float32>`` of the model's dimensions; its file
metadata says which computation made them (``model``, and ``fingerprint`` when the server
sends one; ``dimensions``, ``shard``).

A job that keeps other outputs (``vectors``: any of ``dense``, ``sparse``, ``multi_vector``,
:mod:`.embedder`) has a column for each, after the id, in that order, and only those:

* ``embedding`` (dense), as above;
* ``sparse``, a ``struct<indices: list<int32>, values: list<float32>>``: token ids ascending
  and their weights, as the API answers them. One column of both lists, not two columns,
  keeps a row's ids and weights together (no reader can take one without the other) and is
  the shape the stores take a sparse vector in: Qdrant's ``SparseVector(indices, values)``,
  Milvus' and Pinecone's ``{indices, values}``, a ``scipy.sparse`` row's ``indices`` and
  ``data``; pyarrow's ``struct.field("indices")`` gets either list without copying;
* ``multi_vector``, a ``list<fixed_size_list<float32, width>>``: a text's per-token vectors
  (bge-m3: every token but the first; ColBERT: as its checkpoint marks them), the type
  LanceDB indexes as a multivector column.

The metadata's ``vectors`` lists the outputs the part holds (``dense,sparse,multi_vector``),
and ``multi_vector_dimensions`` the width of a multi-vector where the part has them. A shard
none of whose rows could be embedded still has a part of the same schema (the widths come
from a probe's answer).

A JSONL part (the job's output format ``jsonl``) holds one line per embedded row in the
OpenAI batch output format, as ``run-batch`` writes its answers (the same encoder,
:func:`~embedding_server.batch.lines.response_line`): ``{"id": "batch_req_<shard>_<row>",
"custom_id": "<the row's id as a string>", "response": {"status_code": 200, "request_id",
"fingerprint", "body": {"object": "list", "data": [{"object": "embedding", "index": 0,
"embedding": [floats]}], "model"}}, "error": null}``. ``row`` is the row's number in its
input file, as the errors file counts it; ``request_id`` is the service's for the request
that embedded the row (rows of one request share it); ``fingerprint`` sits where
``run-batch`` puts it. There is no ``usage``: a request's tokens are not known per row.
A job that keeps other outputs than ``dense`` has them from ``/v2/embed``, so its lines' body
is that row's answer there: ``{"response_type": "embeddings_by_type", "embeddings": {"float":
[[floats]], "sparse": [{"indices", "values"}], "multi_vector": [[[floats]]]}, "model"}``,
with the types the job asks for (dense as ``float``).

Rows that could not be embedded (the API refused them, or the row had no text) are listed in
``OUTPUT/errors/part-NNNNNN.jsonl``, one ``{"id", "file", "row", "error"}`` a line, whatever
the part's format.

The part is the commit: a shard is done exactly when its part exists. The errors file is
committed first, so a part is never without its errors; a worker killed between the two
leaves an errors file that the next attempt replaces. Both go through
:func:`~embedding_server.batch.storage.commit_bytes`: whole, or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from embedding_server.batch.embedder import DENSE_ONLY, VECTORS, SparseVector, Vector
from embedding_server.batch.lines import ID_PREFIX, response_line
from embedding_server.batch.plan import OutputFormat
from embedding_server.batch.storage import Location, commit_bytes

PARTS_FOLDER = "parts"
ERRORS_FOLDER = "errors"
EMBEDDING_COLUMN = "embedding"
SPARSE_COLUMN = "sparse"
MULTI_VECTOR_COLUMN = "multi_vector"
SPARSE_TYPE = pa.struct([("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float32()))])


@dataclass(frozen=True)
class PartCounts:
    """What a committed shard holds: rows embedded, and rows in its errors file."""

    rows: int
    failed: int
    vectors: tuple[str, ...] | None = None
    """The outputs a committed part holds (its metadata's ``vectors``, dense for a part
    written before there were others; a JSONL part's first line), None when it tells none."""


@dataclass(frozen=True)
class Provenance:
    model: str | None
    fingerprint: str | None
    shard: int
    dimensions: int | None = None
    """The vector size when the shard has no vector to tell it (none of its rows embedded)."""
    vectors: tuple[Vector, ...] = DENSE_ONLY
    """The outputs the part holds."""
    multi_vector_dimensions: int | None = None
    """The multi-vectors' width when the shard has none to tell it."""


@dataclass(frozen=True)
class OtherOutputs:
    """By position, a shard's outputs but its dense vectors: empty lists for those the job
    does not keep."""

    sparse: list[SparseVector | None] = field(default_factory=list)
    multi_vectors: list[np.ndarray | None] = field(default_factory=list)


@dataclass(frozen=True)
class RowsPlace:
    """Where a shard's rows are, for the lines of a JSONL part: the first row's number in
    its input file, and by position the service's request id of the request that embedded
    the row."""

    first_row: int = 0
    request_ids: list[str | None] | None = None


class ShardOutput:
    """The part and errors file of shard ``index`` under the job's output prefix."""

    def __init__(self, output: Location, index: int, fmt: OutputFormat = "parquet") -> None:
        name = f"part-{index:06d}"
        self.output = output
        self.index = index
        self.format = fmt
        self.part = output.child(PARTS_FOLDER, f"{name}.{fmt}")
        self.errors = output.child(ERRORS_FOLDER, f"{name}.jsonl")

    def committed(self) -> PartCounts | None:
        """The counts of the committed part, None when the shard is not done. A JSONL part's
        rows are its lines (it is committed whole, so its last line is never torn)."""
        if not self.part.exists():
            return None
        vectors: tuple[str, ...] | None = None
        if self.format == "jsonl":
            data = self.part.read_bytes()
            rows = data.count(b"\n")
            if rows:
                vectors = _jsonl_vectors(data[: data.index(b"\n")])
        else:
            with self.part.fs.open_input_file(self.part.path) as source:
                meta = pq.read_metadata(source)
            rows = meta.num_rows
            written = (meta.metadata or {}).get(b"vectors", b"dense").decode()
            vectors = tuple(written.split(","))
        failed = self.errors.read_bytes().count(b"\n") if self.errors.exists() else 0
        return PartCounts(rows, failed, vectors)

    def commit(
        self,
        ids: pa.Array,
        id_field: str,
        vectors: list[np.ndarray | None],
        errors: list[dict[str, Any]],
        provenance: Provenance,
        place: RowsPlace | None = None,
        others: OtherOutputs | None = None,
    ) -> PartCounts:
        """Write the errors file (or remove an earlier attempt's), then the part. A row is
        in the part when it has every output of ``provenance.vectors``."""
        columns = _Columns.of(vectors, others or OtherOutputs(), provenance.vectors)
        if self.format == "jsonl":
            data, rows = _jsonl_part(ids, columns, provenance, place or RowsPlace())
        else:
            data, rows = _parquet_part(ids, id_field, columns, provenance)
        if errors:
            lines = b"".join(orjson.dumps(error) + b"\n" for error in errors)
            commit_bytes(self.errors, lines, self.output)
        else:
            self.errors.delete()
        commit_bytes(self.part, data, self.output)
        return PartCounts(rows, len(errors))


@dataclass(frozen=True)
class _Columns:
    """A shard's requested outputs by position, and which rows have them all."""

    vectors: tuple[Vector, ...]
    dense: list[np.ndarray | None]
    sparse: list[SparseVector | None]
    multi_vectors: list[np.ndarray | None]
    mask: list[bool]

    @classmethod
    def of(
        cls, dense: list[np.ndarray | None], others: OtherOutputs, vectors: tuple[Vector, ...]
    ) -> _Columns:
        count = len(dense)
        none: list[Any] = [None] * count
        sparse: list[SparseVector | None] = others.sparse if "sparse" in vectors else none
        multi: list[np.ndarray | None] = others.multi_vectors if "multi_vector" in vectors else none
        if len(sparse) != count or len(multi) != count:
            raise ValueError("a shard's outputs of different lengths")
        wanted: list[list[Any]] = []
        if "dense" in vectors:
            wanted.append(list(dense))
        if "sparse" in vectors:
            wanted.append(list(sparse))
        if "multi_vector" in vectors:
            wanted.append(list(multi))
        mask = [all(value is not None for value in row) for row in zip(*wanted, strict=True)]
        return cls(vectors, dense, sparse, multi, mask)

    def kept(self, values: list[Any]) -> list[Any]:
        return [value for value, keep in zip(values, self.mask, strict=True) if keep]


def _parquet_part(
    ids: pa.Array, id_field: str, columns: _Columns, provenance: Provenance
) -> tuple[bytes, int]:
    """The Parquet part's bytes and its rows."""
    metadata = {"shard": str(provenance.shard), "vectors": ",".join(columns.vectors)}
    data: dict[str, pa.Array] = {id_field: ids.filter(pa.array(columns.mask, pa.bool_()))}
    if "dense" in columns.vectors:
        data[EMBEDDING_COLUMN], dimensions = _dense_array(
            columns.kept(columns.dense), provenance.dimensions
        )
        metadata["dimensions"] = str(dimensions)
    if "sparse" in columns.vectors:
        data[SPARSE_COLUMN] = _sparse_array(columns.kept(columns.sparse))
    if "multi_vector" in columns.vectors:
        data[MULTI_VECTOR_COLUMN], width = _multi_vector_array(
            columns.kept(columns.multi_vectors), provenance.multi_vector_dimensions
        )
        metadata["multi_vector_dimensions"] = str(width)
    if provenance.model is not None:
        metadata["model"] = provenance.model
    if provenance.fingerprint is not None:
        metadata["fingerprint"] = provenance.fingerprint
    table = pa.table(data).replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes(), table.num_rows


def _dense_array(kept: list[np.ndarray], dimensions: int | None) -> tuple[pa.Array, int]:
    """``fixed_size_list<float32, dimensions>``, and the dimensions."""
    size = int(kept[0].shape[0]) if kept else (dimensions or 0)
    if any(vector.shape[0] != size for vector in kept):
        raise ValueError("the service answered vectors of different sizes in one shard")
    flat = np.concatenate(kept).astype("<f4", copy=False) if kept else np.zeros(0, "<f4")
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), size), size


def _sparse_array(kept: list[SparseVector]) -> pa.Array:
    """``struct<indices: list<int32>, values: list<float32>>``."""
    offsets = np.zeros(len(kept) + 1, dtype=np.int32)
    np.cumsum([len(v.indices) for v in kept], out=offsets[1:])
    indices = np.concatenate([v.indices for v in kept]) if kept else np.zeros(0, np.int32)
    values = np.concatenate([v.values for v in kept]) if kept else np.zeros(0, np.float32)
    if len(indices) != len(values):
        raise ValueError("the service answered a sparse vector of more indices than values")
    offsets_array = pa.array(offsets, pa.int32())
    return pa.StructArray.from_arrays(
        [
            pa.ListArray.from_arrays(offsets_array, pa.array(indices.astype(np.int32))),
            pa.ListArray.from_arrays(offsets_array, pa.array(values.astype(np.float32))),
        ],
        fields=list(SPARSE_TYPE),
    )


def _multi_vector_array(kept: list[np.ndarray], width: int | None) -> tuple[pa.Array, int]:
    """``list<fixed_size_list<float32, width>>``, and the width."""
    size = next((int(m.shape[1]) for m in kept if m.shape[0]), width or 0)
    if any(m.shape[0] and m.shape[1] != size for m in kept):
        raise ValueError("the service answered multi-vectors of different widths in one shard")
    offsets = np.zeros(len(kept) + 1, dtype=np.int32)
    np.cumsum([m.shape[0] for m in kept], out=offsets[1:])
    flat = (
        np.concatenate([m.reshape(-1) for m in kept]).astype("<f4", copy=False)
        if kept
        else np.zeros(0, "<f4")
    )
    rows = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), size)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), rows), size


def _jsonl_part(
    ids: pa.Array, columns: _Columns, provenance: Provenance, place: RowsPlace
) -> tuple[bytes, int]:
    """The JSONL part's bytes and its rows: one batch output line per embedded row."""
    lines: list[bytes] = []
    model = provenance.model
    for position, row_id in enumerate(ids.to_pylist()):
        if not columns.mask[position]:
            continue
        row = place.first_row + position
        line_id = f"{ID_PREFIX}{provenance.shard}_{row}"
        body = _jsonl_body(columns, position, model)
        request_id = place.request_ids[position] if place.request_ids else None
        lines.append(
            response_line(
                line_id,
                str(row_id),
                200,
                request_id or line_id,
                orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
                fingerprint=provenance.fingerprint,
            )
        )
    return b"".join(lines), len(lines)


def _jsonl_vectors(line: bytes) -> tuple[str, ...] | None:
    """The outputs a JSONL part's line holds: its body's ``embeddings`` types (``float`` is
    dense) or ``/v1/embeddings``' dense ``data``; None for a line that says neither."""
    try:
        body = orjson.loads(line)["response"]["body"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if isinstance(body, dict) and isinstance(body.get("embeddings"), dict):
        held = {"dense" if kind == "float" else kind for kind in body["embeddings"]}
        return tuple(vector for vector in VECTORS if vector in held)
    return DENSE_ONLY if isinstance(body, dict) and "data" in body else None


def _jsonl_body(columns: _Columns, position: int, model: str | None) -> dict[str, Any]:
    """A row's answer as its endpoint gives it: ``/v1/embeddings``' for dense vectors alone,
    ``/v2/embed``'s ``embeddings_by_type`` for the others."""
    if columns.vectors == DENSE_ONLY:
        vector = columns.dense[position]
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": vector}],
            "model": model,
        }
    embeddings: dict[str, Any] = {}
    if "dense" in columns.vectors:
        embeddings["float"] = [columns.dense[position]]
    sparse = columns.sparse[position]
    if sparse is not None:
        embeddings["sparse"] = [{"indices": sparse.indices, "values": sparse.values}]
    multi = columns.multi_vectors[position]
    if multi is not None:
        embeddings["multi_vector"] = [multi]
    return {"response_type": "embeddings_by_type", "embeddings": embeddings, "model": model}

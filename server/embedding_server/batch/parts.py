"""A shard's output: ``OUTPUT/parts/part-NNNNNN.parquet`` (or ``.jsonl``) and its errors file,
committed once.

A Parquet part holds the shard's embedded rows: the id column, named and typed as the input
has it, and ``embedding``, a ``fixed_size_list<float32>`` of the model's dimensions; its file
metadata says which computation made them (``model``, and ``fingerprint`` when the server
sends one; ``dimensions``, ``shard``).

A JSONL part (the job's output format ``jsonl``) holds one line per embedded row in the
OpenAI batch output format, as ``run-batch`` writes its answers (the same encoder,
:func:`~embedding_server.batch.lines.response_line`): ``{"id": "batch_req_<shard>_<row>",
"custom_id": "<the row's id as a string>", "response": {"status_code": 200, "request_id",
"fingerprint", "body": {"object": "list", "data": [{"object": "embedding", "index": 0,
"embedding": [floats]}], "model"}}, "error": null}``. ``row`` is the row's number in its
input file, as the errors file counts it; ``request_id`` is the service's for the request
that embedded the row (rows of one request share it); ``fingerprint`` sits where
``run-batch`` puts it. There is no ``usage``: a request's tokens are not known per row.

Rows that could not be embedded (the API refused them, or the row had no text) are listed in
``OUTPUT/errors/part-NNNNNN.jsonl``, one ``{"id", "file", "row", "error"}`` a line, whatever
the part's format.

The part is the commit: a shard is done exactly when its part exists. The errors file is
committed first, so a part is never without its errors; a worker killed between the two
leaves an errors file that the next attempt replaces. Both go through
:func:`~embedding_server.batch.storage.commit_bytes`: whole, or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from embedding_server.batch.lines import ID_PREFIX, response_line
from embedding_server.batch.plan import OutputFormat
from embedding_server.batch.storage import Location, commit_bytes

PARTS_FOLDER = "parts"
ERRORS_FOLDER = "errors"
EMBEDDING_COLUMN = "embedding"


@dataclass(frozen=True)
class PartCounts:
    """What a committed shard holds: rows embedded, and rows in its errors file."""

    rows: int
    failed: int


@dataclass(frozen=True)
class Provenance:
    model: str | None
    fingerprint: str | None
    shard: int
    dimensions: int | None = None
    """The vector size when the shard has no vector to tell it (none of its rows embedded)."""


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
        if self.format == "jsonl":
            rows = self.part.read_bytes().count(b"\n")
        else:
            with self.part.fs.open_input_file(self.part.path) as source:
                rows = pq.read_metadata(source).num_rows
        failed = self.errors.read_bytes().count(b"\n") if self.errors.exists() else 0
        return PartCounts(rows, failed)

    def commit(
        self,
        ids: pa.Array,
        id_field: str,
        vectors: list[np.ndarray | None],
        errors: list[dict[str, Any]],
        provenance: Provenance,
        place: RowsPlace | None = None,
    ) -> PartCounts:
        """Write the errors file (or remove an earlier attempt's), then the part."""
        if self.format == "jsonl":
            data, rows = _jsonl_part(ids, vectors, provenance, place or RowsPlace())
        else:
            data, rows = _parquet_part(ids, id_field, vectors, provenance)
        if errors:
            lines = b"".join(orjson.dumps(error) + b"\n" for error in errors)
            commit_bytes(self.errors, lines, self.output)
        else:
            self.errors.delete()
        commit_bytes(self.part, data, self.output)
        return PartCounts(rows, len(errors))


def _parquet_part(
    ids: pa.Array, id_field: str, vectors: list[np.ndarray | None], provenance: Provenance
) -> tuple[bytes, int]:
    """The Parquet part's bytes and its rows."""
    mask = [vector is not None for vector in vectors]
    kept = [vector for vector in vectors if vector is not None]
    dimensions = int(kept[0].shape[0]) if kept else (provenance.dimensions or 0)
    if any(vector.shape[0] != dimensions for vector in kept):
        raise ValueError("the service answered vectors of different sizes in one shard")
    flat = np.concatenate(kept).astype("<f4", copy=False) if kept else np.zeros(0, "<f4")
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), dimensions)
    metadata = {"dimensions": str(dimensions), "shard": str(provenance.shard)}
    if provenance.model is not None:
        metadata["model"] = provenance.model
    if provenance.fingerprint is not None:
        metadata["fingerprint"] = provenance.fingerprint
    table = pa.table(
        {id_field: ids.filter(pa.array(mask, pa.bool_())), EMBEDDING_COLUMN: embedding}
    ).replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes(), table.num_rows


def _jsonl_part(
    ids: pa.Array, vectors: list[np.ndarray | None], provenance: Provenance, place: RowsPlace
) -> tuple[bytes, int]:
    """The JSONL part's bytes and its rows: one batch output line per embedded row."""
    lines: list[bytes] = []
    model = provenance.model
    for position, (row_id, vector) in enumerate(zip(ids.to_pylist(), vectors, strict=True)):
        if vector is None:
            continue
        row = place.first_row + position
        line_id = f"{ID_PREFIX}{provenance.shard}_{row}"
        body: dict[str, Any] = {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": vector}],
            "model": model,
        }
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

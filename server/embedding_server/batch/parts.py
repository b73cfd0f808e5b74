"""A shard's output: ``OUTPUT/parts/part-NNNNNN.parquet`` and its errors file, committed once.

The part holds the shard's embedded rows: the id column, named and typed as the input has
it, and ``embedding``, a ``fixed_size_list<float32>`` of the model's dimensions; its file
metadata says which computation made them (``model``, and ``fingerprint`` when the server
sends one; ``dimensions``, ``shard``). Rows that could not be embedded (the API refused
them, or the row had no text) are listed in ``OUTPUT/errors/part-NNNNNN.jsonl``, one
``{"id", "file", "row", "error"}`` a line.

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


class ShardOutput:
    """The part and errors file of shard ``index`` under the job's output prefix."""

    def __init__(self, output: Location, index: int) -> None:
        name = f"part-{index:06d}"
        self.output = output
        self.index = index
        self.part = output.child(PARTS_FOLDER, f"{name}.parquet")
        self.errors = output.child(ERRORS_FOLDER, f"{name}.jsonl")

    def committed(self) -> PartCounts | None:
        """The counts of the committed part, None when the shard is not done."""
        if not self.part.exists():
            return None
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
    ) -> PartCounts:
        """Write the errors file (or remove an earlier attempt's), then the part."""
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
        if errors:
            lines = b"".join(orjson.dumps(error) + b"\n" for error in errors)
            commit_bytes(self.errors, lines, self.output)
        else:
            self.errors.delete()
        commit_bytes(self.part, sink.getvalue().to_pybytes(), self.output)
        return PartCounts(table.num_rows, len(errors))

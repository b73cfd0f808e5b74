"""A corpus's files, in the three formats a job reads: how each is cut into shards (when the
plan is made) and how one shard's rows are read back (by the worker that takes it).

- **Parquet**: a shard is a range of row groups, about ``shard_rows`` rows (a row group is
  never split: it is Parquet's unit of reading). Only the id and text columns are read.
- **JSONL**: one object per line; a shard is a range of rows, and the plan keeps the byte
  offset of its first row, so a worker reads only its own bytes.
- **CSV**: a header row, then rows; a shard is a range of rows. CSV rows may hold quoted
  newlines, so a byte offset cannot be known without parsing: a worker parses the file from
  its start up to its shard (split a large CSV corpus into files, or use Parquet). Every
  value is read as text, the id too.

The embedded column is a text, or for a job of images (``--image-field``) an image URL (http,
https or ``data:``). A row whose text or image is missing or not a string, or whose id is
missing, is a row problem, not an error: the worker lists it in the shard's errors file, and
the shard goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from embedding_server.batch.storage import Location

Format = Literal["parquet", "jsonl", "csv"]
FIELD_CHECK_ROWS = 1000
"""JSONL: a plan is refused when none of a file's first rows has the id or text field."""
FORMATS: tuple[Format, ...] = ("parquet", "jsonl", "csv")
IMAGE_URL_PREFIXES = ("http://", "https://", "data:")
"""What an image field's value starts with: the URLs ``/v1/embeddings`` takes for images."""


class CorpusError(Exception):
    """A file that cannot be read as the corpus it was said to be (a missing field, a bad
    header, ids of mixed types): the job cannot run as asked."""


@dataclass(frozen=True)
class Shard:
    """One worker's part of the corpus: ``range`` of ``file``, in row groups (Parquet) or
    rows (JSONL, CSV), ``rows`` rows in all; ``offset``: the first row's byte (JSONL)."""

    file: str
    range: tuple[int, int]
    rows: int
    offset: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "range": list(self.range), "rows": self.rows}
        if self.offset is not None:
            out["offset"] = self.offset
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Shard:
        start, stop = data["range"]
        return cls(
            str(data["file"]), (int(start), int(stop)), int(data["rows"]), data.get("offset")
        )


@dataclass(frozen=True)
class Fields:
    """The id column and the column embedded: a text, or an image (``image``: an http(s) URL
    or a ``data:`` URL string, for a service that takes images)."""

    id: str
    content: str
    image: bool = False

    @property
    def role(self) -> str:
        """What the content column holds, as the refusals name it."""
        return "image" if self.image else "text"


@dataclass
class ShardRows:
    """A shard as read: the ids (an Arrow array, typed as the file has them), the texts (or
    the image URLs), and the rows that cannot be embedded (position in the shard -> the
    reason)."""

    ids: pa.Array
    texts: list[str | None]
    problems: dict[int, str] = field(default_factory=dict)
    first_row: int = 0
    """The shard's first row, counted in its file (for the errors file)."""


def cut(location: Location, fmt: Format, fields: Fields, shard_rows: int) -> list[Shard]:
    """The shards of one file, in order. :class:`CorpusError` when the fields are not there."""
    if fmt == "parquet":
        return _cut_parquet(location, fields, shard_rows)
    if fmt == "jsonl":
        return _cut_jsonl(location, fields, shard_rows)
    return _cut_csv(location, fields, shard_rows)


def read(location: Location, fmt: Format, fields: Fields, shard: Shard) -> ShardRows:
    """The rows of ``shard`` (a shard of ``location``)."""
    if fmt == "parquet":
        return _read_parquet(location, fields, shard)
    if fmt == "jsonl":
        return _read_jsonl(location, fields, shard)
    return _read_csv(location, fields, shard)


def _ranges(total: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, size):
        yield start, min(total, start + size)


def _parquet_file(location: Location) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(location.fs.open_input_file(location.path))
    except pa.ArrowInvalid as error:
        raise CorpusError(f"{location.url}: not a Parquet file: {error}") from None


def _check_columns(location: Location, names: list[str], fields: Fields) -> None:
    for role, name in (("id", fields.id), (fields.role, fields.content)):
        if name not in names:
            raise CorpusError(
                f"{location.url}: no {role} field {name!r} (its columns: {', '.join(names)})"
            )


def _cut_parquet(location: Location, fields: Fields, shard_rows: int) -> list[Shard]:
    parquet = _parquet_file(location)
    _check_columns(location, parquet.schema_arrow.names, fields)
    metadata = parquet.metadata
    shards: list[Shard] = []
    start = rows = 0
    for group in range(metadata.num_row_groups):
        rows += metadata.row_group(group).num_rows
        if rows >= shard_rows:
            shards.append(Shard(location.url, (start, group + 1), rows))
            start, rows = group + 1, 0
    if start < metadata.num_row_groups and rows:
        shards.append(Shard(location.url, (start, metadata.num_row_groups), rows))
    return shards


def _read_parquet(location: Location, fields: Fields, shard: Shard) -> ShardRows:
    parquet = _parquet_file(location)
    table = parquet.read_row_groups(
        list(range(*shard.range)), columns=list(dict.fromkeys([fields.id, fields.content]))
    )
    ids = table.column(fields.id).combine_chunks()
    texts = table.column(fields.content).to_pylist()
    first = sum(parquet.metadata.row_group(g).num_rows for g in range(shard.range[0]))
    rows = ShardRows(ids, [], first_row=first)
    for position, (row_id, text) in enumerate(zip(ids.to_pylist(), texts, strict=True)):
        rows.texts.append(_row_text(rows, position, row_id, text, fields))
    return rows


def _row_text(rows: ShardRows, position: int, row_id: Any, text: Any, fields: Fields) -> str | None:
    """``text`` (or the image URL) when the row can be embedded; else None, with the reason
    noted. An image must be an http(s) or ``data:`` URL, as the API takes them: anything
    else is the row's problem before a request is spent on it."""
    if row_id is None:
        rows.problems[position] = f"the row has no id (field {fields.id!r})"
        return None
    if not isinstance(text, str):
        what = "no" if text is None else f"a {type(text).__name__}, not a string, as"
        rows.problems[position] = f"the row has {what} {fields.role} (field {fields.content!r})"
        return None
    if fields.image and not text.startswith(IMAGE_URL_PREFIXES):
        rows.problems[position] = (
            f"the row's image (field {fields.content!r}) is not an http://, https:// or data: "
            f"URL: {text[:60]!r}"
        )
        return None
    return text


def _cut_jsonl(location: Location, fields: Fields, shard_rows: int) -> list[Shard]:
    shards: list[Shard] = []
    start_offset, rows, index = 0, 0, 0
    sampled: list[bytes] = []
    for position, line in location.lines():
        if not line.strip():
            continue
        if index < FIELD_CHECK_ROWS:
            sampled.append(line)
        if rows == 0:
            start_offset = position
        rows += 1
        index += 1
        if rows == shard_rows:
            shards.append(Shard(location.url, (index - rows, index), rows, start_offset))
            rows = 0
    if rows:
        shards.append(Shard(location.url, (index - rows, index), rows, start_offset))
    _check_sampled_objects(location, sampled, fields)
    return shards


def _check_sampled_objects(location: Location, lines: list[bytes], fields: Fields) -> None:
    """Refuse the file when none of its first rows has the id or the content field (a misspelt
    flag, most likely); one row without them is that row's problem, not the file's."""
    if not lines:
        return
    seen: dict[str, None] = {}
    for line in lines:
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(row, dict):
            seen.update(dict.fromkeys(row))
    if not seen:
        raise CorpusError(f"{location.url}: none of the first {len(lines)} rows is a JSON object")
    for role, name in (("id", fields.id), (fields.role, fields.content)):
        if name not in seen:
            raise CorpusError(
                f"{location.url}: no {role} field {name!r} in the first {len(lines)} rows "
                f"(their fields: {', '.join(list(seen)[:20])})"
            )


def _read_jsonl(location: Location, fields: Fields, shard: Shard) -> ShardRows:
    ids: list[Any] = []
    rows = ShardRows(pa.array([]), [], first_row=shard.range[0])
    for _, line in location.lines(shard.offset or 0):
        if len(ids) == shard.rows:
            break
        if not line.strip():
            continue
        position = len(ids)
        problem = "the row is not a JSON object"
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            row, problem = None, f"the row is not JSON: {error}"
        if not isinstance(row, dict):
            ids.append(None)
            rows.texts.append(None)
            rows.problems[position] = problem
            continue
        row_id = row.get(fields.id)
        if row_id is not None and not isinstance(row_id, (str, int)):
            rows.problems[position] = (
                f"the row's id (field {fields.id!r}) is not a string or integer"
            )
            ids.append(None)
            rows.texts.append(None)
            continue
        ids.append(row_id)
        rows.texts.append(_row_text(rows, position, row_id, row.get(fields.content), fields))
    try:
        rows.ids = pa.array(ids)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise CorpusError(
            f"{location.url}: the ids (field {fields.id!r}) of rows {shard.range[0]} to "
            f"{shard.range[1]} mix strings and integers; give them one type"
        ) from None
    return rows


def _csv_batches(location: Location, fields: Fields) -> Iterator[pa.RecordBatch]:
    names = list(dict.fromkeys([fields.id, fields.content]))
    options = pacsv.ConvertOptions(
        include_columns=names, column_types=dict.fromkeys(names, pa.string())
    )
    stream = location.fs.open_input_stream(location.path)
    try:
        try:
            reader = pacsv.open_csv(stream, convert_options=options)
        except (pa.ArrowInvalid, KeyError) as error:
            raise CorpusError(f"{location.url}: {_csv_problem(error, fields)}") from None
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as error:
                raise CorpusError(f"{location.url}: not CSV as expected: {error}") from None
            yield batch
    finally:
        stream.close()


def _csv_problem(error: Exception, fields: Fields) -> str:
    message = str(error)
    for role, name in (("id", fields.id), (fields.role, fields.content)):
        if f"'{name}'" in message:
            return f"no {role} field {name!r} in the CSV header"
    return f"not CSV as expected: {message}"


def _cut_csv(location: Location, fields: Fields, shard_rows: int) -> list[Shard]:
    total = sum(batch.num_rows for batch in _csv_batches(location, fields))
    return [
        Shard(location.url, (start, stop), stop - start)
        for start, stop in _ranges(total, shard_rows)
    ]


def _read_csv(location: Location, fields: Fields, shard: Shard) -> ShardRows:
    start, stop = shard.range
    pieces: list[pa.RecordBatch] = []
    seen = 0
    for batch in _csv_batches(location, fields):
        lo, hi = max(start - seen, 0), min(stop - seen, batch.num_rows)
        if lo < hi:
            pieces.append(batch.slice(lo, hi - lo))
        seen += batch.num_rows
        if seen >= stop:
            break
    ids = (
        pa.concat_arrays([p.column(fields.id) for p in pieces])
        if pieces
        else pa.array([], pa.string())
    )
    texts = [t for p in pieces for t in p.column(fields.content).to_pylist()]
    rows = ShardRows(ids, [], first_row=start)
    for position, (row_id, text) in enumerate(zip(ids.to_pylist(), texts, strict=True)):
        rows.texts.append(_row_text(rows, position, row_id, text, fields))
    return rows

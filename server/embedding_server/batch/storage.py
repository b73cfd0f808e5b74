"""Where a job's files live: local paths and ``s3://`` URLs, through ``pyarrow.fs``.

A URL becomes a :class:`Location`, a ``pyarrow.fs`` filesystem and a path in it, so the
readers and writers above never ask which store they talk to. S3 takes the standard AWS
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``); an explicit endpoint (``--s3-endpoint``) wins over
``AWS_ENDPOINT_URL``, for S3-compatible stores.

:func:`commit_bytes` is the one way a job makes a file visible, whole or not at all:

- local: a temporary file beside the target, fsync, ``os.replace``, fsync of the folder;
- S3: the object is first uploaded under ``_tmp/`` beside the output, its size checked, then
  copied to its name with one server-side ``CopyObject`` (atomic: the object appears whole).
  Not a direct upload to the name: pyarrow's output stream completes its upload when it is
  closed, from a destructor too, so a write that failed halfway could still complete a torn
  object under the final name. A killed worker leaves at most a temporary object in
  ``_tmp/``, never a visible part.
"""

from __future__ import annotations

import fnmatch
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.fs as pafs

S3_SCHEME = "s3://"
GLOB_CHARS = frozenset("*?[")
READ_CHUNK = 1 << 20
TEMP_FOLDER = "_tmp"
"""Under an S3 output prefix: uploads not yet copied to their names (debris of killed
workers may stay there; nothing reads it)."""


class StorageError(Exception):
    """A URL that cannot be used: no such file, a glob that matches nothing, a bad URL."""


@dataclass(frozen=True)
class Location:
    """One file or folder: its filesystem, its path there, and the URL it was named by."""

    fs: pafs.FileSystem
    path: str
    url: str

    @property
    def is_s3(self) -> bool:
        return self.url.startswith(S3_SCHEME)

    def child(self, *names: str) -> Location:
        """The location ``names`` below this one."""
        joined = "/".join(name.strip("/") for name in names)
        return Location(
            self.fs, f"{self.path.rstrip('/')}/{joined}", f"{self.url.rstrip('/')}/{joined}"
        )

    def exists(self) -> bool:
        found: bool = self.fs.get_file_info(self.path).type != pafs.FileType.NotFound
        return found

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as stream:
            data: bytes = stream.read()
        return data

    def lines(self, offset: int = 0) -> Iterator[tuple[int, bytes]]:
        """The file's lines from byte ``offset`` on (newline cut off), each with the byte
        offset it starts at; streamed, a chunk at a time."""
        stream = self.fs.open_input_file(self.path)
        try:
            stream.seek(offset)
            position, tail = offset, b""
            while chunk := stream.read(READ_CHUNK):
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
                for line in lines:
                    yield position, line
                    position += len(line) + 1
            if tail:
                yield position, tail
        finally:
            stream.close()

    def delete(self) -> None:
        """Remove the file, if it is there."""
        if self.exists():
            self.fs.delete_file(self.path)


def s3_filesystem(endpoint: str | None = None) -> pafs.S3FileSystem:
    """An S3 filesystem from the AWS environment; ``endpoint`` wins over ``AWS_ENDPOINT_URL``."""
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
    options: dict[str, object] = {}
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        if not parts.netloc:
            raise StorageError(f"S3 endpoint {endpoint!r} is not a URL such as http://host:port")
        options["endpoint_override"] = parts.netloc
        options["scheme"] = parts.scheme or "https"
    return pafs.S3FileSystem(**options)  # type: ignore[arg-type]


def locate(url: str, s3_endpoint: str | None = None) -> Location:
    """The :class:`Location` of ``url``: ``s3://bucket/key`` or a local path."""
    if url.startswith(S3_SCHEME):
        path = url[len(S3_SCHEME) :]
        if not path or path.startswith("/"):
            raise StorageError(f"{url!r} is not an s3://bucket/key URL")
        return Location(s3_filesystem(s3_endpoint), path.rstrip("/") or path, url)
    if "://" in url:
        raise StorageError(f"{url!r}: only local paths and s3:// URLs are supported")
    path = str(Path(url).expanduser().absolute())
    return Location(pafs.LocalFileSystem(), path, url)


def expand(pattern: str, s3_endpoint: str | None = None) -> list[Location]:
    """The files that ``pattern`` names, sorted: one file, or a glob (``*``, ``?``, ``[...]``
    within a path segment, e.g. ``s3://bucket/corpus/*.parquet``, ``/data/in/*.jsonl``).
    :class:`StorageError` when nothing matches."""
    base = locate(pattern, s3_endpoint)
    segments = base.path.split("/")
    first_glob = next((i for i, segment in enumerate(segments) if GLOB_CHARS & set(segment)), None)
    if first_glob is None:
        info = base.fs.get_file_info(base.path)
        if info.type != pafs.FileType.File:
            raise StorageError(f"input {pattern!r}: no such file")
        return [base]
    folder = "/".join(segments[:first_glob])
    depth = len(segments) - first_glob
    selector = pafs.FileSelector(folder, allow_not_found=True, recursive=depth > 1)
    found = []
    for info in base.fs.get_file_info(selector):
        if info.type != pafs.FileType.File:
            continue
        rest = info.path[len(folder) :].strip("/").split("/")
        if len(rest) == depth and all(
            fnmatch.fnmatchcase(name, want)
            for name, want in zip(rest, segments[first_glob:], strict=True)
        ):
            found.append(info.path)
    if not found:
        raise StorageError(f"input {pattern!r}: the pattern matches no file")
    return [
        Location(base.fs, path, f"{S3_SCHEME}{path}" if base.is_s3 else path)
        for path in sorted(found)
    ]


def commit_bytes(target: Location, data: bytes, temp_root: Location | None = None) -> None:
    """Make ``data`` visible as ``target``, whole or not at all (the module's docstring).
    ``temp_root``: on S3, the prefix whose ``_tmp/`` holds the upload until it is copied
    (by default the target's folder)."""
    if not target.is_s3:
        _commit_local(Path(target.path), data)
        return
    folder = temp_root or Location(target.fs, target.path.rsplit("/", 1)[0], "")
    name = target.path.rsplit("/", 1)[-1]
    temp = f"{folder.path.rstrip('/')}/{TEMP_FOLDER}/{name}.{uuid.uuid4().hex}"
    stream = target.fs.open_output_stream(temp)
    stream.write(data)
    stream.close()
    size = target.fs.get_file_info(temp).size
    if size != len(data):
        raise OSError(f"s3://{temp}: {size} bytes uploaded of {len(data)}; not committed")
    target.fs.copy_file(temp, target.path)
    target.fs.delete_file(temp)


def _commit_local(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)

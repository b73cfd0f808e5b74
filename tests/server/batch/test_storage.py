"""The job's storage (``embedding_server.batch.storage``): a commit is whole or absent, on
local disk and on S3 (moto on 127.0.0.1); globs match within a path segment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from embedding_server.batch import storage
from embedding_server.batch.storage import StorageError, commit_bytes, expand, locate

from tests.support.s3 import S3Store, moto_s3


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Store]:
    with moto_s3() as store:
        yield store


def test_a_local_commit_that_fails_midway_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "parts" / "part-000000.parquet"
    commit_bytes(locate(str(target)), b"first")
    assert target.read_bytes() == b"first"
    real_write = os.write
    calls = 0

    def write_then_fail(fd: int, data: bytes | memoryview) -> int:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise OSError(28, "No space left on device")
        return real_write(fd, bytes(data)[:3])

    monkeypatch.setattr(storage.os, "write", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        commit_bytes(locate(str(target)), b"second, longer")
    assert target.read_bytes() == b"first"
    assert sorted(p.name for p in target.parent.iterdir()) == ["part-000000.parquet"]


def test_an_s3_commit_is_copied_into_place_and_its_upload_removed(
    s3: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3.environment.items():
        monkeypatch.setenv(name, value)
    bucket = s3.new_bucket()
    target = locate(f"s3://{bucket}/out/parts/part-000001.parquet")
    commit_bytes(target, b"x" * 100_000, locate(f"s3://{bucket}/out"))
    assert target.read_bytes() == b"x" * 100_000
    assert s3.keys(bucket) == ["out/parts/part-000001.parquet"]


def test_an_s3_upload_of_the_wrong_size_is_not_committed(
    s3: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3.environment.items():
        monkeypatch.setenv(name, value)
    bucket = s3.new_bucket()
    target = locate(f"s3://{bucket}/out/parts/part-000002.parquet")
    real = target.fs.open_output_stream

    class Short:
        """What a stream that lost its last bytes would leave: fewer bytes than written."""

        def __init__(self, path: str) -> None:
            self._stream = real(path)

        def write(self, data: bytes) -> None:
            self._stream.write(data[:-10])

        def close(self) -> None:
            self._stream.close()

    fs = type("Fs", (), {})()
    for name in ("get_file_info", "copy_file", "delete_file"):
        setattr(fs, name, getattr(target.fs, name))
    fs.open_output_stream = Short  # type: ignore[attr-defined]
    broken = storage.Location(fs, target.path, target.url)  # type: ignore[arg-type]
    with pytest.raises(OSError, match="bytes uploaded of 1000; not committed"):
        commit_bytes(broken, b"y" * 1000, locate(f"s3://{bucket}/out"))
    assert not target.exists()


def test_a_glob_matches_within_one_segment_and_names_what_matches_nothing(
    tmp_path: Path,
) -> None:
    for name in ["a/x.jsonl", "a/y.jsonl", "a/y.csv", "a/deeper/z.jsonl", "b/w.jsonl"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    found = [
        Path(loc.path).relative_to(tmp_path).as_posix() for loc in expand(f"{tmp_path}/a/*.jsonl")
    ]
    assert found == ["a/x.jsonl", "a/y.jsonl"]
    found = [
        Path(loc.path).relative_to(tmp_path).as_posix() for loc in expand(f"{tmp_path}/*/*.jsonl")
    ]
    assert found == ["a/x.jsonl", "a/y.jsonl", "b/w.jsonl"]
    with pytest.raises(StorageError, match="matches no file"):
        expand(f"{tmp_path}/c/*.jsonl")
    with pytest.raises(StorageError, match="no such file"):
        expand(f"{tmp_path}/a/none.jsonl")
    with pytest.raises(StorageError, match="only local paths and s3:// URLs"):
        locate("gs://bucket/x")

"""The output file: a torn last line is cut off on resume, and what it answers is read back."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from embedding_server.batch.lines import BatchFileError, BatchRequest, answer_line
from embedding_server.batch.output import BatchOutput


def answers(*keys: str | int) -> bytes:
    lines = b""
    for index, key in enumerate(keys, start=1):
        custom_id = key if isinstance(key, str) else None
        line = key if isinstance(key, int) else index
        lines += answer_line(BatchRequest(line, custom_id, "/score", b"{}"), 200, "r", b"{}")
    return lines


def test_a_new_output_answers_nothing(tmp_path: Path) -> None:
    output = BatchOutput(tmp_path / "sub" / "out.jsonl")
    assert output.recover() == set()
    output.open()
    output.write(answers("a"))
    output.close()
    assert output.recover() == {"a"}


def test_a_torn_last_line_is_cut_off_and_the_whole_lines_kept(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    whole = answers("a", 9, "c")
    torn = answers("d")[:-20]
    path.write_bytes(whole + torn)
    output = BatchOutput(path)
    assert output.recover() == {"a", 9, "c"}
    assert output.torn_bytes == len(torn)
    assert path.read_bytes() == whole
    output.open()
    output.write(answers("d"))
    output.close()
    assert [orjson.loads(raw)["custom_id"] for raw in path.read_bytes().splitlines()] == [
        "a",
        None,
        "c",
        "d",
    ]


def test_a_file_with_no_newline_at_all_is_one_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "batch_req_1", "cust')
    assert BatchOutput(path).recover() == set()
    assert path.read_bytes() == b""


def test_an_output_that_is_not_batch_output_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(answers("a") + b'{"some": "other file"}\n')
    with pytest.raises(BatchFileError, match=r"out.jsonl, line 2: not a batch output line"):
        BatchOutput(path).recover()

"""The output file of a run, kept so that a run can be killed (SIGKILL included) and resumed.

Each answer is one ``write(2)`` of one whole line, appended. A kill can still leave the last
line torn; a resumed run cuts the file back to its last newline before it reads which lines
are answered, and appends from there. The torn line's request is sent again, and nothing is
answered twice: a key already in the file is skipped.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import BinaryIO

from embedding_server.batch.lines import BatchFileError, Key, answered_key

logger = logging.getLogger(__name__)

READ_CHUNK = 1 << 20


class BatchOutput:
    """An output file opened for appending, after :meth:`recover` has read what it holds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self.torn_bytes = 0
        """How many bytes of a torn last line :meth:`recover` cut off."""

    def recover(self) -> set[Key]:
        """Cut a torn last line off the file, and return the keys its lines answer (an empty
        set for a new file). :class:`BatchFileError` for a line that is not an answer."""
        answered: set[Key] = set()
        try:
            handle = self.path.open("r+b")
        except FileNotFoundError:
            return answered
        with handle:
            size = handle.seek(0, os.SEEK_END)
            end = _last_newline_end(handle, size)
            if end < size:
                self.torn_bytes = size - end
                handle.truncate(end)
                logger.warning(
                    "%s: cut a torn last line (%d bytes) left by an interrupted run; its request "
                    "is sent again",
                    self.path,
                    self.torn_bytes,
                )
            handle.seek(0)
            for number, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                try:
                    key = answered_key(raw)
                except BatchFileError as error:
                    raise BatchFileError(f"{self.path}, line {number}: {error}") from None
                answered.add(key)
        return answered

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, line: bytes) -> None:
        """Append one whole line (one write call, unless the kernel takes it in parts)."""
        if self._fd is None:
            raise RuntimeError("BatchOutput.write before open")
        view = memoryview(line)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def close(self) -> None:
        """Flush the file to disk and close it."""
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None


def _last_newline_end(stream: BinaryIO, size: int) -> int:
    """The offset just after the file's last newline (0 when it has none)."""
    position = size
    while position > 0:
        start = max(0, position - READ_CHUNK)
        stream.seek(start)
        chunk = stream.read(position - start)
        index = chunk.rfind(b"\n")
        if index >= 0:
            return start + index + 1
        position = start
    return 0

"""The framing of the wire between front-end processes and the engine process.

Transport: asyncio's own unix-socket streams, one connection per front-end to a socket the
engine process listens on. A message is a 4-byte length, then its frames (a 2-byte count,
each frame's 4-byte length, the frames): a small JSON header frame (:mod:`.messages`) plus
raw buffers. Both ends write from their event loop and read in the loop's own callback, so a
message costs no thread hand-off (ZeroMQ, used before, woke an I/O thread of its own for
every message, on both sides), and the messages of one turn of the loop leave in one write.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence
from typing import cast

Frames = list[memoryview]
"""A received message: its frames, as views of one immutable buffer."""

_LENGTH = struct.Struct("<I")


def pack(frames: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """One message as buffers to write: its length and frame table, then the frames."""
    sizes = [memoryview(frame).nbytes for frame in frames]
    table = struct.pack(f"<H{len(sizes)}I", len(sizes), *sizes)
    return [_LENGTH.pack(len(table) + sum(sizes)), table, *frames]


def unpack(message: memoryview) -> Frames:
    """The frames of one message (without its length prefix)."""
    (count,) = struct.unpack_from("<H", message)
    offset = 2 + 4 * count
    frames: Frames = []
    for size in struct.unpack_from(f"<{count}I", message, 2):
        frames.append(message[offset : offset + size])
        offset += size
    return frames


class Wire(asyncio.Protocol):
    """One end of a connection between a front-end and the engine process: messages out
    (:meth:`send`), and each message in handed to ``on_message`` as it completes, in the
    event loop's read callback. ``on_lost`` is called once when the connection closes."""

    def __init__(self, on_message: Callable[[Frames], None], on_lost: Callable[[], None]) -> None:
        self._on_message, self._on_lost = on_message, on_lost
        self._transport: asyncio.Transport | None = None
        self._partial = bytearray()
        self._needed = 0  # the size of the message that _partial starts, once known
        self._outgoing: list[bytes | memoryview] = []
        self._drained: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if self._partial:
            self._partial += data
            if len(self._partial) < self._needed:
                return  # a large message arriving in pieces: one copy at the end
            data = bytes(self._partial)
            self._partial.clear()
        view = memoryview(data)
        offset, end = 0, len(data)
        while end - offset >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(view, offset)
            stop = offset + _LENGTH.size + size
            if stop > end:
                break
            self._on_message(unpack(view[offset + _LENGTH.size : stop]))
            offset = stop
        if offset < end:
            self._partial += view[offset:]
            rest = end - offset
            self._needed = (
                _LENGTH.size + _LENGTH.unpack_from(view, offset)[0]
                if rest >= _LENGTH.size
                else _LENGTH.size
            )

    def send(self, frames: Sequence[bytes | memoryview]) -> None:
        """Queue one message. The messages sent in one turn of the event loop are written
        together at its end: under load one write, and one wake-up of the peer, carries
        many (a batch's results, or every request a front-end read at once)."""
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing += pack(frames)

    def _flush(self) -> None:
        outgoing, self._outgoing = self._outgoing, []
        if self._transport is not None and not self._transport.is_closing():
            self._transport.writelines(outgoing)

    async def drained(self) -> None:
        """Wait while the peer is behind on reading (the transport's buffer is full)."""
        if self._drained is not None:
            await asyncio.shield(self._drained)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.resume_writing()
        self._on_lost()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

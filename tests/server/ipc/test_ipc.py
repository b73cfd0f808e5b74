"""The wire between ``--api-workers`` front-ends and the engine process: what goes in comes
out, as buffers, however the stream splits it; the errors a client must see keep their type
and details; a front-end that goes away takes its queued work with it; and a request the
engine would refuse is refused by the front-end before it pays for the tokenization."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from embedding_server.engine import Engine
from embedding_server.errors import (
    EmbeddingServerError,
    EngineFailedError,
    InvalidRequestError,
    QueueFullError,
    TooManyTokensError,
)
from embedding_server.ipc.client import AttachedEngine, EngineClient
from embedding_server.ipc.messages import (
    Failure,
    Output,
    decode_error,
    decode_output,
    decode_sequences,
    encode_error,
    encode_output,
    encode_sequences,
    to_front_end,
)
from embedding_server.ipc.service import EngineService
from embedding_server.ipc.wire import Frames, Wire, pack
from embedding_server.metrics import Metrics
from embedding_server.request.scheduler import ScheduledOutput
from embedding_server.request.sequences import SequenceInput
from embedding_server.settings import ServerSettings

from tests.support.scheduler import wait_for


def test_sequences_cross_as_int32_buffers() -> None:
    seqs = [
        SequenceInput([101, 7, 8, 102], skip=2, want_tokens=True),
        SequenceInput([101, 102]),
        SequenceInput([101, 5, 102, 6, 102], type_ids=[0, 0, 0, 1, 1]),
    ]
    frames = encode_sequences(seqs)
    assert all(isinstance(frame, bytes) for frame in frames)
    assert len(frames[1]) == 4 * 11  # every id, once, as int32
    back = decode_sequences(frames, want_tokens=True)
    assert [s.ids for s in back] == [s.ids for s in seqs]
    assert [s.skip for s in back] == [2, 0, 0]
    assert [s.type_ids for s in back] == [[0, 0, 0, 0], [0, 0], [0, 0, 0, 1, 1]]
    assert all(s.want_tokens for s in back)
    single = decode_sequences(encode_sequences(seqs[:2]), want_tokens=False)
    assert [s.type_ids for s in single] == [None, None]


def test_vectors_and_per_token_states_cross_as_float32_buffers() -> None:
    rng = np.random.default_rng(0)
    pooled = rng.standard_normal((3, 8)).astype(np.float32)
    tokens = [rng.standard_normal((n, 4)).astype(np.float32) for n in (2, 5, 1)]
    frames = encode_output(7, ScheduledOutput(pooled, list(tokens), 0.5, 0.25, 0.125, 2, 9, 300))
    header = to_front_end.decode(frames[0])
    assert isinstance(header, Output)
    assert header.rid == 7 and header.token_rows == [2, 5, 1]
    out = decode_output(header, frames[1:])
    np.testing.assert_array_equal(out.pooled, pooled)
    for got, want in zip(out.tokens, tokens, strict=True):
        assert got is not None
        np.testing.assert_array_equal(got, want)
    assert (out.queue_s, out.forward_s, out.pool_s) == (0.5, 0.25, 0.125)
    # The batches it rode, for the front-end's traces.
    assert (out.batches, out.batch_size, out.batch_tokens) == (2, 9, 300)
    plain = encode_output(1, ScheduledOutput(pooled, [None] * 3, 0, 0, 0))
    plain_header = to_front_end.decode(plain[0])
    assert isinstance(plain_header, Output)
    assert decode_output(plain_header, plain[1:]).tokens == [None] * 3


def _decoded_error(frame: bytes) -> EmbeddingServerError:
    message = to_front_end.decode(frame)
    assert isinstance(message, Failure) and message.rid == 3
    return decode_error(message.error)


@pytest.mark.parametrize(
    "error",
    [
        QueueFullError("the queue is full", retry_after=7.0),
        TooManyTokensError("too many tokens", param="input"),
        EngineFailedError("illegal memory access"),
        InvalidRequestError("bad", param="input"),
    ],
)
def test_errors_keep_their_type_and_details(error: Exception) -> None:
    back = _decoded_error(encode_error(3, error))
    assert type(back) is type(error)
    assert back.message == str(error)
    assert back.param == getattr(error, "param", None)
    assert getattr(back, "retry_after", None) == getattr(error, "retry_after", None)


def test_an_unexpected_failure_is_a_500_without_its_details() -> None:
    back = _decoded_error(encode_error(3, RuntimeError("/secret/path")))
    assert back.status_code == 500 and "/secret/path" not in back.message


def _stream(messages: list[list[bytes]]) -> bytes:
    return b"".join(bytes(part) for frames in messages for part in pack(frames))


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 4096, None])
def test_messages_arrive_whole_however_the_stream_is_split(chunk: int | None) -> None:
    big = np.arange(300_000, dtype=np.float32).tobytes()  # 1.2 MB: many reads
    messages = [[b'{"rid":1}', b"", b"abc"], [big], [b"x" * 5, big[:9]], [b'{"op":"hello"}']]
    stream = _stream(messages)
    got: list[Frames] = []
    wire = Wire(got.append, lambda: None)
    step = chunk or len(stream)
    if chunk == 7:  # uneven pieces, cut anywhere
        rng, offset = random.Random(0), 0
        while offset < len(stream):
            size = rng.randint(1, 70_000)
            wire.data_received(stream[offset : offset + size])
            offset += size
    else:
        for offset in range(0, len(stream), step):
            wire.data_received(stream[offset : offset + step])
    assert [[bytes(frame) for frame in frames] for frames in got] == messages


@contextlib.asynccontextmanager
async def _served(path: str, engine: Engine) -> AsyncIterator[EngineClient]:
    """``engine``, started, served at ``path`` (a real unix socket), and a front-end's
    client for it, not yet connected; all stopped on the way out."""
    await engine.start()
    service = EngineService(path)
    serving = asyncio.create_task(service.serve(engine.scheduler, engine.handoff(), 1))
    client = EngineClient(path)
    try:
        yield client
    finally:
        client.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        service.close()
        await engine.stop(drain=False)


def test_a_front_end_gets_its_own_results_and_its_cancel_and_hang_up_withdraw_work(
    tmp_path: Path,
) -> None:
    """In one process, over a real unix socket: the engine's end and a front-end's."""
    path = str(tmp_path / "engine.sock")

    async def scenario() -> None:
        metrics = Metrics()
        engine = Engine.from_pretrained(
            "fake?delay_ms=400&max_len=64", max_batch_size=1, max_batch_tokens=64, metrics=metrics
        )
        async with _served(path, engine) as client:
            warm_up = metrics.registry.get_sample_value("embedding_server_batch_size_count") or 0
            handoff = await asyncio.wait_for(client.connect(), 30)
            assert handoff.info == engine.handoff().info
            seqs = [SequenceInput([0, 11, 12, 2]), SequenceInput([0, 13, 2])]
            out = await asyncio.wait_for(client.submit(seqs, want_tokens=False), 30)
            alone = await engine.scheduler.submit(seqs)
            np.testing.assert_array_equal(out.pooled, alone.pooled)

            # One request in the forward pass, the next prepared beside it, three queued; the
            # last caller gives up.
            calls = [asyncio.create_task(client.submit(seqs[:1], False)) for _ in range(5)]
            await wait_for(lambda: engine.scheduler.queued_requests == 3, timeout=30)
            calls[4].cancel()
            await wait_for(lambda: engine.scheduler.queued_requests == 2, timeout=30)
            # The front-end goes away: what it had queued leaves the engine.
            client.close()
            await wait_for(lambda: engine.scheduler.queued_requests == 0, timeout=30)
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert isinstance(results[4], asyncio.CancelledError)
            assert all(isinstance(r, EngineFailedError) for r in results[:4]), results
            await engine.stop(drain=True, timeout=30)
            # Four one-sequence passes for the two requests above, the one in flight at the
            # hang-up, perhaps the one prepared beside it; not the queued ones (without their
            # withdrawal, 8).
            passes = metrics.registry.get_sample_value("embedding_server_batch_size_count")
            assert passes is not None and 5 <= passes - warm_up <= 6, (passes, warm_up)

    asyncio.run(scenario())


async def test_a_sender_waits_while_the_peer_is_behind_on_reading() -> None:
    wire = Wire(lambda _: None, lambda: None)
    await asyncio.wait_for(wire.drained(), 1)  # nothing buffered: no wait
    wire.pause_writing()  # the transport's buffer passed its high-water mark
    waiting = asyncio.ensure_future(wire.drained())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    wire.resume_writing()
    await asyncio.wait_for(waiting, 1)
    wire.pause_writing()
    lost = asyncio.ensure_future(wire.drained())
    await asyncio.sleep(0)
    wire.connection_lost(None)  # a closed connection releases the waiters too
    await asyncio.wait_for(lost, 1)


@contextlib.asynccontextmanager
async def _front_end(
    path: str, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[AttachedEngine, EngineClient, list[int]]]:
    """A front-end attached over a real socket to ``engine`` (started), and a list that
    counts its tokenizer's calls."""
    async with _served(path, engine) as client:
        handoff = await asyncio.wait_for(client.connect(), 30)
        calls: list[int] = []
        encode = handoff.tokenizer.encode

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return encode(*args, **kwargs)

        monkeypatch.setattr(handoff.tokenizer, "encode", counted)
        front = AttachedEngine(ServerSettings(model="fake"), handoff, client)
        await front.start()
        yield front, client, calls


def test_a_front_end_refuses_what_the_engine_would_before_tokenizing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "q" * 30  # 32 tokens with <s> and </s>

    async def scenario() -> None:
        # One sequence per 2 s pass; the queue holds four 32-token requests.
        engine = Engine.from_pretrained(
            "fake?delay_ms=2000&max_len=64",
            max_batch_size=1,
            max_batch_tokens=64,
            max_queue_tokens=128,
        )
        path = str(tmp_path / "engine.sock")
        async with _front_end(path, engine, monkeypatch) as (front, client, calls):
            # One request in the pass, one prepared beside it, four queued: the queue is full.
            # Sent one at a time, so that none arrives before the first two left the queue.
            crowd = []
            for sent in range(1, 7):
                seq = SequenceInput([0, *[7] * 30, 2])
                crowd.append(asyncio.create_task(client.submit([seq], False)))
                queued = max(0, sent - 2)
                await wait_for(lambda q=queued: engine.scheduler.queued_requests == q, 30)
            # This front-end has not heard from the engine: the engine refuses, exactly.
            with pytest.raises(QueueFullError):
                await front.aembed([text])
            assert len(calls) == 1
            # Its answer showed the queue full: the next one is refused here, untokenized,
            # with the engine's own reason and Retry-After.
            with pytest.raises(QueueFullError) as refused:
                await front.aembed([text])
            assert len(calls) == 1
            assert "holds 128 of 128 tokens" in refused.value.message
            assert refused.value.retry_after >= 1
            # More texts than the per-request limit (64 tokens) could hold: a 413, untokenized.
            with pytest.raises(TooManyTokensError):
                await front.aembed(["x"] * 65)
            assert len(calls) == 1
            # The crowd goes away. The engine tells this front-end, which last heard of a full
            # queue, that it drained; the request goes through.
            for task in crowd:
                task.cancel()
            await asyncio.gather(*crowd, return_exceptions=True)
            await wait_for(lambda: client.engine_queue[0] == 0, timeout=30)
            done = await asyncio.wait_for(front.aembed([text]), 60)
            assert done.embeddings.shape[0] == 1
            assert len(calls) == 2

    asyncio.run(scenario())


def test_a_burst_at_one_front_end_is_refused_there_while_it_tokenizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        engine = Engine.from_pretrained(
            "fake?max_len=64", max_batch_tokens=64, max_queue_tokens=320, max_request_tokens=320
        )
        path = str(tmp_path / "engine.sock")
        async with _front_end(path, engine, monkeypatch) as (front, _, calls):
            # Five texts too long to tokenize on the event loop, cut to 320 tokens: the
            # front-end holds room for them while its tokenizer thread reads them. A request
            # that arrives meanwhile and would overfill the queue with them is refused at once.
            big = asyncio.create_task(front.aembed(["w" * 2500] * 5))
            await asyncio.sleep(0)
            with pytest.raises(QueueFullError):
                await front.aembed(["q" * 40, "q" * 40])  # about 24 tokens
            assert len(calls) <= 1
            assert (await asyncio.wait_for(big, 60)).embeddings.shape[0] == 5
            # The room held while it was tokenized was given back when it was sent.
            assert (await front.aembed(["q" * 40, "q" * 40])).embeddings.shape[0] == 2
            assert len(calls) == 2

    asyncio.run(scenario())


def test_images_cross_as_float32_frames_beside_texts() -> None:
    rng = np.random.default_rng(1)
    big = rng.standard_normal((3, 8, 6)).astype(np.float32)
    small = rng.standard_normal((3, 2, 2)).astype(np.float32)
    seqs = [
        SequenceInput([101, 7, 102]),
        SequenceInput([0] * 5, pixels=big),
        SequenceInput([0] * 2, pixels=small),
        SequenceInput([101, 102], skip=1),
    ]
    frames = encode_sequences(seqs)
    assert len(frames[7]) == 4 * (big.size + small.size)  # the pixels, once, as float32
    back = decode_sequences(frames, want_tokens=False)
    assert [s.ids for s in back] == [s.ids for s in seqs]
    assert back[0].pixels is None and back[3].pixels is None
    assert back[1].pixels is not None and np.array_equal(back[1].pixels, big)
    assert back[2].pixels is not None and np.array_equal(back[2].pixels, small)
    assert back[3].skip == 1
    texts = encode_sequences([seqs[0]])
    assert texts[6:] == [b"", b""]  # texts alone pay nothing for images
    assert decode_sequences(texts, want_tokens=False)[0].pixels is None

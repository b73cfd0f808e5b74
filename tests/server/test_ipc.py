"""The wire between ``--api-workers`` front-ends and the engine process: what goes in comes
out, as buffers, and the errors a client must see keep their type and details."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from embedding_server.errors import (
    EngineFailedError,
    InvalidRequestError,
    QueueFullError,
    TooManyTokensError,
)
from embedding_server.ipc import (
    decode_error,
    decode_output,
    decode_sequences,
    encode_error,
    encode_output,
    encode_sequences,
)
from embedding_server.runner import SequenceInput
from embedding_server.scheduler import ScheduledOutput


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
    frames = encode_output(7, ScheduledOutput(pooled, list(tokens), 0.5, 0.25, 0.125))
    header = orjson.loads(frames[0])
    assert header["rid"] == 7 and header["token_rows"] == [2, 5, 1]
    out = decode_output(header, frames[1:])
    np.testing.assert_array_equal(out.pooled, pooled)
    for got, want in zip(out.tokens, tokens, strict=True):
        assert got is not None
        np.testing.assert_array_equal(got, want)
    assert (out.queue_s, out.forward_s, out.pool_s) == (0.5, 0.25, 0.125)
    plain = encode_output(1, ScheduledOutput(pooled, [None] * 3, 0, 0, 0))
    assert decode_output(orjson.loads(plain[0]), plain[1:]).tokens == [None] * 3


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
    back = decode_error(orjson.loads(encode_error(3, error))["error"])
    assert type(back) is type(error)
    assert back.message == str(error)
    assert back.param == getattr(error, "param", None)
    assert getattr(back, "retry_after", None) == getattr(error, "retry_after", None)


def test_an_unexpected_failure_is_a_500_without_its_details() -> None:
    back = decode_error(orjson.loads(encode_error(3, RuntimeError("/secret/path")))["error"])
    assert back.status_code == 500 and "/secret/path" not in back.message

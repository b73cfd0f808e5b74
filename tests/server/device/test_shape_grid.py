"""CPU batches in bfloat16 are padded to a grid of token counts (oneDNN compiles a matmul
kernel per shape) with one-token filler sequences that never reach a caller: the vectors and
token states a caller gets are those of the same batch without fillers."""

from __future__ import annotations

import numpy as np
import pytest
from embedding_server.device.runner import token_grid
from embedding_server.engine import Engine
from embedding_server.request.sequences import SequenceInput


def test_the_grid_pads_by_at_most_an_eighth_and_has_few_sizes() -> None:
    sizes = {token_grid(total) for total in range(1, 16385)}
    # Eight sizes up to 128 tokens, then eight per doubling: 64 in all up to 16,384, so the
    # four linear shapes of a layer stay within oneDNN's 1,024 cached kernels.
    assert len(sizes) == 64
    for total in range(1, 40000):
        padded = token_grid(total)
        assert padded >= total
        if total <= 128:
            assert padded % 16 == 0 and padded - total < 16
        else:
            assert padded - total <= total / 8
        assert token_grid(padded) == padded  # a size on the grid stays where it is


def _sequences() -> list[SequenceInput]:
    return [
        SequenceInput([101, 7592, 2088, 102]),
        SequenceInput([101]),  # as short as a filler: it shares their attention bucket
        SequenceInput([101, 2023, 2003, 1037, 2936, 6251, 2055, 4937, 102], want_tokens=True),
        SequenceInput([101, 2054, 102, 3899, 102], type_ids=[0, 0, 0, 1, 1]),
        SequenceInput([101, 1045, 2293, 7592, 102], skip=2),
    ]


@pytest.fixture(scope="module")
def bf16() -> Engine:
    return Engine.from_pretrained(dtype="bfloat16", normalize=False)


def test_a_bfloat16_cpu_batch_is_padded_with_fillers_that_no_caller_sees(bf16: Engine) -> None:
    runner = bf16._runner
    assert runner.shape_grid
    seqs = _sequences()
    total = sum(len(s.ids) for s in seqs)
    prepared = runner.prepare(seqs)
    assert prepared.batch.input_ids.numel() == token_grid(total) == 32
    assert prepared.fill == 32 - total
    out = runner.execute(prepared)

    runner.shape_grid = False
    try:
        plain_prepared = runner.prepare(seqs)
        assert plain_prepared.batch.input_ids.numel() == total
        plain = runner.execute(plain_prepared)
    finally:
        runner.shape_grid = True

    assert out.pooled.shape == plain.pooled.shape == (len(seqs), 384)
    cosines = (out.pooled * plain.pooled).sum(1) / (
        np.linalg.norm(out.pooled, axis=1) * np.linalg.norm(plain.pooled, axis=1)
    )
    assert cosines.min() >= 0.9999, cosines
    assert [t is None for t in out.tokens] == [True, True, False, True, True]
    assert out.tokens[2] is not None and plain.tokens[2] is not None
    assert out.tokens[2].shape == (9, 384)
    np.testing.assert_allclose(out.tokens[2], plain.tokens[2], atol=0.05)


def test_padded_bfloat16_vectors_point_where_float32_ones_do(bf16: Engine) -> None:
    texts = ["a", "the quick brown fox jumps over the lazy dog", "embeddings " * 40]
    full = Engine.from_pretrained(dtype="float32", normalize=False)
    assert not full._runner.shape_grid  # float32 runs on MKL's sgemm: no kernel per shape
    ours, want = np.asarray(bf16.embed(texts)), np.asarray(full.embed(texts))
    cosines = (ours * want).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(want, axis=1))
    assert cosines.min() >= 0.999, cosines


def test_one_padded_attention_call_gets_no_fillers() -> None:
    # sdpa_padded pads every sequence to the longest: a filler would cost a whole row there.
    engine = Engine.from_pretrained(dtype="bfloat16", attention="sdpa_padded")
    assert not engine._runner.shape_grid
    prepared = engine._runner.prepare(_sequences())
    assert prepared.fill == 0

"""Pooling methods on packed tensors, as sentence-transformers pools (the device half of
pooling; the per-request head is tests/server/test_pooling.py)."""

from __future__ import annotations

import pytest
import torch
from embedding_server.device.pooling import pool
from embedding_server.request.pooling import POOLING_METHODS

LENS = [3, 1, 4]


@pytest.fixture
def hidden() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(sum(LENS), 5, dtype=torch.bfloat16)


def test_cls_mean_last_on_packed_sequences(hidden: torch.Tensor) -> None:
    seqs = torch.split(hidden.float(), LENS)
    torch.testing.assert_close(pool(hidden, LENS, "cls"), torch.stack([s[0] for s in seqs]))
    torch.testing.assert_close(pool(hidden, LENS, "last"), torch.stack([s[-1] for s in seqs]))
    torch.testing.assert_close(pool(hidden, LENS, "mean"), torch.stack([s.mean(0) for s in seqs]))
    assert pool(hidden, LENS, "mean").dtype == torch.float32


def test_mean_pooling_can_leave_the_prompt_out(hidden: torch.Tensor) -> None:
    seqs = torch.split(hidden.float(), LENS)
    got = pool(hidden, LENS, "mean", skip=[2, 0, 1])
    want = torch.stack([seqs[0][2:].mean(0), seqs[1].mean(0), seqs[2][1:].mean(0)])
    torch.testing.assert_close(got, want)


def weighted(seq: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Position-weighted mean of seq[first:], weights = 1-based positions in the sequence."""
    weights = torch.arange(first + 1, len(seq) + 1, dtype=torch.float32).unsqueeze(1)
    return (seq[first:] * weights).sum(0) / weights.sum()


def test_max_weightedmean_mean_sqrt_len_on_packed_sequences(hidden: torch.Tensor) -> None:
    seqs = torch.split(hidden.float(), LENS)
    torch.testing.assert_close(
        pool(hidden, LENS, "max"), torch.stack([s.max(0).values for s in seqs])
    )
    torch.testing.assert_close(
        pool(hidden, LENS, "weightedmean"), torch.stack([weighted(s) for s in seqs])
    )
    torch.testing.assert_close(
        pool(hidden, LENS, "mean_sqrt_len"),
        torch.stack([s.sum(0) / len(s) ** 0.5 for s in seqs]),
    )
    for method in POOLING_METHODS:
        out = pool(hidden, LENS, method)
        assert out.shape == (3, 5) and out.dtype == torch.float32, method


def test_every_method_leaves_the_prompt_out_as_sentence_transformers_does(
    hidden: torch.Tensor,
) -> None:
    """cls reads the first token after the prompt, last is unaffected, weightedmean keeps
    the original position weights; a sequence that is all prompt keeps its last token."""
    seqs = torch.split(hidden.float(), LENS)
    skip = [2, 1, 1]  # the 1-token sequence is all prompt
    torch.testing.assert_close(
        pool(hidden, LENS, "cls", skip), torch.stack([seqs[0][2], seqs[1][0], seqs[2][1]])
    )
    torch.testing.assert_close(pool(hidden, LENS, "last", skip), pool(hidden, LENS, "last"))
    kept = [seqs[0][2:], seqs[1], seqs[2][1:]]
    torch.testing.assert_close(
        pool(hidden, LENS, "max", skip), torch.stack([s.max(0).values for s in kept])
    )
    torch.testing.assert_close(
        pool(hidden, LENS, "mean_sqrt_len", skip),
        torch.stack([s.sum(0) / len(s) ** 0.5 for s in kept]),
    )
    torch.testing.assert_close(
        pool(hidden, LENS, "weightedmean", skip),
        torch.stack([weighted(seqs[0], 2), weighted(seqs[1]), weighted(seqs[2], 1)]),
    )

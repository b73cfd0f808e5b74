"""Pooling methods on packed tensors, the float32 head, and Matryoshka rules."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest
import torch
from embedding_server import settings
from embedding_server.device.pooling import pool
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError
from embedding_server.pooling import (
    POOLING_METHODS,
    Matryoshka,
    build_matryoshka,
    finalize,
)

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


def test_every_pooling_method_is_a_setting() -> None:
    """--pooling offers exactly the methods pool() implements (plus auto)."""
    assert get_args(settings.Pooling) == ("auto", *POOLING_METHODS)


def test_truncation_then_renormalization() -> None:
    vectors = np.array([[3.0, 4.0, 12.0], [1.0, 0.0, 0.0]], dtype=np.float32)
    out = finalize(vectors, dimensions=2, normalize=True)
    np.testing.assert_allclose(out, [[0.6, 0.8], [1.0, 0.0]], rtol=1e-6)
    assert out.dtype == np.float32
    raw = finalize(vectors, dimensions=2, normalize=False)
    np.testing.assert_array_equal(raw, vectors[:, :2])


def test_no_matryoshka_only_full_size_allowed() -> None:
    m = build_matryoshka(
        384, declared=False, declared_dims=None, override_dims=None, default_dims=None
    )
    assert m.resolve(None) == 384 and m.resolve(384) == 384
    with pytest.raises(InvalidRequestError) as err:
        m.resolve(128)
    assert err.value.param == "dimensions"
    assert "384" in err.value.message and "no Matryoshka" in err.value.message


def test_declared_list_and_any_size() -> None:
    listed = build_matryoshka(
        768, declared=True, declared_dims=[64, 256], override_dims=None, default_dims=None
    )
    assert listed.resolve(64) == 64
    with pytest.raises(InvalidRequestError, match="64, 256, 768"):
        listed.resolve(100)
    anysize = build_matryoshka(
        768, declared=True, declared_dims=None, override_dims=None, default_dims=None
    )
    assert anysize.resolve(100) == 100
    for bad in (0, 769, -1):
        with pytest.raises(InvalidRequestError, match="1 to 768"):
            anysize.resolve(bad)
    with pytest.raises(InvalidRequestError):
        anysize.resolve(True)  # type: ignore[arg-type]


def test_settings_override_and_default_dimensions() -> None:
    m = build_matryoshka(
        384, declared=False, declared_dims=None, override_dims=[128, 256], default_dims=256
    )
    assert m == Matryoshka(full=384, supported=True, dimensions=(128, 256, 384), default=256)
    assert m.resolve(None) == 256
    with pytest.raises(InvalidRequestError, match="outside"):
        build_matryoshka(
            384, declared=False, declared_dims=None, override_dims=[512], default_dims=None
        )
    with pytest.raises(InvalidRequestError) as err:
        build_matryoshka(
            384, declared=False, declared_dims=None, override_dims=[128], default_dims=200
        )
    assert err.value.param == "dimensions"


def test_minilm_dimensions_need_the_override(minilm_engine: Engine) -> None:
    """all-MiniLM declares no Matryoshka support: dimensions is refused unless configured."""
    texts = ["a sentence to embed", "another one"]
    with pytest.raises(InvalidRequestError) as err:
        minilm_engine.embed(texts, dimensions=128)
    assert err.value.param == "dimensions"
    full = minilm_engine.embed(texts)
    assert full.shape == (2, 384)

    engine = Engine.from_pretrained(dtype="float32", matryoshka_dimensions=[128, 256])
    assert engine.info().matryoshka and engine.info().matryoshka_dimensions == [128, 256, 384]
    cut = engine.embed(texts, dimensions=128)
    want = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, want, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="128, 256, 384"):
        engine.embed(texts, dimensions=100)

    defaulted = Engine.from_pretrained(dtype="float32", dimensions=256)
    assert defaulted.info().dimensions == 256
    assert defaulted.embed(texts).shape == (2, 256)
    assert defaulted.embed(texts, dimensions=64).shape == (2, 64)
    raw = defaulted.embed(texts, normalize=False, dimensions=384)  # the raw mean-pooled vector
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), full, atol=1e-6)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)

"""The per-request pooling head: Matryoshka rules, truncation and renormalization (the
pooling methods on packed tensors are tests/server/device/test_pooling.py)."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest
from embedding_server import settings
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError
from embedding_server.request.pooling import (
    POOLING_METHODS,
    Matryoshka,
    build_matryoshka,
    finalize,
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

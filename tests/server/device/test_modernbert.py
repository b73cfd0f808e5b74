"""ModernBERT on packed tokens against transformers and sentence-transformers.

Tiny random ModernBERTs (built like ``tests.support.models`` builds the other families) run as ONE
packed batch of mixed lengths, shorter and longer than the local attention band, so every
global/local alternation and the band's exact edge are exercised; each sequence must match
transformers running it alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.device import attention
from embedding_server.engine import Engine
from sentence_transformers import SentenceTransformer
from transformers import AutoConfig

from tests.support.attention import BF16_COSINE, assert_rows_close, pretend_cuda
from tests.support.device_cases import KERNEL_RATIOS, built_once, eager_states
from tests.support.models import (
    MODERNBERT_CLS as _CLS,
)
from tests.support.models import (
    MODERNBERT_SEP as _SEP,
)
from tests.support.models import (
    MODERNBERT_SPECIALS as _SPECIALS,
)
from tests.support.models import (
    MODERNBERT_VARIANTS as _VARIANTS,
)
from tests.support.models import (
    add_sentence_transformers,
    build_modernbert,
)

_EXPECTED_TYPES = {
    "modernbert": ["full", "sliding", "sliding", "full"],
    "modernbert-mlm-legacy": ["full", "sliding", "full", "sliding"],
}
_EXPECTED_WINDOW = {"modernbert": 4, "modernbert-mlm-legacy": 3}


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: a tiny ModernBERT per ``_VARIANTS`` entry, built once per module."""
    return built_once(tmp_path_factory.mktemp("modernbert"), build_modernbert)


def _sequences(vocab_size: int) -> list[list[int]]:
    """[CLS] ids [SEP]: a lone [CLS], lengths the band cannot bite (<= window + 1), at and
    just past its edge, and far past it (two of length 9 share a bucket)."""
    generator = torch.Generator().manual_seed(11)
    out = [[_CLS]]
    for n in [2, 4, 5, 8, 9, 9, 10, 17, 33, 61]:
        body = torch.randint(len(_SPECIALS), vocab_size, (n - 2,), generator=generator)
        out.append([_CLS, *body.tolist(), _SEP])
    return out


@pytest.mark.parametrize(("kernel", "ratio"), KERNEL_RATIOS)
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_packed_batch_matches_transformers(
    modernbert: Callable[[str], Path],
    variant: str,
    kernel: str,
    ratio: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every token state and every pooled (CLS) vector of one packed mixed-length batch
    equals transformers' ModernBertModel running each input alone."""
    monkeypatch.setattr(attention, "_BUCKET_RATIO", ratio)
    path = modernbert(variant)
    reference_config = AutoConfig.from_pretrained(str(path))  # transformers reads it so too
    assert [t.split("_")[0] for t in reference_config.layer_types] == _EXPECTED_TYPES[variant]
    assert reference_config.sliding_window == _EXPECTED_WINDOW[variant]
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False, attention=kernel)
    info = engine.info()
    assert (info.model_type, info.pooling, info.attention) == ("modernbert", "cls", kernel)
    assert info.sliding_window == _EXPECTED_WINDOW[variant]
    seqs = _sequences(info.vocab_size)
    expected = eager_states(path, seqs)
    for seq, got, want in zip(seqs, engine.embed_tokens(seqs), expected, strict=True):
        assert got.shape == want.shape == (len(seq), info.hidden_size)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    pooled = engine.embed(seqs)
    np.testing.assert_allclose(pooled, np.stack([s[0] for s in expected]), atol=2e-5, rtol=1e-4)


def test_flash_attn_gets_the_local_band(
    modernbert: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local layers hand flash-attn ``window_size=(local_attention // 2,) * 2``, global ones
    the plain call; a batch the band cannot bite gets plain calls throughout."""
    path = str(modernbert("modernbert"))
    plain = Engine.from_pretrained(path, dtype="bfloat16")
    seqs = _sequences(plain.info().vocab_size)
    baseline = plain.embed_tokens(seqs)
    cuda = pretend_cuda(monkeypatch)
    engine = Engine.from_pretrained(path, dtype="bfloat16")
    flashed = engine.embed_tokens(seqs)
    assert [c["window_size"] for c in cuda.flash.calls] == [(-1, -1), (4, 4), (4, 4), (-1, -1)]
    assert not any(c["causal"] for c in cuda.flash.calls)
    assert_rows_close(flashed, baseline, min_cosine=BF16_COSINE)
    cuda.flash.calls.clear()
    engine.embed_tokens([s for s in seqs if len(s) <= 5])
    assert [c["window_size"] for c in cuda.flash.calls] == [(-1, -1)] * 4


def test_sentence_transformers_mean_pooling_parity(modernbert: Callable[[str], Path]) -> None:
    """A ModernBERT embedder with a sentence-transformers config (mean pooling, Normalize),
    through Engine.from_pretrained, against SentenceTransformer on the same directory; texts
    reach well past the local band and the 64-token truncation."""
    path = add_sentence_transformers(modernbert("modernbert"), pooling="mean")
    engine = Engine.from_pretrained(str(path), dtype="float32")
    info = engine.info()
    assert (info.pooling, info.normalize, info.max_input_tokens) == ("mean", True, 64)
    texts = ["a", "ModernBERT alternates global and local attention", "tokens " * 15, "zz top"]
    got = engine.embed(texts)
    want = SentenceTransformer(str(path), device="cpu").encode(texts)
    assert got.shape == want.shape == (4, 32)
    cosines = np.sum(got * want, axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    )
    assert cosines.min() >= 0.9999

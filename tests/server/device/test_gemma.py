"""Gemma (1) (bge-reranker-v2-gemma's body) against transformers' GemmaModel.

Tiny random ``GemmaModel`` (bare names) and ``GemmaForCausalLM`` (``model.`` prefix, a tied
or untied ``lm_head``) checkpoints saved by transformers. One packed batch of mixed lengths
must match transformers running each input alone: cosine >= 0.99999 in float32 (and 2e-5
absolute), >= 0.999 in bfloat16, token states and the last-token vectors. Gemma 1 is Gemma
2's body less the sandwich norms, the cap and the window, with ``head_dim ** -0.5`` as the
attention scale: a test checks the parity would notice either difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError

from tests.support import device_cases as cases
from tests.support.attention import assert_rows_close
from tests.support.models import rewrite_checkpoint

pytestmark = pytest.mark.timeout(300)

F32_COSINE, BF16_COSINE = 0.99999, 0.999
LENGTHS = [1, 3, 7, 8, 9, 17, 30, 64]
_CONFIG: dict[str, Any] = {
    **cases.GEMMA_BODY,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}


def _save(path: Path, *, causal_lm: bool = False, **overrides: Any) -> Path:
    # Damped after the spread: bfloat16 rounding then does not chaotically grow through the
    # layers.
    return cases.save_byte_decoder(
        path,
        "gemma",
        {**_CONFIG, **overrides},
        specials=["<pad>", "<eos>", "<bos>", "<unk>"],
        template="<bos> $A",
        bos="<bos>",
        eos="<eos>",
        seed=31,
        causal_lm=causal_lm,
        damp=0.5,
    )


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("gemma") / "body")


@pytest.fixture(scope="module")
def gemma_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("gemma") / "lm", causal_lm=True, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def legacy(gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json as Gemma checkpoints of transformers 4 ship it: a top-level rope_theta,
    ``hidden_act: gelu`` beside ``hidden_activation: gelu_pytorch_tanh`` (both meaning gelu's
    tanh approximation to transformers)."""
    return rewrite_checkpoint(
        gemma,
        tmp_path_factory.mktemp("gemma") / "legacy",
        config={
            "rope_parameters": None,
            "rope_theta": 1000.0,
            "hidden_act": "gelu",
            "hidden_activation": "gelu_pytorch_tanh",
        },
    )


def _sequences(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [
        [2, *torch.randint(4, vocab_size, (n - 1,), generator=generator).tolist()] for n in LENGTHS
    ]


@pytest.mark.parametrize(("dtype", "cosine"), [("float32", F32_COSINE), ("bfloat16", BF16_COSINE)])
@pytest.mark.parametrize("kernel", ["sdpa_bucketed", "sdpa_padded"])
@pytest.mark.parametrize("checkpoint", ["gemma", "gemma_lm", "legacy"])
def test_packed_batch_matches_transformers(
    checkpoint: str, kernel: str, dtype: str, cosine: float, request: pytest.FixtureRequest
) -> None:
    """Token states and last-token vectors of one packed batch equal transformers' eager
    GemmaModel on each input alone: a bare body, a causal LM (its lm_head left unread) and a
    transformers-4 config.json."""
    path: Path = request.getfixturevalue(checkpoint)
    engine = Engine.from_pretrained(
        str(path), dtype=dtype, normalize=False, attention=kernel, task="embed"
    )
    info = engine.info()
    assert (info.backend, info.attention, info.sliding_window) == ("native", kernel, None)
    assert info.attention_passed_over == []
    seqs = _sequences(info.vocab_size)
    want = cases.eager_states(path, seqs, getattr(torch, dtype))
    cases.assert_token_states_match(seqs, engine.embed_tokens(seqs), want, cosine, dtype)
    assert_rows_close(engine.embed(seqs), [w[-1] for w in want], cosine)


def test_the_parity_tells_gemma_from_gemma2(gemma: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above means something: another attention scale (Gemma 2's comes from
    query_pre_attn_scalar) or the exact gelu instead of the tanh one moves the states off
    transformers' by more than the float32 parity allows."""
    engine = Engine.from_pretrained(str(gemma), dtype="float32", normalize=False, task="embed")
    seqs = _sequences(engine.info().vocab_size)
    want = cases.eager_states(gemma, seqs)
    from embedding_server.device.models import gemma as family

    monkeypatch.setattr(family.GemmaModel, "attention_scale", lambda self, c, d: 0.5)
    scaled = Engine.from_pretrained(str(gemma), dtype="float32", normalize=False, task="embed")
    monkeypatch.undo()
    monkeypatch.setattr(family.GemmaModel, "gelu_approximation_of", lambda self, c: "none")
    exact = Engine.from_pretrained(str(gemma), dtype="float32", normalize=False, task="embed")
    for other in (scaled, exact):  # off by more than the float32 parity above allows
        got = other.embed_tokens(seqs)
        assert not all(
            np.allclose(g, w, atol=2e-5, rtol=1e-4) for g, w in zip(got, want, strict=True)
        )


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"is_causal": False}, "bidirectional attention"),
        ({"hidden_act": "relu"}, "activation 'relu' is not supported"),
        ({"hidden_activation": "silu"}, "activation 'silu' is not supported"),
    ],
)
def test_configs_not_served_exactly_are_refused_before_weights(
    gemma: Path, tmp_path: Path, flags: dict[str, Any], says: str
) -> None:
    """Refused from config.json alone (the weights are removed: the refusal comes first)."""
    path = rewrite_checkpoint(gemma, tmp_path / "g", config=flags)
    (path / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match=says):
        Engine.from_pretrained(str(path), dtype="float32", task="embed")


def test_float16_is_refused(gemma: Path) -> None:
    """Gemma's activations overflow float16, as Gemma 2's and 3's do."""
    with pytest.raises(InvalidRequestError, match="gemma activations overflow float16"):
        Engine.from_pretrained(str(gemma), dtype="float16", task="embed")

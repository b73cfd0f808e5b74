"""Gemma 2 (bge-multilingual-gemma2) against transformers' Gemma2Model.

Tiny random ``Gemma2Model`` checkpoints (bge-multilingual-gemma2 is one: bare ``layers.N.*``
names) and ``Gemma2ForCausalLM`` ones (``model.`` prefix, an ``lm_head``) are saved by
transformers; transformers runs them with its eager attention, the one that soft-caps the
logits (its SDPA path does not). Three layers (sliding, full, sliding), a window of 8 and a
cap of 4 small enough that tanh bites on these weights (a test checks it does). One packed
batch of mixed lengths, shorter and longer than the window, must match transformers running
each input alone: cosine >= 0.99999 in float32 (and 2e-5 absolute), >= 0.999 in bfloat16,
token states and the last-token vectors, on both CPU kernels and through the flash-attn
stand-in (``softcap``); torch_varlen, which cannot cap, is passed over saying why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.device import attention
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError

from tests.support import device_cases as cases
from tests.support.attention import assert_rows_close, pretend_cuda
from tests.support.models import rewrite_checkpoint

pytestmark = pytest.mark.timeout(300)

F32_COSINE, BF16_COSINE = 0.99999, 0.999
WINDOW = 8
CAP = 4.0
LENGTHS = [1, 3, WINDOW - 1, WINDOW, WINDOW + 1, WINDOW + 1, 17, 30, 64]
_CONFIG: dict[str, Any] = {
    **cases.GEMMA_BODY,
    "query_pre_attn_scalar": 24,  # not head_dim: the scale is 24 ** -0.5
    "sliding_window": WINDOW,
    "attn_logit_softcapping": CAP,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _save(path: Path, *, causal_lm: bool = False, **overrides: Any) -> Path:
    return cases.save_byte_decoder(
        path,
        "gemma2",
        {**_CONFIG, **overrides},
        specials=["<pad>", "<s>", "</s>", "<unk>"],
        template="$A </s>",
        bos="<s>",
        eos="</s>",
        seed=29,
        causal_lm=causal_lm,
    )


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("gemma2") / "body")


@pytest.fixture(scope="module")
def gemma2_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("gemma2") / "lm", causal_lm=True)


@pytest.fixture(scope="module")
def legacy(gemma2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json as bge-multilingual-gemma2 ships it (transformers 4.42 keys): no
    layer_types (even layers slide), a top-level rope_theta, the cache and final-logit keys."""
    return rewrite_checkpoint(
        gemma2,
        tmp_path_factory.mktemp("gemma2") / "legacy",
        config={
            "layer_types": None,
            "rope_parameters": None,
            "rope_theta": 1000.0,
            "cache_implementation": "hybrid",
            "final_logit_softcapping": 30.0,
        },
    )


def _sequences(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [
        [*torch.randint(3, vocab_size, (n - 1,), generator=generator).tolist(), 2] for n in LENGTHS
    ]


@pytest.mark.parametrize(("dtype", "cosine"), [("float32", F32_COSINE), ("bfloat16", BF16_COSINE)])
@pytest.mark.parametrize(
    ("kernel", "ratio"),
    [
        ("sdpa_bucketed", 1.0),  # exact-length buckets
        ("sdpa_bucketed", 0.5),  # padded buckets
        ("sdpa_padded", 1.0),  # the whole batch padded to its longest
    ],
)
@pytest.mark.parametrize("checkpoint", ["gemma2", "gemma2_lm", "legacy"])
def test_packed_batch_matches_transformers(
    checkpoint: str,
    kernel: str,
    ratio: float,
    dtype: str,
    cosine: float,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Token states and last-token vectors of one packed batch equal transformers' eager
    Gemma2Model on each input alone: a bare body, a causal LM (its lm_head left unread) and
    bge-multilingual-gemma2's legacy config.json; the kernel says it runs eagerly."""
    monkeypatch.setattr(attention, "_BUCKET_RATIO", ratio)
    path: Path = request.getfixturevalue(checkpoint)
    engine = Engine.from_pretrained(
        str(path), dtype=dtype, normalize=False, attention=kernel, task="embed"
    )
    info = engine.info()
    assert (info.backend, info.attention, info.sliding_window) == ("native", kernel, WINDOW)
    assert info.attention_passed_over == [attention.EAGER_SOFTCAP]
    seqs = _sequences(info.vocab_size)
    torch_dtype = getattr(torch, dtype)
    want = cases.eager_states(path, seqs, torch_dtype)
    cases.assert_token_states_match(seqs, engine.embed_tokens(seqs), want, cosine, dtype)
    assert_rows_close(engine.embed(seqs), [w[-1] for w in want], cosine)


def test_the_cap_and_the_window_bite(gemma2: Path) -> None:
    """The parity above means something: without the cap, or with full attention in the
    sliding layers, transformers' own states move well off ours."""
    engine = Engine.from_pretrained(str(gemma2), dtype="float32", normalize=False, task="embed")
    seqs = _sequences(engine.info().vocab_size)
    got = engine.embed_tokens(seqs)
    for other in (
        {"attn_logit_softcapping": None},
        {"layer_types": ["full_attention"] * 3},
    ):
        want = cases.eager_states(gemma2, seqs, **other)
        worst = min(
            float(
                np.min((g * w).sum(-1) / (np.linalg.norm(g, axis=-1) * np.linalg.norm(w, axis=-1)))
            )
            for g, w in zip(got, want, strict=True)
        )
        assert worst < 0.999, other


def test_flash_attn_soft_caps_in_the_kernel(gemma2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU with flash-attn the logits are capped by its ``softcap``, the window passed
    on sliding layers only; the states match the CPU path."""
    plain = Engine.from_pretrained(str(gemma2), dtype="bfloat16", task="embed")
    seqs = _sequences(plain.info().vocab_size)
    baseline = plain.embed_tokens(seqs)
    cuda = pretend_cuda(monkeypatch)
    engine = Engine.from_pretrained(str(gemma2), dtype="bfloat16", task="embed")
    assert (engine.info().attention, engine.info().attention_passed_over) == ("flash_attn", [])
    flashed = engine.embed_tokens(seqs)
    assert [(c["softcap"], c["window_size"], c["causal"]) for c in cuda.flash.calls] == [
        (CAP, (WINDOW - 1, 0), True),
        (CAP, (-1, -1), True),
        (CAP, (WINDOW - 1, 0), True),
    ]
    assert_rows_close(flashed, baseline, min_cosine=0.995)


def test_torch_varlen_is_passed_over_and_refused_by_name(
    gemma2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's varlen_attn cannot cap: without flash-attn the GPU runs sdpa_padded (eagerly)
    and says why; asking for torch_varlen is refused naming the reason."""
    pretend_cuda(monkeypatch, flash=False)
    info = Engine.from_pretrained(str(gemma2), dtype="bfloat16", task="embed").info()
    assert info.attention == "sdpa_padded"
    assert info.attention_passed_over[1:] == [
        "torch_varlen: takes no logit soft-capping, and the model soft-caps its attention logits",
        attention.EAGER_SOFTCAP,
    ]
    with pytest.raises(InvalidRequestError, match="soft-caps its attention logits"):
        Engine.from_pretrained(
            str(gemma2), dtype="bfloat16", task="embed", attention="torch_varlen"
        )


def test_a_flash_attn_without_softcap_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn before 2.6 has no ``softcap``: a capping model is not given it."""

    def old_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
        raise AssertionError("never called")

    assert attention.flash_softcap_error(old_flash) is not None
    assert attention.flash_softcap_error(pretend_cuda(monkeypatch).flash) is None
    facts = attention.AttentionFacts(
        device_type="cuda",
        dtype=torch.bfloat16,
        head_dim=256,
        capability=(9, 0),
        flash_attn_error=attention.flash_softcap_error(old_flash),
        torch_varlen_error=None,
        softcap=True,
    )
    choice = attention.select_backend("auto", facts)
    assert choice.backend is attention.Backend.SDPA_PADDED
    assert "flash_attn: this flash-attn takes no softcap" in choice.passed_over[0]


def test_null_cap_serves_plain_attention(tmp_path: Path) -> None:
    """attn_logit_softcapping: null turns capping off, in transformers and here: the
    fused kernels serve it and nothing is said about eager attention."""
    path = _save(tmp_path / "nocap", attn_logit_softcapping=None)
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False, task="embed")
    assert engine.info().attention_passed_over == []
    seqs = _sequences(engine.info().vocab_size)
    assert_rows_close(engine.embed_tokens(seqs), cases.eager_states(path, seqs), F32_COSINE)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"is_causal": False}, "bidirectional attention"),
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be a positive"),
        ({"hidden_activation": "relu"}, "activation 'relu' is not supported"),
    ],
)
def test_configs_not_served_exactly_are_refused_before_weights(
    gemma2: Path, tmp_path: Path, flags: dict[str, Any], says: str
) -> None:
    """Refused from config.json alone (the weights are removed: the refusal comes first)."""
    path = rewrite_checkpoint(gemma2, tmp_path / "g", config=flags)
    (path / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match=says):
        Engine.from_pretrained(str(path), dtype="float32", task="embed")


def test_auto_backend_serves_gemma2_natively(gemma2: Path) -> None:
    config = json.loads((gemma2 / "config.json").read_text())
    assert config["model_type"] == "gemma2"
    engine = Engine.from_pretrained(str(gemma2), dtype="float32", task="embed")
    assert engine.info().backend == "native"
    assert engine.info().pooling == "last"

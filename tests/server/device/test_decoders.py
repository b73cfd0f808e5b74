"""Bidirectional decoders and the projection heads shipped beside them (voyage-4-nano).

voyage-4-nano is a ``qwen3`` checkpoint with ``use_bidirectional_attention: true``, its body
under ``model.`` and a top-level ``linear.weight`` (no bias) projecting 1024 -> 2048 after
the final norm (``num_labels: 2048``). A tiny Qwen3 is rewritten into that shape, and each
bidirectional flag checkpoints use is checked against transformers' own Qwen3 with
``is_causal=False`` (which transformers 5's masks honour) followed by a torch Linear: one
packed batch of mixed lengths, in float32 and bfloat16. A tensor the code does not read, or
a projection that does not fit, refuses the load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from transformers import AutoModel

from tests.support.attention import assert_rows_close
from tests.support.models import build_decoder, rewrite_checkpoint

PROJECTED = 48  # the projection's output width, unlike the hidden size (32)
BF16_COSINE = 0.999
FLAGS = {
    "use_bidirectional_attention": {"use_bidirectional_attention": True},
    "is_causal": {"is_causal": False},
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_decoder(tmp_path_factory.mktemp("voyage") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def projection() -> torch.Tensor:
    torch.manual_seed(28)
    return 0.2 * torch.randn(PROJECTED, 32)


def voyage_shaped(
    src: Path, dst: Path, projection: torch.Tensor, flags: dict[str, Any], **extra: Any
) -> Path:
    """``src`` (a Qwen3Model checkpoint) as voyage-4-nano ships: ``model.`` names, a
    top-level ``linear.weight``, the flag, ``num_labels`` and custom code named."""
    return rewrite_checkpoint(
        src,
        dst,
        rename=lambda name: "model." + name,
        add={"linear.weight": projection, **extra},
        config={
            **flags,
            "num_labels": PROJECTED,
            "architectures": ["VoyageQwen3BidirectionalEmbedModel"],
            "auto_map": {"AutoModel": "modeling_voyage.VoyageQwen3BidirectionalEmbedModel"},
        },
    )


def reference(
    src: Path, seqs: list[list[int]], projection: torch.Tensor, causal: bool
) -> list[np.ndarray]:
    """transformers' Qwen3 (eager attention, each sequence alone), then the projection."""
    model = AutoModel.from_pretrained(str(src), attn_implementation="eager").eval()
    model.config.is_causal = causal
    with torch.no_grad():
        return [
            F.linear(model(input_ids=torch.tensor([seq])).last_hidden_state[0], projection).numpy()
            for seq in seqs
        ]


def mixed_sequences(engine: Engine) -> list[list[int]]:
    seqs = engine.tokenize(["hi", "The quick brown fox jumps over the lazy dog.", "tokens " * 12])
    return [*seqs, [seqs[0][0]], engine.tokenize("long " * 40)[0]]


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_bidirectional_flag_and_projection_match_transformers(
    qwen3: Path, projection: torch.Tensor, tmp_path: Path, flag: str
) -> None:
    path = voyage_shaped(qwen3, tmp_path / "voyage", projection, FLAGS[flag])
    engine = Engine.from_pretrained(str(path), dtype="float32")
    info = engine.info()
    assert (info.hidden_size, info.dimensions) == (PROJECTED, PROJECTED)
    seqs = mixed_sequences(engine)
    assert len({len(s) for s in seqs}) >= 4
    ours = engine.embed_tokens(seqs)  # one packed batch, states after the projection
    want = reference(qwen3, seqs, projection, causal=False)
    for seq, got, expected in zip(seqs, ours, want, strict=True):
        assert got.shape == expected.shape == (len(seq), PROJECTED)
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)
    # The flag is what makes the difference: run causally, every token but the last of a
    # sequence would have seen less of it.
    causal = reference(qwen3, seqs, projection, causal=True)
    assert not np.allclose(ours[2][:-1], causal[2][:-1], atol=1e-3)
    bf16 = Engine.from_pretrained(str(path), dtype="bfloat16").embed_tokens(seqs)
    assert_rows_close(bf16, want, min_cosine=BF16_COSINE)
    pooled = engine.embed(["a sentence"])
    assert pooled.shape == (1, PROJECTED)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"projection.weight": torch.zeros(8, 32)}, "projection.weight"),
        ({"model.adapter.weight": torch.zeros(8, 32)}, "model.adapter.weight"),
    ],
)
def test_an_unknown_extra_tensor_refuses_the_load_naming_it(
    qwen3: Path,
    projection: torch.Tensor,
    tmp_path: Path,
    extra: dict[str, torch.Tensor],
    named: str,
) -> None:
    path = voyage_shaped(qwen3, tmp_path / "voyage", projection, FLAGS["is_causal"], **extra)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path))
    message = str(refused.value)
    assert named in message and str(path) in message and "1 tensor(s)" in message


def test_a_projection_that_does_not_fit_is_refused(
    qwen3: Path, projection: torch.Tensor, tmp_path: Path
) -> None:
    wrong_input = voyage_shaped(qwen3, tmp_path / "wide", torch.zeros(PROJECTED, 16), {})
    with pytest.raises(UnsupportedModelError, match="48x16 but hidden_size is 32"):
        Engine.from_pretrained(str(wrong_input))
    mislabelled = voyage_shaped(qwen3, tmp_path / "labels", projection, {})
    cfg = json.loads((mislabelled / "config.json").read_text())
    (mislabelled / "config.json").write_text(json.dumps({**cfg, "num_labels": 64}))
    with pytest.raises(
        UnsupportedModelError, match=r"48 outputs but config\.json says num_labels 64"
    ):
        Engine.from_pretrained(str(mislabelled))


def test_contradicting_causality_flags_are_refused(qwen3: Path, tmp_path: Path) -> None:
    path = rewrite_checkpoint(
        qwen3, tmp_path / "both", config={"is_causal": True, "use_bidirectional_attention": True}
    )
    with pytest.raises(UnsupportedModelError, match="is_causal: true and use_bidirectional"):
        Engine.from_pretrained(str(path))


def test_gemma3_refuses_is_causal_false_it_does_not_implement(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    path = rewrite_checkpoint(
        tiny_model("gemma3_text"), tmp_path / "g", config={"is_causal": False}
    )
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention: true"):
        Engine.from_pretrained(str(path))

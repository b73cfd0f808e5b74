"""NVIDIA's bidirectional Llama (``llama_bidirec``: llama-nemotron-embed-1b-v2).

transformers has no ``llama_bidirec`` class: the Hub checkpoint runs NVIDIA's custom
``LlamaBidirectionalModel``, a LlamaModel whose layers attend both ways. So the reference is
transformers' own ``LlamaModel`` (eager attention) given a full bidirectional mask (an
explicit all-zero 4-D additive mask: every token sees every token of its sequence), each
sequence alone. A tiny Llama saved by transformers is rewritten into the Hub's shape
(``model_type: llama_bidirec``, ``LlamaBidirectionalModel``, its ``auto_map`` and
``pooling: avg``, llama3 rope scaling) and served from one packed batch of mixed lengths:
token states and mean-pooled vectors, cosine >= 0.99999 (and 2e-5 absolute) in float32,
>= 0.999 in bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from transformers import AutoModel

from tests.support.attention import assert_rows_close
from tests.support.device_cases import assert_token_states_match
from tests.support.llama_bidirec import EMBED_CONFIG, LLAMA3_ROPE
from tests.support.models import build_decoder, rewrite_checkpoint

F32_COSINE, BF16_COSINE = 0.99999, 0.999


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_decoder(
        tmp_path_factory.mktemp("nemotron") / "llama", "llama", rope_parameters=LLAMA3_ROPE
    )


@pytest.fixture(scope="module")
def nemotron(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rewrite_checkpoint(
        llama, tmp_path_factory.mktemp("nemotron") / "hub", config=EMBED_CONFIG
    )


def _reference(
    llama: Path, seqs: list[list[int]], dtype: torch.dtype, *, causal: bool = False
) -> list[np.ndarray]:
    """transformers' LlamaModel on each sequence alone, with a full bidirectional mask (or,
    ``causal``, its own causal one)."""
    model = AutoModel.from_pretrained(str(llama), attn_implementation="eager", dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            mask = None if causal else torch.zeros(1, 1, len(seq), len(seq), dtype=dtype)
            state = model(input_ids=ids, attention_mask=mask).last_hidden_state[0]
            out.append(state.float().numpy())
    return out


def _sequences(engine: Engine) -> list[list[int]]:
    seqs = engine.tokenize(["hi", "The quick brown fox jumps over the lazy dog.", "tokens " * 12])
    return [*seqs, [seqs[0][0]], engine.tokenize("long " * 40)[0]]


@pytest.mark.parametrize(("dtype", "cosine"), [("float32", F32_COSINE), ("bfloat16", BF16_COSINE)])
@pytest.mark.parametrize("kernel", ["sdpa_bucketed", "sdpa_padded"])
def test_packed_batch_matches_bidirectional_llama(
    llama: Path, nemotron: Path, kernel: str, dtype: str, cosine: float
) -> None:
    engine = Engine.from_pretrained(str(nemotron), dtype=dtype, normalize=False, attention=kernel)
    info = engine.info()
    assert (info.backend, info.pooling, info.task) == ("native", "mean", "embed")
    seqs = _sequences(engine)
    assert len({len(s) for s in seqs}) >= 4
    want = _reference(llama, seqs, getattr(torch, dtype))
    assert_token_states_match(seqs, engine.embed_tokens(seqs), want, cosine, dtype)
    assert_rows_close(engine.embed(seqs), [w.mean(0) for w in want], cosine)


def test_attention_is_bidirectional_without_any_flag(llama: Path, nemotron: Path) -> None:
    """The Hub config carries no causality flag; the model type alone makes every token
    see the whole input: run causally, every state but the last would differ."""
    engine = Engine.from_pretrained(str(nemotron), dtype="float32", normalize=False)
    seqs = _sequences(engine)
    got = engine.embed_tokens(seqs)
    causal = _reference(llama, seqs, torch.float32, causal=True)
    assert not np.allclose(got[2][:-1], causal[2][:-1], atol=1e-3)


def test_is_causal_true_is_refused_before_weights(nemotron: Path, tmp_path: Path) -> None:
    path = rewrite_checkpoint(nemotron, tmp_path / "n", config={"is_causal": True})
    (path / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="bidirectionally by definition"):
        Engine.from_pretrained(str(path), dtype="float32")


def test_a_stray_head_is_refused_and_a_reranker_is_a_reranker(
    nemotron: Path, tmp_path: Path
) -> None:
    """A head tensor in an embedder's checkpoint is refused naming the tensor; the same
    weights under nemotron-rerank's architecture name are served as that reranker (task
    score, mean pooling; its parity is test_nemotron_rerank.py's), never as an embedder."""
    stray = rewrite_checkpoint(
        nemotron, tmp_path / "stray", add={"score.weight": torch.zeros(1, 32)}
    )
    with pytest.raises(UnsupportedModelError, match=r"score\.weight"):
        Engine.from_pretrained(str(stray), dtype="float32")
    path = rewrite_checkpoint(
        nemotron,
        tmp_path / "rerank",
        add={"score.weight": torch.zeros(1, 32)},
        config={"architectures": ["LlamaBidirectionalForSequenceClassification"]},
    )
    info = Engine.from_pretrained(str(path), dtype="float32").info()
    assert (info.task, info.pooling) == ("score", "mean")

"""Cases and checks the device-plane tests share: the packed-batch texts of the BERT-shaped
families, the comparisons against transformers, the edited copies of a checkpoint that must be
refused, and the reference computations several families run the same way."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from tests.support.attention import assert_rows_close
from tests.support.models import _save_tokenizer, build_xlm_roberta, byte_tokenizer, spread_weights

F32_COSINE, BF16_COSINE = 0.99999, 0.999

TEXTS = [
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "short one",
    "packed batches of mixed lengths must not leak into each other " * 3,
]
"""Mixed lengths for one packed batch, the longest past a few dozen tokens."""
QUERIES = ["what is a fox?", "q", "where do cats sleep in the winter months?", "x y z"]
DOCS = ["the fox is an animal", "d", "cats sleep anywhere warm " * 6, "nothing at all"]

KERNEL_RATIOS = [
    ("sdpa_bucketed", 1.0),  # exact-length buckets
    ("sdpa_bucketed", 0.5),  # padded buckets
    ("sdpa_padded", 1.0),  # the whole batch padded to its longest, one call per layer
]
"""(attention kernel, bucket ratio): the layouts a packed batch can run in."""


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity."""
    return np.sum(got * want, axis=-1) / (
        np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1)
    )


def assert_matches(got: np.ndarray, want: np.ndarray, min_cosine: float) -> None:
    """Rows agree in direction; in float32 (``min_cosine`` F32_COSINE) also to 2e-5."""
    assert got.shape == want.shape
    assert cosines(got, want).min() >= min_cosine, cosines(got, want).min()
    if min_cosine == F32_COSINE:
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def flat_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine of two arrays taken whole, in float64."""
    x, y = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def assert_token_states_match(
    seqs: list[list[int]],
    got: list[np.ndarray],
    want: list[np.ndarray],
    cosine: float,
    dtype: str,
    hidden_size: int = 32,
) -> None:
    """One (length, hidden_size) state per token, close to the reference row by row; in
    float32 also to 2e-5."""
    for seq, g, w in zip(seqs, got, want, strict=True):
        assert g.shape == w.shape == (len(seq), hidden_size)
    assert_rows_close(got, want, cosine)
    if dtype == "float32":
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)


def bert_sequences(lengths: list[int]) -> list[list[int]]:
    """[CLS] random word ids [SEP] of each length (a lone [CLS] for 1)."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for n in lengths:
        body = torch.randint(1000, 30000, (max(n - 2, 0),), generator=generator).tolist()
        out.append([101] if n == 1 else [101, *body, 102])
    return out


def eager_states(
    path: Path, seqs: list[list[int]], dtype: torch.dtype = torch.float32, **config: Any
) -> list[np.ndarray]:
    """transformers' last hidden states (eager attention, in ``dtype``, with ``config``
    overriding the checkpoint's), each sequence alone, as float32."""
    model = AutoModel.from_pretrained(
        str(path), attn_implementation="eager", dtype=dtype, **config
    ).eval()
    with torch.no_grad():
        return [
            model(input_ids=torch.tensor([s])).last_hidden_state[0].float().numpy() for s in seqs
        ]


def punctuation_skiplist(path: Path) -> set[int]:
    """ColBERT's punctuation skip-list: each symbol's first token id."""
    tok = AutoTokenizer.from_pretrained(str(path))
    return {tok.encode(s, add_special_tokens=False)[0] for s in string.punctuation}


def edit_config(path: Path, **changes: Any) -> Path:
    """Update ``path``'s config.json in place with ``changes``."""
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def edited_copy(src: Path, target: Path, **changes: Any) -> Path:
    """A copy of the checkpoint at ``src`` with ``changes`` written into its config.json."""
    shutil.copytree(src, target)
    return edit_config(target, **changes)


def assert_refused(path: Path, match: str) -> None:
    """Loading ``path`` in float32 raises UnsupportedModelError matching ``match``."""
    with pytest.raises(UnsupportedModelError, match=match):
        Engine.from_pretrained(str(path), dtype="float32")


def build_roberta(path: Path) -> Path:
    """RoBERTa as all-roberta-large-v1 ships it: XLM-R's architecture and weight names under
    ``model_type: roberta``."""
    build_xlm_roberta(path)
    return edit_config(path, model_type="roberta", architectures=["RobertaModel"])


def save_byte_decoder(
    path: Path,
    model_type: str,
    config: dict[str, Any],
    *,
    specials: list[str],
    template: str,
    bos: str,
    eos: str,
    seed: int,
    causal_lm: bool = False,
    damp: float | None = None,
) -> Path:
    """A tiny random decoder of ``model_type`` (``config``) with a byte-level tokenizer whose
    specials are ``specials`` (pad first, unk last) and whose template is ``template``; the
    weights spread, then (``damp``) every matrix but the embeddings scaled down."""
    path.mkdir(parents=True, exist_ok=True)
    template_tokens = [t for t in specials if t in template.split()]
    tok = byte_tokenizer(specials, template, template_tokens)
    _save_tokenizer(
        tok, path, bos_token=bos, eos_token=eos, pad_token=specials[0], unk_token=specials[-1]
    )
    torch.manual_seed(seed)
    auto_config = AutoConfig.for_model(model_type, vocab_size=tok.get_vocab_size(), **config)
    model = (AutoModelForCausalLM if causal_lm else AutoModel).from_config(auto_config)
    spread_weights(model)
    if damp is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() > 1 and "embed" not in name:
                    param.mul_(damp)
    model.save_pretrained(str(path))
    return path

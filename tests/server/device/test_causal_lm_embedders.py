"""Qwen3-Embedding's own layout: a ``Qwen3ForCausalLM`` checkpoint served as an embedder.

Qwen/Qwen3-Embedding-0.6B ships ``architectures: ["Qwen3ForCausalLM"]`` with
sentence-transformers files: last-token pooling on the ``<|endoftext|>`` its tokenizer
appends, Normalize, and a ``query`` prompt. The other decoder pipeline test uses a bare
``Qwen3Model``; this one saves the causal LM (``model.`` prefix and an ``lm_head`` the
server must leave unread) and checks one batch of mixed lengths against
sentence-transformers' ``encode``, with and without the prompt: float32 cosine >= 0.99999,
bfloat16 >= 0.999.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from embedding_server.engine import Engine
from safetensors import safe_open
from sentence_transformers import SentenceTransformer

from tests.support.attention import assert_rows_close
from tests.support.models import add_sentence_transformers, build_decoder

TEXTS = ["a", "what is the capital of China?", "gravity " * 30, "x y", "the last token is EOS"]
PROMPT = "Instruct: Given a web search query, retrieve relevant passages\nQuery: "


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory: pytest.TempPathFactory) -> Path:
    body = build_decoder(
        tmp_path_factory.mktemp("qwen3-embedding") / "qwen3", "qwen3", causal_lm=True
    )
    path = add_sentence_transformers(body, pooling="lasttoken", prompts={"query": PROMPT})
    # sentence-transformers saves the bare body it loaded; put the causal LM's files back.
    for name in ("config.json", "model.safetensors"):
        shutil.copy(body / name, path / name)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    return path


def test_the_checkpoint_holds_the_causal_lm(qwen3_embedding: Path) -> None:
    """The layout under test really is the causal LM's, head included."""
    with safe_open(str(qwen3_embedding / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "lm_head.weight" in names
    assert any(name.startswith("model.layers.") for name in names)


@pytest.mark.parametrize(("dtype", "min_cosine"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_vectors_are_sentence_transformers(
    qwen3_embedding: Path, dtype: str, min_cosine: float
) -> None:
    engine = Engine.from_pretrained(str(qwen3_embedding), dtype=dtype)
    info = engine.info()
    assert (info.backend, info.task, info.pooling, info.normalize) == (
        "native",
        "embed",
        "last",
        True,
    )
    st = SentenceTransformer(str(qwen3_embedding), device="cpu")
    for prompt_name in (None, "query"):
        want = st.encode(TEXTS, prompt_name=prompt_name)
        assert_rows_close(engine.embed(TEXTS, prompt_name=prompt_name), want, min_cosine)

"""Mean-pooled checkpoints whose bodies were tested but whose vectors were not.

vLLM's embedding docs name checkpoints of layouts that the other parity tests cover only as
hidden states: sentence-transformers/all-roberta-large-v1 (``roberta``), intfloat's
multilingual-e5 (``xlm-roberta``) and shibing624/text2vec-base-chinese-sentence (``ernie``),
each with sentence-transformers' mean pooling; intfloat/e5-small, a BERT without
sentence-transformers files whose model card mean-pools by hand (served with
``--pooling mean``); and ssmits/Qwen2-7B-Instruct-embed-base, a ``Qwen2Model`` whose
sentence-transformers config vLLM's docs call improperly defined and serve with mean
pooling. A tiny checkpoint of each layout runs as one packed batch of mixed lengths, against
the authors' computation: sentence-transformers, or the model card's ``average_pool`` over
transformers' padded batch. float32 >= 0.99999 cosine, bfloat16 >= 0.999.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.engine import Engine
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer

from tests.support.attention import assert_rows_close
from tests.support.bert_families import build_family
from tests.support.device_cases import build_roberta
from tests.support.models import add_sentence_transformers, build_decoder, build_xlm_roberta

TEXTS = [
    "a",
    "query: how much protein should a female eat",
    "passage: " + "the same words again and again " * 6,
    "x y",
    "seven words are in this one here",
]
DTYPES = [("float32", 0.99999), ("bfloat16", 0.999)]


BODIES: dict[str, Callable[[Path], Path]] = {
    "roberta": build_roberta,  # all-roberta-large-v1
    "xlm-roberta": build_xlm_roberta,  # multilingual-e5-base
    "ernie": lambda path: build_family(path, "ernie"),  # text2vec-base-chinese-sentence
}


@pytest.fixture(scope="module")
def st_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mean-pooled")
    return {
        name: add_sentence_transformers(build(root / name), pooling="mean")
        for name, build in BODIES.items()
    }


def _average_pool(path: Path, texts: list[str]) -> np.ndarray:
    """intfloat/e5's model card: mean of the last hidden states under the attention mask of
    one padded batch, then L2-normalized."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].to(states.dtype)
    pooled = (states * mask).sum(dim=1) / mask.sum(dim=1)
    return F.normalize(pooled, p=2, dim=1).numpy()


@pytest.mark.parametrize(("dtype", "min_cosine"), DTYPES)
@pytest.mark.parametrize("model_type", list(BODIES))
def test_sentence_transformers_mean_pooling_matches(
    st_models: dict[str, Path], model_type: str, dtype: str, min_cosine: float
) -> None:
    path = st_models[model_type]
    engine = Engine.from_pretrained(str(path), dtype=dtype)
    info = engine.info()
    assert (info.backend, info.pooling, info.normalize) == ("native", "mean", True)
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    got = engine.embed(TEXTS)
    assert got.shape == want.shape
    assert_rows_close(got, want, min_cosine=min_cosine)


@pytest.mark.parametrize(("dtype", "min_cosine"), DTYPES)
def test_e5_without_sentence_transformers_files_is_the_model_cards_average_pool(
    tiny_model: Callable[[str], Path], dtype: str, min_cosine: float
) -> None:
    """e5-small ships no 1_Pooling: the server would take the first token, as it does for
    any encoder without one, so e5's mean has to be asked for."""
    path = tiny_model("bert")
    assert not (path / "modules.json").exists()
    want = _average_pool(path, TEXTS)
    engine = Engine.from_pretrained(str(path), dtype=dtype, pooling="mean", normalize=True)
    assert_rows_close(engine.embed(TEXTS), want, min_cosine=min_cosine)
    first_token = Engine.from_pretrained(str(path), dtype="float32", normalize=True)
    assert first_token.info().pooling == "cls"
    cosine = np.sum(first_token.embed(TEXTS) * want, axis=1)
    assert cosine.min() < 0.99, "without --pooling mean the vectors would be e5's anyway"


@pytest.mark.parametrize(("dtype", "min_cosine"), DTYPES)
def test_a_qwen2_model_served_with_mean_pooling(
    tmp_path: Path, dtype: str, min_cosine: float
) -> None:
    """Qwen2-7B-Instruct-embed-base's layout: a bare causal ``Qwen2Model``, mean-pooled as
    vLLM's docs tell (``--pooler-config '{"pooling_type": "MEAN"}'``)."""
    path = build_decoder(tmp_path / "qwen2", "qwen2")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2Model"]
    want = _average_pool(path, TEXTS)
    engine = Engine.from_pretrained(str(path), dtype=dtype, pooling="mean", normalize=True)
    assert engine.info().pooling == "mean"
    assert_rows_close(engine.embed(TEXTS), want, min_cosine=min_cosine)

"""NVIDIA's bidirectional Llama reranker (llama-nemotron-rerank-1b-v2:
``LlamaBidirectionalForSequenceClassification``, model_type ``llama_bidirec``) on /score and
/rerank.

Its custom code (not run) is a LlamaModel attending both ways, pooled by the config's
``pooling`` (``avg``: the mean over the tokens), then ``score`` (no bias) divided by the
config's ``temperature``; the model card (and vLLM's nemotron-rerank.jinja) makes each pair
one text, ``question:{query} \\n \\n passage:{passage}``, tokenized with the tokenizer's
special tokens. So the reference is transformers' own LlamaModel (eager attention) with a
full bidirectional mask on each pair's text alone, then that pooling and head, and the
sigmoid vLLM's /score applies to a one-label head. A tiny Llama saved by transformers is
rewritten into the Hub's layout (``model.`` prefix, ``score.weight``, the config's
``pooling``, ``temperature`` and ``auto_map``) and served from one packed batch of mixed
lengths.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from embedding_server.settings import ServerSettings
from transformers import AutoModel, AutoTokenizer

from tests.support.api import running_server
from tests.support.device_cases import assert_refused_before_weights
from tests.support.llama_bidirec import LLAMA3_ROPE, hub_config
from tests.support.models import build_decoder, rewrite_checkpoint

HUB_CONFIG = hub_config(
    "LlamaBidirectionalForSequenceClassification",
    "AutoModelForSequenceClassification",
    id2label={"0": "LABEL_0"},
    label2id={"LABEL_0": 0},
)
QUERY = "how much protein should a female eat?"
DOCUMENTS = [
    "As a general guideline, the CDC's average requirement of protein for women is 46 grams.",
    "Definition of summit: the highest point of a mountain.",
    "Calorie intake should not fall below 1,200 a day in women.",
    "x",
    "very long passage " * 20,  # past the 256-token limit: its end is cut
]
POOLING = {"avg": lambda s: s.mean(0), "last": lambda s: s[-1], "cls": lambda s: s[0]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_decoder(
        tmp_path_factory.mktemp("rerank") / "llama", "llama", rope_parameters=LLAMA3_ROPE
    )


def _score_weight() -> torch.Tensor:
    return torch.randn(1, 32, generator=torch.Generator().manual_seed(11)) * 0.5


def _hub(llama: Path, dst: Path, **config: object) -> Path:
    return rewrite_checkpoint(
        llama,
        dst,
        rename=lambda name: name if name.startswith("model.") else "model." + name,
        add={"score.weight": _score_weight()},
        config={**HUB_CONFIG, **config},
    )


@pytest.fixture(scope="module")
def nemotron(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hub(llama, tmp_path_factory.mktemp("rerank") / "hub")


def _reference(
    llama: Path,
    documents: list[str],
    *,
    limit: int,
    dtype: torch.dtype = torch.float32,
    pooling: str = "avg",
    temperature: float = 1.0,
) -> np.ndarray:
    """The authors' computation: each pair's text through the bidirectional LlamaModel,
    pooled, scored, divided by the temperature; then /score's sigmoid."""
    tok = AutoTokenizer.from_pretrained(str(llama))
    model = AutoModel.from_pretrained(str(llama), attn_implementation="eager", dtype=dtype).eval()
    logits = []
    with torch.no_grad():
        for document in documents:
            text = f"question:{QUERY} \n \n passage:{document}"
            ids = tok(text, truncation=True, max_length=limit, return_tensors="pt").input_ids
            mask = torch.zeros(1, 1, ids.shape[1], ids.shape[1], dtype=dtype)
            states = model(input_ids=ids, attention_mask=mask).last_hidden_state[0].float()
            pooled = POOLING[pooling](states)
            logits.append(float(pooled @ _score_weight()[0]) / temperature)
    scores: np.ndarray = 1.0 / (1.0 + np.exp(-np.asarray(logits)))
    return scores


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_scores_match_the_authors_computation(
    llama: Path, nemotron: Path, dtype: str, atol: float
) -> None:
    engine = Engine.from_pretrained(str(nemotron), dtype=dtype)
    info = engine.info()
    assert (info.backend, info.task, info.pooling) == ("native", "score", "mean")
    limit = info.max_input_tokens
    want = _reference(llama, DOCUMENTS, limit=limit, dtype=getattr(torch, dtype))
    got = engine.score(QUERY, DOCUMENTS)
    assert got.shape == (len(DOCUMENTS),)
    np.testing.assert_allclose(got, want, atol=atol)
    ranked = engine.rerank(QUERY, DOCUMENTS, top_n=3).results
    assert [r.index for r in ranked] == list(np.argsort(-want, kind="stable")[:3])


@pytest.mark.parametrize(("pooling", "temperature"), [("last", 2.0), ("cls", 0.5)])
def test_the_configs_pooling_and_temperature_apply(
    llama: Path, tmp_path: Path, pooling: str, temperature: float
) -> None:
    path = _hub(llama, tmp_path / "hub", pooling=pooling, temperature=temperature)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    limit = engine.info().max_input_tokens
    want = _reference(llama, DOCUMENTS, limit=limit, pooling=pooling, temperature=temperature)
    np.testing.assert_allclose(engine.score(QUERY, DOCUMENTS), want, atol=1e-4)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"pooling": "max"}, "pooling 'max' is not supported"),
        ({"temperature": 0}, "temperature must be a positive number"),
        ({"is_causal": True}, "bidirectionally by definition"),
    ],
)
def test_configs_it_cannot_serve_exactly_are_refused_before_weights(
    nemotron: Path, tmp_path: Path, config: dict[str, object], match: str
) -> None:
    assert_refused_before_weights(nemotron, tmp_path / "n", config, match)


def test_single_texts_and_prompts_are_refused(nemotron: Path) -> None:
    """Its score means something only for a pair inside its fixed prompt."""
    engine = Engine.from_pretrained(str(nemotron), dtype="float32")
    with pytest.raises(InvalidRequestError, match="inside its prompt"):
        engine.classify(["a lone text"])
    with pytest.raises(InvalidRequestError, match="its prompt is fixed"):
        engine.score(QUERY, DOCUMENTS[:1], prompt="Rank these")


def test_a_score_bias_is_refused_not_dropped(nemotron: Path, tmp_path: Path) -> None:
    """Its score layer has no bias: one in the checkpoint is not the model's."""
    path = rewrite_checkpoint(nemotron, tmp_path / "b", add={"score.bias": torch.ones(1)})
    with pytest.raises(UnsupportedModelError, match=r"score\.bias"):
        Engine.from_pretrained(str(path), dtype="float32")


def test_score_and_rerank_over_http(llama: Path, nemotron: Path) -> None:
    documents = DOCUMENTS[:4]  # HTTP refuses an input past the limit unless asked to cut
    want = _reference(llama, documents, limit=256)
    with running_server(ServerSettings(model=str(nemotron), dtype="float32")) as server:
        score = httpx.post(
            server.url + "/score", json={"text_1": QUERY, "text_2": documents}, timeout=60
        )
        assert score.status_code == 200, score.text
        got = [row["score"] for row in score.json()["data"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
        rerank = httpx.post(
            server.url + "/rerank", json={"query": QUERY, "documents": documents}, timeout=60
        )
        assert rerank.status_code == 200, rerank.text
        results = rerank.json()["results"]
        assert [r["index"] for r in results] == list(np.argsort(-want, kind="stable"))
        np.testing.assert_allclose(
            [r["relevance_score"] for r in results], np.sort(want)[::-1], atol=1e-4
        )

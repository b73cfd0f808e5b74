"""``--quantization int8``'s quality bar on the packaged all-MiniLM-L6-v2: every text of a
fixed corpus at cosine >= 0.99 against float32, and retrieval nDCG@10 within 1% of float32's
through mteb.

No published mteb retrieval task runs offline here (their data is downloaded), so the
retrieval sets are local: test_mteb.py's LocalRetrieval (5 queries, 10 documents, prompts on)
and a larger one built from its STS pairs (each first sentence a query, every second sentence
a document, a pair's own partner relevant when its gold similarity is >= 3), scored by
mteb.evaluate like any mteb task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from datasets import Dataset
from embedding_server.engine import Engine
from embedding_server.evaluation import MtebEncoder
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.task_metadata import TaskMetadata

from bench.corpus import make_corpus
from tests.server.test_mteb import (
    _METADATA,
    CORPUS,
    QUERIES,
    STS_PAIRS,
    LocalRetrieval,
    evaluate,
)
from tests.support.models import minilm_with_prompts

pytestmark = pytest.mark.timeout(300)

RELEVANT_SIMILARITY = 3.0


class PairRetrieval(AbsTaskRetrieval):
    """STS pairs as retrieval: find a sentence's paraphrase among all second sentences."""

    metadata = TaskMetadata(
        name="PairRetrieval", type="Retrieval", main_score="ndcg_at_10", **_METADATA
    )

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        relevant = {
            f"q{i}": {f"d{i}": 1}
            for i, (_, _, score) in enumerate(STS_PAIRS)
            if score >= RELEVANT_SIMILARITY
        }
        split = RetrievalSplitData(
            queries=Dataset.from_list(
                [{"id": q, "text": STS_PAIRS[int(q[1:])][0]} for q in relevant]
            ),
            corpus=Dataset.from_list(
                [{"id": f"d{i}", "text": b, "title": ""} for i, (_, b, _) in enumerate(STS_PAIRS)]
            ),
            relevant_docs=relevant,
            top_ranked=None,
        )
        self.dataset = {"default": {"test": split}}
        self.data_loaded = True


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb-cache"))


@pytest.fixture(scope="module")
def minilm_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM with test_mteb.py's query/document prompts (LocalRetrieval's scores there are
    with them)."""
    return minilm_with_prompts(tmp_path_factory.mktemp("minilm-prompts") / "minilm")


@pytest.fixture(scope="module")
def engines(minilm_prompts: Path) -> tuple[Engine, Engine]:
    return (
        Engine.from_pretrained(str(minilm_prompts), dtype="float32"),
        Engine.from_pretrained(str(minilm_prompts), quantization="int8"),
    )


def corpus() -> list[str]:
    """bench.offline's mixed-length corpus (4 to 200 words) and the retrieval sets' texts."""
    sentences = [s for a, b, _ in STS_PAIRS for s in (a, b)]
    return make_corpus(64, seed=34) + sentences + list(QUERIES.values()) + list(CORPUS.values())


def test_int8_embeddings_are_within_cosine_0_99_of_float32_on_every_text(
    engines: tuple[Engine, Engine],
) -> None:
    float32, int8 = engines
    assert int8.info().quantization == "int8"
    texts = corpus()
    a, b = np.asarray(float32.embed(texts)), np.asarray(int8.embed(texts))
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.shape == (len(texts),)
    worst = int(cos.argmin())
    assert cos.min() >= 0.99, f"text {worst} ({texts[worst][:60]!r}...) at cosine {cos.min()}"
    assert cos.min() < 1 - 1e-6  # the int8 path ran: these are not the float32 vectors


@pytest.mark.parametrize("task", [LocalRetrieval(), PairRetrieval()], ids=lambda t: t.metadata.name)
def test_int8_retrieval_ndcg_at_10_is_within_1_percent_of_float32(
    task: Any, engines: tuple[Engine, Engine]
) -> None:
    float32, int8 = engines
    reference = evaluate(MtebEncoder(float32), task)["ndcg_at_10"]
    assert reference > 0.5  # the task measures something
    quantized = evaluate(MtebEncoder(int8), task)["ndcg_at_10"]
    assert abs(quantized - reference) <= 0.01 * reference, (quantized, reference)

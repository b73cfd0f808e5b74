"""mteb evaluates a served model through ``embedding_server.evaluation``: ``mteb.evaluate`` on
small tasks built from local data (nothing can be downloaded here), through the wrapper over
the offline Engine and over a real server on 127.0.0.1, gives the scores that
sentence-transformers gets through mteb's own wrappers on the same tasks.

The embedder is the packaged all-MiniLM-L6-v2 with query/document prompts added to its
sentence-transformers config, so the retrieval task also checks that mteb's prompt type picks
the model's prompt; the cross-encoder is a tiny random BERT saved by CrossEncoder.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mteb
import numpy as np
import pytest
from datasets import Dataset, DatasetDict
from embedding_server.engine import Engine
from embedding_server.evaluation import MtebCrossEncoder, MtebEncoder, MtebMultiVectorEncoder
from embedding_server.settings import ServerSettings
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.sts import AbsTaskSTS
from mteb.abstasks.task_metadata import TaskMetadata
from mteb.models.abs_encoder import AbsEncoder

from tests.support.api import RunningServer, running_server
from tests.support.models import MINILM_DIR, build_bge_m3, minilm_with_prompts
from tests.support.tasks import build_classifier, save_cross_encoder

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-4
"""Our float32 forward pass and torch's differ by ~1e-6 per vector; metrics over rankings
and correlations move only if two scores swap, which 1e-4 would show."""

_METADATA: dict[str, Any] = {
    "description": "Local test task.",
    "reference": "https://example.invalid/local",
    "dataset": {"path": "local/none", "revision": "0"},
    "category": "t2t",
    "eval_splits": ["test"],
    "eval_langs": ["eng-Latn"],
    "date": ("2024-01-01", "2024-01-01"),
    "dialect": ["Written"],
    "domains": [],
    "task_subtypes": [],
    "license": "cc-by-4.0",
    "annotations_creators": "derived",
    "modalities": ["text"],
    "sample_creation": "found",
    "bibtex_citation": "",
}

STS_PAIRS: list[tuple[str, str, float]] = [
    ("A man is playing a guitar.", "A man plays the guitar.", 4.8),
    ("A woman is slicing an onion.", "Someone is cutting an onion.", 4.2),
    ("A dog runs through the grass.", "A puppy is running on a lawn.", 3.9),
    ("The cat sleeps on the sofa.", "A cat is napping on the couch.", 4.5),
    ("Two kids play football.", "Children are playing soccer.", 4.0),
    ("A man is cooking pasta.", "The stock market crashed today.", 0.1),
    ("It is raining in London.", "London has wet weather today.", 3.6),
    ("She reads a book in the park.", "A woman is reading outdoors.", 3.4),
    ("The train arrives at noon.", "A plane took off at midnight.", 1.0),
    ("A boy rides a bicycle.", "A child is cycling down the street.", 3.8),
    ("The chef tastes the soup.", "A cook samples the broth.", 4.1),
    ("He is fixing the car engine.", "A mechanic repairs a motor.", 3.5),
    ("The baby is laughing.", "An infant giggles.", 4.6),
    ("A bird sits on the fence.", "The economy grew by two percent.", 0.0),
    ("People are dancing at a party.", "A crowd dances at a celebration.", 4.3),
    ("The sun sets over the ocean.", "Sunset at the beach.", 3.7),
    ("A man is playing the piano.", "A man is playing a guitar.", 2.2),
    ("The teacher writes on the board.", "A student sleeps in class.", 1.2),
    ("A horse jumps over a fence.", "A horse is leaping a hurdle.", 4.4),
    ("The computer will not start.", "My laptop fails to boot.", 3.9),
    ("A woman is swimming in a pool.", "A man is hiking a mountain.", 0.6),
    ("Snow covers the mountains.", "The peaks are white with snow.", 4.0),
    ("The meeting was postponed.", "They moved the meeting to later.", 3.8),
    ("A girl paints a picture.", "A child is drawing with crayons.", 2.9),
]

QUERIES = {
    "q1": "how do cats spend the winter?",
    "q2": "what makes bread rise?",
    "q3": "when was the first moon landing?",
    "q4": "how to fix a flat bicycle tire",
    "q5": "why is the sky blue",
}
CORPUS = {
    "d1": "In winter, cats curl up near radiators and sleep most of the day.",
    "d2": "Yeast ferments sugar and releases carbon dioxide, which makes dough rise.",
    "d3": "Apollo 11 landed on the Moon on July 20, 1969.",
    "d4": "Remove the wheel, find the puncture, patch the inner tube and reinflate it.",
    "d5": "Sunlight is scattered by air molecules, and blue light scatters the most.",
    "d6": "Dogs need daily walks and a balanced diet.",
    "d7": "Baking soda is a chemical leavening agent used in cakes.",
    "d8": "The Space Shuttle program ended in 2011.",
    "d9": "Road bikes have thin tires inflated to high pressure.",
    "d10": "Sunsets look red because light travels through more atmosphere.",
}
RELEVANT = {
    "q1": {"d1": 1},
    "q2": {"d2": 1, "d7": 1},
    "q3": {"d3": 1},
    "q4": {"d4": 1, "d9": 1},
    "q5": {"d5": 1},
}


class LocalSTS(AbsTaskSTS):
    metadata = TaskMetadata(name="LocalSTS", type="STS", main_score="cosine_spearman", **_METADATA)
    min_score = 0
    max_score = 5

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        columns = {
            "sentence1": [a for a, _, _ in STS_PAIRS],
            "sentence2": [b for _, b, _ in STS_PAIRS],
            "score": [s for _, _, s in STS_PAIRS],
        }
        self.dataset = DatasetDict({"test": Dataset.from_dict(columns)})
        self.data_loaded = True


def _split(*, top_ranked: bool) -> RetrievalSplitData:
    return RetrievalSplitData(
        queries=Dataset.from_list([{"id": k, "text": v} for k, v in QUERIES.items()]),
        corpus=Dataset.from_list([{"id": k, "text": v, "title": ""} for k, v in CORPUS.items()]),
        relevant_docs=RELEVANT,
        top_ranked={q: list(CORPUS) for q in QUERIES} if top_ranked else None,
    )


class LocalRetrieval(AbsTaskRetrieval):
    metadata = TaskMetadata(
        name="LocalRetrieval", type="Retrieval", main_score="ndcg_at_10", **_METADATA
    )

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        self.dataset = {"default": {"test": _split(top_ranked=False)}}
        self.data_loaded = True


class LocalReranking(AbsTaskRetrieval):
    metadata = TaskMetadata(
        name="LocalReranking", type="Reranking", main_score="map_at_1000", **_METADATA
    )

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        self.dataset = {"default": {"test": _split(top_ranked=True)}}
        self.data_loaded = True


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb-cache"))


def evaluate(model: Any, task: Any) -> dict[str, float]:
    """Every numeric score of the task's one split (NaN ones, e.g. nAUC over a perfect
    ranking, left out)."""
    result = mteb.evaluate(model, task, cache=None, show_progress_bar=False)
    [task_result] = result.task_results
    [scores] = task_result.scores["test"]
    return {
        k: float(v)
        for k, v in scores.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def assert_same_scores(ours: dict[str, float], reference: dict[str, float]) -> None:
    assert set(ours) == set(reference)
    assert ours == pytest.approx(reference, abs=TOLERANCE)


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM with query/document prompts in its sentence-transformers config."""
    return minilm_with_prompts(tmp_path_factory.mktemp("minilm-prompts") / "minilm")


@pytest.fixture(scope="module")
def embed_engine(embedder_dir: Path) -> Engine:
    return Engine.from_pretrained(str(embedder_dir), dtype="float32")


@pytest.fixture(scope="module")
def embed_server(embedder_dir: Path) -> Iterator[RunningServer]:
    settings = ServerSettings(model=str(embedder_dir), dtype="float32", max_inputs_per_request=4)
    with running_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder(build_classifier(tmp_path_factory.mktemp("ce") / "bert", "bert", 1))


@pytest.fixture(scope="module")
def cross_server(cross_dir: Path) -> Iterator[RunningServer]:
    settings = ServerSettings(model=str(cross_dir), dtype="float32", max_inputs_per_request=7)
    with running_server(settings) as running:
        yield running


@pytest.mark.parametrize("task", [LocalSTS(), LocalRetrieval()], ids=lambda t: t.metadata.name)
def test_encoder_matches_sentence_transformers(
    task: Any, embedder_dir: Path, embed_engine: Engine, embed_server: RunningServer
) -> None:
    from mteb.models.sentence_transformer_wrapper import SentenceTransformerEncoderWrapper
    from sentence_transformers import SentenceTransformer

    reference = evaluate(
        SentenceTransformerEncoderWrapper(SentenceTransformer(str(embedder_dir), device="cpu")),
        task,
    )
    assert reference[task.metadata.main_score] > 0.5  # the task measures something
    assert_same_scores(evaluate(MtebEncoder(embed_engine), task), reference)
    assert_same_scores(evaluate(MtebEncoder(embed_server.url), task), reference)


def test_encoder_uses_the_prompt_for_the_prompt_type(
    embedder_dir: Path, embed_engine: Engine
) -> None:
    """Without the prompts the retrieval scores differ: the parity above is not vacuous."""
    from mteb.models.sentence_transformer_wrapper import SentenceTransformerEncoderWrapper
    from sentence_transformers import SentenceTransformer

    task = LocalRetrieval()
    plain = SentenceTransformer(str(MINILM_DIR), device="cpu")
    with_prompts = evaluate(MtebEncoder(embed_engine), task)
    without = evaluate(SentenceTransformerEncoderWrapper(plain), task)
    assert with_prompts != pytest.approx(without, abs=TOLERANCE)


def test_cross_encoder_matches_sentence_transformers(
    cross_dir: Path, cross_server: RunningServer
) -> None:
    from mteb.models.sentence_transformer_wrapper import CrossEncoderWrapper
    from sentence_transformers import CrossEncoder

    task = LocalReranking()
    reference = evaluate(CrossEncoderWrapper(CrossEncoder(str(cross_dir), device="cpu")), task)
    with Engine.from_pretrained(str(cross_dir), dtype="float32") as engine:
        assert_same_scores(evaluate(MtebCrossEncoder(engine), task), reference)
    assert_same_scores(evaluate(MtebCrossEncoder(cross_server.url), task), reference)


def test_wrong_task_is_refused(cross_dir: Path, embed_engine: Engine) -> None:
    cross = Engine.from_pretrained(str(cross_dir), dtype="float32")
    with cross, pytest.raises(ValueError, match="MtebEncoder needs a model served with task embed"):
        MtebEncoder(cross)
    with pytest.raises(ValueError, match="task score; this model's task is embed"):
        MtebCrossEncoder(embed_engine)


class _FlagEmbeddingColbert(AbsEncoder):
    """The reference multi-vector encoder: FlagEmbedding's ColBERT output (colbert_linear
    over transformers' XLMRobertaModel, CLS left out, each vector normalized), written out
    (FlagEmbedding is not a dependency), with mteb's MaxSim."""

    def __init__(self, path: Path) -> None:
        import torch
        from mteb.models import ModelMeta
        from mteb.models.model_meta import ScoringFunction
        from transformers import AutoTokenizer, XLMRobertaModel

        self._torch = torch
        self.model = XLMRobertaModel.from_pretrained(str(path)).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        state = torch.load(path / "colbert_linear.pt", weights_only=True)
        self.colbert = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
        self.colbert.load_state_dict(state)
        self.mteb_model_meta = ModelMeta.create_empty(
            overwrites={"name": "reference/colbert", "similarity_fn_name": ScoringFunction.MAX_SIM}
        )

    def encode(self, inputs: Any, **kwargs: Any) -> Any:
        torch = self._torch
        out = []
        with torch.no_grad():
            for text in [t for batch in inputs for t in batch["text"]]:
                enc = self.tokenizer(text, truncation=True, max_length=64, return_tensors="pt")
                h = self.model(**enc).last_hidden_state[0]
                out.append(torch.nn.functional.normalize(self.colbert(h[1:]), dim=-1).numpy())
        return out


def test_multi_vector_encoder_is_maxsim_over_the_colbert_vectors(
    tmp_path_factory: pytest.TempPathFactory, embed_engine: Engine
) -> None:
    """mteb's MaxSim protocol over bge-m3's multi-vectors, offline and over HTTP, scores a
    retrieval task as the reference ColBERT encoder does."""
    path = build_bge_m3(tmp_path_factory.mktemp("bge-m3") / "xlmr")
    task = LocalRetrieval()
    reference = evaluate(_FlagEmbeddingColbert(path), task)
    with Engine.from_pretrained(str(path), dtype="float32") as engine:
        assert_same_scores(evaluate(MtebMultiVectorEncoder(engine), task), reference)
    settings = ServerSettings(model=str(path), dtype="float32", max_inputs_per_request=4)
    with running_server(settings) as server:
        assert_same_scores(evaluate(MtebMultiVectorEncoder(server.url), task), reference)
    with pytest.raises(ValueError, match="needs a model with multi-vector outputs"):
        MtebMultiVectorEncoder(embed_engine)


def test_multi_vector_encoder_gives_a_colbert_its_queries_and_documents_sides(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """On a ColBERT checkpoint mteb's query and document prompt types choose the side its
    texts are tokenized as (marker, query expansion), offline and over HTTP (/v2/embed)."""
    from mteb.types import PromptType

    from tests.server.device.test_colbert_engine import build_hf_colbert

    path = build_hf_colbert(tmp_path_factory.mktemp("colbert") / "hf_colbert")
    texts = ["late interaction", "a document, with punctuation."]
    metadata = LocalRetrieval().metadata
    inputs = [{"text": texts}]
    with Engine.from_pretrained(str(path), dtype="float32") as engine:
        want = {side: engine.embed_tokens(texts, input_type=side) for side in ("query", "document")}
        assert want["query"][1].shape[0] != want["document"][1].shape[0]
        encoders = [MtebMultiVectorEncoder(engine)]
        settings = ServerSettings(model=str(path), dtype="float32")
        with running_server(settings) as server:
            encoders.append(MtebMultiVectorEncoder(server.url))
            for encoder in encoders:
                for prompt_type, side in ((PromptType.query, "query"), (None, "document")):
                    got = encoder.encode(
                        inputs,  # type: ignore[arg-type]
                        task_metadata=metadata,
                        hf_split="test",
                        hf_subset="default",
                        prompt_type=prompt_type,
                    )
                    for g, w in zip(got, want[side], strict=True):  # type: ignore[arg-type]
                        np.testing.assert_allclose(g, w, atol=1e-5)

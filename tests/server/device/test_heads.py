"""Cross-encoders and classifiers through the offline Engine, against transformers'
``*ForSequenceClassification`` and sentence-transformers' ``CrossEncoder.predict``.

Every family's tiny random classifier runs mixed-length inputs as packed batches; each row
must match transformers running that input (or pair) alone, to 1e-4 in float32. Also: the
task decided at load and shown in ``info()``, the refusals of heads and settings that do not
fit, and the per-task errors of the offline API.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.device.pooling import activation
from embedding_server.engine import Engine
from embedding_server.errors import (
    InvalidRequestError,
    UnsettledInputError,
    UnsupportedModelError,
)
from embedding_server.request.heads import apply_activation, softmax
from embedding_server.request.pairs import longest_first
from embedding_server.request.pooling import ACTIVATIONS
from embedding_server.request.truncation import Truncation
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from tests.support.device_cases import DOCS, QUERIES, TEXTS
from tests.support.models import MINILM_DIR
from tests.support.tasks import build_classifier, build_splade, save_cross_encoder

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (family, num_labels, per_token=False) -> a tiny classifier, built once."""
    root = tmp_path_factory.mktemp("classifiers")
    cache: dict[tuple[str, int, bool], Path] = {}

    def get(family: str, num_labels: int, per_token: bool = False) -> Path:
        key = (family, num_labels, per_token)
        if key not in cache:
            name = f"{family}-{num_labels}{'-token' if per_token else ''}"
            cache[key] = build_classifier(root / name, family, num_labels, per_token=per_token)
        return cache[key]

    return get


def reference_logits(
    path: Path, inputs: list[str] | list[tuple[str, str]], max_length: int = 128
) -> np.ndarray:
    """transformers' logits, each input run alone (no padding to get wrong), cut to
    ``max_length`` tokens as the engine cuts them."""
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    rows = []
    with torch.no_grad():
        for item in inputs:
            enc = (
                tok(*item, return_tensors="pt", truncation=True, max_length=max_length)
                if isinstance(item, tuple)
                else tok(item, return_tensors="pt", truncation=True, max_length=max_length)
            )
            rows.append(model(**enc).logits[0].float().numpy())
    return np.stack(rows)


FAMILIES = ["bert", "xlm-roberta", "mpnet", "deberta-v2", "modernbert", "qwen3", "llama"]


@pytest.mark.parametrize("family", FAMILIES)
def test_classify_matches_transformers(classifiers: Callable[..., Path], family: str) -> None:
    path = classifiers(family, 3)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    info = engine.info()
    assert (info.task, info.labels) == ("classify", ["class_0", "class_1", "class_2"])
    result = engine.classify(TEXTS)
    expected = torch.softmax(
        torch.from_numpy(reference_logits(path, TEXTS, info.max_input_tokens)), -1
    ).numpy()
    np.testing.assert_allclose(result.probs, expected, atol=1e-4)
    assert result.predicted == [f"class_{i}" for i in expected.argmax(1)]
    assert result.prompt_tokens > len(TEXTS)
    encoded = engine.encode(TEXTS, task="classify")
    np.testing.assert_allclose(np.stack(encoded), result.probs, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_encoder_scores_match_transformers(
    classifiers: Callable[..., Path], family: str
) -> None:
    """One label: task score; pairs are one sequence (segment ids for BERT), sigmoid on top."""
    path = classifiers(family, 1)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert (engine.info().task, engine.info().score_activation) == ("score", "sigmoid")
    pairs = list(zip(QUERIES, DOCS, strict=True))
    limit = engine.info().max_input_tokens
    expected = 1 / (1 + np.exp(-reference_logits(path, pairs, limit)[:, 0]))
    np.testing.assert_allclose(engine.score(QUERIES, DOCS), expected, atol=1e-4)
    # One query against many documents pairs it with each.
    one_to_many = engine.score(QUERIES[0], DOCS)
    expected_one = 1 / (
        1 + np.exp(-reference_logits(path, [(QUERIES[0], d) for d in DOCS], limit)[:, 0])
    )
    np.testing.assert_allclose(one_to_many, expected_one, atol=1e-4)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoder_matches_sentence_transformers(
    classifiers: Callable[..., Path], family: str
) -> None:
    """A checkpoint saved by CrossEncoder: its declared activation and max length apply, so
    long pairs are cut exactly where CrossEncoder cuts them."""
    from sentence_transformers import CrossEncoder

    path = save_cross_encoder(classifiers(family, 1), max_length=24)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert engine.info().max_input_tokens == 24
    pairs = list(zip(QUERIES, DOCS, strict=True))
    expected = CrossEncoder(str(path), device="cpu").predict(pairs)
    np.testing.assert_allclose(engine.score(QUERIES, DOCS), expected, atol=1e-4)
    ranked = engine.rerank(QUERIES[2], DOCS, top_n=2)
    reference = CrossEncoder(str(path), device="cpu").rank(QUERIES[2], DOCS, top_k=2)
    assert [r.index for r in ranked.results] == [r["corpus_id"] for r in reference]
    np.testing.assert_allclose(
        [r.score for r in ranked.results], [r["score"] for r in reference], atol=1e-4
    )


def test_declared_activation_is_used(classifiers: Callable[..., Path], tmp_path: Path) -> None:
    """A CrossEncoder saved with an identity activation returns raw logits."""
    import json
    import shutil

    path = save_cross_encoder(classifiers("bert", 1))
    raw = tmp_path / "raw"
    shutil.copytree(path, raw)
    cfg_path = raw / "config_sentence_transformers.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["activation_fn"] = "torch.nn.modules.linear.Identity"
    cfg_path.write_text(json.dumps(cfg))
    engine = Engine.from_pretrained(str(raw), dtype="float32")
    assert engine.info().score_activation == "identity"
    expected = reference_logits(raw, [(QUERIES[0], DOCS[0])])[:, 0]
    np.testing.assert_allclose(engine.score(QUERIES[0], DOCS[0]), expected, atol=1e-4)


def test_pair_truncation_matches_transformers(classifiers: Callable[..., Path]) -> None:
    """Longest-first cutting of over-long pairs, token for token, and refusal without it."""
    path = classifiers("bert", 1)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    tok = AutoTokenizer.from_pretrained(str(path))
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs"]
    rng = np.random.default_rng(0)
    for _ in range(60):
        a = " ".join(rng.choice(words, int(rng.integers(1, 25))))
        b = " ".join(rng.choice(words, int(rng.integers(1, 25))))
        limit = int(rng.integers(8, 40))
        reference = tok(a, b, truncation=True, max_length=limit)
        got = engine._tokenizer.encode_pairs([(a, b)], truncation=Truncation(max_tokens=limit))[0]
        assert got.ids == reference["input_ids"]
        assert (got.type_ids or [0] * len(got.ids)) == reference["token_type_ids"]
    assert longest_first(5, 5, 7) == (3, 4)
    with pytest.raises(InvalidRequestError, match="more than the maximum"):
        engine.score("word " * 200, "other", truncate=False)


def test_tasks_on_the_wrong_model_are_refused(
    classifiers: Callable[..., Path], minilm_engine: Engine
) -> None:
    classifier = Engine.from_pretrained(str(classifiers("bert", 3)), dtype="float32")
    with pytest.raises(InvalidRequestError, match="task is classify"):
        classifier.embed(["x"])
    with pytest.raises(InvalidRequestError, match="task is classify"):
        classifier.score("a", "b")
    with pytest.raises(InvalidRequestError, match="task is classify"):
        classifier.rerank("a", ["b"])
    with pytest.raises(InvalidRequestError, match="this model's task is embed"):
        minilm_engine.classify(["x"])
    with pytest.raises(InvalidRequestError, match="task"):
        minilm_engine.encode(["x"], task="reward")  # type: ignore[arg-type]
    cross = Engine.from_pretrained(str(classifiers("bert", 1)), dtype="float32")
    with pytest.raises(InvalidRequestError, match="text_2"):
        cross.score("a", [[1, 2, 3]])
    with pytest.raises(InvalidRequestError, match="prompt"):
        cross.score("a", "b", prompt="query: ")
    with pytest.raises(InvalidRequestError, match="documents"):
        cross.rerank("a", [])
    with pytest.raises(InvalidRequestError, match="top_n"):
        cross.rerank("a", ["b"], top_n=-1)


def test_embedder_rerank_is_cosine(minilm_engine: Engine) -> None:
    docs = ["A man is eating food.", "A man is riding a horse.", "Someone eats a meal."]
    ranked = minilm_engine.rerank("A person eats.", docs)
    cosines = minilm_engine.score("A person eats.", docs)
    assert [r.index for r in ranked.results] == list(np.argsort(-cosines))
    np.testing.assert_allclose([r.score for r in ranked.results], np.sort(cosines)[::-1], atol=1e-6)


def test_task_is_decided_at_load_and_mismatches_refused(
    classifiers: Callable[..., Path], minilm_dir: Path
) -> None:
    three = str(classifiers("bert", 3))
    one = str(classifiers("bert", 1))
    with pytest.raises(UnsupportedModelError, match="serve it with task classify"):
        Engine.from_pretrained(three, task="embed")
    with pytest.raises(UnsupportedModelError, match="task score needs a cross-encoder"):
        Engine.from_pretrained(three, task="score")
    with pytest.raises(UnsupportedModelError, match="no classification head"):
        Engine.from_pretrained(str(minilm_dir), task="classify")
    with pytest.raises(InvalidRequestError, match="pooling applies to task embed only"):
        Engine.from_pretrained(one, pooling="mean")
    # A cross-encoder may be served as a classifier: its one sigmoid probability.
    as_classifier = Engine.from_pretrained(one, task="classify", dtype="float32")
    probs = as_classifier.classify(["hello"]).probs
    assert probs.shape == (1, 1) and 0 < probs[0, 0] < 1


def test_unsupported_heads_are_refused(tmp_path: Path) -> None:
    import json
    import shutil

    shutil.copytree(MINILM_DIR, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["BertForQuestionAnswering"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="question answering"):
        Engine.from_pretrained(str(tmp_path / "m"))


def test_encode_follows_the_task(minilm_engine: Engine) -> None:
    texts = ["one sentence", "and a second, longer sentence"]
    np.testing.assert_allclose(
        np.stack(minilm_engine.encode(texts)), minilm_engine.embed(texts), atol=1e-6
    )
    tokens = minilm_engine.encode(texts, task="token_embed")
    assert [t.shape[0] for t in tokens] == [len(ids) for ids in minilm_engine.tokenize(texts)]
    with pytest.raises(TypeError, match="dimensions"):
        minilm_engine.encode(texts, task="token_embed", dimensions=8)


@pytest.mark.parametrize("family", FAMILIES)
def test_token_classify_matches_transformers(classifiers: Callable[..., Path], family: str) -> None:
    """*ForTokenClassification: every token's label probabilities, packed batches of mixed
    lengths against transformers running each input alone."""
    path = classifiers(family, 4, per_token=True)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert engine.info().task == "token_classify"
    limit = engine.info().max_input_tokens
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForTokenClassification.from_pretrained(str(path)).eval()
    got = engine.token_classify(TEXTS)
    assert len(got) == len(TEXTS)
    for text, probs in zip(TEXTS, got, strict=True):
        enc = tok(text, return_tensors="pt", truncation=True, max_length=limit)
        with torch.no_grad():
            expected = torch.softmax(model(**enc).logits[0], -1).numpy()
        assert probs.shape == expected.shape
        np.testing.assert_allclose(probs, expected, atol=1e-4)
    encoded = engine.encode(TEXTS[:2], task="token_classify")
    np.testing.assert_allclose(encoded[1], got[1], atol=1e-6)
    with pytest.raises(InvalidRequestError, match="task is token_classify"):
        engine.classify(TEXTS)
    with pytest.raises(UnsupportedModelError, match="serve it with task token_classify"):
        Engine.from_pretrained(str(path), task="classify")


@pytest.mark.parametrize("family", ["qwen3", "llama", "bert"])
def test_reward_is_the_raw_head_at_every_token(
    classifiers: Callable[..., Path], family: str
) -> None:
    """task reward (asked for, never auto): the head's raw outputs at every token, as vLLM's
    reward task; for a decoder the last row is transformers' sequence logits."""
    path = classifiers(family, 1)
    engine = Engine.from_pretrained(str(path), dtype="float32", task="reward")
    assert engine.info().task == "reward"
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    rewards = engine.reward(TEXTS)
    limit = engine.info().max_input_tokens
    for text, got in zip(TEXTS, rewards, strict=True):
        enc = tok(text, return_tensors="pt", truncation=True, max_length=limit)
        with torch.no_grad():
            out = model(**enc, output_hidden_states=True)
            states = out.hidden_states[-1][0]
            if family == "bert":  # the pooler and classifier on every token's state
                head = model.classifier(
                    model.bert.pooler.activation(model.bert.pooler.dense(states))
                )
            else:
                head = model.score(states)
        np.testing.assert_allclose(got, head.numpy(), atol=1e-4)
        if family != "bert":
            np.testing.assert_allclose(got[-1], out.logits[0].numpy(), atol=1e-4)
    with pytest.raises(InvalidRequestError, match="task is reward"):
        engine.score("a", "b")
    assert Engine.from_pretrained(str(path), dtype="float32").info().task == "score"


@pytest.fixture(scope="module")
def splade(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (family, strategy="max") -> a tiny SPLADE SparseEncoder, built once."""
    root = tmp_path_factory.mktemp("splade")
    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, strategy: str = "max") -> Path:
        if (family, strategy) not in cache:
            cache[family, strategy] = build_splade(root / f"{family}-{strategy}", family, strategy)
        return cache[family, strategy]

    return get


@pytest.mark.parametrize(
    ("family", "strategy"),
    [("bert", "max"), ("xlm-roberta", "max"), ("mpnet", "max"), ("bert", "sum")],
)
def test_sparse_matches_transformers_logits_and_sparse_encoder(
    splade: Callable[..., Path], family: str, strategy: str
) -> None:
    """SPLADE: log(1 + relu(MLM logits)) reduced over each input's tokens, from transformers'
    own logits (each input alone) and from sentence-transformers' SparseEncoder."""
    from sentence_transformers import SparseEncoder
    from transformers import AutoModelForMaskedLM

    path = splade(family, strategy)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert engine.info().task == "sparse"
    got = engine.sparse_embed(TEXTS)
    limit = engine.info().max_input_tokens
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForMaskedLM.from_pretrained(str(path)).eval()
    vocab = model.config.vocab_size
    for text, vector in zip(TEXTS, got, strict=True):
        enc = tok(text, return_tensors="pt", truncation=True, max_length=limit)
        with torch.no_grad():
            weights = torch.log1p(torch.relu(model(**enc).logits[0]))
        expected = (weights.amax(0) if strategy == "max" else weights.sum(0)).numpy()
        assert list(vector.indices) == sorted(vector.indices)
        np.testing.assert_allclose(vector.to_dense(vocab), expected, atol=1e-4, rtol=1e-5)
    reference = SparseEncoder(str(path), device="cpu").encode(
        TEXTS, convert_to_tensor=True, convert_to_sparse_tensor=False
    )
    dense = np.stack([v.to_dense(vocab) for v in got])
    np.testing.assert_allclose(dense, reference.numpy(), atol=1e-4, rtol=1e-5)
    # SparseVector.top(k) is SparseEncoder's max_active_dims.
    capped = SparseEncoder(str(path), device="cpu").encode(
        TEXTS, convert_to_tensor=True, convert_to_sparse_tensor=False, max_active_dims=5
    )
    top = np.stack([v.top(5).to_dense(vocab) for v in got])
    np.testing.assert_allclose(top, capped.numpy(), atol=1e-4, rtol=1e-5)
    assert all(len(v.top(5).indices) == 5 and v.top(10**6) is v for v in got)


def test_sparse_task_on_a_masked_lm_and_refusals(
    splade: Callable[..., Path], minilm_dir: Path
) -> None:
    """--task sparse serves a plain *ForMaskedLM with max pooling; an embedder body has no
    masked-LM head; a SPLADE model is not an embedder."""
    path = splade("bert")
    with pytest.raises(UnsupportedModelError, match="serve it with task sparse"):
        Engine.from_pretrained(str(path), task="embed")
    with pytest.raises(UnsupportedModelError, match="masked-LM"):
        Engine.from_pretrained(str(minilm_dir), task="sparse")
    sparse = Engine.from_pretrained(str(path), dtype="float32")
    with pytest.raises(InvalidRequestError, match="task is sparse"):
        sparse.embed(["x"])
    body = path.parent / f"{path.name}-body"  # the bare BertForMaskedLM checkpoint
    plain = Engine.from_pretrained(str(body), dtype="float32", task="sparse")
    np.testing.assert_allclose(
        plain.sparse_embed(TEXTS[:2])[1].values, sparse.sparse_embed(TEXTS[:2])[1].values, atol=1e-6
    )


def test_long_pairs_are_read_through_windows_without_changing_the_tokens(
    classifiers: Callable[..., Path],
) -> None:
    """Texts longer than the first window: the pairs match transformers' own truncation
    token for token, on either side, whichever text is the long one, both long included."""
    path = classifiers("bert", 1)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    tokenizer = engine._tokenizer
    tok = AutoTokenizer.from_pretrained(str(path))
    first, widest = tokenizer.windows(tokenizer.max_length)
    long_text = "the quick brown fox jumps over the lazy dog " * 300
    assert first < len(long_text) < widest
    short = "what does the fox do?"
    giant_first_word = "x" * 2 * first + " and then the fox" * 500
    cases = [
        (short, long_text),
        (long_text, short),
        (long_text, long_text[4:]),  # both long: which is longer decides the odd token
        (giant_first_word, short),
        (short, giant_first_word),
    ]
    for a, b in cases:
        for side in ("right", "left"):
            tok.truncation_side = side
            reference = tok(a, b, truncation=True, max_length=tokenizer.max_length)
            got = tokenizer.encode_pairs([(a, b)], truncation=Truncation(side=side))[0]
            assert got.ids == reference["input_ids"], (side, len(a), len(b))
            assert got.truncated
    with pytest.raises(InvalidRequestError, match="more than the maximum"):
        tokenizer.encode_pairs([(short, long_text)], truncation=Truncation.refuse())


def test_a_query_shared_by_many_pairs_is_read_once(classifiers: Callable[..., Path]) -> None:
    """A rerank request's query is one text in every pair: it is read once, whatever the
    number of documents, even when its first word is wider than every window but the last."""
    path = classifiers("bert", 1)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    tokenizer = engine._tokenizer
    first, _ = tokenizer.windows(tokenizer.max_length)
    query = "x" * 3 * first + " and a question" * 20_000  # 300 kB
    documents = [f"document number {i}" for i in range(200)]
    read: list[int] = []
    backend = tokenizer.backend
    original = backend.encode_batch

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(backend, name)

        def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
            read.extend(map(len, texts))
            return original(texts, **kwargs)

    tokenizer._tok = Counting()  # type: ignore[assignment]
    got = tokenizer.encode_pairs([(query, d) for d in documents], truncation=Truncation())
    tokenizer._tok = backend
    assert sum(read) < 8 * first  # the query's windows, once: not 200 times 300 kB
    alone = tokenizer.encode_pairs([(query, documents[7])], truncation=Truncation())
    assert got[7].ids == alone[0].ids


def test_a_pair_of_texts_both_wider_than_the_widest_window_is_refused(
    classifiers: Callable[..., Path],
) -> None:
    """With an odd budget, the longer text of an over-long pair keeps the odd token; when
    both texts run past the widest window, which one is longer is text the server does not
    read, so the pair is refused rather than guessed at (or read whole)."""
    path = classifiers("bert", 1)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    tokenizer = engine._tokenizer
    _, widest = tokenizer.windows(tokenizer.max_length)
    assert (tokenizer.max_length - tokenizer.num_pair_special) % 2 == 1
    long_text = "the quick brown fox jumps over the lazy dog " * (widest // 40)
    with pytest.raises(UnsettledInputError, match="pair 0"):
        tokenizer.encode_pairs([(long_text, long_text[4:])], truncation=Truncation())


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_per_request_activations_are_torchs(name: str) -> None:
    """A classifier's activation runs per request in numpy (front-end processes have no
    torch); the engine's heads use torch's. The two must agree, far into the tails."""
    x = np.concatenate(
        [np.linspace(-40, 40, 801), np.random.default_rng(0).normal(0, 3, 499)]
    ).astype(np.float32)
    want = activation(name)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(apply_activation(name, x), want, rtol=1e-5, atol=1e-6)
    logits = x.reshape(-1, 13)
    np.testing.assert_allclose(
        softmax(logits), torch.softmax(torch.from_numpy(logits), -1).numpy(), rtol=2e-6, atol=1e-7
    )

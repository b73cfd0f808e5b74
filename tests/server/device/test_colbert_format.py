"""A ColBERT checkpoint's tokenization per side and its token vectors
(``embedding_server/request/colbert.py``), against the references restated in
``test_colbert_augmentation.py``: stanford-colbert's ``QueryTokenizer``/``DocTokenizer``
``tensorize`` and PyLate's ``ColBERT.preprocess`` over the same tokenizers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from embedding_server.errors import InvalidRequestError
from embedding_server.request.colbert import (
    ColbertFormat,
    maxsim_sum,
    parse_side,
    punctuation_skiplist,
)
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tests.server.device.test_colbert_augmentation import (
    D_PREFIX,
    DOC_MAXLEN,
    DOCS,
    DOCUMENT_LENGTH,
    PYLATE_QUERIES,
    Q_PREFIX,
    QUERIES,
    QUERY_LENGTH,
    QUERY_MAXLEN,
    _pylate_preprocess,
    _pylate_skiplist,
    _tensorize,
)
from tests.support.device_cases import colbert_skiplist
from tests.support.models import build_bert, build_modernbert


def _tokenizer(path: Path) -> Tokenizer:
    """The server's tokenizer backend: no padding or truncation of its own."""
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def stanford_format(path: Path, *, attend: bool = False) -> ColbertFormat:
    tok = _tokenizer(path)
    marker = tok.token_to_id
    return ColbertFormat(
        style="stanford",
        query_marker=marker("[unused0]"),
        document_marker=marker("[unused1]"),
        query_length=QUERY_MAXLEN,
        document_length=DOC_MAXLEN,
        mask_id=marker("[MASK]"),
        attend_to_expansion=attend,
        skiplist=punctuation_skiplist(tok, "stanford"),
        width=8,
    )


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert(tmp_path_factory.mktemp("format") / "bert")


def test_stanford_queries_and_documents_tokenize_as_stanford_colbert(bert: Path) -> None:
    fmt, tok = stanford_format(bert), _tokenizer(bert)
    queries, real, docs = _tensorize(bert)
    got = [fmt.encode(tok, q, "query") for q in QUERIES]
    assert [e.ids for e in got] == queries
    assert [e.keys for e in got] == real
    assert all(len(e.ids) == QUERY_MAXLEN for e in got)
    got_docs = [fmt.encode(tok, d, "document") for d in DOCS]
    assert [e.ids for e in got_docs] == docs
    assert [e.keys for e in got_docs] == [len(d) for d in docs]
    assert fmt.skiplist == colbert_skiplist(bert)


def test_long_queries_and_documents_are_cut_as_transformers_truncates(bert: Path) -> None:
    fmt, tok = stanford_format(bert), _tokenizer(bert)
    hf = AutoTokenizer.from_pretrained(str(bert))
    text = " ".join(DOCS * 2)
    for side, length in (("query", QUERY_MAXLEN), ("document", DOC_MAXLEN)):
        ids, keys, original = fmt.encode(tok, text, side)  # type: ignore[arg-type]
        want = hf(". " + text, truncation=True, max_length=length)["input_ids"]
        assert ids[2:] == want[2:] and keys == length == len(want)
        assert original == len(hf(". " + text)["input_ids"]) > length
        assert ids[-1] == hf.sep_token_id


def test_attending_to_the_expansion_makes_every_query_token_a_key(bert: Path) -> None:
    fmt, tok = stanford_format(bert, attend=True), _tokenizer(bert)
    ids, keys, _ = fmt.encode(tok, QUERIES[1], "query")
    assert keys == len(ids) == QUERY_MAXLEN


def test_pylate_queries_and_documents_tokenize_as_pylate(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = build_modernbert(tmp_path_factory.mktemp("format") / "mb", "modernbert")
    tok = _tokenizer(path)
    fmt = ColbertFormat(
        style="pylate",
        query_marker=Q_PREFIX,
        document_marker=D_PREFIX,
        query_length=QUERY_LENGTH,
        document_length=DOCUMENT_LENGTH,
        mask_id=tok.token_to_id("[MASK]"),
        attend_to_expansion=False,
        skiplist=punctuation_skiplist(tok, "pylate"),
        width=8,
    )
    queries, real, docs = _pylate_preprocess(path)
    got = [fmt.encode(tok, q, "query") for q in PYLATE_QUERIES]
    assert [e.ids for e in got] == queries
    assert [e.keys for e in got] == real
    assert [fmt.encode(tok, d, "document")[0] for d in DOCS] == docs
    assert fmt.skiplist == _pylate_skiplist(path)


def test_documents_drop_their_skiplist_tokens_and_every_vector_is_unit_length(
    bert: Path,
) -> None:
    fmt, tok = stanford_format(bert), _tokenizer(bert)
    ids, _, _ = fmt.encode(tok, "short, with punctuation!", "document")
    rows = np.random.default_rng(0).standard_normal((len(ids), 8)).astype(np.float32)
    vectors = fmt.vectors(rows, ids, "document")
    kept = [i for i in ids if i not in fmt.skiplist]
    assert len(kept) == len(ids) - 2  # the comma and the exclamation mark
    assert vectors.shape == (len(kept), 8)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-6)
    # A query keeps every token, punctuation and expansion included.
    assert fmt.vectors(rows, ids, "query").shape == (len(ids), 8)


def test_the_admission_estimate_bounds_what_each_side_holds(bert: Path) -> None:
    """The scheduler admits a job by its bound before tokenizing it: an expanded query holds
    its whole length however short its text, so a text-size estimate would undercount it."""
    fmt, tok = stanford_format(bert), _tokenizer(bert)
    texts = ["q", *QUERIES, *DOCS, " ".join(DOCS * 3)]
    for side in ("query", "document"):
        held = [len(fmt.encode(tok, t, side).ids) for t in texts]  # type: ignore[arg-type]
        estimate = fmt.admission(texts, [side] * len(texts))  # type: ignore[list-item]
        assert estimate.floor <= sum(held) <= estimate.bound
        if side == "query":
            assert estimate.floor == sum(held) == QUERY_MAXLEN * len(texts)


def test_maxsim_sums_each_query_vectors_best_match() -> None:
    q = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    d = np.array([[0.6, 0.8], [1.0, 0.0]], np.float32)
    assert maxsim_sum(q, d) == pytest.approx(1.0 + 0.8)
    assert maxsim_sum(q, d[:0]) == 0.0


def test_a_side_other_than_query_or_document_is_a_400() -> None:
    assert parse_side("query") == "query"
    with pytest.raises(InvalidRequestError, match="input_type must be one of query, document"):
        parse_side("passage")

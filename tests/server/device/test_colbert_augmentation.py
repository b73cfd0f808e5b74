"""ColBERT's query augmentation through our packed BERT, against stanford-colbert's forward.

transformers has no ColBERT, so the reference is stanford-futuredata/ColBERT's published
computation written out below over transformers' ``BertModel`` (eager), as its
``QueryTokenizer.tensorize``, ``DocTokenizer.tensorize`` and ``ColBERT.query``/``doc`` do it:

* a query is ``". " + text`` padded to ``query_maxlen``, position 1 overwritten with the
  ``[unused0]`` marker and every ``[PAD]`` with ``[MASK]``; the attention mask stays 0 on those
  ``[MASK]`` tokens (``attend_to_mask_tokens`` false, the default), so they are queries whose
  keys nothing sees. Every position is kept, projected and L2-normalized;
* a document is ``". " + text`` truncated to ``doc_maxlen``, position 1 the ``[unused1]``
  marker; its punctuation tokens are dropped from the output (the skip-list), the rest
  projected and L2-normalized;
* MaxSim: the sum over query vectors of the best dot product with a document vector.

The server's ColBERT head and tokenization are not written yet (the checkpoints are refused at
load); this checks the attention half: a packed batch mixing augmented queries and documents
of different lengths with ``key_lens`` gives the reference's token states, the projection and
normalization applied to both sides alike here. Cosine >= 0.99999 in float32, >= 0.999 in
bfloat16, on every attention backend.

PyLate's ColBERT over ModernBERT (GTE-ModernColBERT) is checked the same way against
lightonai/pylate's ``ColBERT.preprocess``/``encode`` written out over transformers'
``ModernBertModel``: the query tokenized to ``query_length - 1`` and padded with ``[MASK]``
(its pad token) under attention mask 0, the ``[Q]`` prefix token inserted after ``[CLS]``;
the document truncated to ``document_length - 1``, ``[D]`` inserted; every query token kept,
the document's skip-list tokens (``convert_tokens_to_ids`` of each punctuation symbol)
dropped. ModernBERT's local layers add a sliding window, which the varlen kernels cannot
combine with a key prefix: those are refused, the SDPA paths serve it.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.device import attention
from embedding_server.device.attention import Backend
from embedding_server.device.models import PackedBatch, build_model
from embedding_server.device.weights import load_weights
from transformers import AutoTokenizer, BertModel, ModernBertModel

from tests.support.attention import (
    BF16_COSINE,
    StrictFlash,
    StrictTorchVarlen,
    assert_rows_close,
)
from tests.support.device_cases import colbert_skiplist, stanford_tensorize
from tests.support.models import build_bert, build_modernbert

QUERY_MAXLEN, DOC_MAXLEN, DIM = 16, 24, 8
QUERIES = ["what is late interaction?", "colbert"]
DOCS = [
    "ColBERT scores a query against a document by MaxSim, token by token.",
    "short, with punctuation!",
    "a document long enough that it is cut at the document length of this test, "
    "well before its end",
]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert(tmp_path_factory.mktemp("colbert") / "bert")


def _tensorize(path: Path) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """stanford-colbert's tensorize, each query padded to QUERY_MAXLEN: the token ids of
    every query and document, the queries' real (attended) lengths, and the documents'."""
    return stanford_tensorize(
        path, QUERIES, DOCS, (QUERY_MAXLEN, DOC_MAXLEN), ("[unused0]", "[unused1]")
    )


def _head(states: torch.Tensor, linear: torch.Tensor, keep: list[bool]) -> np.ndarray:
    """ColBERT's ``linear`` (no bias), the kept tokens, each L2-normalized."""
    projected = torch.nn.functional.linear(states.float(), linear)[torch.tensor(keep)]
    return torch.nn.functional.normalize(projected, dim=-1).numpy()


def _vectors_alone(
    model: torch.nn.Module,
    linear: torch.Tensor,
    prepared: tuple[list[list[int]], list[int], list[list[int]]],
    skip: set[int],
    query_length: int,
) -> list[np.ndarray]:
    """The authors' computation: the padded queries as one batch under their real lengths'
    mask, each document alone without its skip-listed tokens, through ``_head``."""
    queries, real, docs = prepared
    out = []
    with torch.no_grad():
        mask = (torch.arange(query_length) < torch.tensor(real).unsqueeze(1)).long()
        states = model(input_ids=torch.tensor(queries), attention_mask=mask).last_hidden_state
        out += [_head(s, linear, [True] * query_length) for s in states]
        for d in docs:
            state = model(input_ids=torch.tensor([d])).last_hidden_state[0]
            out.append(_head(state, linear, [t not in skip for t in d]))
    return out


def _vectors_packed(
    path: Path,
    linear: torch.Tensor,
    dtype: torch.dtype,
    backend: Backend,
    prepared: tuple[list[list[int]], list[int], list[list[int]]],
    skip: set[int],
    query_length: int,
    augmented: bool = True,
) -> list[np.ndarray]:
    """The native model on the queries and documents as ONE packed batch (the queries' keys
    cut to their real lengths when ``augmented``), through ``_head``."""
    config = json.loads((path / "config.json").read_text())
    model = build_model(config, dict(load_weights(path)), dtype=dtype, device=torch.device("cpu"))
    queries, real, docs = prepared
    seqs = queries + docs
    key_lens = [*real, *(len(d) for d in docs)] if augmented else None
    batch = PackedBatch.build(seqs, torch.device("cpu"), attention=backend, key_lens=key_lens)
    with torch.inference_mode():
        states = torch.split(model.forward(batch), [len(s) for s in seqs])
    out = [_head(s, linear, [True] * query_length) for s in states[: len(queries)]]
    return out + [
        _head(s, linear, [t not in skip for t in d])
        for s, d in zip(states[len(queries) :], docs, strict=True)
    ]


def _reference(path: Path, linear: torch.Tensor) -> list[np.ndarray]:
    model = BertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    return _vectors_alone(model, linear, _tensorize(path), colbert_skiplist(path), QUERY_MAXLEN)


def _packed(
    path: Path, linear: torch.Tensor, dtype: torch.dtype, backend: Backend, augmented: bool = True
) -> list[np.ndarray]:
    prepared, skip = _tensorize(path), colbert_skiplist(path)
    return _vectors_packed(path, linear, dtype, backend, prepared, skip, QUERY_MAXLEN, augmented)


def _maxsim(q: np.ndarray, d: np.ndarray) -> float:
    return float((q @ d.T).max(axis=1).sum())


@pytest.mark.parametrize(
    ("dtype", "backend", "min_cosine"),
    [
        (torch.float32, Backend.SDPA_BUCKETED, 0.99999),
        (torch.float32, Backend.SDPA_PADDED, 0.99999),
        (torch.bfloat16, Backend.SDPA_BUCKETED, 0.999),
        (torch.bfloat16, Backend.FLASH_ATTN, 0.999),
        (torch.bfloat16, Backend.TORCH_VARLEN, 0.999),
    ],
)
def test_augmented_queries_and_documents_in_one_packed_batch_match_stanford_colbert(
    bert: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    backend: Backend,
    min_cosine: float,
) -> None:
    kernels = attention.VarlenKernels(StrictFlash(), None, StrictTorchVarlen(), None)
    monkeypatch.setattr(attention, "varlen_kernels", lambda: kernels)
    linear = torch.randn(DIM, 32, generator=torch.Generator().manual_seed(3))
    want = _reference(bert, linear)
    got = _packed(bert, linear, dtype, backend)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert_rows_close(got, want, min_cosine=min_cosine)
    queries = len(QUERIES)
    for q in range(queries):
        for d in range(queries, len(want)):
            assert _maxsim(got[q], got[d]) == pytest.approx(
                _maxsim(want[q], want[d]), rel=1e-4 if dtype == torch.float32 else 2e-2
            )


def test_without_key_lens_the_masks_would_be_attended(bert: Path) -> None:
    """The check has teeth: letting every token see the [MASK] keys moves the queries'
    vectors well off the reference, the documents' not at all."""
    linear = torch.randn(DIM, 32, generator=torch.Generator().manual_seed(3))
    want = _reference(bert, linear)
    got = _packed(bert, linear, torch.float32, Backend.SDPA_BUCKETED, augmented=False)
    for q in range(len(QUERIES)):
        cosine = (got[q] * want[q]).sum(-1)
        assert cosine.min() < 0.99
    assert_rows_close(got[len(QUERIES) :], want[len(QUERIES) :], min_cosine=0.99999)


QUERY_LENGTH, DOCUMENT_LENGTH = 12, 20
PYLATE_QUERIES = ["maxsim", "colbert?", "a query cut at the query length"]
Q_PREFIX, D_PREFIX = 10, 11
"""Stand-ins for the ids of the ``[Q] `` and ``[D] `` tokens PyLate adds to the vocabulary."""


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Local layers with a window of 4 tokens each side; the queries above leave at most 3
    [MASK] tokens (GTE-ModernColBERT: 64 each side, query length 32)."""
    return build_modernbert(tmp_path_factory.mktemp("pylate") / "modernbert", "modernbert")


def _pylate_preprocess(path: Path) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """PyLate's preprocess: every query's ids and real (attended) length, every document's."""
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.pad_token_id = tok.mask_token_id  # PyLate pads queries with [MASK]
    q = tok(PYLATE_QUERIES, padding="max_length", truncation=True, max_length=QUERY_LENGTH - 1)
    queries = [[ids[0], Q_PREFIX, *ids[1:]] for ids in q["input_ids"]]
    real = [sum(m) + 1 for m in q["attention_mask"]]
    docs = [tok(d, truncation=True, max_length=DOCUMENT_LENGTH - 1)["input_ids"] for d in DOCS]
    return queries, real, [[d[0], D_PREFIX, *d[1:]] for d in docs]


def _pylate_skiplist(path: Path) -> set[int]:
    tok = AutoTokenizer.from_pretrained(str(path))
    return set(tok.convert_tokens_to_ids(list(string.punctuation)))


def _pylate_reference(path: Path, linear: torch.Tensor) -> list[np.ndarray]:
    model = ModernBertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    return _vectors_alone(
        model, linear, _pylate_preprocess(path), _pylate_skiplist(path), QUERY_LENGTH
    )


def _pylate_packed(
    path: Path, linear: torch.Tensor, dtype: torch.dtype, backend: Backend
) -> list[np.ndarray]:
    prepared, skip = _pylate_preprocess(path), _pylate_skiplist(path)
    return _vectors_packed(path, linear, dtype, backend, prepared, skip, QUERY_LENGTH)


@pytest.mark.parametrize(
    ("dtype", "backend", "min_cosine"),
    [
        (torch.float32, Backend.SDPA_BUCKETED, 0.99999),
        (torch.float32, Backend.SDPA_PADDED, 0.99999),
        (torch.bfloat16, Backend.SDPA_BUCKETED, 0.999),
    ],
)
def test_pylate_queries_and_documents_through_packed_modernbert_match_pylate(
    modernbert: Path, dtype: torch.dtype, backend: Backend, min_cosine: float
) -> None:
    queries, real, _ = _pylate_preprocess(modernbert)
    assert [len(q) for q in queries] == [QUERY_LENGTH] * 3
    assert min(real) < QUERY_LENGTH == max(real)  # expanded queries and a truncated one
    linear = torch.randn(DIM, 32, generator=torch.Generator().manual_seed(4))
    want = _pylate_reference(modernbert, linear)
    got = _pylate_packed(modernbert, linear, dtype, backend)
    assert [g.shape for g in got] == [w.shape for w in want]
    n = len(queries)
    assert_rows_close(got[:n], want[:n], min_cosine=min_cosine)
    # The documents attend to all their tokens, as any ModernBERT input does. This 4-layer
    # ModernBERT's plain documents come to 0.9988 in bfloat16 against float32 (0.9956
    # against transformers in bfloat16), key prefix or not: the suite's other bfloat16
    # ModernBERT checks hold it to BF16_COSINE too.
    docs_cosine = min_cosine if dtype == torch.float32 else BF16_COSINE
    assert_rows_close(got[n:], want[n:], min_cosine=docs_cosine)
    for q in range(len(queries)):
        for d in range(len(queries), len(want)):
            assert _maxsim(got[q], got[d]) == pytest.approx(
                _maxsim(want[q], want[d]), rel=1e-4 if dtype == torch.float32 else 2e-2
            )


@pytest.mark.parametrize("backend", [Backend.FLASH_ATTN, Backend.TORCH_VARLEN])
def test_pylate_modernbert_on_a_varlen_kernel_is_refused(
    modernbert: Path, monkeypatch: pytest.MonkeyPatch, backend: Backend
) -> None:
    """flash-attn would align the local layers' window to the end of the keys: refused."""
    kernels = attention.VarlenKernels(StrictFlash(), None, StrictTorchVarlen(), None)
    monkeypatch.setattr(attention, "varlen_kernels", lambda: kernels)
    linear = torch.randn(DIM, 32)
    with pytest.raises(ValueError, match="need an SDPA kernel"):
        _pylate_packed(modernbert, linear, torch.bfloat16, backend)

"""jina-colbert-v2 (vLLM's ``ColBERTJinaRobertaModel``) served natively, against its authors'
computation on a tiny random checkpoint of its layout (``tests/support/jina_colbert.py``).

The checkpoint is a stanford-colbert ``HF_ColBERT`` over jina's rotary XLM-R, so the reference
is stanford-colbert's published computation (``QueryTokenizer``/``DocTokenizer.tensorize``,
``ColBERT.query``/``doc``) written out over transformers' ``JinaEmbeddingsV3Model`` (the same
body, eager):

* a query is ``". " + text`` padded to ``query_maxlen``, position 1 overwritten with the
  ``[QueryMarker]`` token and every pad with the tokenizer's mask token (XLM-R's ``<mask>``);
  with ``attend_to_mask_tokens`` (jina-colbert-v2's published setting) the expansion tokens
  are attended to, without it they are queries whose keys nothing sees. Every position is
  projected by ``linear`` (no bias) and L2-normalized;
* a document is ``". " + text`` cut to ``doc_maxlen``, position 1 the ``[DocumentMarker]``,
  its punctuation tokens (each symbol's first token) dropped, the rest projected and
  normalized;
* a query scores a document by MaxSim, the sum over its vectors of the best dot product.

Token vectors: float32 cosine >= 0.99999, bfloat16 >= 0.999; scores within 1e-4, on a packed
batch mixing queries and documents of different lengths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.device.loading import load_model
from embedding_server.device.models import PackedBatch, build_model
from embedding_server.device.weights import load_weights
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from transformers import AutoModel, AutoTokenizer

from tests.support.attention import assert_rows_close
from tests.support.device_cases import colbert_skiplist, stanford_tensorize
from tests.support.jina_colbert import (
    DIM,
    DOC_MAXLEN,
    DOCUMENT_MARKER,
    LINEAR,
    QUERY_MARKER,
    QUERY_MAXLEN,
    build_jina_colbert,
)

QUERIES = ["what is late interaction?", "colbert", "a query long enough to be cut at its length"]
DOCS = [
    "ColBERT scores a query against a document by MaxSim, token by token.",
    "short, with punctuation!",
    "x",
    "a document long enough that it is cut at the document length of this test, "
    "well before its end",
]


def _tensorize(
    path: Path, attend_to_mask: bool
) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """stanford-colbert's tensorize: every query's ids (padded to QUERY_MAXLEN) and how many
    of its leading tokens are attended to, and every document's ids."""
    lengths, markers = (QUERY_MAXLEN, DOC_MAXLEN), (QUERY_MARKER, DOCUMENT_MARKER)
    return stanford_tensorize(path, QUERIES, DOCS, lengths, markers, attend_to_mask=attend_to_mask)


def _head(states: torch.Tensor, keep: list[bool]) -> np.ndarray:
    projected = torch.nn.functional.linear(states.float(), LINEAR)[torch.tensor(keep)]
    return torch.nn.functional.normalize(projected, dim=-1).numpy()


def _reference(native: Path, hub: Path, attend_to_mask: bool) -> list[np.ndarray]:
    """The queries' then the documents' ColBERT vectors, as stanford-colbert computes them
    over the body in float32."""
    model = AutoModel.from_pretrained(str(native), attn_implementation="eager").eval()
    queries, real, docs = _tensorize(hub, attend_to_mask)
    skip = colbert_skiplist(hub)
    out = []
    with torch.no_grad():
        mask = (torch.arange(QUERY_MAXLEN) < torch.tensor(real).unsqueeze(1)).long()
        states = model(input_ids=torch.tensor(queries), attention_mask=mask).last_hidden_state
        out += [_head(s, [True] * QUERY_MAXLEN) for s in states]
        for d in docs:
            state = model(input_ids=torch.tensor([d])).last_hidden_state[0]
            out.append(_head(state, [t not in skip for t in d]))
    return out


def _maxsim(q: np.ndarray, d: np.ndarray) -> float:
    return float((q @ d.T).max(axis=1).sum())


@pytest.fixture(scope="module", params=[True, False], ids=["attend-to-mask", "mask-unseen"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, bool]:
    attend = bool(request.param)
    root = tmp_path_factory.mktemp("jina-colbert")
    native, hub = build_jina_colbert(root, attend_to_mask_tokens=attend)
    return native, hub, attend


@pytest.fixture(scope="module")
def want(checkpoint: tuple[Path, Path, bool]) -> list[np.ndarray]:
    return _reference(*checkpoint)


@pytest.mark.parametrize(("dtype", "min_cosine"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_engine_serves_stanford_colberts_vectors(
    checkpoint: tuple[Path, Path, bool], want: list[np.ndarray], dtype: str, min_cosine: float
) -> None:
    engine = Engine.from_pretrained(str(checkpoint[1]), dtype=dtype)
    info = engine.info()
    assert info.outputs == ["multi_vector"] and info.score_method == "maxsim"
    assert info.multi_vector_dim == DIM and info.architecture == "HF_ColBERT"
    queries = engine.embed_tokens(QUERIES, input_type="query")
    documents = engine.embed_tokens(DOCS, input_type="document")
    got = [*queries, *documents]
    assert [g.shape for g in got] == [w.shape for w in want]
    assert_rows_close(got, want, min_cosine=min_cosine)


def test_one_packed_batch_of_queries_and_documents_gives_the_references_states(
    checkpoint: tuple[Path, Path, bool], want: list[np.ndarray]
) -> None:
    """Expanded queries and documents of different lengths in one packed forward pass, each
    query's keys limited as artifact.metadata says."""
    _, hub, attend = checkpoint
    config = json.loads((hub / "config.json").read_text())
    model = build_model(
        config, dict(load_weights(hub)), dtype=torch.float32, device=torch.device("cpu")
    )
    queries, real, docs = _tensorize(hub, attend)
    seqs = [docs[0], *queries[:2], *docs[1:], queries[2]]
    key_lens = [len(docs[0]), *real[:2], *(len(d) for d in docs[1:]), real[2]]
    batch = PackedBatch.build(seqs, torch.device("cpu"), key_lens=key_lens)
    with torch.inference_mode():
        states = torch.split(model.forward(batch), [len(s) for s in seqs])
    skip = colbert_skiplist(hub)
    order = [len(QUERIES), 0, 1, *range(len(QUERIES) + 1, len(want)), 2]
    got = [
        _head(s, [True] * len(ids) if i < len(QUERIES) else [t not in skip for t in ids])
        for s, ids, i in zip(states, seqs, order, strict=True)
    ]
    assert_rows_close(got, [want[i] for i in order], min_cosine=0.99999)


def test_score_and_rerank_are_maxsim(
    checkpoint: tuple[Path, Path, bool], want: list[np.ndarray]
) -> None:
    engine = Engine.from_pretrained(str(checkpoint[1]), dtype="float32")
    n = len(QUERIES)
    for q, query in enumerate(QUERIES):
        expected = [_maxsim(want[q], want[n + d]) for d in range(len(DOCS))]
        np.testing.assert_allclose(engine.score(query, DOCS), expected, rtol=1e-4, atol=1e-4)
        ranked = engine.rerank(query, DOCS).results
        assert [r.index for r in ranked] == list(np.argsort(expected)[::-1])


def test_the_expansion_is_the_tokenizers_mask_token(checkpoint: tuple[Path, Path, bool]) -> None:
    """XLM-R's mask token is ``<mask>``: the queries are expanded with it, not BERT's
    ``[MASK]`` (which this vocabulary lacks)."""
    hub = checkpoint[1]
    loaded = load_model(
        str(hub), revision=None, cache_dir=None, dtype="float32", device=torch.device("cpu")
    )
    assert loaded.colbert is not None
    tok = AutoTokenizer.from_pretrained(str(hub))
    encoded = loaded.colbert.encode(loaded.tokenizer, "colbert", "query")
    assert len(encoded.ids) == QUERY_MAXLEN
    assert encoded.ids[1] == tok.convert_tokens_to_ids(QUERY_MARKER)
    assert encoded.ids[-1] == tok.mask_token_id == tok.convert_tokens_to_ids("<mask>")
    assert encoded.keys == (QUERY_MAXLEN if checkpoint[2] else len(tok(". colbert").input_ids))


def test_a_checkpoint_with_task_adapters_is_not_mistaken_for_it(tmp_path: Path) -> None:
    """A ColBERT projection over a body whose config names adapters but holds none is
    refused, as for jina-embeddings-v3."""
    _, hub = build_jina_colbert(tmp_path)
    config = json.loads((hub / "config.json").read_text())
    config["lora_adaptations"] = ["retrieval.query"]
    (hub / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="holds no LoRA factors"):
        Engine.from_pretrained(str(hub), dtype="float32")


def test_over_http_its_multi_vectors_and_maxsim_scores_are_stanford_colberts(
    checkpoint: tuple[Path, Path, bool], want: list[np.ndarray]
) -> None:
    """Through the server's scheduler: Cohere's /v2/embed per side, /score by MaxSim."""
    import httpx
    from embedding_server.settings import ServerSettings

    from tests.support.api import running_server

    with running_server(ServerSettings(model=str(checkpoint[1]), dtype="float32")) as server:

        def post(path: str, body: dict[str, object]) -> dict[str, Any]:
            response = httpx.post(server.url + path, json=body, timeout=60)
            assert response.status_code == 200, response.text
            answer: dict[str, Any] = response.json()
            return answer

        got = []
        for texts, side in ((QUERIES, "search_query"), (DOCS, "search_document")):
            body = {"texts": texts, "input_type": side, "embedding_types": ["multi_vector"]}
            vectors = post("/v2/embed", body)["embeddings"]["multi_vector"]
            got += [np.array(m, np.float32) for m in vectors]
        assert_rows_close(got, want, min_cosine=0.99999)
        n = len(QUERIES)
        # /score cuts a text to its side's length only when asked to (-1: at the model's).
        expected = [_maxsim(want[1], want[n + d]) for d in range(len(DOCS))]
        body = {"text_1": QUERIES[1], "text_2": DOCS, "truncate_prompt_tokens": -1}
        scored = post("/score", body)
        np.testing.assert_allclose(
            [d["score"] for d in scored["data"]], expected, rtol=1e-4, atol=1e-4
        )

"""bge-m3's three outputs, the request plane's half: dense, sparse (lexical weights) and
multi-vector (ColBERT) from one forward pass, and late-interaction (MaxSim) scoring.

BAAI/bge-m3 ships two heads beside its XLM-R body, as pickled state dicts at the
repository's root: ``sparse_linear.pt`` (hidden -> 1) and ``colbert_linear.pt`` (hidden ->
colbert width). FlagEmbedding's ``BGEM3FlagModel`` computes, from the final hidden states
``h`` of one input:

* dense: the CLS state, L2-normalized (the sentence-transformers pipeline we already read);
* sparse: ``relu(sparse_linear(h_t))`` for every token, the special tokens (CLS, EOS, PAD,
  UNK) dropped, the maximum kept per token id: ``{token id: weight}``;
* multi-vector: ``colbert_linear(h_t)`` for every token but the first (CLS), each
  L2-normalized; scored by MaxSim, the mean over the query's vectors of their best dot
  product with the document's.

On the device both heads run on the token states in one pass (``device/hybrid.py``): each
token's row holds its sparse weight, then its ColBERT vector. What is here reads those rows
per request, in numpy, so ``--api-workers`` front-ends do it without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embedding_server.request.pooling import FloatArray, l2_normalize
from embedding_server.request.results import SparseVector

OUTPUTS = ("dense", "sparse", "multi_vector")
"""The outputs a hybrid model serves, by the names ``/info`` and the APIs use."""


@dataclass(frozen=True)
class HybridHeads:
    """What a bge-m3-shaped model's extra heads mean, for the request plane: the token ids
    its sparse output leaves out and the width of its multi-vectors (the weights are
    ``device.hybrid.HybridHead``)."""

    special_ids: tuple[int, ...]
    """CLS, EOS, PAD and UNK: never weighted in the sparse output (FlagEmbedding's
    ``unused_tokens``)."""
    multi_vector_dim: int
    """Width of one ColBERT vector (``colbert_linear``'s output size)."""

    @property
    def row_width(self) -> int:
        """Width of a token's row as the device returns it: the sparse weight, then the
        ColBERT vector."""
        return 1 + self.multi_vector_dim

    def sparse(self, rows: FloatArray, ids: Sequence[int]) -> SparseVector:
        """One input's lexical weights from its token rows (``[len, row_width]``) and token
        ids: ``relu`` was applied on the device; special tokens and zero weights dropped, the
        largest weight kept per token id, ids ascending."""
        weights = np.asarray(rows[:, 0], dtype=np.float32)
        token_ids = np.asarray(ids, dtype=np.int64)
        keep = (weights > 0) & ~np.isin(token_ids, np.asarray(self.special_ids, dtype=np.int64))
        if not keep.any():
            return SparseVector(np.zeros(0, np.int64), np.zeros(0, np.float32))
        kept_ids, kept = token_ids[keep], weights[keep]
        unique, inverse = np.unique(kept_ids, return_inverse=True)
        best = np.zeros(len(unique), dtype=np.float32)
        np.maximum.at(best, inverse, kept)
        return SparseVector(unique, best)

    def multi_vector(self, rows: FloatArray, *, normalize: bool = True) -> FloatArray:
        """One input's ColBERT vectors (``[len - 1, multi_vector_dim]``): every token but the
        first, L2-normalized unless asked not to be."""
        vectors = np.ascontiguousarray(rows[1:, 1:], dtype=np.float32)
        return l2_normalize(vectors) if normalize else vectors


def maxsim(query: FloatArray, document: FloatArray) -> float:
    """Late interaction: for each query vector, its largest dot product with a document
    vector, averaged over the query's vectors (FlagEmbedding's ``colbert_score``; ColBERT
    sums where FlagEmbedding averages, which only scales a query's scores). An empty side
    scores 0."""
    if len(query) == 0 or len(document) == 0:
        return 0.0
    similarities = np.asarray(query, np.float64) @ np.asarray(document, np.float64).T
    return float(similarities.max(axis=1).mean())


def maxsim_scores(
    vectors: Sequence[FloatArray],
    n_a: int,
    score: Callable[[FloatArray, FloatArray], float] = maxsim,
) -> npt.NDArray[np.float32]:
    """MaxSim (``score``: FlagEmbedding's mean by default) of side a (``vectors[:n_a]``, the
    queries) against side b (the rest), pairwise or one against many, as
    :func:`~.scoring.cosine_scores` pairs them."""
    a, b = list(vectors[:n_a]), list(vectors[n_a:])
    if len(a) == 1 and len(b) > 1:
        a = a * len(b)
    elif len(b) == 1 and len(a) > 1:
        b = b * len(a)
    return np.asarray([score(q, d) for q, d in zip(a, b, strict=True)], dtype=np.float32)

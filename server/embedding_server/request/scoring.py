"""Scoring text pairs, as vLLM's ``/score`` does, and ranking documents by the scores.

With an embedding model both sides are embedded in one job (side a first, then side b), and
the pooled vectors are compared at full size and L2-normalized whatever the server's
``normalize`` default is: a score is a cosine, not a dot product of whatever the head
returns. With a cross-encoder each pair is one sequence (:func:`text_pairs`) and the score is
its classifier's output. Either way the sides pair up the same way: equal lengths pairwise,
or one input against every input of the other side.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from embedding_server.errors import InvalidRequestError
from embedding_server.request.pooling import FloatArray, l2_normalize
from embedding_server.request.results import Ranked
from embedding_server.request.texts import TextInput, normalize_inputs


def check_sides(count_a: int, count_b: int) -> None:
    """Equal lengths, or one input on either side (scored against every input of the
    other)."""
    if count_a != count_b and 1 not in (count_a, count_b):
        raise InvalidRequestError(
            f"text_1 has {count_a} inputs and text_2 has {count_b}; give equal "
            "numbers or one on either side",
            param="text_2",
        )


def _sides(a: object, b: object) -> tuple[list[TextInput], list[TextInput]]:
    """Both sides' inputs; equal lengths, or one input on either side (scored against every
    input of the other)."""
    items_a = normalize_inputs(a, "text_1")
    items_b = normalize_inputs(b, "text_2")
    check_sides(len(items_a), len(items_b))
    return items_a, items_b


def pair_inputs(a: object, b: object) -> tuple[list[TextInput], int]:
    """Both sides' inputs in one list, and how many belong to side a."""
    items_a, items_b = _sides(a, b)
    return items_a + items_b, len(items_a)


def text_pairs(a: object, b: object) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs a cross-encoder scores, the single side repeated."""
    items_a, items_b = _sides(a, b)
    for param, items in (("text_1", items_a), ("text_2", items_b)):
        if not all(isinstance(item, str) for item in items):
            raise InvalidRequestError(
                f"{param} must be text: a cross-encoder tokenizes each pair together",
                param=param,
            )
    texts_a = [str(x) for x in items_a] * (len(items_b) if len(items_a) == 1 else 1)
    texts_b = [str(x) for x in items_b] * (len(items_a) if len(items_b) == 1 else 1)
    return list(zip(texts_a, texts_b, strict=True))


def text_sides(a: object, b: object) -> tuple[list[str], list[str]]:
    """Both sides as texts, unrepeated (equal numbers, or one on either side): a listwise
    reranker's queries and documents (``listwise.py``)."""
    items_a = normalize_inputs(a, "text_1")
    items_b = normalize_inputs(b, "text_2")
    check_sides(len(items_a), len(items_b))
    for param, items in (("text_1", items_a), ("text_2", items_b)):
        if not all(isinstance(item, str) for item in items):
            raise InvalidRequestError(
                f"{param} must be text: a listwise reranker puts queries and documents in "
                "its prompt",
                param=param,
            )
    return [str(x) for x in items_a], [str(x) for x in items_b]


def rank(scores: npt.NDArray[np.float32], top_n: int | None) -> list[Ranked]:
    """Documents by decreasing score (ties keep request order), the first ``top_n`` when
    given (None or 0: all, as vLLM reads 0)."""
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    if top_n:
        order = order[:top_n]
    return [Ranked(i, float(scores[i])) for i in order]


def cosine_scores(pooled: FloatArray, n_a: int) -> npt.NDArray[np.float32]:
    """Row-wise cosine of side a (rows ``[:n_a]``) against side b (the rest)."""
    vectors = l2_normalize(pooled)
    a, b = vectors[:n_a], vectors[n_a:]
    if len(a) == 1 and len(b) > 1:
        a = np.repeat(a, len(b), axis=0)
    elif len(b) == 1 and len(a) > 1:
        b = np.repeat(b, len(a), axis=0)
    scores: npt.NDArray[np.float32] = np.einsum("ij,ij->i", a, b).astype(np.float32)
    return scores

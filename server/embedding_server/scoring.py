"""Scoring: the cosine similarity of text pairs, as vLLM's bi-encoder ``/score`` computes it.

Both sides are embedded in one job (side a first, then side b), and the pooled vectors are
compared at full size and L2-normalized whatever the server's ``normalize`` default is: a
score is a cosine, not a dot product of whatever the head returns.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .errors import InvalidRequestError
from .pooling import FloatArray, l2_normalize
from .tokenization import TextInput, normalize_inputs


def pair_inputs(a: object, b: object) -> tuple[list[TextInput], int]:
    """Both sides' inputs in one list, and how many belong to side a.

    Sides must have equal lengths, or one input on either side (scored against every input
    of the other).
    """
    items_a = normalize_inputs(a, "text_1")
    items_b = normalize_inputs(b, "text_2")
    if len(items_a) != len(items_b) and 1 not in (len(items_a), len(items_b)):
        raise InvalidRequestError(
            f"text_1 has {len(items_a)} inputs and text_2 has {len(items_b)}; give equal "
            "numbers or one on either side",
            param="text_2",
        )
    return items_a + items_b, len(items_a)


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

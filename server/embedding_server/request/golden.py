"""Golden vectors: a fixed probe set, its vectors on the wire, and the comparison of two sets.

The fingerprint (``embedding_server.fingerprint``) says what *should* decide a vector; the
golden vectors check what the computation *does*. A GPU type (a T4 falls back from flash-attn
to padded SDPA), a dtype, a kernel, a library upgrade or a tokenizer fix can each move
vectors, some of them without moving the fingerprint. So every server embeds
:data:`PROBES` at start-up, through the path a ``/v1/embeddings`` request takes, and
``GET /golden`` serves them; a server given the vectors a first one recorded
(``--golden-vectors``, the same JSON as its ``/golden`` answer) compares them probe by probe
(:func:`compare`) and stays unready when any cosine is below ``--golden-min-cosine``.

The threshold's default, 0.9999, is vLLM CI's: a model counts as unchanged while its STS
score moves by less than 1e-4, and another model moves it by more than 1e-3.

Vectors travel as base64 of little-endian float32 (:func:`encode_vector`), the bytes the
OpenAI client decodes from ``encoding_format=base64``: exact, and a quarter of JSON floats.

Pure numpy: the request plane's, and no torch.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

PROBE_SET = "v1"
"""The name of :data:`PROBES`. A change to the texts is a new name: a file recorded with
another set is compared on its own probes, embedded here (``GoldenFile.probes``)."""

PROBES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "東京は日本の首都で、世界で最も人口の多い都市圏のひとつです。",
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Invoice 2024-0173: 3 x 14.99 EUR = 44.97 EUR, VAT 19% = 8.54, due 2024-07-31.",
    "ok",
    "Wie viele Einwohner hat Berlin im Jahr 2023?",
    "A vector index is only as good as the promise that every vector in it came from the "
    "same computation, so a server that would answer with other vectors than the ones "
    "already stored must not take traffic behind the same name.",
)
"""English, a Latin-script language with diacritics (French), CJK (Japanese), code, a
number-heavy line, a one-word input, a question in another Latin-script language (German),
and a long sentence: short enough to embed in milliseconds at every start, varied enough
that a tokenizer or kernel change shows in one of them."""

DEFAULT_MIN_COSINE = 0.9999
"""``--golden-min-cosine``'s default (vLLM CI's threshold; see the module doc)."""

MAX_PROBES = 64
"""Probes a ``--golden-vectors`` file may hold (a file of another probe set is embedded here)."""

MAX_PROBE_CHARS = 4096
"""Characters one probe of a ``--golden-vectors`` file may hold."""

FloatMatrix = npt.NDArray[np.float32]


def encode_vector(vector: npt.ArrayLike) -> str:
    """``vector`` as base64 of its little-endian float32 bytes."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(text: str) -> npt.NDArray[np.float32]:
    """The float32 vector :func:`encode_vector` wrote; ``ValueError`` says why not."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("is not base64") from None
    if not raw or len(raw) % 4:
        raise ValueError(f"holds {len(raw)} bytes, not a whole number of float32 values")
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(vector).all():
        raise ValueError("holds a value that is not finite")
    return vector


@dataclass(frozen=True)
class GoldenFile:
    """What a ``--golden-vectors`` file says: the probes, their vectors, and the fingerprint
    (and its inputs) of the server that embedded them. The rest of a saved ``/golden`` answer
    (its check, model name, dimensions) is not read."""

    probe_set: str
    probes: tuple[str, ...]
    vectors: tuple[npt.NDArray[np.float32], ...]
    fingerprint: str | None
    fingerprint_inputs: dict[str, Any] | None

    @classmethod
    def parse(cls, data: object) -> GoldenFile:
        """A saved ``/golden`` answer; ``ValueError`` names the field and the reason."""
        if not isinstance(data, Mapping):
            raise ValueError("must be a JSON object, as GET /golden answers")
        probe_set = data.get("probe_set")
        if not isinstance(probe_set, str) or not probe_set:
            raise ValueError("'probe_set' must be a non-empty string")
        probes, vectors = data.get("probes"), data.get("vectors")
        if not isinstance(probes, list) or not probes:
            raise ValueError("'probes' must be a non-empty list of texts")
        if len(probes) > MAX_PROBES:
            raise ValueError(f"'probes' holds {len(probes)} texts, more than {MAX_PROBES}")
        for i, probe in enumerate(probes):
            if not isinstance(probe, str) or not probe or len(probe) > MAX_PROBE_CHARS:
                raise ValueError(
                    f"'probes'[{i}] must be a non-empty text of at most {MAX_PROBE_CHARS} "
                    "characters"
                )
        if not isinstance(vectors, list) or len(vectors) != len(probes):
            raise ValueError("'vectors' must be a list with one vector per probe")
        decoded: list[npt.NDArray[np.float32]] = []
        for i, vector in enumerate(vectors):
            if not isinstance(vector, str):
                raise ValueError(f"'vectors'[{i}] must be a base64 string of float32 values")
            try:
                decoded.append(decode_vector(vector))
            except ValueError as error:
                raise ValueError(f"'vectors'[{i}] {error}") from None
        if len({v.size for v in decoded}) != 1:
            raise ValueError("'vectors' must all have the same dimensions")
        fingerprint = data.get("fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise ValueError("'fingerprint' must be a string")
        inputs = data.get("fingerprint_inputs")
        if inputs is not None and not isinstance(inputs, dict):
            raise ValueError("'fingerprint_inputs' must be an object, as /info's")
        return cls(probe_set, tuple(probes), tuple(decoded), fingerprint or None, inputs)

    @property
    def dimensions(self) -> int:
        return int(self.vectors[0].size)


@dataclass(frozen=True)
class Comparison:
    """How one set of vectors compares with a golden set, probe by probe."""

    min_cosine: float | None
    """The lowest cosine over the probes; None when the dimensions differ."""
    probe: int | None
    """The index of the probe with the lowest cosine."""
    passed: bool
    reason: str | None
    """Why it did not pass, in one line (None when it passed)."""


def cosine(a: npt.NDArray[np.floating[Any]], b: npt.NDArray[np.floating[Any]]) -> float:
    """The cosine of ``a`` and ``b`` in float64 (1 for two zero vectors, 0 for one)."""
    x, y = a.astype(np.float64), b.astype(np.float64)
    norms = float(np.linalg.norm(x)) * float(np.linalg.norm(y))
    if norms == 0.0:
        return 1.0 if not x.any() and not y.any() else 0.0
    return min(1.0, max(-1.0, float(np.dot(x, y) / norms)))  # rounding can pass 1


def compare(
    golden: Sequence[npt.NDArray[np.float32]], ours: FloatMatrix, min_cosine: float
) -> Comparison:
    """``ours`` (one row per probe) against ``golden``: passed when every probe's cosine is at
    least ``min_cosine`` (and the dimensions agree)."""
    width = int(ours.shape[1]) if ours.ndim == 2 else 0
    if golden and golden[0].size != width:
        return Comparison(
            None,
            None,
            False,
            f"the dimensions differ: the golden vectors have {golden[0].size}, this server's "
            f"{width}",
        )
    cosines = [cosine(g, row) for g, row in zip(golden, ours, strict=True)]
    lowest = min(range(len(cosines)), key=cosines.__getitem__)
    value = cosines[lowest]
    if value >= min_cosine:
        return Comparison(value, lowest, True, None)
    return Comparison(
        value,
        lowest,
        False,
        f"the lowest cosine is {_shown(value)} (probe {lowest}), below --golden-min-cosine "
        f"{min_cosine:g}",
    )


def _shown(value: float) -> str:
    """A cosine with enough digits to tell it from the threshold (0.99987, not 1.0)."""
    return "nan" if math.isnan(value) else f"{value:.6f}"

"""Turning float32 embedding matrices into wire formats, without Python float lists.

Serialization is a large share of an embedding server's CPU time on small models, so every
encoder here works on whole numpy arrays: base64 comes straight from the little-endian
buffer (``tobytes``), float responses are handed to orjson as numpy rows
(``OPT_SERIALIZE_NUMPY`` writes the shortest float32 repr, which parses back bit-exact), and
the quantized Cohere types are vectorized.

Quantization rules (documented because clients depend on them):

* ``int8``: ``round(127 * x / ||x||)`` clipped to [-128, 127] -- one fixed scale from the
  L2-normalized vector, so int8 dot products of different requests stay comparable.
* ``uint8``: the int8 value plus 128.
* ``binary`` / ``ubinary``: one bit per dimension (1 where the value is > 0), packed 8
  dimensions per byte, first dimension in the most significant bit; ``ubinary`` is the byte
  as 0..255 and ``binary`` the same byte minus 128 (as Cohere and sentence-transformers do).
  A dimension count that is not a multiple of 8 is padded with zero bits.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
import orjson

FloatMatrix = npt.NDArray[np.float32]

EmbedDtype = Literal["float32", "float16", "bfloat16"]
CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]

ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def as_float32(matrix: npt.ArrayLike) -> FloatMatrix:
    """A C-contiguous native float32 2-D view (copies only when it has to)."""
    array = np.ascontiguousarray(matrix, dtype=np.float32)
    if array.ndim == 1:
        array = array.reshape(1, -1)
    return array


def _bfloat16_bits(matrix: FloatMatrix) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (NaN kept quiet)."""
    bits = matrix.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(matrix)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


def to_dtype_bytes(
    matrix: FloatMatrix, dtype: EmbedDtype = "float32"
) -> FloatMatrix | npt.NDArray[np.float16] | npt.NDArray[np.uint16]:
    """The matrix in the little-endian element type ``dtype`` (rows stay rows)."""
    if dtype == "float32":
        return matrix.astype("<f4", copy=False)
    if dtype == "float16":
        return matrix.astype("<f2")
    return _bfloat16_bits(matrix).astype("<u2", copy=False)


def base64_rows(matrix: FloatMatrix, dtype: EmbedDtype = "float32") -> list[str]:
    """One base64 string per row, each the raw little-endian bytes of that row."""
    typed = to_dtype_bytes(matrix, dtype)
    if typed.shape[0] == 0:
        return []
    raw = typed.tobytes()
    stride = typed.shape[1] * typed.itemsize
    if stride % 3 == 0:
        # Rows start on 3-byte boundaries, so one encode of the whole buffer splits exactly.
        text = base64.b64encode(raw)
        step = stride // 3 * 4
        return [text[i : i + step].decode("ascii") for i in range(0, len(text), step)]
    return [
        base64.b64encode(raw[i : i + stride]).decode("ascii") for i in range(0, len(raw), stride)
    ]


def l2_normalize(matrix: FloatMatrix) -> FloatMatrix:
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    normalized: FloatMatrix = (matrix / np.maximum(norms, np.float32(1e-12))).astype(
        np.float32, copy=False
    )
    return normalized


def int8_rows(matrix: FloatMatrix) -> npt.NDArray[np.int8]:
    scaled = np.rint(l2_normalize(matrix) * np.float32(127.0))
    quantized: npt.NDArray[np.int8] = np.clip(scaled, -128, 127).astype(np.int8)
    return quantized


def uint8_rows(matrix: FloatMatrix) -> npt.NDArray[np.uint8]:
    return (int8_rows(matrix).astype(np.int16) + 128).astype(np.uint8)


def ubinary_rows(matrix: FloatMatrix) -> npt.NDArray[np.uint8]:
    return np.packbits(matrix > 0, axis=1)


def binary_rows(matrix: FloatMatrix) -> npt.NDArray[np.int8]:
    return (ubinary_rows(matrix).astype(np.int16) - 128).astype(np.int8)


def cohere_embeddings(
    matrix: FloatMatrix, types: Sequence[CohereEmbeddingType]
) -> dict[str, object]:
    """The ``embeddings`` object of a Cohere v2 embed response, one key per requested type.

    Values are numpy arrays or lists of strings; serialize with :data:`ORJSON_OPTIONS`.
    """
    out: dict[str, object] = {}
    for kind in dict.fromkeys(types):
        if kind == "float":
            out[kind] = matrix
        elif kind == "base64":
            out[kind] = base64_rows(matrix)
        elif kind == "int8":
            out[kind] = int8_rows(matrix)
        elif kind == "uint8":
            out[kind] = uint8_rows(matrix)
        elif kind == "binary":
            out[kind] = binary_rows(matrix)
        else:
            out[kind] = ubinary_rows(matrix)
    return out


def dumps(content: object) -> bytes:
    """The one JSON serializer of responses (numpy arrays serialize natively)."""
    return orjson.dumps(content, option=ORJSON_OPTIONS)

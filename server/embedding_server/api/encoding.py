"""Turning float32 embedding matrices into wire formats, without Python float lists.

Serialization is a large share of an embedding server's CPU time on small models, so every
encoder here works on whole numpy arrays: base64 and the binary responses come straight from
the typed buffer (``astype``/``view``, then ``tobytes``), float responses are handed to orjson
as numpy rows (``OPT_SERIALIZE_NUMPY`` writes the shortest float32 repr, which parses back
bit-exact), and the quantized Cohere types are vectorized.

Binary element types (``embed_dtype``, as vLLM names them), in the byte order asked for:

* ``float32`` / ``float16``: IEEE values; ``bfloat16``: the top 16 bits of the float32,
  rounded to nearest even.
* ``fp8_e4m3`` / ``fp8_e5m2``: one byte per value, the same bit pattern as torch's
  ``float8_e4m3fn`` / ``float8_e5m2`` conversion of the float32, which is what vLLM sends
  (values beyond the format's range, e.g. un-normalized hidden states over 448 in e4m3,
  come out as torch converts them). Computed with ``ml_dtypes``, so the request plane needs
  no torch. Byte order does not apply to them.
* ``native`` byte order is this server's (``sys.byteorder``), as in vLLM; it is little-endian
  on every platform we build for, so the default matches what the OpenAI client decodes.

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
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np
import numpy.typing as npt
import orjson

from embedding_server.request.pooling import l2_normalize

FloatMatrix = npt.NDArray[np.float32]

EmbedDtype = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
ByteOrder = Literal["little", "big"]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
BINARY_MEDIA_TYPE = "application/octet-stream"
CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]

ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY

JSON_FLOAT_BYTES = 16
"""Most bytes one float32 takes in a JSON response: orjson's shortest round-trip form with
sign, exponent and separator (``-1.2345678e-05,``)."""

_JSON_INT8_BYTES = 5  # "-128,"
_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


def bytes_per_value(encoding_format: EncodingFormat, embed_dtype: EmbedDtype) -> float:
    """Most response bytes one output number costs in this wire format (for size limits
    decided before the numbers exist)."""
    if encoding_format == "float":
        return JSON_FLOAT_BYTES
    size = _DTYPE_BYTES[embed_dtype]
    return size * 4 / 3 if encoding_format == "base64" else size


def cohere_bytes_per_dimension(types: Sequence[CohereEmbeddingType]) -> float:
    """Most response bytes one dimension of one input costs across Cohere ``types``."""
    per_type = {
        "float": JSON_FLOAT_BYTES,
        "base64": 4 * 4 / 3,
        "int8": _JSON_INT8_BYTES,
        "uint8": _JSON_INT8_BYTES,
        "binary": _JSON_INT8_BYTES / 8,
        "ubinary": _JSON_INT8_BYTES / 8,
    }
    return sum(per_type[kind] for kind in dict.fromkeys(types))


def as_float32(matrix: npt.ArrayLike) -> FloatMatrix:
    """A C-contiguous native float32 2-D view (copies only when it has to)."""
    array = np.ascontiguousarray(matrix, dtype=np.float32)
    if array.ndim == 1:
        array = array.reshape(1, -1)
    return array


def byte_order(endianness: Endianness) -> ByteOrder:
    """``native`` resolved to this machine's byte order; ``big``/``little`` as given."""
    if endianness == "native":
        return "little" if sys.byteorder == "little" else "big"
    return endianness


def _bfloat16_bits(array: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (NaN kept quiet)."""
    bits = array.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(array)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


_FP8: dict[str, tuple[type[np.generic], float | None]] = {
    "fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
    "fp8_e5m2": (ml_dtypes.float8_e5m2, None),
}
"""Each fp8 type, and where torch saturates it: e4m3fn has no infinity, so torch clamps to
its largest value (448); e5m2 overflows to infinity, as IEEE types do."""


def _fp8_bits(array: npt.NDArray[np.float32], dtype: EmbedDtype) -> npt.NDArray[np.uint8]:
    """float32 -> fp8 bit patterns, rounding to nearest even, as torch converts them
    (saturation as :data:`_FP8` says; a NaN is the type's all-ones NaN). numpy has no fp8
    type; ``ml_dtypes`` (JAX's) adds them without torch."""
    fp8, largest = _FP8[dtype]
    source = array if largest is None else np.clip(array, -largest, largest)
    bits: npt.NDArray[np.uint8] = source.astype(fp8).view(np.uint8).copy()
    nan = np.isnan(array)
    if nan.any():
        bits[nan] |= np.uint8(0x7F)
    return bits


def to_dtype_bytes(
    array: npt.NDArray[np.float32],
    dtype: EmbedDtype = "float32",
    endianness: Endianness = "little",
) -> npt.NDArray[np.generic]:
    """``array`` (any shape, float32) as elements of ``dtype`` in the byte order asked for.

    The result has the input's shape; its ``tobytes()`` is the wire form.
    """
    array = np.ascontiguousarray(array, dtype=np.float32)
    order = "<" if byte_order(endianness) == "little" else ">"
    if dtype == "float32":
        return array.astype(f"{order}f4", copy=False)
    if dtype == "float16":
        return array.astype(f"{order}f2")
    if dtype == "bfloat16":
        return _bfloat16_bits(array).astype(f"{order}u2", copy=False)
    return _fp8_bits(array, dtype)


def base64_rows(
    matrix: FloatMatrix, dtype: EmbedDtype = "float32", endianness: Endianness = "little"
) -> list[str]:
    """One base64 string per row, each the raw bytes (``dtype``, ``endianness``) of that row."""
    typed = to_dtype_bytes(matrix, dtype, endianness)
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


def base64_array(
    array: npt.NDArray[np.float32], dtype: EmbedDtype = "float32", endianness: Endianness = "little"
) -> str:
    """The whole array (e.g. one input's per-token matrix, row-major) as one base64 string."""
    return base64.b64encode(to_dtype_bytes(array, dtype, endianness).tobytes()).decode("ascii")


@dataclass(frozen=True)
class BinaryPayload:
    """A ``bytes`` / ``bytes_only`` response: the body, and vLLM's ``metadata`` items.

    The body is every output's bytes back to back, in input order; item ``i`` says where
    output ``i`` lies (``start``/``end`` byte offsets), its ``shape`` and how to read it.
    """

    body: bytes
    items: list[dict[str, object]]


def binary_payload(
    arrays: Sequence[npt.NDArray[np.float32]] | FloatMatrix,
    dtype: EmbedDtype,
    endianness: Endianness,
) -> BinaryPayload:
    """Encode one output per input (a float32 matrix's rows, or a list of arrays).

    A matrix is converted in one pass and sent as one buffer; its rows are the outputs.
    The items report the resolved byte order (``little``/``big``) rather than ``native``, so
    a client on a machine of the other byte order still decodes them right; vLLM's decoder
    accepts all three names.
    """
    if isinstance(arrays, np.ndarray):
        typed = to_dtype_bytes(arrays, dtype, endianness)
        body = typed.tobytes()
        shapes = [tuple(typed.shape[1:])] * typed.shape[0]
        sizes = [typed[0].nbytes if typed.shape[0] else 0] * typed.shape[0]
    else:
        parts = [to_dtype_bytes(a, dtype, endianness) for a in arrays]
        body = b"".join(p.tobytes() for p in parts)
        shapes = [tuple(p.shape) for p in parts]
        sizes = [p.nbytes for p in parts]
    order = byte_order(endianness)
    items: list[dict[str, object]] = []
    offset = 0
    for index, (shape, size) in enumerate(zip(shapes, sizes, strict=True)):
        items.append(
            {
                "index": index,
                "embed_dtype": dtype,
                "endianness": order,
                "start": offset,
                "end": offset + size,
                "shape": list(shape),
            }
        )
        offset += size
    return BinaryPayload(body=body, items=items)


def metadata_header(content: dict[str, object]) -> str:
    """vLLM's ``metadata`` response header: compact JSON, ASCII-only (headers are latin-1)."""
    return json.dumps(content, separators=(",", ":"), ensure_ascii=True)


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
    return {kind: _COHERE_ENCODINGS[kind](matrix) for kind in dict.fromkeys(types)}


_COHERE_ENCODINGS: dict[CohereEmbeddingType, Callable[[FloatMatrix], object]] = {
    "float": lambda matrix: matrix,
    "base64": lambda matrix: base64_rows(matrix, "float32", "little"),  # little-endian f32
    "int8": int8_rows,
    "uint8": uint8_rows,
    "binary": binary_rows,
    "ubinary": ubinary_rows,
}
"""Each Cohere embedding type's encoding of the float rows."""


def dumps(content: object) -> bytes:
    """The one JSON serializer of responses (numpy arrays serialize natively)."""
    return orjson.dumps(content, option=ORJSON_OPTIONS)

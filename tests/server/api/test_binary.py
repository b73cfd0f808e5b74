"""vLLM's binary encodings on the real all-MiniLM-L6-v2: ``embed_dtype`` (float32, float16,
bfloat16, fp8_e4m3, fp8_e5m2), ``endianness`` (native, big, little) and ``encoding_format``
``base64`` / ``bytes`` / ``bytes_only``, on /v1/embeddings and /pooling.

Every response is decoded the way vLLM's own clients do it (plain HTTP: the official
``openai`` client only knows float and base64) and compared with the float response: exact
for float32, within half a unit in the last place for float16 and bfloat16, and for fp8
equal to torch's own float32 -> float8 conversion of the float values.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from embedding_server.settings import ServerSettings

from tests.support.api import MINILM_DIMS, RunningServer, running_server

pytestmark = pytest.mark.timeout(300)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "A",
    "Paris is the capital of France and its largest city by population.",
]
DTYPES = ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
ENDIANNESS = ["native", "big", "little"]
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    # float32, not `--dtype auto`: these tests compare wire encodings of the same inputs sent
    # in batches of other shapes, and bfloat16 (auto's pick on CPUs with avx512_bf16/AMX)
    # rounds differently as the batch shape changes. api/test_openai.py covers auto's vectors.
    settings = ServerSettings(
        matryoshka_dimensions=[128, 256, 384], max_batch_tokens=4096, dtype="float32"
    )
    with running_server(settings) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def float_vectors(server: RunningServer, texts: list[str], **extra: Any) -> np.ndarray:
    body = post(server, "/v1/embeddings", {"input": texts, "encoding_format": "float", **extra})
    return np.array([d["embedding"] for d in body.json()["data"]], dtype=np.float32)


def embed_packed(
    server: RunningServer, encoding_format: str, dtype: str, endianness: str
) -> httpx.Response:
    """TEXTS' embeddings packed as ``encoding_format``, in ``dtype`` and ``endianness``."""
    body = {
        "input": TEXTS,
        "encoding_format": encoding_format,
        "embed_dtype": dtype,
        "endianness": endianness,
    }
    return post(server, "/v1/embeddings", body)


def decode(raw: bytes, dtype: str, endianness: str) -> np.ndarray:
    """Wire bytes -> float32 values, as a vLLM client reads them (no server code involved)."""
    order = sys.byteorder if endianness == "native" else endianness
    prefix = "<" if order == "little" else ">"
    if dtype == "float32":
        return np.frombuffer(raw, f"{prefix}f4").astype(np.float32)
    if dtype == "float16":
        return np.frombuffer(raw, f"{prefix}f2").astype(np.float32)
    if dtype == "bfloat16":
        high = np.frombuffer(raw, f"{prefix}u2").astype(np.uint32)
        return (high << 16).view(np.float32)
    bits = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return bits.view(FP8[dtype]).to(torch.float32).numpy()


def assert_matches_float(decoded: np.ndarray, reference: np.ndarray, dtype: str) -> None:
    """``decoded`` is ``reference`` carried in ``dtype`` (rounded to nearest)."""
    assert decoded.shape == reference.shape
    if dtype == "float32":
        np.testing.assert_array_equal(decoded, reference)
    elif dtype == "float16":  # half an ulp: 2**-11 relative, 2**-25 among subnormals
        np.testing.assert_allclose(decoded, reference, rtol=2.0**-11, atol=2.0**-25)
    elif dtype == "bfloat16":  # 8 significant bits, float32's exponent range
        np.testing.assert_allclose(decoded, reference, rtol=2.0**-8, atol=0)
    else:
        expected = torch.from_numpy(reference.copy()).to(FP8[dtype]).to(torch.float32).numpy()
        np.testing.assert_array_equal(decoded, expected)
        # ... and it is still the vector: 2 (e5m2) or 3 (e4m3) mantissa bits
        np.testing.assert_allclose(decoded, reference, rtol=2.0**-3, atol=2.0**-10)


@pytest.fixture(scope="module")
def reference(server: RunningServer) -> np.ndarray:
    vectors = float_vectors(server, TEXTS)
    assert vectors.shape == (len(TEXTS), MINILM_DIMS)
    return vectors


@pytest.mark.parametrize("endianness", ENDIANNESS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_base64_decodes_to_the_float_vectors(
    server: RunningServer, reference: np.ndarray, dtype: str, endianness: str
) -> None:
    body = embed_packed(server, "base64", dtype, endianness).json()
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    raws = [base64.b64decode(d["embedding"]) for d in body["data"]]
    assert {len(r) for r in raws} == {MINILM_DIMS * ITEMSIZE[dtype]}
    decoded = np.stack([decode(r, dtype, endianness) for r in raws])
    assert_matches_float(decoded, reference, dtype)


@pytest.mark.parametrize("endianness", ENDIANNESS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_with_metadata_decode_to_the_float_vectors(
    server: RunningServer, reference: np.ndarray, dtype: str, endianness: str
) -> None:
    response = embed_packed(server, "bytes", dtype, endianness)
    assert response.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(response.headers["metadata"])
    assert metadata["model"] == server.lifecycle.served_model_name
    assert metadata["id"].startswith("embd-") and isinstance(metadata["created"], int)
    usage = post(server, "/v1/embeddings", {"input": TEXTS}).json()["usage"]
    assert metadata["usage"] == usage
    order = sys.byteorder if endianness == "native" else endianness
    stride = MINILM_DIMS * ITEMSIZE[dtype]
    assert metadata["data"] == [
        {
            "index": i,
            "embed_dtype": dtype,
            "endianness": order,  # "native" resolved, so any client can read it
            "start": i * stride,
            "end": (i + 1) * stride,
            "shape": [MINILM_DIMS],
        }
        for i in range(len(TEXTS))
    ]
    assert len(response.content) == len(TEXTS) * stride
    decoded = np.stack(
        [
            decode(response.content[item["start"] : item["end"]], dtype, item["endianness"])
            for item in metadata["data"]
        ]
    )
    assert_matches_float(decoded, reference, dtype)


@pytest.mark.parametrize("endianness", ENDIANNESS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_only_is_the_same_body_without_metadata(
    server: RunningServer, reference: np.ndarray, dtype: str, endianness: str
) -> None:
    response = embed_packed(server, "bytes_only", dtype, endianness)
    assert response.headers["content-type"] == "application/octet-stream"
    assert "metadata" not in response.headers
    assert int(response.headers["x-compute-tokens"]) > 0  # timing headers as for JSON
    decoded = decode(response.content, dtype, endianness).reshape(len(TEXTS), MINILM_DIMS)
    assert_matches_float(decoded, reference, dtype)


def test_big_and_little_are_byte_swaps_of_each_other(server: RunningServer) -> None:
    def body(endianness: str) -> bytes:
        request = {
            "input": TEXTS[:2],
            "encoding_format": "bytes_only",
            "embed_dtype": "float16",
            "endianness": endianness,
        }
        return post(server, "/v1/embeddings", request).content

    little, big = body("little"), body("big")
    assert little != big
    assert np.frombuffer(little, "<u2").byteswap().tobytes() == big
    assert body("native") == (little if sys.byteorder == "little" else big)


def test_bytes_with_dimensions_and_input_order(server: RunningServer) -> None:
    texts = [*TEXTS, TEXTS[0]]  # a repeat, too
    expected = float_vectors(server, texts, dimensions=128)
    response = post(
        server,
        "/v1/embeddings",
        {"input": texts, "encoding_format": "bytes", "dimensions": 128},
    )
    items = json.loads(response.headers["metadata"])["data"]
    assert [item["shape"] for item in items] == [[128]] * len(texts)
    assert [item["index"] for item in items] == list(range(len(texts)))
    decoded = np.frombuffer(response.content, "<f4" if sys.byteorder == "little" else ">f4")
    np.testing.assert_array_equal(decoded.reshape(len(texts), 128), expected)
    np.testing.assert_array_equal(expected[0], expected[-1])

    reversed_body = post(
        server,
        "/v1/embeddings",
        {"input": texts[::-1], "encoding_format": "bytes_only", "dimensions": 128},
    ).content
    reversed_rows = np.frombuffer(reversed_body, np.float32).reshape(len(texts), 128)
    np.testing.assert_allclose(reversed_rows, expected[::-1], atol=1e-5)


def test_token_id_inputs_with_bytes(server: RunningServer, reference: np.ndarray) -> None:
    ids = [post(server, "/tokenize", {"prompt": t}).json()["tokens"] for t in TEXTS[:2]]
    content = post(
        server, "/v1/embeddings", {"input": ids, "encoding_format": "bytes_only"}
    ).content
    np.testing.assert_allclose(
        np.frombuffer(content, np.float32).reshape(2, MINILM_DIMS), reference[:2], atol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_pooling_bytes_carry_each_inputs_token_matrix(server: RunningServer, dtype: str) -> None:
    texts = TEXTS[:3]
    states = [
        np.array(d["data"], np.float32)
        for d in post(server, "/pooling", {"input": texts}).json()["data"]
    ]
    response = post(
        server,
        "/pooling",
        {"input": texts, "encoding_format": "bytes", "embed_dtype": dtype, "endianness": "big"},
    )
    metadata = json.loads(response.headers["metadata"])
    assert metadata["id"].startswith("pool-")
    items = metadata["data"]
    assert [item["shape"] for item in items] == [list(s.shape) for s in states]
    assert items[0]["start"] == 0 and items[-1]["end"] == len(response.content)
    for item, state in zip(items, states, strict=True):
        raw = response.content[item["start"] : item["end"]]
        assert_matches_float(decode(raw, dtype, "big").reshape(state.shape), state, dtype)

    packed = post(
        server,
        "/pooling",
        {"input": texts, "encoding_format": "base64", "embed_dtype": dtype, "endianness": "big"},
    ).json()["data"]
    for entry, item in zip(packed, items, strict=True):
        assert base64.b64decode(entry["data"]) == response.content[item["start"] : item["end"]]


def test_pooling_embed_task_bytes_only_is_the_embedding(
    server: RunningServer, reference: np.ndarray
) -> None:
    response = post(
        server,
        "/pooling",
        {"input": TEXTS, "task": "embed", "encoding_format": "bytes_only"},
    )
    assert "metadata" not in response.headers
    pooled = np.frombuffer(response.content, np.float32).reshape(len(TEXTS), MINILM_DIMS)
    np.testing.assert_allclose(pooled, reference, atol=1e-6)


def test_float_accepts_the_binary_options_at_their_defaults(
    server: RunningServer, reference: np.ndarray
) -> None:
    """A client that always sends every field (embed_dtype float32, endianness native)."""
    explicit = float_vectors(server, TEXTS, embed_dtype="float32", endianness="native")
    np.testing.assert_array_equal(explicit, reference)

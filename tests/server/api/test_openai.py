"""/v1/embeddings through the official ``openai`` client, on the real all-MiniLM-L6-v2.

These are the checks a user of the OpenAI SDK would notice: the vectors are the model's
(same as sentence-transformers), base64 and float agree, order is kept, ``dimensions``
works when the server enables Matryoshka truncation, errors arrive as the SDK's typed
exceptions, and a crowd of concurrent requests gets exactly what each would get alone.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from embedding_server.settings import ServerSettings

from tests.support.api import RunningServer, running_server

pytestmark = pytest.mark.timeout(300)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "Kubernetes schedules pods onto nodes.",
    "A",
    "Paris is the capital of France and its largest city by population.",
]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    settings = ServerSettings(matryoshka_dimensions=[128, 256, 384], max_batch_tokens=4096)
    with running_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(server: RunningServer) -> str:
    return server.lifecycle.served_model_name


def vectors(response: object) -> np.ndarray:
    data = response.data  # type: ignore[attr-defined]
    assert [d.index for d in data] == list(range(len(data)))
    return np.array([d.embedding for d in data], dtype=np.float32)


def served_dtype(server: RunningServer) -> str:
    return server.lifecycle.engine.info().dtype  # type: ignore[union-attr]


def assert_own_vectors(
    got: np.ndarray, want: np.ndarray, dtype: str, *, atol: float, rows: list[int] | None = None
) -> None:
    """Row ``i`` of ``got`` is the vector of the input of row ``rows[i]`` of ``want`` (default:
    row ``i``), computed in another batch: nearer to that row than to any other, and in
    float32 equal to it to ``atol``. In bfloat16 (what `--dtype auto` picks on CPUs with
    avx512_bf16/AMX) a batch of another shape rounds differently (8 mantissa bits; AMX kernels
    block by batch size), so there the bar is the direction: cosine >= 0.999, the project's
    bfloat16 parity bar."""
    own = np.arange(len(got)) if rows is None else np.asarray(rows)
    similarity = got @ want.T
    nearest = similarity.argmax(axis=1)
    assert (nearest == own).all(), f"rows answered with other inputs' vectors: {nearest}"
    if dtype == "float32":
        np.testing.assert_allclose(got, want[own], atol=atol)
    else:
        assert dtype == "bfloat16", dtype
        assert similarity[np.arange(len(got)), own].min() >= 0.999


def test_vectors_match_sentence_transformers(
    client: openai.OpenAI, model_name: str, server: RunningServer
) -> None:
    from sentence_transformers import SentenceTransformer

    info = server.lifecycle.engine.info()  # type: ignore[union-attr]
    reference = SentenceTransformer(info.model_path, device="cpu").encode(
        TEXTS, normalize_embeddings=True
    )
    got = vectors(client.embeddings.create(input=TEXTS, model=model_name, encoding_format="float"))
    assert got.shape == (len(TEXTS), 384)
    if info.dtype == "float32":
        np.testing.assert_allclose(got, reference, atol=2e-5)
    else:
        # `--dtype auto` picks bfloat16 on CPUs with avx512_bf16/AMX: 8 mantissa bits, so the
        # vectors agree in direction (the project's bf16 parity bar), not to 2e-5 per value.
        assert info.dtype == "bfloat16"
        assert (got * reference).sum(axis=1).min() >= 0.999


def test_float_and_base64_decode_to_the_same_vectors(
    client: openai.OpenAI, model_name: str
) -> None:
    as_float = vectors(
        client.embeddings.create(input=TEXTS, model=model_name, encoding_format="float")
    )
    # The SDK asks for base64 by default and decodes it as float32 itself.
    as_base64 = vectors(client.embeddings.create(input=TEXTS, model=model_name))
    np.testing.assert_array_equal(as_float, as_base64)
    norms = np.linalg.norm(as_float, axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)


def test_batch_keeps_input_order_and_reports_usage(
    client: openai.OpenAI, model_name: str, server: RunningServer
) -> None:
    batch = client.embeddings.create(input=TEXTS, model=model_name)
    alone = np.concatenate(
        [vectors(client.embeddings.create(input=t, model=model_name)) for t in TEXTS]
    )
    assert_own_vectors(vectors(batch), alone, served_dtype(server), atol=1e-5)
    assert batch.model == model_name
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > len(TEXTS) * 2


def test_dimensions_truncates_and_renormalizes(client: openai.OpenAI, model_name: str) -> None:
    full = vectors(client.embeddings.create(input=TEXTS, model=model_name))
    short = vectors(client.embeddings.create(input=TEXTS, model=model_name, dimensions=128))
    assert short.shape == (len(TEXTS), 128)
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-5)


def test_dimensions_the_server_does_not_allow_are_a_400(
    client: openai.OpenAI, model_name: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(input="x", model=model_name, dimensions=100)
    assert caught.value.body["param"] == "dimensions"  # type: ignore[index]


def test_token_id_inputs_embed_like_their_text(
    client: openai.OpenAI, model_name: str, server: RunningServer
) -> None:
    ids = [
        httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS[:2]
    ]
    from_text = vectors(client.embeddings.create(input=TEXTS[:2], model=model_name))
    from_ids = vectors(client.embeddings.create(input=ids, model=model_name))
    np.testing.assert_allclose(from_ids, from_text, atol=1e-5)
    single = vectors(client.embeddings.create(input=ids[0], model=model_name))
    np.testing.assert_allclose(single[0], from_text[0], atol=1e-5)


def test_over_long_input_is_refused_naming_the_token_count(
    client: openai.OpenAI, model_name: str
) -> None:
    long_text = "word " * 400
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(input=["short", long_text], model=model_name)
    body = caught.value.body
    assert body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert "402 tokens" in body["message"] and "256" in body["message"]  # type: ignore[index]


def test_truncation_on_request(client: openai.OpenAI, model_name: str) -> None:
    long_text = " ".join(f"w{i}" for i in range(600))
    right = client.embeddings.create(
        input=long_text, model=model_name, extra_body={"truncate_prompt_tokens": -1}
    )
    assert right.usage.prompt_tokens == 256
    left = client.embeddings.create(
        input=long_text,
        model=model_name,
        extra_body={"truncate_prompt_tokens": -1, "truncation_side": "left"},
    )
    short = client.embeddings.create(
        input=long_text, model=model_name, extra_body={"truncate_prompt_tokens": 16}
    )
    assert short.usage.prompt_tokens == 16
    assert not np.allclose(vectors(right), vectors(left), atol=1e-3)


def test_normalize_false_and_half_precision_base64(
    client: openai.OpenAI, model_name: str, server: RunningServer
) -> None:
    raw = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": TEXTS[0], "normalize": False, "encoding_format": "float"},
    ).json()
    assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1.0) > 1e-3
    import base64

    full = vectors(client.embeddings.create(input=TEXTS[0], model=model_name))[0]
    for dtype, np_dtype, tol in (("float16", np.float16, 1e-3), ("bfloat16", None, 1e-2)):
        body = httpx.post(
            server.url + "/v1/embeddings",
            json={"input": TEXTS[0], "encoding_format": "base64", "embed_dtype": dtype},
        ).json()
        data = base64.b64decode(body["data"][0]["embedding"])
        assert len(data) == 384 * 2
        if np_dtype is not None:
            decoded = np.frombuffer(data, dtype="<f2").astype(np.float32)
        else:
            decoded = (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_allclose(decoded, full, atol=tol)


def test_another_model_name_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(input="x", model="text-embedding-3-large")
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_models_lists_the_served_model(client: openai.OpenAI, model_name: str) -> None:
    assert [m.id for m in client.models.list()] == [model_name]
    # The packaged default answers to its hub id and to its short name.
    assert model_name == "sentence-transformers/all-MiniLM-L6-v2"
    vectors(client.embeddings.create(input="x", model="all-MiniLM-L6-v2"))


def _mixed_texts(n: int) -> list[str]:
    rng = random.Random(7)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
        "nu",
        "xi",
        "omicron",
        "pi",
        "rho",
        "sigma",
        "tau",
    ]
    return [
        " ".join(rng.choice(words) for _ in range(rng.choice((1, 2, 5, 12, 30, 90))))
        for _ in range(n)
    ]


def test_concurrent_mixed_requests_each_get_their_own_vector(server: RunningServer) -> None:
    unique = _mixed_texts(40)
    texts = [unique[(i * 7) % len(unique)] for i in range(200)]  # each text five times
    url = server.url + "/v1/embeddings"

    async def embed(batch: list[str], concurrent: bool) -> list[np.ndarray]:
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:

            async def one(text: str) -> np.ndarray:
                response = await http.post(url, json={"input": text})
                assert response.status_code == 200, response.text
                return np.array(response.json()["data"][0]["embedding"], np.float32)

            if concurrent:
                return list(await asyncio.gather(*(one(t) for t in batch)))
            return [await one(t) for t in batch]

    alone = dict(zip(unique, asyncio.run(embed(unique, concurrent=False)), strict=True))
    crowd = asyncio.run(embed(texts, concurrent=True))
    distinct = list(alone)  # each text once: a repeated text has one row to match
    assert_own_vectors(
        np.stack(crowd),
        np.stack([alone[text] for text in distinct]),
        served_dtype(server),
        atol=2e-5,
        rows=[distinct.index(text) for text in texts],
    )

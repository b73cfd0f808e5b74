"""The device-shaped benchmark model (``fake?tokenizer=minilm&device_us_per_token=...``): the
packaged MiniLM's own tokenizer, and forward passes that wait for a simulated accelerator in
proportion to their tokens, with the GIL free and no CPU spent, as a host thread waiting on a
GPU does. ``bench.frontend`` measures the front end on it, so what it promises is checked
here: the wait, the free GIL, the token counts and deterministic vectors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from embedding_server.device.fake import DEVICE_MODEL, FakeModel, FakeOptions
from embedding_server.device.hub import resolve_model_path
from embedding_server.device.models.base import PackedBatch
from embedding_server.device.tokenizer_files import load_tokenizer
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError
from embedding_server.settings import DEFAULT_MODEL

pytestmark = pytest.mark.timeout(120)

TEXTS = [
    "hello world",
    "The cat sat on the mat.",
    "Embeddings map text to vectors; similar meanings land close together. " * 4,
    "x",
]


def _model(us_per_token: float, launch_us: float) -> FakeModel:
    options = FakeOptions.parse(
        f"fake?device_us_per_token={us_per_token}&device_launch_us={launch_us}"
    )
    return FakeModel(260, options, torch.device("cpu"), torch.float32)


def _batch(tokens: int) -> PackedBatch:
    """``tokens`` tokens packed in sequences of at most 250."""
    lengths = [250] * (tokens // 250) + ([tokens % 250] if tokens % 250 else [])
    return PackedBatch.build([[5] * n for n in lengths], torch.device("cpu"))


def _timed_forward(model: FakeModel, batch: PackedBatch) -> tuple[float, float]:
    """Wall and this thread's CPU seconds of one forward pass."""
    wall, cpu = time.perf_counter(), time.thread_time()
    model.forward(batch)
    return time.perf_counter() - wall, time.thread_time() - cpu


def test_the_wait_is_the_launch_cost_plus_a_time_per_token() -> None:
    model = _model(us_per_token=1000, launch_us=20_000)  # 20 ms + 1 ms a token
    assert model.device_seconds(10) == pytest.approx(0.030)
    assert model.device_seconds(300) == pytest.approx(0.320)
    model.forward(_batch(1))  # torch's first-call costs are not the device's
    small_wall, _ = _timed_forward(model, _batch(10))
    large_wall, _ = _timed_forward(model, _batch(300))
    assert small_wall >= 0.030
    assert large_wall >= 0.320
    # The difference is the 290 extra tokens' 290 ms, give or take a busy machine's scheduling.
    assert 0.8 * 0.290 <= large_wall - small_wall < 0.290 + 0.5


def test_no_wait_unless_asked() -> None:
    plain = FakeModel(
        260, FakeOptions.parse("fake"), torch.device("cpu"), torch.float32
    ).device_seconds(10_000)
    assert plain == 0.0


def test_the_wait_frees_the_gil_and_spends_no_cpu() -> None:
    model = _model(us_per_token=0, launch_us=300_000)  # 0.3 s
    stop = threading.Event()
    counts = [0]

    def spin() -> None:
        while not stop.is_set():
            counts[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)  # let it start
        before = counts[0]
        wall, cpu = _timed_forward(model, _batch(4))
        progressed = counts[0] - before
    finally:
        stop.set()
        spinner.join()
    assert wall >= 0.3
    # The waiting thread spends (almost) no CPU: a spin-wait would spend all of its 0.3 s.
    assert cpu < 0.1
    # Another Python thread kept running meanwhile: with the GIL held it could not count.
    assert progressed > 10_000


@pytest.fixture(scope="module")
def device_engine() -> Iterator[Engine]:
    with Engine.from_pretrained(DEVICE_MODEL) as engine:
        yield engine


def test_requests_cost_the_real_minilm_tokens(device_engine: Engine) -> None:
    tokenizer, _ = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    tokenizer.no_padding()  # the packaged tokenizer.json pads; the server never does
    expected = [len(tokenizer.encode(text).ids) for text in TEXTS]
    result = device_engine.embed_full(TEXTS)
    assert result.token_counts == expected
    assert result.prompt_tokens == sum(expected)
    assert device_engine.info().vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)


def test_vectors_are_deterministic_and_batch_independent(device_engine: Engine) -> None:
    crowd = device_engine.embed(TEXTS)
    again = device_engine.embed(TEXTS)
    alone = np.stack([device_engine.embed([text])[0] for text in TEXTS])
    assert crowd.shape == (len(TEXTS), 384)
    np.testing.assert_array_equal(crowd, again)
    np.testing.assert_allclose(alone, crowd, atol=1e-6)
    assert np.allclose(np.linalg.norm(crowd, axis=1), 1.0, atol=1e-5)
    # Different texts, different vectors.
    assert np.abs(crowd @ crowd.T - np.eye(len(TEXTS))).max() < 0.99


def test_a_second_engine_gives_the_same_vectors(device_engine: Engine) -> None:
    with Engine.from_pretrained(DEVICE_MODEL) as other:
        np.testing.assert_array_equal(other.embed(TEXTS), device_engine.embed(TEXTS))


@pytest.mark.parametrize(
    "model, field",
    [
        ("fake?tokenizer=gpt2", "tokenizer"),
        ("fake?device_us_per_token=-1", "device_us_per_token"),
        ("fake?device_launch_us=inf", "device_launch_us"),
        ("fake?device_launch_us=soon", "bad fake-model option"),
    ],
)
def test_bad_device_options_are_refused_naming_them(model: str, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field) as caught:
        FakeOptions.parse(model)
    assert caught.value.param == "model"


# -- no per-token work on the host ------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_from_ids_is_the_plain_fake_models_vector(pooling: str) -> None:
    """The device-shaped model pools from the token ids, without per-token rows on the host;
    what a client gets is the plain fake model's vector (same tokenizer, same tables)."""
    device = f"fake?tokenizer=minilm&pooling={pooling}&device_us_per_token=0.1&device_launch_us=1"
    with (
        Engine.from_pretrained(f"fake?tokenizer=minilm&pooling={pooling}", dtype="float32") as a,
        Engine.from_pretrained(device, dtype="float32") as b,
    ):
        np.testing.assert_allclose(b.embed(TEXTS), a.embed(TEXTS), rtol=0, atol=2e-6)
        # Truncated to fewer dimensions and left unnormalized too.
        np.testing.assert_allclose(
            b.embed(TEXTS, dimensions=64, normalize=False),
            a.embed(TEXTS, dimensions=64, normalize=False),
            rtol=0,
            atol=2e-5,
        )


def test_the_forward_pass_hands_the_host_no_token_rows_unless_token_states_are_asked(
    device_engine: Engine,
) -> None:
    runner = device_engine._runner
    model = runner.model
    assert isinstance(model, FakeModel)
    shapes: list[tuple[bool, int]] = []
    original = model.forward

    def watched(batch: PackedBatch, *, rows: bool = True) -> torch.Tensor:
        hidden = original(batch, rows=rows)
        shapes.append((model.is_placeholder(hidden), hidden.shape[0]))
        return hidden

    model.forward = watched  # type: ignore[method-assign]
    try:
        vectors = device_engine.embed(TEXTS)
        states = device_engine.embed_tokens(TEXTS)
    finally:
        del model.forward
    tokens = sum(len(s) for s in states)
    # The embeddings' pass got rows that hold no memory; the token states' pass real ones.
    assert shapes[0] == (True, tokens)
    assert shapes[-1] == (False, tokens)
    # The token states are the rows whose mean is the vector.
    means = np.stack([s.mean(axis=0) for s in states])
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    np.testing.assert_allclose(means, vectors, rtol=0, atol=1e-2)

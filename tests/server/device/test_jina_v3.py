"""jina-embeddings-v3 served natively: the rotary XLM-R body and its task LoRA adapters,
chosen per request and mixed within one packed batch.

transformers (>= 5) has the body (``JinaEmbeddingsV3Model``) but not the adapters, so the
reference for adapter ``t`` is that model with every LoRA'd weight merged by hand,
``W + alpha/r * B[t] @ A[t]`` (``A[t] @ B[t]`` for the embeddings), as jina's
``LoRAParametrization.lora_forward`` computes it; no adapter is the model as saved
(``tests.support.jina_v3``). One packed batch of mixed lengths mixing several adapters and
sequences without one must match each sequence run alone through its merged reference:
cosine >= 0.99999 in float32, >= 0.999 in bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from embedding_server.device.distributed import Shard
from embedding_server.device.models import PackedBatch, build_model, lookup
from embedding_server.device.models.jina_v3 import JinaV3Model
from embedding_server.device.weights import load_weights
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from embedding_server.ipc.messages import decode_sequences, encode_sequences
from embedding_server.request.sequences import SequenceInput
from embedding_server.settings import ServerSettings
from transformers import AutoTokenizer

from tests.support.api import running_server
from tests.support.attention import assert_rows_close
from tests.support.jina_v3 import (
    ADAPTERS,
    INSTRUCTIONS,
    build_jina_v3,
    config_of,
    merged_reference,
)
from tests.support.models import rewrite_checkpoint

pytestmark = pytest.mark.timeout(300)

F32_COSINE = 0.99999
BF16_COSINE = 0.999
LENGTHS = [1, 2, 3, 5, 9, 9, 17, 40, 64, 96, 128, 200]
# Each sequence's adapter index, -1 for none: every adapter and the base weights, mixed.
PLAN = [0, -1, 1, 2, 3, 4, -1, 0, 1, 4, -1, 2]
TEXTS = ["what is a fox?", "The quick brown fox jumps over the lazy dog.", "x"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(native, hub)``: transformers' save and the Hub layout with task LoRA."""
    return build_jina_v3(tmp_path_factory.mktemp("jina-v3"))


def _sequences(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [
        [0, *torch.randint(4, vocab, (max(0, n - 2),), generator=generator).tolist(), 2][:n]
        for n in LENGTHS
    ]


def _references(
    native: Path, hub: Path, seqs: list[list[int]], plan: list[int]
) -> list[np.ndarray]:
    """Each sequence's token states, run alone through its adapter's merged reference."""
    models = {a: merged_reference(native, hub, None if a < 0 else ADAPTERS[a]) for a in set(plan)}
    with torch.no_grad():
        return [
            models[a](input_ids=torch.tensor([s])).last_hidden_state[0].numpy()
            for s, a in zip(seqs, plan, strict=True)
        ]


def _packed_states(
    hub: Path, seqs: list[list[int]], plan: list[int], dtype: torch.dtype, kernel: str = ""
) -> list[np.ndarray]:
    from embedding_server.device.attention import Backend

    model = build_model(
        config_of(hub), dict(load_weights(hub)), dtype=dtype, device=torch.device("cpu")
    )
    assert isinstance(model, JinaV3Model) and list(model.adapters) == ADAPTERS
    backend = Backend(kernel) if kernel else Backend.SDPA_BUCKETED
    batch = PackedBatch.build(seqs, torch.device("cpu"), 0, attention=backend, adapters=plan)
    with torch.inference_mode():
        hidden = model.forward(batch).float().numpy()
    return np.split(hidden, np.cumsum([len(s) for s in seqs])[:-1])


@pytest.mark.parametrize("kernel", ["sdpa_bucketed", "sdpa_padded"])
def test_packed_batch_mixing_adapters_matches_merged_transformers(
    dirs: tuple[Path, Path], kernel: str
) -> None:
    native, hub = dirs
    seqs = _sequences(config_of(hub)["vocab_size"])
    expected = _references(native, hub, seqs, PLAN)
    got = _packed_states(hub, seqs, PLAN, torch.float32, kernel)
    for have, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(have, want, atol=3e-5, rtol=1e-4)
    assert_rows_close(got, expected, min_cosine=F32_COSINE)
    # The adapters matter: the same sequence under the base weights is elsewhere.
    base = _references(native, hub, seqs, [-1] * len(seqs))
    moved = [i for i, a in enumerate(PLAN) if a >= 0]
    assert all(np.abs(got[i] - base[i]).max() > 0.05 for i in moved)


def test_bfloat16_points_where_float32_merged_transformers_does(dirs: tuple[Path, Path]) -> None:
    native, hub = dirs
    seqs = _sequences(config_of(hub)["vocab_size"])
    got = _packed_states(hub, seqs, PLAN, torch.bfloat16)
    assert_rows_close(got, _references(native, hub, seqs, PLAN), min_cosine=BF16_COSINE)


def test_transformers_native_layout_is_served(dirs: tuple[Path, Path]) -> None:
    """transformers' own ``jina_embeddings_v3`` save (no adapters) is the same body."""
    native, hub = dirs
    assert lookup(config_of(native)).model_type == "jina_embeddings_v3"
    engine = Engine.from_pretrained(str(native), dtype="float32", normalize=False)
    info = engine.info()
    assert info.backend == "native" and info.pooling == "mean" and info.adapters == []
    seqs = _sequences(info.vocab_size)
    expected = _references(native, hub, seqs, [-1] * len(seqs))
    assert_rows_close(engine.embed_tokens(seqs), expected, min_cosine=F32_COSINE)


def _reference_embedding(native: Path, hub: Path, text: str, adapter: str | None) -> np.ndarray:
    """jina's ``encode(text, task=adapter)``: the adapter's instruction prepended, mean
    pooling, L2-normalized."""
    tok = AutoTokenizer.from_pretrained(str(native))
    prompt = INSTRUCTIONS[adapter] if adapter else ""
    ids = tok(prompt + text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        states = merged_reference(native, hub, adapter)(input_ids=ids).last_hidden_state[0]
    vector = states.mean(0).numpy()
    return vector / np.linalg.norm(vector)


@pytest.fixture(scope="module")
def engine(dirs: tuple[Path, Path]) -> Iterator[Engine]:
    yield Engine.from_pretrained(str(dirs[1]), dtype="float32")


def test_offline_api_chooses_the_adapter(dirs: tuple[Path, Path], engine: Engine) -> None:
    """``adapter=`` (and the prompt name of the same name) runs that adapter with its prompt;
    none runs the base weights, as jina's ``encode`` with ``task=None``."""
    native, hub = dirs
    info = engine.info()
    assert info.adapters == ADAPTERS and info.prompts == INSTRUCTIONS and info.pooling == "mean"
    for adapter in (None, "retrieval.query", "retrieval.passage", "text-matching"):
        expected = np.stack([_reference_embedding(native, hub, t, adapter) for t in TEXTS])
        got = engine.embed(TEXTS, adapter=adapter)
        assert_rows_close(got, expected, min_cosine=F32_COSINE)
        if adapter is not None:
            by_prompt = engine.embed(TEXTS, prompt_name=adapter)
            np.testing.assert_allclose(by_prompt, got, atol=1e-6)
    query, passage = engine.embed(TEXTS, adapter="retrieval.query"), engine.embed(TEXTS)
    assert np.abs(query - passage).max() > 0.05
    # Matryoshka sizes from config.json: the first 16 dimensions, renormalized.
    assert info.matryoshka and info.matryoshka_dimensions == [8, 16, 32]
    short = engine.embed(TEXTS, adapter="retrieval.query", dimensions=16)
    head = query[:, :16] / np.linalg.norm(query[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, head, atol=1e-6)


def test_one_batch_runs_each_sequence_with_its_own_adapter(
    dirs: tuple[Path, Path], engine: Engine
) -> None:
    """The runner takes adapters per sequence: one batch of three adapters and none gives
    what each gives alone."""
    ids = engine.tokenize(TEXTS[1])[0]
    plan = [0, None, 2, 4]
    out = engine._runner.run([SequenceInput(ids, adapter=a) for a in plan])
    for row, adapter in zip(out.pooled, plan, strict=True):
        alone = engine._runner.run([SequenceInput(ids, adapter=adapter)]).pooled[0]
        np.testing.assert_allclose(row, alone, atol=1e-5)
    assert len({tuple(np.round(r, 4)) for r in out.pooled}) == len(plan)


def test_unknown_adapter_is_refused_naming_the_option(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError) as error:
        engine.embed(["a"], adapter="summarization")
    assert error.value.param == "adapter" and "retrieval.query" in error.value.message


def test_model_without_adapters_refuses_one(dirs: tuple[Path, Path]) -> None:
    engine = Engine.from_pretrained(str(dirs[0]), dtype="float32")
    with pytest.raises(InvalidRequestError, match="no task adapters") as error:
        engine.embed(["a"], adapter="retrieval.query")
    assert error.value.param == "adapter"


def test_adapters_cross_the_process_boundary() -> None:
    """``--api-workers`` front-ends send each sequence's adapter to the engine process."""
    seqs = [SequenceInput([0, 5, 2], adapter=3), SequenceInput([0, 2]), SequenceInput([7], 1)]
    back = decode_sequences(encode_sequences(seqs), want_tokens=False)
    assert [s.adapter for s in back] == [3, None, None]
    assert [list(s.ids) for s in back] == [[0, 5, 2], [0, 2], [7]]
    plain = decode_sequences(encode_sequences([SequenceInput([1, 2])]), want_tokens=False)
    assert plain[0].adapter is None


def test_http_input_type_and_task_choose_the_adapter(
    dirs: tuple[Path, Path], engine: Engine
) -> None:
    """Cohere's ``input_type`` maps onto jina's prompt and adapter names (search_query ->
    retrieval.query, search_document -> retrieval.passage, clustering -> separation); Jina's
    ``task`` field names one directly; an unknown ``task`` is a 400 naming it."""
    settings = ServerSettings(model=str(dirs[1]), dtype="float32")
    with running_server(settings) as server:

        def post(path: str, body: dict[str, object]) -> httpx.Response:
            return httpx.post(server.url + path, json=body, timeout=60)

        def vectors(body: dict[str, object]) -> np.ndarray:
            response = post("/v1/embeddings", {"input": TEXTS, **body})
            assert response.status_code == 200, response.text
            return np.array([row["embedding"] for row in response.json()["data"]])

        for input_type, adapter in (
            ("search_query", "retrieval.query"),
            ("search_document", "retrieval.passage"),
            ("clustering", "separation"),
        ):
            expected = engine.embed(TEXTS, adapter=adapter)
            np.testing.assert_allclose(vectors({"input_type": input_type}), expected, atol=1e-5)
        query = vectors({"task": "retrieval.query"})
        np.testing.assert_allclose(query, engine.embed(TEXTS, adapter="retrieval.query"), atol=1e-5)
        assert np.abs(query - vectors({"task": "retrieval.passage"})).max() > 0.05
        np.testing.assert_allclose(vectors({}), engine.embed(TEXTS), atol=1e-5)

        cohere = post("/v2/embed", {"texts": TEXTS, "input_type": "search_query"})
        assert cohere.status_code == 200, cohere.text
        got = np.array(cohere.json()["embeddings"]["float"])
        np.testing.assert_allclose(got, engine.embed(TEXTS, adapter="retrieval.query"), atol=1e-5)

        bad = post("/v1/embeddings", {"input": TEXTS, "task": "summarization"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "task"
        assert "retrieval.query" in bad.json()["error"]["message"]


def test_default_prompt_name_sets_the_default_adapter(
    dirs: tuple[Path, Path], engine: Engine
) -> None:
    """A request naming no adapter runs the one named like the server's default prompt."""
    served = Engine.from_pretrained(
        str(dirs[1]), dtype="float32", default_prompt_name="retrieval.passage"
    )
    np.testing.assert_allclose(
        served.embed(TEXTS), engine.embed(TEXTS, adapter="retrieval.passage"), atol=1e-6
    )


def test_checkpoints_we_cannot_serve_exactly_are_refused(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    _, hub = dirs
    no_factors = rewrite_checkpoint(
        hub, tmp_path / "no-factors", rename=lambda n: None if ".lora_" in n else n
    )
    with pytest.raises(UnsupportedModelError, match="holds no LoRA factors"):
        Engine.from_pretrained(str(no_factors), dtype="float32")
    unnamed = rewrite_checkpoint(hub, tmp_path / "unnamed", config={"lora_adaptations": None})
    with pytest.raises(UnsupportedModelError, match="names no lora_adaptations"):
        Engine.from_pretrained(str(unnamed), dtype="float32")
    wrong_rank = rewrite_checkpoint(hub, tmp_path / "rank", config={"lora_rank": 8})
    with pytest.raises(UnsupportedModelError, match="lora_rank"):
        Engine.from_pretrained(str(wrong_rank), dtype="float32")
    fewer = rewrite_checkpoint(hub, tmp_path / "fewer", config={"lora_adaptations": ADAPTERS[:3]})
    with pytest.raises(UnsupportedModelError, match="3 adapters"):
        Engine.from_pretrained(str(fewer), dtype="float32")
    interleaved = rewrite_checkpoint(
        hub, tmp_path / "gptj", config={"rotary_emb_interleaved": True}
    )
    with pytest.raises(UnsupportedModelError, match="rotary_emb_interleaved"):
        Engine.from_pretrained(str(interleaved), dtype="float32")


def test_two_ranks_give_the_vectors_of_one(dirs: tuple[Path, Path], engine: Engine) -> None:
    """Heads and MLP columns split over two ranks, each adapter's factors with its weight;
    every token's adapter crosses to the other rank with the batch plan. One batch mixing
    adapters gives one rank's vectors."""
    ids = [engine.tokenize(t)[0] for t in TEXTS]
    plan = [0, None, 4]
    seqs = [SequenceInput(i, adapter=a) for i, a in zip(ids, plan, strict=True)]
    expected = engine._runner.run(seqs).pooled
    with Engine.from_pretrained(str(dirs[1]), dtype="float32", tensor_parallel_size=2) as parallel:
        assert parallel.info().adapters == ADAPTERS
        assert_rows_close(list(parallel._runner.run(seqs).pooled), list(expected), F32_COSINE)
        got = parallel.embed(TEXTS, adapter="retrieval.passage")
        want = engine.embed(TEXTS, adapter="retrieval.passage")
        assert_rows_close(list(got), list(want), min_cosine=F32_COSINE)
        # The split itself: rank 0 holds half the heads and half of each adapter's B rows.
        weights, config = dict(load_weights(dirs[1])), config_of(dirs[1])
        half = build_model(
            config, weights, dtype=torch.float32, device=torch.device("cpu"), shard=Shard(0, 2)
        )
        assert isinstance(half, JinaV3Model) and half.split.heads == 2
        lora = half.layers[0].qkv_lora
        assert lora is not None and lora.up.shape == (len(ADAPTERS) * 4, 3 * 16)


def test_inspect_lists_the_task_adapters(
    dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``embedding-server inspect`` (from weight shapes only) names the adapters a request
    can choose."""
    from embedding_server.cli import main

    assert main(["inspect", "--model", str(dirs[1])]) == 0
    out = capsys.readouterr().out
    assert "task adapters     " + ", ".join(ADAPTERS) in out
    assert "pooling           mean" in out


async def test_scheduled_requests_with_different_adapters_share_batches(
    dirs: tuple[Path, Path], engine: Engine
) -> None:
    """Online, concurrent requests naming different adapters (and none) are batched
    together; each gets its own adapter's vectors, whatever it was batched with."""
    import asyncio

    plan: list[str | None] = ["retrieval.query", None, "separation", "text-matching"] * 2
    expected = {a: engine.embed(TEXTS, adapter=a) for a in set(plan)}
    online = Engine.from_pretrained(str(dirs[1]), dtype="float32")
    await online.start()
    try:
        before = online.scheduler.batches_run
        results = await asyncio.gather(*(online.aembed(TEXTS, adapter=a) for a in plan))
        ran = online.scheduler.batches_run - before
    finally:
        await online.stop()
    for adapter, result in zip(plan, results, strict=True):
        np.testing.assert_allclose(result.embeddings, expected[adapter], atol=1e-5)
    # Queued in one loop tick, they share batches (here: all eight in one) rather than
    # running one batch per adapter or per request.
    assert ran < len(set(plan)), ran

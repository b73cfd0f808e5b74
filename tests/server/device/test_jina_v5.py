"""jina-embeddings-v5-text-small (vLLM's ``JinaEmbeddingsV5Model``) served natively, with its
task adapters chosen per request, against its authors' computation on a tiny random
checkpoint of its layout (``tests/support/jina_v5.py``).

The reference is the authors' ``encode(texts, task, prompt_name)``: transformers'
``Qwen3Model`` with the task's peft LoRA merged (``W + (alpha / r) * B @ A``), the text
prefixed ``"Query: "`` or ``"Document: "`` (the default), the last token's state,
L2-normalized. A request naming no task runs ``retrieval``, vLLM's default. The -nano
sibling's EuroBERT body (``is_decoder: false``) is checked the same way against
transformers' ``EuroBertModel``, attending both ways.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from embedding_server.device.loading import load_model
from embedding_server.device.models import PackedBatch, build_model
from embedding_server.device.models.jina_v5 import JinaV5Model, read_adapters
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from embedding_server.settings import ServerSettings
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tests.support.api import running_server
from tests.support.attention import assert_rows_close
from tests.support.jina_v5 import TASKS, build_jina_v5, merged_reference

F32_COSINE = 0.99999
BF16_COSINE = 0.999
TEXTS = ["what is a fox?", "x", "The quick brown fox jumps over the lazy dog, twice over."]
TASK_NAMES = list(TASKS)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(base, hub)``: transformers' Qwen3 save and the jina-embeddings-v5 layout."""
    return build_jina_v5(tmp_path_factory.mktemp("jina-v5"))


@pytest.fixture(scope="module")
def references(dirs: tuple[Path, Path]) -> dict[str, torch.nn.Module]:
    return {task: merged_reference(*dirs, task) for task in TASK_NAMES}


def _encode(
    base: Path, model: torch.nn.Module, texts: list[str], prompt_name: str = "document"
) -> np.ndarray:
    """The authors' encode: prefix, tokenize, the last token's state, normalized."""
    tok = AutoTokenizer.from_pretrained(str(base))
    prefix = "Query: " if prompt_name == "query" else "Document: "
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tok(prefix + text, return_tensors="pt")
            state = model(**ids).last_hidden_state[0, -1]
            rows.append(torch.nn.functional.normalize(state, dim=-1).numpy())
    return np.stack(rows)


@pytest.fixture(scope="module")
def engine(dirs: tuple[Path, Path]) -> Iterator[Engine]:
    yield Engine.from_pretrained(str(dirs[1]), dtype="float32")


def _model(hub: Path, dtype: torch.dtype) -> JinaV5Model:
    config = json.loads((hub / "config.json").read_text())
    from embedding_server.device.weights import load_weights

    config, weights = read_adapters(hub, config, load_weights(hub))
    model = build_model(config, dict(weights), dtype=dtype, device=torch.device("cpu"))
    assert isinstance(model, JinaV5Model)
    return model


@pytest.mark.parametrize(
    ("dtype", "min_cosine"), [(torch.float32, F32_COSINE), (torch.bfloat16, BF16_COSINE)]
)
def test_packed_batch_mixing_tasks_matches_each_tasks_merged_model(
    dirs: tuple[Path, Path],
    references: dict[str, torch.nn.Module],
    dtype: torch.dtype,
    min_cosine: float,
) -> None:
    """Sequences of mixed lengths, each with its own task, in one packed forward pass: every
    token state is the one its task's merged model gives it alone."""
    model = _model(dirs[1], dtype)
    assert list(model.adapters) == TASK_NAMES
    vocab = json.loads((dirs[1] / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(5)
    lengths = [1, 3, 7, 12, 30, 64, 5, 17]
    plan = [0, 1, 2, 3, 0, 3, 2, 1]
    seqs = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    batch = PackedBatch.build(seqs, torch.device("cpu"), adapters=plan)
    with torch.inference_mode():
        got = torch.split(model.forward(batch).float(), lengths)
    with torch.no_grad():
        want = [
            references[TASK_NAMES[a]](input_ids=torch.tensor([s])).last_hidden_state[0]
            for s, a in zip(seqs, plan, strict=True)
        ]
    assert_rows_close([g.numpy() for g in got], [w.numpy() for w in want], min_cosine=min_cosine)
    # The adapters matter: another task's model puts the same sequence elsewhere.
    with torch.no_grad():
        other = references[TASK_NAMES[1]](input_ids=torch.tensor([seqs[0]])).last_hidden_state[0]
    assert float(torch.abs(other - want[0]).max()) > 0.05


@pytest.mark.parametrize("task", TASK_NAMES)
def test_engine_serves_encode_of_each_task(
    dirs: tuple[Path, Path], references: dict[str, torch.nn.Module], engine: Engine, task: str
) -> None:
    base, _ = dirs
    for prompt_name in ("query", "document"):
        want = _encode(base, references[task], TEXTS, prompt_name)
        got = engine.embed(TEXTS, adapter=task, prompt_name=prompt_name)
        assert_rows_close(got, want, min_cosine=F32_COSINE)


def test_bfloat16_engine_points_where_encode_does(
    dirs: tuple[Path, Path], references: dict[str, torch.nn.Module]
) -> None:
    served = Engine.from_pretrained(str(dirs[1]), dtype="bfloat16")
    want = _encode(dirs[0], references["text-matching"], TEXTS, "query")
    got = served.embed(TEXTS, adapter="text-matching", prompt_name="query")
    assert_rows_close(got, want, min_cosine=BF16_COSINE)


def test_defaults_are_retrieval_and_the_document_prompt(
    dirs: tuple[Path, Path], references: dict[str, torch.nn.Module], engine: Engine
) -> None:
    """encode's prompt_name defaults to document; a request naming no task runs retrieval
    (vLLM's default), never the bare base weights."""
    info = engine.info()
    assert info.adapters == TASK_NAMES and info.pooling == "last"
    assert info.prompts == {"query": "Query: ", "document": "Document: "}
    assert info.default_prompt_name == "document"
    want = _encode(dirs[0], references["retrieval"], TEXTS, "document")
    assert_rows_close(engine.embed(TEXTS), want, min_cosine=F32_COSINE)
    query = engine.embed(TEXTS, prompt_name="query")
    assert_rows_close(query, _encode(dirs[0], references["retrieval"], TEXTS, "query"), F32_COSINE)


def test_unknown_task_is_a_400_naming_the_tasks(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError) as error:
        engine.embed(["a"], adapter="retrieval.query")
    assert error.value.param == "adapter" and "text-matching" in error.value.message


def test_http_task_and_input_type(
    dirs: tuple[Path, Path], references: dict[str, torch.nn.Module], engine: Engine
) -> None:
    """Jina's ``task`` field picks the adapter, ``input_type`` the prompt; an unknown task is
    a 400 naming the field."""
    settings = ServerSettings(model=str(dirs[1]), dtype="float32")
    with running_server(settings) as server:

        def post(body: dict[str, object]) -> httpx.Response:
            return httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)

        response = post({"input": TEXTS, "task": "clustering", "input_type": "query"})
        assert response.status_code == 200, response.text
        got = np.array([row["embedding"] for row in response.json()["data"]])
        want = _encode(dirs[0], references["clustering"], TEXTS, "query")
        assert_rows_close(got, want, min_cosine=F32_COSINE)
        plain = post({"input": TEXTS})
        assert plain.status_code == 200, plain.text
        np.testing.assert_allclose(
            np.array([row["embedding"] for row in plain.json()["data"]]),
            engine.embed(TEXTS),
            atol=1e-5,
        )
        bad = post({"input": TEXTS, "task": "summarization"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "task"


def _copy(hub: Path, dst: Path) -> Path:
    shutil.copytree(hub, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def nano(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(base, hub)`` of the -nano layout: a EuroBERT body, ``is_decoder: false``."""
    return build_jina_v5(tmp_path_factory.mktemp("jina-v5-nano"), body="eurobert")


@pytest.mark.parametrize(
    ("dtype", "min_cosine"), [(torch.float32, F32_COSINE), (torch.bfloat16, BF16_COSINE)]
)
def test_the_nanos_eurobert_body_attends_both_ways_with_its_tasks(
    nano: tuple[Path, Path], dtype: torch.dtype, min_cosine: float
) -> None:
    """One packed batch mixing tasks and lengths against transformers' ``EuroBertModel``
    with each task merged (bidirectional: a causal body would differ on every token but
    the last)."""
    base, hub = nano
    model = _model(hub, dtype)
    assert not model.causal
    references = {task: merged_reference(base, hub, task) for task in TASK_NAMES}
    vocab = json.loads((hub / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(9)
    lengths = [2, 9, 33, 4, 17]
    plan = [3, 0, 1, 2, 0]
    seqs = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    batch = PackedBatch.build(seqs, torch.device("cpu"), adapters=plan)
    with torch.inference_mode():
        got = [g.numpy() for g in torch.split(model.forward(batch).float(), lengths)]
    with torch.no_grad():
        want = [
            references[TASK_NAMES[a]](input_ids=torch.tensor([s])).last_hidden_state[0].numpy()
            for s, a in zip(seqs, plan, strict=True)
        ]
    assert_rows_close(got, want, min_cosine=min_cosine)


def test_the_nano_engine_serves_encode(nano: tuple[Path, Path]) -> None:
    base, hub = nano
    engine = Engine.from_pretrained(str(hub), dtype="float32")
    assert engine.info().adapters == TASK_NAMES and engine.info().pooling == "last"
    for task, prompt_name in (("retrieval", "query"), ("classification", "document")):
        want = _encode(base, merged_reference(base, hub, task), TEXTS, prompt_name)
        got = engine.embed(TEXTS, adapter=task, prompt_name=prompt_name)
        assert_rows_close(got, want, min_cosine=F32_COSINE)


def test_a_causal_eurobert_is_refused(nano: tuple[Path, Path], tmp_path: Path) -> None:
    causal = _copy(nano[1], tmp_path / "causal")
    _edit_config(causal, is_causal=True)
    with pytest.raises(UnsupportedModelError, match="is_causal: true"):
        load_model(
            str(causal), revision=None, cache_dir=None, dtype="float32", device=torch.device("cpu")
        )


def test_a_missing_adapter_is_refused(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    bare = _copy(dirs[1], tmp_path / "bare")
    shutil.rmtree(bare / "adapters" / "clustering")
    with pytest.raises(UnsupportedModelError, match=r"task 'clustering'.*adapter_config\.json"):
        Engine.from_pretrained(str(bare), dtype="float32")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias 'all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ],
)
def test_peft_settings_it_cannot_reproduce_are_refused(
    dirs: tuple[Path, Path], tmp_path: Path, change: dict[str, object], match: str
) -> None:
    path = _copy(dirs[1], tmp_path / "peft")
    settings_file = path / "adapters" / "retrieval" / "adapter_config.json"
    settings = json.loads(settings_file.read_text())
    settings_file.write_text(json.dumps({**settings, **change}))
    with pytest.raises(UnsupportedModelError, match=match):
        Engine.from_pretrained(str(path), dtype="float32")


def test_an_adapted_module_it_does_not_read_is_refused(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """An adapter on the embeddings (peft's lora_embedding_A/B) is a tensor nobody reads:
    the audit refuses the load, naming it."""
    path = _copy(dirs[1], tmp_path / "embedding-lora")
    file = path / "adapters" / "retrieval" / "adapter_model.safetensors"
    tensors = load_file(str(file))
    tensors["base_model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 8)
    save_file(tensors, str(file))
    with pytest.raises(UnsupportedModelError, match="lora_embedding_A"):
        Engine.from_pretrained(str(path), dtype="float32")


def test_a_sequence_naming_no_task_runs_retrieval_beside_others(engine: Engine) -> None:
    """One batch of sequences with and without a task: those without run retrieval, as
    they do alone, never the bare base weights."""
    from embedding_server.request.sequences import SequenceInput

    ids = engine.tokenize("Document: " + TEXTS[2])[0]
    plan = [None, 1, None, 3]
    out = engine._runner.run([SequenceInput(ids, adapter=a) for a in plan])
    retrieval = engine._runner.run([SequenceInput(ids, adapter=0)]).pooled[0]
    for row, adapter in zip(out.pooled, plan, strict=True):
        alone = engine._runner.run([SequenceInput(ids, adapter=adapter)]).pooled[0]
        np.testing.assert_allclose(row, alone, atol=1e-5)
        if adapter is None:
            np.testing.assert_allclose(row, retrieval, atol=1e-5)


def test_another_architecture_name_is_refused(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """Only the authors' class name is served as this family; another name may run other
    math on the same weights."""
    renamed = _copy(dirs[1], tmp_path / "renamed")
    _edit_config(renamed, architectures=["JinaEmbeddingsV5ForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="JinaEmbeddingsV5ForCausalLM"):
        Engine.from_pretrained(str(renamed), dtype="float32")


def test_a_hub_checkpoint_fetches_its_adapters_with_the_weights(
    dirs: tuple[Path, Path], engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the Hub: the body audited from its headers before the download, the adapters'
    files fetched with the weights, and the same vectors as the local directory."""
    from tests.support.hub import FakeHub

    hub = FakeHub(dirs[1], tmp_path / "hub").install(monkeypatch)
    served = Engine.from_pretrained("jinaai/jina-embeddings-v5-text-small", dtype="float32")
    assert ("headers", []) in hub.calls
    fetched = hub.weights_downloaded()
    assert all(any(f"adapters/{t}/adapter_model.safetensors" in f for f in fetched) for t in TASKS)
    for task in ("retrieval", "clustering"):
        np.testing.assert_allclose(
            served.embed(TEXTS, adapter=task), engine.embed(TEXTS, adapter=task), atol=1e-6
        )


def test_tensor_parallelism_is_refused_naming_it(dirs: tuple[Path, Path]) -> None:
    """The adapters are not split across ranks: a rank of two refuses, rather than run the
    base weights' share with whole adapters."""
    from embedding_server.device.distributed import Shard
    from embedding_server.device.weights import load_weights

    hub = dirs[1]
    config, weights = read_adapters(
        hub, json.loads((hub / "config.json").read_text()), load_weights(hub)
    )
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size"):
        build_model(
            config,
            dict(weights),
            dtype=torch.float32,
            device=torch.device("cpu"),
            shard=Shard(1, 2),
        )

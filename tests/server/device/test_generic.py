"""The transformers backend: the long tail served by transformers' own model classes.

A T5 encoder (no native implementation) and a model that only its own code can run are
served through the same engine, scheduler, pooling, heads and HTTP API as the native
families, and must give sentence-transformers' vectors; what the backend cannot serve
exactly (remote code not allowed, tensor parallelism, a tensor it would drop) is refused
with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from embedding_server.device import generic
from embedding_server.device.generic import TransformersModel, padded_groups
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from embedding_server.settings import ServerSettings
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    T5EncoderModel,
)

from tests.support.api import running_server
from tests.support.attention import assert_rows_close
from tests.support.models import (
    CUSTOM_CODE_MARKER,
    _save_tokenizer,
    add_sentence_transformers,
    build_custom_code,
    build_t5_encoder,
    byte_tokenizer,
    spread_weights,
)
from tests.support.tasks import build_classifier

F32_COSINE = 0.99999
# Lengths from 2 to 60 byte tokens: several padded groups in one batch (padded_groups).
TEXTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "embedding " * 5,
    "x",
    "tokens, and then more tokens",
    "a somewhat longer sentence that runs on past fifty tokens",
    "mid-sized input",
]


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A T5 encoder wrapped as gtr-t5 and sentence-t5 are: mean pooling, a Dense layer
    without bias or activation, Normalize."""
    body = build_t5_encoder(tmp_path_factory.mktemp("t5") / "t5")
    return add_sentence_transformers(
        body, pooling="mean", dense_out=24, dense_activation=torch.nn.Identity, dense_bias=False
    )


@pytest.fixture(scope="module")
def custom_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    body = build_custom_code(tmp_path_factory.mktemp("custom") / "tiny-encoder")
    return add_sentence_transformers(body, pooling="mean", trust_remote_code=True)


@pytest.fixture
def forward_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """The sequence lengths of every forward pass of the transformers backend."""
    calls: list[tuple[int, ...]] = []
    original = TransformersModel.forward

    def spy(self: TransformersModel, batch: generic.PackedBatch) -> torch.Tensor:
        calls.append(batch.seqlens)
        return original(self, batch)

    monkeypatch.setattr(TransformersModel, "forward", spy)
    yield calls


def _sentence_transformers(path: Path, texts: list[str], **kwargs: bool) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", **kwargs)
    return np.asarray(model.encode(texts, convert_to_numpy=True), dtype=np.float32)


def test_t5_encoder_matches_sentence_transformers(
    t5_dir: Path, forward_calls: list[tuple[int, ...]]
) -> None:
    engine = Engine.from_pretrained(str(t5_dir), dtype="float32")
    info = engine.info()
    assert (info.backend, info.model_type, info.architecture) == (
        "transformers",
        "t5",
        "T5EncoderModel",
    )
    assert (info.attention, info.pooling, info.dimensions, info.normalize) == (
        "sdpa",
        "mean",
        24,
        True,
    )
    vectors = engine.embed(TEXTS)
    # One forward pass held every text, of mixed lengths.
    assert len(forward_calls) == 1 and len(set(forward_calls[0])) == len(TEXTS)
    assert len(padded_groups(forward_calls[0])) > 1
    expected = _sentence_transformers(t5_dir, TEXTS)
    assert vectors.shape == expected.shape == (len(TEXTS), 24)
    assert_rows_close(vectors, expected, min_cosine=F32_COSINE)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_t5_in_bfloat16_stays_close_to_sentence_transformers(t5_dir: Path) -> None:
    engine = Engine.from_pretrained(str(t5_dir), dtype="bfloat16")
    assert engine.info().dtype == "bfloat16"
    expected = _sentence_transformers(t5_dir, TEXTS)
    assert_rows_close(engine.embed(TEXTS), expected, min_cosine=0.999)


def test_t5_hidden_states_match_transformers_per_sequence(t5_dir: Path) -> None:
    """Each sequence's token states from a mixed batch equal T5EncoderModel's on it alone
    (eager attention, no padding): padding and unpadding lose nothing."""
    engine = Engine.from_pretrained(str(t5_dir), dtype="float32", max_model_len=128)
    seqs = engine.tokenize(TEXTS)
    seqs.append(seqs[0][:1])  # one token
    ours = engine.embed_tokens(seqs)
    encoder = T5EncoderModel.from_pretrained(str(t5_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        for seq, got in zip(seqs, ours, strict=True):
            want = encoder(input_ids=torch.tensor([seq])).last_hidden_state[0].numpy()
            assert got.shape == want.shape == (len(seq), 32)
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_t5_over_http_matches_sentence_transformers_and_says_its_backend(t5_dir: Path) -> None:
    settings = ServerSettings(model=str(t5_dir), dtype="float32")
    with running_server(settings) as server:
        response = httpx.post(
            server.url + "/v1/embeddings", json={"input": TEXTS, "model": str(t5_dir)}, timeout=60
        )
        assert response.status_code == 200, response.text
        vectors = np.asarray([row["embedding"] for row in response.json()["data"]])
        info = httpx.get(server.url + "/info", timeout=10).json()
        labels = {
            "backend": "transformers",
            "model_type": "t5",
            "architecture": "T5EncoderModel",
            "attention": "sdpa",
        }
        assert server.metric("embedding_server_model_info", labels) == 1.0
    assert_rows_close(vectors, _sentence_transformers(t5_dir, TEXTS), min_cosine=F32_COSINE)
    assert (info["backend"], info["model_type"], info["attention"]) == (
        "transformers",
        "t5",
        "sdpa",
    )


def test_custom_code_model_matches_sentence_transformers_when_trusted(
    custom_dir: Path, forward_calls: list[tuple[int, ...]]
) -> None:
    engine = Engine.from_pretrained(str(custom_dir), dtype="float32", trust_remote_code=True)
    info = engine.info()
    assert (info.backend, info.model_type, info.architecture) == (
        "transformers",
        "tiny_encoder",
        "TinyEncoderModel",
    )
    # Its class does not declare SDPA support: transformers' eager path, and /info says so.
    assert info.attention == "eager"
    assert os.environ.get(CUSTOM_CODE_MARKER) == "1"
    vectors = engine.embed(TEXTS)
    assert len(forward_calls) == 1
    expected = _sentence_transformers(custom_dir, TEXTS, trust_remote_code=True)
    assert_rows_close(vectors, expected, min_cosine=F32_COSINE)


def test_custom_code_is_refused_without_trust_remote_code_and_never_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = build_custom_code(tmp_path / "untrusted-encoder")
    monkeypatch.delenv(CUSTOM_CODE_MARKER, raising=False)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path))
    message = str(refused.value)
    assert "auto_map" in message and "modeling_tiny_encoder.TinyEncoderModel" in message
    assert "--trust-remote-code" in message and "trustRemoteCode" in message
    assert "'tiny_encoder' has no native implementation" in message
    assert CUSTOM_CODE_MARKER not in os.environ  # not one line of it was imported


def test_backend_native_refuses_t5_naming_the_model_type(t5_dir: Path) -> None:
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(t5_dir), backend="native")
    message = str(refused.value)
    assert "model_type 't5'" in message and "T5EncoderModel" in message
    assert "bert" in message  # the native model types
    assert "backend auto or transformers" in message


def test_tensor_parallel_is_refused_before_any_rank_starts(
    t5_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embedding_server import engine as engine_module

    def no_ranks(*args: object, **kwargs: object) -> None:
        raise AssertionError("tensor-parallel ranks were started")

    monkeypatch.setattr(engine_module, "TensorParallelGroup", no_ranks)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(t5_dir), tensor_parallel_size=2)
    message = str(refused.value)
    assert "tensor_parallel_size 2" in message and "transformers backend" in message
    assert "model_type 't5' has no native implementation" in message
    assert "tensor_parallel_size 1" in message


def test_t5_refuses_float16_as_native_families_that_overflow_do(t5_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="t5 activations overflow float16"):
        Engine.from_pretrained(str(t5_dir), dtype="float16")


def test_a_native_kernel_setting_is_refused_on_the_transformers_backend(t5_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="attention=sdpa_padded"):
        Engine.from_pretrained(str(t5_dir), attention="sdpa_padded")


def test_auto_serves_registered_model_types_natively(t5_dir: Path) -> None:
    from embedding_server.device.generic import choose_backend

    assert choose_backend({"model_type": "bert"}, "auto", model="m") == "native"
    assert choose_backend({"model_type": "t5"}, "auto", model="m") == "transformers"
    assert choose_backend({"model_type": "bert"}, "transformers", model="m") == "transformers"
    assert Engine.from_pretrained(dtype="float32").info().backend == "native"


def test_forced_transformers_backend_gives_the_native_vectors(t5_dir: Path) -> None:
    """MiniLM through transformers' BertModel: the same vectors as our packed BERT."""
    texts = [*TEXTS, "The packaged all-MiniLM-L6-v2, served by both backends."]
    native = Engine.from_pretrained(dtype="float32")
    forced = Engine.from_pretrained(dtype="float32", backend="transformers")
    assert (native.info().backend, forced.info().backend) == ("native", "transformers")
    assert forced.info().attention == "sdpa"
    assert_rows_close(forced.embed(texts), native.embed(texts), min_cosine=F32_COSINE)


def test_cross_encoder_on_the_transformers_backend_matches_transformers(tmp_path: Path) -> None:
    """A classifier runs transformers' own head: scores are its sigmoid logits, pairs carry
    their segment ids."""
    path = build_classifier(tmp_path / "bert-ce", "bert", 1)
    engine = Engine.from_pretrained(str(path), dtype="float32", backend="transformers")
    assert (engine.info().backend, engine.info().task) == ("transformers", "score")
    queries = ["what is a fox?", "q", "where do cats sleep in the winter months?"]
    docs = ["the fox is an animal", "d", "cats sleep anywhere warm " * 4]
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        logits = [
            model(**tok(q, d, return_tensors="pt")).logits[0, 0].item()
            for q, d in zip(queries, docs, strict=True)
        ]
    expected = 1 / (1 + np.exp(-np.asarray(logits)))
    np.testing.assert_allclose(engine.score(queries, docs), expected, atol=1e-5)
    native = Engine.from_pretrained(str(path), dtype="float32")
    np.testing.assert_allclose(engine.score(queries, docs), native.score(queries, docs), atol=1e-5)


def test_token_classifier_on_the_transformers_backend_matches_native(tmp_path: Path) -> None:
    path = build_classifier(tmp_path / "bert-ner", "bert", 3, per_token=True)
    forced = Engine.from_pretrained(str(path), dtype="float32", backend="transformers")
    native = Engine.from_pretrained(str(path), dtype="float32")
    assert forced.info().task == native.info().task == "token_classify"
    assert forced.info().labels == native.info().labels == ["class_0", "class_1", "class_2"]
    with pytest.raises(UnsupportedModelError, match="task reward"):
        Engine.from_pretrained(str(path), backend="transformers", task="reward")
    for ours, theirs in zip(
        forced.token_classify(TEXTS),
        native.token_classify(TEXTS),
        strict=True,
    ):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_a_tensor_the_class_does_not_read_refuses_the_load(t5_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "t5-extra"
    shutil.copytree(t5_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    weights["projection_head.weight"] = torch.zeros(4, 32)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path))
    assert "projection_head.weight" in str(refused.value)
    assert "does not read" in str(refused.value)


def test_a_missing_weight_refuses_the_load(t5_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "t5-missing"
    shutil.copytree(t5_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    dropped = "encoder.final_layer_norm.weight"
    del weights[dropped]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path))
    assert dropped in str(refused.value) and "at random" in str(refused.value)


def test_a_model_type_nobody_knows_is_refused_naming_it(t5_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "unknown"
    shutil.copytree(t5_dir, path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="made_up", architectures=["MadeUpModel"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path))
    message = str(refused.value)
    assert "'made_up'" in message and "MadeUpModel" in message and "auto_map" in message


_ENCODER = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 130,
}
# model_type -> (the pretraining class its Hub checkpoints are saved as, config)
LONG_TAIL: dict[str, tuple[type, dict[str, object]]] = {
    "mpnet": (AutoModelForMaskedLM, _ENCODER),
    "distilbert": (
        AutoModelForMaskedLM,
        {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "max_position_embeddings": 128},
    ),
    "camembert": (AutoModelForMaskedLM, _ENCODER),
    "electra": (AutoModelForPreTraining, {**_ENCODER, "embedding_size": 16}),
    "deberta-v2": (AutoModelForMaskedLM, _ENCODER),
    "ernie": (AutoModelForMaskedLM, _ENCODER),
    "gemma2": (
        AutoModelForCausalLM,
        {**_ENCODER, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128},
    ),
}


@pytest.mark.parametrize("model_type", sorted(LONG_TAIL))
def test_long_tail_model_types_match_transformers(tmp_path: Path, model_type: str) -> None:
    """Checkpoints saved as Hub checkpoints of these types are (an MLM, ELECTRA's
    discriminator, a causal LM: heads and all) give transformers' own hidden states, each
    sequence of a mixed batch as if alone; the pretraining heads are left unread by name, and
    the body class's pooler, which such checkpoints lack, is not used."""
    auto, options = LONG_TAIL[model_type]
    tok = byte_tokenizer(["<pad>", "<s>", "</s>", "<unk>"], "<s> $A </s>", ["<s>", "</s>"])
    _save_tokenizer(
        tok, tmp_path, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    torch.manual_seed(8)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=tok.get_vocab_size(),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **options,
    )
    pretrained = auto.from_config(config)
    spread_weights(pretrained)
    pretrained.save_pretrained(str(tmp_path))
    # A causal LM with no sentence-transformers config is refused under task auto (it may be
    # a yes/no reranker); its hidden states are served as embeddings only when asked.
    task = "embed" if auto is AutoModelForCausalLM else "auto"
    engine = Engine.from_pretrained(
        str(tmp_path), dtype="float32", backend="transformers", task=task
    )
    assert engine.info().backend == "transformers"
    seqs = engine.tokenize(TEXTS)
    reference = AutoModel.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    with torch.no_grad():
        for seq, got in zip(seqs, engine.embed_tokens(seqs), strict=True):
            want = reference(input_ids=torch.tensor([seq])).last_hidden_state[0].numpy()
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_padded_groups_keep_order_and_bound_padding() -> None:
    lengths = [1, 2, 3, 5, 8, 8, 9, 30, 31, 33, 120]
    groups = padded_groups(lengths)
    assert [n for group in groups for n in group] == lengths
    for group in groups:
        padded, real = len(group) * max(group), sum(group)
        assert len(group) == 1 or padded <= real * (1 + generic.PAD_SLACK) + generic.PAD_TOKENS
    assert padded_groups([]) == []
    assert padded_groups([7] * 50) == [[7] * 50]


def test_a_generative_checkpoint_is_not_served_as_an_embedder_silently(tmp_path: Path) -> None:
    """bge-reranker-v2-gemma is a GemmaForCausalLM scored by its yes-token logit: with no
    sentence-transformers config, the transformers backend refuses it under task auto, as the
    native path refuses Qwen3-Reranker, rather than serve cosines of last-token states."""
    auto, options = LONG_TAIL["gemma2"]
    tok = byte_tokenizer(["<pad>", "<s>", "</s>", "<unk>"], "<s> $A </s>", ["<s>", "</s>"])
    _save_tokenizer(
        tok, tmp_path, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    config = AutoConfig.for_model(
        "gemma2", vocab_size=tok.get_vocab_size(), pad_token_id=0, **options
    )
    auto.from_config(config).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="Gemma2ForCausalLM") as refused:
        Engine.from_pretrained(str(tmp_path), dtype="float32")
    assert "--task embed" in str(refused.value)

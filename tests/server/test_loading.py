"""Loading: sentence-transformers pipelines, weight layouts, Hub cache, resolved info()."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from _models import add_sentence_transformers
from embedding_server.engine import Engine
from embedding_server.errors import ModelNotFoundError, UnsupportedModelError
from embedding_server.loading import read_sentence_transformers
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer

TEXTS = ["a", "the same model, read by two libraries", "tokens " * 15, "zz top"]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def st_bert_dense(tiny_model: Callable[[str], Path]) -> Path:
    """Tiny BERT + mean pooling (prompt excluded) + Dense(tanh, 24) + Normalize, prompts."""
    return add_sentence_transformers(
        tiny_model("bert"),
        pooling="mean",
        dense_out=24,
        include_prompt=False,
        prompts={"query": "search query: ", "doc": "search document: "},
        default_prompt_name="query",
    )


@pytest.fixture(scope="module")
def st_qwen3_last(tiny_model: Callable[[str], Path]) -> Path:
    return add_sentence_transformers(
        tiny_model("qwen3"), pooling="lasttoken", prompts={"query": "Instruct: find it\nQuery: "}
    )


def test_sentence_transformers_pipeline_parity(st_bert_dense: Path) -> None:
    """Pooling config, Dense layer, Normalize, default prompt and include_prompt=False."""
    engine = Engine.from_pretrained(str(st_bert_dense), dtype="float32")
    info = engine.info()
    assert (info.pooling, info.normalize, info.dimensions, info.hidden_size) == (
        "mean",
        True,
        24,
        32,
    )
    assert info.default_prompt_name == "query" and info.max_input_tokens == 64
    st = SentenceTransformer(str(st_bert_dense), device="cpu")
    for kwargs in ({}, {"prompt_name": "doc"}, {"prompt": "custom: "}):
        want = st.encode(TEXTS, **kwargs)
        got = engine.embed(TEXTS, **kwargs)
        assert got.shape == (4, 24)
        assert cosines(got, want).min() >= 0.9999, kwargs


def test_decoder_last_token_pipeline_parity(st_qwen3_last: Path) -> None:
    engine = Engine.from_pretrained(str(st_qwen3_last), dtype="float32")
    assert engine.info().pooling == "last"
    st = SentenceTransformer(str(st_qwen3_last), device="cpu")
    for kwargs in ({}, {"prompt_name": "query"}):
        assert cosines(engine.embed(TEXTS, **kwargs), st.encode(TEXTS, **kwargs)).min() >= 0.9999


def test_pooling_override_and_unsupported_mode(st_bert_dense: Path, tmp_path: Path) -> None:
    mean = Engine.from_pretrained(str(st_bert_dense), dtype="float32", normalize=False)
    cls = Engine.from_pretrained(
        str(st_bert_dense), dtype="float32", pooling="cls", normalize=False
    )
    assert cls.info().pooling == "cls" and not cls.info().normalize
    assert not np.allclose(cls.embed(TEXTS), mean.embed(TEXTS))
    shutil.copytree(st_bert_dense, tmp_path / "m")
    pooling_cfg = tmp_path / "m" / "1_Pooling" / "config.json"
    cfg = json.loads(pooling_cfg.read_text())
    cfg["pooling_mode"] = "max"
    pooling_cfg.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="max"):
        Engine.from_pretrained(str(tmp_path / "m"))
    assert Engine.from_pretrained(str(tmp_path / "m"), pooling="mean").info().pooling == "mean"


def _copy_without_weights(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    return load_file(str(src / "model.safetensors"))


@pytest.mark.parametrize("layout", ["sharded-safetensors", "pytorch-bin", "sharded-bin"])
def test_weight_layouts(tiny_model: Callable[[str], Path], tmp_path: Path, layout: str) -> None:
    src = tiny_model("qwen2")
    reference = Engine.from_pretrained(str(src), dtype="float32").embed(TEXTS)
    weights = _copy_without_weights(src, tmp_path / "m")
    names = sorted(weights)
    halves = {"shard-1": names[: len(names) // 2], "shard-2": names[len(names) // 2 :]}
    if layout == "sharded-safetensors":
        from safetensors.torch import save_file

        weight_map = {}
        for shard, keys in halves.items():
            save_file({k: weights[k] for k in keys}, str(tmp_path / "m" / f"{shard}.safetensors"))
            weight_map.update({k: f"{shard}.safetensors" for k in keys})
        (tmp_path / "m" / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    elif layout == "pytorch-bin":
        torch.save(weights, tmp_path / "m" / "pytorch_model.bin")
    else:
        weight_map = {}
        for shard, keys in halves.items():
            torch.save({k: weights[k] for k in keys}, tmp_path / "m" / f"{shard}.bin")
            weight_map.update({k: f"{shard}.bin" for k in keys})
        (tmp_path / "m" / "pytorch_model.bin.index.json").write_text(
            json.dumps({"weight_map": weight_map})
        )
    loaded = Engine.from_pretrained(str(tmp_path / "m"), dtype="float32").embed(TEXTS)
    np.testing.assert_allclose(loaded, reference, atol=1e-6)


def test_missing_weights_and_directories(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    _copy_without_weights(tiny_model("bert"), tmp_path / "m")
    with pytest.raises(UnsupportedModelError, match="no weights"):
        Engine.from_pretrained(str(tmp_path / "m"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Engine.from_pretrained(str(tmp_path / "nowhere"))


def test_hub_id_resolves_from_the_local_cache_when_offline(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub id is served from cache_dir with HF_HUB_OFFLINE=1 (no network in tests)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--acme--tiny-bert"
    shutil.copytree(tiny_model("bert"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    engine = Engine.from_pretrained("acme/tiny-bert", cache_dir=str(tmp_path), dtype="float32")
    assert engine.info().model == "acme/tiny-bert"
    assert engine.info().model_path == str(repo / "snapshots" / commit)
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        Engine.from_pretrained("acme/absent", cache_dir=str(tmp_path))


def test_minilm_info(minilm_engine: Engine) -> None:
    info = minilm_engine.info().to_dict()
    expected = {
        "architecture": "BertModel",
        "model_type": "bert",
        "hidden_size": 384,
        "dimensions": 384,
        "max_input_tokens": 256,
        "pooling": "mean",
        "normalize": True,
        "dtype": "float32",
        "device": "cpu",
        "matryoshka": False,
        "matryoshka_dimensions": None,
        "prompts": {},
        "vocab_size": 30522,
    }
    assert {k: info[k] for k in expected} == expected
    json.dumps(info)  # serializable as-is for /info


def test_minilm_sentence_transformers_files(minilm_dir: Path) -> None:
    st = read_sentence_transformers(minilm_dir)
    assert (st.present, st.pooling, st.normalize, st.max_seq_length) == (True, "mean", True, 256)
    assert st.dense == []

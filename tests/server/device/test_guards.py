"""The fidelity guards: a model is served as its authors compute it, or refused at load
with a message naming the model, what was found and what to do.

* every tensor of a checkpoint is read, or declared ignorable by its family with a reason;
  anything else refuses the load, on every tensor-parallel rank too;
* a Hub model's config files are read, and the model refused, before any weight is
  downloaded (a fake ``snapshot_download`` records what was asked for);
* a ``*ForCausalLM`` checkpoint with no sentence-transformers config (a yes/no reranker or a
  chat model) is not silently served as an embedder;
* custom code (``auto_map``) is never run: served natively when we implement its
  ``model_type``, refused otherwise.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub
import numpy as np
import pytest
import torch
from embedding_server.device.distributed import Shard
from embedding_server.device.inspection import inspect_model
from embedding_server.device.loading import load_model, load_shard
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from embedding_server.settings import DEFAULT_MODEL, EngineSettings
from safetensors import safe_open
from safetensors.torch import load_file

from tests.support.device_cases import fake_snapshot_download
from tests.support.models import (
    add_sentence_transformers,
    build_decoder,
    rewrite_checkpoint,
)
from tests.support.tasks import build_splade

TEXTS = ["a", "every tensor is read or declared", "tokens " * 9]
CPU = torch.device("cpu")


def _load(model: str, **kwargs: Any) -> Any:
    return load_model(model, revision=None, cache_dir=None, dtype="float32", device=CPU, **kwargs)


# -- every tensor is used or declared -------------------------------------------------------


def test_the_packaged_minilm_reads_every_tensor_but_its_declared_buffers_and_pooler() -> None:
    loaded = _load(DEFAULT_MODEL)
    audit = loaded.tensors
    assert audit is not None and audit.unclaimed == ()
    ignored = dict(audit.ignored)
    assert set(ignored) == {"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"}
    assert (
        "pooler" in ignored["pooler.dense.weight"]
        and "buffer" in ignored["embeddings.position_ids"]
    )
    with safe_open(str(loaded.path / "model.safetensors"), "pt") as f:
        total = len(list(f.keys()))
    assert len(audit.read) == total - 3


def test_an_unknown_tensor_refuses_the_load_naming_the_model_and_the_tensors(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    extra = {f"extra_head.{i}.weight": torch.zeros(2, 32) for i in range(7)}
    path = rewrite_checkpoint(tiny_model("bert"), tmp_path / "bert-extra", add=extra)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path))
    message = str(refused.value)
    assert message.startswith(f"model {str(path)!r}: ")
    assert "7 tensor(s)" in message and "and 2 more" in message
    assert all(f"extra_head.{i}.weight" in message for i in range(5))
    assert "extra_head.6.weight" not in message  # the first few, not a wall of names
    assert "embedding-server inspect" in message  # what to do


def test_a_tensor_parallel_rank_applies_the_same_rule(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_model("qwen3")
    clean = load_shard(
        str(src), revision=None, cache_dir=None, dtype="float32", device=CPU, shard=Shard(1, 2)
    )
    assert clean[0].hidden_size == 32
    path = rewrite_checkpoint(src, tmp_path / "q", add={"adapter.weight": torch.zeros(4, 4)})
    with pytest.raises(UnsupportedModelError, match=r"adapter\.weight"):
        load_shard(
            str(path), revision=None, cache_dir=None, dtype="float32", device=CPU, shard=Shard(1, 2)
        )


def test_known_extras_of_each_kind_are_ignored_with_their_reason(tmp_path: Path) -> None:
    """A ForCausalLM's lm_head and saved rotary buffers; a ForMaskedLM's head served as an
    embedder, which task sparse then reads."""
    causal = build_decoder(tmp_path / "qwen3-lm", "qwen3", causal_lm=True)
    buffers = {
        "model.rotary_emb.inv_freq": torch.ones(8),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
    }
    causal = rewrite_checkpoint(causal, tmp_path / "qwen3-lm-buffers", add=buffers)
    audit = _load(str(causal), task="embed").tensors
    ignored = dict(audit.ignored)
    assert set(ignored) == {"lm_head.weight", *buffers}
    assert "language-model head" in ignored["lm_head.weight"]
    # What is ignored takes no part: the body alone gives the same vectors.
    body = rewrite_checkpoint(
        causal, tmp_path / "qwen3-body", rename=lambda n: None if n in ignored else n
    )
    bare = Engine.from_pretrained(str(body), dtype="float32", task="embed").embed(TEXTS)
    lm = Engine.from_pretrained(str(causal), dtype="float32", task="embed").embed(TEXTS)
    np.testing.assert_allclose(lm, bare, atol=1e-6)

    mlm = build_splade(tmp_path / "splade", "bert").parent / "splade-body"  # BertForMaskedLM
    embedded = _load(str(mlm)).tensors
    assert any(name.startswith("cls.predictions.") for name, _ in embedded.ignored)
    sparse = _load(str(mlm), task="sparse").tensors
    assert not any(name.startswith("cls.predictions.") for name, _ in sparse.ignored)
    assert "cls.predictions.transform.dense.weight" in sparse.read


# -- config before weights ------------------------------------------------------------------

COMMIT = "c0ffee00" * 5


@pytest.fixture
def fake_hub(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Callable[[Path], tuple[Path, list[tuple[str | None, list[str]]]]]:
    """Serve a local directory as a Hub repository: ``snapshot_download`` copies the files
    its ``allow_patterns`` match (as the Hub's fnmatch filter does) into a snapshot folder,
    and records each call's revision and patterns."""

    def serve(repo: Path) -> tuple[Path, list[tuple[str | None, list[str]]]]:
        calls: list[tuple[str | None, list[str]]] = []
        snapshot = tmp_path / "hub" / "snapshots" / COMMIT

        def record(kwargs: dict[str, Any]) -> None:
            calls.append((kwargs.get("revision"), list(kwargs.get("allow_patterns") or ["*"])))

        fake_snapshot_download(monkeypatch, repo, snapshot, record, honour_ignore_patterns=False)
        return snapshot, calls

    return serve


def _weights_in(snapshot: Path) -> list[Path]:
    return [p for p in snapshot.rglob("*") if p.suffix in (".safetensors", ".bin")]


def test_a_hub_model_is_read_from_its_config_then_its_weights_of_the_same_commit(
    tiny_model: Callable[[str], Path],
    fake_hub: Callable[[Path], tuple[Path, list[tuple[str | None, list[str]]]]],
) -> None:
    repo = add_sentence_transformers(tiny_model("bert"), pooling="mean", dense_out=24)
    snapshot, calls = fake_hub(repo)
    engine = Engine.from_pretrained("acme/tiny-bert-dense", dtype="float32")
    assert engine.info().dimensions == 24
    (first_revision, first), (second_revision, second) = calls
    assert first_revision is None and not any("safetensors" in p or "bin" in p for p in first)
    assert second_revision == COMMIT  # pinned: a push between the two cannot mix commits
    assert "*.safetensors" in second and "2_Dense/model.safetensors" in second
    local = Engine.from_pretrained(str(repo), dtype="float32")
    np.testing.assert_allclose(engine.embed(TEXTS), local.embed(TEXTS), atol=1e-6)
    assert _weights_in(snapshot)


def test_a_bin_only_hub_model_fetches_its_checkpoint_and_nothing_else(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    fake_hub: Callable[[Path], tuple[Path, list[tuple[str | None, list[str]]]]],
) -> None:
    src = tiny_model("bert")
    repo = tmp_path / "repo"
    shutil.copytree(src, repo, ignore=shutil.ignore_patterns("model.safetensors"))
    torch.save(load_file(str(src / "model.safetensors")), repo / "pytorch_model.bin")
    torch.save({"lr": torch.tensor(0.1)}, repo / "training_args.bin")
    snapshot, calls = fake_hub(repo)
    engine = Engine.from_pretrained("acme/bin-only", dtype="float32")
    assert [revision for revision, _ in calls] == [None, COMMIT, COMMIT]
    assert sorted(p.name for p in _weights_in(snapshot)) == ["pytorch_model.bin"]
    local = Engine.from_pretrained(str(src), dtype="float32")
    np.testing.assert_allclose(engine.embed(TEXTS), local.embed(TEXTS), atol=1e-6)


def _unsupported_type(src: Path, dst: Path) -> Path:
    """A model type neither backend knows (T5, which this test used before, is now served by
    the transformers backend)."""
    return rewrite_checkpoint(
        src, dst, config={"model_type": "made_up", "architectures": ["MadeUpModel"]}
    )


def _custom_code(src: Path, dst: Path) -> Path:
    return rewrite_checkpoint(
        src,
        dst,
        config={
            "model_type": "nvembed",
            "architectures": ["NVEmbedModel"],
            "auto_map": {"AutoModel": "modeling_nvembed.NVEmbedModel"},
        },
    )


def _unsupported_module(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.StaticEmbedding",
                }
            ]
        )
    )
    return dst


@pytest.mark.parametrize(
    ("build", "found"),
    [
        (_unsupported_type, "model_type 'made_up' (MadeUpModel) has no native implementation"),
        (_custom_code, "modeling_nvembed.NVEmbedModel"),
        (_unsupported_module, "StaticEmbedding"),
    ],
)
def test_an_unsupported_hub_model_is_refused_before_any_weight_is_downloaded(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    fake_hub: Callable[[Path], tuple[Path, list[tuple[str | None, list[str]]]]],
    build: Callable[[Path, Path], Path],
    found: str,
) -> None:
    snapshot, calls = fake_hub(build(tiny_model("bert"), tmp_path / "repo"))
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained("acme/unsupported")
    assert str(refused.value).startswith("model 'acme/unsupported': ")
    assert found in str(refused.value)
    assert len(calls) == 1  # the config download only
    assert _weights_in(snapshot) == []


def test_inspecting_a_hub_model_reads_safetensors_headers_not_weights(
    tiny_model: Callable[[str], Path],
    fake_hub: Callable[[Path], tuple[Path, list[tuple[str | None, list[str]]]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo = tiny_model("bert")
    snapshot, calls = fake_hub(repo)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    asked: list[tuple[str, str | None]] = []

    def get_safetensors_metadata(repo_id: str, *, revision: str | None = None) -> Any:
        asked.append((repo_id, revision))
        with safe_open(str(repo / "model.safetensors"), "pt") as f:
            tensors = {
                name: SimpleNamespace(
                    dtype=str(f.get_slice(name).get_dtype()),
                    shape=list(f.get_slice(name).get_shape()),
                )
                for name in f.keys()  # noqa: SIM118
            }
        return SimpleNamespace(
            files_metadata={"model.safetensors": SimpleNamespace(tensors=tensors)}
        )

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", get_safetensors_metadata)
    inspection = inspect_model(EngineSettings(model="acme/tiny-bert", dtype="float32"))
    assert asked == [("acme/tiny-bert", COMMIT)]
    # The config, then only the small files read whole (Dense modules, bge-m3's heads).
    assert calls[1:] == [(COMMIT, ["sparse_linear.pt", "colbert_linear.pt"])]
    assert _weights_in(snapshot) == []
    assert (inspection.info.hidden_size, inspection.info.max_input_tokens) == (32, 128)
    assert {name for name, _ in inspection.ignored} == {"pooler.dense.weight", "pooler.dense.bias"}


# -- generative checkpoints are not silently embedders --------------------------------------


@pytest.fixture(scope="module")
def qwen3_causal_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3ForCausalLM with no sentence-transformers files: Qwen3-Reranker's shape."""
    return build_decoder(tmp_path_factory.mktemp("reranker") / "qwen3", "qwen3", causal_lm=True)


def test_a_causal_lm_without_sentence_transformers_config_is_refused_under_task_auto(
    qwen3_causal_lm: Path,
) -> None:
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(qwen3_causal_lm))
    message = str(refused.value)
    assert str(qwen3_causal_lm) in message and "Qwen3ForCausalLM" in message
    assert "reranker" in message and "--task embed" in message
    embedder = Engine.from_pretrained(str(qwen3_causal_lm), task="embed", dtype="float32")
    assert (embedder.info().task, embedder.info().pooling) == ("embed", "last")


def test_a_causal_lm_with_sentence_transformers_config_is_an_embedder(
    qwen3_causal_lm: Path, tmp_path: Path
) -> None:
    """Qwen3-Embedding: Qwen3ForCausalLM with modules.json (last-token pooling)."""
    st = add_sentence_transformers(qwen3_causal_lm, pooling="lasttoken")
    cfg = json.loads((st / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (st / "config.json").write_text(json.dumps(cfg))
    info = Engine.from_pretrained(str(st), dtype="float32").info()
    assert (info.architecture, info.task, info.pooling) == ("Qwen3ForCausalLM", "embed", "last")


# -- custom code ------------------------------------------------------------------------------


def test_custom_code_of_a_native_model_type_is_served_natively_and_not_run(
    tiny_model: Callable[[str], Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = tiny_model("qwen3")
    custom = rewrite_checkpoint(
        src, tmp_path / "custom", config={"auto_map": {"AutoModel": "modeling_x.XModel"}}
    )
    with caplog.at_level(logging.WARNING, logger="embedding_server.device.loading"):
        engine = Engine.from_pretrained(str(custom), dtype="float32")
    assert any(
        "modeling_x.XModel" in r.getMessage() and "not run" in r.getMessage()
        for r in caplog.records
    )
    plain = Engine.from_pretrained(str(src), dtype="float32")
    np.testing.assert_allclose(engine.embed(TEXTS), plain.embed(TEXTS), atol=1e-6)
    assert _load(str(custom)).custom_code == "modeling_x.XModel"


def test_custom_code_of_another_model_type_is_refused_saying_what_would_serve_it(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    path = _custom_code(tiny_model("bert"), tmp_path / "nvembed")
    # backend auto: the transformers backend would serve it, but only with remote code.
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path))
    message = str(refused.value)
    assert "modeling_nvembed.NVEmbedModel" in message
    assert "--trust-remote-code" in message
    # backend native: never runs the code, and says what would serve it.
    with pytest.raises(UnsupportedModelError) as native:
        Engine.from_pretrained(str(path), backend="native")
    message = str(native.value)
    assert "modeling_nvembed.NVEmbedModel" in message and "'nvembed'" in message
    assert "--trust-remote-code" in message and "--backend transformers" in message
    with pytest.raises(UnsupportedModelError) as trusted:
        Engine.from_pretrained(str(path), backend="native", trust_remote_code=True)
    assert "Remote code is allowed" in str(trusted.value)
    assert "--backend transformers" in str(trusted.value)


def test_meta_builds_see_the_same_shapes_as_real_ones(tiny_model: Callable[[str], Path]) -> None:
    """What inspect builds (names and shapes on the meta device) is what serve builds."""
    path = str(tiny_model("qwen2"))
    real = _load(path)
    meta = _load(path, shapes_only=True)
    assert meta.model.hidden_size == real.model.hidden_size
    assert meta.tensors == real.tensors

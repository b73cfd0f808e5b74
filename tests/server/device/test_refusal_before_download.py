"""A Hub model that would be refused is refused before a single weight file is downloaded.

``inspect`` decides from the config files and the safetensors headers; serving runs the
same inspection first (the body and heads built on the ``meta`` device from the headers,
then the settings' own checks), so a checkpoint with a tensor nobody claims, or one the
settings cannot serve, costs its config files, not its weights. The fake Hub records every
request, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.device.distributed import Shard
from embedding_server.device.loading import load_shard
from embedding_server.engine import Engine
from embedding_server.errors import EmbeddingServerError, UnsupportedModelError

from tests.support.hub import FakeHub
from tests.support.models import add_sentence_transformers, build_t5_encoder, rewrite_checkpoint

TEXTS = ["a", "audited before it is downloaded", "tokens " * 9]


@pytest.fixture
def extra_head(tiny_model: Callable[[str], Path], tmp_path: Path) -> Path:
    """A Qwen3 checkpoint with a head the family neither reads nor declares (the shape of a
    reward model's ``score`` head on a body served as an embedder)."""
    head = {"score.0.weight": torch.zeros(32, 32), "score.2.weight": torch.zeros(1, 32)}
    return rewrite_checkpoint(tiny_model("qwen3"), tmp_path / "extra-head", add=head)


def test_serving_refuses_an_unclaimed_head_from_the_headers_before_any_weight(
    extra_head: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = FakeHub(extra_head, tmp_path / "hub").install(monkeypatch)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained("acme/extra-head", dtype="float32")
    message = str(refused.value)
    assert message.startswith("model 'acme/extra-head': ")
    assert "score.0.weight" in message and "score.2.weight" in message
    assert ("headers", []) in hub.calls
    assert hub.weight_requests() == []
    assert hub.weights_downloaded() == []


def test_a_tensor_parallel_rank_refuses_it_before_any_weight_too(
    extra_head: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = FakeHub(extra_head, tmp_path / "hub").install(monkeypatch)
    with pytest.raises(UnsupportedModelError, match=r"score\.0\.weight"):
        load_shard(
            "acme/extra-head",
            revision=None,
            cache_dir=None,
            dtype="float32",
            device=torch.device("cpu"),
            shard=Shard(1, 2),
        )
    assert hub.weight_requests() == [] and hub.weights_downloaded() == []


def test_a_servable_hub_model_is_audited_then_downloaded_and_served(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tiny_model("qwen3")
    hub = FakeHub(repo, tmp_path / "hub").install(monkeypatch)
    engine = Engine.from_pretrained("acme/qwen3", dtype="float32")
    assert len(hub.weight_requests()) == 1  # once, and only after the headers were read
    asked_weights = next(i for i, call in enumerate(hub.calls) if call[1] in hub.weight_requests())
    assert ("headers", []) in hub.calls[:asked_weights]
    assert asked_weights == len(hub.calls) - 1
    assert "model.safetensors" in " ".join(hub.weights_downloaded())
    local = Engine.from_pretrained(str(repo), dtype="float32")
    np.testing.assert_allclose(engine.embed(TEXTS), local.embed(TEXTS), atol=1e-6)


def test_serving_refuses_what_the_settings_audit_refuses_before_any_weight(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal that needs the loaded model's configuration, not its tensors: a
    sentence-transformers pooling that concatenates two modes, and a --dimensions beyond
    the model's, each decided by inspect from the config files and headers."""
    concatenated = add_sentence_transformers(tiny_model("bert"), pooling="cls+mean")
    hub = FakeHub(concatenated, tmp_path / "hub").install(monkeypatch)
    with pytest.raises(UnsupportedModelError, match="concatenated pooling is not supported"):
        Engine.from_pretrained("acme/cls-mean", dtype="float32")
    assert hub.weight_requests() == [] and hub.weights_downloaded() == []

    hub = FakeHub(tiny_model("bert"), tmp_path / "hub-2").install(monkeypatch)
    with pytest.raises(EmbeddingServerError) as refused:
        Engine.from_pretrained("acme/bert", dtype="float32", dimensions=1000)
    assert refused.value.param == "dimensions"
    assert hub.weight_requests() == [] and hub.weights_downloaded() == []


def test_a_bin_only_repository_is_audited_on_its_downloaded_weights(
    extra_head: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No headers to read: the refusal still comes, after the only download there can be."""
    from safetensors.torch import load_file

    repo = tmp_path / "bin-only"
    repo.mkdir()
    for f in extra_head.iterdir():
        if f.name != "model.safetensors":
            (repo / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(str(extra_head / "model.safetensors")), repo / "pytorch_model.bin")
    FakeHub(repo, tmp_path / "hub").install(monkeypatch)
    with pytest.raises(UnsupportedModelError, match=r"score\.0\.weight"):
        Engine.from_pretrained("acme/bin-only", dtype="float32")


def test_the_transformers_backend_refuses_a_task_it_lacks_before_any_weight(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = FakeHub(tiny_model("bert"), tmp_path / "hub").install(monkeypatch)
    with pytest.raises(UnsupportedModelError, match=r"task sparse .* native backend only"):
        Engine.from_pretrained("acme/bert", backend="transformers", task="sparse")
    assert hub.weight_requests() == [] and hub.weights_downloaded() == []


def test_the_transformers_backend_refuses_t5_in_float16_before_any_weight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = FakeHub(build_t5_encoder(tmp_path / "t5"), tmp_path / "hub").install(monkeypatch)
    with pytest.raises(EmbeddingServerError, match="overflow float16") as refused:
        Engine.from_pretrained("acme/t5", dtype="float16")
    assert refused.value.param == "dtype"
    assert hub.weight_requests() == [] and hub.weights_downloaded() == []

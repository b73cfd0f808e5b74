"""A Hub model that would be refused is refused before a single weight file is downloaded.

``inspect`` decides from the safetensors headers; serving runs the same audit first (the
body and heads built on the ``meta`` device from the headers), so a checkpoint with a
tensor nobody claims costs its config files, not its weights. The fake Hub records every
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
from embedding_server.errors import UnsupportedModelError

from tests.support.hub import FakeHub
from tests.support.models import rewrite_checkpoint

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
    kinds = [kind for kind, _ in hub.calls]
    assert kinds == ["snapshot", "headers", "snapshot"]  # config, headers, then the weights
    assert "model.safetensors" in " ".join(hub.weights_downloaded())
    local = Engine.from_pretrained(str(repo), dtype="float32")
    np.testing.assert_allclose(engine.embed(TEXTS), local.embed(TEXTS), atol=1e-6)


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

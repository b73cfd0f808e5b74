"""A vision-language embedder is refused as one, on every backend and with remote code
allowed: the transformers backend would run its remote class on text alone, leaving the
vision tower unused, so the refusal comes from config.json, before any code or weight is
fetched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError

from tests.support.hub import FakeHub

NEMOTRON_VL = {
    # nvidia/llama-nemotron-embed-vl-1b-v2's config.json, as far as it decides the backend.
    "model_type": "llama_nemotron_vl",
    "architectures": ["LlamaNemotronVLModel"],
    "auto_map": {
        "AutoConfig": "configuration_llama_nemotron_vl.LlamaNemotronVLConfig",
        "AutoModel": "modeling_llama_nemotron_vl.LlamaNemotronVLModel",
    },
}


@pytest.mark.parametrize("backend", ["auto", "transformers", "native"])
def test_nemotron_embed_vl_is_refused_as_a_vision_language_model_even_with_remote_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps(NEMOTRON_VL))
    (repo / "modeling_llama_nemotron_vl.py").write_text("raise SystemExit('remote code ran')\n")
    hub = FakeHub(repo, tmp_path / "hub").install(monkeypatch)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(
            "nvidia/llama-nemotron-embed-vl-1b-v2", backend=backend, trust_remote_code=True
        )
    message = str(refused.value)
    assert "'llama_nemotron_vl' is a vision-language model" in message
    assert "its vision tower would go unused" in message and "CLIP or SigLIP" in message
    assert "--backend transformers" not in message  # not pointed at a text-only way out
    fetched = [pattern for _, patterns in hub.calls for pattern in patterns]
    assert not any(p.endswith(".py") for p in fetched)
    assert hub.weight_requests() == []

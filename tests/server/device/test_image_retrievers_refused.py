"""vLLM's image late-interaction retrievers are refused, not served as text embedders.

vidore/colpali-v1.3-hf (``colpali``) and ModernVBERT/colmodernvbert-merged
(``colmodernvbert``) embed page images and texts into per-token vectors through a
vision-language body and a retrieval projection. Neither type has a native family, so
``--backend auto`` hands them to the transformers backend, which has no ``AutoModel`` class
for either: the load must stop there, naming the model type, rather than pool some other
tensor of a text-only forward pass.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from transformers import ColModernVBertConfig, ColPaliConfig, PretrainedConfig

from tests.support.models import build_decoder


@pytest.mark.parametrize(
    "config", [ColPaliConfig(), ColModernVBertConfig()], ids=["colpali", "colmodernvbert"]
)
def test_an_image_retriever_is_refused_naming_its_type(
    tmp_path: Path, config: PretrainedConfig
) -> None:
    tokenizer = build_decoder(tmp_path / "tokenizer", "llama")
    path = tmp_path / config.model_type
    config.save_pretrained(path)
    for file in tokenizer.glob("tokenizer*"):
        shutil.copy(file, path / file.name)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path))
    assert config.model_type in str(refused.value).lower()

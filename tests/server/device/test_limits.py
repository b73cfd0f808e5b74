"""A model's limits come from its weights, not from what config.json claims.

The longest sequence and the largest token id the server accepts are read from
``max_position_embeddings`` and ``vocab_size``. A config that claims more than the weights'
tables hold would let a request index past a table: an IndexError (a 500) on the CPU, a
device-side assert that poisons the CUDA context on a GPU. Such a checkpoint is refused at
load, naming the model, the key, the claim and the table's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError

from tests.support.models import build_t5_encoder, rewrite_checkpoint

TEXTS = ["short", "a few more words than that"]


@pytest.mark.parametrize(
    ("model_type", "key", "claimed", "rows"),
    [
        # BERT's absolute position table has max_position_embeddings (128) rows.
        ("bert", "max_position_embeddings", 512, 128),
        # XLM-R's positions start at pad_token_id + 1: the table (130 rows) still bounds them.
        ("xlm-roberta", "max_position_embeddings", 4096, 130),
        ("bert", "vocab_size", 40000, 30522),
        ("qwen3", "vocab_size", 1 << 20, None),
    ],
)
def test_a_config_claiming_more_than_its_tables_hold_is_refused_at_load(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    model_type: str,
    key: str,
    claimed: int,
    rows: int | None,
) -> None:
    src = tiny_model(model_type)
    honest = Engine.from_pretrained(str(src), dtype="float32")
    lying = rewrite_checkpoint(src, tmp_path / "lying", config={key: claimed})
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(lying), dtype="float32")
    message = str(refused.value)
    assert message.startswith(f"model {str(lying)!r}: "), message
    assert f"{key}={claimed}" in message, message
    if rows is not None:
        assert f"{rows} rows" in message, message
    assert "config.json" in message  # what to fix
    # A config that claims less than the tables hold is a limit, not a lie: it loads.
    if key == "max_position_embeddings":
        shorter = rewrite_checkpoint(src, tmp_path / "shorter", config={key: 64})
        engine = Engine.from_pretrained(str(shorter), dtype="float32")
        np.testing.assert_allclose(engine.embed(TEXTS), honest.embed(TEXTS), atol=1e-5)


def test_the_transformers_backend_refuses_a_vocab_size_its_weights_do_not_have(
    tmp_path: Path,
) -> None:
    """transformers builds the tables from the config and refuses weights of another shape;
    the server reports that as a refusal naming the model, not a crash."""
    src = build_t5_encoder(tmp_path / "t5")
    lying = rewrite_checkpoint(src, tmp_path / "lying", config={"vocab_size": 100_000})
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(lying), dtype="float32")
    assert str(refused.value).startswith(f"model {str(lying)!r}: transformers cannot load it")

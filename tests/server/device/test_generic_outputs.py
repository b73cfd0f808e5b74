"""The transformers backend pools per-token states; a model whose own code returns anything
else (a vector it has pooled itself, as NV-Embed-v2's ``sentence_embeddings``; a dict
without per-token states) is refused at load, naming what its forward pass returns, rather
than crashing at warm-up or serving rows of the wrong thing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError

from tests.support.models import build_custom_code

STATES = "return BaseModelOutput(last_hidden_state=self.norm(x))"
RETURNS = {
    # NV-Embed-v2's contract: a dict holding the pooled vectors only.
    "pooled dict": (
        'return {"sentence_embeddings": self.norm(x).mean(1)}',
        "'sentence_embeddings'",
    ),
    "pooled tensor": ("return self.norm(x).mean(1)", "a tensor of shape [1, 32]"),
    "pooled tuple": ("return (self.norm(x).mean(1), self.norm(x))", "a tuple (a tensor of shape"),
    "dict of states under another name": (
        'return {"token_embeddings": self.norm(x)}',
        "'token_embeddings': a tensor of shape [1, 3, 32]",
    ),
}


def _returning(path: Path, statement: str) -> Path:
    modeling = path / "modeling_tiny_encoder.py"
    code = modeling.read_text()
    assert STATES in code
    modeling.write_text(code.replace(STATES, statement))
    return path


@pytest.mark.parametrize("kind", sorted(RETURNS))
def test_a_remote_model_that_does_not_return_per_token_states_is_refused_by_name(
    tmp_path: Path, kind: str
) -> None:
    statement, shown = RETURNS[kind]
    path = _returning(build_custom_code(tmp_path / kind.replace(" ", "-")), statement)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path), trust_remote_code=True, dtype="float32")
    message = str(refused.value)
    assert message.startswith(f"model {str(path)!r}: ")
    assert "TinyEncoderModel's forward pass returns" in message and shown in message
    assert "last_hidden_state [batch, tokens, hidden]" in message
    assert "already pooled" in message


def test_a_plain_dict_with_last_hidden_state_is_served(tmp_path: Path) -> None:
    """What the refusal checks is the output's content, not its class."""
    plain = _returning(
        build_custom_code(tmp_path / "plain"), 'return {"last_hidden_state": self.norm(x)}'
    )
    reference = build_custom_code(tmp_path / "reference")
    texts = ["a", "per-token states in a plain dict"]
    served = Engine.from_pretrained(str(plain), trust_remote_code=True, dtype="float32")
    same = Engine.from_pretrained(str(reference), trust_remote_code=True, dtype="float32")
    np.testing.assert_allclose(served.embed(texts), same.embed(texts), atol=1e-6)

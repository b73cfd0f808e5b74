"""InternLM2's reward models (internlm2-1_8b/7b/20b-reward: ``InternLM2ForRewardModel``,
model_type ``internlm2``) on task reward.

transformers has no InternLM2 class, and the authors' ``modeling_internlm2.py`` is Llama's
math under other names with q, k and v interleaved in one ``wqkv``, which it reads as
``(kv_heads, groups + 2, head_dim)``: each key/value head's query heads, then its key,
then its value. So a tiny Llama saved by transformers is rewritten into InternLM2's layout
(``wqkv`` packed as that code unpacks it, written here from its layout; ``wo``,
``feed_forward.w1/w3/w2``, ``attention_norm``, ``ffn_norm``, ``tok_embeddings``, a
``v_head``), and the reference is transformers' own LlamaModel on each sequence alone with
the ``v_head`` applied to every token, raw, as vLLM's InternLM2ForRewardModel returns it (the
last token's output is the reward the authors' ``get_score`` reads). One packed batch of
mixed lengths, float32 and bfloat16; grouped-query attention (4 query heads, 2 key/value)
makes the interleaving matter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from safetensors.torch import load_file
from transformers import AutoModel

from tests.support.device_cases import assert_refused_before_weights, assert_rewards_match
from tests.support.models import build_decoder, rewrite_checkpoint

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
TEXTS = ["short", "a somewhat longer answer to the question", "x", "tokens " * 30]
HUB_CONFIG = {
    "model_type": "internlm2",
    "architectures": ["InternLM2ForRewardModel"],
    "auto_map": {
        "AutoConfig": "configuration_internlm2.InternLM2Config",
        "AutoModel": "modeling_internlm2.InternLM2ForRewardModel",
    },
    "bias": False,
    "rope_theta": 500000.0,
    "rope_parameters": None,
    "rope_scaling": None,
}
LAYER_NAMES = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _v_head() -> torch.Tensor:
    return torch.randn(1, 32, generator=torch.Generator().manual_seed(5)) * 0.4


def _wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The authors' packing: per key/value head, its query heads, its key, its value."""
    groups = HEADS // KV_HEADS
    hidden = q.shape[1]
    blocks = torch.cat(
        [
            q.reshape(KV_HEADS, groups, HEAD_DIM, hidden),
            k.reshape(KV_HEADS, 1, HEAD_DIM, hidden),
            v.reshape(KV_HEADS, 1, HEAD_DIM, hidden),
        ],
        dim=1,
    )
    return blocks.reshape(-1, hidden)


def _hub(llama: Path, dst: Path, **config: object) -> Path:
    """``llama`` in InternLM2's layout (its reward checkpoint: ``model.`` prefix, v_head)."""
    tensors = load_file(str(llama / "model.safetensors"))
    out: dict[str, torch.Tensor] = {"v_head.weight": _v_head()}
    for name, tensor in tensors.items():
        bare = name.removeprefix("model.")
        if bare == "embed_tokens.weight":
            out["model.tok_embeddings.weight"] = tensor
        elif bare == "norm.weight":
            out["model.norm.weight"] = tensor
        elif ".self_attn.q_proj." in bare:
            stem = bare.split("self_attn.")[0]
            out[f"model.{stem}attention.wqkv.weight"] = _wqkv(
                tensor,
                tensors[name.replace("q_proj", "k_proj")],
                tensors[name.replace("q_proj", "v_proj")],
            )
        elif ".self_attn.k_proj." in bare or ".self_attn.v_proj." in bare:
            continue
        else:
            stem, _, rest = bare.partition("layers.")
            layer, _, part = rest.partition(".")
            out[f"model.layers.{layer}.{LAYER_NAMES[part]}"] = tensor
    return rewrite_checkpoint(
        llama,
        dst,
        rename=lambda name: None,
        add=out,
        config={**HUB_CONFIG, **config},
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_decoder(tmp_path_factory.mktemp("internlm2") / "llama", "llama")


@pytest.fixture(scope="module")
def internlm2(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hub(llama, tmp_path_factory.mktemp("internlm2") / "hub")


def _reference(llama: Path, seqs: list[list[int]], dtype: torch.dtype) -> list[np.ndarray]:
    model = AutoModel.from_pretrained(str(llama), dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for seq in seqs:
            states = model(input_ids=torch.tensor([seq])).last_hidden_state[0]
            out.append((states.float() @ _v_head().T).numpy())
    return out


@pytest.mark.parametrize(("dtype", "cosine"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_rewards_match_the_authors_computation(
    llama: Path, internlm2: Path, dtype: str, cosine: float
) -> None:
    engine = Engine.from_pretrained(str(internlm2), dtype=dtype)
    info = engine.info()
    assert (info.backend, info.task) == ("native", "reward")
    seqs = engine.tokenize(TEXTS)
    assert len({len(s) for s in seqs}) == len(seqs)
    want = _reference(llama, seqs, getattr(torch, dtype))
    got = engine.reward(TEXTS)
    assert_rewards_match(seqs, got, want, cosine, dtype)


def test_dynamic_ntk_is_the_plain_rotary_within_the_limit(
    llama: Path, internlm2: Path, tmp_path: Path
) -> None:
    """The authors' dynamic NTK changes the base only past max_position_embeddings, which
    the server never admits."""
    path = _hub(llama, tmp_path / "dynamic", rope_scaling={"type": "dynamic", "factor": 2.0})
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert engine.info().max_input_tokens <= 256
    plain = Engine.from_pretrained(str(internlm2), dtype="float32")
    for a, b in zip(engine.reward(TEXTS), plain.reward(TEXTS), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"bias": True}, "bias: true"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling"),
        ({"architectures": ["InternLM2ForProcessRewardModel"]}, "process reward models"),
    ],
)
def test_what_it_cannot_serve_exactly_is_refused_before_weights(
    internlm2: Path, tmp_path: Path, config: dict[str, object], match: str
) -> None:
    assert_refused_before_weights(internlm2, tmp_path / "n", config, match)


def test_an_unread_tensor_is_refused(internlm2: Path, tmp_path: Path) -> None:
    path = rewrite_checkpoint(
        internlm2, tmp_path / "extra", add={"model.layers.0.attention.bias": torch.zeros(3)}
    )
    with pytest.raises(UnsupportedModelError, match=r"attention\.bias"):
        Engine.from_pretrained(str(path), dtype="float32")


def test_linear_rope_scaling_matches(tmp_path: Path) -> None:
    """rope_scaling type linear (InternLM2's key) divides the positions, as Llama's does."""
    llama = build_decoder(
        tmp_path / "llama-linear",
        "llama",
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
    )
    path = _hub(llama, tmp_path / "hub", rope_scaling={"type": "linear", "factor": 4.0})
    engine = Engine.from_pretrained(str(path), dtype="float32")
    seqs = engine.tokenize(TEXTS)
    for got, want in zip(engine.reward(TEXTS), _reference(llama, seqs, torch.float32), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)

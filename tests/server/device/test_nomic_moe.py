"""NomicBERT v2-moe (nomic-embed-text-v2-moe) against an eager reference.

transformers' NomicBERT is dense only (no experts, no biases, no ungated MLP), so the
reference is written here from the published architecture (the remote code of
nomic-ai/nomic-bert-2048 and contrastors, as vLLM's ``bert_with_rope.py`` ports it), one
unpadded sequence at a time:

* word + token type embeddings, ``emb_ln``; non-interleaved rotary over the whole head;
* each layer: ``attn.Wqkv`` and ``attn.out_proj`` with biases (``qkv_proj_bias``),
  ``norm1`` over the residual sum, the MLP, ``norm2`` over the residual sum;
* the MLP of layers ``i % moe_every_n_layers == 1``: router ``mlp.router.layer`` (no bias),
  softmax in float32, the top ``moe_top_k`` probabilities cast back and not renormalized;
  each chosen expert ``e`` computes ``gelu(x @ w1[e].T) @ w2[e]`` (``mlp.experts.mlp.w1`` and
  ``w2`` are ``[E * I, H]``, expert-major), scaled by its probability and summed, plus
  ``mlp.experts.bias``; the other layers: ``fc2(gelu(fc1(x)))`` with biases.

Written per token and per expert (the plainest form), it checks the server's grouped
execution (each expert once over all its tokens). One packed batch of mixed lengths: cosine
>= 0.99999 (and 2e-5 absolute) in float32, >= 0.999 in bfloat16 (against the reference in
bfloat16, where the routing of near ties is the model dtype's), token states and the
mean-pooled vectors, on both CPU kernels; two tensor-parallel ranks give one rank's vectors.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.engine import Engine
from safetensors.torch import load_file, save_file

from tests.support.device_cases import (
    BF16_COSINE,
    F32_COSINE,
    assert_two_ranks_give_the_states_of_one,
    bert_sequences,
    cosines,
)
from tests.support.models import MINILM_DIR

pytestmark = pytest.mark.timeout(300)

H, HEADS, INNER, LAYERS, EXPERTS, TOP_K, POSITIONS = 32, 4, 48, 4, 8, 2, 64
LENGTHS = [1, 3, 9, 17, 40, POSITIONS]

CONFIG: dict[str, Any] = {
    "model_type": "nomic_bert",
    "architectures": ["NomicBertModel"],
    "auto_map": {
        "AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
        "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel",
    },
    "n_embd": H,
    "n_head": HEADS,
    "n_inner": INNER,
    "n_layer": LAYERS,
    "n_positions": POSITIONS,
    "vocab_size": 30528,
    "type_vocab_size": 1,
    "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu",
    "qkv_proj_bias": True,
    "mlp_fc1_bias": True,
    "mlp_fc2_bias": True,
    "moe_every_n_layers": 2,
    "num_experts": EXPERTS,
    "moe_top_k": TOP_K,
    "moe_normalize_expert_weights": False,
    "num_shared_experts": 0,
    "expert_choice_router": False,
    "rotary_emb_base": 10000,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_scaling_factor": None,
    "max_trained_positions": 2048,
    "prenorm": False,
    "causal": False,
    "use_rms_norm": None,
    "parallel_block": False,
    "pad_token_id": 1,
}


def _weights(seed: int = 31) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    def norm(name: str) -> dict[str, torch.Tensor]:
        return {name + ".weight": 1.0 + rand(H, scale=0.1), name + ".bias": rand(H, scale=0.05)}

    out = {
        "embeddings.word_embeddings.weight": rand(CONFIG["vocab_size"], H),
        "embeddings.token_type_embeddings.weight": rand(1, H),
        **norm("emb_ln"),
    }
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        out.update(
            {
                p + "attn.Wqkv.weight": rand(3 * H, H),
                p + "attn.Wqkv.bias": rand(3 * H, scale=0.05),
                p + "attn.out_proj.weight": rand(H, H),
                p + "attn.out_proj.bias": rand(H, scale=0.05),
                **norm(p + "norm1"),
                **norm(p + "norm2"),
            }
        )
        if i % 2 == 1:
            out.update(
                {
                    p + "mlp.router.layer.weight": rand(EXPERTS, H, scale=1.0),
                    p + "mlp.experts.mlp.w1": rand(EXPERTS * INNER, H),
                    p + "mlp.experts.mlp.w2": rand(EXPERTS * INNER, H),
                    p + "mlp.experts.bias": rand(H, scale=0.05),
                }
            )
        else:
            out.update(
                {
                    p + "mlp.fc1.weight": rand(INNER, H),
                    p + "mlp.fc1.bias": rand(INNER, scale=0.05),
                    p + "mlp.fc2.weight": rand(H, INNER),
                    p + "mlp.fc2.bias": rand(H, scale=0.05),
                }
            )
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint of nomic-embed-text-v2-moe's shape: MoE in layers 1 and 3."""
    path = tmp_path_factory.mktemp("nomic-moe") / "m"
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM_DIR / name, path / name)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    save_file(_weights(), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _reference(weights: dict[str, torch.Tensor], ids: list[int], dtype: torch.dtype) -> np.ndarray:
    """The published model's last hidden states for one sequence, in ``dtype`` (softmaxes
    in float32), per token and per expert."""
    w = {k: v.to(dtype) for k, v in weights.items()}
    d, eps, n = H // HEADS, CONFIG["layer_norm_epsilon"], len(ids)

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (H,), w[name + ".weight"], w[name + ".bias"], eps)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    inv_freq = 1.0 / (CONFIG["rotary_emb_base"] ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(n).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    x = w["embeddings.word_embeddings.weight"][torch.tensor(ids)]
    x = ln(x + w["embeddings.token_type_embeddings.weight"][0], "emb_ln")
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        q, k, v = linear(x, p + "attn.Wqkv").view(n, 3, HEADS, d).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        logits = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(dtype)
        ctx = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, H)
        x = ln(x + linear(ctx, p + "attn.out_proj"), p + "norm1")
        if i % CONFIG["moe_every_n_layers"] == 1:
            route = torch.softmax(
                F.linear(x, w[p + "mlp.router.layer.weight"]), dim=-1, dtype=torch.float32
            )
            top_w, top_e = torch.topk(route, TOP_K, dim=-1)
            top_w = top_w.to(dtype)
            w1 = w[p + "mlp.experts.mlp.w1"].view(EXPERTS, INNER, H)
            w2 = w[p + "mlp.experts.mlp.w2"].view(EXPERTS, INNER, H)
            mlp = torch.zeros_like(x)
            for expert in range(EXPERTS):
                for token in range(n):
                    for choice in range(TOP_K):
                        if int(top_e[token, choice]) == expert:
                            hidden = F.gelu(x[token] @ w1[expert].t()) @ w2[expert]
                            mlp[token] += hidden * top_w[token, choice]
            mlp = mlp + w[p + "mlp.experts.bias"]
        else:
            mlp = linear(F.gelu(linear(x, p + "mlp.fc1")), p + "mlp.fc2")
        x = ln(x + mlp, p + "norm2")
    return x.float().numpy()


@pytest.mark.parametrize("kernel", ["sdpa_bucketed", "sdpa_padded"])
@pytest.mark.parametrize(
    ("dtype", "min_cosine"), [("float32", F32_COSINE), ("bfloat16", BF16_COSINE)]
)
def test_packed_batch_matches_the_published_architecture(
    model: Path, dtype: str, min_cosine: float, kernel: str
) -> None:
    """Every token state and mean-pooled vector of one packed batch of mixed lengths, as
    the published model computes each input alone, with its experts and biases."""
    engine = Engine.from_pretrained(str(model), dtype=dtype, normalize=False, attention=kernel)
    info = engine.info()
    assert (info.model_type, info.backend, info.pooling) == ("nomic_bert", "native", "mean")
    seqs = bert_sequences(LENGTHS)
    weights = load_file(str(model / "model.safetensors"))
    torch_dtype = getattr(torch, dtype)
    with torch.no_grad():
        expected = [_reference(weights, seq, torch_dtype) for seq in seqs]
    for got, want in zip(engine.embed_tokens(seqs), expected, strict=True):
        assert cosines(got, want).min() >= min_cosine, cosines(got, want).min()
        if dtype == "float32":
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    pooled = np.stack([e.mean(0) for e in expected])
    assert cosines(engine.embed(seqs), pooled).min() >= min_cosine


def test_every_expert_is_routed_to(model: Path, tmp_path: Path) -> None:
    """The batch of the parity test reaches all eight experts: zeroing any one expert's
    output weights (in both MoE layers) changes some token's state, so the parity above
    covers the routing to each of them, not one or two."""
    weights = load_file(str(model / "model.safetensors"))
    seqs = bert_sequences(LENGTHS)
    base = np.concatenate(
        Engine.from_pretrained(str(model), dtype="float32", normalize=False).embed_tokens(seqs)
    )
    for expert in range(EXPERTS):
        changed = dict(weights)
        for layer in (1, 3):
            name = f"encoder.layers.{layer}.mlp.experts.mlp.w2"
            w2 = changed[name].clone()
            w2[expert * INNER : (expert + 1) * INNER] = 0
            changed[name] = w2
        dst = tmp_path / f"zeroed-{expert}"
        shutil.copytree(model, dst)
        save_file(changed, str(dst / "model.safetensors"), metadata={"format": "pt"})
        engine = Engine.from_pretrained(str(dst), dtype="float32", normalize=False)
        assert cosines(np.concatenate(engine.embed_tokens(seqs)), base).min() < 0.999, expert


def test_two_ranks_give_the_vectors_of_one(model: Path) -> None:
    """Tensor parallelism: 2 of the 4 heads, half of each expert's (and each dense MLP's)
    intermediate features on each rank, the router whole on both, the partial sums added
    and the biases once."""
    seqs = bert_sequences([3, 40, 9])
    assert_two_ranks_give_the_states_of_one(model, seqs)

"""Tiny JinaBERT v2 checkpoints and an eager reference written from the published code.

transformers has no JinaBERT (jina-embeddings-v2 runs jina's own code from the Hub, which the
tests cannot fetch), so the reference here is a plain per-sequence implementation of the
published architecture: jinaai/jina-bert-implementation's ``JinaBertModel`` (the -en, -de,
-es, -zh models) and jinaai/jina-bert-v2-qk-post-norm's (jina-embeddings-v2-base-code), as
their ``modeling_bert.py`` computes one unpadded sequence:

* embeddings: word + token type (no position table), LayerNorm;
* ALiBi: ``rebuild_alibi_tensor``'s ``-slope_h * |i - j|``, the slopes of
  ``_get_alibi_head_slopes`` (written out again below, not imported from the server), added
  to the scaled logits before the softmax;
* each layer: BERT's self-attention and ``attention.output`` (dense, LayerNorm over the sum
  with the input); the code model LayerNorms the query and key projections first
  (``layer_norm_q``/``_k``) and adds ``layer_norm_1(input + attention output)``; then the
  gated MLP: ``gated_layers`` -> ``gelu(first half) * second half`` -> ``wo`` ->
  ``layernorm(. + h)`` (v2), or ``up_gated_layer`` -> ``first half * gelu(second half)`` ->
  ``down_layer`` -> ``layer_norm_2(. + h)`` (code).

Checkpoints are written as the Hub ships them: ``model_type: bert``, ``position_embedding_type:
alibi``, ``feed_forward_type: geglu``, ``emb_pooler: mean`` and an ``auto_map`` to jina's
code, bare ``JinaBertModel`` tensor names, the all-MiniLM WordPiece tokenizer.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.support.models import MINILM_DIR

VARIANTS: dict[str, dict[str, Any]] = {
    # 6 heads: the slopes' rule for a head count that is not a power of 2 (jina-v2-base: 12).
    "v2": {
        "hidden_size": 48,
        "num_attention_heads": 6,
        "implementation": "jina-bert-implementation",
    },
    # 4 heads, the power-of-2 slopes (jina-v2-small: 8).
    "code": {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "implementation": "jina-bert-v2-qk-post-norm",
    },
}
INTERMEDIATE = 40
LAYERS = 2
POSITIONS = 80
VOCAB = 30522


def config_of(variant: str) -> dict[str, Any]:
    """The config.json of a tiny checkpoint of ``variant``, shaped as jina's are."""
    spec = VARIANTS[variant]
    repo = f"jinaai/{spec['implementation']}"
    return {
        "_name_or_path": repo,
        "architectures": ["JinaBertForMaskedLM"],
        "auto_map": {
            "AutoConfig": f"{repo}--configuration_bert.JinaBertConfig",
            "AutoModel": f"{repo}--modeling_bert.JinaBertModel",
            "AutoModelForMaskedLM": f"{repo}--modeling_bert.JinaBertForMaskedLM",
        },
        "model_type": "bert",
        "position_embedding_type": "alibi",
        "feed_forward_type": "geglu",
        "emb_pooler": "mean",
        "attn_implementation": "torch",
        "hidden_act": "gelu",
        "hidden_size": spec["hidden_size"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_hidden_layers": LAYERS,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": POSITIONS,
        "type_vocab_size": 2,
        "vocab_size": VOCAB,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
    }


def _weights(variant: str, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights under the published names, spread so that layers mix."""
    generator = torch.Generator().manual_seed(seed)
    h, i = VARIANTS[variant]["hidden_size"], INTERMEDIATE

    def matrix(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    def vector(n: int) -> torch.Tensor:
        return torch.randn(n, generator=generator) * 0.05

    def norm(name: str) -> dict[str, torch.Tensor]:
        return {
            name + ".weight": 1.0 + 0.1 * torch.randn(h, generator=generator),
            name + ".bias": vector(h),
        }

    out: dict[str, torch.Tensor] = {
        "embeddings.word_embeddings.weight": matrix(VOCAB, h),
        "embeddings.token_type_embeddings.weight": matrix(2, h),
        **norm("embeddings.LayerNorm"),
        "pooler.dense.weight": matrix(h, h),  # JinaBertModel's pooler, unused for embeddings
        "pooler.dense.bias": vector(h),
    }
    for n in range(LAYERS):
        p = f"encoder.layer.{n}."
        for proj in ("query", "key", "value"):
            out[p + f"attention.self.{proj}.weight"] = matrix(h, h)
            out[p + f"attention.self.{proj}.bias"] = vector(h)
        out[p + "attention.output.dense.weight"] = matrix(h, h)
        out[p + "attention.output.dense.bias"] = vector(h)
        out.update(norm(p + "attention.output.LayerNorm"))
        if variant == "code":
            out.update(norm(p + "attention.self.layer_norm_q"))
            out.update(norm(p + "attention.self.layer_norm_k"))
            out.update(norm(p + "layer_norm_1"))
            out[p + "mlp.up_gated_layer.weight"] = matrix(2 * i, h)
            out[p + "mlp.down_layer.weight"] = matrix(h, i)
            out[p + "mlp.down_layer.bias"] = vector(h)
            out.update(norm(p + "layer_norm_2"))
        else:
            out[p + "mlp.gated_layers.weight"] = matrix(2 * i, h)
            out[p + "mlp.wo.weight"] = matrix(h, i)
            out[p + "mlp.wo.bias"] = vector(h)
            out.update(norm(p + "mlp.layernorm"))
    return out


def build_jina_bert(
    path: Path, variant: str = "v2", *, head: str | None = None, seed: int = 29
) -> Path:
    """A tiny JinaBERT v2 checkpoint of ``variant`` (``v2`` or ``code``) at ``path``: the bare
    body (``JinaBertModel``, as jina-embeddings-v2 ships), or with ``head`` the body under
    ``bert.`` and ``JinaBertForMaskedLM``'s ``cls.predictions`` (``masked_lm``) or
    ``JinaBertForSequenceClassification``'s pooler and one-label ``classifier`` (``score``,
    jina-reranker-v1's kind)."""
    path.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM_DIR / name, path / name)
    config = config_of(variant)
    weights = _weights(variant, seed)
    if head is not None:
        generator = torch.Generator().manual_seed(seed + 1)
        h = VARIANTS[variant]["hidden_size"]
        pooler = {k: weights.pop(k) for k in ("pooler.dense.weight", "pooler.dense.bias")}
        weights = {"bert." + k: v for k, v in weights.items()}
        if head == "masked_lm":
            weights.update(
                {
                    "cls.predictions.transform.dense.weight": torch.randn(
                        h, h, generator=generator
                    ),
                    "cls.predictions.transform.dense.bias": torch.zeros(h),
                    "cls.predictions.transform.LayerNorm.weight": torch.ones(h),
                    "cls.predictions.transform.LayerNorm.bias": torch.zeros(h),
                    "cls.predictions.bias": torch.zeros(VOCAB),
                }
            )
        else:
            weights.update({"bert." + k: v for k, v in pooler.items()})
            weights["classifier.weight"] = 0.1 * torch.randn(1, h, generator=generator)
            weights["classifier.bias"] = torch.randn(1, generator=generator)
            config["architectures"] = ["JinaBertForSequenceClassification"]
            config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _published_slopes(n_heads: int) -> list[float]:
    """``_get_alibi_head_slopes`` of the published code."""

    def get_slopes_power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return get_slopes_power_of_2(n_heads)
    closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + _published_slopes(2 * closest_power_of_2)[0::2][: n_heads - closest_power_of_2]
    )


def reference(
    weights: dict[str, torch.Tensor],
    config: dict[str, Any],
    ids: list[int],
    token_types: list[int] | None = None,
) -> torch.Tensor:
    """The published model's last hidden states ``[L, hidden]`` for one sequence, float32."""
    w = {k.removeprefix("bert."): v.float() for k, v in weights.items()}
    h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    inter, eps, d = int(config["intermediate_size"]), float(config["layer_norm_eps"]), h // heads
    code = "encoder.layer.0.attention.self.layer_norm_q.weight" in w

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (h,), w[name + ".weight"], w[name + ".bias"], eps)

    def linear(x: torch.Tensor, name: str, bias: bool = True) -> torch.Tensor:
        return F.linear(x, w[name + ".weight"], w[name + ".bias"] if bias else None)

    length = len(ids)
    types = torch.tensor(token_types or [0] * length)
    x = w["embeddings.word_embeddings.weight"][torch.tensor(ids)]
    x = ln(x + w["embeddings.token_type_embeddings.weight"][types], "embeddings.LayerNorm")
    context = torch.arange(length)[:, None]
    memory = torch.arange(length)[None, :]
    relative = torch.abs(memory - context).unsqueeze(0).expand(heads, -1, -1)
    alibi = torch.Tensor(_published_slopes(heads)).unsqueeze(1).unsqueeze(1) * -1 * relative
    for n in range(int(config["num_hidden_layers"])):
        p = f"encoder.layer.{n}."
        q = linear(x, p + "attention.self.query")
        k = linear(x, p + "attention.self.key")
        if code:
            q, k = (
                ln(q, p + "attention.self.layer_norm_q"),
                ln(k, p + "attention.self.layer_norm_k"),
            )
        v = linear(x, p + "attention.self.value")
        q, k, v = (t.view(length, heads, d).transpose(0, 1) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
        probs = torch.softmax(scores + alibi, dim=-1)
        ctx = torch.matmul(probs, v).transpose(0, 1).reshape(length, h)
        attention = ln(
            linear(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm"
        )
        if code:
            residual = ln(x + attention, p + "layer_norm_1")
            states = linear(residual, p + "mlp.up_gated_layer", bias=False)
            up, gated = states[:, :inter], states[:, inter:]
            x = ln(residual + linear(up * F.gelu(gated), p + "mlp.down_layer"), p + "layer_norm_2")
        else:
            states = linear(attention, p + "mlp.gated_layers", bias=False)
            gated, non_gated = states[:, :inter], states[:, inter:]
            mlp = linear(F.gelu(gated) * non_gated, p + "mlp.wo")
            x = ln(mlp + attention, p + "mlp.layernorm")
    return x

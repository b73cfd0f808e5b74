"""Tiny random jina-embeddings-v3 checkpoints, in the layouts the server reads.

:func:`build_jina_v3` writes two directories from one transformers ``JinaEmbeddingsV3Model``
(transformers >= 5, the body without adapters):

* ``native``: transformers' own save (``model_type: jina_embeddings_v3``, flash names);
* ``hub``: the same body as jinaai/jina-embeddings-v3 ships it: ``model_type: xlm-roberta``
  with ``position_embedding_type: rotary``, the body under ``roberta.``, and every Linear and
  Embedding a torch parametrization (``parametrizations.weight.original``) with random task
  LoRA factors (``parametrizations.weight.0.lora_A`` / ``lora_B``, a leading adapter
  dimension), ``lora_adaptations``, ``task_instructions``.

:func:`merged_reference` is the reference for one adapter: the transformers model with every
weight replaced by ``W + s * B[t] @ A[t]`` (``A[t] @ B[t]`` for embeddings), as jina's
``LoRAParametrization.lora_forward`` computes it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel

from tests.support.models import (
    ROBERTA_ROLES,
    ROBERTA_SPECIALS,
    _save_tokenizer,
    byte_tokenizer,
    rewrite_checkpoint,
    spread_weights,
)

ADAPTERS = ["retrieval.query", "retrieval.passage", "separation", "classification", "text-matching"]
INSTRUCTIONS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
    "separation": "",
    "classification": "",
    "text-matching": "",
}
RANK, ALPHA = 4, 2.0
SCALING = ALPHA / RANK
_LINEAR = re.compile(r"encoder\.layers\.\d+\.(?:mixer\.(?:Wqkv|out_proj)|mlp\.fc[12])\.weight")
_EMBEDDING = re.compile(r"embeddings\.(?:word|token_type)_embeddings\.weight")
# The XLM-R body both jina-embeddings-v3 and jina-colbert-v2 build on, tiny.
JINA_BODY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 258,
    "type_vocab_size": 1,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}


def build_jina_v3(root: Path) -> tuple[Path, Path]:
    """``(native, hub)`` directories of one tiny random model (see the module docstring)."""
    native = root / "native"
    native.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(ROBERTA_SPECIALS, "<s> $A </s>", ["<s>", "</s>"])
    _save_tokenizer(tok, native, **ROBERTA_ROLES)
    torch.manual_seed(29)
    config = AutoConfig.for_model(
        "jina_embeddings_v3", vocab_size=tok.get_vocab_size(), **JINA_BODY
    )
    model = AutoModel.from_config(config)
    spread_weights(model)
    model.save_pretrained(str(native))

    generator = torch.Generator().manual_seed(3)
    factors: dict[str, torch.Tensor] = {}
    n = len(ADAPTERS)
    for name, weight in load_file(str(native / "model.safetensors")).items():
        rows, cols = weight.shape if weight.dim() == 2 else (0, 0)
        base = "roberta." + name.removesuffix(".weight") + ".parametrizations.weight."
        if _LINEAR.fullmatch(name):  # A [n, r, in], B [n, out, r]
            factors[base + "0.lora_A"] = 0.3 * torch.randn(n, RANK, cols, generator=generator)
            factors[base + "0.lora_B"] = 0.3 * torch.randn(n, rows, RANK, generator=generator)
        elif _EMBEDDING.fullmatch(name):  # A [n, vocab, r], B [n, r, dim]
            factors[base + "0.lora_A"] = 0.3 * torch.randn(n, rows, RANK, generator=generator)
            factors[base + "0.lora_B"] = 0.3 * torch.randn(n, RANK, cols, generator=generator)

    def rename(name: str) -> str:
        if _LINEAR.fullmatch(name) or _EMBEDDING.fullmatch(name):
            return "roberta." + name.removesuffix(".weight") + ".parametrizations.weight.original"
        return "roberta." + name

    hub_config: dict[str, Any] = {
        "model_type": "xlm-roberta",
        "architectures": ["XLMRobertaModel"],
        "auto_map": {
            "AutoConfig": "jinaai/xlm-roberta-flash-implementation--configuration_xlm_roberta."
            "XLMRobertaFlashConfig",
            "AutoModel": "jinaai/xlm-roberta-flash-implementation--modeling_lora.XLMRobertaLoRA",
        },
        "position_embedding_type": "rotary",
        "rotary_emb_base": 20000.0,
        "rope_parameters": None,
        "lora_adaptations": ADAPTERS,
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout_p": 0.0,
        "task_instructions": INSTRUCTIONS,
        "emb_pooler": None,
        "matryoshka_dimensions": [8, 16, 32],
        "use_flash_attn": True,
    }
    hub = rewrite_checkpoint(native, root / "hub", rename=rename, add=factors, config=hub_config)
    return native, hub


def merged_reference(native: Path, hub: Path, adapter: str | None) -> torch.nn.Module:
    """transformers' model of ``native`` with ``adapter``'s LoRA merged into its weights
    (None: the base weights), float32, eval mode."""
    model = AutoModel.from_pretrained(str(native), attn_implementation="eager").eval()
    if adapter is None:
        return model
    t = ADAPTERS.index(adapter)
    stored = load_file(str(hub / "model.safetensors"))
    merged = dict(load_file(str(native / "model.safetensors")))
    for name in list(merged):
        base = "roberta." + name.removesuffix(".weight") + ".parametrizations.weight.0."
        if base + "lora_A" not in stored:
            continue
        a, b = stored[base + "lora_A"][t], stored[base + "lora_B"][t]
        delta = a @ b if _EMBEDDING.fullmatch(name) else b @ a
        merged[name] = merged[name] + SCALING * delta
    # Load the merged original-format weights through transformers' own conversion.
    out = native.parent / f"merged-{adapter}"
    if not out.is_dir():
        from safetensors.torch import save_file

        out.mkdir()
        for item in native.iterdir():
            if item.name != "model.safetensors":
                (out / item.name).write_bytes(item.read_bytes())
        save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    return AutoModel.from_pretrained(str(out), attn_implementation="eager").eval()


def config_of(path: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config

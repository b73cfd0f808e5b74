"""Tiny random checkpoints of the model types that share BERT's math under other names:
CamemBERT, DistilBERT, ERNIE, ELECTRA, and jina-reranker-v2's flash-attention XLM-R names.

Built like ``models.py`` and ``tasks.py`` build theirs: transformers' own ``save_pretrained`` of
a seeded random model with spread weights, and a byte-level fast tokenizer with the family's
pair template, so the loader reads what a Hub snapshot holds. Each family's config sets what
sets it apart from BERT: DistilBERT's own config keys and sinusoidal position table, ERNIE's
task-type embeddings and ReLU, ELECTRA's embeddings narrower than its layers.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from tokenizers import processors
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PreTrainedTokenizerFast,
)

from tests.support.models import byte_tokenizer, spread_weights

Kind = Literal["body", "sequence", "token", "masked_lm", "pretraining"]

FAMILIES = ("camembert", "distilbert", "ernie", "electra")
"""The model types; ``xlm-roberta-flash`` (jina-reranker-v2's names) is built by
:func:`build_flash_xlm_roberta` from an ``xlm-roberta`` checkpoint."""

_BERT = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
_ROBERTA = {
    **_BERT,
    "hidden_size": 32,
    "max_position_embeddings": 130,
    "type_vocab_size": 1,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "camembert": _ROBERTA,
    "xlm-roberta": {**_ROBERTA, "layer_norm_eps": 1e-5},
    # Its own names for BERT's keys, no segment embeddings.
    "distilbert": {
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "hidden_dim": 64,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
    },
    # ERNIE 3.0's task-type table (row 0 is added), ERNIE 1.0's ReLU.
    "ernie": {
        **_BERT,
        "hidden_size": 32,
        "max_position_embeddings": 128,
        "type_vocab_size": 2,
        "use_task_id": True,
        "task_type_vocab_size": 3,
        "hidden_act": "relu",
        "pad_token_id": 0,
    },
    # Embeddings half as wide as the layers: embeddings_project widens them.
    "electra": {
        **_BERT,
        "hidden_size": 32,
        "embedding_size": 16,
        "max_position_embeddings": 128,
        "type_vocab_size": 2,
        "pad_token_id": 0,
    },
}

_AUTO = {
    "body": AutoModel,
    "sequence": AutoModelForSequenceClassification,
    "token": AutoModelForTokenClassification,
    "masked_lm": AutoModelForMaskedLM,
    "pretraining": AutoModelForPreTraining,  # ELECTRA's discriminator, ERNIE's MLM + NSP
}


def _tokenizer(path: Path, model_type: str) -> int:
    """A byte-level tokenizer with the family's special tokens and pair template (segment 1
    for the second text where the family has segments); returns the vocabulary size."""
    if model_type in ("camembert", "xlm-roberta"):
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        single, pair, template = "<s> $A </s>", "<s> $A </s> </s> $B </s>", ["<s>", "</s>"]
        named: dict[str, Any] = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "cls_token": "<s>",
            "sep_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "mask_token": "<mask>",
        }
    else:
        specials = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]
        single, pair, template = "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1", ["[CLS]", "[SEP]"]
        named = {
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "mask_token": "[MASK]",
            "unk_token": "[UNK]",
        }
        if model_type != "distilbert":  # as BertTokenizer, ErnieTokenizer, ElectraTokenizer
            named["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    tok = byte_tokenizer(specials, single, template)
    vocab = tok.get_vocab()
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, vocab[t]) for t in template]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=10**30, **named)
    fast.save_pretrained(str(path))
    return int(tok.get_vocab_size())


def build_family(
    path: Path,
    model_type: str,
    kind: Kind = "body",
    *,
    num_labels: int = 1,
    sinusoidal: bool = False,
    seed: int = 21,
) -> Path:
    """A 2-layer ``model_type`` checkpoint: a body, a sequence or token classifier with
    ``num_labels`` labels, a masked LM, or the family's pre-training model. ``sinusoidal``
    (DistilBERT): the fixed sinusoidal position table, saved as transformers saves it,
    instead of a learned one."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(path, model_type)
    overrides: dict[str, Any] = {**CONFIGS[model_type], "vocab_size": vocab}
    if kind in ("sequence", "token"):
        overrides["num_labels"] = num_labels
        overrides["id2label"] = {str(i): f"class_{i}" for i in range(num_labels)}
    if sinusoidal:
        overrides["sinusoidal_pos_embds"] = True
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **overrides)
    model = _AUTO[kind].from_config(config)
    table = None
    if sinusoidal:
        table = model.get_position_embeddings().weight.detach().clone()
    spread_weights(model)
    if table is not None:
        with torch.no_grad():
            model.get_position_embeddings().weight.copy_(table)
    model.save_pretrained(str(path))
    return path


_LAYER = r"^((?:roberta\.)?encoder\.)layer\.(\d+)\."
_FLASH_NAMES = (
    (r"^((?:roberta\.)?)embeddings\.LayerNorm\.", r"\1emb_ln."),
    (_LAYER + r"attention\.output\.dense\.", r"\1layers.\2.mixer.out_proj."),
    (_LAYER + r"attention\.output\.LayerNorm\.", r"\1layers.\2.norm1."),
    (_LAYER + r"intermediate\.dense\.", r"\1layers.\2.mlp.fc1."),
    (_LAYER + r"output\.dense\.", r"\1layers.\2.mlp.fc2."),
    (_LAYER + r"output\.LayerNorm\.", r"\1layers.\2.norm2."),
)


def build_flash_xlm_roberta(original: Path, path: Path) -> Path:
    """``original`` (an ``xlm-roberta`` body or task checkpoint) saved again
    as jinaai/xlm-roberta-flash-implementation names its weights (jina-reranker-v2): q, k and
    v fused into ``Wqkv``, ``emb_ln``, ``norm1``/``norm2``, ``mixer.out_proj``, ``mlp.fc1``/
    ``fc2``; same tokenizer and math, and its config as the Hub's is: no ``model_type``,
    the custom code's classes in ``auto_map``."""
    shutil.copytree(original, path)
    weights = load_file(str(original / "model.safetensors"))
    renamed: dict[str, torch.Tensor] = {}
    for name in list(weights):
        match = re.match(_LAYER + r"attention\.self\.query\.(\w+)$", name)
        if match:
            encoder, layer, part = match.groups()
            own = f"{encoder}layer.{layer}.attention.self."
            renamed[f"{encoder}layers.{layer}.mixer.Wqkv.{part}"] = torch.cat(
                [weights.pop(own + f"{n}.{part}") for n in ("query", "key", "value")]
            )
    for name, tensor in weights.items():
        for pattern, replacement in _FLASH_NAMES:
            name = re.sub(pattern, replacement, name)
        renamed[name] = tensor.contiguous()
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    assert config.pop("model_type") == "xlm-roberta"
    # As the Hub's config.json is: no model_type, the custom code's config class instead.
    config["auto_map"] = {
        "AutoConfig": "configuration_xlm_roberta.XLMRobertaFlashConfig",
        "AutoModel": "modeling_xlm_roberta.XLMRobertaModel",
        "AutoModelForSequenceClassification": (
            "modeling_xlm_roberta.XLMRobertaForSequenceClassification"
        ),
    }
    config["use_flash_attn"] = True
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path

"""Tiny random jina-colbert-v2 checkpoints, in the layout jinaai/jina-colbert-v2 ships.

jina-colbert-v2 is a stanford-colbert ``HF_ColBERT`` whose body is jina's XLM-RoBERTa
"flash" implementation (rotary positions, no task adapters: jina-embeddings-v3's body):
``config.json`` says ``model_type: xlm-roberta``, ``position_embedding_type: rotary`` and
``architectures: ["HF_ColBERT"]``; ``model.safetensors`` holds the body under ``roberta.``
with the flash names (``emb_ln``, ``mixer.Wqkv``, ``norm1`` ...) and ``linear.weight``
(``hidden -> 128``, no bias) beside it; ``artifact.metadata`` names the ``[QueryMarker]`` and
``[DocumentMarker]`` tokens (added to XLM-R's vocabulary), the query and document lengths
and ``attend_to_mask_tokens``. The tokenizer is XLM-R's, whose mask token is ``<mask>``.

:func:`build_jina_colbert` writes the transformers ``JinaEmbeddingsV3Model`` save (``native``,
the reference body) and the Hub layout of the same weights (``hub``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel

from tests.support.jina_v3 import JINA_BODY
from tests.support.models import (
    ROBERTA_ROLES,
    _save_tokenizer,
    byte_tokenizer,
    rewrite_checkpoint,
    spread_weights,
)

QUERY_MARKER, DOCUMENT_MARKER, MASK = "[QueryMarker]", "[DocumentMarker]", "<mask>"
QUERY_MAXLEN, DOC_MAXLEN, DIM = 16, 24, 8
LINEAR = torch.randn(DIM, 32, generator=torch.Generator().manual_seed(11))


def build_jina_colbert(root: Path, **metadata: Any) -> tuple[Path, Path]:
    """``(native, hub)``: the reference body and the jina-colbert-v2 layout of it;
    ``metadata`` overrides ``artifact.metadata``'s settings."""
    native = root / "native"
    native.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "<pad>", "</s>", MASK, QUERY_MARKER, DOCUMENT_MARKER, "<unk>"]
    tok = byte_tokenizer(specials, "<s> $A </s>", ["<s>", "</s>"])
    _save_tokenizer(tok, native, **ROBERTA_ROLES, mask_token=MASK)
    torch.manual_seed(31)
    config = AutoConfig.for_model(
        "jina_embeddings_v3", vocab_size=tok.get_vocab_size(), **JINA_BODY
    )
    model = AutoModel.from_config(config)
    spread_weights(model)
    model.save_pretrained(str(native))

    hub_config: dict[str, Any] = {
        "model_type": "xlm-roberta",
        "architectures": ["HF_ColBERT"],
        "auto_map": {
            "AutoConfig": "jinaai/xlm-roberta-flash-implementation--configuration_xlm_roberta."
            "XLMRobertaFlashConfig",
            "AutoModel": "jinaai/xlm-roberta-flash-implementation--modeling_xlm_roberta."
            "XLMRobertaModel",
        },
        "position_embedding_type": "rotary",
        "rotary_emb_base": 20000.0,
        "rope_parameters": None,
        "emb_pooler": None,
        "use_flash_attn": True,
    }
    hub = rewrite_checkpoint(
        native,
        root / "hub",
        rename=lambda name: "roberta." + name,
        add={"linear.weight": LINEAR.clone()},
        config=hub_config,
    )
    meta = {
        "query_token_id": QUERY_MARKER,
        "doc_token_id": DOCUMENT_MARKER,
        "query_token": "[Q]",
        "doc_token": "[D]",
        "query_maxlen": QUERY_MAXLEN,
        "doc_maxlen": DOC_MAXLEN,
        "attend_to_mask_tokens": True,
        "mask_punctuation": True,
        "similarity": "cosine",
        "interaction": "colbert",
        "dim": DIM,
        **metadata,
    }
    (hub / "artifact.metadata").write_text(json.dumps(meta))
    return native, hub

"""Tiny random Alibaba GTE ("new") checkpoints in each config layout the Hub holds.

transformers >= 5 runs this math as ``model_type: gte`` and its ``save_pretrained`` writes the
Hub's weight names (``encoder.layer.N.attention.qkv_proj``, ``mlp.up_gate_proj`` ...), but its
own config keys (``rope_parameters``) and ``gte.`` as a task head's prefix. Each builder saves
that reference model under ``<path>-reference`` and serves a copy rewritten as the Hub ships it:
new-impl's ``model_type: new`` config (``rope_theta``, ``rope_scaling: {type: ntk}`` and its
own flags), the ``new.`` prefix, or Snowflake's ``gte`` config with those legacy keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from tests.support.models import rewrite_checkpoint, spread_weights
from tests.support.tasks import roberta_pair_tokenizer

HEADS, HIDDEN = 4, 32
HEAD_DIM = HIDDEN // HEADS
_BASE: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}

NEW_IMPL_FLAGS: dict[str, Any] = {
    "auto_map": {
        "AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
        "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel",
    },
    "layer_norm_type": "layer_norm",
    "logn_attention_clip1": False,
    "logn_attention_scale": False,
    "pack_qkv": True,
    "position_embedding_type": "rope",
    "unpad_inputs": True,
    "use_memory_efficient_attention": False,
    "rope_parameters": None,
}
"""The keys new-impl's configs carry beyond transformers' (and without its rope_parameters)."""

NTK_FACTOR = 2.0
NTK_THETA = 500.0


@dataclass(frozen=True)
class GteVariant:
    reference: dict[str, Any]
    """GteConfig overrides of the transformers reference."""
    hub: dict[str, Any] | None = field(default=None)
    """config.json as the Hub ships it (merged over transformers'; None values drop keys);
    None: served as transformers saved it."""
    segments: bool = False
    """The tokenizer gives a pair's second text segment id 1 (BERT's template); else 0 for
    both, as the XLM-R tokenizer of gte-multilingual and its reranker."""


GTE_VARIANTS: dict[str, GteVariant] = {
    # transformers' own layout (model_type gte, rope_parameters).
    "gte": GteVariant({"type_vocab_size": 1}),
    # gte-multilingual-base: new-impl config, theta 160000, one token type, no scaling.
    "new": GteVariant(
        {"type_vocab_size": 1},
        {
            **NEW_IMPL_FLAGS,
            "model_type": "new",
            "architectures": ["NewModel"],
            "rope_theta": 160000.0,
            "rope_scaling": None,
        },
    ),
    # gte-base-en-v1.5: no token types, rope_scaling {type: ntk, factor: 2}. new-impl scales
    # from the first position (base theta * factor, frequencies / factor^(2/head_dim)), which
    # is transformers' linear rope with those two numbers: the reference. A small theta
    # so that the short test inputs turn through many periods.
    "new-ntk": GteVariant(
        {
            "type_vocab_size": 0,
            "rope_parameters": {
                "rope_type": "linear",
                "factor": NTK_FACTOR ** (2 / HEAD_DIM),
                "rope_theta": NTK_THETA * NTK_FACTOR,
            },
        },
        {
            **NEW_IMPL_FLAGS,
            "model_type": "new",
            "architectures": ["NewModel"],
            "rope_theta": NTK_THETA,
            "rope_scaling": {"factor": NTK_FACTOR, "type": "ntk"},
        },
    ),
    # Segment ids from the tokenizer: two rows (read per token), and one row (what
    # gte-multilingual has), which a tokenizer saying 1 must not index past.
    "gte-segments": GteVariant({"type_vocab_size": 2}, segments=True),
    "gte-one-segment": GteVariant({"type_vocab_size": 1}, segments=True),
    # Snowflake/snowflake-arctic-embed-m-v2.0: model_type gte, but new-impl's legacy keys.
    "gte-snowflake": GteVariant(
        {"type_vocab_size": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}},
        {**NEW_IMPL_FLAGS, "architectures": ["GteModel"], "rope_theta": 1000.0},
    ),
}


def _tokenizer(path: Path, *, segments: bool) -> int:
    if segments:
        return roberta_pair_tokenizer(path, "<s> $A </s> </s> $B:1 </s>:1")
    return roberta_pair_tokenizer(path)


def reference_dir(path: Path) -> Path:
    """Where a served GTE checkpoint's transformers reference lies."""
    return path.parent / (path.name + "-reference")


def build_gte(path: Path, variant: str, *, head: str | None = None, num_labels: int = 1) -> Path:
    """A 2-layer GTE of ``variant``'s layout at ``path`` (its reference beside it): a body, or
    with ``head`` ("sequence" or "token") a classifier as new-impl's
    ``New*Classification`` saves it (the body under ``new.``)."""
    spec = GTE_VARIANTS[variant]
    ref = reference_dir(path)
    ref.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(ref, segments=spec.segments)
    torch.manual_seed(21)
    extra: dict[str, Any] = {}
    if head is not None:
        extra = {
            "num_labels": num_labels,
            "id2label": {str(i): f"class_{i}" for i in range(num_labels)},
        }
    config = AutoConfig.for_model("gte", vocab_size=vocab, **{**_BASE, **spec.reference, **extra})
    auto: Any = {
        None: AutoModel,
        "sequence": AutoModelForSequenceClassification,
        "token": AutoModelForTokenClassification,
    }[head]
    model = auto.from_config(config)
    spread_weights(model)
    model.save_pretrained(str(ref))
    if spec.hub is None and head is None:
        return ref
    hub = dict(spec.hub or {})
    if head is not None and "architectures" in hub:
        kind = "Sequence" if head == "sequence" else "Token"
        name = "New" if hub.get("model_type") == "new" else "Gte"
        hub["architectures"] = [f"{name}For{kind}Classification"]
    prefix = "new." if hub.get("model_type") == "new" else "gte."
    rewrite_checkpoint(
        ref,
        path,
        rename=lambda n: prefix + n.removeprefix("gte.") if n.startswith("gte.") else n,
        config=hub,
    )
    if hub:  # merged keys that are null on the Hub (rope_scaling: null) stay as null
        cfg = json.loads((path / "config.json").read_text())
        cfg.update({k: v for k, v in hub.items() if v is None and k == "rope_scaling"})
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path

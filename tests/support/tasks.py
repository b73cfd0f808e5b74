"""Tiny random ``*ForSequenceClassification`` checkpoints of each family, for the task tests.

Built like ``models.py`` builds the bodies: transformers' own ``save_pretrained`` of a seeded
random model with spread weights, and a fast tokenizer that has a pair template, so our loader
reads what a Hub cross-encoder or classifier snapshot holds.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from tokenizers import processors
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from tests.support.models import (
    DEBERTA_VARIANTS,
    MINILM_DIR,
    ROBERTA_ROLES,
    ROBERTA_SPECIALS,
    _save_tokenizer,
    byte_tokenizer,
    deberta_tokenizer,
    spread_weights,
)

_ENCODER: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}


def _save_classifier(
    model_type: str, path: Path, seed: int, *, per_token: bool, **config: Any
) -> None:
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **config)
    auto = AutoModelForTokenClassification if per_token else AutoModelForSequenceClassification
    model = auto.from_config(cfg)
    spread_weights(model)
    model.save_pretrained(str(path))


def _byte_tokenizer_with_pairs(
    path: Path, specials: list[str], single: str, pair: str, template: list[str], **named: str
) -> int:
    tok = byte_tokenizer(specials, single, template)
    vocab = tok.get_vocab()
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, vocab[t]) for t in template]
    )
    _save_tokenizer(tok, path, **named)
    return int(tok.get_vocab_size())


def roberta_pair_tokenizer(path: Path, pair: str = "<s> $A </s> </s> $B </s>") -> int:
    """RoBERTa's byte-level tokenizer, ``<s> a </s>`` and the ``pair`` template, saved at
    ``path``: its vocabulary size."""
    return _byte_tokenizer_with_pairs(
        path, ROBERTA_SPECIALS, "<s> $A </s>", pair, ["<s>", "</s>"], **ROBERTA_ROLES
    )


def build_classifier(
    path: Path, family: str, num_labels: int, *, per_token: bool = False, **overrides: Any
) -> Path:
    """A 2-layer ``<family>ForSequenceClassification`` (``ForTokenClassification`` with
    ``per_token``) with ``num_labels`` labels.

    ``family``: bert (the real MiniLM WordPiece tokenizer, two token types), xlm-roberta
    (``<s> a </s></s> b </s>``), mpnet (the same template), deberta-v2 (DeBERTa-v3's layout,
    ``[CLS] a [SEP] b [SEP]``; ``overrides`` may give another), modernbert, qwen3 or llama
    (last-token ``score`` head).
    """
    path.mkdir(parents=True, exist_ok=True)
    labels = {"id2label": {str(i): f"class_{i}" for i in range(num_labels)}}
    common = {"num_labels": num_labels, "per_token": per_token, **labels, **overrides}
    if family == "bert":
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
            shutil.copy(MINILM_DIR / name, path / name)
        _save_classifier(
            "bert",
            path,
            11,
            vocab_size=30522,
            max_position_embeddings=128,
            type_vocab_size=2,
            pad_token_id=0,
            **_ENCODER,
            **common,
        )
    elif family == "xlm-roberta":
        vocab = roberta_pair_tokenizer(path)
        _save_classifier(
            "xlm-roberta",
            path,
            12,
            vocab_size=vocab,
            max_position_embeddings=130,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **_ENCODER,
            **common,
        )
    elif family == "mpnet":
        vocab = roberta_pair_tokenizer(path)
        _save_classifier(
            "mpnet",
            path,
            16,
            vocab_size=vocab,
            max_position_embeddings=130,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **_ENCODER,
            **common,
        )
    elif family == "deberta-v2":
        _save_classifier(
            "deberta-v2",
            path,
            17,
            vocab_size=deberta_tokenizer(path),
            max_position_embeddings=128,
            pad_token_id=0,
            **_ENCODER,
            **{**DEBERTA_VARIANTS["deberta-v3"], **common},
        )
    elif family == "modernbert":
        vocab = _byte_tokenizer_with_pairs(
            path,
            ["[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"],
            "[CLS] $A [SEP]",
            "[CLS] $A [SEP] $B [SEP]",
            ["[CLS]", "[SEP]"],
            cls_token="[CLS]",
            sep_token="[SEP]",
            pad_token="[PAD]",
            mask_token="[MASK]",
            unk_token="[UNK]",
        )
        _save_classifier(
            "modernbert",
            path,
            13,
            vocab_size=vocab,
            max_position_embeddings=256,
            local_attention=8,
            global_attn_every_n_layers=2,
            pad_token_id=2,
            bos_token_id=0,
            cls_token_id=0,
            eos_token_id=1,
            sep_token_id=1,
            **_ENCODER,
            **common,
        )
    else:  # decoders: EOS appended, pairs joined before it
        vocab = _byte_tokenizer_with_pairs(
            path,
            ["<pad>", "<s>", "</s>", "<unk>"],
            "$A </s>",
            "$A </s> $B </s>",
            ["</s>"],
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
        )
        extra = {"head_dim": 16} if family == "qwen3" else {}
        _save_classifier(
            family,
            path,
            14,
            vocab_size=vocab,
            max_position_embeddings=256,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
            **_ENCODER,
            **extra,
            **common,
        )
    return path


def save_cross_encoder(path: Path, max_length: int = 64) -> Path:
    """The checkpoint saved again by sentence-transformers' CrossEncoder (its config files:
    activation_fn, the tokenizer's max length), next to it."""
    from sentence_transformers import CrossEncoder

    out = path.parent / (path.name + "-ce")
    CrossEncoder(str(path), max_length=max_length, device="cpu").save(str(out))
    return out


def build_splade(path: Path, family: str, strategy: str = "max") -> Path:
    """A 2-layer ``<family>ForMaskedLM`` (bert, xlm-roberta or mpnet) wrapped by
    sentence-transformers as a SPLADE SparseEncoder (MLMTransformer + SpladePooling), saved at
    ``path``."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from transformers import AutoModelForMaskedLM

    body = build_classifier(path.parent / f"{path.name}-body", family, 2)
    torch.manual_seed(15)
    config = AutoConfig.from_pretrained(str(body))
    config.architectures = None
    mlm = AutoModelForMaskedLM.from_config(config)
    spread_weights(mlm)
    mlm.save_pretrained(str(body))
    encoder = SparseEncoder(
        modules=[
            MLMTransformer(str(body), max_seq_length=64),
            SpladePooling(pooling_strategy=strategy),
        ],
        device="cpu",
    )
    encoder.save(str(path))
    return path

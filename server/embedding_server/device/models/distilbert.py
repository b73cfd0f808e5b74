"""DistilBERT: BERT's math under other names.

Covers distiluse-base-multilingual, msmarco-distilbert / multi-qa-distilbert, the SST-2
classifier and DistilBERT SPLADE models. Six post-LayerNorm layers of BERT's shape with no
segment embeddings; the config and the weights name BERT's parts differently, so the family
is a config mapping and a rename onto :class:`~.bert.BertModel`. A config with
``sinusoidal_pos_embds`` still saves its (fixed) position table, which is read like a learned
one.
"""

from __future__ import annotations

from functools import partial

from embedding_server.device.heads import ClassifierNames, MaskedLmNames
from embedding_server.device.models.base import Ignored
from embedding_server.device.models.bert import BertModel, BertVariant

CONFIG_KEYS = (
    ("hidden_size", "dim"),
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("intermediate_size", "hidden_dim"),
    ("hidden_act", "activation"),
)
"""BERT's config keys -> DistilBERT's (transformers' ``attribute_map``, and the two it
spells out in the modules instead). Its LayerNorms use eps 1e-12, BERT's default."""

_LAYER = r"^transformer\.layer\.(\d+)\."
VARIANT = BertVariant(
    prefixes=("distilbert.",),
    names=(
        (_LAYER + r"attention\.q_lin\.", r"encoder.layer.\1.attention.self.query."),
        (_LAYER + r"attention\.k_lin\.", r"encoder.layer.\1.attention.self.key."),
        (_LAYER + r"attention\.v_lin\.", r"encoder.layer.\1.attention.self.value."),
        (_LAYER + r"attention\.out_lin\.", r"encoder.layer.\1.attention.output.dense."),
        (_LAYER + r"sa_layer_norm\.", r"encoder.layer.\1.attention.output.LayerNorm."),
        (_LAYER + r"ffn\.lin1\.", r"encoder.layer.\1.intermediate.dense."),
        (_LAYER + r"ffn\.lin2\.", r"encoder.layer.\1.output.dense."),
        (_LAYER + r"output_layer_norm\.", r"encoder.layer.\1.output.LayerNorm."),
    ),
)

build = partial(BertModel, variant=VARIANT)

CLASSIFIER = ClassifierNames(out="classifier.", dense="pre_classifier.", activation="relu")
"""``pre_classifier`` -> ReLU -> ``classifier`` on the first token; token classifiers have
``classifier`` alone."""

MASKED_LM = MaskedLmNames(
    dense="vocab_transform.",
    norm="vocab_layer_norm.",
    decoder="vocab_projector.",
    bias="vocab_projector.bias",
    tied="distilbert.embeddings.word_embeddings.weight",
)
"""DistilBertForMaskedLM's head (the activation is the config's ``activation``)."""

IGNORED = (
    Ignored(
        r"vocab_(transform|layer_norm|projector)\..+",
        "the masked-LM head of DistilBertForMaskedLM, read only for task sparse",
    ),
    Ignored(r"(distilbert\.)?embeddings\.position_ids", "a buffer older transformers saved"),
)

"""ELECTRA (``model_type: electra``): BERT with embeddings narrower than the layers.

Covers the ELECTRA discriminators and the cross-encoders fine-tuned from them
(ms-marco-electra-base and kin). The body is BERT's under the prefix ``electra.``; its
embeddings (and their LayerNorm) are ``embedding_size`` wide, and when that differs from
``hidden_size`` a linear ``embeddings_project`` widens them before layer 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedding_server.device.heads import ClassifierNames, MaskedLmNames
from embedding_server.device.models.base import Checkpoint, Ignored, PackedBatch, WeightReader
from embedding_server.device.models.bert import BertModel, BertVariant

VARIANT = BertVariant(prefixes=("electra.",))


class ElectraModel(BertModel):
    """An ELECTRA encoder body: BERT's, after the optional embedding projection."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint, VARIANT)

    def read_embeddings(self, w: WeightReader, checkpoint: Checkpoint) -> None:
        super().read_embeddings(w, checkpoint)
        config = checkpoint.config
        self.project: tuple[torch.Tensor, torch.Tensor] | None = None
        # transformers builds the projection exactly when the widths differ.
        if int(config.get("embedding_size", self.hidden_size)) != self.hidden_size:
            self.project = (w.get("embeddings_project.weight"), w.get("embeddings_project.bias"))

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        x = super().embed(batch)
        return x if self.project is None else F.linear(x, *self.project)


build = ElectraModel

CLASSIFIER = ClassifierNames(
    out="classifier.out_proj.", dense="classifier.dense.", activation="gelu"
)
"""ElectraClassificationHead: ``dense`` -> GELU (not RoBERTa's tanh) -> ``out_proj`` on the
first token; token classifiers have ``classifier`` alone."""

MASKED_LM = MaskedLmNames(
    dense="generator_predictions.dense.",
    norm="generator_predictions.LayerNorm.",
    decoder="generator_lm_head.",
    bias="generator_lm_head.bias",
    tied="electra.embeddings.word_embeddings.weight",
    activation="gelu",
)
"""The generator's head (ElectraForMaskedLM): always GELU, whatever ``hidden_act`` says."""

IGNORED = (
    Ignored(
        r"discriminator_predictions\..+",
        "the replaced-token-detection head of ElectraForPreTraining (the published "
        "discriminators): neither an embedding nor a classifier",
    ),
    Ignored(
        r"generator_(predictions|lm_head)\..+",
        "the masked-LM head of ElectraForMaskedLM, read only for task sparse",
    ),
    Ignored(
        r"(electra\.)?embeddings\.(position_ids|token_type_ids)",
        "buffers older transformers saved",
    ),
)

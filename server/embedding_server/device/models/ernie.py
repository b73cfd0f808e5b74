"""ERNIE (1.0 to 3.0, ``model_type: ernie``): BERT plus an optional task-type embedding.

Covers the nghuyong/ernie-* conversions and the embedders and rerankers fine-tuned from them.
The body is BERT's under the prefix ``ernie.``; with ``use_task_id`` the embeddings also add
``task_type_embeddings[task_type_id]``. transformers takes task type 0 unless the caller
passes ids, and nothing in a request names a task type, so the server adds row 0 too: a
constant vector, folded into the segment embeddings at load, so the forward pass is BERT's.
"""

from __future__ import annotations

from embedding_server.device.heads import ClassifierNames, MaskedLmNames
from embedding_server.device.models.base import Checkpoint, Ignored, WeightReader
from embedding_server.device.models.bert import BertModel, BertVariant

VARIANT = BertVariant(prefixes=("ernie.",))

_TASK_TYPES = "embeddings.task_type_embeddings.weight"


class ErnieModel(BertModel):
    """An ERNIE encoder body: BERT's, task type 0 folded into the segment embeddings."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint, VARIANT)

    def read_embeddings(self, w: WeightReader, checkpoint: Checkpoint) -> None:
        super().read_embeddings(w, checkpoint)
        if not checkpoint.config.get("use_task_id"):
            return
        task0 = w.get(_TASK_TYPES)[0]
        if self.type_emb is not None:
            self.type_emb += task0  # every row: whichever segment a token is in
            self.type0 = self.type_emb[0]
        else:
            self.type0 = self.type0 + task0


build = ErnieModel

CLASSIFIER = ClassifierNames(out="classifier.", dense="ernie.pooler.dense.")
"""BERT's: the pooler (dense + tanh on the first token), then ``classifier``."""

MASKED_LM = MaskedLmNames(
    dense="cls.predictions.transform.dense.",
    norm="cls.predictions.transform.LayerNorm.",
    decoder="cls.predictions.decoder.",
    bias="cls.predictions.bias",
    tied="ernie.embeddings.word_embeddings.weight",
)

IGNORED = (
    Ignored(
        r"(ernie\.)?pooler\.dense\.(weight|bias)",
        "the pooler of ErnieModel: embeddings pool the token states; sequence classifiers read it",
    ),
    Ignored(r"cls\.predictions\..+", "the masked-LM head, read only for task sparse"),
    Ignored(r"cls\.seq_relationship\..+", "the next-sentence head of ErnieForPreTraining"),
    Ignored(
        r"(ernie\.)?embeddings\.task_type_embeddings\.weight",
        "task-type embeddings of a config without use_task_id, which transformers does not "
        "use either",
    ),
    Ignored(
        r"(ernie\.)?embeddings\.(position_ids|token_type_ids)", "buffers older transformers saved"
    ),
)

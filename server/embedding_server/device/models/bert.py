"""BERT-family encoders on packed tokens: BERT, RoBERTa, XLM-RoBERTa, CamemBERT, and the
model types that share their math under other names (DistilBERT, ERNIE, ELECTRA).

Covers all-MiniLM, bge (v1.5), e5, gte-base (BERT) and bge-m3 / multilingual-e5 (XLM-R).
Post-LayerNorm blocks, absolute position embeddings, bidirectional attention. Query, key and
value projections are fused into one matmul at load time (one GEMM over all packed tokens
instead of three). What the model types differ in is data (:class:`BertVariant`): the prefix
a task head's checkpoint nests the body under, where positions start (RoBERTa, XLM-R and
CamemBERT number them from ``padding_idx + 1``, which is why the model exposes
``position_offset``), and the names a family gives the shared weights. DistilBERT, ERNIE and
ELECTRA are BERT's descendants and build on this module, as transformers' own ones do:
DistilBERT is a rename, ERNIE and ELECTRA add one embedding step each through
:class:`BertModel`'s two embedding hooks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embedding_server.device.heads import ClassificationHead, HeadWeights, SparseHead
from embedding_server.device.models.base import (
    Checkpoint,
    Ignored,
    PackedBatch,
    WeightReader,
    config_get,
    refuse_beyond_table,
)
from embedding_server.device.models.layers import HeadSplit
from embedding_server.device.models.post_ln import PostLnEncoder, PostLnLayer
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.heads import SparseStrategy
from embedding_server.request.pooling import ACTIVATIONS, PoolingMethod

_PREFIX = r"(?:(?:bert|roberta|model|encoder)\.)?"

IGNORED = (
    Ignored(
        _PREFIX + r"embeddings\.(?:position_ids|token_type_ids)",
        "index buffers older transformers saved (0, 1, 2 ... and all zeros); positions and "
        "segment ids come from the packed batch",
    ),
    Ignored(
        _PREFIX + r"pooler\.dense\.(?:weight|bias)",
        "BERT's pooler (dense + tanh over [CLS], trained for next-sentence prediction): "
        "embeddings pool the final hidden states; only a *ForSequenceClassification "
        "head reads it",
    ),
    Ignored(
        r"cls\.predictions\..+|lm_head\.(?:dense|layer_norm|decoder)\.(?:weight|bias)|lm_head\.bias",
        "the masked-LM head (BERT cls.predictions, RoBERTa/XLM-R lm_head): read only by "
        "task sparse (SPLADE)",
    ),
    Ignored(
        r"cls\.seq_relationship\.(?:weight|bias)",
        "BertForPreTraining's next-sentence head, which no task serves",
    ),
)
"""What BERT, RoBERTa and XLM-R checkpoints carry and the body does not read."""


def renames(*table: tuple[str, str]) -> Callable[[str], str]:
    """A weight-name mapping from ``(pattern, replacement)`` pairs (``re.sub`` syntax), each
    applied in turn to the whole name; names no pattern matches pass unchanged."""
    compiled = [(re.compile(pattern), replacement) for pattern, replacement in table]

    def rename(name: str) -> str:
        for pattern, replacement in compiled:
            name = pattern.sub(replacement, name)
        return name

    return rename


LEGACY_NAMES = ((r"LayerNorm\.gamma$", "LayerNorm.weight"), (r"LayerNorm\.beta$", "LayerNorm.bias"))
"""Old TF-converted checkpoints call LayerNorm parameters gamma/beta."""

FLASH_NAMES = (
    (r"^emb_ln\.", "embeddings.LayerNorm."),
    (r"^encoder\.layers\.(\d+)\.mixer\.Wqkv\.", r"encoder.layer.\1.attention.self.qkv."),
    (r"^encoder\.layers\.(\d+)\.mixer\.out_proj\.", r"encoder.layer.\1.attention.output.dense."),
    (r"^encoder\.layers\.(\d+)\.norm1\.", r"encoder.layer.\1.attention.output.LayerNorm."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc1\.", r"encoder.layer.\1.intermediate.dense."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc2\.", r"encoder.layer.\1.output.dense."),
    (r"^encoder\.layers\.(\d+)\.norm2\.", r"encoder.layer.\1.output.LayerNorm."),
)
"""The flash-attention XLM-R implementation's names (jinaai/xlm-roberta-flash-implementation,
which jina-reranker-v2 runs), as its conversion script writes them from transformers' names:
q, k and v fused into ``Wqkv`` (in that order), the rest renamed one to one, ``emb_ln`` outside
``embeddings``. The math is XLM-R's; vLLM maps the same table (``jina_to_vllm_mapper``)."""


@dataclass(frozen=True)
class BertVariant:
    """What one BERT-family model type's checkpoints differ in, beyond its config."""

    prefixes: Sequence[str] = ("bert.", "roberta.", "model.", "encoder.")
    """Where a task head's checkpoint nests the body (``bert.``, ``roberta.``, ...)."""
    offset_positions: bool = False
    """Positions numbered from ``pad_token_id + 1`` (RoBERTa), not from 0."""
    names: tuple[tuple[str, str], ...] = ()
    """The family's weight names -> BERT's, as :func:`renames` pairs applied after the prefix
    is stripped (and after :data:`LEGACY_NAMES`, which every variant reads)."""


BERT = BertVariant()
ROBERTA = BertVariant(offset_positions=True)
XLM_ROBERTA = BertVariant(offset_positions=True, names=FLASH_NAMES)


class BertModel(PostLnEncoder):
    """A BERT-family encoder body for packed batches.

    Subclasses change the embeddings only, through :meth:`read_embeddings` (what they read
    from the checkpoint) and :meth:`embed` (the states entering layer 0)."""

    def __init__(self, checkpoint: Checkpoint, variant: BertVariant = BERT) -> None:
        config = checkpoint.config
        model_type = str(config.get("model_type", "bert"))
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"{model_type} with position_embedding_type="
                f"{config.get('position_embedding_type')!r} is not supported (only absolute)"
            )
        split = self._read_sizes(checkpoint, model_type, eps=1e-12)
        self.num_layers = int(config["num_hidden_layers"])
        if variant.offset_positions:
            self.position_offset = int(config_get(config, "pad_token_id", default=1)) + 1
        else:
            self.position_offset = 0
        self.max_positions = int(config.get("max_position_embeddings", 512)) - self.position_offset

        w = checkpoint.reader(
            prefixes=variant.prefixes, marker="embeddings.", architecture=model_type
        )
        w.rename(renames(*LEGACY_NAMES, *variant.names))
        self.read_embeddings(w, checkpoint)
        refuse_beyond_table(
            model_type,
            "max_position_embeddings",
            self.max_positions + self.position_offset,
            self.pos_emb.shape[0],
            "position table",
        )
        self.layers: list[PostLnLayer] = []
        for i in range(self.num_layers):
            p = f"encoder.layer.{i}."
            self.layers.append(PostLnLayer.read(w, p, split, _read_qkv(w, p, split)))

    def read_embeddings(self, w: WeightReader, checkpoint: Checkpoint) -> None:
        """The word, position and segment tables and their LayerNorm."""
        get = w.get
        self.word_emb = w.embedding("embeddings.word_embeddings.weight")
        self.pos_emb = get("embeddings.position_embeddings.weight")
        self.type_emb: torch.Tensor | None = None
        if "embeddings.token_type_embeddings.weight" in w:
            self.type_emb = get("embeddings.token_type_embeddings.weight")
            self.type0 = self.type_emb[0]
        else:
            width = self.pos_emb.shape[1]
            self.type0 = torch.zeros(width, dtype=checkpoint.dtype, device=checkpoint.device)
        self.emb_ln_w = get("embeddings.LayerNorm.weight")
        self.emb_ln_b = get("embeddings.LayerNorm.bias")

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        """The normalized sum of the token, position and segment embeddings ``[T, width]``."""
        x = self.word_emb(batch.input_ids)
        x += self.pos_emb.index_select(0, batch.position_ids)
        if batch.token_type_ids is not None and self.type_emb is not None:
            x += self.type_emb.index_select(0, batch.token_type_ids)  # a pair's second text
        else:
            x += self.type0
        return F.layer_norm(x, self.emb_ln_w.shape, self.emb_ln_w, self.emb_ln_b, self.eps)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        x = self.embed(batch)
        for layer in self.layers:
            x = self._block(x, layer, batch)
        return x


def _read_qkv(w: WeightReader, p: str, split: HeadSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``p``'s fused q/k/v weight and bias, this rank's heads: fused here from
    ``query``/``key``/``value``, or as flash-attention checkpoints already fuse them."""
    fused = p + "attention.self.qkv."
    if fused + "weight" in w:  # q, k, v stacked; every head has its k/v, so split.kv == split.q
        return w.rows(fused + "weight", split.q, blocks=3), w.rows(
            fused + "bias", split.q, blocks=3
        )
    names = [p + f"attention.self.{n}." for n in ("query", "key", "value")]
    return w.qkv([n + "weight" for n in names], split), w.qkv([n + "bias" for n in names], split)


def classification_head(
    w: HeadWeights, per_token: bool
) -> tuple[ClassificationHead, PoolingMethod]:
    """The BERT family's classification heads, CLS-pooled: RoBERTa and XLM-R put a pooler
    (``classifier.dense`` + tanh) before ``classifier.out_proj``; BERT its ``bert.pooler``
    before ``classifier``. Token classifiers have no pooler, just ``classifier``."""
    if per_token:
        return ClassificationHead.read(w, "classifier."), "cls"
    if "classifier.out_proj.weight" in w:  # RoBERTa, XLM-R
        return ClassificationHead.read(w, "classifier.out_proj.", "classifier.dense."), "cls"
    pooler = next((p for p in ("bert.pooler.", "pooler.") if p + "dense.weight" in w), None)
    return ClassificationHead.read(
        w, "classifier.", None if pooler is None else pooler + "dense."
    ), "cls"


_MASKED_LM_NAMES = {
    "bert": (
        "cls.predictions.transform.dense.",
        "cls.predictions.transform.LayerNorm.",
        "cls.predictions.decoder.",
        "cls.predictions.bias",
    ),
    "roberta": ("lm_head.dense.", "lm_head.layer_norm.", "lm_head.decoder.", "lm_head.bias"),
}


def masked_lm_head(w: HeadWeights, strategy: SparseStrategy) -> SparseHead:
    """The masked-LM head of a BERT or RoBERTa/XLM-R ``*ForMaskedLM`` checkpoint as a SPLADE
    head, by Hugging Face names (the decoder is usually tied to the word embeddings and not
    saved)."""
    key = "roberta" if "lm_head.dense.weight" in w else "bert"
    dense, norm, decoder, bias = _MASKED_LM_NAMES[key]
    arch = w.architecture
    if dense + "weight" not in w:
        raise UnsupportedModelError(
            f"task sparse (SPLADE) needs a BERT, RoBERTa or XLM-R masked-LM checkpoint with its "
            f"head (cls.predictions.* or lm_head.*); {arch} has none"
        )
    act = str(w.config.get("hidden_act", "gelu"))
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{arch}: masked-LM head activation {act!r} is not supported")
    tied_name = next(
        (
            n
            for n in (
                decoder + "weight",
                "bert.embeddings.word_embeddings.weight",
                "roberta.embeddings.word_embeddings.weight",
            )
            if n in w
        ),
        None,
    )
    if tied_name is None:
        raise UnsupportedModelError(f"{arch} checkpoint has neither a decoder nor word embeddings")
    decoder_bias = w.maybe(bias) if bias in w else w.maybe(decoder + "bias")
    return SparseHead(
        dense_weight=w.get(dense + "weight"),
        dense_bias=w.maybe(dense + "bias"),
        activation=act,
        norm_weight=w.get(norm + "weight"),
        norm_bias=w.maybe(norm + "bias"),
        norm_eps=float(w.config.get("layer_norm_eps", 1e-12)),
        decoder_weight=w.get(tied_name),
        decoder_bias=decoder_bias,
        strategy=strategy,
    )

"""MPNet on packed tokens: all-mpnet-base-v2, the multi-qa and paraphrase MPNet models.

A BERT-style post-LayerNorm encoder (learned absolute positions numbered from
``padding_idx + 1``, no segment ids) whose attention logits carry one relative-position bias,
``[heads, L, L]``, computed from T5-style buckets of ``key - query`` and shared by every
layer. flash_attn and torch_varlen take no such bias, so the registry declares it
(``Architecture.attention_bias``) and an SDPA kernel serves MPNet; the bias depends only on
the positions, so it is built once per batch and length bucket
(:class:`~..attention.PositionBias`) and added by SDPA as its float mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedding_server.device.attention import PositionBias
from embedding_server.device.heads import HeadWeights, SparseHead
from embedding_server.device.models.base import Checkpoint, Ignored, PackedBatch
from embedding_server.device.models.layers import relative_position_buckets
from embedding_server.device.models.post_ln import PostLnEncoder, PostLnLayer
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.heads import SparseStrategy

# transformers' MPNet hard-codes these rather than reading the config: the embeddings'
# padding_idx (positions start after it), and the buckets' count and reach.
PADDING_IDX = 1
NUM_BUCKETS = 32
MAX_DISTANCE = 128

IGNORED = (
    Ignored(
        r"(mpnet\.)?pooler\.dense\.(weight|bias)",
        "MPNetModel's pooler (dense + tanh over the first token), which neither the "
        "sentence-transformers pipeline nor any task head reads",
    ),
    Ignored(
        r"(mpnet\.)?embeddings\.position_ids",
        "a buffer older transformers versions saved; positions are computed per sequence",
    ),
    Ignored(r"lm_head\..+", "the masked-LM head, read only for task sparse (SPLADE)"),
)


class MPNetModel(PostLnEncoder):
    """An MPNet encoder body for packed batches."""

    position_offset = PADDING_IDX + 1

    def __init__(self, checkpoint: Checkpoint) -> None:
        config = checkpoint.config
        buckets = int(config.get("relative_attention_num_buckets", NUM_BUCKETS))
        if buckets != NUM_BUCKETS:
            # transformers sizes the table from the config but always buckets into 32.
            raise UnsupportedModelError(
                f"mpnet with relative_attention_num_buckets={buckets} is not supported: "
                f"transformers' MPNet always uses {NUM_BUCKETS} buckets, so such a checkpoint "
                "cannot be served as it was trained"
            )
        split = self._read_sizes(checkpoint, "mpnet", eps=1e-12)
        self.max_positions = int(config.get("max_position_embeddings", 514)) - self.position_offset

        w = checkpoint.reader(prefixes=("mpnet.",), marker="embeddings.", architecture="mpnet")
        get = w.get
        self.word_emb = w.embedding("embeddings.word_embeddings.weight")
        self.pos_emb = get("embeddings.position_embeddings.weight")
        self.emb_ln_w = get("embeddings.LayerNorm.weight")
        self.emb_ln_b = get("embeddings.LayerNorm.bias")
        heads = slice(split.q.start // self.head_dim, split.q.stop // self.head_dim)
        # [buckets, heads]: this rank's heads' columns.
        self.rel_bias = w.columns("encoder.relative_attention_bias.weight", heads)
        self.layers: list[PostLnLayer] = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            names = [p + f"attention.attn.{n}." for n in ("q", "k", "v")]
            qkv = (
                w.qkv([n + "weight" for n in names], split),
                w.qkv([n + "bias" for n in names], split),
            )
            self.layers.append(
                PostLnLayer.read(
                    w, p, split, qkv, out="attention.attn.o.", ln1="attention.LayerNorm."
                )
            )
        self._buckets = torch.empty(0, 0, dtype=torch.long, device=checkpoint.device)
        self.bias = PositionBias(self._bias_table)

    def _bias_table(self, length: int) -> torch.Tensor:
        """The relative-position bias of a sequence of ``length`` tokens, ``[heads, L, L]``.

        The bucket of a pair depends only on ``key - query``, so the buckets of a longer
        sequence hold every shorter one's in their top-left corner: they are computed once for
        the longest sequence seen and sliced."""
        if self._buckets.shape[0] < length:
            size = max(length, 2 * self._buckets.shape[0], 64)
            pos = torch.arange(size, dtype=torch.long, device=self._buckets.device)
            self._buckets = relative_position_buckets(
                pos.unsqueeze(0) - pos.unsqueeze(1),
                num_buckets=NUM_BUCKETS,
                max_distance=MAX_DISTANCE,
            )
        buckets = self._buckets[:length, :length]
        return F.embedding(buckets, self.rel_bias).permute(2, 0, 1).contiguous()

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        x = self.word_emb(batch.input_ids)
        x += self.pos_emb.index_select(0, batch.position_ids)
        x = F.layer_norm(x, (self.hidden_size,), self.emb_ln_w, self.emb_ln_b, self.eps)
        for layer in self.layers:
            x = self._block(x, layer, batch, bias=self.bias)
        return x


def masked_lm_head(w: HeadWeights, strategy: SparseStrategy) -> SparseHead:
    """The ``lm_head`` of an ``MPNetForMaskedLM`` checkpoint as a SPLADE head: dense, gelu
    (transformers' MPNetLMHead hard-codes it, whatever ``hidden_act`` says), LayerNorm, and
    the decoder tied to the word embeddings, plus ``lm_head.bias``."""
    if "lm_head.dense.weight" not in w:
        raise UnsupportedModelError(
            f"task sparse (SPLADE) needs an MPNetForMaskedLM checkpoint with its head "
            f"(lm_head.*); {w.architecture} has none"
        )
    decoder = next(
        (
            n
            for n in ("lm_head.decoder.weight", "mpnet.embeddings.word_embeddings.weight")
            if n in w
        ),
        None,
    )
    if decoder is None:
        raise UnsupportedModelError(
            f"{w.architecture} checkpoint has neither lm_head.decoder.weight nor the word "
            "embeddings it is tied to"
        )
    bias = "lm_head.bias" if "lm_head.bias" in w else "lm_head.decoder.bias"
    return SparseHead(
        dense_weight=w.get("lm_head.dense.weight"),
        dense_bias=w.maybe("lm_head.dense.bias"),
        activation="gelu",
        norm_weight=w.get("lm_head.layer_norm.weight"),
        norm_bias=w.maybe("lm_head.layer_norm.bias"),
        norm_eps=float(w.config.get("layer_norm_eps", 1e-12)),
        decoder_weight=w.get(decoder),
        decoder_bias=w.maybe(bias),
        strategy=strategy,
    )

"""DeBERTa-v2 and DeBERTa-v3 on packed tokens: the mxbai-rerank-v1 rerankers, NLI and other
classifiers, and their bodies.

A post-LayerNorm encoder with *disentangled* attention. Besides the content-to-content logit
``q_i . k_j``, each pair gets a content-to-position term ``c2p`` (``q_i`` against the
projected embedding of the relative position ``i - j``) and a position-to-content term
``p2c`` (``k_j`` against the projected embedding of ``j - i``), as ``pos_att_type`` lists
them. Relative positions are log-bucketed (``position_buckets``) and share one table,
``encoder.rel_embeddings`` (LayerNorm'ed when ``norm_rel_ebd`` says so), projected by each
layer's own key and query projections (``share_att_key``, v3) or by separate ``pos_key_proj``
/ ``pos_query_proj``. All three terms are divided by ``sqrt(head_dim * (1 + len(pos_att_type)))``.
v3 has no absolute positions (``position_biased_input: false``) and no segment ids.

**How it runs.** The position terms depend on the query and key of each pair, so unlike
MPNet's bias they cannot be computed once per batch; and flash_attn and torch_varlen take no
additive term at all. So DeBERTa runs on the SDPA kernels' padded length buckets (the
registry declares ``attention_bias``): per layer and bucket, :class:`_DisentangledBias`
computes ``c2p + p2c`` from the bucket's ``[n, heads, L, head_dim]`` query and key blocks,
and SDPA adds it as its float mask. What keeps that cheap:

- The projected position embeddings depend only on weights, so each layer's are computed once
  at load (in the model dtype, as transformers computes them per forward), not per batch.
- A sequence of length ``L`` only has the distances ``-(L - 1) .. L - 1``: each term is one
  matmul against those ``2L - 1`` rows (not the table's ``2 * position_buckets``), ordered so
  that each pair's score lies on a diagonal that a strided view reads out
  (:func:`_relative_scores`),
  where transformers gathers through an index as large as the scores.

The relative-position index of each distance is computed once on the host, in float32 as
transformers computes it. The convolution that deberta-v2-xlarge/xxlarge add after the first
layer (``conv_kernel_size``) runs on the packed tokens, never across two sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.attention import AttentionPlan
from embedding_server.device.heads import ClassificationHead, HeadWeights
from embedding_server.device.models.base import Checkpoint, Ignored, PackedBatch
from embedding_server.device.models.layers import activation
from embedding_server.device.models.post_ln import PostLnEncoder, PostLnLayer
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.pooling import ACTIVATIONS, PoolingMethod

MODEL_TYPE = "deberta-v2"

IGNORED = (
    Ignored(
        r"(deberta\.)?embeddings\.position_ids",
        "a buffer older transformers versions saved; positions are computed per sequence",
    ),
    Ignored(
        r"(deberta\.)?embeddings\.position_embeddings\.weight",
        "the absolute position table, which checkpoints with position_biased_input false "
        "(DeBERTa-v3) carry and transformers never adds (read when it is true)",
    ),
    Ignored(
        r"(lm_predictions|cls\.predictions|mask_predictions)\..+",
        "the pretraining heads (masked-LM, replaced-token detection), which no served task reads",
    ),
)


def log_bucket_position(
    relative: torch.Tensor, bucket_size: int, max_position: int
) -> torch.Tensor:
    """transformers' ``make_log_bucket_position``: distances below ``bucket_size // 2`` kept,
    longer ones log-bucketed up to ``max_position``, sign kept; float32 as there."""
    sign = torch.sign(relative)
    mid = bucket_size // 2
    abs_pos = torch.where(
        (relative < mid) & (relative > -mid),
        torch.tensor(mid - 1).type_as(relative),
        torch.abs(relative),
    )
    log_pos = (
        torch.ceil(
            torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)
        )
        + mid
    )
    return torch.where(abs_pos <= mid, relative.type_as(log_pos), log_pos * sign).to(torch.long)


class _RelativePositions:
    """Which row of the position embeddings each distance ``i - j`` reads (transformers'
    ``clamp(relative_pos + span, 0, 2 * span - 1)``), for every distance of sequences of up
    to ``size`` tokens: computed once on the host, in float32 as transformers computes it,
    kept on the device, grown on demand."""

    def __init__(
        self, span: int, buckets: int, max_relative: int, size: int, device: torch.device
    ) -> None:
        self.span, self.buckets, self.max_relative = span, buckets, max_relative
        self.device = device
        self._build(size)

    def _build(self, size: int) -> None:
        self.size = size
        distance = torch.arange(-(size - 1), size, dtype=torch.long)  # i - j
        relative = distance
        if self.buckets > 0 and self.max_relative > 0:
            relative = log_bucket_position(distance, self.buckets, self.max_relative)
        rows = torch.clamp(relative + self.span, 0, 2 * self.span - 1)
        self._rising = rows.to(self.device)
        self._falling = rows.flip(0).to(self.device)

    def rows(self, length: int, *, rising: bool) -> torch.Tensor:
        """``[2L - 1]``: the row of each distance a sequence of ``length`` tokens has, from
        ``-(L - 1)`` up (``rising``) or from ``L - 1`` down."""
        if length > self.size:
            self._build(max(length, 2 * self.size))
        rows = self._rising if rising else self._falling
        return rows[self.size - length : self.size + length - 1]


def _relative_scores(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[n, heads, L, L]``: ``x``'s scores (``[n, heads, L, head_dim]``) against ``table``
    (``[heads, 2L - 1, head_dim]``), element ``[a, b]`` read from column ``b - a + L - 1``:
    the diagonals of a relative-position score, with no gather (Transformer-XL's relative
    shift, as a strided view).

    One matmul per head over all ``n * L`` rows: ``x`` is a transposed view of the packed
    tokens, so heads-first it is a plain view too, and nothing is copied."""
    n, heads, length, dim = x.shape
    width = table.shape[1]
    rows = x.transpose(0, 1).reshape(heads, n * length, dim)
    scores = torch.bmm(rows, table.transpose(1, 2))  # [heads, n * L, 2L - 1], contiguous
    return scores.as_strided(
        (n, heads, length, length),
        (length * width, n * length * width, width - 1, 1),
        length - 1,
    )


@dataclass(frozen=True, eq=False)
class _DisentangledBias:
    """One layer's ``c2p + p2c`` terms, per length bucket: an
    :class:`~..attention.AttentionBias`.

    For a bucket of length ``L``, each term is one matmul against the ``2L - 1`` position
    embeddings of the distances ``-(L - 1) .. L - 1`` (rows repeated where distances share a
    bucket), ordered so that the score of pair ``(i, j)`` lies on a diagonal that a strided
    view reads out, where transformers gathers from all ``2 * span`` rows."""

    positions: _RelativePositions
    pos_key: torch.Tensor | None
    """``[heads, 2 * span, head_dim]``: the position embeddings through the key projection,
    divided by the attention's root scale (c2p); None without c2p."""
    pos_query: torch.Tensor | None
    """The same through the query projection (p2c); None without p2c."""

    def __call__(
        self, plan: AttentionPlan, index: int, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        length = q.shape[2]
        bias: torch.Tensor | None = None
        if self.pos_key is not None:
            # c2p[i, j] = q_i . pos_key[row(i - j)]: column c holds distance L - 1 - c, so
            # (i, j) is column j - i + L - 1.
            rows = self.positions.rows(length, rising=False)
            bias = _relative_scores(q, self.pos_key.index_select(1, rows))
        if self.pos_query is not None:
            # p2c[i, j] = k_j . pos_query[row(i - j)]: column c holds distance c - (L - 1), so
            # (j, i) is column i - j + L - 1; transposed.
            rows = self.positions.rows(length, rising=True)
            p2c = _relative_scores(k, self.pos_query.index_select(1, rows)).transpose(-1, -2)
            bias = p2c if bias is None else bias + p2c
        assert bias is not None  # built only with c2p or p2c
        return plan.mask_keys(index, bias.contiguous())


@dataclass
class _Layer(PostLnLayer):
    bias: _DisentangledBias | None


@dataclass
class _Conv:
    """The convolution after the first layer: ``LayerNorm(layer_0 + act(conv(embeddings)))``."""

    taps: list[tuple[int, torch.Tensor]]  # (offset, [hidden, hidden] weight of that tap)
    bias: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]
    ln_w: torch.Tensor
    ln_b: torch.Tensor


def pos_att_types(config: Mapping[str, Any]) -> list[str]:
    """``pos_att_type`` as a list (older configs write ``"p2c|c2p"``), as transformers reads it."""
    value = config.get("pos_att_type") or []
    if isinstance(value, str):
        return [x.strip() for x in value.lower().split("|")]
    return [str(x) for x in value]


class DebertaV2Model(PostLnEncoder):
    """A DeBERTa-v2/v3 encoder body for packed batches."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        config, device = checkpoint.config, checkpoint.device
        split = self._read_sizes(checkpoint, MODEL_TYPE, eps=1e-7)
        hidden = self.hidden_size
        declared_head = config.get("attention_head_size")
        if declared_head is not None and int(declared_head) != self.head_dim:
            raise UnsupportedModelError(
                f"{MODEL_TYPE} with attention_head_size={declared_head} (not hidden_size / "
                f"num_attention_heads = {self.head_dim}) is not supported"
            )
        max_position_embeddings = int(config.get("max_position_embeddings", 512))
        # Relative positions work at any length, but the checkpoint was trained up to this.
        self.max_positions = max_position_embeddings
        types = pos_att_types(config)
        relative = bool(config.get("relative_attention", False))
        share_att_key = bool(config.get("share_att_key", False))
        # As transformers: the scale counts c2p and p2c even without relative_attention.
        scale_factor = 1 + ("c2p" in types) + ("p2c" in types)
        root = float(torch.sqrt(torch.tensor(self.head_dim, dtype=torch.float) * scale_factor))
        self.scale = 1.0 / root

        w = checkpoint.reader(prefixes=("deberta.",), marker="embeddings.", architecture=MODEL_TYPE)
        get = w.get
        self.word_emb = w.embedding("embeddings.word_embeddings.weight")
        self.pos_emb = w.maybe(
            "embeddings.position_embeddings.weight",
            bool(config.get("position_biased_input", True)),
        )
        self.type_emb = w.maybe(
            "embeddings.token_type_embeddings.weight", int(config.get("type_vocab_size", 0)) > 0
        )
        embedding_size = int(config.get("embedding_size") or hidden)
        self.embed_proj = w.maybe("embeddings.embed_proj.weight", embedding_size != hidden)
        self.emb_ln_w = get("embeddings.LayerNorm.weight")
        self.emb_ln_b = get("embeddings.LayerNorm.bias")

        positions: _RelativePositions | None = None
        rel: torch.Tensor | None = None
        if relative:
            buckets = int(config.get("position_buckets", -1))
            max_relative = int(config.get("max_relative_positions", -1))
            if max_relative < 1:
                max_relative = max_position_embeddings
            span = buckets if buckets > 0 else max_relative
            positions = _RelativePositions(
                span, buckets, max_relative, max_position_embeddings, device
            )
            rel = get("encoder.rel_embeddings.weight")[: 2 * span]
            norm = [x.strip() for x in str(config.get("norm_rel_ebd", "none")).lower().split("|")]
            if "layer_norm" in norm:
                rel = F.layer_norm(
                    rel,
                    (hidden,),
                    get("encoder.LayerNorm.weight"),
                    get("encoder.LayerNorm.bias"),
                    self.eps,
                )

        def position_projection(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            """``rel`` through one projection, divided by the root scale as transformers
            divides the terms: ``[heads, 2 * span, head_dim]``."""
            assert rel is not None
            out = F.linear(rel, weight, bias) / root
            return out.view(rel.shape[0], split.heads, self.head_dim).transpose(0, 1).contiguous()

        self.layers: list[_Layer] = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            a = p + "attention.self."
            q_w, q_b = (
                w.rows(a + "query_proj.weight", split.q),
                w.rows(a + "query_proj.bias", split.q),
            )
            k_w, k_b = (
                w.rows(a + "key_proj.weight", split.kv),
                w.rows(a + "key_proj.bias", split.kv),
            )
            v_w, v_b = (
                w.rows(a + "value_proj.weight", split.kv),
                w.rows(a + "value_proj.bias", split.kv),
            )
            bias: _DisentangledBias | None = None
            if positions is not None and ({"c2p", "p2c"} & set(types)):
                pos_key = pos_query = None
                if "c2p" in types:
                    name = "key_proj" if share_att_key else "pos_key_proj"
                    pos_key = position_projection(
                        k_w if share_att_key else w.rows(a + f"{name}.weight", split.q),
                        k_b if share_att_key else w.rows(a + f"{name}.bias", split.q),
                    )
                if "p2c" in types:
                    name = "query_proj" if share_att_key else "pos_query_proj"
                    pos_query = position_projection(
                        q_w if share_att_key else w.rows(a + f"{name}.weight", split.q),
                        q_b if share_att_key else w.rows(a + f"{name}.bias", split.q),
                    )
                bias = _DisentangledBias(positions, pos_key, pos_query)
            qkv = torch.cat([q_w, k_w, v_w]), torch.cat([q_b, k_b, v_b])
            self.layers.append(_Layer.read(w, p, split, qkv, bias=bias))
        self.conv = _read_conv(config, get) if _conv_kernel(config) else None

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        x = self.word_emb(batch.input_ids)
        if self.pos_emb is not None:
            x += self.pos_emb.index_select(0, batch.position_ids)
        if self.type_emb is not None:
            if batch.token_type_ids is not None:
                x += self.type_emb.index_select(0, batch.token_type_ids)  # a pair's second text
            else:
                x += self.type_emb[0]
        if self.embed_proj is not None:
            x = F.linear(x, self.embed_proj)
        x = F.layer_norm(x, (self.hidden_size,), self.emb_ln_w, self.emb_ln_b, self.eps)
        embeddings = x
        for i, layer in enumerate(self.layers):
            x = self._block(x, layer, batch, bias=layer.bias)
            if i == 0 and self.conv is not None:
                x = self._convolve(embeddings, x, batch.position_ids)
        return x

    def _convolve(
        self, embeddings: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """transformers' ConvLayer on packed tokens: each tap reads the token ``offset``
        away, or zero where that falls outside the token's own sequence (the zero padding of
        a sequence run alone). Positions restart at 0 in each sequence, so the neighbour is in
        the same sequence exactly when its position is this one's plus ``offset``."""
        conv = self.conv
        assert conv is not None
        t = embeddings.shape[0]
        index = torch.arange(t, device=embeddings.device)
        out = conv.bias.expand_as(embeddings)
        for offset, weight in conv.taps:
            if offset == 0:
                tap = embeddings
            else:
                neighbour = (index + offset).clamp(0, t - 1)
                same = positions.index_select(0, neighbour) == positions + offset
                tap = embeddings.index_select(0, neighbour) * same.unsqueeze(1).to(embeddings.dtype)
            out = out + F.linear(tap, weight)
        h = self.hidden_size
        return F.layer_norm(residual + conv.act(out), (h,), conv.ln_w, conv.ln_b, self.eps)


def _conv_kernel(config: Mapping[str, Any]) -> int:
    return int(config.get("conv_kernel_size") or 0)


def _read_conv(config: Mapping[str, Any], get: Callable[[str], torch.Tensor]) -> _Conv:
    kernel = _conv_kernel(config)
    if kernel % 2 == 0:
        raise UnsupportedModelError(
            f"{MODEL_TYPE} with an even conv_kernel_size ({kernel}) is not supported: "
            "transformers' ConvLayer then shortens each sequence by a token"
        )
    groups = int(config.get("conv_groups") or 1)
    weight = get("encoder.conv.conv.weight")  # [hidden, hidden / groups, kernel]
    rows, cols = weight.shape[0] // groups, weight.shape[1]
    taps = []
    for tap in range(kernel):
        # A grouped convolution is one with a block-diagonal weight: group g's outputs read
        # only its own slice of the inputs.
        full = weight.new_zeros(weight.shape[0], cols * groups)
        for g in range(groups):
            full[g * rows : (g + 1) * rows, g * cols : (g + 1) * cols] = weight[
                g * rows : (g + 1) * rows, :, tap
            ]
        taps.append((tap - (kernel - 1) // 2, full))
    return _Conv(
        taps=taps,
        bias=get("encoder.conv.conv.bias"),
        act=activation(config, MODEL_TYPE, "conv_act", default="tanh"),
        ln_w=get("encoder.conv.LayerNorm.weight"),
        ln_b=get("encoder.conv.LayerNorm.bias"),
    )


def classification_head(
    w: HeadWeights, per_token: bool
) -> tuple[ClassificationHead, PoolingMethod]:
    """DebertaV2ForSequenceClassification: the ContextPooler (``pooler.dense`` and
    ``pooler_hidden_act``, gelu by default) on the first token, then ``classifier``.
    DebertaV2ForTokenClassification: ``classifier`` on every token."""
    if per_token:
        return ClassificationHead.read(w, "classifier."), "cls"
    act = str(w.config.get("pooler_hidden_act", "gelu"))
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{w.architecture}: pooler_hidden_act {act!r} is not supported; supported: "
            f"{', '.join(ACTIVATIONS)}"
        )
    return ClassificationHead.read(w, "classifier.", "pooler.dense.", pooler_activation=act), "cls"

"""jina-embeddings-v3 on packed tokens: a rotary XLM-R with task LoRA adapters, the adapter
chosen per sequence.

The Hub checkpoint (jinaai/jina-embeddings-v3, run there by jinaai/xlm-roberta-flash-
implementation's ``XLMRobertaLoRA``) says ``model_type: xlm-roberta`` with
``position_embedding_type: rotary``; transformers >= 5 ships the same body as
``model_type: jina_embeddings_v3`` (without the adapters), which is the reference the tests
compare against. Both are read here.

The body is XLM-R's post-LayerNorm blocks under the flash implementation's names (``emb_ln``,
``mixer.Wqkv``, ``mixer.out_proj``, ``norm1``, ``mlp.fc1``/``fc2``, ``norm2``: the rename
table jina-reranker-v2 is read by, ``bert.FLASH_NAMES``), with no position table: NeoX-style
rotary positions over the whole head, base ``rotary_emb_base`` (20000), from 0 in each
sequence. Word and segment embeddings, then ``emb_ln``; mean pooling and Matryoshka come from
the sentence-transformers files, outside the model.

Task LoRA: ``lora_adaptations`` names ``n`` adapters (retrieval.query, retrieval.passage,
separation, classification, text-matching), each of rank ``lora_rank`` on every Linear and
every Embedding of the body, stored as torch parametrizations in the main safetensors:
``X.parametrizations.weight.original`` is the base weight and
``X.parametrizations.weight.0.lora_A`` / ``lora_B`` the factors with a leading adapter
dimension. For a Linear ``A`` is ``[n, r, in]`` and ``B`` ``[n, out, r]``: adapter ``t`` uses
``W + s * B[t] @ A[t]``; for an Embedding ``A`` is ``[n, vocab, r]`` and ``B`` ``[n, r, dim]``:
``W + s * A[t] @ B[t]``; ``s = lora_alpha / lora_rank``. A sequence with no adapter (the
remote code's ``task=None``) runs the base weights.

Mixed adapters in one packed batch: every Linear adds ``((x @ A_all^T) * mask) @ B_all`` to
its base product, where ``A_all`` stacks every adapter's ``A`` (``[n*r, in]``), ``B_all``
every adapter's scaled ``B^T`` (``[n*r, out]``), and ``mask`` (``[T, n*r]``, built once per
batch) keeps, for each token, the ``r`` columns of its sequence's adapter (none for a sequence
without one). That is the per-sequence merged weight, exactly, as two thin GEMMs over all the
tokens (``n*r`` = 20 columns against a 1024-wide body: a few percent of the layer's work);
the batch is never split by adapter. Embeddings gather the rows of ``A`` by token id instead
of multiplying.

Tensor parallelism splits heads and MLP columns as for XLM-R. The adapters follow their
weight: a column-parallel projection (q/k/v, fc1) keeps its rows of ``B`` and all of ``A``; a
row-parallel one (out_proj, fc2) its columns of ``A`` and all of ``B``, its partial low-rank
product summed over the ranks with the partial base product (the masked GEMM is linear, so
the sum is the whole). The embeddings' factors are small (``vocab x n*r``) and replicated.
The adapter of every token crosses to the other ranks with the batch plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.distributed import Shard
from embedding_server.device.models.base import Checkpoint, Ignored, PackedBatch, WeightReader
from embedding_server.device.models.bert import FLASH_NAMES, LEGACY_NAMES, renames
from embedding_server.device.models.layers import RotaryTable, rope_inv_freq, row_linear
from embedding_server.device.models.post_ln import Activation, PostLnEncoder, PostLnLayer
from embedding_server.errors import UnsupportedModelError

HUB_MODEL_TYPE = "xlm-roberta"
NATIVE_MODEL_TYPE = "jina_embeddings_v3"
DEFAULT_BASE = 20_000.0
"""``rotary_emb_base`` of jina's config class, and transformers' ``default_theta``."""

PREFIXES = ("roberta.",)
"""``XLMRobertaLoRA`` nests the body under ``roberta.``; transformers saves it bare."""

PARAMETRIZED = (
    (r"\.parametrizations\.weight\.original$", ".weight"),
    (r"\.parametrizations\.weight\.0\.lora_([AB])$", r".lora_\1"),
)
"""torch's parametrization names -> ``X.weight`` (the base) and ``X.lora_A`` / ``X.lora_B``."""

_PREFIX = r"(?:roberta\.)?"
_WEIGHT = r"(?:weight|parametrizations\.weight\.(?:original|0\.lora_[AB]))"

IGNORED = (
    Ignored(
        _PREFIX + r"pooler\.dense\.(?:bias|" + _WEIGHT + ")",
        "the BERT-style pooler (dense + tanh over the first token; its LoRA factors too): "
        "jina-embeddings-v3 mean-pools the final hidden states",
    ),
    Ignored(
        _PREFIX + r"embeddings\.(?:position_ids|token_type_ids)",
        "index buffers; positions and segment ids come from the packed batch",
    ),
    Ignored(
        _PREFIX + r"encoder\.layers\.\d+\.mixer\.rotary_emb\.inv_freq",
        "the rotary frequencies, a buffer: computed from rotary_emb_base here",
    ),
)
"""What jina-embeddings-v3 checkpoints carry and the body does not read."""


def is_jina_v3(config: Mapping[str, Any]) -> bool:
    """Whether an ``xlm-roberta`` config is jina-embeddings-v3's rotary body."""
    return (
        config.get("model_type") == HUB_MODEL_TYPE
        and config.get("position_embedding_type") == "rotary"
    )


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, from config.json alone, what the flash implementation can be configured to do
    and is not implemented here."""
    model_type = str(config.get("model_type"))
    position = config.get("position_embedding_type", "rotary")
    if model_type == HUB_MODEL_TYPE and position != "rotary":
        raise UnsupportedModelError(
            f"{model_type} position_embedding_type={position!r} is not jina-embeddings-v3's "
            "rotary body"
        )
    if config.get("rotary_emb_interleaved"):
        raise UnsupportedModelError(
            f"{model_type} rotary_emb_interleaved: true (GPT-J-style pairs) is not supported "
            "natively; jina-embeddings-v3 rotates halves"
        )
    if config.get("rotary_emb_scale_base") is not None:
        raise UnsupportedModelError(
            f"{model_type} rotary_emb_scale_base (xPos) is not supported natively"
        )
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    dim = config.get("rotary_emb_dim")
    if dim is not None and int(dim) != hidden // heads:
        raise UnsupportedModelError(
            f"{model_type} rotary_emb_dim={dim} (rotary over part of each head) is not "
            f"supported natively; only the whole head ({hidden // heads})"
        )
    if config.get("emb_pooler") is not None:
        raise UnsupportedModelError(
            f"{model_type} emb_pooler={config['emb_pooler']!r} (pooling inside the model) is "
            "not supported natively; jina-embeddings-v3 sets none"
        )
    adaptations = config.get("lora_adaptations")
    if adaptations is not None and (
        not isinstance(adaptations, list)
        or not adaptations
        or not all(isinstance(a, str) for a in adaptations)
        or len(set(adaptations)) != len(adaptations)
    ):
        raise UnsupportedModelError(
            f"{model_type} lora_adaptations must be a list of distinct adapter names; got "
            f"{adaptations!r}"
        )


def adapter_names(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The task adapters a config declares, in their index order."""
    return tuple(str(a) for a in config.get("lora_adaptations") or ())


@dataclass
class LoraStack:
    """Every adapter's factors of one Linear, stacked for one masked GEMM (module docstring)."""

    down: torch.Tensor
    """``[n*r, in]``: every adapter's ``A``."""
    up: torch.Tensor
    """``[n*r, out]``: every adapter's ``B^T``, times ``lora_alpha / lora_rank``."""

    def __call__(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (F.linear(x, self.down) * mask) @ self.up


@dataclass
class EmbeddingLora:
    """Every adapter's factors of one Embedding: rows of ``A`` gathered by id, then ``B``."""

    down: torch.Tensor
    """``[vocab, n*r]``: row ``v`` holds every adapter's ``A[t][v]``."""
    up: torch.Tensor
    """``[n*r, dim]``: every adapter's ``B``, times ``lora_alpha / lora_rank``."""

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (self.down.index_select(0, ids) * mask) @ self.up


@dataclass
class _Layer(PostLnLayer):
    """A block whose four projections carry their adapters."""

    qkv_lora: LoraStack | None = None
    out_lora: LoraStack | None = None
    up_lora: LoraStack | None = None
    down_lora: LoraStack | None = None

    def qkv(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return _linear(x, self.qkv_w, self.qkv_b, self.qkv_lora, mask)

    def out(self, x: torch.Tensor, mask: torch.Tensor | None, shard: Shard) -> torch.Tensor:
        return _row_linear(x, self.out_w, self.out_b, self.out_lora, mask, shard)

    def mlp(self, x: torch.Tensor, act: Activation, mask: torch.Tensor | None) -> torch.Tensor:
        return act(_linear(x, self.up_w, self.up_b, self.up_lora, mask))

    def down(self, x: torch.Tensor, mask: torch.Tensor | None, shard: Shard) -> torch.Tensor:
        return _row_linear(x, self.down_w, self.down_b, self.down_lora, mask, shard)


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora: LoraStack | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """A column-parallel (or whole) projection with its adapters."""
    out = F.linear(x, weight, bias)
    if lora is not None and mask is not None:
        out = out + lora(x, mask)
    return out


def _row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    lora: LoraStack | None,
    mask: torch.Tensor | None,
    shard: Shard,
) -> torch.Tensor:
    """A row-parallel projection with its adapters: this rank's partial base and low-rank
    products, summed over the ranks, then the bias once."""
    if lora is None or mask is None:
        return row_linear(x, weight, bias, shard)
    if not shard.parallel:
        return F.linear(x, weight, bias) + lora(x, mask)
    return shard.all_reduce(F.linear(x, weight) + lora(x, mask)) + bias


def rotary_frequencies(config: Mapping[str, Any], head_dim: int) -> torch.Tensor:
    """The inverse rotary frequencies: the Hub's ``rotary_emb_base``, or transformers'
    ``rope_parameters`` (only its default rope: the checkpoint was trained with no scaling)."""
    native = config.get("rope_parameters")
    if native:
        params = dict(native)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise UnsupportedModelError(
                f"{config.get('model_type')} rope_type {kind!r} is not supported natively "
                "(only default, as jina-embeddings-v3 is trained)"
            )
        params.setdefault("rope_theta", DEFAULT_BASE)
        return rope_inv_freq(params, head_dim)
    base = float(config.get("rotary_emb_base") or DEFAULT_BASE)
    return rope_inv_freq({"rope_theta": base}, head_dim)


class JinaV3Model(PostLnEncoder):
    """A jina-embeddings-v3 body for packed batches, with its task adapters."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        config, dtype, device = checkpoint.config, checkpoint.dtype, checkpoint.device
        model_type = str(config.get("model_type", NATIVE_MODEL_TYPE))
        check_config(config)
        split = self._read_sizes(checkpoint, model_type, eps=1e-5, even=True)
        self.max_positions = int(config.get("max_position_embeddings", 8194))
        self.rotary = RotaryTable(
            rotary_frequencies(config, self.head_dim), dtype=dtype, device=device
        )

        w = checkpoint.reader(prefixes=PREFIXES, marker="embeddings.", architecture=model_type)
        w.rename(renames(*LEGACY_NAMES, *FLASH_NAMES, *PARAMETRIZED))
        self.adapters = self._read_adapter_config(config, w, model_type)
        """The task adapters' names; index ``i`` is ``PackedBatch.adapter_ids`` value ``i``."""
        get = w.get
        vocab = w.shape_of("embeddings.word_embeddings.weight")  # every rank's rows
        self.word_emb = w.embedding("embeddings.word_embeddings.weight")
        self.word_lora = self._embedding_lora(w, "embeddings.word_embeddings.", vocab)
        self.type_emb: torch.Tensor | None = None
        self.type_lora: EmbeddingLora | None = None
        if "embeddings.token_type_embeddings.weight" in w:
            self.type_emb = get("embeddings.token_type_embeddings.weight")
            self.type_lora = self._embedding_lora(
                w, "embeddings.token_type_embeddings.", tuple(self.type_emb.shape)
            )
        self.emb_ln_w = get("embeddings.LayerNorm.weight")
        self.emb_ln_b = get("embeddings.LayerNorm.bias")
        rank = self._rank if self.adapters else 0
        self._slots = torch.arange(len(self.adapters), device=device).repeat_interleave(rank)
        self.layers: list[_Layer] = []
        h, inter = self.hidden_size, int(config["intermediate_size"])
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            qkv, out = p + "attention.self.qkv.", p + "attention.output.dense."
            up, down = p + "intermediate.dense.", p + "output.dense."
            self.layers.append(
                _Layer.read(
                    w,
                    p,
                    split,
                    (
                        w.rows(qkv + "weight", split.q, blocks=3),
                        w.rows(qkv + "bias", split.q, blocks=3),
                    ),
                    qkv_lora=self._linear_lora(w, qkv, (3 * h, h), rows=split.q, blocks=3),
                    out_lora=self._linear_lora(w, out, (h, h), columns=split.q),
                    up_lora=self._linear_lora(w, up, (inter, h), rows=split.mlp),
                    down_lora=self._linear_lora(w, down, (h, inter), columns=split.mlp),
                )
            )

    def _read_adapter_config(
        self, config: Mapping[str, Any], w: WeightReader, model_type: str
    ) -> tuple[str, ...]:
        """The adapters' names, rank and scale, refusing a config and checkpoint that
        disagree about whether there are adapters."""
        names = adapter_names(config)
        stored = "embeddings.word_embeddings.lora_A" in w
        if names and not stored:
            raise UnsupportedModelError(
                f"{model_type} config.json names lora_adaptations {list(names)}, but the "
                "checkpoint holds no LoRA factors (parametrizations.weight.0.lora_A); is it "
                "complete?"
            )
        if stored and not names:
            raise UnsupportedModelError(
                f"{model_type} checkpoint holds task LoRA factors, but config.json names no "
                "lora_adaptations: the adapters cannot be chosen by name"
            )
        self._rank = int(config.get("lora_rank", 4))
        self._scaling = float(config.get("lora_alpha", 1)) / self._rank
        return names

    def _check_factors(
        self, name: str, a: torch.Tensor, b: torch.Tensor, expected: tuple[tuple[int, ...], ...]
    ) -> None:
        """Refuse factors whose shapes are not ``expected`` (``A``'s, then ``B``'s): the
        adapter count and rank config.json names, the weight's own sizes."""
        if (tuple(a.shape), tuple(b.shape)) != expected:
            raise UnsupportedModelError(
                f"{name} LoRA factors have shapes {tuple(a.shape)} and {tuple(b.shape)}, not "
                f"{expected[0]} and {expected[1]}: config.json says {len(self.adapters)} "
                f"adapters (lora_adaptations) of rank {self._rank} (lora_rank) on the weight"
            )

    def _linear_lora(
        self,
        w: WeightReader,
        prefix: str,
        shape: tuple[int, ...],
        *,
        rows: slice | None = None,
        blocks: int = 1,
        columns: slice | None = None,
    ) -> LoraStack | None:
        """One Linear's adapters (its whole weight ``[out, in]`` is ``shape``), this rank's
        share: ``rows`` of ``B`` (of each of ``blocks`` fused parts) for a column-parallel
        weight, ``columns`` of ``A`` for a row-parallel one."""
        if not self.adapters:
            return None
        a, b = w.get(prefix + "lora_A"), w.get(prefix + "lora_B")  # [n, r, in], [n, out, r]
        n, r, fan_out, fan_in = len(self.adapters), self._rank, shape[0], shape[1]
        self._check_factors(prefix, a, b, ((n, r, fan_in), (n, fan_out, r)))
        if rows is not None:
            b = torch.cat([part[:, rows] for part in b.chunk(blocks, dim=1)], dim=1)
        if columns is not None:
            a = a[:, :, columns]
        up = b.float().transpose(1, 2).reshape(-1, b.shape[1]) * self._scaling
        return LoraStack(down=a.reshape(-1, a.shape[2]).contiguous(), up=up.to(b.dtype))

    def _embedding_lora(
        self, w: WeightReader, prefix: str, shape: tuple[int, ...]
    ) -> EmbeddingLora | None:
        """One Embedding's adapters (its table ``[rows, dim]`` is ``shape``), replicated."""
        if not self.adapters:
            return None
        a, b = w.get(prefix + "lora_A"), w.get(prefix + "lora_B")  # [n, vocab, r], [n, r, dim]
        n, r, rows, dim = len(self.adapters), self._rank, shape[0], shape[1]
        self._check_factors(prefix, a, b, ((n, rows, r), (n, r, dim)))
        down = a.transpose(0, 1).reshape(a.shape[1], -1).contiguous()
        up = b.float().reshape(-1, b.shape[2]) * self._scaling
        return EmbeddingLora(down=down, up=up.to(b.dtype))

    def adapter_mask(self, batch: PackedBatch) -> torch.Tensor | None:
        """``[T, n*r]``: 1 in the ``r`` columns of each token's adapter, else 0; None when
        no sequence of the batch uses an adapter (the base weights alone)."""
        ids = batch.adapter_ids
        if ids is None or not self.adapters:
            return None
        return (ids.unsqueeze(1) == self._slots.unsqueeze(0)).to(self.emb_ln_w.dtype)

    def embed(self, batch: PackedBatch, mask: torch.Tensor | None) -> torch.Tensor:
        """The normalized word (+ segment) embeddings, each adapted ``[T, hidden]``."""
        ids = batch.input_ids
        x = self.word_emb(ids)
        if self.word_lora is not None and mask is not None:
            x = x + self.word_lora(ids, mask)
        if self.type_emb is not None:
            # type_vocab_size 1: every token reads row 0 (its XLM-R tokenizer gives a pair's
            # second text type 0 as well).
            types = torch.zeros_like(ids)
            if batch.token_type_ids is not None and self.type_emb.shape[0] > 1:
                types = batch.token_type_ids
            x = x + self.type_emb.index_select(0, types)
            if self.type_lora is not None and mask is not None:
                x = x + self.type_lora(types, mask)
        return F.layer_norm(x, (self.hidden_size,), self.emb_ln_w, self.emb_ln_b, self.eps)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        mask = self.adapter_mask(batch)
        rope = self.rotary.lookup(batch.position_ids, batch.max_seqlen)
        x = self.embed(batch, mask)
        for layer in self.layers:
            x = self._block(x, layer, batch, rope=rope, mask=mask)
        return x

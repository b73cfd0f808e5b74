"""What every model implementation shares: the packed batch and the model protocol.

A ``PackedBatch`` is the flat layout of the design (input_ids[T], position_ids[T],
cu_seqlens[B+1], max_seqlen). Models turn it into final hidden states ``[T, hidden]``; pooling
is not their concern. Attention goes through :meth:`PackedBatch.attention`, which runs the
batch's kernel and shares its plan across layers, so a model's forward is only its own
math. Weights come from Hugging Face checkpoints by their names (:class:`WeightReader`), so no
``transformers`` model class is needed at run time.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from embedding_server.device.attention import (
    AttentionBias,
    AttentionPlan,
    Backend,
    flash_kernel,
    plan_attention,
    staged,
    varlen_attention,
)
from embedding_server.device.distributed import SINGLE, Shard
from embedding_server.device.models.layers import HeadSplit, VocabEmbedding
from embedding_server.device.prefix_cache import (
    PrefixBatch,
    PrefixEntry,
    PrefixKey,
    prefix_attention,
    split_entries,
)
from embedding_server.errors import UnsupportedModelError


@dataclass(eq=False)
class PackedBatch:
    """All sequences of a forward pass concatenated, no padding."""

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarting at each sequence
    cu_seqlens: torch.Tensor  # [B+1] int32, on the model's device
    max_seqlen: int
    seqlens: tuple[int, ...]
    attention_backend: Backend = Backend.SDPA_BUCKETED
    token_type_ids: torch.Tensor | None = None
    """[T] int64 segment ids of sentence pairs (BERT), None when every token is segment 0."""
    adapter_ids: torch.Tensor | None = None
    """[T] int64 index of the task adapter each token's sequence runs (jina-embeddings-v3's
    LoRA), -1 for none; None when no sequence of the batch names one."""
    key_lens: tuple[int, ...] | None = None
    """Per sequence, how many leading tokens are keys (ColBERT's query augmentation: the
    ``[MASK]`` tokens after a query are queries nothing attends to); None: all of them."""
    prefix: PrefixBatch | None = None
    """The cached prefixes the sequences continue (``device.prefix_cache``): the batch then
    holds each sequence's own tokens only, at positions after its prefix's; None: none."""
    _plan: AttentionPlan | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        sequences: Sequence[Sequence[int]],
        device: torch.device,
        position_offset: int = 0,
        *,
        attention: Backend = Backend.SDPA_BUCKETED,
        token_types: Sequence[Sequence[int]] | None = None,
        adapters: Sequence[int] | None = None,
        key_lens: Sequence[int] | None = None,
        prefixes: Sequence[PrefixKey | None] | None = None,
    ) -> PackedBatch:
        """Pack token id lists; ``position_offset`` shifts positions (RoBERTa: padding_idx+1);
        ``attention`` is the kernel every layer's attention runs on; ``token_types`` are the
        segment ids of each sequence (sentence pairs), None for all zeros; ``adapters`` the
        task adapter of each sequence (-1: none), None for none at all; ``key_lens`` each
        sequence's count of leading tokens other tokens may attend to, None for all;
        ``prefixes`` the cached prefix each sequence continues (None: none), whose length
        shifts its positions.

        The integer rows (ids, positions, segment ids) are packed on the host into one
        staging tensor and reach the device in one copy, ``cu_seqlens`` in a second. On CUDA
        the staging tensors are pinned and the copies ``non_blocking`` on the current stream
        (:func:`~..attention.staged`), so the host goes on at once; a consumer on another
        stream must wait for this one (the runner's copy stream and event). On the CPU the
        batch's tensors are rows of the staging tensor itself."""
        seqlens = tuple(len(s) for s in sequences)
        total = sum(seqlens)
        rows = 2 + (token_types is not None) + (adapters is not None)
        pin_memory = device.type == "cuda"
        staging = torch.empty((rows, total), dtype=torch.int64, pin_memory=pin_memory)
        host = staging.numpy()
        host[0] = np.fromiter(itertools.chain.from_iterable(sequences), np.int64, total)
        lens = np.asarray(seqlens, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        host[1] = np.arange(total, dtype=np.int64) - np.repeat(starts, lens) + position_offset
        prefix = None
        if prefixes is not None and any(p is not None for p in prefixes):
            shift = np.asarray([0 if p is None else len(p) for p in prefixes], dtype=np.int64)
            host[1] += np.repeat(shift, lens)
            prefix = PrefixBatch.build(prefixes, seqlens, device)
        if token_types is not None:
            host[2] = np.fromiter(itertools.chain.from_iterable(token_types), np.int64, total)
        if adapters is not None:
            host[rows - 1] = np.repeat(np.asarray(adapters, dtype=np.int64), lens)
        cu = torch.empty(len(seqlens) + 1, dtype=torch.int32, pin_memory=pin_memory)
        cu_host = cu.numpy()
        cu_host[0] = 0
        np.cumsum(lens, out=cu_host[1:], dtype=np.int32)
        packed = staged(staging, device)
        return cls(
            packed[0],
            packed[1],
            staged(cu, device),
            max(seqlens, default=0),
            seqlens,
            attention,
            None if token_types is None else packed[2],
            None if adapters is None else packed[rows - 1],
            None if key_lens is None else tuple(key_lens),
            prefix,
        )

    @classmethod
    def of(
        cls,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        seqlens: Sequence[int],
        *,
        attention: Backend = Backend.SDPA_BUCKETED,
        key_lens: Sequence[int] | None = None,
        prefixes: Sequence[PrefixKey | None] | None = None,
    ) -> PackedBatch:
        """A batch from already packed ids and positions (what a tensor-parallel worker
        receives); ``cu_seqlens`` goes to their device; ``key_lens`` and ``prefixes`` as
        :meth:`build`'s (the positions already shifted by the prefixes)."""
        lens = torch.tensor(list(seqlens), dtype=torch.int32)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        return cls(
            input_ids,
            position_ids,
            staged(cu, input_ids.device),
            max(seqlens, default=0),
            tuple(seqlens),
            attention,
            key_lens=None if key_lens is None else tuple(key_lens),
            prefix=(
                PrefixBatch.build(prefixes, seqlens, input_ids.device)
                if prefixes is not None and any(p is not None for p in prefixes)
                else None
            ),
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch on its device, the attention plan's included."""
        own = [
            self.input_ids,
            self.position_ids,
            self.cu_seqlens,
            self.token_type_ids,
            self.adapter_ids,
        ]
        # A batch with prefixes attends through their plan (``prefix_attention``) only.
        plan = self.attention_plan.tensors() if self.prefix is None else self.prefix.tensors()
        return [t for t in own if t is not None] + plan

    @property
    def max_position(self) -> int:
        """One more than the largest position of the batch (its prefixes counted)."""
        return self.max_seqlen if self.prefix is None else self.prefix.max_full_seqlen

    @property
    def attention_plan(self) -> AttentionPlan:
        """The attention plan, built once and shared by all layers."""
        if self._plan is None:
            self._plan = plan_attention(
                self.seqlens, self.input_ids.device, self.attention_backend, self.key_lens
            )
        return self._plan

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        window: int | None = None,
        bias: AttentionBias | None = None,
        softcap: float | None = None,
        layer: int | None = None,
    ) -> torch.Tensor:
        """Attention within each packed sequence (``[T, heads, head_dim]`` in and out);
        ``window`` is the keys a query sees on each side (flash-attn's convention); ``bias``
        an additive term on the logits (SDPA kernels only, see ``Architecture.attention_bias``);
        ``softcap`` the logits' tanh cap (see ``Architecture.attention_softcap``). ``layer``:
        the layer's index, which a batch with cached prefixes needs to read their keys.

        With cached prefixes (:attr:`prefix`) it is
        :func:`~..prefix_cache.prefix_attention`, for what that computes exactly: causal
        attention, with or without a sliding window or soft-cap, no bias, on flash-attn or
        an SDPA plan."""
        if self.prefix is None:
            return varlen_attention(
                q,
                k,
                v,
                cu_seqlens=self.cu_seqlens,
                max_seqlen=self.max_seqlen,
                causal=causal,
                plan=self.attention_plan,
                scale=scale,
                window=window,
                bias=bias,
                softcap=softcap,
            )
        if layer is None or not causal or bias is not None:
            raise ValueError(
                "a cached prefix needs causal attention without an additive bias, and the "
                "layer's index"
            )
        if self.attention_backend is Backend.TORCH_VARLEN:
            raise ValueError("torch_varlen cannot attend to a cached prefix")
        flash = flash_kernel() if self.attention_backend is Backend.FLASH_ATTN else None
        return prefix_attention(
            q,
            k,
            v,
            self.prefix,
            layer,
            scale=scale,
            window=window,
            softcap=softcap,
            flash=flash,
            cu_seqlens_q=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
        )


Captured = list[tuple[torch.Tensor, torch.Tensor]]
"""Each layer's keys (after RoPE) and values of a forward pass, in layer order."""


class PrefixStates:
    """What a causal decoder body needs to serve cached prefixes (``device.prefix_cache``):
    its forward pass as :meth:`_run`, which appends each layer's keys and values to
    ``captured`` when given one and passes ``layer=`` to :meth:`PackedBatch.attention`."""

    causal: bool
    device: torch.device

    def _run(self, batch: PackedBatch, captured: Captured | None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        return self._run(batch, None)

    def prefix_entries(
        self, prefixes: Sequence[PrefixKey], attention: Backend = Backend.SDPA_BUCKETED
    ) -> list[PrefixEntry]:
        """The cacheable states of ``prefixes`` (each a sequence's leading token ids), in one
        forward pass of them alone: exact for a causal body, whose states of a sequence's
        first tokens do not depend on what follows, sliding windows included."""
        if not self.causal:
            raise ValueError("a bidirectional model's prefix states depend on what follows")
        batch = PackedBatch.build(prefixes, self.device, attention=attention)
        captured: Captured = []
        return split_entries(prefixes, self._run(batch, captured), captured)


class EmbeddingModel(Protocol):
    """A packed-token transformer body."""

    hidden_size: int
    """Width of the states :meth:`forward` returns (a projection shipped with the body, such
    as voyage-4-nano's ``linear``, makes it the projection's output width)."""
    causal: bool
    position_offset: int
    """Added to 0-based positions before the position embedding (RoBERTa: padding_idx + 1)."""
    max_positions: int
    """Longest sequence the position encoding supports."""
    sliding_window: int | None
    """The config's ``sliding_window`` when some layers attend only that far; else None."""

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` in the model dtype."""
        ...


@dataclass(frozen=True)
class Ignored:
    """Checkpoint tensors a family knows it does not use, and why: an unused pooler, an LM
    head when embedding, a buffer saved by mistake. ``pattern`` is a regular expression
    matched against the whole Hugging Face name; anything a family neither reads nor lists
    here refuses the load, so a head we do not know can never vanish silently."""

    pattern: str
    reason: str


class TrackedWeights(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by name, remembering which were read: the body's
    :class:`WeightReader` and the head readers all read through it, so after a model is
    built :func:`audit_tensors` knows what nobody read. Asking whether a name exists is not
    reading it."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._weights[name]
        self.read.add(name)
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of ``name``, without reading it where the checkpoint can tell."""
        reader = getattr(self._weights, "shape_of", None)
        if reader is not None:
            return tuple(reader(name))
        return tuple(self._weights[name].shape)

    def row(self, name: str, index: int) -> torch.Tensor:
        """Row ``index`` of ``name`` (which counts as read): from the file alone where the
        checkpoint can read one row (safetensors), else from the whole tensor."""
        self.read.add(name)
        reader = getattr(self._weights, "row", None)
        if reader is not None:
            tensor: torch.Tensor = reader(name, index)
            return tensor
        return self._weights[name][index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


@dataclass(frozen=True)
class TensorAudit:
    """Where every tensor of a checkpoint went once its model and heads were built."""

    read: tuple[str, ...]
    ignored: tuple[tuple[str, str], ...]
    """``(name, reason)`` of each tensor left unread that the family declares it ignores."""
    unclaimed: tuple[str, ...]
    """Tensors neither read nor declared: the load must be refused."""


def audit_tensors(weights: TrackedWeights, ignored: Sequence[Ignored]) -> TensorAudit:
    """Sort every tensor of ``weights`` into read, declared ignorable, and unclaimed."""
    patterns = [(re.compile(entry.pattern), entry.reason) for entry in ignored]
    read: list[str] = []
    skipped: list[tuple[str, str]] = []
    unclaimed: list[str] = []
    for name in sorted(weights):
        if name in weights.read:
            read.append(name)
            continue
        reason = next((why for rx, why in patterns if rx.fullmatch(name)), None)
        if reason is None:
            unclaimed.append(name)
        else:
            skipped.append((name, reason))
    return TensorAudit(tuple(read), tuple(skipped), tuple(unclaimed))


@dataclass(frozen=True)
class Checkpoint:
    """What a family's builder gets: the config, the weights by Hugging Face name, the
    dtype and device the model runs in, and the tensor-parallel rank it builds (``shard``:
    which heads and MLP columns to keep, see ``layers.HeadSplit``)."""

    config: Mapping[str, Any]
    weights: Mapping[str, torch.Tensor]
    dtype: torch.dtype
    device: torch.device
    shard: Shard = SINGLE

    def reader(self, *, prefixes: Sequence[str], marker: str, architecture: str) -> WeightReader:
        """The weights, converted, under the family's names (see :class:`WeightReader`)."""
        vocab = self.config.get("vocab_size")
        return WeightReader(
            self.weights,
            prefixes=prefixes,
            marker=marker,
            architecture=architecture,
            dtype=self.dtype,
            device=self.device,
            shard=self.shard,
            claimed_vocab=int(vocab) if isinstance(vocab, int) else None,
        )


class WeightReader:
    """A checkpoint's tensors by Hugging Face name, converted to the model's dtype and device.

    The task-head prefix (``bert.``, ``model.`` ...) is stripped first, so names match the
    bare model: a prefix is stripped only if it precedes ``marker``, a name every checkpoint
    of the family contains (e.g. ``embeddings.``). Names outside the prefix keep their own
    (a projection shipped beside the body: voyage-4-nano's ``linear.weight`` next to
    ``model.*``), so a family can read them. A missing weight means the checkpoint is not
    what it claims, and is an error naming it. What no reader reads is the fidelity guard's
    concern (:func:`audit_tensors`), not this class's.
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        prefixes: Sequence[str],
        marker: str,
        architecture: str,
        dtype: torch.dtype,
        device: torch.device,
        shard: Shard = SINGLE,
        claimed_vocab: int | None = None,
    ) -> None:
        self.shard = shard
        self.claimed_vocab = claimed_vocab
        """config.json's ``vocab_size``: the token-id bound the server admits, checked
        against the embedding table's rows (:func:`refuse_beyond_table`)."""
        # Names are resolved up front, tensors only when read: with a lazy mapping (loading's
        # safetensors reader) each is loaded, sliced to this rank's share and converted on
        # its own, so no rank ever holds the whole checkpoint.
        self._weights = weights
        self._names = _strip_prefix(weights.keys(), prefixes, marker)
        self.architecture, self.dtype, self.device = architecture, dtype, device

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The whole shape of ``name`` (every rank's share), without reading it where the
        checkpoint can tell."""
        if name not in self._names:
            self._take(name)  # the error naming the missing weight
        source = self._names[name]
        reader = getattr(self._weights, "shape_of", None)
        if reader is not None:
            return tuple(reader(source))
        return tuple(self._weights[source].shape)

    def rename(self, rename: Callable[[str], str]) -> None:
        """Map legacy names onto the current ones before reading."""
        self._names = {rename(name): source for name, source in self._names.items()}

    def _take(self, name: str) -> torch.Tensor:
        try:
            return self._weights[self._names.pop(name)]
        except KeyError:
            raise UnsupportedModelError(
                f"{self.architecture} checkpoint lacks the weight {name!r}; is it a complete "
                f"{self.architecture} model?"
            ) from None

    def _convert(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(device=self.device, dtype=self.dtype).contiguous()
        if out.untyped_storage().nbytes() > out.nbytes:
            out = out.clone()  # a rank's share viewing the whole: keep only the share
        return out

    def get(self, name: str) -> torch.Tensor:
        """The whole weight (replicated on every tensor-parallel rank)."""
        return self._convert(self._take(name))

    def rows(self, name: str, select: slice, *, blocks: int = 1) -> torch.Tensor:
        """Output features ``select`` of a column-parallel weight (or its bias): this rank's
        share. A fused weight of ``blocks`` equal parts (ModernBERT's ``Wqkv``: 3) gives
        ``select`` of each part, concatenated. Sliced before the conversion, so only the
        share reaches the device."""
        return self._convert(self._host_rows(name, select, blocks))

    def _host_rows(self, name: str, select: slice, blocks: int = 1) -> torch.Tensor:
        weight = self._take(name)
        if blocks == 1:
            return weight[select]
        return torch.cat([part[select] for part in weight.chunk(blocks)])

    def embedding(self, name: str) -> VocabEmbedding:
        """A token embedding table, split by vocabulary rows on tensor-parallel ranks."""
        weight = self._take(name)
        if self.claimed_vocab is not None:
            refuse_beyond_table(
                self.architecture, "vocab_size", self.claimed_vocab, weight.shape[0], name
            )
        rows = self.shard.chunk(weight.shape[0])
        return VocabEmbedding(self._convert(weight[rows]), rows, self.shard)

    def columns(self, name: str, select: slice) -> torch.Tensor:
        """Input features ``select`` of a row-parallel weight: this rank's share."""
        return self._convert(self._take(name)[:, select])

    def maybe(self, name: str, present: bool) -> torch.Tensor | None:
        """The weight when the config says it exists (``present``), else None."""
        return self.get(name) if present else None

    def cat(self, names: Sequence[str], selects: Sequence[slice]) -> torch.Tensor:
        """This rank's rows (``selects``, one per name) of several weights concatenated along
        the output dimension: one matmul instead of several (q/k/v, gate/up)."""
        # Concatenated on the host, then converted and moved once: concatenating on the device
        # would hold every part and the fused copy there at the same time.
        parts = [self._host_rows(n, select) for n, select in zip(names, selects, strict=True)]
        return self._convert(torch.cat(parts))

    def qkv(self, names: Sequence[str], split: HeadSplit) -> torch.Tensor:
        """The query, key and value projections (weights or biases, in that order) fused,
        holding this rank's heads."""
        return self.cat(names, (split.q, split.kv, split.kv))


def refuse_beyond_table(architecture: str, key: str, claimed: int, rows: int, table: str) -> None:
    """Refuse a config whose ``key`` claims more than the weights' ``table`` holds.

    The server's limits come from the config (the longest input from
    ``max_position_embeddings``, the largest token id admitted from ``vocab_size``); a claim
    beyond the table would let a request index past it: an IndexError on the CPU, a
    device-side assert that poisons the CUDA context on a GPU. A claim below is a limit the
    checkpoint chose, and stands.
    """
    if claimed > rows:
        raise UnsupportedModelError(
            f"{architecture} config.json says {key}={claimed}, but the weights' {table} has "
            f"{rows} rows: positions or token ids beyond {rows} would index past it. The "
            f"config does not match its weights; fix {key} in config.json (at most {rows})"
        )


def _strip_prefix(names: Iterable[str], prefixes: Sequence[str], marker: str) -> dict[str, str]:
    """Our name -> the checkpoint's name, with the first prefix that precedes ``marker``
    stripped; names outside it keep their own unless a stripped one took it (then that one
    is never read, and the fidelity guard refuses the checkpoint)."""
    names = list(names)
    for prefix in prefixes:
        if any(name.startswith(prefix + marker) for name in names):
            inside = {n.removeprefix(prefix): n for n in names if n.startswith(prefix)}
            outside = {n: n for n in names if not n.startswith(prefix) and n not in inside}
            return {**outside, **inside}
    return {name: name for name in names}


def decoder_causal(config: Mapping[str, Any], model_type: str) -> bool:
    """Whether a decoder's attention is causal, by every flag checkpoints use to switch it
    off: ``is_causal: false`` (gte-Qwen2; what transformers' masks read) and
    ``use_bidirectional_attention: true`` (voyage-4-nano, EmbeddingGemma). Contradicting
    flags are refused rather than guessed between."""
    is_causal = config.get("is_causal")
    bidirectional = config.get("use_bidirectional_attention")
    if is_causal is True and bidirectional is True:
        raise UnsupportedModelError(
            f"{model_type} config.json sets both is_causal: true and "
            "use_bidirectional_attention: true; which attention the model was trained with "
            "is ambiguous: fix the config to say one"
        )
    return not (is_causal is False or bidirectional is True)


def config_get(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """First present key among ``names`` (configs name the same thing differently)."""
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    return default

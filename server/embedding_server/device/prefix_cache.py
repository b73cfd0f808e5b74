"""Exact instruction-prefix caching for causal decoders (``--prefix-cache-bytes``).

Why: the decoder embedders users pick most put a long instruction before every short query
(Qwen3-Embedding's ``Instruct: Given a web search query, ...\\nQuery:``, e5-mistral's), so a
10-token query costs 30 to 40 tokens of compute, every time, for the same prefix tokens. In a
*causal* decoder the states of a sequence's first ``P`` tokens depend on those ``P`` tokens
alone, so computing them once and reusing them is exact, not an approximation. In a
bidirectional one (gte-Qwen2, llama-nemotron-embed, GritLM, every encoder) each prefix token
attends to what follows, and a cache would be wrong: the engine refuses the flag there
(``device.configuration``).

What is cached, per prefix (its exact token ids, leading special tokens included; the model's
fingerprint keys the whole cache, which lives and dies with its engine): every layer's keys
(after q/k norm and RoPE) and values, ``[layers, P, kv_heads, head_dim]``, this rank's heads,
and the model's final states of those tokens ``[P, hidden]``, which pooling and per-token
outputs read as if they had been computed with the request. A prefix is the prompt's
share of a sequence's ids (``SequenceInput.skip``, its prompt length): whatever the
tokenizer made of the prompt's boundary, the key is the ids themselves, so a prompt whose
last token merges with the text's first (byte-level BPE) only misses, never serves another
prefix's states.

Each request then runs only its own tokens, at positions shifted by ``P``, its queries
attending to the cached keys and its own (:func:`prefix_attention`): queries a suffix of the
keys, causal aligned to the bottom right. On flash-attn that is its varlen call with separate
query and key lengths (``causal=True`` aligns so since flash-attn 2.1); on the SDPA paths one
call per group of sequences with the same query and prefix lengths, with an explicit
``[n, P + n]`` mask. A batch mixes sequences with and without a prefix freely. Sliding
windows stay exact (a prefix token's states only ever look back): the window is applied to
the positions the prefix shifts, on both paths.

Bounded by a byte budget with LRU eviction (:class:`PrefixCache`); an entry larger than the
budget is computed for its batch and not kept.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from embedding_server.device.attention import Backend, softcapped_attention, staged
from embedding_server.metrics import Metrics

PrefixKey = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PrefixEntry:
    """One prefix's states: what every layer's attention reads of it, and its final states."""

    ids: PrefixKey
    keys: torch.Tensor
    """``[layers, P, kv_heads, head_dim]``, after RoPE (this rank's key heads)."""
    values: torch.Tensor
    """``[layers, P, kv_heads, head_dim]``."""
    states: torch.Tensor
    """``[P, hidden]``: the model's output states of the prefix tokens."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.states))


@runtime_checkable
class PrefixModel(Protocol):
    """A model whose prefix states can be cached: a causal decoder of ours."""

    def prefix_entries(
        self, prefixes: Sequence[PrefixKey], attention: Backend = ...
    ) -> list[PrefixEntry]:
        """Each prefix's states, computed alone (``attention``: the kernel)."""
        ...


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """The cache's state and counts (``/metrics`` exports hits, misses and bytes)."""

    max_bytes: int
    bytes: int
    entries: int
    hits: int
    """Sequences served from a prefix computed for an earlier batch."""
    misses: int
    """Sequences whose prefix was computed for their own batch."""
    evictions: int


class PrefixCache:
    """Prefix states by their token ids, least recently used first out, within ``max_bytes``.

    Shared by the scheduler's threads: :meth:`get` and :meth:`put` take a lock. An entry
    handed out stays valid after it is evicted (the batch holding it keeps its tensors)."""

    def __init__(self, max_bytes: int, *, metrics: Metrics | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a prefix cache needs a positive byte budget, got {max_bytes}")
        self.max_bytes = max_bytes
        self._metrics = metrics
        self._listeners: list[Callable[[PrefixKey], None]] = []
        self._entries: OrderedDict[PrefixKey, PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, ids: PrefixKey) -> PrefixEntry | None:
        with self._lock:
            entry = self._entries.get(ids)
            if entry is not None:
                self._entries.move_to_end(ids)
            return entry

    def listen(self, dropped: Callable[[PrefixKey], None]) -> None:
        """Call ``dropped(key)`` for each prefix the cache lets go of: evicted, or refused
        by :meth:`put` (tensor parallelism's other ranks drop theirs then)."""
        self._listeners.append(dropped)

    def put(self, entry: PrefixEntry) -> bool:
        """Keep ``entry``, evicting the least recently used ones it needs room from; False
        (nothing kept or evicted) when it alone is larger than the budget."""
        size = entry.nbytes
        if size > self.max_bytes:
            for dropped in self._listeners:
                dropped(entry.ids)
            return False
        evicted: list[PrefixKey] = []
        with self._lock:
            old = self._entries.pop(entry.ids, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._entries and self._bytes + size > self.max_bytes:
                key, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                self._evictions += 1
                evicted.append(key)
            self._entries[entry.ids] = entry
            self._bytes += size
            if self._metrics is not None:
                self._metrics.prefix_cache_bytes.set(self._bytes)
        for key in evicted:
            for dropped in self._listeners:
                dropped(key)
        return True

    def count(self, *, hits: int, misses: int) -> None:
        with self._lock:
            self._hits += hits
            self._misses += misses
        if self._metrics is not None:
            self._metrics.prefix_cache_hits.inc(hits)
            self._metrics.prefix_cache_misses.inc(misses)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                self.max_bytes,
                self._bytes,
                len(self._entries),
                self._hits,
                self._misses,
                self._evictions,
            )


@dataclass(frozen=True, slots=True)
class _Group:
    """Sequences of one batch with the same own length ``n`` and prefix length ``p``."""

    n: int
    p: int
    queries: torch.Tensor  # [count * n] packed index of each own token, in order
    keys: torch.Tensor  # [count * (p + n)] row of each key in cat(prefix keys, own keys)


@dataclass(eq=False)
class PrefixBatch:
    """The prefix side of one packed batch: which sequences start with which cached prefix.

    The packed batch holds only each sequence's own tokens (``seqlens``); sequence ``i``
    carries ``lengths[i]`` prefix tokens before them (0: none), those of
    ``entries[slots[i]]``. Built on the host with the batch (the index tensors depend only
    on the lengths); :meth:`bind` gives it the entries' tensors before the forward pass."""

    lengths: tuple[int, ...]
    slots: tuple[int, ...]
    """Per sequence, the index of its prefix among the batch's distinct ones (-1: none)."""
    keys: tuple[PrefixKey, ...]
    """The batch's distinct prefixes, in slot order."""
    seqlens: tuple[int, ...]
    groups: tuple[_Group, ...]
    full_index: torch.Tensor
    """``[sum(lengths) + sum(seqlens)]``: row of each full sequence's token (its prefix's,
    then its own) in ``cat(prefix states, own states)``."""
    cu_seqlens_k: torch.Tensor
    """int32 ``[B+1]`` of the full (prefix + own) key sequences, for the varlen kernels."""
    _keys: torch.Tensor | None = field(default=None, repr=False)
    _values: torch.Tensor | None = field(default=None, repr=False)
    _states: torch.Tensor | None = field(default=None, repr=False)
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        prefixes: Sequence[PrefixKey | None],
        seqlens: Sequence[int],
        device: torch.device,
    ) -> PrefixBatch:
        """The plan of a batch whose sequence ``i`` has the own length ``seqlens[i]`` and
        the cached prefix ``prefixes[i]`` (None: none)."""
        distinct: dict[PrefixKey, int] = {}
        slots = [-1 if p is None else distinct.setdefault(p, len(distinct)) for p in prefixes]
        keys = tuple(distinct)
        lengths = tuple(0 if p is None else len(p) for p in prefixes)
        offsets = list(itertools.accumulate((len(k) for k in keys), initial=0))
        prefix_rows = offsets[-1]
        starts = list(itertools.accumulate(seqlens, initial=0))
        # Rows of cat(prefix rows, own rows): sequence i's full tokens.
        rows: list[torch.Tensor] = []
        for i, (slot, n) in enumerate(zip(slots, seqlens, strict=True)):
            own = torch.arange(prefix_rows + starts[i], prefix_rows + starts[i] + n)
            if slot >= 0:
                rows.append(torch.arange(offsets[slot], offsets[slot] + lengths[i]))
            rows.append(own)
        full = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        full_lens = [p + n for p, n in zip(lengths, seqlens, strict=True)]
        cu_k = torch.tensor(list(itertools.accumulate(full_lens, initial=0)), dtype=torch.int32)
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, (p, n) in enumerate(zip(lengths, seqlens, strict=True)):
            by_shape.setdefault((n, p), []).append(i)
        full_starts = list(itertools.accumulate(full_lens, initial=0))
        groups = []
        for (n, p), members in sorted(by_shape.items()):
            queries = torch.cat([torch.arange(starts[i], starts[i] + n) for i in members])
            key_rows = torch.cat([full[full_starts[i] : full_starts[i + 1]] for i in members])
            groups.append(_Group(n, p, staged(queries, device), staged(key_rows, device)))
        return cls(
            lengths,
            tuple(slots),
            keys,
            tuple(seqlens),
            tuple(groups),
            staged(full, device),
            staged(cu_k, device),
        )

    def tensors(self) -> list[torch.Tensor]:
        """The plan's index and mask tensors on the device (not the entries': the cache's)."""
        own = [t for g in self.groups for t in (g.queries, g.keys)]
        return [*own, self.full_index, self.cu_seqlens_k]

    def mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """Group ``index``'s ``[n, p + n]`` mask (True = attend), built once per batch and
        window: query ``i`` (position ``p + i``) sees key ``j`` when ``j <= p + i`` and, with a
        ``window``, ``p + i - j <= window``. None for a square causal block without a window
        that bites (SDPA's ``is_causal``)."""
        group = self.groups[index]
        if group.p == 0 and (window is None or group.n - 1 <= window):
            return None
        key = (index, window)
        mask = self._masks.get(key)
        if mask is None:
            device = group.queries.device
            back = (
                torch.arange(group.n, device=device).unsqueeze(1)
                + group.p
                - torch.arange(group.p + group.n, device=device).unsqueeze(0)
            )  # position of the query minus that of the key
            mask = back >= 0
            if window is not None:
                mask &= back <= window
            self._masks[key] = mask
        return mask

    @property
    def full_seqlens(self) -> tuple[int, ...]:
        return tuple(p + n for p, n in zip(self.lengths, self.seqlens, strict=True))

    @property
    def max_full_seqlen(self) -> int:
        return max(self.full_seqlens, default=0)

    def bind(self, entries: Sequence[PrefixEntry]) -> None:
        """Attach the states of :attr:`keys` (in order), before the forward pass."""
        if tuple(e.ids for e in entries) != self.keys:
            raise ValueError("prefix entries do not match the batch's prefixes")
        if not entries:
            return
        if len(entries) == 1:
            entry = entries[0]
            self._keys, self._values, self._states = entry.keys, entry.values, entry.states
            return
        self._keys = torch.cat([e.keys for e in entries], dim=1)
        self._values = torch.cat([e.values for e in entries], dim=1)
        self._states = torch.cat([e.states for e in entries])

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s prefix keys and values, ``[sum of prefix lengths, kv_heads,
        head_dim]`` each; None when the batch has no prefix."""
        if self._keys is None or self._values is None:
            return None
        return self._keys[index], self._values[index]

    def full_states(self, own: torch.Tensor) -> torch.Tensor:
        """The output states of every sequence whole (prefix tokens first), from its own
        tokens' (``own``, ``[sum(seqlens), hidden]``): as pooling reads them uncached."""
        if self._states is None:
            return own
        return torch.cat([self._states.to(own.dtype), own]).index_select(0, self.full_index)


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: PrefixBatch,
    layer: int,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    flash: Any = None,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
) -> torch.Tensor:
    """Causal attention of each sequence's own queries ``q`` (``[T, Hq, D]``) to its cached
    prefix's keys and values (layer ``layer``) and its own ``k``, ``v`` (``[T, Hkv, D]``):
    query ``j`` of a sequence with prefix length ``P`` sees keys ``0 .. P + j``, and with a
    sliding ``window`` only those at most ``window`` before ``P + j`` (flash-attn's
    convention, as ``attention.varlen_attention``'s): what the whole sequence computes.
    ``softcap`` caps the logits (Gemma 2's ``cap * tanh(logits / cap)``), eagerly on SDPA's
    side (``attention.softcapped_attention``, as without the cache).

    ``flash``: flash-attn's ``flash_attn_varlen_func`` (with ``cu_seqlens_q`` and
    ``max_seqlen_q``), whose ``causal=True`` and ``window_size`` align queries to the end of
    longer keys; without it, scaled_dot_product_attention per :class:`_Group`."""
    cached = prefix.layer(layer)
    if cached is None:
        keys, values = k, v
    else:
        keys, values = torch.cat([cached[0], k]), torch.cat([cached[1], v])
    if window is not None and window >= prefix.max_full_seqlen - 1:
        window = None  # no query of this batch is far enough from any key for it to bite
    if flash is not None:
        extra: dict[str, Any] = {} if window is None else {"window_size": (window, 0)}
        if softcap is not None:
            extra["softcap"] = softcap
        return flash(  # type: ignore[no-any-return]
            q,
            keys.index_select(0, prefix.full_index),
            values.index_select(0, prefix.full_index),
            cu_seqlens_q,
            prefix.cu_seqlens_k,
            max_seqlen_q,
            prefix.max_full_seqlen,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=True,
            **extra,
        )
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    rep = heads // kv_heads
    out = q.new_empty(q.shape)
    for index, group in enumerate(prefix.groups):
        count = group.queries.shape[0] // group.n
        qb = q.index_select(0, group.queries).view(count, group.n, heads, dim).transpose(1, 2)
        width = group.p + group.n
        kb = keys.index_select(0, group.keys).view(count, width, kv_heads, dim).transpose(1, 2)
        vb = values.index_select(0, group.keys).view(count, width, kv_heads, dim).transpose(1, 2)
        if rep > 1:
            kb, vb = kb.repeat_interleave(rep, dim=1), vb.repeat_interleave(rep, dim=1)
        mask = prefix.mask(index, window)
        if softcap is not None:
            sdpa = {"is_causal": True} if mask is None else {"attn_mask": mask}
            result = softcapped_attention(qb, kb, vb, sdpa, scale, softcap, group.n)
        elif mask is None:
            result = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        else:
            result = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        out.index_copy_(0, group.queries, result.transpose(1, 2).reshape(-1, heads, dim))
    return out


def split_entries(
    prefixes: Sequence[PrefixKey],
    states: torch.Tensor,
    captured: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[PrefixEntry]:
    """The entries of ``prefixes`` run packed in that order, from the forward pass's final
    ``states`` (``[T, hidden]``) and each layer's ``captured`` keys and values
    (``[T, kv_heads, head_dim]``): each prefix's own rows, copied out of the batch."""
    keys = torch.stack([k for k, _ in captured])  # [layers, T, kv_heads, head_dim]
    values = torch.stack([v for _, v in captured])
    entries, start = [], 0
    for ids in prefixes:
        end = start + len(ids)
        entries.append(
            PrefixEntry(
                tuple(ids),
                keys[:, start:end].clone(),
                values[:, start:end].clone(),
                states[start:end].clone(),
            )
        )
        start = end
    return entries

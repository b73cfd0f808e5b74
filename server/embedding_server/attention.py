"""The one variable-length attention function every model calls.

Models run on *packed* batches: all sequences concatenated into one ``[total_tokens, ...]``
tensor, delimited by ``cu_seqlens`` (int32, ``[B+1]``). No padding reaches the linear layers,
which is where an encoder spends almost all of its FLOPs.

* On CUDA with flash-attn installed we call ``flash_attn_varlen_func`` directly: it consumes
  exactly this layout.
* Otherwise (CPU, every test) we run torch's ``scaled_dot_product_attention`` per *length
  bucket*: sequences of equal (or, with ``_BUCKET_RATIO`` < 1, similar) length are attended
  together as one ``[n, heads, L, head_dim]`` block, padded with a key mask only when lengths
  in the bucket differ. The scheduler groups requests by length and the runner orders each
  batch by length, so buckets are contiguous and the block is a zero-copy view. A
  block-diagonal mask over the whole batch would cost O(T^2); a call per sequence costs
  O(B) calls per layer; buckets cost O(#distinct lengths).

The bucket plan depends only on the sequence lengths, so it is built once per batch
(:func:`plan_attention`) and reused by every layer.

Sliding-window layers (Mistral, Qwen2/Qwen3 with ``use_sliding_window``) pass ``window``, the
keys a query may see on each side, in flash-attn's ``window_size`` convention; the model maps
its config onto it. flash-attn gets it as ``window_size``; on the torch path only buckets
longer than ``window + 1`` get a banded mask (built once per batch), the others cannot tell
the difference and keep the mask-free call.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FlashVarlenFunc = Callable[..., torch.Tensor]

try:  # pragma: no cover - only on GPU hosts with the gpu extra
    from flash_attn import flash_attn_varlen_func as _flash_impl

    flash_attn_varlen_func: FlashVarlenFunc | None = _flash_impl
except ImportError:  # flash-attn is optional: the torch path below is always available
    flash_attn_varlen_func = None

# Sequences whose length is within this factor of their bucket's longest share one padded
# SDPA call. 1.0 = exact-length buckets: since the runner sorts each batch by length, those
# are contiguous zero-copy views, and measured on MiniLM (130 sequences, 62 distinct
# lengths, CPU) they beat padded 0.8-buckets by ~10%: the gather/scatter copies cost more
# than the extra SDPA calls (~30 us each). Lower it if a backend makes calls expensive.
_BUCKET_RATIO = 1.0


def flash_available(tensor: torch.Tensor) -> bool:
    """Whether the flash-attn kernel can serve this tensor (importable, CUDA, half dtype)."""
    return (
        flash_attn_varlen_func is not None
        and tensor.is_cuda
        and tensor.dtype in (torch.float16, torch.bfloat16)
    )


def backend_name(device: torch.device, dtype: torch.dtype) -> str:
    """The attention implementation a model on this device and dtype will use (for info())."""
    if (
        flash_attn_varlen_func is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
    ):
        return "flash_attn_varlen"
    return "torch_sdpa_bucketed"


@dataclass(frozen=True, slots=True)
class _Bucket:
    length: int  # padded length L of this bucket
    count: int  # sequences n
    start: int  # first packed token when ``contiguous``
    contiguous: bool  # all n sequences have length L and are adjacent
    gather: torch.Tensor | None  # [n*L] packed token index per padded slot
    valid: torch.Tensor | None  # [n*L] bool: slot holds a real token
    key_mask: torch.Tensor | None  # [n, 1, 1, L] bool, True = attend


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How the torch path splits a packed batch into padded SDPA calls."""

    buckets: tuple[_Bucket, ...]
    total_tokens: int
    device: torch.device
    _window_masks: dict[tuple[int, int, bool], torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    def window_mask(self, index: int, window: int, causal: bool) -> torch.Tensor:
        """Bucket ``index``'s banded mask (True = attend), cached for the other layers.

        Query ``i`` sees key ``j`` when ``i - window <= j``, and ``j <= i`` (causal) or
        ``j <= i + window`` (not causal). ``[L, L]``, or ``[n, 1, L, L]`` when the bucket
        pads its shorter sequences and attention is not causal (then padded keys are masked
        too, and each padded query sees itself so that no row is empty).
        """
        key = (index, window, causal)
        mask = self._window_masks.get(key)
        if mask is None:
            bucket = self.buckets[index]
            pos = torch.arange(bucket.length, device=self.device)
            back = pos.unsqueeze(1) - pos.unsqueeze(0)  # i - j
            mask = (back <= window) & (back >= (0 if causal else -window))
            if not causal and bucket.key_mask is not None:
                diagonal = torch.eye(bucket.length, dtype=torch.bool, device=self.device)
                mask = (mask & bucket.key_mask) | diagonal
            self._window_masks[key] = mask
        return mask


def plan_attention(seqlens: Sequence[int], device: torch.device) -> AttentionPlan:
    """Group sequences into length buckets (order inside the batch is preserved per bucket)."""
    starts: list[int] = []
    offset = 0
    for n in seqlens:
        starts.append(offset)
        offset += n
    order = sorted(range(len(seqlens)), key=lambda i: -seqlens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and seqlens[i] >= _BUCKET_RATIO * seqlens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    buckets = []
    for group in groups:
        group.sort()
        length = seqlens[group[0]] if len(group) == 1 else max(seqlens[i] for i in group)
        same = all(seqlens[i] == length for i in group)
        adjacent = all(starts[b] == starts[a] + length for a, b in itertools.pairwise(group))
        if same and adjacent:
            buckets.append(_Bucket(length, len(group), starts[group[0]], True, None, None, None))
            continue
        slot = torch.arange(length)
        lens = torch.tensor([seqlens[i] for i in group])
        valid = slot.unsqueeze(0) < lens.unsqueeze(1)  # [n, L]
        base = torch.tensor([starts[i] for i in group]).unsqueeze(1)
        gather = torch.where(valid, base + slot, base)  # pads -> own start
        buckets.append(
            _Bucket(
                length,
                len(group),
                0,
                False,
                gather.reshape(-1).to(device),
                valid.reshape(-1).to(device),
                None if same else valid[:, None, None, :].to(device),
            )
        )
    return AttentionPlan(tuple(buckets), offset, device)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    plan: AttentionPlan | None = None,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention over packed sequences.

    ``q``: ``[T, Hq, D]``; ``k``, ``v``: ``[T, Hkv, D]`` with ``Hq % Hkv == 0`` (grouped-query
    attention); ``cu_seqlens``: int32 ``[B+1]``. Returns ``[T, Hq, D]``. Tokens attend only
    within their own sequence (and only backwards when ``causal``). With ``window`` (sliding
    window attention), the query at position ``i`` sees only keys ``j`` with
    ``i - window <= j <= i + window``: flash-attn's ``window_size=(window, window)``, so a
    causal query sees ``window + 1`` keys, itself included.
    """
    if window is not None and window < 0:
        raise ValueError(f"attention window must be >= 0, got {window}")
    if window is not None and window >= max_seqlen - 1:
        window = None  # no query of this batch is far enough from any key for it to bite
    if flash_available(q):
        assert flash_attn_varlen_func is not None
        # Passed only when it bites, so flash-attn builds without window_size (< 2.3)
        # still serve the models and batches that do not need it.
        extra: dict[str, Any] = {}
        if window is not None:
            extra["window_size"] = (window, 0 if causal else window)
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            **extra,
        )
    if plan is None:
        plan = plan_attention(torch.diff(cu_seqlens).tolist(), q.device)
    return _sdpa_bucketed(q, k, v, plan, causal=causal, scale=scale, window=window)


def _sdpa_bucketed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    *,
    causal: bool,
    scale: float | None,
    window: int | None,
) -> torch.Tensor:
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    rep = heads // kv_heads

    def band(index: int) -> torch.Tensor | None:
        if window is None or plan.buckets[index].length - 1 <= window:
            return None
        return plan.window_mask(index, window, causal)

    if len(plan.buckets) == 1 and plan.buckets[0].contiguous:
        result = _attend(q, k, v, plan.buckets[0], rep, causal, scale, band(0))
        return result.reshape(-1, heads, dim)
    out = q.new_empty(q.shape)
    for index, bucket in enumerate(plan.buckets):
        result = _attend(q, k, v, bucket, rep, causal, scale, band(index))  # [n*L, H, D]
        if bucket.contiguous:
            out[bucket.start : bucket.start + bucket.count * bucket.length] = result
        else:
            assert bucket.gather is not None and bucket.valid is not None
            out.index_copy_(0, bucket.gather[bucket.valid], result[bucket.valid])
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bucket: _Bucket,
    rep: int,
    causal: bool,
    scale: float | None,
    window_mask: torch.Tensor | None,
) -> torch.Tensor:
    n, length = bucket.count, bucket.length
    if bucket.contiguous:
        end = bucket.start + n * length
        qb, kb, vb = q[bucket.start : end], k[bucket.start : end], v[bucket.start : end]
    else:
        assert bucket.gather is not None
        qb, kb, vb = (t.index_select(0, bucket.gather) for t in (q, k, v))
    qb = qb.view(n, length, q.shape[1], q.shape[2]).transpose(1, 2)
    kb = kb.view(n, length, k.shape[1], k.shape[2]).transpose(1, 2)
    vb = vb.view(n, length, v.shape[1], v.shape[2]).transpose(1, 2)
    if rep > 1:
        kb = kb.repeat_interleave(rep, dim=1)
        vb = vb.repeat_interleave(rep, dim=1)
    kwargs: dict[str, Any] = {"scale": scale}
    if window_mask is not None:
        kwargs["attn_mask"] = window_mask  # causality and padding are folded into the band
    elif causal:
        # Right padding: a real query at position i only sees keys <= i, all real.
        kwargs["is_causal"] = True
    elif bucket.key_mask is not None:
        kwargs["attn_mask"] = bucket.key_mask
    result = F.scaled_dot_product_attention(qb, kb, vb, **kwargs)
    return result.transpose(1, 2).reshape(n * length, q.shape[1], q.shape[2])

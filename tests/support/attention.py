"""A recording stand-in for flash-attn's ``flash_attn_varlen_func`` and the mask it documents.

The model tests swap it in for the real kernel (absent on CPU machines) to check what our
attention plumbing passes: cumulative lengths, causal flag, window, scale; it computes the
reference result with torch's SDPA so the forward pass still produces real numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def flash_mask(n: int, causal: bool, window_size: tuple[int, int]) -> torch.Tensor:
    """flash-attn's documented mask for seqlen_q == seqlen_k: query i sees keys j in
    ``[i - window_size[0], i + window_size[1]]`` (-1 = unbounded), and only j <= i if causal."""
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    left, right = window_size
    keep = torch.ones(n, n, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if causal:
        keep &= j <= i
    return keep


class RecordingFlash:
    """Stands in for flash_attn_varlen_func (same signature), computing the reference."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
    ) -> torch.Tensor:
        self.calls.append(
            {
                "cu_q": cu_seqlens_q.clone(),
                "cu_k": cu_seqlens_k.clone(),
                "max_q": max_seqlen_q,
                "max_k": max_seqlen_k,
                "causal": causal,
                "dropout": dropout_p,
                "scale": softmax_scale,
                "dtype": cu_seqlens_q.dtype,
                "window_size": window_size,
            }
        )
        lens = torch.diff(cu_seqlens_q).tolist()
        out = []
        start = 0
        rep = q.shape[1] // k.shape[1]
        for n in lens:
            qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            mask = flash_mask(n, causal, window_size)
            out.append(
                F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=softmax_scale
                ).transpose(0, 1)
            )
            start += n
        return torch.cat(out)

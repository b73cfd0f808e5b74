"""Stand-ins for the CUDA-only varlen attention kernels, strict about what the real ones need.

flash-attn's ``flash_attn_varlen_func`` and torch's ``varlen_attn`` only run on CUDA, so on
this CPU the tests hand the engine these instead, with the device facts of a GPU
(:func:`pretend_cuda`). Each stand-in refuses, as the real kernel does, a call it could not
serve: float32 or host tensors, ``cu_seqlens`` that are not int32 on q's device, a tensor
``max_seqlen``, a strided last dimension, ``head_dim`` > 256, ALiBi slopes that are not
float32 per head, and for torch's kernel grouped query attention without ``enable_gqa``. It
then computes the reference (float32 per-sequence SDPA under flash-attn's documented
``window_size`` mask, logits soft-capped as flash-attn's ``softcap`` does, ALiBi added as its
``alibi_slopes`` documents) and returns it in q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.device import attention
from embedding_server.device import configuration as device_configuration
from embedding_server.device.attention import AttentionFacts

MAX_HEAD_DIM = 256
BF16_COSINE = 0.995
"""Two bfloat16 runs of the same tiny model through different attention kernels agree to
about this cosine per token (bf16 keeps ~3 significant digits, and errors compound over
layers); a kernel given the wrong layout, mask or scale is far off it."""


def flash_mask(
    n: int, causal: bool, window_size: tuple[int, int], m: int | None = None
) -> torch.Tensor:
    """flash-attn's documented mask for ``n`` queries and ``m`` keys (default ``n``), aligned
    to the bottom right (flash-attn 2.1+): with ``d = m - n``, query i sees keys j in
    ``[i + d - window_size[0], i + d + window_size[1]]`` (-1 = unbounded), and only
    ``j <= i + d`` if causal."""
    m = n if m is None else m
    i = torch.arange(n).unsqueeze(1) + (m - n)
    j = torch.arange(m).unsqueeze(0)
    left, right = window_size
    keep = torch.ones(n, m, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if causal:
        keep &= j <= i
    return keep


def check_varlen_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: tuple[torch.Tensor, torch.Tensor],
    max_seqlen: tuple[Any, Any],
) -> None:
    """What flash-attn's and torch's varlen kernels refuse, raised the way they would."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"{name}: FlashAttention only supports fp16 and bf16, not {t.dtype}")
        if t.dtype != q.dtype:
            raise RuntimeError("query and key/value must have the same dtype")
        if t.stride(-1) != 1:
            raise RuntimeError(f"{name} must have contiguous last dimension")
    if q.shape[-1] > MAX_HEAD_DIM or k.shape[-1] != q.shape[-1]:
        raise RuntimeError(
            f"FlashAttention forward only supports head dimension at most 256, {q.shape}"
        )
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    for cu, packed in zip(cu_seqlens, (q, k), strict=True):
        if cu.dtype != torch.int32:
            raise RuntimeError(f"cu_seqlens must have dtype int32, not {cu.dtype}")
        if cu.device != q.device:
            raise RuntimeError(f"cu_seqlens must be on {q.device}, not {cu.device}")
        if int(cu[-1]) != packed.shape[0]:
            raise RuntimeError("cu_seqlens does not add up to the packed tokens")
    if len(cu_seqlens[0]) != len(cu_seqlens[1]):
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have the same batch size")
    for value in max_seqlen:
        if type(value) is not int:
            raise RuntimeError(f"max_seqlen must be a Python int, not {type(value).__name__}")


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool,
    window_size: tuple[int, int],
    scale: float | None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence float32 attention under flash-attn's mask, in q's dtype; ``softcap`` > 0
    caps the scaled logits at ``softcap * tanh(logits / softcap)`` (flash-attn's 0: none);
    ``alibi_slopes`` adds flash-attn's documented ALiBi term, ``-slope * |i - j|`` per head
    (queries and keys of equal length). ``cu_seqlens_k``: keys and values packed apart from
    the queries; where a sequence's differ in length, the masks follow flash-attn's
    bottom-right alignment (:func:`flash_mask`); ALiBi only with equal
    lengths, else it raises."""
    rep = q.shape[1] // k.shape[1]
    out, start, key_start = [], 0, 0
    key_lens = torch.diff(cu_seqlens if cu_seqlens_k is None else cu_seqlens_k).tolist()
    for n, m in zip(torch.diff(cu_seqlens).tolist(), key_lens, strict=True):
        qs = q[start : start + n].float().transpose(0, 1)
        ks, vs = (t[key_start : key_start + m].float().transpose(0, 1) for t in (k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        if m != n and alibi_slopes is not None:
            raise RuntimeError("the stand-in models ALiBi on equal q/k lengths only")
        mask = flash_mask(n, causal, window_size, m)
        if alibi_slopes is not None:
            pos = torch.arange(n)
            distance = (pos.unsqueeze(0) - pos.unsqueeze(1)).abs().float()
            bias = -alibi_slopes.float()[:, None, None] * distance
            mask = bias.masked_fill(~mask, float("-inf"))
        if softcap > 0:
            logits = qs @ ks.transpose(-1, -2) * (qs.shape[-1] ** -0.5 if scale is None else scale)
            logits = (torch.tanh(logits / softcap) * softcap).masked_fill(~mask, float("-inf"))
            result = torch.softmax(logits, dim=-1) @ vs
        else:
            result = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out.append(result.transpose(0, 1))
        start += n
        key_start += m
    return torch.cat(out).to(q.dtype)


@dataclass
class StrictFlash:
    """``flash_attn_varlen_func``'s signature; records each call."""

    calls: list[dict[str, Any]] = field(default_factory=list)

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
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_varlen_call(q, k, v, (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k))
        if alibi_slopes is not None and (
            alibi_slopes.dtype != torch.float32
            or alibi_slopes.device != q.device
            or tuple(alibi_slopes.shape) != (q.shape[1],)
        ):
            raise RuntimeError("alibi_slopes must be float32 (nheads,) on q's device")
        self.calls.append(
            {
                "cu_q": cu_seqlens_q.clone(),
                "cu_k": cu_seqlens_k.clone(),
                "max_q": max_seqlen_q,
                "max_k": max_seqlen_k,
                "causal": causal,
                "dropout": dropout_p,
                "scale": softmax_scale,
                "window_size": window_size,
                "softcap": softcap,
                "alibi_slopes": None if alibi_slopes is None else alibi_slopes.clone(),
            }
        )
        return reference(
            q,
            k,
            v,
            cu_seqlens_q,
            causal=causal,
            window_size=window_size,
            scale=softmax_scale,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            cu_seqlens_k=cu_seqlens_k,
        )


@dataclass
class StrictTorchVarlen:
    """``torch.nn.attention.varlen.varlen_attn``'s signature (causal is
    ``window_size=(-1, 0)``); records each call."""

    calls: list[dict[str, Any]] = field(default_factory=list)

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seq_q: torch.Tensor,
        cu_seq_k: torch.Tensor,
        max_q: int,
        max_k: int,
        *,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        check_varlen_call(query, key, value, (cu_seq_q, cu_seq_k), (max_q, max_k))
        if query.shape[1] != key.shape[1] and not enable_gqa:
            raise RuntimeError("grouped-query attention needs enable_gqa=True")
        self.calls.append({"window_size": window_size, "enable_gqa": enable_gqa, "scale": scale})
        return reference(
            query,
            key,
            value,
            cu_seq_q,
            causal=False,
            window_size=window_size,
            scale=scale,
            cu_seqlens_k=cu_seq_k,
        )


@dataclass
class FakeCuda:
    """What :func:`pretend_cuda` installed."""

    flash: StrictFlash
    torch_varlen: StrictTorchVarlen


def pretend_cuda(
    monkeypatch: pytest.MonkeyPatch,
    *,
    capability: tuple[int, int] = (9, 0),
    flash: bool = True,
    torch_varlen: bool = True,
) -> FakeCuda:
    """Engines built after this see a GPU of ``capability`` (their tensors stay on the CPU)
    with flash-attn and torch's varlen kernel as asked, served by the strict stand-ins."""
    fakes = FakeCuda(StrictFlash(), StrictTorchVarlen())
    kernels = attention.VarlenKernels(
        fakes.flash if flash else None,
        None if flash else "flash-attn is not installed",
        fakes.torch_varlen if torch_varlen else None,
        None if torch_varlen else "torch 2.4.0 has no torch.nn.attention.varlen.varlen_attn",
    )
    monkeypatch.setattr(attention, "varlen_kernels", lambda: kernels)

    def probe(
        device: torch.device,
        dtype: torch.dtype,
        head_dim: int,
        *,
        bias: str | None = None,
        softcap: bool = False,
        alibi: bool = False,
        windowed_key_prefix: bool = False,
    ) -> AttentionFacts:
        return AttentionFacts(
            device_type="cuda",
            dtype=dtype,
            head_dim=head_dim,
            capability=capability,
            flash_attn_error=kernels.flash_error
            or (attention.flash_softcap_error(kernels.flash) if softcap else None)
            or (attention.flash_alibi_error(kernels.flash) if alibi else None),
            torch_varlen_error=kernels.torch_varlen_error,
            bias=bias,
            softcap=softcap,
            alibi=alibi,
            windowed_key_prefix=windowed_key_prefix,
        )

    # Where the engine (and inspect) choose the kernel from the facts.
    monkeypatch.setattr(device_configuration, "probe", probe)
    return fakes


def assert_rows_close(
    got: list[np.ndarray] | np.ndarray, want: list[np.ndarray] | np.ndarray, min_cosine: float
) -> None:
    """Every row (token state or vector) of ``got`` points where ``want``'s does."""
    for a, b in zip(got, want, strict=True):
        a2, b2 = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
        assert a2.shape == b2.shape
        cosine = (a2 * b2).sum(-1) / (np.linalg.norm(a2, axis=-1) * np.linalg.norm(b2, axis=-1))
        assert cosine.min() >= min_cosine, f"cosine {cosine.min():.6f} < {min_cosine}"

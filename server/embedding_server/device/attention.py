"""The one variable-length attention function every model calls, and the choice of kernel.

Models run on *packed* batches: all sequences concatenated into one ``[total_tokens, ...]``
tensor, delimited by ``cu_seqlens`` (int32, ``[B+1]``). No padding reaches the linear layers,
which is where an encoder spends almost all of its FLOPs. Four backends serve that layout:

* ``flash_attn``: flash-attn 2's ``flash_attn_varlen_func`` (CUDA, sm80+, fp16/bf16,
  head_dim <= 256). It consumes exactly this layout.
* ``torch_varlen``: torch's own ``torch.nn.attention.varlen.varlen_attn`` (same constraints,
  cuDNN or torch's FlashAttention-2 kernels), for images without flash-attn. Causal is
  ``window_size=(-1, 0)``, GQA ``enable_gqa=True``.
* ``sdpa_padded``: one ``scaled_dot_product_attention`` call per layer over the batch padded to
  its longest sequence, with gather/scatter indices built once per batch: the CUDA fallback
  (old GPUs, fp32, exotic head sizes), where a call costs more than padding.
* ``sdpa_bucketed``: one SDPA call per *length bucket*: sequences of equal (or, with
  ``_BUCKET_RATIO`` < 1, similar) length are attended together as one
  ``[n, heads, L, head_dim]`` block, padded with a key mask only when lengths in the bucket
  differ. The scheduler groups requests by length and the runner orders each batch by length,
  so buckets are contiguous and the block is a zero-copy view. The CPU default: a block-diagonal
  mask over the whole batch would cost O(T^2), a call per sequence O(B) calls per layer;
  buckets cost O(#distinct lengths) short calls.

:func:`select_backend` picks one at start from facts about the device (:func:`probe`), and
says why it passed over each faster one; a backend named explicitly is strict, so a pod that
cannot run it fails at start instead of serving slowly. The plan (bucket or padding indices,
banded masks) depends only on the sequence lengths, so it is built once per batch
(:func:`plan_attention`) and reused by every layer, with no host sync inside the layer loop.

Families whose logits carry an additive term (MPNet's relative-position bias, DeBERTa's
disentangled position terms) pass an :class:`AttentionBias`, evaluated per length bucket and
handed to SDPA as its float mask with the padded keys folded in. flash_attn and torch_varlen
take no such term, so those families declare it (:attr:`AttentionFacts.bias`) and
:func:`select_backend` passes over both varlen kernels, saying why. A bias that depends only
on positions (:class:`PositionBias`) is built once per batch and bucket and reused by every
layer.

ALiBi (JinaBERT's symmetric linear biases, ``-slope * |i - j|`` per head) is the one bias
flash-attn computes itself (its ``alibi_slopes``): the family passes an :class:`AlibiBias`,
which carries the slopes for flash_attn and builds the same term as an SDPA float mask per
length bucket. torch_varlen takes neither, so such a family declares it
(:attr:`AttentionFacts.alibi`) and :func:`select_backend` passes over torch_varlen (and a
flash-attn without ``alibi_slopes``), saying why.

Sliding-window layers (Mistral, Qwen2/Qwen3 with ``use_sliding_window``) pass ``window``, the
keys a query may see on each side, in flash-attn's ``window_size`` convention; the model maps
its config onto it. The varlen kernels get it as ``window_size``; on the SDPA paths only blocks
longer than ``window + 1`` get a banded mask (built once per batch), the others cannot tell
the difference and keep the mask-free call.

Attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``: ``cap * tanh(logits /
cap)`` after the scale, before the mask and softmax) passes ``softcap``. flash-attn >= 2.6
applies it in the kernel (its ``softcap`` argument); torch's varlen_attn and SDPA cannot, so
:func:`select_backend` passes over torch_varlen (and a flash-attn without ``softcap``) saying
why, and the SDPA paths compute such attention eagerly per length bucket (matmul, tanh cap,
mask, float32 softmax, matmul: transformers' eager attention, which is what it runs Gemma 2
with).

Keys limited to a prefix (ColBERT's query augmentation: a query padded with ``[MASK]`` up to
its query length, where the ``[MASK]`` positions are queries of their own but no position
attends to them, their keys being masked as stanford-colbert and PyLate mask them with
``attention_mask`` 0): the plan takes ``key_lens``, each sequence's count of leading tokens
that serve as keys and values. Every query of the sequence is still computed. The varlen
kernels get the keys and values of those tokens gathered, with their own ``cu_seqlens_k``;
the SDPA paths a key mask. Causal attention and ALiBi are refused with it, and sliding
windows on the varlen kernels: flash-attn aligns a query to the *end* of a shorter key
sequence for those, which is not what the reference computes. The SDPA paths take a window
(ModernBERT's local layers) as long as every query has a key within it; one without would
get an empty softmax, which the references fill differently, so that batch is refused.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import itertools
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from embedding_server.errors import InvalidRequestError

logger = logging.getLogger(__name__)

VarlenFunc = Callable[..., torch.Tensor]


def _import_flash_attn() -> tuple[VarlenFunc | None, str | None]:
    """flash-attn's varlen function, or why it is not there. Installed but broken (its CUDA
    extension built against another torch, say) is logged: it would otherwise be a silent
    fallback to a slower kernel."""
    broken: Exception
    try:
        from flash_attn import flash_attn_varlen_func as function
    except ModuleNotFoundError as error:
        if error.name == "flash_attn":
            return None, "flash-attn is not installed"
        broken = error
    except (ImportError, OSError, RuntimeError) as error:  # an ABI mismatch, a bad build
        broken = error
    else:  # pragma: no cover - only on GPU hosts with the gpu extra
        return function, None
    reason = f"flash-attn failed to import: {type(broken).__name__}: {broken}"
    logger.warning("%s", reason)
    return None, reason


def _torch_varlen() -> tuple[VarlenFunc | None, str | None]:
    """torch's varlen_attn when this torch has it with the keywords we pass, else why not."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ModuleNotFoundError:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    except ImportError as error:
        return None, f"torch's varlen_attn failed to import: {error}"
    known = set(inspect.signature(varlen_attn).parameters)
    missing = sorted({"window_size", "enable_gqa", "scale"} - known)
    if missing:  # the signature changed between versions: only the one we know is used
        return None, f"torch {torch.__version__}'s varlen_attn lacks {', '.join(missing)}"
    return cast(VarlenFunc, varlen_attn), None  # it returns a tuple only with return_aux


@dataclass(frozen=True, slots=True)
class VarlenKernels:
    """The two CUDA varlen kernels of this install, each with why it is missing (None: it is
    there)."""

    flash: VarlenFunc | None
    flash_error: str | None
    torch_varlen: VarlenFunc | None
    torch_varlen_error: str | None


@functools.cache
def varlen_kernels() -> VarlenKernels:
    """Import the varlen kernels, once, when a CUDA device asks (:func:`probe`).

    Not at import: ``torch.nn.attention.varlen`` pulls in torch's compiler stack (dynamo,
    inductor), seconds of start-up and tens of MB of private memory in every process that
    imports this module (docs/performance-log.md), the CPU server's included, which runs
    neither kernel."""
    flash, flash_error = _import_flash_attn()
    varlen, varlen_error = _torch_varlen()
    return VarlenKernels(flash, flash_error, varlen, varlen_error)


HALF_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_MIN_CAPABILITY = (8, 0)  # FlashAttention-2 kernels (flash-attn's and torch's): Ampere+
VARLEN_MAX_HEAD_DIM = 256

# Sequences whose length is within this factor of their bucket's longest share one padded
# SDPA call. 1.0 = exact-length buckets: since the runner sorts each batch by length, those
# are contiguous zero-copy views, and on MiniLM they beat padded 0.8-buckets on the CPU: the
# gather/scatter copies cost more than the extra SDPA calls (docs/performance-log.md).
# ``sdpa_padded`` is ratio 0: one bucket.
_BUCKET_RATIO = 1.0


class Backend(enum.StrEnum):
    """The attention kernels, fastest first."""

    FLASH_ATTN = "flash_attn"
    TORCH_VARLEN = "torch_varlen"
    SDPA_PADDED = "sdpa_padded"
    SDPA_BUCKETED = "sdpa_bucketed"


@dataclass(frozen=True, slots=True)
class AttentionFacts:
    """What the choice of kernel depends on; :func:`probe` reads them, tests make them up."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    capability: tuple[int, int] | None = None
    """CUDA compute capability of the target device (None off CUDA)."""
    flash_attn_error: str | None = "not probed"
    """None when flash-attn imported; else why it did not."""
    torch_varlen_error: str | None = "not probed"
    """None when torch's varlen_attn is usable; else why not."""
    bias: str | None = None
    """What the model adds to its attention logits that the varlen kernels cannot take
    (its registry entry's ``attention_bias``), or None when plain softmax attention."""
    softcap: bool = False
    """The model soft-caps its attention logits (Gemma 2): only flash-attn with ``softcap``
    and the (eager) SDPA paths can."""
    alibi: bool = False
    """The model adds ALiBi position biases (JinaBERT): only flash-attn with
    ``alibi_slopes`` and the SDPA paths (as a float mask) can."""
    windowed_key_prefix: bool = False
    """Batches limit keys to a prefix (ColBERT's query expansion) in a model with a sliding
    window (ModernBERT): :func:`plan_attention` refuses the pair on the varlen kernels,
    which would align the window to the end of the keys."""


@dataclass(frozen=True, slots=True)
class BackendChoice:
    backend: Backend
    passed_over: tuple[str, ...]
    """Why each faster backend was not chosen, for the start-up log and /info."""


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
    """The facts of this process's install and ``device``, for a model whose attention adds
    ``bias`` to its logits (None: nothing), soft-caps them (``softcap``) and adds ALiBi
    position biases (``alibi``). The varlen kernels are looked for only on CUDA: elsewhere
    neither can run, whatever is installed."""
    facts = AttentionFacts(
        device_type=device.type,
        dtype=dtype,
        head_dim=head_dim,
        bias=bias,
        softcap=softcap,
        alibi=alibi,
        windowed_key_prefix=windowed_key_prefix,
    )
    if device.type != "cuda":
        return facts
    kernels = varlen_kernels()
    return dataclasses.replace(
        facts,
        capability=torch.cuda.get_device_capability(device),
        flash_attn_error=kernels.flash_error
        or (flash_softcap_error(kernels.flash) if softcap else None)
        or (flash_alibi_error(kernels.flash) if alibi else None),
        torch_varlen_error=kernels.torch_varlen_error,
    )


def _flash_lacks(flash: VarlenFunc | None, parameter: str, why: str) -> str | None:
    """``why`` when this flash-attn takes no ``parameter`` (None: it does, or is missing)."""
    if flash is None:
        return None
    try:
        known = set(inspect.signature(flash).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: do not guess
        known = set()
    return None if parameter in known else why


def flash_softcap_error(flash: VarlenFunc | None) -> str | None:
    """Why this flash-attn cannot soft-cap attention logits (None: it can, or is missing)."""
    return _flash_lacks(
        flash,
        "softcap",
        "this flash-attn takes no softcap (2.6 and later do), which the model's attention needs",
    )


def flash_alibi_error(flash: VarlenFunc | None) -> str | None:
    """Why this flash-attn cannot add ALiBi biases (None: it can, or is missing)."""
    return _flash_lacks(
        flash,
        "alibi_slopes",
        "this flash-attn takes no alibi_slopes (2.4 and later do), which the model's ALiBi "
        "positions need",
    )


def _varlen_unfit(facts: AttentionFacts, install_error: str | None) -> str | None:
    """Why a FlashAttention-2 varlen kernel cannot serve ``facts``, or None when it can."""
    if facts.bias is not None:
        return f"takes no additive bias on the logits, and the model adds {facts.bias}"
    if facts.windowed_key_prefix:
        return (
            "cannot limit keys to a prefix within a sliding window, which the model's "
            "ColBERT query expansion needs"
        )
    if facts.device_type != "cuda":
        return f"needs CUDA, the device is {facts.device_type}"
    if install_error is not None:
        return install_error
    if facts.capability is not None and facts.capability < VARLEN_MIN_CAPABILITY:
        major, minor = facts.capability
        return f"needs compute capability 8.0 (Ampere) or newer, the GPU has {major}.{minor}"
    if facts.dtype not in HALF_DTYPES:
        return f"needs float16 or bfloat16, the dtype is {str(facts.dtype).removeprefix('torch.')}"
    if facts.head_dim > VARLEN_MAX_HEAD_DIM:
        return f"supports head_dim <= {VARLEN_MAX_HEAD_DIM}, the model's is {facts.head_dim}"
    return None


def unfit(backend: Backend, facts: AttentionFacts) -> str | None:
    """Why ``backend`` cannot serve ``facts`` (None: it can)."""
    if backend is Backend.FLASH_ATTN:
        return _varlen_unfit(facts, facts.flash_attn_error)
    if backend is Backend.TORCH_VARLEN:
        if facts.softcap:
            return "takes no logit soft-capping, and the model soft-caps its attention logits"
        if facts.alibi:
            return "takes no ALiBi slopes, and the model adds ALiBi position biases"
        return _varlen_unfit(facts, facts.torch_varlen_error)
    return None  # the SDPA paths run anywhere torch does


def select_backend(requested: str, facts: AttentionFacts) -> BackendChoice:
    """``auto``: the fastest backend ``facts`` allow (CUDA: flash_attn, torch_varlen,
    sdpa_padded; CPU: sdpa_bucketed). A named backend is strict: it is used or refused.
    A soft-capping model on an SDPA path is told so too: its attention runs eagerly."""
    choice = _select(requested, facts)
    if facts.softcap and choice.backend in (Backend.SDPA_PADDED, Backend.SDPA_BUCKETED):
        return BackendChoice(choice.backend, (*choice.passed_over, EAGER_SOFTCAP))
    return choice


EAGER_SOFTCAP = (
    "SDPA's fused kernels: they take no logit soft-capping, so this model's attention is "
    "computed eagerly (matmul, tanh cap, float32 softmax, matmul) per length bucket"
)


def _select(requested: str, facts: AttentionFacts) -> BackendChoice:
    if requested != "auto":
        backend = Backend(requested)
        reason = unfit(backend, facts)
        if reason is not None:
            message = f"attention={backend} cannot be used: {reason}"
            raise InvalidRequestError(message, param="attention")
        return BackendChoice(backend, ())
    if facts.device_type != "cuda":
        return BackendChoice(Backend.SDPA_BUCKETED, ())
    passed_over: list[str] = []
    for backend in (Backend.FLASH_ATTN, Backend.TORCH_VARLEN):
        reason = unfit(backend, facts)
        if reason is None:
            return BackendChoice(backend, tuple(passed_over))
        passed_over.append(f"{backend}: {reason}")
    return BackendChoice(Backend.SDPA_PADDED, tuple(passed_over))


@dataclass(frozen=True, slots=True)
class _Bucket:
    length: int  # padded length L of this bucket
    count: int  # sequences n
    start: int  # first packed token when ``contiguous``
    contiguous: bool  # all n sequences have length L and are adjacent
    gather: torch.Tensor | None  # [n*L] packed token index per padded slot
    slots: torch.Tensor | None  # [t] the padded slots that hold real tokens, in packed order
    tokens: torch.Tensor | None  # [t] the packed index of the token in each of those slots
    key_mask: torch.Tensor | None  # [n, 1, 1, L] bool, True = attend


@dataclass(frozen=True, slots=True)
class _KeyPrefix:
    """The varlen kernels' view of a plan whose sequences attend to a prefix of their tokens
    only (``key_lens``): which packed tokens are keys, and their ``cu_seqlens_k``."""

    index: torch.Tensor  # [sum(key_lens)] packed index of each key token, in order
    cu_seqlens: torch.Tensor  # int32 [B+1]
    max_seqlen: int
    max_unseen: int  # the most tokens of one sequence that are queries only


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How one packed batch is attended: the backend, and for SDPA the padded blocks."""

    buckets: tuple[_Bucket, ...]
    total_tokens: int
    device: torch.device
    backend: Backend = Backend.SDPA_BUCKETED
    key_prefix: _KeyPrefix | None = None
    """Set when some sequence's keys are a strict prefix of its tokens (``key_lens``); the
    SDPA buckets then carry that in their ``key_mask``."""
    _window_masks: dict[tuple[int, int, bool], torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )
    _memo: dict[Hashable, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def tensors(self) -> list[torch.Tensor]:
        """The index and mask tensors built with the plan (not the per-layer window masks,
        which the forward pass builds on its own stream)."""
        fields = ((b.gather, b.slots, b.tokens, b.key_mask) for b in self.buckets)
        own = [t for group in fields for t in group if t is not None]
        if self.key_prefix is not None:
            own += [self.key_prefix.index, self.key_prefix.cu_seqlens]
        return own

    def window_mask(self, index: int, window: int, causal: bool) -> torch.Tensor:
        """Bucket ``index``'s banded mask (True = attend), cached for the other layers.

        Query ``i`` sees key ``j`` when ``i - window <= j``, and ``j <= i`` (causal) or
        ``j <= i + window`` (not causal). ``[L, L]``, or ``[n, 1, L, L]`` when the bucket
        pads its shorter sequences or limits their keys and attention is not causal (then
        those keys are masked too, and a padded query with no key left sees itself so that
        no row is empty; a real query always has one, :func:`varlen_attention` checks).
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
                mask = mask & bucket.key_mask
                mask = mask | (diagonal & ~mask.any(dim=-1, keepdim=True))
            self._window_masks[key] = mask
        return mask

    def memo(self, key: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``build()``, run once per plan under ``key``: a tensor every layer of the batch
        shares (a position bias), dropped with the plan."""
        tensor = self._memo.get(key)
        if tensor is None:
            tensor = self._memo[key] = build()
        return tensor

    def mask_keys(self, index: int, bias: torch.Tensor) -> torch.Tensor:
        """An additive ``bias`` (``[heads, L, L]`` or ``[n, heads, L, L]``) as bucket
        ``index``'s SDPA mask: its padded keys at -inf (``[n, heads, L, L]``), or ``bias``
        itself when the bucket pads nothing. Every sequence has a real first key, so no row is
        all -inf."""
        key_mask = self.buckets[index].key_mask
        if key_mask is None:
            return bias
        return bias.masked_fill(~key_mask, float("-inf"))


class AttentionBias(Protocol):
    """An additive term on one length bucket's attention logits, added after the scale and
    before the softmax: what flash_attn and torch_varlen cannot take."""

    def __call__(
        self, plan: AttentionPlan, index: int, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        """Bucket ``index``'s mask for SDPA, in ``q``'s dtype: the bias, broadcastable to
        ``[n, heads, L, L]``, with the padded keys at -inf (:meth:`AttentionPlan.mask_keys`).
        ``q`` and ``k`` are the bucket's blocks ``[n, heads, L, head_dim]`` (key heads
        repeated to the query heads), for terms that depend on them (DeBERTa's)."""
        ...


@dataclass(frozen=True, eq=False)
class PositionBias:
    """A bias that depends only on the query and key positions (MPNet's and T5's relative
    buckets): ``table(L)`` is its ``[heads, L, L]`` for a sequence of length ``L``, in the
    model dtype. Built once per batch and bucket, padded keys folded in, and shared by every
    layer, as transformers computes it once per forward."""

    table: Callable[[int], torch.Tensor]

    def __call__(
        self, plan: AttentionPlan, index: int, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return plan.memo((self, index), lambda: plan.mask_keys(index, self.table(q.shape[2])))


@dataclass(frozen=True, eq=False)
class AlibiBias:
    """Symmetric ALiBi (Press et al.; JinaBERT's encoder form): ``-slopes[h] * |i - j|`` on
    head ``h``'s logits for query ``i`` and key ``j``. ``slopes`` (float32, ``[heads]``, on
    the model's device, this rank's heads) go to flash-attn as its ``alibi_slopes``, which
    adds exactly that term when queries and keys have the same lengths; the SDPA paths get
    it as a float mask, computed in float32 and cast to the model dtype (as the reference
    implementations build their ALiBi tensor), once per batch and bucket, shared by every
    layer."""

    slopes: torch.Tensor

    def table(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """The bias of a sequence of ``length`` tokens, ``[heads, L, L]`` in ``dtype``."""
        pos = torch.arange(length, device=self.slopes.device)
        distance = (pos.unsqueeze(0) - pos.unsqueeze(1)).abs()
        return (-self.slopes[:, None, None] * distance).to(dtype)

    def __call__(
        self, plan: AttentionPlan, index: int, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return plan.memo(
            (self, index), lambda: plan.mask_keys(index, self.table(q.shape[2], q.dtype))
        )


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``. On CUDA the copy comes from pinned memory and is queued
    ``non_blocking`` on the current stream: the host does not wait for it, and whatever that
    stream runs next sees the data. On the CPU it is ``host`` itself, no copy."""
    if device.type != "cuda":
        return host
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def plan_attention(
    seqlens: Sequence[int],
    device: torch.device,
    backend: Backend = Backend.SDPA_BUCKETED,
    key_lens: Sequence[int] | None = None,
) -> AttentionPlan:
    """The plan for one batch. The varlen kernels need none (but the gathered keys when
    ``key_lens`` limits them); ``sdpa_padded`` is one bucket of everything; ``sdpa_bucketed``
    groups sequences by length (order kept within a bucket).

    ``key_lens``: per sequence, how many of its leading tokens are keys and values (1 to its
    length; None: all of them). Its other tokens are queries that nothing attends to."""
    total = sum(seqlens)
    if key_lens is not None:
        if len(key_lens) != len(seqlens) or any(
            not 1 <= k <= n for k, n in zip(key_lens, seqlens, strict=True)
        ):
            raise ValueError(
                f"key_lens {list(key_lens)} must give each of the {len(seqlens)} sequences "
                "between 1 and its length of key tokens"
            )
        if list(key_lens) == list(seqlens):
            key_lens = None
    prefix = None
    if key_lens is not None:
        starts = list(itertools.accumulate(seqlens, initial=0))[:-1]
        index = torch.cat([torch.arange(s, s + k) for s, k in zip(starts, key_lens, strict=True)])
        cu_k = torch.tensor(list(itertools.accumulate(key_lens, initial=0)), dtype=torch.int32)
        unseen = max(n - k for n, k in zip(seqlens, key_lens, strict=True))
        prefix = _KeyPrefix(staged(index, device), staged(cu_k, device), max(key_lens), unseen)
    if backend in (Backend.FLASH_ATTN, Backend.TORCH_VARLEN):
        return AttentionPlan((), total, device, backend, prefix)
    keys = list(seqlens) if key_lens is None else list(key_lens)
    ratio = 0.0 if backend is Backend.SDPA_PADDED else _BUCKET_RATIO
    starts = list(itertools.accumulate(seqlens, initial=0))[:-1]
    order = sorted(range(len(seqlens)), key=lambda i: -seqlens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and seqlens[i] >= ratio * seqlens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    buckets = []
    for group in groups:
        group.sort()
        length = max(seqlens[i] for i in group)
        same = all(seqlens[i] == length == keys[i] for i in group)
        adjacent = all(starts[b] == starts[a] + length for a, b in itertools.pairwise(group))
        if same and adjacent:
            buckets.append(
                _Bucket(length, len(group), starts[group[0]], True, None, None, None, None)
            )
            continue
        slot = torch.arange(length)
        lens = torch.tensor([seqlens[i] for i in group])
        valid = slot.unsqueeze(0) < lens.unsqueeze(1)  # [n, L]
        attended = slot.unsqueeze(0) < torch.tensor([keys[i] for i in group]).unsqueeze(1)
        base = torch.tensor([starts[i] for i in group]).unsqueeze(1)
        gather = torch.where(valid, base + slot, base).reshape(-1)  # pads -> own start
        slots = valid.reshape(-1).nonzero().squeeze(1)  # on the host, once per batch
        buckets.append(
            _Bucket(
                length,
                len(group),
                0,
                False,
                staged(gather, device),
                staged(slots, device),
                staged(gather[slots], device),
                None if same else staged(attended[:, None, None, :], device),
            )
        )
    return AttentionPlan(tuple(buckets), total, device, backend, prefix)


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
    bias: AttentionBias | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention over packed sequences, with the plan's backend (``sdpa_bucketed`` without).

    ``q``: ``[T, Hq, D]``; ``k``, ``v``: ``[T, Hkv, D]`` with ``Hq % Hkv == 0`` (grouped-query
    attention); ``cu_seqlens``: int32 ``[B+1]``. Returns ``[T, Hq, D]``. Tokens attend only
    within their own sequence (and only backwards when ``causal``). With ``window`` (sliding
    window attention), the query at position ``i`` sees only keys ``j`` with
    ``i - window <= j <= i + window``: flash-attn's ``window_size=(window, window)``, so a
    causal query sees ``window + 1`` keys, itself included. ``bias`` adds a term to each
    bucket's logits (bidirectional attention without a window only, on an SDPA plan: the
    families that pass one are encoders that :func:`select_backend` keeps off the varlen
    kernels). An :class:`AlibiBias` is the exception: flash_attn adds it itself (its
    ``alibi_slopes``), so it is served there too. ``softcap``: logits become ``softcap *
    tanh(logits / softcap)`` before the mask and softmax (flash_attn's ``softcap``; eager on
    the SDPA plans; torch_varlen refuses).
    """
    if window is not None and window < 0:
        raise ValueError(f"attention window must be >= 0, got {window}")
    if window is not None and window >= max_seqlen - 1:
        window = None  # no query of this batch is far enough from any key for it to bite
    if plan is None:
        plan = plan_attention(torch.diff(cu_seqlens).tolist(), q.device)
    if plan.key_prefix is not None:
        if causal or isinstance(bias, AlibiBias):
            raise ValueError(
                "keys limited to a prefix of each sequence (key_lens) are supported on "
                "bidirectional attention without ALiBi only: flash-attn aligns such terms to "
                "the end of the shorter key sequence"
            )
        if window is not None and plan.key_prefix.max_unseen > window:
            raise ValueError(
                f"keys limited to a prefix of each sequence (key_lens) leave up to "
                f"{plan.key_prefix.max_unseen} queries after the last key, more than the "
                f"sliding window of {window}: a query would see no key at all"
            )
        if plan.backend in (Backend.FLASH_ATTN, Backend.TORCH_VARLEN):
            if window is not None:
                raise ValueError(
                    f"{plan.backend} aligns a sliding window to the end of a shorter key "
                    "sequence; keys limited to a prefix (key_lens) with a window need an "
                    "SDPA kernel"
                )
            if bias is not None:
                raise ValueError(f"{plan.backend} takes no attention bias")
            prefix = plan.key_prefix
            k, v = k.index_select(0, prefix.index), v.index_select(0, prefix.index)
            if plan.backend is Backend.FLASH_ATTN:
                return _flash_attn(
                    q, k, v, cu_seqlens, max_seqlen, False, scale, None, softcap, keys=prefix
                )
            if softcap is not None:
                raise ValueError("torch_varlen takes no logit soft-capping")
            return _torch_varlen_attn(
                q, k, v, cu_seqlens, max_seqlen, False, scale, None, keys=prefix
            )
    if bias is not None:
        if causal or window is not None:
            raise ValueError("an attention bias is supported on bidirectional attention only")
        if isinstance(bias, AlibiBias) and plan.backend is Backend.FLASH_ATTN and softcap is None:
            return _flash_attn(
                q, k, v, cu_seqlens, max_seqlen, False, scale, None, alibi_slopes=bias.slopes
            )
        if plan.backend in (Backend.FLASH_ATTN, Backend.TORCH_VARLEN):
            raise ValueError(
                f"{plan.backend} takes no attention bias; the model's registry entry must "
                "declare attention_bias (ALiBi: attention_alibi) so that a kernel that "
                "takes it is selected"
            )
        if softcap is not None:
            raise ValueError("an attention bias and logit soft-capping are not supported together")
        return _sdpa_bucketed(q, k, v, plan, causal=False, scale=scale, window=None, bias=bias)
    if plan.backend is Backend.FLASH_ATTN:
        return _flash_attn(q, k, v, cu_seqlens, max_seqlen, causal, scale, window, softcap)
    if plan.backend is Backend.TORCH_VARLEN:
        if softcap is not None:
            raise ValueError(
                "torch_varlen takes no logit soft-capping; the model's registry entry must "
                "declare attention_softcap so that another kernel is selected"
            )
        return _torch_varlen_attn(q, k, v, cu_seqlens, max_seqlen, causal, scale, window)
    return _sdpa_bucketed(q, k, v, plan, causal=causal, scale=scale, window=window, softcap=softcap)


def flash_kernel() -> VarlenFunc:
    """flash-attn's ``flash_attn_varlen_func``, where :func:`select_backend` chose it."""
    kernels = varlen_kernels()
    if kernels.flash is None:
        raise RuntimeError(f"flash_attn was not selectable: {kernels.flash_error}")
    return kernels.flash


def _flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float | None,
    window: int | None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    keys: _KeyPrefix | None = None,
) -> torch.Tensor:
    """flash_attn_varlen_func; ``keys``: ``k`` and ``v`` hold only the key tokens, delimited
    by its ``cu_seqlens`` (the queries by ``cu_seqlens``)."""
    kernels = varlen_kernels()
    if kernels.flash is None:
        raise RuntimeError(f"flash_attn was not selectable: {kernels.flash_error}")
    # Passed only when it bites, so flash-attn builds without window_size (< 2.3) still serve
    # the models and batches that do not need it.
    extra: dict[str, Any] = {}
    if window is not None:
        extra["window_size"] = (window, 0 if causal else window)
    if softcap is not None:
        extra["softcap"] = softcap
    if alibi_slopes is not None:
        extra["alibi_slopes"] = alibi_slopes
    return kernels.flash(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens if keys is None else keys.cu_seqlens,
        max_seqlen,
        max_seqlen if keys is None else keys.max_seqlen,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        **extra,
    )


def _torch_varlen_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float | None,
    window: int | None,
    keys: _KeyPrefix | None = None,
) -> torch.Tensor:
    """torch's varlen_attn; ``keys`` as for :func:`_flash_attn`."""
    kernels = varlen_kernels()
    if kernels.torch_varlen is None:
        raise RuntimeError(f"torch_varlen was not selectable: {kernels.torch_varlen_error}")
    left = -1 if window is None else window
    right = 0 if causal else (-1 if window is None else window)
    return kernels.torch_varlen(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens if keys is None else keys.cu_seqlens,
        max_seqlen,
        max_seqlen if keys is None else keys.max_seqlen,
        scale=scale,
        window_size=(left, right),
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _sdpa_bucketed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    *,
    causal: bool,
    scale: float | None,
    window: int | None,
    bias: AttentionBias | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    rep = heads // kv_heads

    def band(index: int) -> torch.Tensor | None:
        if window is None or plan.buckets[index].length - 1 <= window:
            return None
        return plan.window_mask(index, window, causal)

    def bias_of(index: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        return None if bias is None else functools.partial(bias, plan, index)

    if len(plan.buckets) == 1 and plan.buckets[0].contiguous:
        result = _attend(q, k, v, plan.buckets[0], rep, causal, scale, band(0), bias_of(0), softcap)
        return result.reshape(-1, heads, dim)
    out = q.new_empty(q.shape)
    for index, bucket in enumerate(plan.buckets):
        mask, extra = band(index), bias_of(index)
        result = _attend(q, k, v, bucket, rep, causal, scale, mask, extra, softcap)  # [n*L, H, D]
        if bucket.contiguous:
            out[bucket.start : bucket.start + bucket.count * bucket.length] = result
        else:
            assert bucket.slots is not None and bucket.tokens is not None
            out.index_copy_(0, bucket.tokens, result.index_select(0, bucket.slots))
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
    bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    softcap: float | None = None,
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
    if bias is not None:
        # Padded keys are already at -inf. Expanded to 4-D (a view): torch's fused CPU kernel
        # takes a float mask only in that shape, and a [heads, L, L] one falls back to the
        # unfused math, several times slower from L ~ 100 (docs/performance-log.md).
        kwargs["attn_mask"] = bias(qb, kb).expand(n, qb.shape[1], length, length)
    elif window_mask is not None:
        kwargs["attn_mask"] = window_mask  # causality and padding are folded into the band
    elif causal:
        # Right padding: a real query at position i only sees keys <= i, all real.
        kwargs["is_causal"] = True
    elif bucket.key_mask is not None:
        kwargs["attn_mask"] = bucket.key_mask
    if softcap is not None:
        result = softcapped_attention(qb, kb, vb, kwargs, scale, softcap, length)
    else:
        result = F.scaled_dot_product_attention(qb, kb, vb, **kwargs)
    return result.transpose(1, 2).reshape(n * length, q.shape[1], q.shape[2])


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sdpa_kwargs: Mapping[str, Any],
    scale: float | None,
    softcap: float,
    length: int,
) -> torch.Tensor:
    """What SDPA would compute with ``sdpa_kwargs`` (its boolean mask or ``is_causal``), with
    the logits soft-capped: transformers' eager attention, step by step and in its dtypes
    (logits in the model dtype, softmax in float32 cast back), which it runs Gemma 2 with."""
    logits = torch.matmul(q, k.transpose(-1, -2)) * (
        q.shape[-1] ** -0.5 if scale is None else scale
    )
    logits = torch.tanh(logits / softcap) * softcap
    mask = sdpa_kwargs.get("attn_mask")
    if sdpa_kwargs.get("is_causal"):
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)

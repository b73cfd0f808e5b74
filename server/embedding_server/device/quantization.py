"""int8 weights with dynamic per-token activation quantization for the native families on
the CPU (``--quantization int8``).

Every transformer block's linear weights (attention q/k/v and output, the MLP projections:
the 2-D tensors of each entry of the body's ``layers``) become :class:`Int8Weight`: int8 per
output channel, symmetric (scale ``max|w| / 127``), with no float copy kept and one int8 copy
(in the layout of the kernel that runs it). At run time each token's activations are quantized
the same way with their own scale (dynamic, per token: one outlier token does not coarsen the
grid of the whole packed batch), multiplied in int8 with int32 accumulation, and rescaled to
float32 with the bias added. The product runs on one of two torch kernels
(:func:`amx_int8_available` decides, when a weight is made):

* on CPUs with AMX-INT8 tiles, oneDNN's prepacked ``qlinear`` (``torch.ops.onednn``, what
  torch's own x86 int8 lowering uses; oneDNN's AMX brgemm). It takes one activation scale
  per tensor, so it is given a scale of 1 and the int8 values shifted to uint8 around a
  zero point of 128, and each token's own scale is applied to its output row afterwards:
  the scale factors out of the row's sums, so the product is exactly the per-token one;
* elsewhere ``torch._int_mm`` (oneDNN's int8 GEMM API: AVX-512 VNNI), which on an AMX CPU
  does not reach the tiles (slower there on MiniLM's up-projection: docs/performance-log.md,
  "int8's matmul on AMX").

Embedding tables, norms, position tables, a body's own projection and every head stay
float32: they are not in the blocks' 2-D fields, and they are a small share of the work.

Why per token and ``_int_mm`` rather than ``quantized::linear_dynamic`` (fbgemm, the kernel
behind ``torch.ao``'s dynamic quantization): that kernel quantizes activations per tensor, so
one outlier token sets the grid of a whole packed batch, and on all-MiniLM-L6-v2 over
``bench.corpus`` texts it left the worst text below the 0.99 cosine bar against float32;
per-token scales pass it, and ``_int_mm`` was also the faster product (docs/performance-log.md,
"int8 on the CPU"). torch also marks the quantized-tensor constructors fbgemm needs
deprecated.

Why a tensor subclass: the families call ``F.linear(x, weight, bias)`` on raw tensors at some
60 sites. :class:`Int8Weight` is a weight those calls dispatch on (``__torch_function__``), so
no family changes and the float path stays exactly as it was. Any other use of such a weight
(none today) gets its dequantized float32 value (``__torch_dispatch__``): correct if slower,
never wrong.

Why not torchao: its ``Int8DynamicActivationInt8WeightConfig`` ran slower than float32 on
MiniLM's shapes in eager mode on the CPU (docs/performance-log.md, "int8 on the CPU"), and it
rewrites ``nn.Linear`` modules, which our families do not have.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from embedding_server.device.dtypes import cpu_flags
from embedding_server.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

Quantization = Literal["none", "int8"]


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as int8 per output channel, symmetric, and the float32
    scale of each row."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1).clamp_min(_TINY) / 127.0
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


_TINY = torch.finfo(torch.float32).tiny

_UINT8_ZERO = 128
"""Where the int8 grid's zero sits once shifted into uint8 for oneDNN's ``qlinear``."""


def amx_int8_available() -> bool:
    """True where the int8 products run on oneDNN's prepacked ``qlinear`` (the CPU has
    AMX-INT8 tiles and this torch has the operator); else they run on ``torch._int_mm``."""
    return (
        "amx_int8" in cpu_flags()
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
    )


class Int8Weight(torch.Tensor):
    """A ``[out, in]`` linear weight held as int8 with one scale per output row, no float
    copy: ``F.linear(x, w, b)`` on it runs the int8 product (:meth:`linear`); any other
    operation sees its dequantized float32 value."""

    _int8: torch.Tensor | None
    """``[in, out]``: the transposed view ``_int_mm`` multiplies by (its fast layout); None
    where ``_packed`` holds the values (one int8 copy per weight, not two)."""
    _scale: torch.Tensor
    """``[out]`` float32."""
    _packed: torch.Tensor | None
    """The int8 values prepacked for oneDNN's AMX ``qlinear`` (None: ``_int_mm`` is used)."""
    _zero_points: torch.Tensor | None
    """``[out]`` zeros for ``qlinear`` (the weights are symmetric); None with ``_int_mm``."""

    @staticmethod
    def __new__(cls, weight: torch.Tensor) -> Int8Weight:
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("Int8Weight takes a 2-D float32 CPU tensor")
        out = torch.Tensor._make_wrapper_subclass(
            cls, weight.shape, dtype=weight.dtype, device=weight.device
        )
        int8, out._scale = _quantize(weight)
        if amx_int8_available():
            out._int8 = None
            out._packed = torch.ops.onednn.qlinear_prepack(int8, None)
            out._zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        else:
            out._int8, out._packed, out._zero_points = int8.t(), None, None
        return out

    def __init__(self, weight: torch.Tensor) -> None:
        pass  # all done in __new__: a wrapper subclass has no storage to initialize

    def int8_values(self) -> torch.Tensor:
        """The int8 weight ``[out, in]``, whichever kernel holds it. Prepacked values are read
        back through ``qlinear`` itself: the identity (as uint8 129 against zero point 128)
        times the weight with unit scales, whose int32 sums are the values, exactly."""
        if self._int8 is not None:
            return self._int8.t()
        assert self._packed is not None and self._zero_points is not None
        n_in, n_out = self.shape[1], self.shape[0]
        identity = torch.eye(n_in, dtype=torch.uint8).add_(_UINT8_ZERO)
        values: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
            identity, 1.0, _UINT8_ZERO, self._packed, torch.ones(n_out), self._zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        return values.t().to(torch.int8)

    def dequantize(self) -> torch.Tensor:  # type: ignore[override]
        """The float32 weight ``[out, in]`` the int8 values stand for."""
        return self.int8_values().to(torch.float32) * self._scale[:, None]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ self.T + bias``: ``x``'s rows quantized to int8 each by its own scale
        (``max|x_row| / 127``), multiplied in int8 with int32 sums, rescaled by both scales."""
        if x.dtype != torch.float32:
            raise TypeError(f"int8 linear takes float32 activations, got {x.dtype}")
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return x.new_empty((*x.shape[:-1], self.shape[0]))
        # max |x| per row as max(max, -min): torch's inf-norm and abs().amax() reductions
        # are slower (docs/performance-log.md, "int8 on the CPU").
        row_scale = torch.maximum(
            rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True).neg_()
        )
        row_scale = row_scale.clamp_min_(_TINY).div_(127.0)
        scaled = rows / row_scale
        if self._packed is not None:
            assert self._zero_points is not None
            # Activation scale 1 and zero point 128 here, the weight's per-row scales inside;
            # each token's own scale then multiplies its row: exactly the per-token product.
            shifted = scaled.round_().add_(_UINT8_ZERO).to(torch.uint8)
            out: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
                shifted, 1.0, _UINT8_ZERO, self._packed, self._scale, self._zero_points,
                None, 1.0, 0, torch.float32, "none", [], "",
            )  # fmt: skip
            out.mul_(row_scale)
            if bias is not None:
                out.add_(bias)
            return out.reshape(*x.shape[:-1], self.shape[0])
        assert self._int8 is not None
        quantized = scaled.round_().to(torch.int8)
        # int32 sums times float32 row scales: one pass that is also the conversion; the
        # column scales and the bias then in place (no more [tokens, out] buffers).
        out = torch.mul(torch._int_mm(quantized, self._int8), row_scale)
        if bias is None:
            out.mul_(self._scale)
        else:
            torch.addcmul(bias, out, self._scale, out=out)
        return out.reshape(*x.shape[:-1], self.shape[0])

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.linear:
            x, weight, bias = _linear_args(args, kwargs)
            if isinstance(weight, Int8Weight) and not isinstance(x, Int8Weight):
                return weight.linear(x, bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)  # shape, dtype, device: the wrapper's own

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares a plain function
        cls,
        func: Any,
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[Any, Any] | None = None,
    ) -> Any:
        """Any operation but ``F.linear`` runs on the dequantized float32 weight."""

        def plain(value: Any) -> Any:
            return value.dequantize() if isinstance(value, Int8Weight) else value

        return func(*tree_map(plain, args), **tree_map(plain, dict(kwargs or {})))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"Int8Weight(shape={tuple(self.shape)}, int8 per output channel)"


def _linear_args(
    args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[Any, Any, torch.Tensor | None]:
    names = ("input", "weight", "bias")
    values = list(args) + [kwargs.get(n) for n in names[len(args) :]]
    return values[0], values[1], values[2]


def refuse_int8(*, device: torch.device, dtype: str, backend: str, tensor_parallel: bool) -> None:
    """Refuse ``--quantization int8`` where it cannot run exactly as described: the kernels
    are CPU-only and take float32 activations; the transformers backend's modules are not
    ours to rewrite; a tensor-parallel shard would need its int8 partial sums all-reduced,
    which is not built."""
    reason = None
    if device.type != "cpu":
        reason = (
            f"it runs on the CPU only (torch's quantized kernels), and the device is {device}; "
            "serve float16/bfloat16 on a GPU instead"
        )
    elif dtype not in ("auto", "float32"):
        reason = (
            f"its activations are float32 (int8 weights, activations quantized per token), so "
            f"--dtype {dtype} cannot apply; leave --dtype auto or set float32"
        )
    elif backend == "transformers":
        reason = (
            "it quantizes the native families' linear layers; the transformers backend is "
            "not served quantized"
        )
    elif tensor_parallel:
        reason = "tensor parallelism is not served quantized; set --tensor-parallel-size 1"
    if reason is not None:
        raise UnsupportedModelError(f"--quantization int8: {reason}", param="quantization")


def quantize_layers(body: Any) -> int:
    """Replace the 2-D float32 fields of each of ``body.layers``' blocks (their linear
    weights) with :class:`Int8Weight`, in place; returns how many were replaced. A body
    without ``layers`` is refused: nothing would be quantized, and serving it as if it were
    would be a silent no-op."""
    layers = getattr(body, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise UnsupportedModelError(
            f"--quantization int8: the {type(body).__name__} body has no transformer blocks "
            "this server knows how to quantize",
            param="quantization",
        )
    count = 0
    for layer in layers:
        if not dataclasses.is_dataclass(layer):
            raise UnsupportedModelError(
                f"--quantization int8: {type(body).__name__}'s blocks are not weight records",
                param="quantization",
            )
        for f in dataclasses.fields(layer):
            value = getattr(layer, f.name)
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, Int8Weight)
                and value.dim() == 2
                and value.dtype == torch.float32
            ):
                object.__setattr__(layer, f.name, Int8Weight(value))
                count += 1
    if count == 0:
        raise UnsupportedModelError(
            f"--quantization int8: {type(body).__name__} has no float32 linear weights in its "
            "blocks to quantize",
            param="quantization",
        )
    logger.info(
        "quantization int8: %d linear weights in %d blocks as int8 per output channel "
        "(activations quantized per token at run time), products on %s",
        count,
        len(layers),
        "oneDNN's AMX qlinear" if amx_int8_available() else "torch._int_mm",
    )
    return count

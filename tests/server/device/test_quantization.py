"""``--quantization int8``: the int8 linear weight, which weights a body quantizes, what the
engine reports, and where it is refused.

The model-level checks run tiny random BERT and Qwen3 bodies against their own float32
path (the float path is checked against transformers elsewhere); the quality bar on a real
checkpoint is tests/server/test_quantization_quality.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.device import quantization
from embedding_server.device.dtypes import cpu_flags
from embedding_server.device.inspection import inspect_model
from embedding_server.device.loading import load_model
from embedding_server.device.quantization import Int8Weight, amx_int8_available
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from embedding_server.settings import EngineSettings
from pydantic import ValidationError

TEXTS = [
    "a",
    "the same model, read two ways",
    "tokens " * 40,
    "zz top",
    "a packed batch of mixed lengths, " * 6,
]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_int8_linear_is_close_to_float_and_quantizes_each_token_on_its_own() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(96, 64) * 0.1, torch.randn(96)
    x = torch.randn(12, 64)
    x[3] *= 1000.0  # an outlier token: with one scale per batch it would flatten the others
    q = Int8Weight(w)
    ours, reference = F.linear(x, q, b), F.linear(x, w, b)
    assert type(ours) is torch.Tensor and ours.shape == (12, 96)
    assert F.cosine_similarity(ours, reference, dim=1).min() > 0.999
    small = [i for i in range(12) if i != 3]
    error = (ours[small] - reference[small]).norm(dim=1) / reference[small].norm(dim=1)
    assert error.max() < 0.02
    no_bias = F.linear(x, q)
    assert torch.allclose(no_bias + b, ours, atol=1e-4)
    batched = F.linear(x.view(3, 4, 64), q, b)  # leading dimensions are kept
    assert torch.allclose(batched.view(12, 96), ours)


INT32_ACCUMULATING_INT8 = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
"""CPU flags of int8 dot products that accumulate in int32 without saturating (VNNI, AMX)."""

HAS_QLINEAR = (
    hasattr(torch.ops.onednn, "qlinear_pointwise") and torch.backends.mkldnn.is_available()
)


@pytest.mark.skipif(not HAS_QLINEAR, reason="this torch has no oneDNN qlinear operator")
@pytest.mark.skipif(
    not cpu_flags() & INT32_ACCUMULATING_INT8,
    reason="this CPU has no VNNI or AMX: oneDNN's u8s8 product falls back to AVX2's vpmaddubsw, "
    "whose int16 pair sums saturate (one output in 7,400 off by 1% on a 2-core AMD EPYC AVX2 VM, "
    "2026-12-02); the server takes this path only with AMX-INT8 (amx_int8_available)",
)
def test_onednns_qlinear_computes_exactly_the_per_token_int8_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The AMX path (oneDNN's qlinear, given activation scale 1 and each token's scale
    applied afterwards) and the _int_mm path are the same product: forced here on any x86
    CPU whose int8 instructions accumulate in int32 (VNNI or AMX), where oneDNN runs the same
    qlinear on the instructions it has."""
    torch.manual_seed(2)
    w, b = torch.randn(200, 72) * 0.05, torch.randn(200)
    x = torch.randn(37, 72)
    x[5] *= 500.0  # an outlier token keeps its own scale on both paths
    x[9] = 0.0  # an all-zero token: scale clamped, an exact zero product
    monkeypatch.setattr(quantization, "amx_int8_available", lambda: True)
    amx = Int8Weight(w)
    monkeypatch.setattr(quantization, "amx_int8_available", lambda: False)
    plain = Int8Weight(w)
    assert amx._packed is not None and plain._packed is None
    # One int8 copy each, in its kernel's layout, holding the same values.
    assert amx._int8 is None and plain._int8 is not None
    assert torch.equal(amx.int8_values(), plain.int8_values())
    assert torch.equal(amx.dequantize(), plain.dequantize())
    for bias in (b, None):
        ours, theirs = F.linear(x, amx, bias), F.linear(x, plain, bias)
        assert ours.shape == theirs.shape == (37, 200) and ours.dtype == torch.float32
        scale = theirs.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
        assert ((ours - theirs).abs() / scale).max() < 1e-5
    assert torch.equal(F.linear(x[9:10], amx), torch.zeros(1, 200))
    batched = F.linear(x[:36].view(4, 9, 72), amx, b)  # leading dimensions are kept
    assert torch.allclose(batched.view(36, 200), F.linear(x[:36], amx, b))
    assert F.linear(x[:0], amx, b).shape == (0, 200)


def test_the_amx_kernel_is_chosen_exactly_where_the_cpu_has_amx_int8() -> None:
    chosen = Int8Weight(torch.randn(8, 4))._packed is not None
    assert chosen == amx_int8_available()
    assert amx_int8_available() == (
        "amx_int8" in Path("/proc/cpuinfo").read_text().split() and HAS_QLINEAR
    )


def test_int8_weight_holds_int8_and_reads_as_its_dequantized_value() -> None:
    torch.manual_seed(1)
    w = torch.randn(32, 16)
    q = Int8Weight(w)
    assert (q.shape, q.dtype, q.device, q.dim()) == (w.shape, torch.float32, w.device, 2)
    assert q.int8_values().dtype == torch.int8 and q.int8_values().shape == w.shape
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    # Any other use than F.linear sees the dequantized float weight, never garbage.
    assert torch.equal(q * 1.0, q.dequantize())
    assert torch.equal(torch.ones(2, 32) @ q, torch.ones(2, 32) @ q.dequantize())
    with pytest.raises(ValueError):
        Int8Weight(w.to(torch.bfloat16))


@pytest.mark.parametrize("model_type", ["bert", "qwen3"])
def test_quantized_body_holds_int8_block_weights_and_stays_close(
    model_type: str, tiny_model: Callable[[str], Path]
) -> None:
    path = tiny_model(model_type)
    loaded = load_model(
        str(path),
        revision=None,
        cache_dir=None,
        dtype="auto",
        device=torch.device("cpu"),
        quantization="int8",
    )
    assert loaded.dtype == torch.float32 and loaded.quantization == "int8"
    body = loaded.model
    for layer in body.layers:  # type: ignore[attr-defined]
        tensors = {k: v for k, v in vars(layer).items() if isinstance(v, torch.Tensor)}
        matrices = {k for k, v in tensors.items() if v.dim() == 2}
        assert matrices and all(isinstance(tensors[k], Int8Weight) for k in matrices)
        assert not any(isinstance(v, Int8Weight) for k, v in tensors.items() if k not in matrices)
    floats = [v for v in vars(body).values() if isinstance(v, torch.Tensor)]
    assert floats and not any(isinstance(v, Int8Weight) for v in floats)  # embeddings, norms

    reference = Engine.from_pretrained(str(path), dtype="float32")
    quantized = Engine.from_pretrained(str(path), quantization="int8")
    ours = np.asarray(quantized.embed(TEXTS))
    theirs = np.asarray(reference.embed(TEXTS))
    assert cosines(ours, theirs).min() >= 0.99
    assert not np.allclose(ours, theirs, atol=1e-6)  # int8 did run


def test_info_reports_int8_and_float32(tiny_model: Callable[[str], Path]) -> None:
    info = Engine.from_pretrained(str(tiny_model("bert")), quantization="int8").info()
    assert (info.quantization, info.dtype) == ("int8", "float32")
    assert info.to_dict()["quantization"] == "int8"
    assert Engine.from_pretrained(str(tiny_model("bert"))).info().quantization == "none"


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float16"}, "float16"),
        ({"device": "cuda"}, "CPU only"),
        ({"device": "cuda:1"}, "CPU only"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_settings_refuse_what_int8_cannot_run(setting: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError, match=named) as error:
        EngineSettings(quantization="int8", **setting)  # type: ignore[arg-type]
    assert "quantization int8" in str(error.value)
    EngineSettings(quantization="none", **setting)  # type: ignore[arg-type]


def test_settings_refuse_an_unknown_quantization() -> None:
    with pytest.raises(ValidationError, match="quantization"):
        EngineSettings(quantization="int4")  # type: ignore[arg-type]


def test_load_refuses_a_gpu_and_the_transformers_backend(
    tiny_model: Callable[[str], Path],
) -> None:
    path = str(tiny_model("bert"))
    common = {"revision": None, "cache_dir": None, "dtype": "auto", "quantization": "int8"}
    with pytest.raises(UnsupportedModelError, match="CPU only") as gpu:
        load_model(path, device=torch.device("cuda"), **common)  # type: ignore[arg-type]
    assert gpu.value.param == "quantization"  # before any CUDA call: this machine has none
    with pytest.raises(UnsupportedModelError, match="transformers backend"):
        Engine.from_pretrained(path, quantization="int8", backend="transformers")
    with pytest.raises(UnsupportedModelError, match="fake backend"):
        Engine.from_pretrained("fake?dim=8", quantization="int8")


def test_inspect_reports_int8_and_refuses_as_serving_would(
    tiny_model: Callable[[str], Path],
) -> None:
    path = str(tiny_model("bert"))
    inspected = inspect_model(EngineSettings(model=path, quantization="int8"))
    assert (inspected.info.quantization, inspected.info.dtype) == ("int8", "float32")
    with pytest.raises(UnsupportedModelError, match="transformers backend"):
        inspect_model(EngineSettings(model=path, quantization="int8", backend="transformers"))

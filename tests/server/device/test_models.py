"""Our packed model code against Hugging Face transformers, and the attention plumbing.

Every supported family is built tiny with random weights, saved with ``save_pretrained``,
loaded by our engine, and run as ONE packed batch of mixed lengths (1 token up to the
longest); each sequence's hidden states must match transformers running it alone.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.device import attention
from embedding_server.device.models.base import PackedBatch
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from transformers import AutoModel

from tests.support.attention import BF16_COSINE, assert_rows_close, flash_mask, pretend_cuda
from tests.support.device_cases import KERNEL_RATIOS, built_once
from tests.support.models import build_decoder

FAMILIES = [
    "bert",
    "xlm-roberta",
    "mpnet",
    "deberta-v2",
    "qwen2",
    "qwen3",
    "llama",
    "mistral",
    "gemma3_text",
]


def _reference_states(path: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    model = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for seq in seqs:
            out.append(model(input_ids=torch.tensor([seq])).last_hidden_state[0].numpy())
    return out


def _mixed_sequences(engine: Engine) -> list[list[int]]:
    texts = ["hi", "The quick brown fox jumps over the lazy dog.", "embedding " * 6, "tokens", "x"]
    seqs = engine.tokenize(texts)
    seqs.append([seqs[0][0]])  # a single token
    longest = engine.info().max_input_tokens
    seqs.append(engine.tokenize("long " * 200)[0][:longest])  # exactly the maximum length
    return seqs


@pytest.mark.parametrize("kernel", ["sdpa_bucketed", "sdpa_padded"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_batch_matches_transformers(
    tiny_model: Callable[[str], Path], model_type: str, kernel: str
) -> None:
    path = tiny_model(model_type)
    engine = Engine.from_pretrained(str(path), dtype="float32", max_model_len=96, attention=kernel)
    assert engine.info().attention == kernel
    seqs = _mixed_sequences(engine)
    assert len({len(s) for s in seqs}) >= 5
    ours = engine.embed_tokens(seqs)  # one packed batch
    expected = _reference_states(path, seqs)
    for seq, got, want in zip(seqs, ours, expected, strict=True):
        assert got.shape == want.shape == (len(seq), engine.info().hidden_size)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("model_type", "flags"),
    [
        ("llama", {"attention_bias": True, "mlp_bias": True}),  # biases on q/k/v/o and MLP
        ("qwen3", {"attention_bias": True}),  # q/k/v/o
        ("mistral", {"attention_bias": True, "mlp_bias": True}),  # transformers ignores both
    ],
)
def test_projection_biases_follow_transformers(
    tmp_path: Path, model_type: str, flags: dict[str, bool]
) -> None:
    path = build_decoder(tmp_path / model_type, model_type, **flags)
    engine = Engine.from_pretrained(str(path), dtype="float32", max_model_len=96)
    seqs = _mixed_sequences(engine)
    expected = _reference_states(path, seqs)
    for got, want in zip(engine.embed_tokens(seqs), expected, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["bert", "qwen3", "gemma3_text"])
def test_pooled_vectors_follow_architecture_default(
    tiny_model: Callable[[str], Path], model_type: str
) -> None:
    """Without a sentence-transformers config: CLS for encoders, last token for decoders."""
    path = tiny_model(model_type)
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False)
    seqs = engine.tokenize(["one", "a longer input text"])
    states = engine.embed_tokens(seqs)
    pooled = engine.embed(seqs)
    index = 0 if model_type == "bert" else -1
    np.testing.assert_allclose(pooled, np.stack([s[index] for s in states]), atol=1e-6)
    assert engine.info().pooling == ("cls" if model_type == "bert" else "last")


def _naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: list[int],
    causal: bool,
    window: int | None = None,
) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    out, start = [], 0
    sides = (-1, -1) if window is None else (window, window)
    for n in lens:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        mask = flash_mask(n, causal, sides)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("ratio", [1.0, 0.5])  # exact-length buckets / padded + key mask
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [[5, 5, 5], [1, 9, 3, 9, 17, 16, 2], [7], [4, 4, 9, 4]])
def test_bucketed_attention_equals_per_sequence(
    lens: list[int], causal: bool, ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "_BUCKET_RATIO", ratio)
    torch.manual_seed(0)
    total = sum(lens)
    q = torch.randn(total, 4, 8)
    k, v = torch.randn(total, 2, 8), torch.randn(total, 2, 8)  # grouped-query 4:2
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    got = attention.varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=max(lens), causal=causal)
    torch.testing.assert_close(got, _naive_attention(q, k, v, lens, causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["bert", "qwen3"])
def test_flash_attn_plumbing(
    tiny_model: Callable[[str], Path], model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU with flash-attn, models hand it the packed layout in half precision (the
    stand-in refuses anything the real kernel would) and its output is what they use."""
    path = str(tiny_model(model_type))
    plain = Engine.from_pretrained(path, dtype="bfloat16")
    seqs = plain.tokenize(["a", "a bit longer", "the longest input of them all"])
    baseline = plain.embed_tokens(seqs)
    cuda = pretend_cuda(monkeypatch)
    engine = Engine.from_pretrained(path, dtype="bfloat16")
    assert engine.info().attention == "flash_attn"
    flashed = engine.embed_tokens(seqs)
    layers = 2
    assert len(cuda.flash.calls) == layers
    lens = sorted(len(s) for s in seqs)  # the runner packs shortest first
    expected_cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    for call in cuda.flash.calls:
        assert torch.equal(call["cu_q"], expected_cu) and torch.equal(call["cu_k"], expected_cu)
        assert call["max_q"] == call["max_k"] == max(lens)
        assert call["causal"] is (model_type == "qwen3")
        assert call["dropout"] == 0.0
    assert_rows_close(flashed, baseline, min_cosine=BF16_COSINE)


def test_packed_batch_positions_restart_per_sequence() -> None:
    batch = PackedBatch.build([[5, 6, 7], [8], [9, 10]], torch.device("cpu"), position_offset=2)
    assert batch.position_ids.tolist() == [2, 3, 4, 2, 2, 3]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 3


def test_unsupported_architecture_names_it_and_the_supported_list(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_model("bert")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="t5", architectures=["T5EncoderModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        Engine.from_pretrained(str(tmp_path), backend="native")
    message = str(err.value)
    assert "t5" in message and "T5EncoderModel" in message
    for supported in ("bert", "xlm-roberta", "qwen3", "llama"):
        assert supported in message


def test_multimodal_gemma3_is_refused_with_the_way_out(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The vision + language Gemma 3 wrapper is refused before its weights are read, and the
    message says which Gemma 3 checkpoints are served."""
    src = tiny_model("gemma3_text")
    shutil.copytree(src, tmp_path / "m")
    text_config = json.loads((src / "config.json").read_text())
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "model.safetensors").unlink()  # proves weights are not needed to refuse
    with pytest.raises(UnsupportedModelError) as err:
        Engine.from_pretrained(str(tmp_path / "m"))
    message = str(err.value)
    assert "'gemma3'" in message and "multimodal" in message and "gemma3_text" in message


# --- sliding-window attention (Mistral, Qwen2/Qwen3 with use_sliding_window) ---------------

_WINDOW = 8
_WINDOWED: dict[str, tuple[str, dict[str, Any]]] = {
    # Mistral: ``sliding_window`` alone makes every layer slide.
    "mistral": ("mistral", {"sliding_window": _WINDOW}),
    # A bidirectional decoder: transformers' window is then |i - j| <= sliding_window.
    "mistral-bidirectional": ("mistral", {"sliding_window": _WINDOW, "is_causal": False}),
    # Qwen2 as older checkpoints write it (no layer_types): layers >= max_window_layers slide.
    "qwen2-max-window-layers": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": _WINDOW, "max_window_layers": 1},
    ),
    # Newer checkpoints name each layer's kind; layer_types wins over max_window_layers.
    "qwen2-layer-types": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": _WINDOW,
            "max_window_layers": 1,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "qwen3": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": _WINDOW, "max_window_layers": 1},
    ),
    # gte-Qwen2 style: a sliding_window value that use_sliding_window leaves switched off.
    "qwen2-window-off": (
        "qwen2",
        {"use_sliding_window": False, "sliding_window": _WINDOW, "max_window_layers": 0},
    ),
    # Gemma 3: a local layer (sliding window, local rope) and a global one (global rope).
    "gemma3": (
        "gemma3_text",
        {"sliding_window": _WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # EmbeddingGemma: bidirectional; transformers' local window is then |i - j| <= W // 2.
    "gemma3-bidirectional": (
        "gemma3_text",
        {
            "sliding_window": _WINDOW,
            "layer_types": ["full_attention", "sliding_attention"],
            "use_bidirectional_attention": True,
        },
    ),
    # config.json as EmbeddingGemma ships it (transformers 4.x keys: rope_theta,
    # rope_local_base_freq, rope_scaling), with an odd window and the layer kinds given by
    # sliding_window_pattern instead of layer_types; rewritten in ``windowed_model``.
    "gemma3-legacy-config": (
        "gemma3_text",
        {"sliding_window": _WINDOW, "use_bidirectional_attention": True},
    ),
}
_LEGACY_GEMMA3_WINDOW = 7


@pytest.fixture(scope="session")
def windowed_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: a tiny decoder per ``_WINDOWED`` variant, built once per session."""

    def build(target: Path, variant: str) -> Path:
        model_type, overrides = _WINDOWED[variant]
        path = build_decoder(target, model_type, **overrides)
        config = json.loads((path / "config.json").read_text())
        if variant == "qwen2-max-window-layers":
            del config["layer_types"]  # transformers derives it from max_window_layers
            (path / "config.json").write_text(json.dumps(config))
        if variant == "gemma3-legacy-config":
            for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
                config.pop(key, None)
            config.update(
                sliding_window=_LEGACY_GEMMA3_WINDOW,
                sliding_window_pattern=2,  # layers: sliding, full
                rope_theta=10000.0,
                rope_local_base_freq=100.0,
                rope_scaling={"rope_type": "linear", "factor": 4.0},
            )
            (path / "config.json").write_text(json.dumps(config))
        return path

    return built_once(tmp_path_factory.mktemp("windowed-models"), build)


def _windowed_sequences(vocab_size: int) -> list[list[int]]:
    """Random ids ending in EOS: shorter than, equal to, one past, and far past the window
    (two of length 9 share a bucket)."""
    generator = torch.Generator().manual_seed(7)
    lens = [1, 4, _WINDOW, _WINDOW + 1, _WINDOW + 1, _WINDOW + 2, 16, 17, 33, 61]
    return [
        [*torch.randint(3, vocab_size, (n - 1,), generator=generator).tolist(), 2] for n in lens
    ]


@pytest.mark.parametrize(("kernel", "ratio"), KERNEL_RATIOS)
@pytest.mark.parametrize("variant", list(_WINDOWED))
def test_sliding_window_matches_transformers(
    windowed_model: Callable[[str], Path],
    variant: str,
    kernel: str,
    ratio: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One packed batch mixing inputs shorter and longer than the window: every token state
    and every last-token vector equals transformers running each input alone."""
    monkeypatch.setattr(attention, "_BUCKET_RATIO", ratio)
    path = windowed_model(variant)
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False, attention=kernel)
    seqs = _windowed_sequences(engine.info().vocab_size)
    expected = _reference_states(path, seqs)
    for seq, got, want in zip(seqs, engine.embed_tokens(seqs), expected, strict=True):
        assert got.shape == want.shape == (len(seq), engine.info().hidden_size)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    pooled = engine.embed(seqs)
    np.testing.assert_allclose(pooled, np.stack([s[-1] for s in expected]), atol=2e-5, rtol=1e-4)
    declared = json.loads((path / "config.json").read_text())["sliding_window"]
    assert engine.info().sliding_window == (None if variant == "qwen2-window-off" else declared)


def test_info_reports_no_window_for_full_attention_models(
    tiny_model: Callable[[str], Path],
) -> None:
    for model_type in ("bert", "llama"):
        engine = Engine.from_pretrained(str(tiny_model(model_type)), dtype="float32")
        assert engine.info().sliding_window is None


@pytest.mark.parametrize("ratio", [1.0, 0.5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0, 1, 3, 8, 16])
def test_windowed_bucketed_attention_equals_per_sequence(
    window: int, causal: bool, ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``window`` keys each side (flash-attn's window_size convention), per bucket."""
    monkeypatch.setattr(attention, "_BUCKET_RATIO", ratio)
    torch.manual_seed(0)
    lens = [1, 9, 3, 9, 17, 16, 2, 4, 4]
    total = sum(lens)
    q = torch.randn(total, 4, 8)
    k, v = torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    got = attention.varlen_attention(
        q, k, v, cu_seqlens=cu, max_seqlen=max(lens), causal=causal, window=window
    )
    want = _naive_attention(q, k, v, lens, causal, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_window_masks_only_the_buckets_it_can_bite(
    causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buckets no longer than the window + 1 keep the mask-free SDPA call."""
    calls: list[tuple[int, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((args[0].shape[2], kwargs.get("attn_mask") is not None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    lens = [2, 4, 4, 5, 6, 9]  # sorted like the runner packs them: contiguous buckets
    total = sum(lens)
    q, k, v = torch.randn(total, 2, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    attention.varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=9, causal=causal, window=4)
    assert sorted(calls) == [(2, False), (4, False), (5, False), (6, True), (9, True)]


@pytest.mark.parametrize(
    ("variant", "window_sizes"),
    [
        ("mistral", [(_WINDOW - 1, 0)] * 2),
        ("mistral-bidirectional", [(_WINDOW, _WINDOW)] * 2),
        ("qwen2-max-window-layers", [(-1, -1), (_WINDOW - 1, 0)]),
        ("qwen2-layer-types", [(_WINDOW - 1, 0), (-1, -1)]),
        ("qwen2-window-off", [(-1, -1)] * 2),
        ("gemma3", [(_WINDOW - 1, 0), (-1, -1)]),
        ("gemma3-bidirectional", [(-1, -1), (_WINDOW // 2, _WINDOW // 2)]),
        ("gemma3-legacy-config", [(_LEGACY_GEMMA3_WINDOW // 2,) * 2, (-1, -1)]),
    ],
)
def test_flash_attn_gets_the_sliding_window(
    windowed_model: Callable[[str], Path],
    variant: str,
    window_sizes: list[tuple[int, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sliding layers hand flash-attn the window as ``window_size=(left, right)``, with the
    boundary transformers uses; a batch the window cannot bite gets the plain call."""
    path = str(windowed_model(variant))
    plain = Engine.from_pretrained(path, dtype="bfloat16")
    seqs = _windowed_sequences(plain.info().vocab_size)
    baseline = plain.embed_tokens(seqs)
    cuda = pretend_cuda(monkeypatch)
    engine = Engine.from_pretrained(path, dtype="bfloat16")
    flashed = engine.embed_tokens(seqs)
    assert [call["window_size"] for call in cuda.flash.calls] == window_sizes
    assert_rows_close(flashed, baseline, min_cosine=BF16_COSINE)
    cuda.flash.calls.clear()
    reach = min((left for left, _ in window_sizes if left >= 0), default=_WINDOW)
    engine.embed_tokens([s for s in seqs if len(s) <= reach + 1])
    assert [call["window_size"] for call in cuda.flash.calls] == [(-1, -1)] * 2

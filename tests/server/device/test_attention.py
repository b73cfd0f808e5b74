"""Which attention kernel, dtype and device a server picks, and what it says about it.

The GPU paths cannot run here, so the facts of a GPU (compute capability, installed kernels)
are made up (:func:`tests.support.attention.pretend_cuda`) while the tensors stay on the CPU, and
the CUDA-only kernels are strict stand-ins that refuse what the real ones refuse.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.device import attention, dtypes
from embedding_server.device.attention import (
    AttentionFacts,
    Backend,
    plan_attention,
    select_backend,
)
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError

from tests.support.attention import (
    BF16_COSINE,
    StrictFlash,
    StrictTorchVarlen,
    assert_rows_close,
    pretend_cuda,
)
from tests.support.models import build_decoder


def _facts(
    device: str = "cuda",
    capability: tuple[int, int] | None = (9, 0),
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 64,
    flash: bool = True,
    torch_varlen: bool = True,
) -> AttentionFacts:
    return AttentionFacts(
        device_type=device,
        dtype=dtype,
        head_dim=head_dim,
        capability=capability if device == "cuda" else None,
        flash_attn_error=None if flash else "flash-attn is not installed",
        torch_varlen_error=None if torch_varlen else "torch 2.4.0 has no varlen_attn",
    )


@pytest.mark.parametrize(
    ("facts", "backend", "reasons"),
    [
        (_facts(), "flash_attn", []),
        (_facts(dtype=torch.float16, head_dim=256), "flash_attn", []),
        (_facts(flash=False), "torch_varlen", ["not installed"]),
        # T4 (sm75) and V100 (sm70): FlashAttention-2 kernels need Ampere.
        (_facts(capability=(7, 5), dtype=torch.float16), "sdpa_padded", ["7.5", "7.5"]),
        (_facts(capability=(7, 0), dtype=torch.float16), "sdpa_padded", ["7.0", "7.0"]),
        (_facts(dtype=torch.float32), "sdpa_padded", ["float32", "float32"]),
        (_facts(head_dim=512), "sdpa_padded", ["head_dim <= 256", "head_dim <= 256"]),
        (_facts(flash=False, torch_varlen=False), "sdpa_padded", ["not installed", "2.4.0"]),
        (_facts(device="cpu"), "sdpa_bucketed", []),
        (_facts(device="cpu", dtype=torch.float32), "sdpa_bucketed", []),
    ],
)
def test_auto_picks_the_fastest_kernel_the_gpu_can_run(
    facts: AttentionFacts, backend: str, reasons: list[str]
) -> None:
    choice = select_backend("auto", facts)
    assert choice.backend == backend
    assert len(choice.passed_over) == len(reasons)
    for said, expected in zip(choice.passed_over, reasons, strict=True):
        assert expected in said


@pytest.mark.parametrize(
    ("requested", "facts", "complaint"),
    [
        ("flash_attn", _facts(capability=(7, 5), dtype=torch.float16), "capability 8.0"),
        ("flash_attn", _facts(flash=False), "not installed"),
        ("flash_attn", _facts(device="cpu"), "needs CUDA"),
        ("torch_varlen", _facts(dtype=torch.float32), "float32"),
        ("torch_varlen", _facts(torch_varlen=False), "no varlen_attn"),
        ("torch_varlen", _facts(head_dim=320), "head_dim <= 256"),
    ],
)
def test_a_named_kernel_is_strict(requested: str, facts: AttentionFacts, complaint: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        select_backend(requested, facts)
    assert raised.value.param == "attention"
    assert f"attention={requested}" in raised.value.message
    assert complaint in raised.value.message


@pytest.mark.parametrize("requested", ["sdpa_padded", "sdpa_bucketed"])
def test_the_sdpa_kernels_run_anywhere(requested: str) -> None:
    for facts in (_facts(), _facts(device="cpu"), _facts(capability=(6, 0))):
        assert select_backend(requested, facts).backend == requested


def test_a_strict_kernel_the_cpu_cannot_run_stops_the_engine_from_loading(
    minilm_dir: Path,
) -> None:
    with pytest.raises(InvalidRequestError, match="attention=flash_attn cannot be used"):
        Engine.from_pretrained(str(minilm_dir), attention="flash_attn")


@pytest.mark.parametrize(
    ("capability", "dtype", "overflows", "expected"),
    [
        ((9, 0), "auto", None, torch.bfloat16),  # H100
        ((8, 0), "auto", None, torch.bfloat16),  # A100
        ((8, 9), "auto", None, torch.bfloat16),  # L4, L40S
        ((7, 5), "auto", None, torch.float16),  # T4: bf16 would be emulated
        ((7, 0), "auto", None, torch.float16),  # V100
        ((7, 5), "auto", "gemma3_text", torch.float32),  # fp16 overflows, no native bf16
        ((9, 0), "auto", "gemma3_text", torch.bfloat16),
        ((7, 5), "float32", None, torch.float32),
        ((7, 5), "bfloat16", None, torch.bfloat16),  # asked for: obeyed, with a warning
    ],
)
def test_auto_dtype_follows_the_target_gpu(
    capability: tuple[int, int], dtype: str, overflows: str | None, expected: torch.dtype
) -> None:
    cuda = torch.device("cuda", 1)  # not the current device: the capability passed is its own
    resolved = dtypes.resolve_dtype(
        dtype,  # type: ignore[arg-type]
        cuda,
        capability=capability,
        fp16_overflows=overflows,
    )
    assert resolved == expected


def test_emulated_bf16_on_an_old_gpu_is_called_out(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="embedding_server.device.dtypes"):
        dtypes.resolve_dtype("bfloat16", torch.device("cuda"), capability=(7, 5))
    assert any("emulated" in r.getMessage() and "7.5" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_float16_is_refused_for_a_model_it_overflows(device: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        dtypes.resolve_dtype(
            "float16", torch.device(device), capability=(9, 0), fp16_overflows="gemma3_text"
        )
    assert raised.value.param == "dtype"
    assert "gemma3_text" in raised.value.message and "overflow" in raised.value.message


def test_gemma3_refuses_float16_at_load(tmp_path: Path) -> None:
    path = build_decoder(tmp_path / "gemma3", "gemma3_text")
    with pytest.raises(InvalidRequestError, match="overflow float16") as raised:
        Engine.from_pretrained(str(path), dtype="float16")
    assert raised.value.param == "dtype"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without a usable GPU")
@pytest.mark.parametrize("setting", ["cuda", "cuda:0", "cuda:3"])
def test_a_gpu_asked_for_by_name_must_be_usable(setting: str) -> None:
    """What a GPU pod whose CUDA is broken sees: a start-up failure, not a silent CPU server."""
    with pytest.raises(InvalidRequestError) as raised:
        dtypes.resolve_device(setting)
    assert raised.value.param == "device"
    assert f"device={setting} was asked for" in raised.value.message
    assert "CUDA" in raised.value.message


def test_device_auto_and_nonsense() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert dtypes.resolve_device("auto").type == expected
    with pytest.raises(InvalidRequestError, match="is not a device") as raised:
        dtypes.resolve_device("gpu0")
    assert raised.value.param == "device"


def test_an_old_gpu_falls_back_to_padded_sdpa_and_says_why(
    tiny_model: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A T4 with flash-attn installed: the kernels are never called (they would crash), the
    padded path serves, and the log and /info say why."""
    path = str(tiny_model("qwen3"))
    reference = Engine.from_pretrained(path, dtype="float32")
    seqs = reference.tokenize(["one", "two words", "a longer input text than both"])
    cuda = pretend_cuda(monkeypatch, capability=(7, 5))
    with caplog.at_level(logging.WARNING, logger="embedding_server.engine"):
        engine = Engine.from_pretrained(path, dtype="float32")
    info = engine.info()
    assert info.attention == "sdpa_padded"
    assert [reason.split(":")[0] for reason in info.attention_passed_over] == [
        "flash_attn",
        "torch_varlen",
    ]
    assert all("7.5" in reason for reason in info.attention_passed_over)
    logged = [r.getMessage() for r in caplog.records]
    assert any("not using flash_attn" in m and "7.5" in m for m in logged)
    np.testing.assert_allclose(engine.embed(seqs), reference.embed(seqs), atol=1e-5)
    assert cuda.flash.calls == [] and cuda.torch_varlen.calls == []


def test_float32_on_an_ampere_gpu_never_reaches_the_half_precision_kernels(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = pretend_cuda(monkeypatch)
    engine = Engine.from_pretrained(str(tiny_model("bert")), dtype="float32")
    assert engine.info().attention == "sdpa_padded"
    engine.embed(engine.tokenize(["a", "bc def"]))
    assert cuda.flash.calls == [] and cuda.torch_varlen.calls == []


@pytest.mark.parametrize(
    ("model_type", "overrides", "window_size", "gqa"),
    [
        ("bert", {}, (-1, -1), False),
        ("qwen3", {}, (-1, 0), True),  # causal is window_size=(-1, 0); the tiny qwen3 is GQA
        ("mistral", {"sliding_window": 4}, (3, 0), True),
    ],
)
def test_torch_varlen_gets_causality_windows_and_gqa_as_its_signature_wants(
    tmp_path: Path,
    tiny_model: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    model_type: str,
    overrides: dict[str, int],
    window_size: tuple[int, int],
    gqa: bool,
) -> None:
    """An image without flash-attn on an Ampere+ GPU runs torch's own varlen kernel."""
    if overrides:
        path = str(build_decoder(tmp_path / model_type, model_type, **overrides))
    else:
        path = str(tiny_model(model_type))
    plain = Engine.from_pretrained(path, dtype="bfloat16")
    seqs = plain.tokenize(["a", "a bit longer", "the longest input of them all, by far"])
    baseline = plain.embed_tokens(seqs)
    cuda = pretend_cuda(monkeypatch, flash=False)
    engine = Engine.from_pretrained(path, dtype="bfloat16")
    assert engine.info().attention == "torch_varlen"
    assert engine.info().attention_passed_over == ["flash_attn: flash-attn is not installed"]
    assert_rows_close(engine.embed_tokens(seqs), baseline, min_cosine=BF16_COSINE)
    assert cuda.torch_varlen.calls, "torch's varlen kernel was never called"
    assert {c["window_size"] for c in cuda.torch_varlen.calls} == {window_size}
    assert {c["enable_gqa"] for c in cuda.torch_varlen.calls} == {gqa}


def test_the_flash_stand_in_refuses_what_flash_attn_refuses() -> None:
    """The stand-in is only worth its checks: a call flash-attn would reject fails here too."""
    flash = StrictFlash()
    q = torch.randn(6, 4, 16, dtype=torch.bfloat16)
    k = v = torch.randn(6, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert flash(q, k, v, cu, cu, 4, 4).shape == q.shape
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        flash(q.float(), k.float(), v.float(), cu, cu, 4, 4)
    with pytest.raises(RuntimeError, match="int32"):
        flash(q, k, v, cu.long(), cu.long(), 4, 4)
    with pytest.raises(RuntimeError, match="Python int"):
        flash(q, k, v, cu, cu, torch.tensor(4), torch.tensor(4))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        wide = torch.randn(6, 4, 32, dtype=torch.bfloat16)
        flash(wide[..., ::2], k, v, cu, cu, 4, 4)
    with pytest.raises(RuntimeError, match="at most 256"):
        big = torch.randn(6, 2, 320, dtype=torch.bfloat16)
        flash(big, big, big, cu, cu, 4, 4)


def test_padded_plan_is_one_call_with_indices_built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """sdpa_padded: one SDPA call per layer whatever the lengths, and no boolean indexing
    (a host sync on CUDA) when the output is scattered back."""
    lens = [3, 9, 1, 9, 5]
    plan = plan_attention(lens, torch.device("cpu"), Backend.SDPA_PADDED)
    assert len(plan.buckets) == 1
    bucket = plan.buckets[0]
    assert (bucket.count, bucket.length) == (5, 9)
    assert bucket.slots is not None and bucket.tokens is not None
    assert bucket.slots.dtype == bucket.tokens.dtype == torch.int64
    assert sorted(bucket.tokens.tolist()) == list(range(sum(lens)))

    def no_bool_index(self: torch.Tensor, index: object) -> torch.Tensor:
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            raise AssertionError("boolean indexing inside the layer loop")
        return original(self, index)

    original = torch.Tensor.__getitem__
    q, k, v = (torch.randn(sum(lens), 2, 8) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    monkeypatch.setattr(torch.Tensor, "__getitem__", no_bool_index)
    got = attention.varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=9, causal=False, plan=plan)
    monkeypatch.undo()
    want = attention.varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=9, causal=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_broken_flash_attn_install_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """flash-attn built against another torch fails to import: that is logged and becomes
    the reason auto passes it over, never a silent fallback."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    with caplog.at_level(logging.WARNING, logger="embedding_server.device.attention"):
        function, reason = attention._import_flash_attn()
    assert function is None
    assert reason is not None and "undefined symbol" in reason
    assert any("flash-attn failed to import" in r.getMessage() for r in caplog.records)
    choice = select_backend("auto", dataclasses.replace(_facts(), flash_attn_error=reason))
    assert choice.backend == "torch_varlen" and "undefined symbol" in choice.passed_over[0]


def test_a_cpu_engine_never_imports_the_cuda_kernels() -> None:
    """Importing the varlen kernels loads torch's compiler stack (seconds and ~85 MB in every
    process): a CPU server, and the front-ends of ``--api-workers``, which never run them,
    must start without it. A fresh interpreter, since this one's tests may have loaded it."""
    script = (
        "import sys\n"
        "from embedding_server.engine import Engine\n"
        "engine = Engine.from_pretrained('fake?max_len=16', device='cpu')\n"
        "print(engine.info().attention, sorted(m for m in sys.modules"
        " if m.startswith(('torch._dynamo', 'torch._inductor', 'flash_attn'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["sdpa_bucketed", "[]"], done.stdout


def _prefix_keys_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], key_lens: list[int]
) -> torch.Tensor:
    """What stanford-colbert's and PyLate's padded forward computes for a query padded with
    [MASK] under ``attention_mask`` 0 at those positions (their BERT/ModernBERT attention,
    eager or SDPA): every position is a query, only the first ``key_lens[i]`` are keys.
    Written out per sequence: float32 logits, the masked keys dropped, softmax, values."""
    out, start = [], 0
    for n, m in zip(lens, key_lens, strict=True):
        qs = q[start : start + n].float().transpose(0, 1)  # [H, n, D]
        ks, vs = (t[start : start + m].float().transpose(0, 1) for t in (k, v))
        weights = torch.softmax(qs @ ks.transpose(-1, -2) * qs.shape[-1] ** -0.5, dim=-1)
        out.append((weights @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


LENS = [5, 3, 7, 7, 2, 7]
KEY_LENS = [3, 3, 4, 7, 1, 2]


@pytest.mark.parametrize(
    "backend",
    [Backend.SDPA_BUCKETED, Backend.SDPA_PADDED, Backend.FLASH_ATTN, Backend.TORCH_VARLEN],
)
def test_keys_limited_to_a_prefix_are_all_a_query_sees(
    monkeypatch: pytest.MonkeyPatch, backend: Backend
) -> None:
    """ColBERT's query augmentation: the [MASK] tokens after a query are queries whose keys
    nobody sees. Each backend gives every token (the [MASK] ones too) attention over its
    sequence's key prefix only, in a packed batch of mixed lengths and prefixes; what sits in
    the masked keys and values changes nothing."""
    varlen = backend in (Backend.FLASH_ATTN, Backend.TORCH_VARLEN)
    flash, torch_varlen = StrictFlash(), StrictTorchVarlen()
    kernels = attention.VarlenKernels(flash, None, torch_varlen, None)
    monkeypatch.setattr(attention, "varlen_kernels", lambda: kernels)
    dtype = torch.bfloat16 if varlen else torch.float32
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(LENS), 4, 16, generator=generator, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(LENS).tolist()], dtype=torch.int32)
    plan = plan_attention(LENS, torch.device("cpu"), backend, key_lens=KEY_LENS)

    got = attention.varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=7, causal=False, plan=plan)

    want = _prefix_keys_reference(q, k, v, LENS, KEY_LENS)
    if varlen:
        assert_rows_close(got.float().flatten(1), want.flatten(1), min_cosine=0.999)
        calls = flash.calls if backend is Backend.FLASH_ATTN else torch_varlen.calls
        assert calls, f"{backend} was never called"
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Scramble the keys and values nobody may see: nothing moves.
    masked = torch.ones(sum(LENS), dtype=torch.bool)
    for start, m in zip(cu[:-1].tolist(), KEY_LENS, strict=True):
        masked[start : start + m] = False
    k2, v2 = k.clone(), v.clone()
    k2[masked], v2[masked] = k2[masked] * 7 + 3, v2[masked] - 5
    again = attention.varlen_attention(
        q, k2, v2, cu_seqlens=cu, max_seqlen=7, causal=False, plan=plan
    )
    torch.testing.assert_close(again, got)


@pytest.mark.parametrize("backend", [Backend.SDPA_BUCKETED, Backend.SDPA_PADDED])
def test_keys_limited_to_a_prefix_within_a_sliding_window(backend: Backend) -> None:
    """ModernBERT's local layers: a query sees the keys of its prefix within the window."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(LENS), 2, 8, generator=generator) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(LENS).tolist()], dtype=torch.int32)
    plan = plan_attention(LENS, torch.device("cpu"), backend, key_lens=KEY_LENS)
    window = 5  # the most queries after a sequence's last key (7 - 2), so each sees one
    got = attention.varlen_attention(
        q, k, v, cu_seqlens=cu, max_seqlen=7, causal=False, window=window, plan=plan
    )
    want, start = [], 0
    for n, m in zip(LENS, KEY_LENS, strict=True):
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        mask = ((i - j).abs() <= window) & (j < m)
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        want.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        start += n
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("backend", "causal", "window", "complaint"),
    [
        (Backend.SDPA_BUCKETED, True, None, "bidirectional"),
        (Backend.SDPA_BUCKETED, False, 4, "a query would see no key"),
        (Backend.FLASH_ATTN, False, 5, "need an SDPA kernel"),
        (Backend.TORCH_VARLEN, False, 5, "need an SDPA kernel"),
    ],
)
def test_keys_limited_to_a_prefix_refuse_what_the_kernel_would_get_wrong(
    backend: Backend, causal: bool, window: int | None, complaint: str
) -> None:
    """flash-attn aligns causal masks and windows to the end of a shorter key sequence, which
    is not the reference's mask, and a query with no key in its window has no defined
    softmax: such attention with a key prefix is refused."""
    q = k = v = torch.randn(sum(LENS), 2, 8)
    cu = torch.tensor([0, *np.cumsum(LENS).tolist()], dtype=torch.int32)
    plan = plan_attention(LENS, torch.device("cpu"), backend, key_lens=KEY_LENS)
    with pytest.raises(ValueError, match=complaint):
        attention.varlen_attention(
            q, k, v, cu_seqlens=cu, max_seqlen=7, causal=causal, window=window, plan=plan
        )


def test_key_lens_outside_a_sequence_are_refused() -> None:
    with pytest.raises(ValueError, match="between 1 and its length"):
        plan_attention([3, 2], torch.device("cpu"), key_lens=[3, 0])
    with pytest.raises(ValueError, match="between 1 and its length"):
        plan_attention([3, 2], torch.device("cpu"), key_lens=[4, 2])

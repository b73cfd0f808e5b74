"""MPNet and DeBERTa-v2/v3: the families whose attention logits carry position terms.

Tiny random models of each layout (``tests.support.models``) run as ONE packed batch of mixed
lengths, long enough that MPNet's buckets and DeBERTa's relative positions are clamped and
log-bucketed; every token state must match transformers running each sequence alone, in
float32 to 2e-5 (cosine >= 0.99999) and in bfloat16 to cosine >= 0.999 against float32
transformers; the classifier heads likewise. Also: all-mpnet-base-v2's sentence-transformers
pipeline, the SDPA-only kernel choice and what /info and the log say about it, the bias
plumbing of the attention function, the refusals, and the checkpoint tensors each family
leaves unread.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.device import attention
from embedding_server.device.attention import (
    AttentionFacts,
    AttentionPlan,
    Backend,
    PositionBias,
    plan_attention,
    select_backend,
)
from embedding_server.device.models import ARCHITECTURES, build_model
from embedding_server.device.weights import load_weights
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from transformers import (
    AutoModelForMaskedLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from tests.support import device_cases as cases
from tests.support.attention import assert_rows_close, pretend_cuda
from tests.support.device_cases import (
    assert_bfloat16_classifier_matches,
    assert_refused,
    assert_scores_are_sigmoid_logits,
    built_once,
    centered,
    eager_states,
    edited_copy,
)
from tests.support.models import (
    DEBERTA_VARIANTS,
    add_sentence_transformers,
    build_deberta,
    build_mpnet,
)
from tests.support.tasks import build_classifier

pytestmark = pytest.mark.timeout(300)


MODELS = ["mpnet", *DEBERTA_VARIANTS]
# Up to 200 tokens: past MPNet's 128-token bucket reach (its tiny model has 256 positions);
# DeBERTa's tiny models stop at 128, past their 16-position clamp and 8-bucket log range.
LENGTHS = [1, 2, 3, 5, 9, 9, 17, 40, 64, 96, 128, 200]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: a tiny body per ``MODELS`` entry, built once per module."""

    def build(target: Path, name: str) -> Path:
        return build_mpnet(target) if name == "mpnet" else build_deberta(target, name)

    return built_once(tmp_path_factory.mktemp("relative-attention"), build)


def _sequences(engine: Engine) -> list[list[int]]:
    """Random ids between the model's first and last special token, one of each length that
    fits; lengths 9 twice, so one bucket holds two sequences."""
    generator = torch.Generator().manual_seed(11)
    vocab, longest = engine.info().vocab_size, engine.info().max_input_tokens
    first, last = engine.tokenize("")[0]
    seqs = []
    for n in (n for n in LENGTHS if n <= longest):
        middle = torch.randint(4, vocab, (max(0, n - 2),), generator=generator).tolist()
        seqs.append([first, *middle, last][:n])
    return seqs


@pytest.mark.parametrize(
    ("kernel", "ratio"),
    [
        ("sdpa_bucketed", 1.0),  # exact-length buckets: the bias without a key mask
        ("sdpa_bucketed", 0.5),  # padded buckets: the bias with the padded keys masked
        ("sdpa_padded", 1.0),  # the whole batch padded to its longest
    ],
)
@pytest.mark.parametrize("name", MODELS)
def test_packed_batch_matches_transformers(
    model_dir: Callable[[str], Path],
    name: str,
    kernel: str,
    ratio: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(attention, "_BUCKET_RATIO", ratio)
    path = model_dir(name)
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False, attention=kernel)
    assert engine.info().attention == kernel
    seqs = _sequences(engine)
    assert max(len(s) for s in seqs) >= 128
    expected = eager_states(path, seqs)
    got = engine.embed_tokens(seqs)
    for seq, have, want in zip(seqs, got, expected, strict=True):
        assert have.shape == want.shape == (len(seq), engine.info().hidden_size)
        np.testing.assert_allclose(have, want, atol=2e-5, rtol=1e-4)
    assert_rows_close(got, expected, min_cosine=cases.F32_COSINE)


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_points_where_float32_transformers_does(
    model_dir: Callable[[str], Path], name: str
) -> None:
    path = model_dir(name)
    engine = Engine.from_pretrained(str(path), dtype="bfloat16", normalize=False)
    assert engine.info().dtype == "bfloat16"
    seqs = _sequences(engine)
    assert_rows_close(
        engine.embed_tokens(seqs), eager_states(path, seqs), min_cosine=cases.BF16_COSINE
    )


@pytest.mark.parametrize(
    ("dtype", "min_cosine"), [("float32", cases.F32_COSINE), ("bfloat16", 0.999)]
)
def test_mpnet_sentence_transformers_pipeline(
    model_dir: Callable[[str], Path], dtype: str, min_cosine: float
) -> None:
    """all-mpnet-base-v2's shape: mean pooling and Normalize, read from the saved pipeline,
    against sentence-transformers' own encode, with inputs past the 128-token bucket reach."""
    from sentence_transformers import SentenceTransformer

    path = add_sentence_transformers(model_dir("mpnet"), pooling="mean", max_seq_length=200)
    engine = Engine.from_pretrained(str(path), dtype=dtype)
    info = engine.info()
    assert (info.pooling, info.normalize, info.max_input_tokens) == ("mean", True, 200)
    texts = [*cases.TEXTS, "long input " * 40]
    expected = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)
    got = engine.embed(texts)
    if dtype == "float32":
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert_rows_close(got, expected, min_cosine=min_cosine)


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (family, num_labels, per_token=False, variant=None) -> a tiny classifier."""
    root = tmp_path_factory.mktemp("relative-classifiers")
    cache: dict[tuple[str, int, bool, str | None], Path] = {}

    def get(
        family: str, num_labels: int, per_token: bool = False, variant: str | None = None
    ) -> Path:
        key = (family, num_labels, per_token, variant)
        if key not in cache:
            overrides = DEBERTA_VARIANTS[variant] if variant else {}
            name = f"{family}-{num_labels}-{per_token}-{variant}"
            cache[key] = build_classifier(
                root / name, family, num_labels, per_token=per_token, **overrides
            )
        return cache[key]

    return get


@pytest.mark.parametrize("family", ["mpnet", "deberta-v2"])
def test_sequence_classifier_in_bfloat16(classifiers: Callable[..., Path], family: str) -> None:
    """The head (pooler, activation, classifier) on bfloat16 states: the logits point where
    float32 transformers' do (cosine of the centered logits, which softmax keeps)."""
    path = classifiers(family, 3)
    assert_bfloat16_classifier_matches(path, path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["mpnet", "deberta-v2"])
def test_token_classifier_in_both_dtypes(
    classifiers: Callable[..., Path], family: str, dtype: str
) -> None:
    path = classifiers(family, 4, per_token=True)
    engine = Engine.from_pretrained(str(path), dtype=dtype)
    assert engine.info().task == "token_classify"
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForTokenClassification.from_pretrained(str(path)).eval()
    limit = engine.info().max_input_tokens
    for text, probs in zip(cases.TEXTS, engine.token_classify(cases.TEXTS), strict=True):
        enc = tok(text, return_tensors="pt", truncation=True, max_length=limit)
        with torch.no_grad():
            logits = model(**enc).logits[0].numpy()
        assert probs.shape == logits.shape
        if dtype == "float32":
            np.testing.assert_allclose(
                probs, torch.softmax(torch.from_numpy(logits), -1), atol=1e-5
            )
        min_cosine = cases.F32_COSINE if dtype == "float32" else cases.BF16_COSINE
        assert_rows_close(centered(np.log(probs)), centered(logits), min_cosine=min_cosine)


def test_deberta_v2_cross_encoder_with_segment_ids_and_the_convolution(
    classifiers: Callable[..., Path],
) -> None:
    """DeBERTa-v2-xlarge's layout as a cross-encoder: pairs carry segment ids (type
    embeddings), and the first layer's convolution must not mix the two texts' neighbours
    with other pairs' in the packed batch."""
    path = classifiers("deberta-v2", 1, variant="deberta-v2-conv")
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert engine.info().task == "score"
    assert_scores_are_sigmoid_logits(engine, path)


# --- the kernel: SDPA only, and said ---------------------------------------------------------


def _facts(device: str = "cuda", bias: str | None = "a relative-position bias") -> AttentionFacts:
    return AttentionFacts(
        device_type=device,
        dtype=torch.bfloat16,
        head_dim=64,
        capability=(9, 0) if device == "cuda" else None,
        flash_attn_error=None,
        torch_varlen_error=None,
        bias=bias,
    )


def test_a_bias_rules_out_the_varlen_kernels_and_says_so() -> None:
    choice = select_backend("auto", _facts())
    assert choice.backend == "sdpa_padded"
    assert [r.split(":")[0] for r in choice.passed_over] == ["flash_attn", "torch_varlen"]
    assert all("a relative-position bias" in r for r in choice.passed_over)
    assert select_backend("auto", _facts(device="cpu")).backend == "sdpa_bucketed"
    assert select_backend("auto", _facts(bias=None)).backend == "flash_attn"  # others unchanged
    for named in ("sdpa_padded", "sdpa_bucketed"):
        assert select_backend(named, _facts()).backend == named
    for named in ("flash_attn", "torch_varlen"):
        with pytest.raises(InvalidRequestError, match="relative-position bias") as raised:
            select_backend(named, _facts())
        assert raised.value.param == "attention"


@pytest.mark.parametrize(
    ("name", "what"),
    [("mpnet", "relative-position bias"), ("deberta-v3", "disentangled position terms")],
)
def test_on_a_gpu_the_families_run_padded_sdpa_and_info_says_why(
    model_dir: Callable[[str], Path],
    name: str,
    what: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A GPU with flash-attn and torch's varlen kernel: neither is called (neither can add
    the bias), the padded SDPA path serves the same vectors, and /info and the start-up log
    name the reason; naming a varlen kernel fails the start."""
    path = str(model_dir(name))
    plain = Engine.from_pretrained(path, dtype="bfloat16", normalize=False)
    seqs = _sequences(plain)
    baseline = plain.embed_tokens(seqs)
    cuda = pretend_cuda(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="embedding_server.engine"):
        engine = Engine.from_pretrained(path, dtype="bfloat16", normalize=False)
    info = engine.info()
    assert info.attention == "sdpa_padded"
    assert [r.split(":")[0] for r in info.attention_passed_over] == ["flash_attn", "torch_varlen"]
    assert all(what in r for r in info.attention_passed_over)
    assert any(
        "not using flash_attn" in r.getMessage() and what in r.getMessage() for r in caplog.records
    )
    assert_rows_close(engine.embed_tokens(seqs), baseline, min_cosine=cases.BF16_COSINE)
    assert cuda.flash.calls == [] and cuda.torch_varlen.calls == []
    with pytest.raises(InvalidRequestError, match=f"attention=flash_attn cannot be used.*{what}"):
        Engine.from_pretrained(path, dtype="bfloat16", attention="flash_attn")


# --- the attention function's bias -----------------------------------------------------------


def _relative_table(heads: int, longest: int) -> tuple[Callable[[int], torch.Tensor], list[int]]:
    """A random bias of ``key - query`` per head (as MPNet's), and the lengths asked for."""
    values = torch.randn(heads, 2 * longest - 1, generator=torch.Generator().manual_seed(3))
    asked: list[int] = []

    def table(length: int) -> torch.Tensor:
        asked.append(length)
        pos = torch.arange(length)
        return values[:, pos.unsqueeze(0) - pos.unsqueeze(1) + longest - 1]

    return table, asked


@pytest.mark.parametrize(
    ("backend", "ratio"),
    [(Backend.SDPA_BUCKETED, 1.0), (Backend.SDPA_BUCKETED, 0.5), (Backend.SDPA_PADDED, 1.0)],
)
def test_a_position_bias_is_added_per_sequence_and_built_once_per_batch(
    backend: Backend, ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "_BUCKET_RATIO", ratio)
    torch.manual_seed(0)
    lens = [1, 3, 4, 4, 9, 16, 17]  # sorted, as the runner packs them
    total, heads = sum(lens), 4
    q, k, v = (torch.randn(total, heads, 8) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    table, asked = _relative_table(heads, max(lens))
    bias = PositionBias(table)
    plan = plan_attention(lens, torch.device("cpu"), backend)
    for _ in range(2):  # two layers of one batch
        got = attention.varlen_attention(
            q, k, v, cu_seqlens=cu, max_seqlen=max(lens), causal=False, plan=plan, bias=bias
        )
        out, start = [], 0
        for n in lens:
            qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
            out.append(
                F.scaled_dot_product_attention(qs, ks, vs, attn_mask=table(n)).transpose(0, 1)
            )
            start += n
        torch.testing.assert_close(got, torch.cat(out), atol=1e-5, rtol=1e-5)
    built = asked[: len(plan.buckets)]  # the reference's own calls come after
    assert sorted(built) == sorted(b.length for b in plan.buckets)
    assert len(asked) == len(plan.buckets) + 2 * len(lens)  # nothing rebuilt for layer two


def test_a_bias_is_refused_where_it_cannot_apply() -> None:
    q = k = v = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    table, _ = _relative_table(2, 4)
    bias = PositionBias(table)
    with pytest.raises(ValueError, match="bidirectional"):
        attention.varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=4, causal=True, bias=bias)
    with pytest.raises(ValueError, match="bidirectional"):
        attention.varlen_attention(
            q, k, v, cu_seqlens=cu, max_seqlen=4, causal=False, window=1, bias=bias
        )
    flash = AttentionPlan((), 6, torch.device("cpu"), Backend.FLASH_ATTN)
    with pytest.raises(ValueError, match="attention_bias"):
        attention.varlen_attention(
            q, k, v, cu_seqlens=cu, max_seqlen=4, causal=False, plan=flash, bias=bias
        )


# --- refusals and the tensors left unread ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "changes", "complaint"),
    [
        ("mpnet", {"relative_attention_num_buckets": 64}, "always uses 32 buckets"),
        ("deberta-v2-conv", {"conv_kernel_size": 2}, "even conv_kernel_size"),
        ("deberta-v3", {"attention_head_size": 4}, "attention_head_size=4"),
        ("deberta-v3", {"hidden_act": "gelu_10"}, "activation 'gelu_10'"),
    ],
)
def test_what_cannot_be_served_exactly_is_refused(
    model_dir: Callable[[str], Path],
    tmp_path: Path,
    name: str,
    changes: dict[str, Any],
    complaint: str,
) -> None:
    path = edited_copy(model_dir(name), tmp_path / "m", **changes)
    assert_refused(path, re.escape(complaint))


def test_an_unknown_pooler_activation_is_refused(
    classifiers: Callable[..., Path], tmp_path: Path
) -> None:
    path = edited_copy(classifiers("deberta-v2", 1), tmp_path / "m", pooler_hidden_act="gelu_new")
    with pytest.raises(UnsupportedModelError, match="pooler_hidden_act 'gelu_new'"):
        Engine.from_pretrained(str(path), dtype="float32")


class _Recording(dict[str, torch.Tensor]):
    """A checkpoint's tensors that remembers which were read."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(weights)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return super().__getitem__(name)


def _masked_lm(path: Path) -> Path:
    """The body's checkpoint saved again as ``*ForMaskedLM`` (an LM head beside it)."""
    AutoModelForMaskedLM.from_pretrained(str(path)).save_pretrained(str(path))
    return path


@pytest.mark.parametrize(
    ("name", "unread"),
    [
        ("mpnet", {"pooler.dense.weight", "pooler.dense.bias"}),
        (
            "mpnet-mlm",
            {f"lm_head.{n}" for n in ("dense.weight", "dense.bias", "layer_norm.weight")}
            | {"lm_head.layer_norm.bias", "lm_head.bias"},
        ),
        ("deberta-v3", set()),
        ("deberta-v2-conv", set()),
    ],
)
def test_unread_tensors_are_the_declared_ones(
    model_dir: Callable[[str], Path], tmp_path: Path, name: str, unread: set[str]
) -> None:
    """Building the body reads every tensor of the checkpoint but the ones its registry entry
    declares ignorable (each with a reason): nothing else is dropped on the floor."""
    if name == "mpnet-mlm":
        path = _masked_lm(shutil.copytree(model_dir("mpnet"), tmp_path / name))
    else:
        path = model_dir(name)
    config = json.loads((path / "config.json").read_text())
    weights = _Recording(dict(load_weights(path)))
    build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"))
    left = set(weights) - weights.read
    assert left == unread
    patterns = [re.compile(i.pattern) for i in ARCHITECTURES[config["model_type"]].ignored]
    assert all(i.reason for i in ARCHITECTURES[config["model_type"]].ignored)
    for tensor in left:
        assert any(p.fullmatch(tensor) for p in patterns), f"{tensor} is neither read nor ignored"

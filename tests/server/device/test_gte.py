"""Alibaba GTE "new" (gte-multilingual-base, gte-*-en-v1.5, stella_en_400M_v5, Snowflake's
arctic-embed-m-v2.0, the mGTE reranker), served natively.

Tiny random models in each config layout the Hub holds (``tests.support.gte``) run as ONE
packed batch of mixed lengths; every token state must match transformers' ``GteModel`` running
each sequence alone, in float32 to 2e-5 (cosine >= 0.99999) and in bfloat16 to cosine >= 0.999
against float32 transformers; the classifier heads likewise (``new.`` prefix, pooler +
classifier). Also: new-impl's fixed NTK rope scaling, each config value that would change the
math and is not implemented is refused, and the tensors a body leaves unread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.device.models import ARCHITECTURES, build_model, lookup
from embedding_server.device.weights import load_weights
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from transformers import (
    AutoModel,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from tests.support import device_cases as cases
from tests.support.attention import assert_rows_close
from tests.support.device_cases import (
    assert_bfloat16_classifier_matches,
    assert_refused,
    assert_scores_are_sigmoid_logits,
    edited_copy,
)
from tests.support.gte import GTE_VARIANTS, build_gte, reference_dir
from tests.support.models import add_sentence_transformers, rewrite_checkpoint

pytestmark = pytest.mark.timeout(300)


LENGTHS = [1, 2, 3, 5, 9, 9, 17, 40, 64, 96, 128, 200]
BODIES = [v for v in GTE_VARIANTS if not GTE_VARIANTS[v].segments]


@pytest.fixture(scope="module")
def gte_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (variant, head=None, num_labels=1) -> a tiny served checkpoint, built once."""
    root = tmp_path_factory.mktemp("gte")
    cache: dict[tuple[str, str | None, int], Path] = {}

    def get(variant: str, head: str | None = None, num_labels: int = 1) -> Path:
        key = (variant, head, num_labels)
        if key not in cache:
            name = f"{variant}-{head}-{num_labels}"
            cache[key] = build_gte(root / name, variant, head=head, num_labels=num_labels)
        return cache[key]

    return get


def _reference(path: Path) -> Path:
    """The transformers checkpoint ``path`` was rewritten from (itself when not rewritten)."""
    ref = reference_dir(path)
    return ref if ref.is_dir() and ref != path else path


def _sequences(engine: Engine) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    vocab, longest = engine.info().vocab_size, engine.info().max_input_tokens
    first, last = engine.tokenize("")[0]
    seqs = []
    for n in (n for n in LENGTHS if n <= longest):
        middle = torch.randint(4, vocab, (max(0, n - 2),), generator=generator).tolist()
        seqs.append([first, *middle, last][:n])
    return seqs


def _reference_states(path: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    model = AutoModel.from_pretrained(str(_reference(path)), attn_implementation="eager").eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s])).last_hidden_state[0].numpy() for s in seqs]


@pytest.mark.parametrize("kernel", ["sdpa_bucketed", "sdpa_padded"])
@pytest.mark.parametrize("variant", BODIES)
def test_packed_batch_matches_transformers(
    gte_dir: Callable[..., Path], variant: str, kernel: str
) -> None:
    path = gte_dir(variant)
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False, attention=kernel)
    info = engine.info()
    assert info.backend == "native" and info.pooling == "cls" and info.attention == kernel
    seqs = _sequences(engine)
    assert max(len(s) for s in seqs) == 200
    expected = _reference_states(path, seqs)
    got = engine.embed_tokens(seqs)
    for seq, have, want in zip(seqs, got, expected, strict=True):
        assert have.shape == want.shape == (len(seq), info.hidden_size)
        np.testing.assert_allclose(have, want, atol=2e-5, rtol=1e-4)
    assert_rows_close(got, expected, min_cosine=cases.F32_COSINE)


@pytest.mark.parametrize("variant", BODIES)
def test_bfloat16_points_where_float32_transformers_does(
    gte_dir: Callable[..., Path], variant: str
) -> None:
    path = gte_dir(variant)
    engine = Engine.from_pretrained(str(path), dtype="bfloat16", normalize=False)
    assert engine.info().dtype == "bfloat16"
    seqs = _sequences(engine)
    assert_rows_close(
        engine.embed_tokens(seqs), _reference_states(path, seqs), min_cosine=cases.BF16_COSINE
    )


@pytest.mark.parametrize(
    ("dtype", "min_cosine"), [("float32", cases.F32_COSINE), ("bfloat16", cases.BF16_COSINE)]
)
def test_sentence_transformers_pipeline(
    gte_dir: Callable[..., Path], dtype: str, min_cosine: float
) -> None:
    """gte-multilingual-base's pipeline: CLS pooling and Normalize, read from the saved
    modules, against sentence-transformers' own encode (transformers' gte layout, which it
    can load without remote code)."""
    from sentence_transformers import SentenceTransformer

    path = add_sentence_transformers(gte_dir("gte"), pooling="cls", max_seq_length=200)
    engine = Engine.from_pretrained(str(path), dtype=dtype)
    info = engine.info()
    assert (info.pooling, info.normalize, info.max_input_tokens) == ("cls", True, 200)
    texts = [*cases.TEXTS, "long input " * 40]
    expected = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)
    got = engine.embed(texts)
    if dtype == "float32":
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert_rows_close(got, expected, min_cosine=min_cosine)


def test_ntk_scaling_applies_from_the_first_position(gte_dir: Callable[..., Path]) -> None:
    """gte-base-en-v1.5's ``rope_scaling: {type: ntk}``: new-impl scales the frequencies for
    every input, however short; served unscaled (as if it took effect only past
    max_position_embeddings) the states would differ from the reference above."""
    path = gte_dir("new-ntk")
    config = json.loads((path / "config.json").read_text())
    assert config["rope_scaling"]["type"] == "ntk" and config["max_position_embeddings"] > 200
    weights = dict(load_weights(path))
    cpu = torch.device("cpu")
    scaled = build_model(config, weights, dtype=torch.float32, device=cpu)
    plain = build_model({**config, "rope_scaling": None}, weights, dtype=torch.float32, device=cpu)
    assert not torch.allclose(scaled.rotary.inv_freq, plain.rotary.inv_freq)  # type: ignore[attr-defined]
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False)
    seqs = _sequences(engine)
    assert_rows_close(
        engine.embed_tokens(seqs), _reference_states(path, seqs), min_cosine=cases.F32_COSINE
    )


def test_model_type_new_is_served_natively() -> None:
    """``new`` used to be refused naming NewModel; it is a registry entry now, CLS-pooled, as
    is transformers' and Snowflake's ``gte``."""
    for model_type, arch in (("new", "NewModel"), ("gte", "GteModel")):
        entry = lookup({"model_type": model_type, "architectures": [arch]})
        assert entry.default_pooling == "cls" and entry.classifier is not None


# --- classifier heads --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["new", "gte"])
def test_reranker_scores_pairs_as_transformers(gte_dir: Callable[..., Path], variant: str) -> None:
    """gte-multilingual-reranker-base's shape: NewForSequenceClassification, one label, the
    body under ``new.`` and its pooler before ``classifier`` (transformers' own layout too)."""
    path = gte_dir(variant, "sequence", 1)
    if variant == "new":
        names = json.loads((path / "config.json").read_text())["architectures"]
        assert names == ["NewForSequenceClassification"]
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert engine.info().task == "score"
    assert_scores_are_sigmoid_logits(engine, _reference(path))


@pytest.mark.parametrize("variant", ["gte-segments", "gte-one-segment"])
def test_pair_segment_ids(gte_dir: Callable[..., Path], variant: str) -> None:
    """A tokenizer that gives a pair's second text segment id 1: with two type rows each
    token reads its own; with one (gte-multilingual's table) every token reads row 0, where
    transformers would index past the table (on a GPU, a device-side assert)."""
    path = gte_dir(variant, "sequence", 1)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    pairs = list(zip(cases.QUERIES, cases.DOCS, strict=True))
    tok = AutoTokenizer.from_pretrained(str(_reference(path)))
    assert 1 in tok(*pairs[0], return_token_type_ids=True)["token_type_ids"]
    one = variant == "gte-one-segment"
    assert_scores_are_sigmoid_logits(engine, _reference(path), one_segment=one)


def test_sequence_classifier_in_bfloat16(gte_dir: Callable[..., Path]) -> None:
    path = gte_dir("new-ntk", "sequence", 3)
    assert_bfloat16_classifier_matches(path, _reference(path))


def test_token_classifier(gte_dir: Callable[..., Path]) -> None:
    path = gte_dir("new", "token", 4)
    engine = Engine.from_pretrained(str(path), dtype="float32")
    assert engine.info().task == "token_classify"
    ref = _reference(path)
    tok = AutoTokenizer.from_pretrained(str(ref))
    model = AutoModelForTokenClassification.from_pretrained(str(ref)).eval()
    for text, probs in zip(cases.TEXTS, engine.token_classify(cases.TEXTS), strict=True):
        with torch.no_grad():
            logits = model(**tok(text, return_tensors="pt")).logits[0]
        np.testing.assert_allclose(probs, torch.softmax(logits, -1).numpy(), atol=1e-5)


def test_a_sequence_classifier_without_its_pooler_is_refused(
    gte_dir: Callable[..., Path], tmp_path: Path
) -> None:
    src = gte_dir("new", "sequence", 1)
    path = rewrite_checkpoint(src, tmp_path / "m", rename=lambda n: None if ".pooler." in n else n)
    with pytest.raises(UnsupportedModelError, match=re.escape("new.pooler.dense")):
        Engine.from_pretrained(str(path), dtype="float32")


# --- refusals and the tensors left unread ------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "changes", "complaint"),
    [
        ("new", {"logn_attention_scale": True}, "logn_attention_scale: true"),
        ("new", {"logn_attention_clip1": True}, "logn_attention_clip1: true"),
        ("new", {"layer_norm_type": "rms_norm"}, "layer_norm_type='rms_norm'"),
        ("new", {"position_embedding_type": "absolute"}, "position_embedding_type='absolute'"),
        ("new", {"pack_qkv": False}, "pack_qkv: false"),
        ("new", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
        (
            "new-ntk",
            {"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}},
            "mixed_b=0.5",
        ),
        ("new-ntk", {"rope_scaling": {"type": "ntk", "factor": 0.5}}, "factor 0.5 below 1"),
        ("new", {"hidden_act": "gelu_10"}, "activation 'gelu_10'"),
        (
            "gte",
            {
                "rope_parameters": {
                    "rope_type": "dynamic",
                    "factor": 2.0,
                    "rope_theta": 1000.0,
                    "original_max_position_embeddings": 128,
                }
            },
            "original_max_position_embeddings=128",
        ),
        ("gte", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "'yarn'"),
    ],
)
def test_what_cannot_be_served_exactly_is_refused(
    gte_dir: Callable[..., Path],
    tmp_path: Path,
    variant: str,
    changes: dict[str, Any],
    complaint: str,
) -> None:
    path = edited_copy(gte_dir(variant), tmp_path / "m", **changes)
    assert_refused(path, re.escape(complaint))


def test_dynamic_rope_within_max_positions_is_the_default_rope(
    gte_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """transformers' ``dynamic`` rope changes nothing up to max_position_embeddings, the
    longest input the server runs: served as the default rope, it matches transformers."""
    src = gte_dir("gte")
    params = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 160000.0}
    path = edited_copy(src, tmp_path / "m", rope_parameters=params)
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False)
    seqs = _sequences(engine)
    model = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([s])).last_hidden_state[0].numpy() for s in seqs]
    assert_rows_close(engine.embed_tokens(seqs), expected, min_cosine=cases.F32_COSINE)


class _Recording(dict[str, torch.Tensor]):
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(weights)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return super().__getitem__(name)


def test_unread_tensors_are_the_declared_ones(gte_dir: Callable[..., Path], tmp_path: Path) -> None:
    """A NewModel saved with its pooler (add_pooling_layer) and a NewForMaskedLM head beside
    it: the body reads everything else, and what it leaves is declared, with a reason."""
    src = gte_dir("new")
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    extra = {
        "new.pooler.dense.weight": torch.zeros(hidden, hidden),
        "new.pooler.dense.bias": torch.zeros(hidden),
        "lm_head.dense.weight": torch.zeros(hidden, hidden),
        "lm_head.norm.weight": torch.ones(hidden),
    }
    path = rewrite_checkpoint(src, tmp_path / "m", rename=lambda n: "new." + n, add=extra)
    config = json.loads((path / "config.json").read_text())
    weights = _Recording(dict(load_weights(path)))
    build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"))
    left = set(weights) - weights.read
    assert left == set(extra)
    ignored = ARCHITECTURES["new"].ignored
    assert all(entry.reason for entry in ignored)
    for tensor in left:
        assert any(re.fullmatch(entry.pattern, tensor) for entry in ignored), tensor


def test_an_undeclared_tensor_is_refused(gte_dir: Callable[..., Path], tmp_path: Path) -> None:
    path = rewrite_checkpoint(
        gte_dir("new"), tmp_path / "m", add={"sparse_linear.weight": torch.zeros(1, 32)}
    )
    with pytest.raises(UnsupportedModelError, match=re.escape("sparse_linear.weight")):
        Engine.from_pretrained(str(path), dtype="float32")

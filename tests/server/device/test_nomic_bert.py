"""NomicBERT (nomic-embed-text-v1/v1.5, snowflake-arctic-embed-m-long) against transformers.

Tiny random ``NomicBertModel`` / ``NomicBertForSequenceClassification`` checkpoints are saved
by transformers (which writes the Hub's weight names: ``emb_ln``, ``encoder.layers.N.attn.Wqkv``,
``mlp.fc11`` ...) and their config.json rewritten into the Hub's GPT-2-style keys (``n_embd``,
``rotary_emb_base``, ``rotary_scaling_factor``, ``max_trained_positions`` ...); transformers
runs the native checkpoint as the reference, the engine the Hub-style one (and the native one).
One packed batch of mixed lengths must match transformers running each input alone: cosine
>= 0.99999 in float32 (and 2e-5 absolute), >= 0.999 in bfloat16, token states and the
mean-pooled vectors, and the heads of transformers' NomicBertFor* classes (sequence
classifier, cross-encoder pairs with segment ids, token classifier, a masked-LM checkpoint
embedding with its body). Dynamic NTK: transformers' ``dynamic`` rope implements NomicBERT's
formula (its trained length is the native config's ``max_position_embeddings``), so sequences
longer than a small ``max_trained_positions`` are checked against it; it keeps scaled
frequencies across calls, so each input runs on a freshly loaded reference.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.device.models.nomic_bert import ntk_base
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from tests.support import device_cases as cases
from tests.support.attention import assert_rows_close, pretend_cuda
from tests.support.models import MINILM_DIR, rewrite_checkpoint, spread_weights

pytest.importorskip("transformers.models.nomic_bert")
pytestmark = pytest.mark.timeout(300)


TRAINED = 16
"""The tiny models' ``max_trained_positions``: inputs beyond it are NTK-scaled."""
SERVED = 64
"""Their ``n_positions``: the longest input the engine admits."""
FACTOR = 2.0
LENGTHS = [1, 3, 9, TRAINED, TRAINED + 1, 23, 40, SERVED]
_BASE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": 30528,  # nomic's: the bert-base-uncased vocabulary padded to 64
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
}


def _save(
    path: Path, *, classes: int = 0, masked_lm: bool = False, token: bool = False, **overrides: Any
) -> Path:
    """A transformers-native NomicBERT at ``path`` (a classifier of ``classes`` labels when
    > 0), with the all-MiniLM WordPiece tokenizer (nomic's is bert-base-uncased's)."""
    path.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM_DIR / name, path / name)
    torch.manual_seed(29)
    extra = {"num_labels": classes} if classes else {}
    config = AutoConfig.for_model("nomic_bert", **{**_BASE, **overrides, **extra})
    auto = AutoModelForSequenceClassification if classes else AutoModel
    auto = AutoModelForMaskedLM if masked_lm else auto
    auto = AutoModelForTokenClassification if token else auto
    model = auto.from_config(config)
    spread_weights(model)
    model.save_pretrained(str(path))
    return path


def _hub_config(native: Mapping[str, Any], **hub: Any) -> dict[str, Any]:
    """``native``'s config.json as the Hub's nomic-embed configs spell it."""
    cfg = dict(native)
    rope = cfg.pop("rope_parameters")
    out = {
        k: v
        for k, v in cfg.items()
        if k
        not in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "layer_norm_eps",
            "hidden_act",
            "head_dim",
        )
    }
    out.update(
        n_embd=cfg["hidden_size"],
        n_layer=cfg["num_hidden_layers"],
        n_head=cfg["num_attention_heads"],
        n_inner=cfg["intermediate_size"],
        n_positions=SERVED,
        layer_norm_epsilon=cfg["layer_norm_eps"],
        activation_function="swiglu",
        rotary_emb_base=rope["rope_theta"],
        rotary_emb_fraction=1.0,
        rotary_emb_interleaved=False,
        rotary_emb_scale_base=None,
        rotary_scaling_factor=None,
        max_trained_positions=TRAINED,
        prenorm=False,
        causal=False,
        qkv_proj_bias=False,
        mlp_fc1_bias=False,
        mlp_fc2_bias=False,
        use_rms_norm=False,
        parallel_block=False,
        pad_vocab_size_multiple=64,
    )
    out.update(hub)
    return out


def _hub_copy(native: Path, dst: Path, **hub: Any) -> Path:
    shutil.copytree(native, dst)
    cfg = json.loads((native / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(_hub_config(cfg, **hub), indent=2))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served checkpoints and their references, by name.

    ``plain``: transformers-native, no scaling, 64 positions; ``hub``: the same weights under
    the Hub's keys without ``rotary_scaling_factor`` (v1's form); ``dynamic-ref``: the same
    weights with transformers' dynamic rope trained on 16 positions; ``hub-dynamic``: the
    Hub's ``rotary_scaling_factor: 2``, ``max_trained_positions: 16`` (v1.5's form);
    ``classifier`` / ``hub-classifier``: a 3-label sequence classifier, native and Hub;
    ``masked-lm``: NomicBertForMaskedLM (the body under ``nomic_bert.``, a ``cls.`` head);
    ``scorer`` / ``hub-scorer``: a one-label cross-encoder; ``token`` / ``hub-token``: a
    4-label token classifier."""
    root = tmp_path_factory.mktemp("nomic")
    plain = _save(root / "plain", max_position_embeddings=SERVED)
    dynamic = _save(
        root / "dynamic-ref",
        max_position_embeddings=TRAINED,
        rope_parameters={"rope_type": "dynamic", "factor": FACTOR, "rope_theta": 1000.0},
    )
    classifier = _save(root / "classifier", classes=3, max_position_embeddings=SERVED)
    masked_lm = _save(root / "masked-lm", masked_lm=True, max_position_embeddings=SERVED)
    scorer = _save(root / "scorer", classes=1, max_position_embeddings=SERVED)
    token = _save(root / "token", classes=4, token=True, max_position_embeddings=SERVED)
    return {
        "plain": plain,
        "hub": _hub_copy(plain, root / "hub"),
        "dynamic-ref": dynamic,
        "hub-dynamic": _hub_copy(plain, root / "hub-dynamic", rotary_scaling_factor=FACTOR),
        "classifier": classifier,
        "hub-classifier": _hub_copy(classifier, root / "hub-classifier"),
        "masked-lm": masked_lm,
        "scorer": scorer,
        "hub-scorer": _hub_copy(scorer, root / "hub-scorer"),
        "token": token,
        "hub-token": _hub_copy(token, root / "hub-token"),
    }


def _reference(path: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    """transformers' token states of each sequence alone, on a freshly loaded model each (its
    dynamic rope keeps the frequencies of the longest input it has seen)."""
    out = []
    for seq in seqs:
        model = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
        with torch.no_grad():
            out.append(model(input_ids=torch.tensor([seq])).last_hidden_state[0].numpy())
    return out


@pytest.mark.parametrize("kernel", ["sdpa_bucketed", "sdpa_padded"])
@pytest.mark.parametrize(("dtype", "min_cosine"), cases.DTYPES)
@pytest.mark.parametrize(
    ("served", "reference"),
    [("plain", "plain"), ("hub", "plain"), ("hub-dynamic", "dynamic-ref")],
)
def test_packed_batch_matches_transformers(
    models: dict[str, Path],
    served: str,
    reference: str,
    dtype: str,
    min_cosine: float,
    kernel: str,
) -> None:
    """Every token state of one packed batch (1 token up to n_positions, across the trained
    length) and every mean-pooled vector, as transformers computes each input alone: under
    native keys, under the Hub's, and with dynamic NTK beyond max_trained_positions; on
    both CPU attention kernels (exact-length buckets, the batch padded to its longest)."""
    engine = Engine.from_pretrained(
        str(models[served]), dtype=dtype, normalize=False, attention=kernel
    )
    info = engine.info()
    assert (info.model_type, info.pooling, info.hidden_size) == ("nomic_bert", "mean", 32)
    assert info.attention == kernel
    assert info.max_input_tokens == SERVED
    seqs = cases.bert_sequences(LENGTHS)
    expected = _reference(models[reference], seqs)
    cases.assert_states_and_means(engine, seqs, expected, min_cosine)


def test_a_masked_lm_checkpoint_embeds_with_its_body(models: dict[str, Path]) -> None:
    """NomicBertForMaskedLM: the body read under its ``nomic_bert.`` prefix, the ``cls.``
    head declared ignored (the fidelity guard would refuse it otherwise), mean-pooled
    vectors equal to transformers' NomicBertModel over the same checkpoint."""
    engine = Engine.from_pretrained(str(models["masked-lm"]), dtype="float32", normalize=False)
    assert (engine.info().task, engine.info().pooling) == ("embed", "mean")
    seqs = cases.bert_sequences([2, 17, 33])
    expected = _reference(models["masked-lm"], seqs)
    cases.assert_matches(
        engine.embed(seqs), np.stack([e.mean(0) for e in expected]), cases.F32_COSINE
    )


def test_flash_attn_matches_transformers(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU's flash-attn (the strict CPU stand-in), bfloat16: plain bidirectional calls
    over the packed rotated q/k, with dynamic NTK, giving transformers' states."""
    seqs = cases.bert_sequences(LENGTHS)
    expected = _reference(models["dynamic-ref"], seqs)
    cuda = pretend_cuda(monkeypatch)
    engine = Engine.from_pretrained(str(models["hub-dynamic"]), dtype="bfloat16")
    assert engine.info().attention == "flash_attn"
    got = engine.embed_tokens(seqs)
    assert len(cuda.flash.calls) == 2  # one per layer, the whole packed batch
    assert not any(c["causal"] for c in cuda.flash.calls)
    assert all(c["window_size"] == (-1, -1) for c in cuda.flash.calls)
    assert_rows_close(got, expected, min_cosine=cases.BF16_COSINE)


def test_dynamic_ntk_changes_only_sequences_beyond_the_trained_length(
    models: dict[str, Path],
) -> None:
    """The scaled model gives the unscaled one's states up to max_trained_positions and
    different ones beyond it (so the parity above checks the scaling, not its absence); a
    short text's vector does not depend on a long one batched with it."""
    plain = Engine.from_pretrained(str(models["hub"]), dtype="float32")
    scaled = Engine.from_pretrained(str(models["hub-dynamic"]), dtype="float32")
    short, long = cases.bert_sequences([TRAINED, 40])
    a, b = plain.embed([short, long]), scaled.embed([short, long])
    np.testing.assert_allclose(b[0], a[0], atol=1e-6)
    assert float(cases.cosines(b[1:], a[1:])[0]) < 0.9999
    np.testing.assert_allclose(scaled.embed([short])[0], b[0], atol=1e-6)


def test_ntk_base_is_nomics_formula() -> None:
    """base * (factor * L / trained - (factor - 1)) ** (d / (d - 2)) beyond the trained
    length, the base itself up to it; by hand for nomic-embed-text-v1.5's numbers."""
    assert ntk_base(1000.0, 2.0, 2048, 2048, 64) == 1000.0
    # L = 8192: 2 * 4 - 1 = 7, 7 ** (64 / 62) * 1000
    assert ntk_base(1000.0, 2.0, 2048, 8192, 64) == pytest.approx(1000.0 * 7 ** (64 / 62))
    assert ntk_base(1000.0, 2.0, 2048, 3072, 64) == pytest.approx(1000.0 * 2 ** (64 / 62))


@pytest.mark.parametrize(("dtype", "min_cosine"), cases.DTYPES)
@pytest.mark.parametrize("served", ["classifier", "hub-classifier"])
def test_sequence_classifier_matches_transformers(
    models: dict[str, Path], served: str, dtype: str, min_cosine: float
) -> None:
    """NomicBertForSequenceClassification: the pooler (dense + tanh on [CLS]) and
    ``classifier``, raw logits (task reward) and the classify task's probabilities."""
    seqs = cases.bert_sequences([1, 5, 30, SERVED])
    model = AutoModelForSequenceClassification.from_pretrained(
        str(models["classifier"]), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = np.stack([model(input_ids=torch.tensor([s])).logits[0].numpy() for s in seqs])
    rewards = Engine.from_pretrained(str(models[served]), dtype=dtype, task="reward")
    cases.assert_matches(np.stack([r[0] for r in rewards.reward(seqs)]), logits, min_cosine)
    engine = Engine.from_pretrained(str(models[served]), dtype=dtype)
    assert engine.info().task == "classify"
    probs = torch.softmax(torch.from_numpy(logits), -1).numpy()
    cases.assert_matches(engine.classify(seqs).probs, probs, min_cosine)


QUERIES = ["what is a fox?", "q", "where do cats sleep in the winter months?"]
DOCS = ["the fox is an animal", "d", "cats sleep anywhere warm " * 6]


@pytest.mark.parametrize("served", ["scorer", "hub-scorer"])
def test_cross_encoder_scores_match_transformers(models: dict[str, Path], served: str) -> None:
    """One label: task score, sigmoid over the logit of each (query, document) pair, the
    pair one sequence with its segment ids (token_type_embeddings row 1 for the document)."""
    tok = AutoTokenizer.from_pretrained(str(models["scorer"]))
    model = AutoModelForSequenceClassification.from_pretrained(
        str(models["scorer"]), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = np.array(
            [
                model(**tok(q, d, return_tensors="pt")).logits[0, 0].item()
                for q, d in zip(QUERIES, DOCS, strict=True)
            ]
        )
    for dtype, min_cosine in cases.DTYPES:
        engine = Engine.from_pretrained(str(models[served]), dtype=dtype)
        assert engine.info().task == "score"
        scores = engine.score(QUERIES, DOCS)
        cases.assert_matches(np.log(scores / (1 - scores)), logits, min_cosine)
        if dtype == "float32":
            np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits)), atol=1e-5)


@pytest.mark.parametrize("served", ["token", "hub-token"])
def test_token_classifier_matches_transformers(models: dict[str, Path], served: str) -> None:
    """NomicBertForTokenClassification: ``classifier`` on every token's state, each
    token's label probabilities."""
    seqs = cases.bert_sequences([1, 9, 30])
    model = AutoModelForTokenClassification.from_pretrained(
        str(models["token"]), attn_implementation="eager"
    ).eval()
    for dtype, min_cosine in cases.DTYPES:
        engine = Engine.from_pretrained(str(models[served]), dtype=dtype)
        assert engine.info().task == "token_classify"
        for seq, probs in zip(seqs, engine.token_classify(seqs), strict=True):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq])).logits[0]
            cases.assert_matches(probs, torch.softmax(logits, -1).numpy(), min_cosine)


def test_two_ranks_give_the_vectors_of_one(models: dict[str, Path]) -> None:
    """Tensor parallelism: 2 of the 4 heads and half the SwiGLU on each rank (Wqkv split per
    q/k/v block, fc11/fc12 by rows, out_proj/fc2 by columns), dynamic NTK included."""
    cases.assert_two_ranks_give_the_states_of_one(
        models["hub-dynamic"], cases.bert_sequences([3, 40, 9])
    )


_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"prenorm": True}, "prenorm"),
    ({"rotary_emb_fraction": 0.5}, "rotary_emb_fraction=0.5"),
    ({"rotary_emb_interleaved": True}, "rotary_emb_interleaved"),
    ({"moe_every_n_layers": 2}, "without num_experts and moe_top_k"),
    ({"num_experts": 8}, "without moe_every_n_layers"),
    (
        {"moe_every_n_layers": 2, "num_experts": 8, "moe_top_k": 2, "num_shared_experts": 1},
        "shared experts",
    ),
    # Served where the checkpoint has them (test_nomic_moe.py); here the weights lack them.
    ({"qkv_proj_bias": True}, "attn.Wqkv.bias"),
    ({"mlp_fc1_bias": True}, "mlp_fc1_bias: true on the gated MLP"),
    ({"use_rms_norm": True}, "RMSNorm"),
    ({"rotary_emb_scale_base": 512}, "xPos"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
]


@pytest.mark.parametrize(("config", "named"), _REFUSALS)
def test_what_is_not_served_exactly_is_refused(
    models: dict[str, Path], tmp_path: Path, config: dict[str, Any], named: str
) -> None:
    """Each config value we cannot serve exactly refuses the load, naming the model type and
    the value."""
    path = _hub_copy(models["plain"], tmp_path / "m", **config)
    with pytest.raises(UnsupportedModelError, match="nomic_bert") as err:
        Engine.from_pretrained(str(path), dtype="float32")
    assert named in str(err.value)


def test_a_rope_type_we_do_not_implement_is_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A native config with a rope scaling other than dynamic NTK names it."""
    dst = tmp_path / "m"
    shutil.copytree(models["plain"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1000.0}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn'"):
        Engine.from_pretrained(str(dst), dtype="float32")


def test_a_stray_tensor_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    """A bias the config does not declare (a checkpoint with biases under a config that
    says none) is a tensor no reader claims: the fidelity guard refuses it by name."""
    bias = torch.zeros(96)
    path = rewrite_checkpoint(
        models["hub"], tmp_path / "m", add={"encoder.layers.0.attn.Wqkv.bias": bias}
    )
    with pytest.raises(UnsupportedModelError, match=re.escape("encoder.layers.0.attn.Wqkv.bias")):
        Engine.from_pretrained(str(path), dtype="float32")


def test_an_moe_we_cannot_serve_is_refused_before_any_weight_is_read(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Renormalized expert weights (not nomic-embed-text-v2-moe's routing) are refused from
    config.json alone: the weights are never fetched (here: there are none)."""
    path = _hub_copy(
        models["plain"],
        tmp_path / "m",
        moe_every_n_layers=2,
        num_experts=8,
        moe_top_k=2,
        moe_normalize_expert_weights=1.0,
    )
    (path / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="moe_normalize_expert_weights"):
        Engine.from_pretrained(str(path), dtype="float32")

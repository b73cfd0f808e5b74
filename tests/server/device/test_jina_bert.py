"""JinaBERT v2 (jina-embeddings-v2-*, ALiBi + GeGLU) against an eager reference.

transformers has no JinaBERT: the reference is written in the test from the published
architecture (``tests/support/jina_bert.py``: jina-bert-implementation's and
jina-bert-v2-qk-post-norm's ``modeling_bert.py``, one unpadded sequence at a time, with
their ALiBi tensor and slopes written out again). Tiny random checkpoints are saved as the Hub
ships them (``model_type: bert``, ``position_embedding_type: alibi``, jina's ``auto_map``,
bare tensor names). One packed batch of mixed lengths must match the reference run on each
input alone: cosine >= 0.99999 (and 2e-5 absolute) in float32, >= 0.999 in bfloat16, token
states and the mean-pooled vectors, on both CPU attention kernels and on flash-attn (the
strict stand-in, given ALiBi slopes); two tensor-parallel ranks give one rank's vectors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.device.attention import AttentionFacts, Backend, select_backend
from embedding_server.device.models.jina_bert import alibi_slopes
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tests.support import device_cases as cases
from tests.support.attention import assert_rows_close, pretend_cuda
from tests.support.jina_bert import POSITIONS, build_jina_bert, config_of, reference
from tests.support.models import rewrite_checkpoint

pytestmark = pytest.mark.timeout(300)


LENGTHS = [1, 3, 9, 9, 17, 40, POSITIONS]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``v2``: jina-bert-implementation's layout, 6 heads; ``code``: jina-bert-v2-qk-post-norm's
    (jina-embeddings-v2-base-code), 4 heads."""
    root = tmp_path_factory.mktemp("jina")
    return {name: build_jina_bert(root / name, name) for name in ("v2", "code")}


def _expected(path: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    weights = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    with torch.no_grad():
        return [reference(weights, config, seq).numpy() for seq in seqs]


@pytest.mark.parametrize("kernel", ["sdpa_bucketed", "sdpa_padded"])
@pytest.mark.parametrize(("dtype", "min_cosine"), cases.DTYPES)
@pytest.mark.parametrize("variant", ["v2", "code"])
def test_packed_batch_matches_the_published_architecture(
    models: dict[str, Path], variant: str, dtype: str, min_cosine: float, kernel: str
) -> None:
    """Every token state of one packed batch (1 token up to max_position_embeddings, two
    of equal length) and every mean-pooled vector, as the published model computes each
    input alone; served natively (jina's auto_map is not run), mean-pooled as its config's
    emb_pooler says, on both CPU attention kernels."""
    engine = Engine.from_pretrained(
        str(models[variant]), dtype=dtype, normalize=False, attention=kernel
    )
    info = engine.info()
    assert (info.model_type, info.backend, info.pooling) == ("bert", "native", "mean")
    assert info.attention == kernel
    assert info.max_input_tokens == POSITIONS
    seqs = cases.bert_sequences(LENGTHS)
    expected = _expected(models[variant], seqs)
    cases.assert_states_and_means(engine, seqs, expected, min_cosine)


def test_the_bias_orders_the_tokens_symmetrically(models: dict[str, Path]) -> None:
    """ALiBi is all that orders the tokens (there is no position table), so the parity above
    checks the bias and not its absence: shuffled, each token gets another state (attention
    without positions would give the same, permuted); reversed, the same state mirrored
    (the bias depends on |i - j| only, both ways)."""
    engine = Engine.from_pretrained(str(models["v2"]), dtype="float32", normalize=False)
    seq = cases.bert_sequences([12])[0]
    order = [0, 5, 2, 9, 1, 7, 3, 10, 4, 8, 6, 11]
    forward, shuffled, backward = engine.embed_tokens([seq, [seq[i] for i in order], seq[::-1]])
    assert float(cases.cosines(shuffled, forward[order]).min()) < 0.99
    np.testing.assert_allclose(backward[::-1], forward, atol=2e-5)


@pytest.mark.parametrize("variant", ["v2", "code"])
def test_flash_attn_takes_the_alibi_slopes(
    models: dict[str, Path], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU with flash-attn (the strict stand-in), bfloat16: one call per layer over the
    whole packed batch, given the slopes of every head (float32), giving the reference's
    states; torch_varlen, which takes no ALiBi, is passed over with the reason."""
    seqs = cases.bert_sequences(LENGTHS)
    expected = _expected(models[variant], seqs)
    cuda = pretend_cuda(monkeypatch)
    engine = Engine.from_pretrained(str(models[variant]), dtype="bfloat16")
    heads = config_of(variant)["num_attention_heads"]
    assert engine.info().attention == "flash_attn"
    got = engine.embed_tokens(seqs)
    assert len(cuda.flash.calls) == 2  # one per layer, the whole packed batch
    for call in cuda.flash.calls:
        assert not call["causal"] and call["window_size"] == (-1, -1)
        torch.testing.assert_close(
            call["alibi_slopes"], torch.tensor(alibi_slopes(heads), dtype=torch.float32)
        )
    assert cuda.torch_varlen.calls == []
    assert_rows_close(got, expected, min_cosine=cases.BF16_COSINE)


def test_without_flash_attn_the_sdpa_kernel_serves_and_says_why(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU without flash-attn: torch_varlen cannot add ALiBi, so the padded SDPA kernel
    serves and /info names why; naming torch_varlen fails the start."""
    pretend_cuda(monkeypatch, flash=False)
    engine = Engine.from_pretrained(str(models["v2"]), dtype="bfloat16")
    info = engine.info()
    assert info.attention == "sdpa_padded"
    assert any(r.startswith("torch_varlen:") and "ALiBi" in r for r in info.attention_passed_over)
    with pytest.raises(InvalidRequestError, match="ALiBi"):
        Engine.from_pretrained(str(models["v2"]), dtype="bfloat16", attention="torch_varlen")


def test_a_flash_attn_without_alibi_slopes_is_passed_over() -> None:
    """flash-attn before 2.4 has no alibi_slopes: the facts say so and SDPA serves."""

    def old_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q

    from embedding_server.device.attention import flash_alibi_error

    reason = flash_alibi_error(old_flash)
    assert reason is not None and "alibi_slopes" in reason
    facts = AttentionFacts(
        device_type="cuda",
        dtype=torch.bfloat16,
        head_dim=64,
        capability=(9, 0),
        flash_attn_error=reason,
        torch_varlen_error=None,
        alibi=True,
    )
    choice = select_backend("auto", facts)
    assert choice.backend is Backend.SDPA_PADDED
    assert [r.split(":")[0] for r in choice.passed_over] == ["flash_attn", "torch_varlen"]


def test_the_slopes_are_the_alibi_papers() -> None:
    """Powers of two: 2^(-8/n), 2^(-16/n) ... (8 heads: 1/2 ... 1/256). Otherwise the
    nearest power of two's, then every other slope of twice that power (12 heads,
    jina-v2-base: 8 heads' slopes, then the 16 heads' 1st, 3rd, 5th, 7th)."""
    assert alibi_slopes(8) == pytest.approx([2.0**-i for i in range(1, 9)])
    sixteen = [2.0 ** (-i / 2) for i in range(1, 17)]
    assert alibi_slopes(12) == pytest.approx([2.0**-i for i in range(1, 9)] + sixteen[0:8:2])


def test_a_masked_lm_checkpoint_embeds_with_its_body(tmp_path: Path) -> None:
    """JinaBertForMaskedLM: the body under ``bert.``, the ``cls.`` head declared ignored,
    mean-pooled vectors equal to the reference body's."""
    path = build_jina_bert(tmp_path / "mlm", "v2", head="masked_lm")
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False)
    assert (engine.info().task, engine.info().pooling) == ("embed", "mean")
    seqs = cases.bert_sequences([2, 17, 33])
    expected = np.stack([e.mean(0) for e in _expected(path, seqs)])
    cases.assert_matches(engine.embed(seqs), expected, cases.F32_COSINE)


QUERIES = ["what is a fox?", "q", "where do cats sleep in the winter months?"]
DOCS = ["the fox is an animal", "d", "cats sleep anywhere warm " * 6]


def test_cross_encoder_scores_match_the_published_architecture(tmp_path: Path) -> None:
    """JinaBertForSequenceClassification (jina-reranker-v1's kind), one label: BERT's
    pooler (dense + tanh on [CLS]) and ``classifier`` over the JinaBERT body, each (query,
    document) pair one sequence with its segment ids, sigmoid of the logit."""
    path = build_jina_bert(tmp_path / "scorer", "v2", head="score")
    tok = AutoTokenizer.from_pretrained(str(path))
    weights = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    logits = []
    with torch.no_grad():
        for q, d in zip(QUERIES, DOCS, strict=True):
            enc = tok(q, d)
            states = reference(weights, config, enc["input_ids"], enc["token_type_ids"])
            pooled = torch.tanh(
                F.linear(
                    states[0],
                    weights["bert.pooler.dense.weight"],
                    weights["bert.pooler.dense.bias"],
                )
            )
            logits.append(
                float(F.linear(pooled, weights["classifier.weight"], weights["classifier.bias"]))
            )
    want = np.array(logits)
    for dtype, min_cosine in cases.DTYPES:
        engine = Engine.from_pretrained(str(path), dtype=dtype)
        assert engine.info().task == "score"
        scores = engine.score(QUERIES, DOCS)
        cases.assert_matches(np.log(scores / (1 - scores)), want, min_cosine)
        if dtype == "float32":
            np.testing.assert_allclose(scores, 1 / (1 + np.exp(-want)), atol=1e-5)


def test_two_ranks_give_the_vectors_of_one(models: dict[str, Path]) -> None:
    """Tensor parallelism: 3 of the 6 heads (with their slopes) and half of each GeGLU half
    on each rank, out and wo by columns."""
    cases.assert_two_ranks_give_the_states_of_one(models["v2"], cases.bert_sequences([3, 40, 9]))


def test_the_code_model_is_refused_under_tensor_parallelism(models: dict[str, Path]) -> None:
    """jina-embeddings-v2-base-code LayerNorms q and k over all heads: a rank with half of
    them cannot, so it is refused by name rather than computed wrongly."""
    with pytest.raises(UnsupportedModelError, match="layer_norm_q"):
        Engine.from_pretrained(str(models["code"]), dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
        ({"feed_forward_type": "original"}, "feed_forward_type='original'"),
        ({"feed_forward_type": None}, "states no feed_forward_type"),
    ],
)
def test_what_is_not_served_exactly_is_refused_before_the_weights(
    models: dict[str, Path], tmp_path: Path, config: dict[str, str | None], named: str
) -> None:
    """From config.json alone (the weights are never read: here there are none): another
    position type, an MLP that is not gated, a config that does not say which."""
    path = rewrite_checkpoint(models["v2"], tmp_path / "m", config=config)
    (path / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        Engine.from_pretrained(str(path), dtype="float32")


def test_an_unknown_mlp_layout_and_a_stray_tensor_are_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """BERT's ungated MLP names under an ALiBi config, and a tensor no reader claims."""
    plain = rewrite_checkpoint(
        models["v2"],
        tmp_path / "plain",
        rename=lambda n: n.replace("mlp.gated_layers", "intermediate.dense"),
    )
    with pytest.raises(UnsupportedModelError, match="gated_layers"):
        Engine.from_pretrained(str(plain), dtype="float32")
    stray = rewrite_checkpoint(
        models["v2"],
        tmp_path / "stray",
        add={"encoder.layer.0.mlp.gated_layers.bias": torch.zeros(80)},
    )
    with pytest.raises(UnsupportedModelError, match=re.escape("mlp.gated_layers.bias")):
        Engine.from_pretrained(str(stray), dtype="float32")

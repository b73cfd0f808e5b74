"""Generative yes/no rerankers (Qwen3-Reranker) served with task score.

A tiny random ``Qwen3ForCausalLM`` with a tokenizer holding Qwen's chat tokens and the answer
tokens "yes" and "no" stands in for Qwen3-Reranker. The reference is its model card's code
run on transformers' full model: each pair formatted with the published prompt (prefix
token ids, the pair text's ids cut to fit, suffix ids), the last position's next-token
logits for "no" and "yes", ``log_softmax`` then ``exp`` of "yes". Our ``/score`` and
``/rerank`` (packed batches, only the two LM-head rows) must give the same P(yes) in float32
and within bfloat16's precision; families without a reranker prompt are refused, and task
auto still refuses the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from embedding_server.device.loading import load_model
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from embedding_server.request.heads import QWEN3_RERANKER
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support import device_cases as cases
from tests.support.models import (
    _DECODER,
    _save_model,
    _save_tokenizer,
    build_decoder,
    byte_tokenizer,
)

CPU = torch.device("cpu")

QUERIES, DOCS = cases.RERANK_QUERIES, cases.RERANK_DOCS
BF16_ATOL = 0.01  # P(yes) in [0, 1]: bfloat16 keeps about 3 significant digits


def build_reranker(path: Path, model_type: str = "qwen3", **overrides: object) -> Path:
    """A 2-layer ``*ForCausalLM`` whose tokenizer knows ``<|im_start|>``, ``<|im_end|>`` and
    the answer tokens, adding no special tokens of its own (as Qwen's does not)."""
    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"], "$A", [])
    tok.add_tokens(["yes", "no"])
    _save_tokenizer(tok, path, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    extra: dict[str, object] = {"pad_token_id": 0, "eos_token_id": 2}
    if model_type == "qwen3":
        extra["head_dim"] = 16
    _save_model(
        model_type,
        path,
        tok.get_vocab_size(with_added_tokens=True),
        seed=5,
        auto=AutoModelForCausalLM,
        **{
            **_DECODER,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
            **extra,
            **overrides,
        },
    )
    return path


def calibrate(path: Path) -> Path:
    """Set the "yes" row of ``path``'s LM head so that P(yes) spreads over (0, 1) for the
    test pairs: a random head saturates (every pair's last state is mostly the shared
    prompt's), and saturated scores could not tell a wrong pair from a right one. A tied
    head is the embedding table: its row is set there (the prompt's own "yes" reads it too;
    the reference is run on the saved result, so that only moves the spread)."""
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    states = []
    for query, doc in zip(QUERIES, DOCS, strict=True):
        text = QWEN3_RERANKER.text(query, doc) + QWEN3_RERANKER.suffix
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            states.append(model.model(ids).last_hidden_state[0, -1])
    h = torch.stack(states)
    mean = h.mean(0)
    step = h[1] - h[0]
    direction = step - (step @ mean) / (mean @ mean) * mean  # no offset: centred on zero
    direction *= 3.0 / ((h[1] - h[0]) @ direction)
    tensors = load_file(str(path / "model.safetensors"))
    name = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    head = tensors[name]
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    head[yes] = head[no] + direction
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibrate(build_reranker(tmp_path_factory.mktemp("qwen3-reranker") / "qwen3"))


def model_card_scores(
    path: Path,
    pairs: list[tuple[str, str]],
    max_length: int,
    instruction: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> np.ndarray:
    """Qwen3-Reranker's model card computation on transformers' full model."""
    t = QWEN3_RERANKER
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    prefix = tok.encode(t.prefix, add_special_tokens=False)
    suffix = tok.encode(t.suffix, add_special_tokens=False)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    given = t.instruction if instruction is None else instruction
    out = []
    for query, doc in pairs:
        body = f"<Instruct>: {given}\n<Query>: {query}\n<Document>: {doc}"
        ids = tok.encode(body, add_special_tokens=False)[: max_length - len(prefix) - len(suffix)]
        with torch.no_grad():
            logits = model(torch.tensor([prefix + ids + suffix])).logits[0, -1]
        pair = torch.log_softmax(torch.stack([logits[no], logits[yes]]).float(), dim=0)
        out.append(pair[1].exp().item())
    return np.asarray(out)


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-5), ("bfloat16", BF16_ATOL)])
def test_score_and_rerank_are_the_model_cards_p_yes(
    reranker: Path, dtype: str, atol: float
) -> None:
    """Against the model card's code on transformers in the same dtype (in bfloat16 the two
    round differently: the tolerance is bfloat16's), in one packed batch of mixed lengths;
    /rerank orders the documents as float32 transformers does."""
    engine = Engine.from_pretrained(str(reranker), task="score", dtype=dtype)
    assert (engine.info().task, engine.info().dtype) == ("score", dtype)
    torch_dtype = getattr(torch, dtype)
    pairs = list(zip(QUERIES, DOCS, strict=True))
    expected = model_card_scores(reranker, pairs, 1024, dtype=torch_dtype)
    assert expected.std() > 0.1  # the pairs score differently: the check can tell them apart
    np.testing.assert_allclose(engine.score(QUERIES, DOCS), expected, atol=atol)
    ranked = engine.rerank(QUERIES[0], DOCS)
    against = model_card_scores(reranker, [(QUERIES[0], d) for d in DOCS], 1024, dtype=torch_dtype)
    order = np.argsort(-model_card_scores(reranker, [(QUERIES[0], d) for d in DOCS], 1024))
    assert [r.index for r in ranked.results] == list(order)
    np.testing.assert_allclose(
        [r.score for r in ranked.results], against[[r.index for r in ranked.results]], atol=atol
    )


def test_prompt_replaces_the_instruction_and_truncation_keeps_the_suffix(
    reranker: Path,
) -> None:
    """``prompt`` is the Instruct line; an over-long pair is cut at the end of its document,
    never in the suffix the answer follows, and refused when truncation is off or left."""
    engine = Engine.from_pretrained(str(reranker), task="score", dtype="float32", max_model_len=300)
    instruction = "Judge cat facts"
    pairs = list(zip(QUERIES, DOCS, strict=True))
    np.testing.assert_allclose(
        engine.score(QUERIES, DOCS, prompt=instruction),
        model_card_scores(reranker, pairs, 300, instruction),
        atol=1e-5,
    )
    long_doc = "cats sleep anywhere warm. " * 20
    assert len(long_doc) > 300
    np.testing.assert_allclose(
        engine.score([QUERIES[0]], [long_doc]),
        model_card_scores(reranker, [(QUERIES[0], long_doc)], 300),
        atol=1e-5,
    )
    for truncate, param in ((False, "input"), ("left", "truncate")):
        with pytest.raises(InvalidRequestError) as refused:
            engine.score([QUERIES[0]], [long_doc], truncate=truncate)
        assert refused.value.param == param
    with pytest.raises(InvalidRequestError, match="yes/no reranker"):
        engine.classify(["cats"])


def test_only_the_answer_rows_of_the_lm_head_matter(reranker: Path, tmp_path: Path) -> None:
    """The checkpoint's every tensor is accounted for (the LM head read for its two rows),
    and changing any other row of it leaves the scores as they were."""
    engine = Engine.from_pretrained(str(reranker), task="score", dtype="float32")
    tensors = load_file(str(reranker / "model.safetensors"))
    loaded = load_model(
        str(reranker), revision=None, cache_dir=None, dtype="float32", device=CPU, task="score"
    )
    assert loaded.tensors is not None
    assert set(loaded.tensors.read) == set(tensors) and loaded.tensors.unclaimed == ()
    meta = load_model(
        str(reranker),
        revision=None,
        cache_dir=None,
        dtype="float32",
        device=CPU,
        task="score",
        shapes_only=True,
    )
    assert meta.tensors == loaded.tensors  # `inspect` accounts for them the same way
    assert meta.classifier == loaded.classifier
    tok = AutoTokenizer.from_pretrained(str(reranker))
    keep = {tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")}
    cases.assert_other_head_rows_are_not_read(
        engine, reranker, keep, tmp_path / "changed", QUERIES, DOCS
    )


def test_task_auto_still_refuses_and_points_at_task_score(reranker: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="--task score"):
        Engine.from_pretrained(str(reranker))


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_families_without_a_reranker_prompt_are_refused(tmp_path: Path, model_type: str) -> None:
    path = build_reranker(tmp_path / model_type, model_type)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(path), task="score")
    message = str(refused.value)
    assert "yes/no reranker" in message and repr(model_type) in message
    assert "mxbai-rerank-v2" in message and "--task embed" in message


def test_a_tokenizer_without_the_answer_tokens_is_refused(tmp_path: Path) -> None:
    path = build_decoder(tmp_path / "plain", "qwen3", causal_lm=True)
    with pytest.raises(UnsupportedModelError, match="no token 'yes'"):
        Engine.from_pretrained(str(path), task="score")


@pytest.mark.parametrize("front_ends", [False, True])
def test_http_score_and_rerank(reranker: Path, front_ends: bool) -> None:
    """Over HTTP, in one process and through two front-end processes (which format the
    pairs themselves, with no torch): /score and /rerank give the model card's P(yes);
    /classify of single texts is a 400."""
    expected = model_card_scores(reranker, [(QUERIES[0], d) for d in DOCS], 1024)
    with cases.score_server(reranker, front_ends) as server:
        info = httpx.get(server.url + "/info", timeout=10).json()
        assert (info["task"], info["score_activation"]) == ("score", "sigmoid")
        tries = 2 if front_ends else 1  # whichever front-end takes the connection
        cases.assert_scored_and_ranked(server.url, QUERIES[0], DOCS, expected, tries)
        refused = httpx.post(server.url + "/classify", json={"input": ["cats"]}, timeout=60)
        assert refused.status_code == 400 and "yes/no reranker" in refused.text


def test_a_head_tied_to_the_embeddings_reads_their_rows(tmp_path: Path) -> None:
    """Qwen3-Reranker-0.6B ties its LM head to the embeddings: no lm_head.weight is saved,
    and the answer rows come from the embedding table."""
    path = calibrate(build_reranker(tmp_path / "tied", tie_word_embeddings=True))
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    engine = Engine.from_pretrained(str(path), task="score", dtype="float32")
    expected = model_card_scores(path, list(zip(QUERIES, DOCS, strict=True)), 1024)
    assert expected.std() > 0.05
    np.testing.assert_allclose(engine.score(QUERIES, DOCS), expected, atol=1e-5)

"""mxbai-rerank-v2 (Qwen2ForCausalLM) and bge-reranker-v2-gemma (GemmaForCausalLM) served
with task score as yes/no rerankers.

Each stands in as a tiny random ``*ForCausalLM`` with a tokenizer holding the tokens its
prompt needs. The references are the authors' code, restated here with the prompts copied
from it (not from the server's templates) and run on transformers' full model:

* mxbai-rerank-v2, the ``mxbai-rerank`` package's ``MxbaiRerankV2.prepare_inputs`` and
  ``forward``: the query segment cut to 3/4 of ``max_length``, the document to what is
  left, pieces tokenized apart, score ``logit("1") - logit("0")`` at the last position;
* bge-reranker-v2-gemma, FlagEmbedding's ``BaseLLMReranker.compute_score_single_gpu``:
  ``<bos>`` + "A: query" (3/4 of ``max_length``), "\\n" + "B: passage" cut to
  ``max_length + len(sep) + len(prompt)`` for the pair, then "\\n" and the prompt; score the
  "Yes" logit.

The server returns the sigmoid of each (FlagEmbedding's ``normalize=True``; mxbai's
relevance probability), as it does for every one-label cross-encoder. ``max_length`` is
what makes the whole sequence fit the server's limit (``model_max_length`` = the limit for
mxbai; ``limit - 2 * (len(sep) + len(prompt))`` for FlagEmbedding), so truncated pairs are
compared too.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.device.loading import load_model
from embedding_server.engine import Engine
from embedding_server.errors import InputTooLongError, InvalidRequestError, UnsupportedModelError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support import device_cases as cases
from tests.support.models import (
    _DECODER,
    _save_model,
    _save_tokenizer,
    add_sentence_transformers,
    byte_tokenizer,
)

pytestmark = pytest.mark.timeout(300)

CPU = torch.device("cpu")
QUERIES, DOCS = cases.RERANK_QUERIES, cases.RERANK_DOCS
BF16_ATOL = 0.01  # a probability: bfloat16 keeps about 3 significant digits
LONG_QUERY = "which small cats sleep the longest in a warm house? " * 6
LONG_DOC = "cats sleep anywhere warm, on beds and boxes. " * 20

# From mixedbread-ai/mxbai-rerank, mxbai_rerank/mxbai_rerank_v2.py (MxbaiRerankV2).
MXBAI_PREFIX = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n<|im_start|>user\n"
)
MXBAI_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
MXBAI_TASK = (
    "You are a search relevance expert who evaluates how well documents match search "
    "queries. For each query-document pair, carefully analyze the semantic relationship "
    "between them, then provide your binary relevance judgment (0 for not relevant, 1 for "
    "relevant).\nRelevance:"
)
# From FlagEmbedding, inference/reranker/decoder_only/base.py (BaseLLMReranker).
FLAG_PROMPT = (
    "Given a query A and a passage B, determine whether the passage contains an answer to "
    "the query by providing a prediction of either 'Yes' or 'No'."
)

Ids = Callable[[str], list[int]]


def _ids(path: Path) -> Ids:
    tok = AutoTokenizer.from_pretrained(str(path))
    return lambda text: list(tok(text, add_special_tokens=False)["input_ids"])


def mxbai_inputs(
    path: Path, pairs: list[tuple[str, str]], limit: int, instruction: str | None = None
) -> list[list[int]]:
    """MxbaiRerankV2.prepare_inputs with ``model_max_length`` = ``max_length`` = ``limit``."""
    ids = _ids(path)
    prefix, suffix, task, sep = ids(MXBAI_PREFIX), ids(MXBAI_SUFFIX), ids(MXBAI_TASK), ids("\n")
    predefined = len(prefix) + len(task) + len(suffix) + len(sep)
    model_max_length = limit
    max_length = min(limit, model_max_length - predefined)
    out = []
    for query, document in pairs:
        query_prompt = f"query: {query}"
        if instruction:
            query_prompt = "".join([f"instruction: {instruction}", "\n", query_prompt])
        query_ids = ids(query_prompt)[: max_length * 3 // 4]
        available = model_max_length - len(query_ids) - predefined
        doc_ids = ids(f"document: {document}")[: min(available, max_length)]
        second = (sep + doc_ids)[: max_length - len(query_ids)]  # truncation="only_second"
        out.append(prefix + query_ids + second + sep + task + suffix)
    return out


def flag_inputs(
    path: Path, pairs: list[tuple[str, str]], limit: int, prompt: str | None = None
) -> list[list[int]]:
    """compute_score_single_gpu's inputs with ``max_length`` leaving the limit room."""
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = _ids(path)
    prompt_ids = ids(FLAG_PROMPT if prompt is None else prompt)
    sep = ids("\n")
    max_length = limit - 2 * (len(sep) + len(prompt_ids))
    encode_max_length = max_length + len(sep) + len(prompt_ids)
    assert tok.bos_token_id is not None and tok.bos_token_id != tok.pad_token_id
    out = []
    for query, passage in pairs:
        query_ids = ids(f"A: {query}")[: max_length * 3 // 4]
        passage_ids = ids(f"B: {passage}")[:max_length]
        first = [tok.bos_token_id, *query_ids]
        second = (sep + passage_ids)[: encode_max_length - len(first)]  # only_second
        out.append(first + second + sep + prompt_ids)
    return out


def last_logits(path: Path, inputs: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0, -1].float() for ids in inputs]


def reference(
    family: str,
    path: Path,
    pairs: list[tuple[str, str]],
    limit: int = 1024,
    instruction: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> np.ndarray:
    """The authors' score of each pair, through a sigmoid."""
    ids = _ids(path)
    if family == "mxbai":
        yes, no = ids("1")[0], ids("0")[0]
        logits = last_logits(path, mxbai_inputs(path, pairs, limit, instruction), dtype)
        raw = [float(x[yes] - x[no]) for x in logits]
    else:
        yes = ids("Yes")[0]
        logits = last_logits(path, flag_inputs(path, pairs, limit, instruction), dtype)
        raw = [float(x[yes]) for x in logits]
    return np.asarray([1.0 / (1.0 + math.exp(-r)) for r in raw])


def build(path: Path, family: str, *, tied: bool = True) -> Path:
    """A 2-layer reranker of ``family`` ("mxbai": qwen2, "gemma"), the answer rows of its
    head set so that the test pairs' scores spread over (0, 1) (a random head saturates:
    every pair's last state is mostly the shared prompt's)."""
    path.mkdir(parents=True, exist_ok=True)
    if family == "mxbai":
        tok = byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"], "$A", [])
        _save_tokenizer(tok, path, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        model_type, extra = "qwen2", {"pad_token_id": 0, "eos_token_id": 2}
    else:
        tok = byte_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>"], "<bos> $A", ["<bos>"])
        tok.add_tokens(["Yes"])
        _save_tokenizer(
            tok, path, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
        )
        model_type = "gemma"
        extra = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "head_dim": 16}
    _save_model(
        model_type,
        path,
        tok.get_vocab_size(with_added_tokens=True),
        seed=11,
        auto=AutoModelForCausalLM,
        **{**_DECODER, "max_position_embeddings": 1024, "tie_word_embeddings": tied, **extra},
    )
    pairs = list(zip(QUERIES, DOCS, strict=True))
    inputs = (
        mxbai_inputs(path, pairs, 1024) if family == "mxbai" else flag_inputs(path, pairs, 1024)
    )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        h = torch.stack([model.model(torch.tensor([i])).last_hidden_state[0, -1] for i in inputs])
    mean, step = h.mean(0), h[1] - h[0]
    direction = step - (step @ mean) / (mean @ mean) * mean  # no offset: centred on zero
    direction *= 3.0 / (step @ direction)
    tensors = load_file(str(path / "model.safetensors"))
    name = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    ids = _ids(path)
    if family == "mxbai":
        tensors[name][ids("1")[0]] = tensors[name][ids("0")[0]] + direction
    else:
        tensors[name][ids("Yes")[0]] = direction
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def mxbai(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("mxbai") / "m", "mxbai")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("bge-gemma") / "g", "gemma")


FAMILIES = ["mxbai", "gemma"]


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-5), ("bfloat16", BF16_ATOL)])
@pytest.mark.parametrize("family", FAMILIES)
def test_score_and_rerank_equal_the_authors_code(
    family: str, dtype: str, atol: float, request: pytest.FixtureRequest
) -> None:
    """One packed batch of mixed lengths against the reference in the same dtype; /rerank
    orders the documents as float32 transformers does."""
    path: Path = request.getfixturevalue(family)
    engine = Engine.from_pretrained(str(path), task="score", dtype=dtype)
    assert (engine.info().task, engine.info().backend) == ("score", "native")
    torch_dtype = getattr(torch, dtype)
    pairs = list(zip(QUERIES, DOCS, strict=True))
    expected = reference(family, path, pairs, dtype=torch_dtype)
    assert expected.std() > 0.1  # the pairs score differently: the check can tell them apart
    np.testing.assert_allclose(engine.score(QUERIES, DOCS), expected, atol=atol)
    one = [(QUERIES[0], d) for d in DOCS]
    ranked = engine.rerank(QUERIES[0], DOCS)
    order = np.argsort(-reference(family, path, one))
    assert [r.index for r in ranked.results] == list(order)
    against = reference(family, path, one, dtype=torch_dtype)
    np.testing.assert_allclose([r.score for r in ranked.results], against[order], atol=atol)


@pytest.mark.parametrize(("family", "limit"), [("mxbai", 520), ("gemma", 420)])
def test_truncation_and_instruction_follow_the_authors_code(
    family: str, limit: int, request: pytest.FixtureRequest
) -> None:
    """Over-long queries and documents are cut where the reference cuts them (the query to
    3/4 of the budget, the document to the rest, the fixed pieces kept); ``prompt`` is
    mxbai's instruction and FlagEmbedding's prompt; ``truncate=False`` and ``'left'`` are
    refused naming the field."""
    path: Path = request.getfixturevalue(family)
    engine = Engine.from_pretrained(str(path), task="score", dtype="float32", max_model_len=limit)
    pairs = [(LONG_QUERY, LONG_DOC), (QUERIES[0], LONG_DOC), (LONG_QUERY, DOCS[1])]
    inputs = (mxbai_inputs if family == "mxbai" else flag_inputs)(path, pairs, limit)
    assert all(len(i) <= limit for i in inputs)
    assert len(_ids(path)(LONG_DOC)) > limit and len(_ids(path)(LONG_QUERY)) > limit // 2
    queries, docs = [q for q, _ in pairs], [d for _, d in pairs]
    np.testing.assert_allclose(
        engine.score(queries, docs), reference(family, path, pairs, limit), atol=1e-5
    )
    instruction = "Judge facts about cats"
    short = list(zip(QUERIES, DOCS, strict=True))
    with_instruction = reference(family, path, short, limit, instruction)
    assert np.abs(with_instruction - reference(family, path, short, limit)).max() > 1e-3
    np.testing.assert_allclose(
        engine.score(QUERIES, DOCS, prompt=instruction), with_instruction, atol=1e-5
    )
    with pytest.raises(InputTooLongError) as too_long:
        engine.score([QUERIES[0]], [LONG_DOC], truncate=False)
    assert too_long.value.param == "input"
    with pytest.raises(InvalidRequestError) as left:
        engine.score([QUERIES[0]], [LONG_DOC], truncate="left")
    assert left.value.param == "truncate"
    with pytest.raises(InvalidRequestError, match="yes/no reranker"):
        engine.classify(["cats"])


def test_only_the_answer_rows_of_an_untied_head_are_read(tmp_path: Path) -> None:
    """Every tensor is accounted for (the LM head read for its two rows), and changing any
    other row of it leaves the scores as they were."""
    path = build(tmp_path / "untied", "mxbai", tied=False)
    tensors = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" in tensors
    loaded = load_model(
        str(path), revision=None, cache_dir=None, dtype="float32", device=CPU, task="score"
    )
    assert loaded.tensors is not None
    assert set(loaded.tensors.read) == set(tensors) and loaded.tensors.unclaimed == ()
    engine = Engine.from_pretrained(str(path), task="score", dtype="float32")
    pairs = list(zip(QUERIES, DOCS, strict=True))
    np.testing.assert_allclose(
        engine.score(QUERIES, DOCS), reference("mxbai", path, pairs), atol=1e-5
    )
    ids = _ids(path)
    keep = {ids("1")[0], ids("0")[0]}
    cases.assert_other_head_rows_are_not_read(
        engine, path, keep, tmp_path / "changed", QUERIES, DOCS
    )


@pytest.mark.parametrize(("family", "front_ends"), [("mxbai", False), ("gemma", True)])
def test_http_score_and_rerank(
    family: str, front_ends: bool, request: pytest.FixtureRequest
) -> None:
    """Over HTTP, in one process or through two front-end processes (which lay the pairs out
    themselves, with no torch): /score and /rerank give the reference's scores and order."""
    path: Path = request.getfixturevalue(family)
    one = [(QUERIES[0], d) for d in DOCS]
    expected = reference(family, path, one)
    with cases.score_server(path, front_ends) as server:
        tries = 2 if front_ends else 1  # whichever front-end takes the connection
        cases.assert_scored_and_ranked(server.url, QUERIES[0], DOCS, expected, tries)


@pytest.mark.parametrize("family", FAMILIES)
def test_task_auto_refuses_and_points_at_task_score(
    family: str, request: pytest.FixtureRequest
) -> None:
    """Without --task score the checkpoint looks like any chat model: refused, saying how."""
    path: Path = request.getfixturevalue(family)
    with pytest.raises(UnsupportedModelError, match="--task score") as refused:
        Engine.from_pretrained(str(path))
    assert "bge-reranker-v2-gemma" in str(refused.value)


@pytest.mark.parametrize(("family", "token"), [("mxbai", "<|im_start|>"), ("gemma", "<bos>")])
def test_a_tokenizer_without_the_prompts_tokens_is_refused(
    family: str, token: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The prompt's markers must be single tokens of the checkpoint's tokenizer."""
    path: Path = request.getfixturevalue(family)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (copy / name).read_text()
        (copy / name).write_text(text.replace(f'"{token}"', '"<renamed>"'))
    with pytest.raises(UnsupportedModelError, match=f"no token '{token}'"):
        Engine.from_pretrained(str(copy), task="score")


def test_a_qwen2_embedder_is_not_taken_for_a_reranker(mxbai: Path) -> None:
    """A Qwen2ForCausalLM with a sentence-transformers config (gte-Qwen2) is an embedder: task
    score does not serve it with mxbai's prompt; task embed serves it."""
    copy = add_sentence_transformers(mxbai, pooling="lasttoken", name="gte-qwen2")
    assert (copy / "modules.json").exists()
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(str(copy), task="score")
    assert "mxbai" not in str(refused.value)
    assert Engine.from_pretrained(str(copy), task="embed").info().task == "embed"

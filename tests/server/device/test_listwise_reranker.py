"""jina-reranker-v3 (``JinaForRanking``), a listwise reranker, served with task score.

A tiny random ``Qwen3ForCausalLM`` saved in the real layout (``architectures:
["JinaForRanking"]``, no LM head, ``projector.0.weight`` and ``projector.2.weight`` beside
the body) with a tokenizer holding Qwen's chat tokens and the two markers stands in for the
model. The reference is the authors' ``modeling.py`` computation written out here on
transformers' Qwen3: each query and document cut alone (512 and 2048 tokens) and decoded,
documents taken into blocks by the room left in ``model_max_length``, one prompt per block
run at batch size one, the last hidden states at the markers through the projector,
cosines, and the blocks' query projections averaged by their best ``(1 + cosine) / 2``. Our
``/rerank`` and ``/score`` (packed batches of blocks of mixed lengths) must give the same
scores within 1e-4 in float32 and the same order; bfloat16 within 1e-2 of the float32
reference.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.device.loading import load_model
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from embedding_server.settings import ServerSettings
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from tests.support.api import running_server, server_process
from tests.support.models import _DECODER, _save_model, byte_tokenizer, rewrite_checkpoint

CPU = torch.device("cpu")
WINDOW = 5000
"""The tokenizer's ``model_max_length``: small enough that a few long documents fill a
block, so the block-wise merge is exercised."""
DOC_TOKEN, QUERY_TOKEN = "<|embed_token|>", "<|rerank_token|>"

QUERY = "what do cats eat?"
DOCUMENTS = [
    "Cats eat fish and mice. " * 110,  # over 2048 tokens (one per byte): cut and decoded
    "Paris is the capital of France.",
    "Kittens drink milk; grown cats mostly eat meat. " * 30,
    "d",
    f"Dogs eat anything{DOC_TOKEN}, even {QUERY_TOKEN} markers typed by a user.",
    "Cat food is made of fish, chicken and grain.",
]
BF16_ATOL = 1e-2
"""Cosines in [-1, 1]; bfloat16 keeps about 3 significant digits (the authors' own code in
bfloat16 is as far from its float32 scores as ours)."""


def build_jina_reranker(path: Path) -> Path:
    """A 2-layer Qwen3 saved as ``JinaForRanking``: the causal LM's body without its LM head,
    and a projector ``[hidden / 2, hidden]``, ``[512, hidden / 2]`` as the authors build it."""
    source = path.parent / (path.name + "-causal-lm")
    source.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"], "$A", [])
    tok.add_special_tokens([DOC_TOKEN, QUERY_TOKEN])
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=WINDOW,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
    ).save_pretrained(str(source))
    _save_model(
        "qwen3",
        source,
        tok.get_vocab_size(with_added_tokens=True),
        seed=11,
        auto=AutoModelForCausalLM,
        **{
            **_DECODER,
            "max_position_embeddings": 8192,
            "head_dim": 16,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        },
    )
    hidden = int(_DECODER["hidden_size"])
    generator = torch.Generator().manual_seed(12)
    projector = {
        "projector.0.weight": 0.4 * torch.randn(hidden // 2, hidden, generator=generator),
        "projector.2.weight": 0.4 * torch.randn(512, hidden // 2, generator=generator),
    }
    return rewrite_checkpoint(
        source,
        path,
        rename=lambda name: None if name == "lm_head.weight" else name,
        add=projector,
        config={
            "architectures": ["JinaForRanking"],
            "auto_map": {"AutoModel": "modeling.JinaForRanking"},
        },
    )


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_jina_reranker(tmp_path_factory.mktemp("jina-reranker-v3") / "jina")


def _prompt(query: str, docs: list[str], instruction: str | None) -> str:
    """The authors' ``format_docs_prompts_func`` (no thinking)."""

    def clean(text: str) -> str:
        return text.replace(QUERY_TOKEN, "").replace(DOC_TOKEN, "")

    query, docs = clean(query), [clean(d) for d in docs]
    prefix = (
        "<|im_start|>system\nYou are a search relevance expert who can determine a ranking of "
        "the passages based on how relevant they are to the query. If the query is a question, "
        "how relevant a passage is depends on how well it answers the question. If not, try to "
        "analyze the intent of the query and assess how well each passage satisfies the "
        "intent. If an instruction is provided, you should follow the instruction when "
        "determining the ranking.<|im_end|>\n<|im_start|>user\n"
    )
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prompt = (
        f"I will provide you with {len(docs)} passages, each indicated by a numerical "
        f"identifier. Rank the passages based on their relevance to query: {query}\n"
    )
    if instruction:
        prompt += f"<instruct>\n{clean(instruction)}\n</instruct>\n"
    passages = [f'<passage id="{i}">\n{d}{DOC_TOKEN}\n</passage>' for i, d in enumerate(docs)]
    prompt += "\n".join(passages)
    prompt += f"\n<query>\n{query}{QUERY_TOKEN}\n</query>"
    return prefix + prompt + suffix


def authors_rerank(
    path: Path,
    query: str,
    documents: list[str],
    instruction: str | None = None,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> tuple[np.ndarray, int]:
    """The authors' ``JinaForRanking.rerank`` on transformers' Qwen3 (scores in document
    order), and how many blocks it ran. ``window``: a served limit below the tokenizer's
    ``model_max_length``, which takes its place, and a block whose prompt exceeds it is
    halved until it fits (the server's rule where the authors' count falls short)."""
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    weights = load_file(str(path / "model.safetensors"))
    first, second = weights["projector.0.weight"], weights["projector.2.weight"]

    def projector(x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, first.to(x.dtype))), second.to(x.dtype))

    doc_id, query_id = tok.convert_tokens_to_ids(DOC_TOKEN), tok.convert_tokens_to_ids(QUERY_TOKEN)

    def cut(text: str, limit: int) -> tuple[str, int]:
        ids = tok(text, truncation=True, max_length=limit)["input_ids"]
        return (tok.decode(ids) if len(ids) >= limit else text), len(ids)

    query, query_length = cut(query, 512)
    docs, lengths = zip(*(cut(d, 2048) for d in documents), strict=True)
    limit = window or tok.model_max_length
    blocks, block, room = [], [], limit - 2 * query_length
    for doc, length in zip(docs, lengths, strict=True):
        block.append(doc)
        room -= length
        if len(block) >= 125 or room <= 2048:
            blocks.append(block)
            block, room = [], limit - 2 * query_length
    if block:
        blocks.append(block)
    fitted: list[list[str]] = []
    while blocks:
        block = blocks.pop(0)
        if window and len(tok(_prompt(query, block, instruction))["input_ids"]) > window:
            blocks[:0] = [block[: len(block) // 2], block[len(block) // 2 :]]
        else:
            fitted.append(block)
    blocks = fitted
    doc_embeds, query_embeds, block_weights = [], [], []
    for block in blocks:
        batch = tok(text=[_prompt(query, block, instruction)], return_tensors="pt")
        with torch.no_grad():
            out = model(**batch, output_hidden_states=True, use_cache=False)
        hidden, ids = out.hidden_states[-1][0], batch["input_ids"][0]
        d, q = projector(hidden[ids == doc_id]), projector(hidden[ids == query_id])
        assert q.shape[0] == 1 and d.shape[0] == len(block)
        scores = F.cosine_similarity(d, q.expand_as(d), dim=-1).float().numpy()
        doc_embeds.extend(d.float().numpy())
        query_embeds.append(q[0].float().numpy())
        block_weights.append(((1.0 + scores) / 2.0).max())
    merged = np.average(np.array(query_embeds), axis=0, weights=block_weights)
    doc_matrix = np.array(doc_embeds)
    norms = np.linalg.norm(merged) * np.linalg.norm(doc_matrix, axis=1)
    return doc_matrix.dot(merged) / norms, len(blocks)


def test_rerank_is_the_authors_rerank_across_blocks(reranker: Path) -> None:
    """Six documents (one cut at 2048 tokens, marker strings typed into another) fill two
    blocks of the window; the scores and the order are the authors', within 1e-4."""
    engine = Engine.from_pretrained(str(reranker), dtype="float32")
    info = engine.info()
    assert (info.task, info.score_method, info.architecture) == (
        "score",
        "listwise",
        "JinaForRanking",
    )
    expected, blocks = authors_rerank(reranker, QUERY, DOCUMENTS)
    assert blocks == 2  # the merge of blocks' query projections is what is checked
    assert expected.std() > 0.05  # the documents score apart: a wrong row would show
    ranked = engine.rerank(QUERY, DOCUMENTS)
    assert [r.index for r in ranked.results] == list(np.argsort(-expected))
    np.testing.assert_allclose(
        [r.score for r in ranked.results], expected[[r.index for r in ranked.results]], atol=1e-4
    )
    assert ranked.truncated_inputs == 1  # the first block's list had a document cut


def test_one_block_and_pairs_of_mixed_lengths(reranker: Path) -> None:
    """One query against short documents is one prompt (the cosines, as vLLM's one-list
    score); equal sides are each pair's own prompt, run together in one packed batch of
    mixed lengths; a prompt is the instruction."""
    engine = Engine.from_pretrained(str(reranker), dtype="float32")
    short = DOCUMENTS[1:]
    expected, blocks = authors_rerank(reranker, QUERY, short)
    assert blocks == 1
    np.testing.assert_allclose(engine.score(QUERY, short), expected, atol=1e-4)
    queries = [QUERY, "capital of France", f"q{QUERY_TOKEN}", "what do dogs eat?", "cat food"]
    pairs = np.array(
        [authors_rerank(reranker, q, [d])[0][0] for q, d in zip(queries, short, strict=True)]
    )
    assert pairs.std() > 0.01
    np.testing.assert_allclose(engine.score(queries, short), pairs, atol=1e-4)
    instruction = "Prefer passages about pets"
    instructed, _ = authors_rerank(reranker, QUERY, short, instruction)
    assert np.abs(instructed - expected).max() > 1e-3  # the instruction changes the scores
    instructed_ours = engine.score(QUERY, short, prompt=instruction)
    np.testing.assert_allclose(instructed_ours, instructed, atol=1e-4)


def test_bfloat16_is_within_its_precision(reranker: Path) -> None:
    """In bfloat16 the scores of one block and of two merged blocks stay within 1e-2 of the
    float32 reference."""
    engine = Engine.from_pretrained(str(reranker), dtype="bfloat16")
    assert engine.info().dtype == "bfloat16"
    for documents in (DOCUMENTS[1:], DOCUMENTS):
        expected, _ = authors_rerank(reranker, QUERY, documents)
        np.testing.assert_allclose(engine.score(QUERY, documents), expected, atol=BF16_ATOL)


def test_options_that_do_not_apply_are_refused(reranker: Path) -> None:
    """Truncation from the left, prompt names, classification, token ids and other tasks
    are refused by name; without truncation an over-long document is refused."""
    engine = Engine.from_pretrained(str(reranker), dtype="float32")
    for options, param in (
        ({"truncate": "left"}, "truncate"),
        ({"truncate": False}, "documents"),
        ({"prompt_name": "query"}, "prompt_name"),
    ):
        with pytest.raises(InvalidRequestError) as refused:
            engine.score(QUERY, DOCUMENTS, **options)  # type: ignore[arg-type]
        assert refused.value.param == param
    with pytest.raises(InvalidRequestError, match="listwise reranker"):
        engine.classify(["cats"])
    with pytest.raises(InvalidRequestError, match="text_2 must be text"):
        engine.score(QUERY, [[1, 2, 3]])
    for task in ("embed", "classify"):
        with pytest.raises(UnsupportedModelError, match="listwise reranker"):
            Engine.from_pretrained(str(reranker), task=task, dtype="float32")


def test_every_tensor_is_read_and_a_missing_projector_is_refused(
    reranker: Path, tmp_path: Path
) -> None:
    """The projector is read (no tensor left unclaimed); without it, or with a bias the
    authors' projector does not have, the checkpoint is refused by name."""
    loaded = load_model(
        str(reranker), revision=None, cache_dir=None, dtype="float32", device=CPU, task="auto"
    )
    assert loaded.tensors is not None and loaded.tensors.unclaimed == ()
    assert {"projector.0.weight", "projector.2.weight"} <= set(loaded.tensors.read)
    assert loaded.listwise is not None and loaded.listwise.width == 512
    broken = rewrite_checkpoint(
        reranker, tmp_path / "broken", rename=lambda n: None if n == "projector.2.weight" else n
    )
    with pytest.raises(UnsupportedModelError, match=r"projector\.2\.weight"):
        Engine.from_pretrained(str(broken), dtype="float32")
    biased = tmp_path / "biased"
    rewrite_checkpoint(reranker, biased, add={"projector.0.bias": torch.zeros(16)})
    with pytest.raises(UnsupportedModelError, match=r"projector\.0\.bias"):
        Engine.from_pretrained(str(biased), dtype="float32")


def test_http_rerank_and_score(reranker: Path) -> None:
    """Over HTTP: a document over 2048 tokens is refused unless truncation is asked for
    (as for any over-long input); then /rerank orders the documents as the authors' code
    does, with its scores, and /score gives them in request order."""
    expected, _ = authors_rerank(reranker, QUERY, DOCUMENTS)
    settings = ServerSettings(model=str(reranker), dtype="float32")
    with running_server(settings) as server:
        body: dict[str, object] = {"query": QUERY, "documents": DOCUMENTS}
        refused = httpx.post(server.url + "/rerank", json=body, timeout=120)
        assert refused.status_code == 400 and "documents[0] has more than 2048" in refused.text
        body["truncate_prompt_tokens"] = -1  # vLLM's field: cut as the model's authors do
        ranked = httpx.post(server.url + "/rerank", json=body, timeout=120)
        assert ranked.status_code == 200, ranked.text
        results = ranked.json()["results"]
        assert [r["index"] for r in results] == list(np.argsort(-expected))
        np.testing.assert_allclose(
            [r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-4
        )
        scored = httpx.post(
            server.url + "/score",
            json={"text_1": QUERY, "text_2": DOCUMENTS, "truncate_prompt_tokens": -1},
            timeout=120,
        )
        assert scored.status_code == 200, scored.text
        np.testing.assert_allclose([d["score"] for d in scored.json()["data"]], expected, atol=1e-4)
        refused = httpx.post(server.url + "/classify", json={"input": ["cats"]}, timeout=60)
        assert refused.status_code == 400 and "listwise reranker" in refused.text


def test_front_end_processes_build_the_lists_themselves(reranker: Path) -> None:
    """Through two front-end processes (the request plane alone, no torch: they cut the
    texts, build the blocks and merge their scores) /rerank gives the authors' scores."""
    expected, _ = authors_rerank(reranker, QUERY, DOCUMENTS)
    args = ["--model", str(reranker), "--dtype", "float32", "--auto-truncate"]
    with server_process([*args, "--api-workers", "2"], workers=2) as server:
        for _ in range(2):  # whichever front-end takes the connection
            ranked = httpx.post(
                server.url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=120
            )
            assert ranked.status_code == 200, ranked.text
            results = ranked.json()["results"]
            assert [r["index"] for r in results] == list(np.argsort(-expected))
            np.testing.assert_allclose(
                [r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-4
            )


def test_a_block_whose_prompt_overflows_the_window_is_halved(reranker: Path) -> None:
    """125 one-letter documents in a 2400-token window: the authors' rule puts them in one
    block, whose prompt (over 4000 tokens with its passage tags) does not fit; it is halved
    until each half does, and every document is scored by the authors' merge over those
    blocks."""
    engine = Engine.from_pretrained(str(reranker), dtype="float32", max_model_len=2400)
    documents = [chr(ord("a") + i % 26) for i in range(125)]
    expected, blocks = authors_rerank(reranker, QUERY, documents, window=2400)
    assert blocks > 2
    np.testing.assert_allclose(engine.score(QUERY, documents), expected, atol=1e-4)

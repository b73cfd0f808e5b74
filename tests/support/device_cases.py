"""Cases and checks the device-plane tests share: the packed-batch texts of the BERT-shaped
families, the comparisons against transformers, the edited copies of a checkpoint that must be
refused, and the reference computations several families run the same way."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import shutil
import string
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import huggingface_hub
import numpy as np
import pytest
import torch
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from embedding_server.settings import ServerSettings
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from tests.support.api import RunningServer, ServerProcess, running_server, server_process
from tests.support.attention import assert_rows_close
from tests.support.models import (
    _save_tokenizer,
    build_xlm_roberta,
    byte_tokenizer,
    rewrite_checkpoint,
    spread_weights,
)

F32_COSINE, BF16_COSINE = 0.99999, 0.999
DTYPES = [("float32", F32_COSINE), ("bfloat16", BF16_COSINE)]
"""(dtype, the least cosine to the float32 reference) the parity tests run in."""

TEXTS = [
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "short one",
    "packed batches of mixed lengths must not leak into each other " * 3,
]
"""Mixed lengths for one packed batch, the longest past a few dozen tokens."""
QUERIES = ["what is a fox?", "q", "where do cats sleep in the winter months?", "x y z"]
DOCS = ["the fox is an animal", "d", "cats sleep anywhere warm " * 6, "nothing at all"]
RERANK_QUERIES = ["what do cats eat?", "where is the capital of France?", "q"]
RERANK_DOCS = [
    "cats eat fish and mice, and sometimes {braces} or no food at all",
    "Paris is the capital of France; yes, it is.",
    "d",
]
"""Pairs for the LM-head rerankers: a template's braces in a document, a one-letter pair."""

KERNEL_RATIOS = [
    ("sdpa_bucketed", 1.0),  # exact-length buckets
    ("sdpa_bucketed", 0.5),  # padded buckets
    ("sdpa_padded", 1.0),  # the whole batch padded to its longest, one call per layer
]
"""(attention kernel, bucket ratio): the layouts a packed batch can run in."""

GEMMA_BODY: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # not hidden / heads
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
}
"""The tiny Gemma-shaped body (grouped-query attention, head_dim not hidden / heads) the
Gemma and Gemma 2 tests build on."""


def built_once(root: Path, build: Callable[[Path, str], Path]) -> Callable[[str], Path]:
    """Factory: name -> ``build(root / name, name)``, built on the first call for each name."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build(root / name, name)
        return cache[name]

    return get


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity."""
    return np.sum(got * want, axis=-1) / (
        np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1)
    )


def assert_matches(got: np.ndarray, want: np.ndarray, min_cosine: float) -> None:
    """Rows agree in direction; in float32 (``min_cosine`` F32_COSINE) also to 2e-5."""
    assert got.shape == want.shape
    assert cosines(got, want).min() >= min_cosine, cosines(got, want).min()
    if min_cosine == F32_COSINE:
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def assert_states_and_means(
    engine: Engine, seqs: list[list[int]], expected: list[np.ndarray], min_cosine: float
) -> None:
    """``engine``'s token states of ``seqs`` match ``expected``, and its vectors their means
    (``assert_matches``)."""
    for got, want in zip(engine.embed_tokens(seqs), expected, strict=True):
        assert_matches(got, want, min_cosine)
    assert_matches(engine.embed(seqs), np.stack([e.mean(0) for e in expected]), min_cosine)


def assert_two_ranks_give_the_states_of_one(path: Path, seqs: list[list[int]]) -> None:
    """Two tensor-parallel ranks give the token states of ``seqs`` one rank gives (float32)."""
    single = Engine.from_pretrained(str(path), dtype="float32")
    parallel = Engine.from_pretrained(str(path), dtype="float32", tensor_parallel_size=2)
    try:
        assert parallel.tensor_parallel is not None
        for want, got in zip(single.embed_tokens(seqs), parallel.embed_tokens(seqs), strict=True):
            assert cosines(got, want).min() >= F32_COSINE
    finally:
        parallel.close()


def flat_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine of two arrays taken whole, in float64."""
    x, y = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def assert_rewards_match(
    seqs: list[list[int]], got: list[np.ndarray], want: list[np.ndarray], cosine: float, dtype: str
) -> None:
    """One reward per token of each sequence, pointing where the reference's do (taken
    whole); in float32 also to 1e-4."""
    for seq, g, w in zip(seqs, got, want, strict=True):
        assert g.shape == w.shape == (len(seq), 1)
        assert flat_cosine(g, w) >= cosine
        if dtype == "float32":
            np.testing.assert_allclose(g, w, atol=1e-4)


def assert_token_states_match(
    seqs: list[list[int]],
    got: list[np.ndarray],
    want: list[np.ndarray],
    cosine: float,
    dtype: str,
    hidden_size: int = 32,
) -> None:
    """One (length, hidden_size) state per token, close to the reference row by row; in
    float32 also to 2e-5."""
    for seq, g, w in zip(seqs, got, want, strict=True):
        assert g.shape == w.shape == (len(seq), hidden_size)
    assert_rows_close(got, want, cosine)
    if dtype == "float32":
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)


def bert_sequences(lengths: list[int]) -> list[list[int]]:
    """[CLS] random word ids [SEP] of each length (a lone [CLS] for 1)."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for n in lengths:
        body = torch.randint(1000, 30000, (max(n - 2, 0),), generator=generator).tolist()
        out.append([101] if n == 1 else [101, *body, 102])
    return out


def eager_states(
    path: Path, seqs: list[list[int]], dtype: torch.dtype = torch.float32, **config: Any
) -> list[np.ndarray]:
    """transformers' last hidden states (eager attention, in ``dtype``, with ``config``
    overriding the checkpoint's), each sequence alone, as float32."""
    model = AutoModel.from_pretrained(
        str(path), attn_implementation="eager", dtype=dtype, **config
    ).eval()
    with torch.no_grad():
        return [
            model(input_ids=torch.tensor([s])).last_hidden_state[0].float().numpy() for s in seqs
        ]


def classifier_logits(
    path: Path, inputs: list[str] | list[tuple[str, str]], limit: int, *, one_segment: bool = False
) -> np.ndarray:
    """transformers' float32 sequence logits, each input (or pair, with its segment ids) run
    alone, cut to ``limit`` tokens; ``one_segment``: every token's segment id 0."""
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    rows = []
    with torch.no_grad():
        for item in inputs:
            parts = item if isinstance(item, tuple) else (item,)
            enc = tok(
                *parts,
                return_tensors="pt",
                truncation=True,
                max_length=limit,
                return_token_type_ids=True,  # as DeBERTa's own tokenizer returns them
            )
            if one_segment:
                enc["token_type_ids"] = torch.zeros_like(enc["token_type_ids"])
            rows.append(model(**enc).logits[0].numpy())
    return np.stack(rows)


def centered(log_probs: np.ndarray) -> np.ndarray:
    """Logits up to their per-row constant (what log-softmax keeps of them), centered, and
    flattened: the logits of several rows as one vector. Compared row by row, a row whose
    labels are nearly tied (centered logits of norm ~0.2) has its direction set by bfloat16's
    rounding alone; transformers' own bfloat16 run misses 0.999 on such rows too."""
    return (log_probs - log_probs.mean(-1, keepdims=True)).reshape(1, -1)


def assert_bfloat16_classifier_matches(path: Path, reference: Path) -> None:
    """The classifier at ``path``, run in bfloat16, gives logits that point where float32
    transformers' (on ``reference``) do, on ``TEXTS``."""
    engine = Engine.from_pretrained(str(path), dtype="bfloat16")
    assert engine.info().task == "classify"
    expected = classifier_logits(reference, TEXTS, engine.info().max_input_tokens)
    got = np.log(engine.classify(TEXTS).probs)
    assert_rows_close(centered(got), centered(expected), min_cosine=BF16_COSINE)


def assert_scores_are_sigmoid_logits(
    engine: Engine, reference: Path, *, one_segment: bool = False
) -> None:
    """``engine``'s scores of ``QUERIES`` against ``DOCS`` pairwise are the sigmoid of
    transformers' one logit (on ``reference``)."""
    pairs = list(zip(QUERIES, DOCS, strict=True))
    limit = engine.info().max_input_tokens
    logits = classifier_logits(reference, pairs, limit, one_segment=one_segment)[:, 0]
    np.testing.assert_allclose(engine.score(QUERIES, DOCS), 1 / (1 + np.exp(-logits)), atol=1e-5)


def colbert_skiplist(path: Path) -> set[int]:
    """ColBERT's punctuation skip-list: each symbol's first token id."""
    tok = AutoTokenizer.from_pretrained(str(path))
    return {tok.encode(s, add_special_tokens=False)[0] for s in string.punctuation}


def stanford_tensorize(
    path: Path,
    queries: list[str],
    docs: list[str],
    lengths: tuple[int, int],
    markers: tuple[str, str],
    *,
    attend_to_mask: bool = False,
) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """stanford-colbert's tensorize, each query padded to ``lengths[0]`` with [MASK] and each
    document cut to ``lengths[1]``, the ``markers`` (query's, document's) after [CLS]: every
    query's and document's token ids, and how many of each query's leading tokens are
    attended to (``attend_to_mask``: its [MASK] padding too)."""
    query_maxlen, doc_maxlen = lengths
    tok = AutoTokenizer.from_pretrained(str(path))
    q_marker, d_marker = tok.convert_tokens_to_ids(list(markers))
    q = tok(
        [". " + x for x in queries],
        padding="max_length",
        truncation=True,
        max_length=query_maxlen,
        return_tensors="pt",
    )
    ids, mask = q["input_ids"], q["attention_mask"]
    ids[:, 1] = q_marker
    ids[ids == tok.pad_token_id] = tok.mask_token_id
    if attend_to_mask:
        mask[ids == tok.mask_token_id] = 1
    doc_ids = [
        tok(". " + x, truncation="longest_first", max_length=doc_maxlen)["input_ids"] for x in docs
    ]
    for d in doc_ids:
        d[1] = d_marker
    return ids.tolist(), mask.sum(1).tolist(), doc_ids


def edit_config(path: Path, **changes: Any) -> Path:
    """Update ``path``'s config.json in place with ``changes``."""
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def edited_copy(src: Path, target: Path, **changes: Any) -> Path:
    """A copy of the checkpoint at ``src`` with ``changes`` written into its config.json."""
    shutil.copytree(src, target)
    return edit_config(target, **changes)


def assert_refused(path: Path, match: str) -> None:
    """Loading ``path`` in float32 raises UnsupportedModelError matching ``match``."""
    with pytest.raises(UnsupportedModelError, match=match):
        Engine.from_pretrained(str(path), dtype="float32")


def assert_refused_before_weights(
    src: Path, target: Path, config: dict[str, object], match: str
) -> None:
    """A copy of ``src`` with ``config`` merged into its config.json and its weights removed
    is refused (UnsupportedModelError matching ``match``): the refusal reads no weights."""
    path = rewrite_checkpoint(src, target, config=config)
    (path / "model.safetensors").unlink()
    assert_refused(path, match)


def build_roberta(path: Path) -> Path:
    """RoBERTa as all-roberta-large-v1 ships it: XLM-R's architecture and weight names under
    ``model_type: roberta``."""
    build_xlm_roberta(path)
    return edit_config(path, model_type="roberta", architectures=["RobertaModel"])


def save_byte_decoder(
    path: Path,
    model_type: str,
    config: dict[str, Any],
    *,
    specials: list[str],
    template: str,
    bos: str,
    eos: str,
    seed: int,
    causal_lm: bool = False,
    damp: float | None = None,
) -> Path:
    """A tiny random decoder of ``model_type`` (``config``) with a byte-level tokenizer whose
    specials are ``specials`` (pad first, unk last) and whose template is ``template``; the
    weights spread, then (``damp``) every matrix but the embeddings scaled down."""
    path.mkdir(parents=True, exist_ok=True)
    template_tokens = [t for t in specials if t in template.split()]
    tok = byte_tokenizer(specials, template, template_tokens)
    _save_tokenizer(
        tok, path, bos_token=bos, eos_token=eos, pad_token=specials[0], unk_token=specials[-1]
    )
    torch.manual_seed(seed)
    auto_config = AutoConfig.for_model(model_type, vocab_size=tok.get_vocab_size(), **config)
    model = (AutoModelForCausalLM if causal_lm else AutoModel).from_config(auto_config)
    spread_weights(model)
    if damp is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() > 1 and "embed" not in name:
                    param.mul_(damp)
    model.save_pretrained(str(path))
    return path


@contextlib.contextmanager
def score_server(path: Path, front_ends: bool) -> Iterator[RunningServer | ServerProcess]:
    """The checkpoint at ``path`` served with task score in float32: in one process, or
    (``front_ends``) behind two front-end processes."""
    with contextlib.ExitStack() as stack:
        server: RunningServer | ServerProcess
        if front_ends:
            args = ["--model", str(path), "--task", "score", "--dtype", "float32"]
            server = stack.enter_context(server_process([*args, "--api-workers", "2"], workers=2))
        else:
            settings = ServerSettings(model=str(path), task="score", dtype="float32")
            server = stack.enter_context(running_server(settings))
        yield server


def assert_other_head_rows_are_not_read(
    engine: Engine, path: Path, keep: set[int], target: Path, queries: list[str], docs: list[str]
) -> None:
    """A copy of the checkpoint at ``path`` (at ``target``) whose LM-head rows other than
    ``keep`` are random scores ``queries`` against ``docs`` as ``engine`` does."""
    tensors = load_file(str(path / "model.safetensors"))
    head = tensors["lm_head.weight"].clone()
    others = [i for i in range(head.shape[0]) if i not in keep]
    head[others] = torch.randn(len(others), head.shape[1])
    shutil.copytree(path, target)
    save_file({**tensors, "lm_head.weight": head}, str(target / "model.safetensors"))
    other = Engine.from_pretrained(str(target), task="score", dtype="float32")
    np.testing.assert_allclose(other.score(queries, docs), engine.score(queries, docs), atol=1e-6)


def assert_scored_and_ranked(
    url: str, query: str, docs: list[str], expected: np.ndarray, tries: int = 1
) -> None:
    """/score (asked ``tries`` times: whichever front-end takes the connection) gives
    ``expected`` for ``query`` against each of ``docs``, and /rerank their order and scores."""
    for _ in range(tries):
        scored = httpx.post(url + "/score", json={"text_1": query, "text_2": docs}, timeout=60)
        assert scored.status_code == 200, scored.text
        got = [d["score"] for d in scored.json()["data"]]
        np.testing.assert_allclose(got, expected, atol=1e-5)
    ranked = httpx.post(url + "/rerank", json={"query": query, "documents": docs}, timeout=60)
    assert ranked.status_code == 200, ranked.text
    results = ranked.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected))
    np.testing.assert_allclose(
        [r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-5
    )


def fake_snapshot_download(
    monkeypatch: pytest.MonkeyPatch,
    repo: Path,
    snapshot: Path,
    record: Callable[[dict[str, Any]], None],
    *,
    honour_ignore_patterns: bool,
) -> None:
    """Serve the local directory ``repo`` as a Hub repository: ``snapshot_download`` copies
    the files its ``allow_patterns`` match (fnmatch over the whole path, as the Hub's filter
    does; less those ``ignore_patterns`` match, when honoured) into ``snapshot``, and hands
    each call's keyword arguments to ``record``."""

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        patterns = list(kwargs.get("allow_patterns") or ["*"])
        ignored = list(kwargs.get("ignore_patterns") or []) if honour_ignore_patterns else []
        record(kwargs)
        for f in repo.rglob("*"):
            rel = f.relative_to(repo).as_posix()
            wanted = any(fnmatch.fnmatch(rel, p) for p in patterns)
            if f.is_file() and wanted and not any(fnmatch.fnmatch(rel, p) for p in ignored):
                (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, snapshot / rel)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

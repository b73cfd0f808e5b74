"""The prompt-prefix cache (``--prefix-cache-bytes``): exact for causal decoders, refused
for bidirectional ones.

A request after a cached prompt runs only its own tokens, attending to the prompt's cached
keys and values; its vector must be the one the whole sequence gives. Checked on tiny random
Qwen3, Qwen2, Llama and Mistral bodies (2 layers, GQA 4:2), float32 and bfloat16, on packed
batches that mix cached and uncached sequences of several lengths, two prompts, truncation at
the maximum length, a sliding window, int8 weights, and an LRU budget that holds one prompt;
the attention itself against whole-sequence causal attention on random tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.device.models.base import PackedBatch
from embedding_server.device.prefix_cache import PrefixBatch, PrefixCache, PrefixEntry
from embedding_server.device.prefix_cache import prefix_attention as attend_after_prefix
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError
from embedding_server.metrics import Metrics
from embedding_server.request.sequences import SequenceInput
from sentence_transformers import SentenceTransformer

from tests.support import device_cases as cases
from tests.support.attention import assert_rows_close, pretend_cuda
from tests.support.models import add_sentence_transformers, build_decoder

QUERY = "Instruct: Given a web search query, retrieve relevant passages\nQuery: "
OTHER = "Represent this sentence for searching: "
TEXTS = ["a", "what is the capital of China?", "gravity " * 12, "x y", "the last token"]
MIN_COSINE = {"float32": 0.99999, "bfloat16": 0.999}
BUDGET = 1 << 22


def causal_embedder(root: Path, model_type: str, pooling: str, **overrides: object) -> Path:
    body = build_decoder(root / model_type, model_type, **overrides)
    return add_sentence_transformers(
        body,
        pooling=pooling,
        prompts={"query": QUERY, "other": OTHER},
        name=f"{pooling}-{len(overrides)}",
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("prefix-cache")
    built: dict[tuple[str, str], Path] = {}

    def get(model_type: str, pooling: str = "lasttoken") -> Path:
        key = (model_type, pooling)
        if key not in built:
            built[key] = causal_embedder(root / pooling, model_type, pooling)
        return built[key]

    return get


def stats(engine: Engine) -> dict[str, int]:
    cache = engine._runner.prefix_cache
    assert cache is not None
    return dataclasses.asdict(cache.stats())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama", "mistral"])
def test_cached_prompts_give_the_whole_sequences_vectors(
    models: Callable[..., Path], model_type: str, dtype: str
) -> None:
    path = models(model_type)
    plain = Engine.from_pretrained(str(path), dtype=dtype)
    cached = Engine.from_pretrained(str(path), dtype=dtype, prefix_cache_bytes=BUDGET)
    assert cached.info().prefix_cache_bytes == BUDGET
    # Exact, so not part of what a vector is: the fingerprint is the uncached engine's.
    assert cached.info().fingerprint == plain.info().fingerprint
    want = plain.embed(TEXTS, prompt_name="query")
    first = cached.embed(TEXTS, prompt_name="query")  # computes the prompt's states
    again = cached.embed(TEXTS, prompt_name="query")  # reads them
    assert_rows_close(first, want, MIN_COSINE[dtype])
    assert_rows_close(again, want, MIN_COSINE[dtype])
    counted = stats(cached)
    assert counted["misses"] == len(TEXTS)  # one batch computed the prompt for all five
    assert counted["hits"] == len(TEXTS)
    assert counted["entries"] == 1 and 0 < counted["bytes"] <= BUDGET
    # The prompt matters to the vector: the cache did not just drop it.
    assert not np.allclose(again, plain.embed(TEXTS), atol=1e-3)
    # Texts without a prompt run whole, as before.
    assert_rows_close(cached.embed(TEXTS), plain.embed(TEXTS), MIN_COSINE[dtype])


def gemma_embedder(root: Path, model_type: str) -> Path:
    """A causal Gemma 3 (local and global layers, two RoPE tables) or Gemma 2 (logits capped
    at 4, where tanh bites) with a window of 8, far shorter than the prompts."""
    config: dict[str, object] = {
        **cases.GEMMA_BODY,
        "max_position_embeddings": 256,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if model_type == "gemma2":
        config["attn_logit_softcapping"] = 4.0
    else:
        config["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    body = cases.save_byte_decoder(
        root / model_type,
        model_type,
        config,
        specials=["<pad>", "<s>", "</s>", "<unk>"],
        template="<s> $A </s>",
        bos="<s>",
        eos="</s>",
        seed=31,
    )
    return add_sentence_transformers(
        body, pooling="lasttoken", prompts={"query": QUERY, "other": OTHER}
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma2"])
def test_gemma_bodies_with_windows_and_caps_stay_exact(
    tmp_path: Path, model_type: str, dtype: str
) -> None:
    path = gemma_embedder(tmp_path, model_type)
    plain = Engine.from_pretrained(str(path), dtype=dtype)
    cached = Engine.from_pretrained(str(path), dtype=dtype, prefix_cache_bytes=BUDGET)
    assert plain.info().sliding_window == 8
    want = plain.embed(TEXTS, prompt_name="query")
    for _ in range(2):
        assert_rows_close(cached.embed(TEXTS, prompt_name="query"), want, MIN_COSINE[dtype])
    assert stats(cached)["hits"] == len(TEXTS)
    assert not np.allclose(want, plain.embed(TEXTS), atol=1e-3)


@pytest.mark.parametrize("model_type", ["qwen3", "mistral-window"])
def test_flash_attn_gets_separate_key_lengths_aligned_to_the_end(
    models: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_type: str
) -> None:
    """On a GPU the cached path is one flash-attn varlen call per layer: the own queries, the
    prefix and own keys with their own ``cu_seqlens_k``, ``causal=True`` (bottom-right in
    flash-attn 2.1+) and the window as ``window_size``. Through the strict stand-in, which
    computes flash-attn's documented masks, in bfloat16 as flash-attn runs."""
    fakes = pretend_cuda(monkeypatch)
    if model_type == "qwen3":
        path = models("qwen3")
    else:
        path = causal_embedder(tmp_path, "mistral", "lasttoken", sliding_window=len(OTHER) + 8)
    plain = Engine.from_pretrained(str(path), dtype="bfloat16")
    cached = Engine.from_pretrained(str(path), dtype="bfloat16", prefix_cache_bytes=BUDGET)
    assert cached.info().attention == "flash_attn"
    texts = [*TEXTS, "a text longer than the window, from its prompt on"]
    want = plain.embed(texts, prompt_name="other")
    fakes.flash.calls.clear()
    for _ in range(2):
        assert_rows_close(cached.embed(texts, prompt_name="other"), want, MIN_COSINE["bfloat16"])
    assert stats(cached)["hits"] == len(texts)
    split = [c for c in fakes.flash.calls if not torch.equal(c["cu_q"], c["cu_k"])]
    assert split and all(c["causal"] for c in split)
    windows = {c["window_size"] for c in split}
    assert windows == ({(-1, -1)} if model_type == "qwen3" else {(len(OTHER) + 7, 0)})


def test_qwen3_with_the_cache_equals_sentence_transformers(models: Callable[..., Path]) -> None:
    path = models("qwen3")
    engine = Engine.from_pretrained(str(path), dtype="float32", prefix_cache_bytes=BUDGET)
    st = SentenceTransformer(str(path), device="cpu")
    for _ in range(2):
        got = engine.embed(TEXTS, prompt_name="query")
        assert_rows_close(got, st.encode(TEXTS, prompt_name="query"), 0.99999)
    assert stats(engine)["hits"] == len(TEXTS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_packed_batch_mixes_prompts_lengths_and_token_states(
    models: Callable[..., Path], dtype: str
) -> None:
    """Mean pooling reads the prompt's states too (include_prompt): they come back from the
    cache. One batch holds two prompts, no prompt, a per-token output and a sequence that is
    all prompt (which runs whole)."""
    path = models("qwen3", "mean")
    plain = Engine.from_pretrained(str(path), dtype=dtype)
    cached = Engine.from_pretrained(str(path), dtype=dtype, prefix_cache_bytes=BUDGET)
    query = plain.tokenize([QUERY + t for t in TEXTS])
    other = plain.tokenize([OTHER + t for t in TEXTS[:3]])
    bare = plain.tokenize(TEXTS[:3])
    q_len, o_len = len(plain.tokenize([QUERY])[0]) - 1, len(plain.tokenize([OTHER])[0]) - 1
    seqs = (
        [SequenceInput(ids, q_len, want_tokens=i == 1) for i, ids in enumerate(query)]
        + [SequenceInput(ids, o_len) for ids in other]
        + [SequenceInput(ids) for ids in bare]
        + [SequenceInput(query[0][: q_len + 1], q_len + 1)]  # nothing after its prompt
    )
    for _ in range(2):
        got, want = cached._runner.run(seqs), plain._runner.run(seqs)
        assert_rows_close(got.pooled, want.pooled, MIN_COSINE[dtype])
        assert got.tokens[1] is not None and want.tokens[1] is not None
        assert_rows_close(got.tokens[1], want.tokens[1], MIN_COSINE[dtype])
        assert [t is None for t in got.tokens] == [i != 1 for i in range(len(seqs))]
    counted = stats(cached)
    assert counted["entries"] == 2
    assert (counted["misses"], counted["hits"]) == (len(query) + len(other),) * 2


def test_truncation_at_the_maximum_length_keeps_the_prompt_cached(
    models: Callable[..., Path],
) -> None:
    path = models("llama")
    limit = len(QUERY) + 12
    plain = Engine.from_pretrained(str(path), dtype="float32", max_model_len=limit)
    cached = Engine.from_pretrained(
        str(path), dtype="float32", max_model_len=limit, prefix_cache_bytes=BUDGET
    )
    texts = ["short", "long text " * 20, "y" * 40]
    want = plain.embed(texts, prompt_name="query")
    assert_rows_close(cached.embed(texts, prompt_name="query"), want, 0.99999)
    assert_rows_close(cached.embed(texts, prompt_name="query"), want, 0.99999)
    assert stats(cached)["hits"] == len(texts)


def test_a_budget_of_one_prompt_evicts_the_least_recent(models: Callable[..., Path]) -> None:
    path = models("qwen2")
    probe = Engine.from_pretrained(str(path), dtype="float32", prefix_cache_bytes=BUDGET)
    probe.embed(["x"], prompt_name="query")
    one = stats(probe)["bytes"]  # the longer prompt's entry
    plain = Engine.from_pretrained(str(path), dtype="float32")
    cached = Engine.from_pretrained(str(path), dtype="float32", prefix_cache_bytes=one)
    for name in ("query", "other", "query", "other"):
        got = cached.embed(TEXTS, prompt_name=name)
        assert_rows_close(got, plain.embed(TEXTS, prompt_name=name), 0.99999)
    counted = stats(cached)
    assert counted["entries"] == 1 and counted["bytes"] <= one
    assert counted["evictions"] == 3 and counted["hits"] == 0


def test_a_sliding_window_reaching_into_the_prompt_stays_exact(tmp_path: Path) -> None:
    """Mistral's window over a prompt and text longer than it: the window is applied to the
    positions the prompt shifts, so the cached run still equals the whole one, which differs
    from full attention there."""
    window = len(OTHER) + 8
    path = causal_embedder(tmp_path, "mistral", "lasttoken", sliding_window=window)
    plain = Engine.from_pretrained(str(path), dtype="float32")
    cached = Engine.from_pretrained(str(path), dtype="float32", prefix_cache_bytes=BUDGET)
    assert plain.info().sliding_window == window
    texts = ["ab", "cd", "a text longer than the window, from its prompt on"]
    want = plain.embed(texts, prompt_name="other")
    for _ in range(2):
        assert_rows_close(cached.embed(texts, prompt_name="other"), want, 0.99999)
    assert stats(cached)["hits"] == len(texts)
    full = causal_embedder(tmp_path / "full", "mistral", "lasttoken", sliding_window=None)
    unwindowed = Engine.from_pretrained(str(full), dtype="float32").embed(
        texts, prompt_name="other"
    )
    assert np.allclose(unwindowed[:2], want[:2], atol=1e-5)  # within the window: the same
    assert not np.allclose(unwindowed[2], want[2], atol=1e-3)  # beyond it: the window bites


def test_int8_weights_with_the_cache(models: Callable[..., Path]) -> None:
    path = models("qwen3")
    plain = Engine.from_pretrained(str(path), dtype="float32", quantization="int8")
    cached = Engine.from_pretrained(
        str(path), dtype="float32", quantization="int8", prefix_cache_bytes=BUDGET
    )
    want = plain.embed(TEXTS, prompt_name="query")
    for _ in range(2):
        assert_rows_close(cached.embed(TEXTS, prompt_name="query"), want, 0.9999)
    assert stats(cached)["hits"] == len(TEXTS)


async def test_a_started_engine_has_its_declared_prompts_cached(
    models: Callable[..., Path],
) -> None:
    """Start-up computes every prompt the model declares, so the first query reads it."""
    path = models("qwen3")
    engine = Engine.from_pretrained(str(path), dtype="float32", prefix_cache_bytes=BUDGET)
    await engine.start()
    try:
        assert stats(engine)["entries"] == 2  # query and other
        got = (await engine.aembed(TEXTS, prompt_name="other")).embeddings
        want = Engine.from_pretrained(str(path), dtype="float32").embed(TEXTS, prompt_name="other")
        assert_rows_close(got, want, 0.99999)
        assert stats(engine)["hits"] == len(TEXTS)
    finally:
        await engine.stop()


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_each_cache_their_heads(models: Callable[..., Path]) -> None:
    """Two gloo ranks: rank 0's cache decides, every rank computes and keeps its heads of
    each prefix, and drops them when rank 0 evicts (a budget of one prompt, prompts
    alternating: a worker that dropped one too early, or kept a stale one, would fail the
    forward pass or give other vectors)."""
    path = str(models("qwen3"))
    plain = Engine.from_pretrained(path, dtype="float32")
    with Engine.from_pretrained(
        path, dtype="float32", tensor_parallel_size=2, prefix_cache_bytes=BUDGET
    ) as parallel:
        want = plain.embed(TEXTS, prompt_name="query")
        for _ in range(2):
            assert_rows_close(parallel.embed(TEXTS, prompt_name="query"), want, 0.99999)
        counted = stats(parallel)
        assert (counted["misses"], counted["hits"]) == (len(TEXTS), len(TEXTS))
        one = counted["bytes"]  # rank 0's share of the query prompt, the longer one
    with Engine.from_pretrained(
        path, dtype="float32", tensor_parallel_size=2, prefix_cache_bytes=one
    ) as parallel:
        for name in ("query", "other", "query", "other", "other"):
            got = parallel.embed(TEXTS, prompt_name=name)
            assert_rows_close(got, plain.embed(TEXTS, prompt_name=name), 0.99999)
        counted = stats(parallel)
        assert counted["evictions"] == 3 and counted["hits"] == len(TEXTS)


def test_prefixes_and_drops_reach_tensor_parallel_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's broadcasts replayed into a worker's receive: the prefixes to compute, then a
    forward whose sequences continue them (one with none) and the prefixes to drop after
    it; the worker rebuilds the same positions and prefix plan."""
    from embedding_server.device import tensor_parallel
    from embedding_server.device.attention import Backend

    sent: list[torch.Tensor] = []
    monkeypatch.setattr(tensor_parallel.dist, "broadcast", lambda t, src: sent.append(t.clone()))
    cpu = torch.device("cpu")
    prefixes: list[tuple[int, ...] | None] = [(7, 8, 9), None, (7, 8, 9), (5,)]
    batch = PackedBatch.build([[1, 2], [3], [4, 5, 6], [2]], cpu, prefixes=prefixes)
    tensor_parallel._send(tensor_parallel._PREFIX, None, cpu, prefixes=[(7, 8, 9), (5,)])
    tensor_parallel._send(tensor_parallel._FORWARD, batch, cpu, drops=[(1, 2, 3, 4)])
    replay = iter(sent)
    monkeypatch.setattr(tensor_parallel.dist, "broadcast", lambda t, src: t.copy_(next(replay)))
    first = tensor_parallel._receive(cpu, Backend.SDPA_BUCKETED)
    assert first.kind == tensor_parallel._PREFIX and first.prefixes == ((7, 8, 9), (5,))
    second = tensor_parallel._receive(cpu, Backend.SDPA_BUCKETED)
    got = second.batch
    assert second.kind == tensor_parallel._FORWARD and got is not None and got.prefix is not None
    assert second.drops == ((1, 2, 3, 4),)
    assert got.position_ids.tolist() == [3, 4, 0, 3, 4, 5, 1]  # after each prefix
    assert batch.prefix is not None
    assert (got.prefix.keys, got.prefix.slots) == (batch.prefix.keys, batch.prefix.slots)
    assert [t.tolist() for t in got.prefix.tensors()] == [
        t.tolist() for t in batch.prefix.tensors()
    ]


def test_metrics_count_hits_misses_and_bytes(models: Callable[..., Path]) -> None:
    metrics = Metrics()
    engine = Engine.from_pretrained(
        str(models("qwen3")), dtype="float32", prefix_cache_bytes=BUDGET, metrics=metrics
    )
    engine.embed(TEXTS, prompt_name="query")
    engine.embed(TEXTS[:2], prompt_name="query")
    text = metrics.render(ready=True, loading=False).decode()
    assert f"embedding_server_prefix_cache_misses_total {float(len(TEXTS))}" in text
    assert "embedding_server_prefix_cache_hits_total 2.0" in text
    assert f"embedding_server_prefix_cache_bytes {float(stats(engine)['bytes'])}" in text


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"is_causal": False}, "attends bidirectionally"),
        ({"use_bidirectional_attention": True}, "attends bidirectionally"),
    ],
)
def test_bidirectional_decoders_refuse_the_cache(
    tmp_path: Path, overrides: dict[str, object], why: str
) -> None:
    path = causal_embedder(tmp_path, "qwen3", "mean", **overrides)
    Engine.from_pretrained(str(path), dtype="float32")  # served without it
    with pytest.raises(InvalidRequestError, match=why) as refused:
        Engine.from_pretrained(str(path), dtype="float32", prefix_cache_bytes=BUDGET)
    assert refused.value.param == "prefix_cache_bytes"


def test_an_encoder_and_the_transformers_backend_refuse_the_cache(
    models: Callable[..., Path], tiny_model: Callable[[str], Path]
) -> None:
    with pytest.raises(InvalidRequestError, match="not a decoder"):
        Engine.from_pretrained(str(tiny_model("bert")), prefix_cache_bytes=BUDGET)
    with pytest.raises(InvalidRequestError, match="transformers backend"):
        Engine.from_pretrained(
            str(models("qwen3")), backend="transformers", prefix_cache_bytes=BUDGET
        )


def test_attention_after_a_prefix_is_whole_sequence_causal_attention() -> None:
    """Random q/k/v of whole sequences: each sequence's own queries attending to its prefix's
    keys and its own equal the whole sequence's causal attention on those rows (GQA 4:2;
    prefixes shared, distinct and absent; own lengths 1 to 9)."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    prefixes: list[tuple[int, ...] | None] = [(1, 2, 3), None, (1, 2, 3), (7,) * 5, None, (7,) * 5]
    own = [4, 3, 1, 9, 1, 4]
    entries: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    whole_q, whole_k, whole_v, want_rows = [], [], [], []
    q_own, k_own, v_own = [], [], []
    for prefix, n in zip(prefixes, own, strict=True):
        p = 0 if prefix is None else len(prefix)
        if prefix is not None and prefix not in entries:
            entries[prefix] = (torch.randn(p, kv_heads, dim), torch.randn(p, kv_heads, dim))
        pk, pv = entries[prefix] if prefix is not None else (torch.zeros(0, kv_heads, dim),) * 2
        q = torch.randn(p + n, heads, dim)
        k, v = (
            torch.cat([pk, torch.randn(n, kv_heads, dim)]),
            torch.cat([pv, torch.randn(n, kv_heads, dim)]),
        )
        whole = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(2, 1).transpose(0, 1),
            v.repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True,
        ).transpose(0, 1)
        want_rows.append(whole[p:])
        q_own.append(q[p:])
        k_own.append(k[p:])
        v_own.append(v[p:])
        whole_q.append(q)
        whole_k.append(k)
        whole_v.append(v)
    batch = PrefixBatch.build(prefixes, own, torch.device("cpu"))
    bound = [
        PrefixEntry(key, entries[key][0][None], entries[key][1][None], torch.zeros(len(key), 1))
        for key in batch.keys
    ]
    batch.bind(bound)
    got = attend_after_prefix(
        torch.cat(q_own), torch.cat(k_own), torch.cat(v_own), batch, 0, scale=dim**-0.5
    )
    torch.testing.assert_close(got, torch.cat(want_rows), atol=1e-5, rtol=1e-5)
    assert batch.full_seqlens == tuple(
        n + (0 if p is None else len(p)) for p, n in zip(prefixes, own, strict=True)
    )


def test_the_lru_keeps_the_budget() -> None:
    def entry(key: int, tokens: int) -> PrefixEntry:
        states = torch.zeros(tokens, 4)
        return PrefixEntry((key,) * tokens, torch.zeros(1, tokens, 1, 4), states[None], states)

    size = entry(0, 2).nbytes
    cache = PrefixCache(2 * size)
    cache.put(entry(1, 2))
    cache.put(entry(2, 2))
    assert cache.get((1, 1)) is not None  # 1 is now the most recent
    cache.put(entry(3, 2))
    assert cache.get((2, 2)) is None and cache.get((1, 1)) is not None
    assert not cache.put(entry(4, 5))  # larger than the whole budget: not kept
    counted = cache.stats()
    assert (counted.entries, counted.bytes, counted.evictions) == (2, 2 * size, 1)
    with pytest.raises(ValueError, match="positive"):
        PrefixCache(0)

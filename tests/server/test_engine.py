"""The offline and async Engine API on the real all-MiniLM-L6-v2 and the fake backend."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from embedding_server.api.protocol import cohere_truncation, openai_truncation
from embedding_server.engine import Engine, StageTimings
from embedding_server.errors import (
    InputTooLongError,
    InvalidRequestError,
    NotReadyError,
    TooManyTokensError,
    UnsettledInputError,
)
from embedding_server.metrics import Metrics
from embedding_server.request.tokenization import TextTokenizer
from embedding_server.request.truncation import Truncation
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer

pytestmark = pytest.mark.timeout(120)

MIXED = [
    "a",  # [CLS] a [SEP]
    "The cat sat on the mat.",
    "Embeddings map text to vectors; similar meanings land close together. " * 3,
    "x",
    "A fairly long passage about continuous batching and token budgets, " * 30,  # > 256 tokens
    "short",
    "Pack all sequences of a batch into one tensor without padding.",
]


@pytest.fixture(scope="module")
def st_model() -> SentenceTransformer:
    from tests.support.models import MINILM_DIR

    return SentenceTransformer(str(MINILM_DIR), device="cpu")


@pytest.fixture(scope="module")
def st_reference(st_model: SentenceTransformer) -> np.ndarray:
    return np.asarray(st_model.encode(MIXED, batch_size=len(MIXED), convert_to_numpy=True))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_float32_parity_with_sentence_transformers(
    minilm_engine: Engine, st_reference: np.ndarray
) -> None:
    lengths = [len(ids) for ids in minilm_engine.tokenize(MIXED)]
    assert min(lengths) == 3 and max(lengths) > 256  # 1 content token .. over max
    result = minilm_engine.embed_full(MIXED)
    assert result.embeddings.dtype == np.float32 and result.embeddings.shape == (7, 384)
    assert cosines(result.embeddings, st_reference).min() >= 0.9999
    assert max(result.token_counts) == 256 and result.truncated_inputs == 1


def test_bfloat16_parity(st_reference: np.ndarray) -> None:
    engine = Engine.from_pretrained(dtype="bfloat16")
    assert engine.info().dtype == "bfloat16"
    vectors = engine.embed(MIXED)
    assert vectors.dtype == np.float32
    assert cosines(vectors, st_reference).min() >= 0.999


async def test_async_path_matches_offline_and_reports_usage(minilm_engine: Engine) -> None:
    metrics = Metrics()
    engine = Engine.from_pretrained(dtype="float32", metrics=metrics)
    offline = minilm_engine.embed(MIXED)
    assert not engine.ready
    with pytest.raises(NotReadyError):
        await engine.aembed(["too early"])
    await engine.start()
    try:
        assert engine.ready
        result = await engine.aembed(MIXED)
        np.testing.assert_allclose(result.embeddings, offline, atol=1e-5)
        assert result.prompt_tokens == sum(result.token_counts)
        assert result.truncated_inputs == 1
        assert isinstance(result.timings, StageTimings)
        assert result.timings.forward > 0 and result.timings.tokenize > 0
        assert result.timings.total >= result.timings.forward
        sample = metrics.registry.get_sample_value
        assert sample("embedding_server_input_tokens_total") == result.prompt_tokens
        assert sample("embedding_server_truncated_inputs_total") == 1
        assert sample("embedding_server_stage_seconds_count", {"stage": "forward"}) == 1
        assert (sample("embedding_server_model_load_seconds") or 0) > 0
        with pytest.raises(RuntimeError, match="await the async form"):
            engine.embed(["sync call inside the loop"])
        # a sync call from another thread goes through the running scheduler
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.update(v=engine.embed(MIXED[:2])))
        worker.start()
        while worker.is_alive():
            await asyncio.sleep(0.01)
        np.testing.assert_allclose(box["v"], offline[:2], atol=1e-5)
    finally:
        await engine.stop()
    assert not engine.ready


class _RecordingTokenizer:
    """A real tokenizer that remembers the longest text it was asked to encode."""

    def __init__(self, path: Path) -> None:
        self.inner = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.longest = 0
        self.calls = 0

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        self.longest = max([self.longest, *map(len, texts)])
        self.calls += 1
        return self.inner.encode_batch(texts, **kwargs)

    def encode_batch_fast(self, texts: list[str], **kwargs: Any) -> Any:
        self.longest = max([self.longest, *map(len, texts)])
        self.calls += 1
        return self.inner.encode_batch_fast(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_long_texts_are_read_through_windows_without_changing_any_result(
    minilm_dir: Path,
) -> None:
    recording = _RecordingTokenizer(minilm_dir)
    clipped = TextTokenizer(recording, max_length=32)  # type: ignore[arg-type]
    full = TextTokenizer(Tokenizer.from_file(str(minilm_dir / "tokenizer.json")), max_length=32)
    full.first_chars_per_token = 10**9  # the reference: every text tokenized whole
    first, _ = clipped.windows(32)
    prose = " ".join(f"word{i} and some-more text, é 日本" for i in range(2000))
    assert len(prose) > 100 * first
    cases = [
        prose,
        "hello" + " " * 5000 + "world",  # fits in 4 tokens whatever its length
        "x" * 5000,  # one giant word: a single [UNK]
        "a " * 5000 + "x" * 5000,  # ends in a giant word
        "x" * 5000 + " a" * 5000,  # starts with one
        "x" * 3 * first + " a" * 5000,  # a first word wider than the first window
    ]

    def result(tok: TextTokenizer, text: str, truncation: Truncation, prompt: str | None) -> object:
        try:
            out = tok.encode([text], truncation=truncation, prompt=prompt)
        except InputTooLongError:
            return "too long"
        return [(t.ids, t.prompt_length, t.truncated) for t in out]

    for text in cases:
        for truncation in (Truncation("right"), Truncation("left"), Truncation(None)):
            for prompt in (None, "query: "):
                assert result(clipped, text, truncation, prompt) == result(
                    full, text, truncation, prompt
                ), (text[:40], truncation, prompt)
    # Read and whole texts in one request (they take different tokenizer calls) come back
    # in order, each as it would alone.
    mixed = ["short one", prose, "another short text", cases[4], "end"]
    for truncation in (Truncation("right"), Truncation("left")):
        together = clipped.encode(mixed, truncation=truncation)
        alone = [full.encode([text], truncation=truncation)[0] for text in mixed]
        assert [t.ids for t in together] == [t.ids for t in alone]
    recording.longest = 0
    clipped.encode([prose, prose], truncation=Truncation("right"), prompt="query: ")
    assert recording.longest <= first + len("query: ")
    # A giant first word and then megabytes of short words: the windows widen past the
    # word and stop; the tokenizer never sees more than a few windows of it.
    recording.longest = 0
    attack = "x" * 3 * first + " a" * 1_000_000
    expected = full.encode([cases[-1]], truncation=Truncation("right"))[0].ids
    assert clipped.encode([attack], truncation=Truncation("right"))[0].ids == expected
    assert recording.longest <= 4 * first


def test_a_text_its_widest_window_does_not_settle_is_refused_not_read_whole(
    minilm_dir: Path,
) -> None:
    recording = _RecordingTokenizer(minilm_dir)
    tokenizer = TextTokenizer(recording, max_length=32)  # type: ignore[arg-type]
    _, widest = tokenizer.windows(32)
    giant = "x" * (widest + 1) + " a" * 20
    for truncation in (Truncation("right"), Truncation(None), Truncation("left")):
        text = giant if truncation.side != "left" else giant[::-1]
        with pytest.raises(UnsettledInputError) as refused:
            tokenizer.encode(["fine", text], truncation=truncation)
        assert refused.value.param == "input" and "input[1]" in refused.value.message
        assert f"at most {widest} characters" in refused.value.message
    assert recording.longest <= widest
    # A text the widest window holds whole is tokenized as it is.
    fits = tokenizer.encode(["x" * (widest - 50) + " a" * 20], truncation=Truncation("right"))[0]
    assert fits.ids[:2] == [101, 100]  # [CLS] [UNK]


def test_tokenize_refuses_an_over_long_prompt_after_reading_a_bounded_part(
    minilm_dir: Path,
) -> None:
    recording = _RecordingTokenizer(minilm_dir)
    tokenizer = TextTokenizer(recording, max_length=32)  # type: ignore[arg-type]
    for prompt in ("a " * 1_000_000, "x" * 3000 + " a" * 1_000_000):
        recording.longest = 0
        with pytest.raises(TooManyTokensError) as refused:
            tokenizer.tokenize(prompt, max_tokens=1000, param="prompt")
        assert refused.value.param == "prompt" and "at least" in refused.value.message
        assert recording.longest <= 8 * 1001
    exact = "x" * 3000 + " hello" * 100
    assert tokenizer.tokenize(exact, max_tokens=1000) == tokenizer.tokenize(exact)
    with pytest.raises(TooManyTokensError, match="holds 102 tokens"):
        tokenizer.tokenize("hello " * 100, max_tokens=101)


def test_a_request_over_its_limit_is_refused_before_all_its_texts_are_read(
    minilm_dir: Path,
) -> None:
    recording = _RecordingTokenizer(minilm_dir)
    tokenizer = TextTokenizer(recording, max_length=32)  # type: ignore[arg-type]
    texts = ["many words in every text " * 40] * 20_000  # 20 MB in all
    calls_before = recording.calls
    with pytest.raises(TooManyTokensError) as refused:
        tokenizer.encode(texts, truncation=Truncation("right"), max_total=64_000)
    assert "max_request_tokens" in refused.value.message
    assert recording.calls - calls_before <= 2  # a turn or two of reading, not all of it


def test_admission_estimates_are_never_less_than_what_the_texts_hold(minilm_dir: Path) -> None:
    """Queue room is reserved on the estimate while a request is tokenized, so a text that
    holds more tokens than its estimate says would let a crowd past admission and make the
    server tokenize what the queue then refuses: the estimate is an upper bound."""
    from tests.support.models import byte_tokenizer

    wordpiece = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    byte_level = byte_tokenizer(["<s>", "</s>", "<unk>"], "<s> $A </s>", ["<s>", "</s>"])
    hostile = [
        "a a a a a a a a",  # a token per two characters
        ",.;:!?" * 20,  # a token per character
        "日本語の文章" * 20,  # a token per character, or per byte on byte-level BPE
        "\U0001f600" * 20,  # four bytes a character
        "hello",
    ]
    for backend in (wordpiece, byte_level):
        tokenizer = TextTokenizer(backend, max_length=512)
        right = Truncation("right")
        for text in hostile:
            holds = len(tokenizer.encode([text], truncation=right)[0].ids)
            estimate = tokenizer.admission_estimate([text], right, None).bound
            assert estimate >= holds, (backend is byte_level, text[:12], estimate, holds)
            prompted = len(tokenizer.encode([text], truncation=right, prompt="query: ")[0].ids)
            estimate = tokenizer.admission_estimate([text], right, "query: ").bound
            assert estimate >= prompted
    pairs = TextTokenizer(wordpiece, max_length=512)
    for a in hostile:
        for b in hostile:
            holds = len(pairs.encode_pairs([(a, b)], truncation=Truncation("right"))[0].ids)
            assert pairs.pair_estimate([(a, b)], Truncation("right")).bound >= holds


def test_input_ids_must_be_rows_of_the_embedding_table_too(minilm_dir: Path) -> None:
    # A checkpoint whose embedding table is smaller than its tokenizer's vocabulary: an id
    # the tokenizer knows but the table lacks would be an out-of-range row (a device assert
    # that poisons the whole batch on CUDA), so it is refused before it is queued.
    backend = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tokenizer = TextTokenizer(backend, max_length=32, embedding_rows=30000)
    with pytest.raises(InvalidRequestError) as err:
        tokenizer.encode([[101, 30000, 102]], truncation=Truncation())
    assert err.value.param == "input" and "30000" in err.value.message
    assert tokenizer.encode([[101, 29999, 102]], truncation=Truncation())[0].ids[1] == 29999
    assert tokenizer.detokenize([30100])  # decoding needs no table row


def test_token_ids_are_accepted_and_equal_the_text(minilm_engine: Engine) -> None:
    ids = minilm_engine.tokenize(["hello there", "general kenobi"])
    np.testing.assert_allclose(
        minilm_engine.embed(ids), minilm_engine.embed(["hello there", "general kenobi"]), atol=1e-6
    )
    single = minilm_engine.embed(ids[0])  # one list[int] = one input
    assert single.shape == (1, 384)
    content = minilm_engine.tokenize("hello there", add_special_tokens=False)[0]
    assert minilm_engine.detokenize(ids[0]) == "hello there"
    assert len(content) == len(ids[0]) - 2
    raw = minilm_engine.embed(["hello there"], add_special_tokens=False)
    np.testing.assert_allclose(raw, minilm_engine.embed([content]), atol=1e-6)


def test_truncation_sides_and_refusal(minilm_engine: Engine) -> None:
    text = " ".join(f"word{i}" for i in range(300))
    ids = minilm_engine.tokenize(text)[0]
    assert len(ids) > 256
    cls, sep, content = ids[0], ids[-1], ids[1:-1]
    right = minilm_engine.embed([text], truncate="right")
    np.testing.assert_allclose(right, minilm_engine.embed([[cls, *content[:254], sep]]), atol=1e-6)
    left = minilm_engine.embed([text], truncate=Truncation(side="left"))
    np.testing.assert_allclose(left, minilm_engine.embed([[cls, *content[-254:], sep]]), atol=1e-6)
    short = minilm_engine.embed_full([text], truncate=openai_truncation(10))
    assert short.token_counts == [10] and short.truncated_inputs == 1
    np.testing.assert_allclose(
        short.embeddings, minilm_engine.embed([[cls, *content[:8], sep]]), atol=1e-6
    )
    with pytest.raises(InputTooLongError) as err:
        minilm_engine.embed(["fine", text], truncate=False)
    assert err.value.param == "input" and err.value.max_tokens == 256
    # The text is longer than the tokenizer is shown (it is clipped, see tokenization.py),
    # so the count is a floor that already proves it too long.
    assert 256 < err.value.token_count <= len(ids) and "input[1]" in err.value.message
    with pytest.raises(InputTooLongError):
        minilm_engine.embed([text], truncate=cohere_truncation("NONE"))
    with pytest.raises(InvalidRequestError) as too_big:
        minilm_engine.embed([text], truncate=openai_truncation(1000))
    assert too_big.value.param == "truncate_prompt_tokens"
    whole = minilm_engine.embed_full([text], truncate=openai_truncation(-1))
    assert whole.token_counts == [256]


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("", "empty string"),
        ([], "empty list"),
        (["ok", ""], "input[1] must not be an empty string"),
        (["ok", 3.5], "input[1] must be a string"),
        ({"text": "x"}, "got dict"),
        (None, "got NoneType"),
        ([["a"]], "input[0]"),
        ([[1, 2], []], "input[1] must not be an empty token list"),
        ([[1, 99999999]], "token ids must be integers in [0, 30522)"),
    ],
)
def test_bad_input_is_a_typed_error_naming_the_field(
    minilm_engine: Engine, bad: Any, fragment: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        minilm_engine.embed(bad)
    assert err.value.param == "input"
    assert fragment in err.value.message


def test_score_is_cosine(minilm_engine: Engine) -> None:
    a = ["a cat", "a dog", "a car"]
    b = ["a kitten", "a puppy", "an automobile"]
    va, vb = minilm_engine.embed(a), minilm_engine.embed(b)
    np.testing.assert_allclose(minilm_engine.score(a, b), np.sum(va * vb, axis=1), atol=1e-6)
    one_to_many = minilm_engine.score("a cat", b)
    assert one_to_many.shape == (3,) and int(np.argmax(one_to_many)) == 0
    with pytest.raises(InvalidRequestError) as err:
        minilm_engine.score(a, b[:2])
    assert err.value.param == "text_2"


def test_prompts_on_the_fake_backend() -> None:
    engine = Engine.from_pretrained("fake?dim=16")
    np.testing.assert_allclose(
        engine.embed(["cats"], prompt_name="query"), engine.embed(["query: cats"]), atol=1e-6
    )
    np.testing.assert_allclose(
        engine.embed(["cats"], prompt="passage: "), engine.embed(["passage: cats"]), atol=1e-6
    )
    with pytest.raises(InvalidRequestError) as err:
        engine.embed(["cats"], prompt_name="nope")
    assert err.value.param == "prompt_name" and "query" in err.value.message
    with pytest.raises(InvalidRequestError):
        engine.embed(["cats"], prompt="x", prompt_name="query")
    defaulted = Engine.from_pretrained("fake?dim=16", default_prompt_name="query")
    np.testing.assert_allclose(defaulted.embed(["cats"]), engine.embed(["query: cats"]), atol=1e-6)


def test_per_token_embeddings(minilm_engine: Engine, st_model: SentenceTransformer) -> None:
    texts = ["one", "a somewhat longer sentence"]
    ours = minilm_engine.embed_tokens(texts)
    theirs = st_model.encode(texts, output_value="token_embeddings")
    for got, want in zip(ours, theirs, strict=True):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, np.asarray(want), atol=1e-4)


async def test_async_token_and_score_results() -> None:
    engine = Engine.from_pretrained("fake?dim=16")
    async with engine:
        tokens = await engine.aembed_tokens(["ab", "abc"])
        assert [t.shape for t in tokens.embeddings] == [(4, 16), (5, 16)]
        assert tokens.token_ids[0] == engine.tokenize("ab")[0]
        assert tokens.prompt_tokens == 9
        scored = await engine.ascore("abc", ["abc", "xyz"])
        assert scored.scores[0] == pytest.approx(1.0, abs=1e-6) and scored.scores[1] < 1
        assert await engine.atokenize("ab") == engine.tokenize("ab")


@pytest.fixture
def cpu_flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    from embedding_server.device import dtypes

    flags: set[str] = set()
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(dtypes.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    yield flags


def test_auto_dtype_on_cpu_follows_bf16_support(cpu_flags: set[str]) -> None:
    import torch
    from embedding_server.device.dtypes import resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    cpu_flags.add("avx512_bf16")
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16


def test_batch_budget_defaults_to_a_cache_sized_batch_on_cpu(minilm_engine: Engine) -> None:
    from embedding_server.settings import CPU_BATCH_TOKENS

    assert minilm_engine.info().device == "cpu"
    assert minilm_engine.info().max_batch_tokens == CPU_BATCH_TOKENS
    # never below one maximal input, however long the model's inputs may be
    long_inputs = Engine.from_pretrained(f"fake?dim=8&max_len={CPU_BATCH_TOKENS * 2}")
    assert long_inputs.info().max_batch_tokens == CPU_BATCH_TOKENS * 2
    # a smaller queue budget bounds the default; an explicit value always wins
    small_queue = Engine.from_pretrained("fake?dim=8&max_len=64", max_queue_tokens=1000)
    assert small_queue.info().max_batch_tokens == 1000
    explicit = Engine.from_pretrained("fake?dim=8&max_len=64", max_batch_tokens=300)
    assert explicit.info().max_batch_tokens == 300


def test_batch_budget_that_cannot_hold_one_input_names_the_setting() -> None:
    with pytest.raises(InvalidRequestError) as too_small:
        Engine.from_pretrained("fake?dim=8&max_len=512", max_batch_tokens=100)
    assert too_small.value.param == "max_batch_tokens"
    with pytest.raises(InvalidRequestError) as queue:
        Engine.from_pretrained("fake?dim=8&max_len=512", max_queue_tokens=100)
    assert queue.value.param == "max_queue_tokens"
    assert "512" in str(queue.value)


def test_token_states_of_a_mixed_batch_are_each_sequences_own(minilm_engine: Engine) -> None:
    """In one batch where only some sequences ask for per-token states, each gets exactly
    its own rows (the states leave the device in one copy, then are split on the host)."""
    from embedding_server.request.sequences import SequenceInput

    seqs = minilm_engine.tokenize(["a", "a much longer input than the first", "mid length"])
    alone = [minilm_engine.embed_tokens([s])[0] for s in seqs]
    runner = minilm_engine._runner
    for wanted in ([True, False, True], [False, True, False], [True, True, True]):
        out = runner.run(
            [SequenceInput(s, want_tokens=w) for s, w in zip(seqs, wanted, strict=True)]
        )
        for got, want, asked in zip(out.tokens, alone, wanted, strict=True):
            if asked:
                assert got is not None and got.shape == want.shape
                np.testing.assert_allclose(got, want, atol=1e-5)
            else:
                assert got is None


async def test_the_servers_own_probes_do_not_count_as_queries_for_the_bulk_cap() -> None:
    # The golden vectors are embedded at start-up with serve_unrecorded: were they a query,
    # every bulk batch of the next minute would be cut to --bulk-batch-ms (here well under a
    # token), and an indexing-only service would run at a fraction of its speed.
    from embedding_server.request.tasks.embed import embed

    engine = Engine.from_pretrained("fake?dim=16", bulk_batch_ms=1e-6)
    async with engine:
        full = engine.scheduler.max_batch_tokens
        probe = await engine.serve_unrecorded(embed, ["golden probe", "another"])
        assert probe.embeddings.shape == (2, 16)
        assert engine.scheduler.tokens_per_s > 0  # a rate to cap by is measured
        assert engine.scheduler.bulk_room() == full
        await engine.aembed(["a client's query"])
        assert engine.scheduler.bulk_room() < full  # a query came: bulk batches are cut short

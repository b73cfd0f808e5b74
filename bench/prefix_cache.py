"""Short queries after a long instruction, with and without the prompt-prefix cache.

Not a test: a measurement. A Qwen3-Embedding-0.6B-shaped body (28 layers, 1024 wide, 16
query and 8 key heads of 128, MLP 3072; random weights, built once and kept under
``~/.cache/embedding-operator/bench-models``) with Qwen3-Embedding's recipe (last-token
pooling, Normalize, its ``query`` instruction ``Instruct: Given a web search query, retrieve
relevant passages that answer the query\\nQuery:``), tokenized with the packaged MiniLM's
WordPiece vocabulary (the instruction is 19 tokens there, ``[CLS]`` included; the figures
print the counts). Two engines in one process, one with ``--prefix-cache-bytes``, take turns:

* throughput: ``--queries`` queries of 5 to 20 tokens, ``Engine.embed`` 32 at a time with
  ``prompt_name="query"``, ``--rounds`` rounds each (the median round counts);
* latency: ``--latency`` queries one at a time (p50);
* how the gain falls as queries grow: the same at longer queries (``--lengths``), fewer of
  them, one round;
* the cache's memory, and the cosine of the cached vectors to the uncached ones.

Printed against the target (2x queries/s with p50 no worse), and written to
``bench/out/prefix_cache.json``.

    .venv/bin/python -m bench.prefix_cache [--dtypes float32,bfloat16] [--queries 64]
        [--rounds 3] [--latency 16] [--lengths 40,80,160] [--shape qwen3-0.6b|tiny]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import write_results
from bench.models import copy_tokenizer
from bench.offline import FAMILIES

INSTRUCTION = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
_BODY_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-Embedding-0.6B's body, as bench.offline's qwen3 family has it.
    "qwen3-0.6b": {key: FAMILIES["qwen3"][1][key] for key in _BODY_KEYS},
    "tiny": dict(zip(_BODY_KEYS, (64, 2, 4, 2, 16, 128), strict=True)),  # the e2e smoke's
}
TARGET = 2.0
BATCH = 32
BUDGET = 256 * 1024 * 1024
MODELS = Path.home() / ".cache" / "embedding-operator" / "bench-models"


def build(shape: str) -> Path:
    """The model directory of ``shape``, built there unless it already is."""
    from embedding_server.device.hub import resolve_model_path
    from embedding_server.settings import DEFAULT_MODEL
    from transformers import Qwen3Config, Qwen3Model

    path = MODELS / f"{shape}-shaped-embedder"
    if (path / "modules.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(path)
    source = resolve_model_path(DEFAULT_MODEL)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = Qwen3Config(
        vocab_size=vocab,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        **SHAPES[shape],
    )
    Qwen3Model(config).save_pretrained(path)
    width = SHAPES[shape]["hidden_size"]
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": width, "pooling_mode_lasttoken": True})
    )
    (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192}))
    (path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": INSTRUCTION, "document": ""}})
    )
    modules = [
        ("0", "", "Transformer"),
        ("1", "1_Pooling", "Pooling"),
        ("2", "2_Normalize", "Normalize"),
    ]
    (path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": n, "path": p, "type": f"sentence_transformers.models.{t}"}
                for i, (n, p, t) in enumerate(modules)
            ]
        )
    )
    return path


def queries(engine: Any, count: int, low: int, high: int, seed: int) -> list[str]:
    """``count`` queries of ``low``..``high`` tokens each (the text's own, special tokens
    included, without the instruction), from random words."""
    from bench.corpus import make_corpus

    words = " ".join(make_corpus(200, seed=seed)).lower().replace(".", "").split()
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        want = rng.randint(low, high)
        text = " ".join(rng.choices(words, k=want))
        ids = engine.tokenize([text])[0]
        while len(ids) > want and " " in text:
            text = text.rsplit(" ", 1)[0]
            ids = engine.tokenize([text])[0]
        out.append(text)
    return out


def throughput(engine: Any, texts: list[str]) -> float:
    started = time.perf_counter()
    for start in range(0, len(texts), BATCH):
        engine.embed(texts[start : start + BATCH], prompt_name="query")
    return len(texts) / (time.perf_counter() - started)


def latency_p50(engine: Any, texts: list[str]) -> float:
    seconds = []
    for text in texts:
        started = time.perf_counter()
        engine.embed([text], prompt_name="query")
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def measure(path: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    from embedding_server.engine import Engine

    engines = {
        "off": Engine.from_pretrained(str(path), dtype=dtype),
        "on": Engine.from_pretrained(str(path), dtype=dtype, prefix_cache_bytes=BUDGET),
    }
    probe = engines["off"]
    prompt = len(probe.tokenize([INSTRUCTION])[0]) - 1  # less the [SEP] a text ends with
    short = queries(probe, args.queries, 5, 20, seed=1)
    for engine in engines.values():  # warm-up: kernels, and the cache's one entry
        engine.embed(short[:BATCH], prompt_name="query")
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for mode, engine in engines.items():
            rates[mode].append(throughput(engine, short))
    lat = queries(probe, args.latency, 5, 20, seed=2)
    p50 = {mode: latency_p50(engine, lat) for mode, engine in engines.items()}
    vectors = {m: engines[m].embed(short, prompt_name="query") for m in engines}
    cache = engines["on"]._runner.prefix_cache
    assert cache is not None
    stats = cache.stats()
    qps = {mode: statistics.median(r) for mode, r in rates.items()}
    sweep = []
    for length in args.lengths:
        texts = queries(probe, max(BATCH // 2, 8), length, length, seed=length)
        got = {mode: throughput(engine, texts) for mode, engine in engines.items()}
        sweep.append({"tokens": length, "qps": got, "ratio": got["on"] / got["off"]})
    mean_tokens = statistics.mean(len(t) for t in probe.tokenize(short))
    return {
        "dtype": str(probe.info().dtype),
        "prompt_tokens": prompt,
        "query_tokens_mean": mean_tokens,
        "qps": qps,
        "qps_rounds": rates,
        "ratio": qps["on"] / qps["off"],
        "p50_s": p50,
        "p50_ratio": p50["on"] / p50["off"],
        "cache_bytes": stats.bytes,
        "cache_entries": stats.entries,
        "cache_hits": stats.hits,
        "cos_min": cosine_min(vectors["on"], vectors["off"]),
        "longer": sweep,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=int, default=16)
    parser.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[40, 80, 160]
    )
    args = parser.parse_args()
    from embedding_server.device.dtypes import cpu_flags

    started = time.perf_counter()
    path = build(args.shape)
    built = time.perf_counter() - started
    print(f"model: {args.shape}-shaped Qwen3 embedder at {path} ({built:.0f} s)")
    if not cpu_flags() & {"amx_bf16", "avx512_bf16"}:
        print("no native bfloat16 matmuls on this CPU: bfloat16 runs emulated here")
    runs = []
    for dtype in args.dtypes.split(","):
        run = measure(path, dtype, args)
        runs.append(run)
        qps, p50 = run["qps"], run["p50_s"]
        met = "met" if run["ratio"] >= TARGET and run["p50_ratio"] <= 1.0 else "missed"
        print(
            f"{run['dtype']}: instruction {run['prompt_tokens']} tokens, queries "
            f"{run['query_tokens_mean']:.1f} tokens on average"
        )
        print(
            f"  queries/s: cache {qps['on']:.1f}, none {qps['off']:.1f}: "
            f"{run['ratio']:.2f}x (target >= {TARGET:g}x) {met}"
        )
        print(
            f"  p50 of one query: cache {p50['on'] * 1e3:.1f} ms, none {p50['off'] * 1e3:.1f} ms:"
            f" {run['p50_ratio']:.2f}x (target <= 1x)"
        )
        print(
            f"  cache: {run['cache_entries']} prefix, {run['cache_bytes'] / 2**20:.2f} MiB; "
            f"cosine to uncached min {run['cos_min']:.6f}"
        )
        for point in run["longer"]:
            print(
                f"  queries of {point['tokens']} tokens: {point['ratio']:.2f}x "
                f"({point['qps']['on']:.1f} / {point['qps']['off']:.1f} queries/s)"
            )
    write_results("prefix_cache", {"shape": args.shape, "target": TARGET, "runs": runs})


if __name__ == "__main__":
    main()

"""Tensor parallelism: the same model and corpus on one rank and on N ranks.

Not a test: a measurement. For ``--tensor-parallel-size`` 1 and N (default 2) it prints

* the weight bytes each rank holds (built rank by rank with ``load_shard``, as each rank
  builds its own): with N ranks each should hold about 1/N of the attention and MLP weights,
  plus the replicated embeddings and norms;
* bulk throughput (``engine.embed`` over the deterministic corpus, bench/corpus.py),
  texts/s and tokens/s, with the CPU seconds of all ranks together;
* latency of single-text calls, p50 and p99;
* the cosine agreement of N ranks' vectors with one rank's.

On a CPU whose cores the ranks share, N ranks do the same arithmetic plus the all-reduces,
so throughput is not expected to improve there: tensor parallelism is for models that do not
fit, or do not run fast enough, on one GPU. Raw figures go to bench/out/tensor_parallel.json.

    .venv/bin/python -m bench.tensor_parallel --texts 200
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any, get_args

import numpy as np
import torch
from embedding_server.device.distributed import Shard
from embedding_server.device.dtypes import resolve_device
from embedding_server.device.loading import load_shard
from embedding_server.engine import Engine
from embedding_server.settings import DEFAULT_MODEL, Dtype

from bench import out_dir, write_results
from bench.corpus import make_corpus
from bench.processes import cpu_seconds

OUT = out_dir()


@dataclass
class Run:
    tensor_parallel_size: int
    weight_bytes_per_rank: list[int]
    seconds: float
    cpu_seconds: float
    texts_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    cos_min_vs_tp1: float


def tensor_bytes(root: object) -> int:
    """Bytes of the distinct tensor storages reachable from a model's attributes."""
    storages: dict[int, int] = {}

    def walk(obj: object, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, list | tuple):
            for item in obj:
                walk(item, depth)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth)
        elif depth < 4 and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                walk(item, depth + 1)

    walk(root, 0)
    return sum(storages.values())


def weights_per_rank(model: str, size: int, dtype: Dtype) -> list[int]:
    device = resolve_device("cpu")
    return [
        tensor_bytes(
            load_shard(
                model,
                revision=None,
                cache_dir=None,
                dtype=dtype,
                device=device,
                shard=Shard(rank, size),
            )
        )
        for rank in range(size)
    ]


def measure(
    model: str, size: int, dtype: Dtype, corpus: list[str], requests: int, reference: Any
) -> tuple[Run, np.ndarray]:
    with Engine.from_pretrained(model, dtype=dtype, tensor_parallel_size=size) as engine:
        tokens = sum(len(ids) for ids in engine.tokenize(corpus))
        engine.embed(corpus[:16])  # warm-up
        cpu, start = cpu_seconds(), time.perf_counter()
        vectors = engine.embed(corpus)
        seconds = time.perf_counter() - start
        cpu_used = cpu_seconds() - cpu
        latencies = []
        for text in corpus[:requests]:
            begun = time.perf_counter()
            engine.embed([text])
            latencies.append(time.perf_counter() - begun)
    want = vectors if reference is None else reference
    cos = (vectors * want).sum(1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(want, axis=1))
    run = Run(
        tensor_parallel_size=size,
        weight_bytes_per_rank=weights_per_rank(model, size, dtype),
        seconds=seconds,
        cpu_seconds=cpu_used,
        texts_per_s=len(corpus) / seconds,
        tokens_per_s=tokens / seconds,
        p50_ms=1000 * float(np.percentile(latencies, 50)),
        p99_ms=1000 * float(np.percentile(latencies, 99)),
        cos_min_vs_tp1=float(cos.min()),
    )
    return run, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model directory or Hub id")
    parser.add_argument("--texts", type=int, default=200, help="corpus size for throughput")
    parser.add_argument("--requests", type=int, default=100, help="single-text calls timed")
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="N to compare")
    parser.add_argument("--dtype", default="float32", choices=get_args(Dtype))
    args = parser.parse_args()

    corpus = make_corpus(args.texts)
    one, reference = measure(args.model, 1, args.dtype, corpus, args.requests, None)
    many, _ = measure(
        args.model, args.tensor_parallel_size, args.dtype, corpus, args.requests, reference
    )
    runs = [one, many]
    print(
        f"model {args.model}, {args.texts} texts, {args.requests} single-text calls, {args.dtype}"
    )
    print(
        f"{'TP':>3} {'weights/rank MiB':>18} {'texts/s':>8} {'tokens/s':>9} "
        f"{'CPU s':>6} {'p50 ms':>7} {'p99 ms':>7} {'cos min':>9}"
    )
    for run in runs:
        per_rank = "/".join(f"{b / 2**20:.1f}" for b in run.weight_bytes_per_rank)
        print(
            f"{run.tensor_parallel_size:>3} {per_rank:>18} {run.texts_per_s:>8.1f} "
            f"{run.tokens_per_s:>9.0f} {run.cpu_seconds:>6.2f} {run.p50_ms:>7.1f} "
            f"{run.p99_ms:>7.1f} {run.cos_min_vs_tp1:>9.6f}"
        )
    n = args.tensor_parallel_size
    weights = max(many.weight_bytes_per_rank) / one.weight_bytes_per_rank[0]
    print(
        f"TP={n} vs TP=1: weights per rank x{weights:.2f}, "
        f"throughput x{many.texts_per_s / one.texts_per_s:.2f}, "
        f"p50 x{many.p50_ms / one.p50_ms:.2f}, p99 x{many.p99_ms / one.p99_ms:.2f}"
    )
    write_results("tensor_parallel", {"model": args.model, "runs": [asdict(r) for r in runs]})
    print(f"wrote {out_dir() / 'tensor_parallel.json'}")


if __name__ == "__main__":
    main()

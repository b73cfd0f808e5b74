"""Scheduler throughput: concurrent requests through the engine's batching loop, no HTTP.

Not a test: a measurement. Sends the deterministic mixed-length corpus (bench/corpus.py) as
requests of ``--per-request`` texts, ``--concurrency`` at a time, through ``Engine.aembed``
(tokenizer pool, scheduler, forward thread) and prints texts/s, tokens/s, process CPU
seconds, the batches run, the mean batch, and the *device gap*: the median time from the end
of one model forward pass to the start of the next, which is what the device idles between
batches (on CUDA the host's part of it: pooling and the copy back are still in it). Best of
``--repeats``. Besides the public Engine API it only wraps the model's ``forward`` (to time
it), so the same script measures another checkout: run it with that checkout's interpreter
from this directory and compare back to back (the machine is shared).

    .venv/bin/python -m bench.scheduler --texts 512
    .venv/bin/python -m bench.scheduler --model "fake?dim=384&delay_ms=20"  # a slow "device"

The fake model's ``delay_ms`` sleeps in the forward thread the way a GPU keeps the host
waiting, so it shows what preparing the next batch during a forward pass hides.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from embedding_server.engine import Engine
from embedding_server.settings import DEFAULT_MODEL

from bench import write_results
from bench.corpus import make_corpus


@dataclass
class Run:
    seconds: float
    cpu_seconds: float
    texts_per_s: float
    tokens_per_s: float
    batches: int
    mean_batch: float
    gap_ms: float


class ForwardTimes:
    """Wraps a model's forward pass to record when each one starts and ends."""

    def __init__(self, model: Any) -> None:
        self.spans: list[tuple[float, float]] = []
        forward = model.forward

        def timed(batch: Any) -> Any:
            start = time.perf_counter()
            try:
                return forward(batch)
            finally:
                self.spans.append((start, time.perf_counter()))

        model.forward = timed

    def median_gap_ms(self) -> float:
        gaps = [b[0] - a[1] for a, b in itertools.pairwise(self.spans)]
        return 1000 * statistics.median(gaps) if gaps else 0.0


async def measure(
    engine: Engine, requests: list[list[str]], concurrency: int, times: ForwardTimes
) -> Run:
    tokens = sum(len(ids) for ids in engine.tokenize([t for r in requests for t in r]))
    limit = asyncio.Semaphore(concurrency)

    async def one(texts: list[str]) -> None:
        async with limit:
            await engine.aembed(texts)

    batches_before = engine.scheduler.batches_run
    times.spans.clear()
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    texts = sum(len(r) for r in requests)
    batches = engine.scheduler.batches_run - batches_before
    return Run(
        wall,
        cpu,
        texts / wall,
        tokens / wall,
        batches,
        texts / max(1, batches),
        times.median_gap_ms(),
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--per-request", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings: dict[str, Any] = {"dtype": args.dtype}
    if args.max_batch_tokens is not None:
        settings["max_batch_tokens"] = args.max_batch_tokens
    engine = Engine.from_pretrained(args.model, **settings)
    corpus = make_corpus(args.texts, max_words=120)
    n = args.per_request
    requests = [corpus[i : i + n] for i in range(0, len(corpus), n)]
    times = ForwardTimes(engine._runner.model)  # the one look inside: timing the forward
    await engine.start()
    try:
        warm = requests[: max(1, len(requests) // 8)]
        await measure(engine, warm, args.concurrency, times)
        runs = [
            await measure(engine, requests, args.concurrency, times) for _ in range(args.repeats)
        ]
    finally:
        await engine.stop()
    best = max(runs, key=lambda r: r.texts_per_s)
    report = {"model": args.model, "best": asdict(best), "runs": [asdict(r) for r in runs]}
    write_results("scheduler", report)
    print(json.dumps(report))  # the last line: the e2e tier's smoke run reads it


if __name__ == "__main__":
    asyncio.run(main())

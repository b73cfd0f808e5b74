"""Serving-shaped batches in bfloat16 on the CPU, with and without the token-count grid.

Not a test: a measurement. A server's batches have a new token count almost every time, and
oneDNN (torch's bfloat16 matmuls on the CPU) compiles a kernel for each shape it meets and
keeps 1,024 of them. The runner pads CPU batches in bfloat16/float16 to a grid of sizes
(``embedding_server.device.runner.token_grid``) with one-token filler sequences, so a few
dozen shapes are compiled once and then reused. This script measures what that buys.

Each mode runs in a fresh process (oneDNN's kernel cache is per process), in turns: the
packaged all-MiniLM-L6-v2 in bfloat16 embeds ``--texts`` texts of the benchmark corpus, cut
into batches of 1 to 32 texts drawn at random (a new cut, and a new order, every round), by
``Engine.embed`` one batch at a time, ``--rounds`` times. The first round of a process
compiles the kernels its shapes need; the later ones are the steady state of a long-running
server. Prints each round, the best steady round of each mode and their ratio, and the cosine
of the grid's vectors to the ungridded ones'. On a CPU without native bfloat16 matmuls the
script says so and measures anyway (oneDNN still runs them).

    .venv/bin/python -m bench.shape_grid [--texts 600] [--rounds 3] [--turns 2]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bench import out_dir, write_results

OUT = out_dir()


def worker(grid: bool, texts: int, rounds: int, seed: int) -> dict[str, Any]:
    """One process's rounds (run with ``--worker``): seconds per round, and the vectors of
    the last round in corpus order."""
    from embedding_server.engine import Engine

    from bench.corpus import make_corpus

    corpus = make_corpus(texts)
    engine = Engine.from_pretrained(dtype="bfloat16")
    engine._runner.shape_grid = grid  # the setting under test (on by default here)
    engine.embed(corpus[:4])
    rng = random.Random(seed)
    seconds, cpu = [], []
    vectors = np.zeros((0,), dtype=np.float32)
    for _ in range(rounds):
        order = list(range(len(corpus)))
        rng.shuffle(order)
        batches: list[list[int]] = []
        while sum(map(len, batches)) < len(order):
            start = sum(map(len, batches))
            batches.append(order[start : start + rng.randint(1, 32)])
        started, cpu_started = time.perf_counter(), time.process_time()
        outs = [np.asarray(engine.embed([corpus[i] for i in batch])) for batch in batches]
        seconds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
        vectors = np.empty((len(corpus), outs[0].shape[1]), dtype=np.float32)
        for batch, out in zip(batches, outs, strict=True):
            vectors[batch] = out
    return {"seconds": seconds, "cpu": cpu, "vectors": vectors.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=2, help="processes per mode, alternating")
    parser.add_argument("--worker", choices=["grid", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.worker == "grid", args.texts, args.rounds, args.seed)
        sys.stdout.write(json.dumps(result))
        return

    from embedding_server.device.dtypes import cpu_flags

    isa = sorted(cpu_flags() & {"amx_bf16", "avx512_bf16", "avx512f", "avx2"})
    print(f"ISA: {', '.join(isa) or 'none of avx2/avx512/amx'}")
    if not cpu_flags() & {"amx_bf16", "avx512_bf16"}:
        print("no native bfloat16 matmuls on this CPU: --dtype auto would pick float32 here")
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "grid": []}
    for turn in range(args.turns):
        for mode in ("plain", "grid"):
            command = [sys.executable, "-m", "bench.shape_grid", "--worker", mode]
            command += ["--texts", str(args.texts), "--rounds", str(args.rounds)]
            command += ["--seed", str(turn)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout)
            runs[mode].append(result)
            rounds = ", ".join(
                f"{s:.2f}s (cpu {c:.1f}s)"
                for s, c in zip(result["seconds"], result["cpu"], strict=True)
            )
            print(f"  turn {turn + 1} {mode:<5} rounds: {rounds}", flush=True)
    best: dict[str, float] = {}
    first: dict[str, float] = {}
    for mode, results in runs.items():
        first[mode] = min(r["seconds"][0] for r in results)
        steady = [s for r in results for s in r["seconds"][1:]] or [
            r["seconds"][0] for r in results
        ]
        best[mode] = min(steady)
    plain = np.asarray(runs["plain"][-1]["vectors"])
    grid = np.asarray(runs["grid"][-1]["vectors"])
    cosines = (plain * grid).sum(1) / (np.linalg.norm(plain, axis=1) * np.linalg.norm(grid, axis=1))
    print(f"{args.texts} texts in batches of 1-32, bfloat16:")
    print(f"  steady (best later round): plain {best['plain']:.2f}s, grid {best['grid']:.2f}s")
    print(f"  grid / plain speed, steady: {best['plain'] / best['grid']:.2f}x")
    print(f"  grid / plain speed, first round: {first['plain'] / first['grid']:.2f}x")
    print(f"  cosine grid vs plain: min {cosines.min():.6f}")
    summary = {"isa": isa, "best": best, "first": first, "cos_min": float(cosines.min())}
    write_results("shape_grid", summary)


if __name__ == "__main__":
    main()

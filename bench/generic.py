"""The transformers backend against sentence-transformers, on the same model and texts.

Not a test: a measurement. The transformers backend (``--backend transformers``) runs
transformers' own model class, as sentence-transformers does, so the question is only
whether our batching around it (continuous batches of ``max_batch_tokens``, length-sorted,
cut into padded groups of similar lengths) is as fast as sentence-transformers'
``encode`` (length-sorted, ``batch_size`` texts padded together). The target is "no slower".

Two models, each embedding the deterministic mixed-length corpus (bench/corpus.py):

* ``t5``: a random T5 encoder shaped like gtr-t5-base (12 layers, d_model 768, d_ff 3072,
  ReLU) wrapped as gtr-t5 is (mean pooling, a 768x768 Dense, Normalize), with MiniLM's
  WordPiece tokenizer so that texts have realistic token counts: the long tail's own path.
* ``minilm``: the packaged all-MiniLM-L6-v2 forced through ``backend="transformers"``, with
  the native packed path beside it for scale.

Prints texts/s, CPU seconds, the ratio to sentence-transformers and the cosine agreement,
float32; results go to ``bench/out/generic.json``.

    .venv/bin/python -m bench.generic --texts 300
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from embedding_server.device.dtypes import cpu_thread_budget
from embedding_server.device.hub import resolve_model_path
from embedding_server.engine import Engine
from embedding_server.settings import DEFAULT_MODEL

from bench import out_dir, write_results
from bench.corpus import make_corpus
from bench.models import copy_tokenizer
from bench.offline import cosines

OUT = out_dir()
GTR_BASE = {
    "d_model": 768,
    "d_kv": 64,
    "d_ff": 3072,
    "num_layers": 12,
    "num_heads": 12,
    "feed_forward_proj": "relu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
}
GTR_MAX_SEQ_LENGTH = 512


@dataclass
class Run:
    model: str
    name: str
    seconds: float
    cpu_seconds: float
    texts_per_s: float
    cos_min: float


def build_gtr_like(root: Path, layers: int) -> Path:
    """A random gtr-t5-base-shaped encoder (``layers`` of them) as a sentence-transformers
    model directory under ``root``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )
    from transformers import T5Config, T5EncoderModel

    body = root / "t5-body"
    body.mkdir(parents=True)
    copy_tokenizer(body)
    torch.manual_seed(0)
    config = T5Config(**{**GTR_BASE, "num_layers": layers}, vocab_size=30522, pad_token_id=0)
    T5EncoderModel(config).save_pretrained(str(body))
    transformer = Transformer(str(body), max_seq_length=GTR_MAX_SEQ_LENGTH)
    width = transformer.get_embedding_dimension()
    st = SentenceTransformer(
        modules=[
            transformer,
            Pooling(width, pooling_mode="mean"),
            Dense(width, width, bias=False, activation_function=torch.nn.Identity()),
            Normalize(),
        ],
        device="cpu",
    )
    out = root / "gtr-like"
    st.save(str(out))
    return out


def measure(
    model: str, name: str, texts: Sequence[str], embed: Callable[[list[str]], np.ndarray]
) -> tuple[Run, np.ndarray]:
    embed(list(texts[:16]))  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    vectors = np.asarray(embed(list(texts)), dtype=np.float32)
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    return Run(model, name, seconds, cpu, len(texts) / seconds, 1.0), vectors


def compare(label: str, path: str, texts: list[str], batch_size: int, native: bool) -> list[Run]:
    """sentence-transformers, then our transformers backend (and the native one)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu")
    runs = []
    reference_run, reference = measure(
        label,
        "sentence-transformers",
        texts,
        lambda t: st.encode(t, batch_size=batch_size, convert_to_numpy=True),
    )
    runs.append(reference_run)
    backends = ["transformers", "native"] if native else ["transformers"]
    for backend in backends:
        engine = Engine.from_pretrained(path, dtype="float32", backend=backend)
        run, vectors = measure(label, f"embedding-server {backend}", texts, engine.embed)
        run.cos_min = float(cosines(vectors, reference).min())
        runs.append(run)
    for run in runs:
        ratio = run.texts_per_s / reference_run.texts_per_s
        cpu_ratio = reference_run.cpu_seconds / run.cpu_seconds
        print(
            f"  {label:<7} {run.name:<32} {run.seconds:7.2f}s (cpu {run.cpu_seconds:6.1f}s) "
            f"{run.texts_per_s:7.1f} texts/s  {ratio:5.2f}x wall  {cpu_ratio:5.2f}x CPU  "
            f"cos min {run.cos_min:.6f}"
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=300)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument(
        "--t5-layers",
        type=int,
        default=GTR_BASE["num_layers"],
        help="layers of the gtr-t5-base-shaped encoder (fewer for a quick run)",
    )
    parser.add_argument("--models", default="t5,minilm", help="comma-separated: t5, minilm")
    args = parser.parse_args()

    threads = cpu_thread_budget()
    torch.set_num_threads(threads)
    texts = make_corpus(args.texts)
    models = {m.strip() for m in args.models.split(",") if m.strip()}
    print(f"{len(texts)} texts; torch {torch.__version__}, {threads} threads, float32")
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-generic-") as root:
        if "t5" in models:
            path = build_gtr_like(Path(root), args.t5_layers)
            runs += compare("t5", str(path), texts, args.st_batch_size, native=False)
        if "minilm" in models:
            minilm = str(resolve_model_path(DEFAULT_MODEL))
            runs += compare("minilm", minilm, texts, args.st_batch_size, native=True)
    written = write_results(
        "generic", {"texts": len(texts), "threads": threads, "runs": [asdict(r) for r in runs]}
    )
    print(f"\nwrote {written}")


if __name__ == "__main__":
    main()

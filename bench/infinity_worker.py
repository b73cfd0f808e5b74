"""infinity-emb's int8 modes, run inside infinity-emb's own virtualenv for ``bench.offline``.

infinity-emb pins its own torch, transformers and optimum, so it never shares a process (or
a virtualenv) with our server: ``bench.offline --infinity-python PATH`` starts this file
under that Python. It imports nothing of this repository, only the standard library, numpy
and what infinity-emb brings. Two commands:

``export SRC DST``
    MiniLM as ONNX, then dynamically quantized to int8 with optimum's ``ORTQuantizer``
    (``model_quantized.onnx``, the file name infinity's optimum engine prefers on a CPU), the
    way sentence-transformers' ``export_dynamic_quantized_onnx_model`` does it: weights int8,
    activations quantized at run time, the configuration for the CPU's instruction set
    (``--isa``: avx512_vnni, avx512 or avx2). The tokenizer and pooling files are copied.

``serve MODEL --engine torch|optimum``
    Builds infinity's ``AsyncEmbeddingEngine`` (``--engine torch --dtype int8``: its
    ``torch.quantization.quantize_dynamic`` on every ``nn.Linear``; ``--engine optimum``:
    onnxruntime on the quantized ONNX file), embeds the corpus once to warm up, then embeds it
    again each time a line ``run`` arrives on stdin, writing the vectors to ``--out`` and one
    line of JSON with the wall and CPU seconds (this process's, all its threads) to stdout.

Lines meant for the caller start with :data:`MARK`; infinity's own logging goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

MARK = "@@infinity-worker "
COPIED = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)


def say(**fields: Any) -> None:
    sys.stdout.write(MARK + json.dumps(fields) + "\n")
    sys.stdout.flush()


def export(src: Path, dst: Path, isa: str) -> None:
    from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    dst.mkdir(parents=True, exist_ok=True)
    model = ORTModelForFeatureExtraction.from_pretrained(str(src), export=True)
    model.save_pretrained(str(dst))
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    if (src / "1_Pooling").is_dir():
        shutil.copytree(src / "1_Pooling", dst / "1_Pooling", dirs_exist_ok=True)
    config = getattr(AutoQuantizationConfig, isa)(is_static=False, per_channel=False)
    quantizer = ORTQuantizer.from_pretrained(str(dst), file_name="model.onnx")
    quantizer.quantize(save_dir=str(dst), quantization_config=config)
    files = sorted(p.name for p in dst.glob("*.onnx"))
    say(exported=str(dst), files=files, isa=isa)


async def serve(args: argparse.Namespace) -> None:
    import numpy as np
    from infinity_emb import AsyncEmbeddingEngine, EngineArgs, __version__

    if args.engine == "torch":
        import torch

        torch.set_num_threads(args.threads)
    texts = json.loads(Path(args.texts).read_text())
    engine = AsyncEmbeddingEngine.from_args(
        EngineArgs(
            model_name_or_path=args.model,
            engine=args.engine,
            device="cpu",
            dtype=args.dtype,
            batch_size=args.batch_size,
            pooling_method="mean",
        )
    )
    await engine.astart()
    try:
        await engine.embed(sentences=texts[:32])
        say(ready=True, version=__version__)
        for line in sys.stdin:
            if line.strip() != "run":
                break
            start, cpu_start = time.perf_counter(), time.process_time()
            vectors, _ = await engine.embed(sentences=texts)
            seconds = time.perf_counter() - start
            cpu_seconds = time.process_time() - cpu_start
            out = Path(args.out)
            np.save(out, np.asarray(vectors, dtype=np.float32))
            say(seconds=seconds, cpu_seconds=cpu_seconds, vectors=str(out))
    finally:
        await engine.astop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export")
    exp.add_argument("src", type=Path)
    exp.add_argument("dst", type=Path)
    exp.add_argument("--isa", choices=["avx512_vnni", "avx512", "avx2"], default="avx2")
    srv = sub.add_parser("serve")
    srv.add_argument("model")
    srv.add_argument("--engine", choices=["torch", "optimum"], required=True)
    srv.add_argument("--dtype", default="int8")
    srv.add_argument("--texts", required=True, help="a JSON list of the texts")
    srv.add_argument("--out", required=True, help="where each run's vectors go (.npy)")
    srv.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    srv.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    # Every answer the caller reads comes from say(); whatever a library prints goes to stderr.
    try:
        if args.command == "export":
            export(args.src, args.dst, args.isa)
        else:
            asyncio.run(serve(args))
    except Exception as exc:  # noqa: BLE001 - reported to the caller, which prints it
        say(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
        sys.exit(1)


if __name__ == "__main__":
    main()

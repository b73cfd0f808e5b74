"""Images per second: our Engine vs sentence-transformers on the same CLIP, same run.

Not a test: a measurement. Embeds the same photos-sized images (random smooth pictures,
640x480 by default, so resizing and cropping cost what they cost on real uploads) with

* sentence-transformers (its ``Transformer`` module on a transformers CLIP checkpoint:
  ``CLIPImageProcessor``, then ``get_image_features``), in float32 and bfloat16;
* our Engine (``engine.embed(images)``: our Pillow + numpy preprocessing, then the native
  vision tower), in float32 and bfloat16;

both counting preprocessing, and prints images/s, the ratios, CPU time and the cosine
agreement with sentence-transformers float32.

    .venv/bin/python -m bench.images --images 128

The model is random weights in the shape of openai/clip-vit-base-patch32 (ViT-B/32 at 224
pixels, the most downloaded CLIP), built once under ``bench/out/`` with the real
checkpoint's preprocessing config; random weights run at the speed real ones do. Its
tokenizer is a byte-level one in CLIP's layout (``<|startoftext|> text <|endoftext|>``):
only the text tower reads it, and images are measured here.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from embedding_server.device.dtypes import cpu_flags, cpu_thread_budget
from embedding_server.engine import Engine
from PIL import Image, ImageFilter

from bench import out_dir, write_results

OUT = out_dir()

# openai/clip-vit-base-patch32's shape and preprocessing (its config.json and
# preprocessor_config.json).
VISION = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 32,
}
TEXT = {
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "max_position_embeddings": 77,
    "vocab_size": 49408,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 1,
}
PROCESSOR = {
    "size": {"shortest_edge": 224},
    "crop_size": {"height": 224, "width": 224},
    "resample": 3,  # bicubic
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def random_clip() -> Path:
    """The ViT-B/32-shaped random CLIP, built once."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, PreTrainedTokenizerFast

    path = OUT / "clip-vit-b32-random"
    if (path / "model.safetensors").exists():
        return path
    torch.manual_seed(0)
    config = CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=512)
    CLIPModel(config).save_pretrained(str(path))
    CLIPImageProcessor(**PROCESSOR).save_pretrained(str(path))
    specials = ["<|startoftext|>", "<|endoftext|>"]  # ids 0 and 1, as TEXT says
    vocab = {token: i for i, token in enumerate(specials)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=specials[1]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[(t, vocab[t]) for t in specials]
    )
    tok.add_special_tokens(specials)
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=77,
        bos_token=specials[0],
        eos_token=specials[1],
        pad_token=specials[1],
        unk_token=specials[1],
    ).save_pretrained(str(path))
    return path


def pictures(count: int, size: tuple[int, int]) -> list[Image.Image]:
    """Smooth random RGB pictures (noise blurred, so they are photo-like to a resampler)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        noise = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
        out.append(Image.fromarray(noise, "RGB").filter(ImageFilter.GaussianBlur(3)))
    return out


@dataclass
class Run:
    name: str
    seconds: float
    cpu_seconds: float
    images_per_s: float
    cos_min: float


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument(
        "--skip-bf16", action="store_true", help="bf16 is emulated (slow) without avx512_bf16/AMX"
    )
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    threads = cpu_thread_budget()
    torch.set_num_threads(threads)
    path = random_clip()
    images = pictures(args.images, (args.width, args.height))
    native_bf16 = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    print(
        f"random CLIP ViT-B/32 (224 px, 50 tokens an image); {len(images)} images of "
        f"{args.width}x{args.height}; torch {torch.__version__}, {threads} threads; CPU "
        f"capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {native_bf16}, "
        f"AMX: {'amx_bf16' in cpu_flags()}"
    )
    dtypes = ["float32"] if args.skip_bf16 else ["float32", "bfloat16"]
    runs: list[Run] = []
    reference: np.ndarray | None = None

    def record(name: str, fn: Any) -> None:
        nonlocal reference
        fn(images[:4])  # warm-up
        start, cpu_start = time.perf_counter(), time.process_time()
        vectors = np.asarray(fn(images), dtype=np.float32)
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
        if reference is None:
            reference = vectors
        run = Run(
            name,
            seconds,
            cpu_seconds,
            len(images) / seconds,
            float(cosines(vectors, reference).min()),
        )
        runs.append(run)
        print(
            f"  {name:<34} {seconds:7.2f}s (cpu {cpu_seconds:6.1f}s) "
            f"{run.images_per_s:7.1f} images/s  cos min {run.cos_min:.6f}"
        )

    for dtype in dtypes:
        st = SentenceTransformer(str(path), device="cpu")
        if dtype == "bfloat16":
            st = st.to(torch.bfloat16)
        record(
            f"sentence-transformers {dtype}",
            lambda x, st=st: st.encode(x, batch_size=args.st_batch_size, convert_to_numpy=True),
        )
        del st
    for dtype in dtypes:
        engine = Engine.from_pretrained(str(path), dtype=dtype)
        record(f"embedding-server {dtype}", engine.embed)
        engine.close()

    by_name = {r.name: r for r in runs}
    print("\nratios (images/s), target >= 1.0x sentence-transformers at the same dtype:")
    for dtype in dtypes:
        ours, theirs = (
            by_name[f"embedding-server {dtype}"],
            by_name[f"sentence-transformers {dtype}"],
        )
        print(
            f"  ours {dtype} / sentence-transformers {dtype}: "
            f"{ours.images_per_s / theirs.images_per_s:.2f}x wall, "
            f"{theirs.cpu_seconds / ours.cpu_seconds:.2f}x CPU time"
        )
    print("\n| run | images/s | CPU s | cosine min vs ST fp32 |")
    print("|---|---:|---:|---:|")
    for r in runs:
        print(f"| {r.name} | {r.images_per_s:.1f} | {r.cpu_seconds:.1f} | {r.cos_min:.6f} |")
    written = write_results(
        "images", {"images": len(images), "threads": threads, "runs": [asdict(r) for r in runs]}
    )
    print(f"\nwrote {written}")


if __name__ == "__main__":
    main()

"""GPU smoke run: every attention kernel, dtype and model family on this machine's GPU.

One command, a few minutes, no downloads; what it prints goes into docs/benchmarks/index.md:

    .venv/bin/python -m bench.gpu_smoke            # on a GPU host
    .venv/bin/python -m bench.gpu_smoke --device cpu --quick   # the same checks on a CPU

1. The device: nvidia-smi's facts, torch's and flash-attn's versions, the kernels available
   and the one ``--attention auto`` would pick (with its reasons).
2. Kernels: each attention kernel the device can run, in bfloat16 and float16, against a
   float32 reference: head dims 32-256, grouped-query and plain, causal and bidirectional,
   with and without a sliding window, one packed batch of lengths from 1 to 2048.
3. Models: a tiny random model of each family (BERT, XLM-R, CamemBERT, DistilBERT, ERNIE,
   ELECTRA, JinaBERT, MPNet, DeBERTa-v3, ModernBERT, Llama, Mistral, Qwen2, Qwen3, Gemma 3) on the
   device in each dtype and kernel it can run, against the CPU in float32; then a sequence
   and a token classifier through the whole engine (heads on the device).
4. Scale: a two-layer decoder with a 7B model's shapes (hidden 4096, 32 heads, 8 KV heads,
   MLP 14336) at the full GPU token budget: time per forward and peak memory, per kernel.

Exit status 1 when any check misses its bound, so it can gate an image.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from embedding_server.device import attention
from embedding_server.device.attention import Backend, plan_attention, probe, select_backend, unfit
from embedding_server.device.loading import head_dim_of
from embedding_server.device.model_config import read_model_config
from embedding_server.device.models import build_model, lookup
from embedding_server.device.models.base import PackedBatch
from embedding_server.device.weights import load_weights
from embedding_server.settings import GPU_BATCH_TOKENS

from bench import write_results

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Worst per-row cosine to the float32 reference that a kernel/model may show, per dtype.
MIN_COSINE = {torch.float32: 0.99999, torch.bfloat16: 0.995, torch.float16: 0.999}
LENGTHS = [1, 2, 3, 7, 16, 17, 64, 100, 255, 256, 511, 1000, 2048]


@dataclass
class Check:
    section: str
    name: str
    passed: bool
    detail: str


def device_facts(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "flash_attn": attention.varlen_kernels().flash_error or "importable",
        "torch_varlen": attention.varlen_kernels().torch_varlen_error or "available",
    }
    if device.type == "cuda":
        facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        facts["name"] = torch.cuda.get_device_name(device)
        smi = shutil.which("nvidia-smi")
        if smi:
            query = "name,driver_version,memory.total,compute_cap,clocks.max.sm"
            out = subprocess.run(
                [smi, f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            facts["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
    for dtype in (torch.bfloat16, torch.float16):
        choice = select_backend("auto", probe(device, dtype, 128))
        facts[f"auto_{dtype}".replace("torch.", "")] = {
            "backend": str(choice.backend),
            "passed_over": list(choice.passed_over),
        }
    return facts


def runnable_backends(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    bias: str | None = None,
    alibi: bool = False,
) -> list[Backend]:
    facts = probe(device, dtype, head_dim, bias=bias, alibi=alibi)
    return [b for b in Backend if unfit(b, facts) is None]


def _row_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a2, b2 = a.double().reshape(a.shape[0], -1), b.double().reshape(b.shape[0], -1)
    return float(F.cosine_similarity(a2, b2, dim=-1).min())


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], causal: bool, window: int
) -> torch.Tensor:
    """float32, one sequence at a time, on the CPU."""
    rep = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start : start + n].float().cpu().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        keep = torch.ones(n, n, dtype=torch.bool)
        if window >= 0:
            keep &= (j >= i - window) & (j <= i + window)
        if causal:
            keep &= j <= i
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep).transpose(0, 1))
        start += n
    return torch.cat(out)


def kernel_checks(device: torch.device, dtypes: list[torch.dtype], quick: bool) -> Iterator[Check]:
    lens = LENGTHS[:9] if quick else LENGTHS
    head_dims = [32, 64, 128] if quick else [32, 64, 80, 96, 128, 256]
    generator = torch.Generator().manual_seed(0)
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    for head_dim in head_dims:
        for heads, kv_heads in ((8, 8), (8, 2)):
            q = torch.randn(total, heads, head_dim, generator=generator)
            k = torch.randn(total, kv_heads, head_dim, generator=generator)
            v = torch.randn(total, kv_heads, head_dim, generator=generator)
            for causal in (False, True):
                for window in (-1, 64):
                    want = _reference(q, k, v, lens, causal, window)
                    for dtype in dtypes:
                        for backend in runnable_backends(device, dtype, head_dim):
                            plan = plan_attention(lens, device, backend)
                            got = attention.varlen_attention(
                                *(t.to(device, dtype) for t in (q, k, v)),
                                cu_seqlens=cu.to(device),
                                max_seqlen=max(lens),
                                causal=causal,
                                plan=plan,
                                window=None if window < 0 else window,
                            )
                            cosine = _row_cosine(got.float().cpu(), want)
                            name = (
                                f"{backend} {str(dtype)[6:]} d={head_dim} h={heads}/{kv_heads} "
                                f"{'causal' if causal else 'bidir'} window={window}"
                            )
                            yield Check(
                                "kernels",
                                name,
                                cosine >= MIN_COSINE[dtype],
                                f"min cosine {cosine:.6f}",
                            )


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 512}
FAMILIES: dict[str, dict[str, Any]] = {
    "bert": {"num_attention_heads": 4, "max_position_embeddings": 2048},
    "xlm-roberta": {"num_attention_heads": 4, "max_position_embeddings": 2050, "pad_token_id": 1},
    "camembert": {"num_attention_heads": 4, "max_position_embeddings": 2050, "pad_token_id": 1},
    "distilbert": {"n_heads": 4, "hidden_dim": 128, "max_position_embeddings": 2048},
    "ernie": {"num_attention_heads": 4, "max_position_embeddings": 2048, "use_task_id": True},
    "electra": {"num_attention_heads": 4, "max_position_embeddings": 2048, "embedding_size": 32},
    # Position terms on the logits: the SDPA kernels only (attention.AttentionFacts.bias).
    "mpnet": {"num_attention_heads": 4, "max_position_embeddings": 2050},
    "deberta-v2": {  # DeBERTa-v3's layout
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
        "relative_attention": True,
        "pos_att_type": ["p2c", "c2p"],
        "position_buckets": 256,
        "share_att_key": True,
        "norm_rel_ebd": "layer_norm",
        "position_biased_input": False,
    },
    "modernbert": {
        "num_attention_heads": 4,
        "global_attn_every_n_layers": 2,
        "local_attention": 16,
        "max_position_embeddings": 2048,
        **{f"{t}_token_id": i for i, t in enumerate(("pad", "bos", "eos", "cls", "sep"))},
    },
    # JinaBERT (jina-embeddings-v2): ALiBi slopes, flash-attn's alibi_slopes or an SDPA mask;
    # a BERT rewritten into its layout (build_tiny).
    "bert-alibi": {"num_attention_heads": 4, "max_position_embeddings": 2048},
    "llama": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "mistral": {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 32},
    "qwen2": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen3": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    "gemma3_text": {
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}


def build_tiny(family: str, root: Path) -> Path:
    from transformers import AutoConfig, AutoModel

    path = root / family
    model_type = family.removesuffix("-alibi")
    config = AutoConfig.for_model(model_type, **SMALL, **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="eager")
    for parameter in model.parameters():  # random but not tiny: make layers matter
        parameter.data.normal_(0.0, 0.2)
    model.save_pretrained(path)
    if family == "bert-alibi":
        _as_jina_bert(path)
    return path


def _as_jina_bert(path: Path) -> None:
    """BERT's checkpoint at ``path`` rewritten into JinaBERT v2's layout: no position table,
    ``mlp.gated_layers`` / ``mlp.wo`` / ``mlp.layernorm`` for the MLP, an ALiBi config."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    weights.pop("embeddings.position_embeddings.weight")
    inter, hidden = SMALL["intermediate_size"], SMALL["hidden_size"]
    for i in range(SMALL["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        weights.pop(p + "intermediate.dense.bias")
        up = weights.pop(p + "intermediate.dense.weight")
        weights[p + "mlp.gated_layers.weight"] = torch.cat([up, torch.randn(inter, hidden) * 0.2])
        weights[p + "mlp.wo.weight"] = weights.pop(p + "output.dense.weight")
        weights[p + "mlp.wo.bias"] = weights.pop(p + "output.dense.bias")
        for part in ("weight", "bias"):
            weights[p + f"mlp.layernorm.{part}"] = weights.pop(p + f"output.LayerNorm.{part}")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(position_embedding_type="alibi", feed_forward_type="geglu", emb_pooler="mean")
    (path / "config.json").write_text(json.dumps(config))


def _hidden(
    path: Path, device: torch.device, dtype: torch.dtype, backend: Backend, seqs: list[list[int]]
) -> torch.Tensor:
    config = read_model_config(path)
    model = build_model(config, load_weights(path), dtype=dtype, device=device)
    with torch.inference_mode():
        batch = PackedBatch.build(seqs, device, model.position_offset, attention=backend)
        return model.forward(batch).float().cpu()


def model_checks(
    device: torch.device, dtypes: list[torch.dtype], root: Path, quick: bool
) -> Iterator[Check]:
    generator = torch.Generator().manual_seed(1)
    lens = sorted([1, 5, 17, 33, 64, 200] if quick else [1, 5, 17, 33, 64, 200, 700, 2000])
    seqs = [torch.randint(3, SMALL["vocab_size"], (n,), generator=generator).tolist() for n in lens]
    for model_type in FAMILIES:
        path = build_tiny(model_type, root)
        want = _hidden(path, torch.device("cpu"), torch.float32, Backend.SDPA_BUCKETED, seqs)
        config = read_model_config(path)
        arch = lookup(config)
        head_dim = head_dim_of(arch.read_config(config))
        bias, alibi = arch.attention_bias, arch.alibi(config)
        for dtype in dtypes:
            if model_type == "gemma3_text" and dtype == torch.float16:
                continue  # refused by the server: Gemma 3 overflows float16
            for backend in runnable_backends(device, dtype, head_dim, bias, alibi):
                got = _hidden(path, device, dtype, backend, seqs)
                cosine = _row_cosine(got, want)
                yield Check(
                    "models",
                    f"{model_type} {backend} {str(dtype)[6:]}",
                    cosine >= MIN_COSINE[dtype],
                    f"min cosine {cosine:.6f} vs CPU float32",
                )


# Largest gap of a class probability to CPU float32's that a classifier head may show.
MAX_PROB_GAP = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.01}


def build_classifier(root: Path, per_token: bool) -> Path:
    """A tiny random BERT ``ForSequenceClassification`` (3 labels) or
    ``ForTokenClassification`` (5 labels), with a byte-level tokenizer: the server runs the
    first's head on pooled vectors, the second's on every token's state, both on the device."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        PreTrainedTokenizerFast,
    )

    path = root / ("bert-token-classifier" if per_token else "bert-classifier")
    specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)],
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    ).save_pretrained(path)
    config = AutoConfig.for_model(
        "bert",
        **{**SMALL, "vocab_size": len(vocab)},
        **FAMILIES["bert"],
        num_labels=5 if per_token else 3,
    )
    auto = AutoModelForTokenClassification if per_token else AutoModelForSequenceClassification
    torch.manual_seed(0)
    model = auto.from_config(config)
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


def head_checks(device: torch.device, dtypes: list[torch.dtype], root: Path) -> Iterator[Check]:
    """Classifier heads through the whole engine on the device: /classify's probabilities
    (pooled vector, head, softmax) and token_classify's (the head on every token's state,
    run before the copy back), against the CPU in float32."""
    import numpy as np
    from embedding_server.engine import Engine

    texts = ["x", "a short one", "a longer text about the weather in the mountains " * 12]
    for per_token in (False, True):
        path = build_classifier(root, per_token)
        task = "token_classify" if per_token else "classify"
        cpu = Engine.from_pretrained(str(path), device="cpu", dtype="float32")
        want = cpu.encode(texts, task=task)
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            engine = Engine.from_pretrained(str(path), device=str(device), dtype=name)
            got = engine.encode(texts, task=task)
            gap = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
            yield Check(
                "heads",
                f"bert {task} {engine.info().attention} {name}",
                gap <= MAX_PROB_GAP[dtype],
                f"max probability gap {gap:.2e} vs CPU float32",
            )
            engine.close()


def scale_runs(device: torch.device, root: Path, tokens: int) -> Iterator[Check]:
    """A 7B decoder's shapes, two layers, one batch at the token budget (512-token inputs)."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=2,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    path = root / "llama-7b-shape"
    LlamaModel(config).to(torch.bfloat16).save_pretrained(path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = load_weights(path)
    model = build_model(read_model_config(path), weights, dtype=dtype, device=device)
    del weights
    seqs = [[7] * 512 for _ in range(max(1, tokens // 512))]
    for backend in runnable_backends(device, dtype, 128):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            batch = PackedBatch.build(seqs, device, 0, attention=backend)
            model.forward(batch)  # warm-up (kernel selection, allocator)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            runs = 3
            for _ in range(runs):
                batch = PackedBatch.build(seqs, device, 0, attention=backend)
                model.forward(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - start) / runs
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        yield Check(
            "scale",
            f"7B-shaped 2-layer decoder, {backend} {str(dtype)[6:]}, {len(seqs)}x512 tokens",
            True,
            f"{seconds * 1000:.1f} ms/forward, {len(seqs) * 512 / seconds:,.0f} tokens/s, "
            f"peak {peak:.2f} GiB",
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--quick", action="store_true", help="fewer lengths and head dims")
    parser.add_argument("--no-scale", action="store_true", help="skip the 7B-shaped run")
    parser.add_argument(
        "--tokens", type=int, default=GPU_BATCH_TOKENS, help="token budget of the scale run"
    )
    parser.add_argument(
        "--json", type=Path, help="write the results here (default: gpu_smoke.json in bench/out)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no usable CUDA device; run with --device cpu to check the CPU paths")
        return 2
    dtypes = [torch.bfloat16, torch.float16] if device.type == "cuda" else [torch.bfloat16]
    facts = device_facts(device)
    print(json.dumps(facts, indent=2))
    checks: list[Check] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
        sections: list[Callable[[], Iterator[Check]]] = [
            lambda: kernel_checks(device, dtypes, args.quick),
            lambda: model_checks(device, [*dtypes, torch.float32], Path(tmp), args.quick),
            lambda: head_checks(device, [*dtypes, torch.float32], Path(tmp)),
        ]
        if not args.no_scale:
            sections.append(lambda: scale_runs(device, Path(tmp), args.tokens))
        for section in sections:
            for check in section():
                checks.append(check)
                mark = "ok  " if check.passed else "FAIL"
                print(f"{mark} [{check.section}] {check.name}: {check.detail}", flush=True)
    failed = [c for c in checks if not c.passed]
    print(
        f"\n{len(checks) - len(failed)}/{len(checks)} checks passed in "
        f"{time.perf_counter() - started:.0f} s on {facts.get('name', device.type)}"
    )
    write_results(
        "gpu_smoke", {"facts": facts, "checks": [c.__dict__ for c in checks]}, path=args.json
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

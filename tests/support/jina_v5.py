"""Tiny random jina-embeddings-v5-text-small checkpoints, in the layout jinaai ships.

:func:`build_jina_v5` writes one transformers ``Qwen3Model`` twice: as transformers saves it
(``base``, the reference body) and as jina-embeddings-v5-text-small ships it (``hub``):
``model_type: jina_embeddings_v5``, ``architectures: ["JinaEmbeddingsV5Model"]``,
``task_names``, the base body's tensors as they are, and per task a peft LoRA adapter in
``adapters/<task>/`` (``adapter_config.json`` and ``adapter_model.safetensors`` with
``base_model.model.layers.N.<module>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight``
``[out, r]``). The tasks differ in rank and in which projections they adapt, as peft allows.
With ``body="eurobert"`` the body is a transformers ``EuroBertModel`` and the config says
``is_decoder: false``: jina-embeddings-v5-text-nano's layout.

:func:`merged_reference` is the reference for one task: transformers' model with every adapted
weight replaced by ``W + (lora_alpha / r) * B @ A``, which is what peft's LoRA layer computes
(and ``merge_and_unload`` stores) for the active adapter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from tests.support.models import build_decoder, rewrite_checkpoint

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TASKS: dict[str, tuple[int, float, tuple[str, ...]]] = {
    "retrieval": (4, 8.0, ALL),
    "text-matching": (2, 4.0, ALL),
    "classification": (4, 4.0, ("q_proj", "v_proj", "o_proj")),
    "clustering": (3, 6.0, ("gate_proj", "up_proj", "down_proj", "k_proj")),
}
"""task -> (r, lora_alpha, target modules)."""
_PARENT = {
    m: "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp" for m in ALL
}


def build_jina_v5(root: Path, body: str = "qwen3") -> tuple[Path, Path]:
    """``(base, hub)`` directories of one tiny random model (see the module docstring);
    ``body`` eurobert for the -nano layout (``is_decoder: false``)."""
    base = build_decoder(root / "base", body)
    hub_config: dict[str, Any] = {
        **({"is_decoder": False} if body == "eurobert" else {}),
        "model_type": "jina_embeddings_v5",
        "architectures": ["JinaEmbeddingsV5Model"],
        "auto_map": {
            "AutoConfig": "configuration_jina_embeddings_v5.JinaEmbeddingsV5Config",
            "AutoModel": "modeling_jina_embeddings_v5.JinaEmbeddingsV5Model",
        },
        "task_names": list(TASKS),
    }
    hub = rewrite_checkpoint(base, root / "hub", config=hub_config)
    weights = load_file(str(base / "model.safetensors"))
    layers = 1 + max(int(n.split(".")[1]) for n in weights if n.startswith("layers."))
    generator = torch.Generator().manual_seed(17)
    for task, (rank, alpha, targets) in TASKS.items():
        folder = hub / "adapters" / task
        folder.mkdir(parents=True)
        tensors: dict[str, torch.Tensor] = {}
        for i in range(layers):
            for module in targets:
                out, fan_in = weights[f"layers.{i}.{_PARENT[module]}.{module}.weight"].shape
                name = f"base_model.model.layers.{i}.{_PARENT[module]}.{module}"
                tensors[name + ".lora_A.weight"] = 0.1 * torch.randn(
                    rank, fan_in, generator=generator
                )
                tensors[name + ".lora_B.weight"] = 0.1 * torch.randn(out, rank, generator=generator)
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        settings = {
            "peft_type": "LORA",
            "task_type": "FEATURE_EXTRACTION",
            "base_model_name_or_path": "jinaai/jina-embeddings-v5-text-small",
            "r": rank,
            "lora_alpha": alpha,
            "lora_dropout": 0.1,
            "target_modules": list(targets),
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "rank_pattern": {},
            "alpha_pattern": {},
        }
        (folder / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return base, hub


def merged_reference(base: Path, hub: Path, task: str) -> torch.nn.Module:
    """transformers' model of ``base`` with ``task``'s LoRA merged into its weights, float32,
    eval mode."""
    rank, alpha, _ = TASKS[task]
    factors = load_file(str(hub / "adapters" / task / "adapter_model.safetensors"))
    merged = dict(load_file(str(base / "model.safetensors")))
    for name in list(merged):
        stem = "base_model.model." + name.removesuffix(".weight")
        if stem + ".lora_A.weight" in factors:
            a, b = factors[stem + ".lora_A.weight"], factors[stem + ".lora_B.weight"]
            merged[name] = merged[name] + (alpha / rank) * (b @ a)
    out = base.parent / f"merged-{task}"
    if not out.is_dir():
        shutil.copytree(base, out, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    return AutoModel.from_pretrained(str(out), attn_implementation="eager").eval()

"""jina-embeddings-v5-text on packed tokens: a Qwen3 decoder (-small) or a EuroBERT encoder
(-nano) with per-task LoRA adapters, the adapter chosen per sequence.

jinaai/jina-embeddings-v5-text-small ships ``model_type: jina_embeddings_v5`` (a Qwen3Config
under another name, plus ``task_names``), ``architectures: ["JinaEmbeddingsV5Model"]``, the
base Qwen3 body in ``model.safetensors`` (a ``Qwen3Model``: ``embed_tokens``, ``layers.N``,
``norm``) and one peft LoRA adapter per task beside it: ``adapters/<task>/adapter_config.json``
(``r``, ``lora_alpha``) and ``adapters/<task>/adapter_model.safetensors``
(``base_model.model.layers.N.self_attn.q_proj.lora_A.weight`` ``[r, in]``, ``lora_B.weight``
``[out, r]``). Its authors' ``encode(texts, task, prompt_name)`` (and vLLM's
``JinaEmbeddingsV5Model``, which merges one task's adapter at load) runs the body with
``W + (alpha / r) * B @ A`` on every adapted projection, causally, prefixes ``"Query: "`` or
``"Document: "`` (the default), pools the last token and L2-normalizes (after a Matryoshka
cut). Every text runs some task's adapter; a request that names none runs ``retrieval``
(vLLM's default).

Mixed tasks in one packed batch, as for jina-embeddings-v3 (``jina_v3.py``): each adapted
projection adds ``((x @ A_all^T) * mask) @ B_all`` to its base product, ``A_all`` / ``B_all``
stacking every adapter's factors (q, k and v side by side for the fused projection, likewise
gate and up), ``mask`` keeping each token's own adapter's columns.

The -nano sibling says ``is_decoder: false``: its body is EuroBERT (its authors' code,
``EuroBertModel``, in transformers as ``eurobert``), which is Llama's blocks and weight
names attending both ways, as vLLM runs it (``JinaEmbeddingsV5EncoderModel``: a Llama whose
attention is encoder-only); the same adapters, prompts and last-token pooling apply. Tensor
parallelism is not implemented for the adapters: refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embedding_server.device.models.base import Checkpoint, PackedBatch
from embedding_server.device.models.jina_v3 import LoraStack
from embedding_server.device.models.llama import Adapters, DecoderVariant, LlamaModel
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.pooling import PoolingMethod

MODEL_TYPE = "jina_embeddings_v5"
ARCHITECTURE = "JinaEmbeddingsV5Model"
ADAPTERS_DIR = "adapters"
ADAPTER_PREFIX = "adapters."
"""Where an adapter's tensors join the checkpoint's: ``adapters.<task>.<peft name>``, so that
the tensor audit covers them like any other (an adapted module nobody reads refuses)."""
ADAPTER_CONFIGS = "jina_v5_adapter_configs"
"""The config key the adapters' ``adapter_config.json`` contents are carried under."""
DEFAULT_TASK = "retrieval"
"""The adapter a request that names none runs (vLLM's default ``jina_task``)."""
PROMPTS = {"query": "Query: ", "document": "Document: "}
DEFAULT_PROMPT = "document"
"""The prefixes the authors' ``encode`` puts in front (``prompt_name``, default document),
used where the checkpoint has no sentence-transformers prompts."""

_QWEN3 = DecoderVariant(attention_bias=True, qk_norm=True, window="opt_in")
_EUROBERT = DecoderVariant(attention_bias=True, mlp_bias=True, bidirectional=True)
"""EuroBERT as transformers (and vLLM's ``JinaEmbeddingsV5EncoderModel``) runs it: Llama's
blocks, names and bias flags, attending both ways."""
_PEFT_NAME = re.compile(
    r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight"
)
_REFUSED_OPTIONS = (
    ("use_dora", "DoRA's magnitude vectors"),
    ("fan_in_fan_out", "transposed (Conv1D) factors"),
    ("lora_bias", "a bias on lora_B"),
)


def task_names(config: Mapping[str, Any]) -> tuple[str, ...]:
    names = config.get("task_names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise UnsupportedModelError(
            f"{MODEL_TYPE} config.json must name its task adapters (task_names, a list of "
            f"strings); got {names!r}"
        )
    if len(set(names)) != len(names):
        raise UnsupportedModelError(f"{MODEL_TYPE} task_names repeats a name: {names}")
    return tuple(names)


def variant_of(config: Mapping[str, Any]) -> DecoderVariant:
    """The body a config describes: EuroBERT (-nano, ``is_decoder: false``), else Qwen3."""
    return _EUROBERT if config.get("is_decoder") is False else _QWEN3


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse from config.json alone what is not served: a config without its task names,
    a EuroBERT body said to be causal."""
    task_names(config)
    variant_of(config).check_config(config)


def declared_pooling(config: Mapping[str, Any]) -> PoolingMethod:
    """The last token's state: what the authors' ``encode`` pools, whatever the files say."""
    return "last"


class _Joined(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors with the adapters' beside them (read lazily from both)."""

    def __init__(self, base: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor]):
        self._base, self._extra = base, extra

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._extra[name] if name in self._extra else self._base[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._base
        yield from self._extra

    def __len__(self) -> int:
        return len(self._base) + len(self._extra)

    def shape_of(self, name: str) -> tuple[int, ...]:
        if name in self._extra:
            return tuple(self._extra[name].shape)
        reader = getattr(self._base, "shape_of", None)
        return tuple(reader(name)) if reader is not None else tuple(self._base[name].shape)


def read_adapters(
    path: Path, config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], Mapping[str, torch.Tensor]]:
    """``config`` with every task's ``adapter_config.json`` under :data:`ADAPTER_CONFIGS`, and
    ``weights`` with every task's LoRA tensors under ``adapters.<task>.``; a task whose
    adapter is missing is refused (its vectors would be the base model's)."""
    from safetensors import safe_open

    configs: dict[str, Any] = {}
    extra: dict[str, torch.Tensor] = {}
    for task in task_names(config):
        folder = path / ADAPTERS_DIR / task
        try:
            configs[task] = json.loads((folder / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise UnsupportedModelError(
                f"{MODEL_TYPE} task {task!r} (task_names) has no readable "
                f"{ADAPTERS_DIR}/{task}/adapter_config.json ({exc}); without its adapter the "
                "task's vectors would be the base model's"
            ) from exc
        file = folder / "adapter_model.safetensors"
        if not file.is_file():
            raise UnsupportedModelError(
                f"{MODEL_TYPE} task {task!r} has no {ADAPTERS_DIR}/{task}/adapter_model.safetensors"
            )
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # type: ignore[no-untyped-call]  # noqa: SIM118
                extra[f"{ADAPTER_PREFIX}{task}.{name}"] = handle.get_tensor(name)  # type: ignore[no-untyped-call]
    return {**config, ADAPTER_CONFIGS: configs}, _Joined(weights, extra)


def _scaling(task: str, settings: Mapping[str, Any]) -> tuple[int, float]:
    """An adapter's rank and ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA); refuses what
    peft can be set to compute and is not served."""
    where = f"{ADAPTERS_DIR}/{task}/adapter_config.json"
    kind = settings.get("peft_type", "LORA")
    if kind != "LORA":
        raise UnsupportedModelError(f"{where}: peft_type {kind!r} is not served (only LORA)")
    for key, what in _REFUSED_OPTIONS:
        if settings.get(key):
            raise UnsupportedModelError(f"{where} sets {key} ({what}), which is not served")
    if settings.get("bias", "none") != "none":
        raise UnsupportedModelError(f"{where} sets bias {settings['bias']!r}; only none")
    for key in ("rank_pattern", "alpha_pattern"):
        if settings.get(key):
            raise UnsupportedModelError(f"{where} sets {key} (a rank or alpha per module)")
    if settings.get("modules_to_save"):
        raise UnsupportedModelError(
            f"{where} sets modules_to_save {settings['modules_to_save']!r} (whole modules "
            "replaced per task), which is not served"
        )
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise UnsupportedModelError(f"{where}: r and lora_alpha must be numbers; got {rank!r}")
    divisor = rank**0.5 if settings.get("use_rslora") else rank
    return rank, float(alpha) / divisor


@dataclass
class _Factors:
    """One adapter's factors of one projection: ``A`` ``[r, in]``, ``B`` ``[out, r]``."""

    a: torch.Tensor
    b: torch.Tensor


_FUSED = {
    "self_attn": (("q_proj", "k_proj", "v_proj"), "qkv"),
    "mlp": (("gate_proj", "up_proj"), "gate_up"),
}


class JinaV5Model(LlamaModel):
    """jina-embeddings-v5-text's body (Qwen3 or EuroBERT) with its task adapters."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        config = checkpoint.config
        check_config(config)
        if checkpoint.shard.parallel:
            raise UnsupportedModelError(
                f"{MODEL_TYPE} with tensor_parallel_size > 1 is not served (its task "
                "adapters are not split across ranks); serve it on one device"
            )
        super().__init__(checkpoint, variant=variant_of(config))
        self.adapters = task_names(config)
        """The task adapters' names; index ``i`` is ``PackedBatch.adapter_ids`` value ``i``."""
        self.default_adapter = DEFAULT_TASK if DEFAULT_TASK in self.adapters else self.adapters[0]
        self.declared_prompts = dict(PROMPTS)
        self.default_prompt_name = DEFAULT_PROMPT
        settings = config.get(ADAPTER_CONFIGS)
        if not isinstance(settings, Mapping):
            if checkpoint.device.type != "meta":
                raise UnsupportedModelError(
                    f"{MODEL_TYPE} task adapters were not read (adapters/<task>/); the "
                    "model cannot run its tasks"
                )
            # The body audited from its safetensors headers alone, before the download
            # (inspect, serve's audit): the adapters are read with the weights.
            settings = {}
        factors = self._read_factors(checkpoint, settings) if settings else {}
        self._stacks = [self._layer_stacks(i, factors) for i in range(len(self.layers))]

    def _read_factors(
        self, checkpoint: Checkpoint, settings: Mapping[str, Any]
    ) -> dict[tuple[int, str, int], _Factors]:
        """``(layer, module, adapter) -> factors``, ``B`` scaled; every adapter tensor read."""
        found: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
        weights = checkpoint.weights
        scales = {t: _scaling(t, settings.get(t) or {}) for t in self.adapters}
        for index, task in enumerate(self.adapters):
            prefix = f"{ADAPTER_PREFIX}{task}."
            for name in [n for n in weights if n.startswith(prefix)]:
                match = _PEFT_NAME.fullmatch(name[len(prefix) :])
                if match is None:
                    continue  # left unread: the audit refuses it, naming it
                layer, _, module, side = match.groups()
                if int(layer) >= len(self.layers):
                    continue
                tensor = weights[name].to(torch.float32)
                found.setdefault((int(layer), module, index), {})[side] = tensor
        out: dict[tuple[int, str, int], _Factors] = {}
        for key, pair in found.items():
            layer, module, index = key
            task = self.adapters[index]
            rank, scale = scales[task]
            if set(pair) != {"A", "B"}:
                raise UnsupportedModelError(
                    f"{ADAPTERS_DIR}/{task}: layers.{layer} {module} has lora_{next(iter(pair))} "
                    "without its other factor"
                )
            a, b = pair["A"], pair["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
                raise UnsupportedModelError(
                    f"{ADAPTERS_DIR}/{task}: layers.{layer} {module} factors have shapes "
                    f"{list(a.shape)} and {list(b.shape)}, not [r, in] and [out, r] with "
                    f"r={rank} (adapter_config.json)"
                )
            out[key] = _Factors(a, b * scale)
        return out

    def _layer_stacks(
        self, i: int, factors: Mapping[tuple[int, str, int], _Factors]
    ) -> dict[str, tuple[LoraStack, torch.Tensor] | None]:
        """Layer ``i``'s stacked adapters per projection (fused ones side by side), each with
        the adapter index of its columns; None where no adapter touches it."""
        layer = self.layers[i]
        widths = {
            "qkv": self._split_widths(layer.qkv_w.shape[0]),
            "gate_up": (layer.gate_up_w.shape[0] // 2,) * 2,
        }
        parts = {
            "qkv": _FUSED["self_attn"][0],
            "gate_up": _FUSED["mlp"][0],
            "o": ("o_proj",),
            "down": ("down_proj",),
        }
        fan_in = {
            "qkv": layer.qkv_w.shape[1],
            "gate_up": layer.gate_up_w.shape[1],
            "o": layer.o_w.shape[1],
            "down": layer.down_w.shape[1],
        }
        fan_out = {"o": (layer.o_w.shape[0],), "down": (layer.down_w.shape[0],), **widths}
        stacks: dict[str, tuple[LoraStack, torch.Tensor] | None] = {}
        for kind, modules in parts.items():
            downs, ups, slots = [], [], []
            offsets = [0]
            for width in fan_out[kind]:
                offsets.append(offsets[-1] + int(width))
            for index in range(len(self.adapters)):
                for j, module in enumerate(modules):
                    f = factors.get((i, module, index))
                    if f is None:
                        continue
                    want = (int(fan_in[kind]), offsets[j + 1] - offsets[j])
                    if (f.a.shape[1], f.b.shape[0]) != want:
                        raise UnsupportedModelError(
                            f"{ADAPTERS_DIR}/{self.adapters[index]}: layers.{i} {module} "
                            f"factors map {f.a.shape[1]} -> {f.b.shape[0]}, the weight "
                            f"{want[0]} -> {want[1]}"
                        )
                    up = torch.zeros(f.b.shape[1], offsets[-1])
                    up[:, offsets[j] : offsets[j + 1]] = f.b.T
                    downs.append(f.a)
                    ups.append(up)
                    slots += [index] * f.a.shape[0]
            if not downs:
                stacks[kind] = None
                continue
            # float32: the low-rank product is a thin GEMM, and rounding its two halves to
            # bfloat16 on top of the base product costs more than a merged weight does.
            stack = LoraStack(
                down=torch.cat(downs).to(self.device).contiguous(),
                up=torch.cat(ups).to(self.device).contiguous(),
            )
            stacks[kind] = (stack, torch.tensor(slots, device=self.device))
        return stacks

    def _split_widths(self, rows: int) -> tuple[int, int, int]:
        q = self.split.heads * self.head_dim
        kv = self.split.kv_heads * self.head_dim
        if q + 2 * kv != rows:
            raise UnsupportedModelError(f"{MODEL_TYPE} fused q/k/v has {rows} rows")
        return q, kv, kv

    def _adapters(self, batch: PackedBatch) -> Adapters:
        # A sequence that names no task (no adapter ids, or -1) runs the default task's:
        # the authors' code has no base-weights mode.
        default = self.adapters.index(self.default_adapter)
        ids = batch.adapter_ids
        if ids is None:
            ids = torch.full_like(batch.input_ids, default)
        else:
            ids = torch.where(ids < 0, default, ids)
        onehot = (ids.unsqueeze(1) == torch.arange(len(self.adapters), device=ids.device)).float()
        masks: dict[int, torch.Tensor] = {}

        def lora(i: int, kind: str, x: torch.Tensor) -> torch.Tensor:
            stack = self._stacks[i][kind]
            if stack is None:
                return torch.zeros((), dtype=x.dtype, device=x.device)
            factors, slots = stack
            mask = masks.get(id(slots))
            if mask is None:
                mask = masks[id(slots)] = onehot.index_select(1, slots)
            return factors(x.float(), mask).to(x.dtype)

        return lora

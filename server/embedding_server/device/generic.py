"""The transformers backend: transformers' own model class behind the packed interface.

The native families (``models/``) are our own packed implementations, each checked against
transformers. Everything else transformers can load (T5 encoders, the long tail of encoder
architectures, and a checkpoint's own ``modeling_*.py`` when remote code is allowed) runs
here instead: :class:`TransformersModel` is an :class:`~.models.base.EmbeddingModel` whose
``forward`` takes the same :class:`~.models.base.PackedBatch`, cuts it into padded groups of
similar lengths, runs the transformers module on each (SDPA attention where the class
supports it, else eager) and returns the unpadded hidden states ``[T, hidden]``. So the
scheduler, admission, pooling (``device/pooling.py``), the sentence-transformers Dense and
Normalize head, the API and the metrics are the ones every native model goes through.

Choices, and why:

* **Which backend** (:func:`choose_backend`): ``auto`` is native when the registry has the
  ``model_type``, else transformers; ``native`` refuses what the registry lacks; ``transformers``
  forces this path (a check against the native path, or an escape hatch).
* **Which class**: transformers' encoder-only class where it has one
  (``AutoModelForTextEncoding``: ``T5EncoderModel`` for ``t5``, as sentence-transformers loads
  it), else ``AutoModel``; ``AutoModelFor{Sequence,Token}Classification`` for a classifier
  checkpoint, whose head (a pooler, ELECTRA's or DeBERTa's own heads ...) is then
  transformers' own too. Its logits are what the model returns per token (a sequence
  classifier's at every token of the sequence), read through an identity
  :class:`~.heads.ClassificationHead`, so labels, activations and the score/classify API are
  the ones the native heads use.
* **Remote code** (``auto_map`` in config.json) runs only with ``trust_remote_code``: it is
  arbitrary Python from the checkpoint's repository, executed inside the server. Without the
  setting such a checkpoint is refused before any of it is imported.
* **Nothing is dropped or invented silently**: a weight the class expects and the checkpoint
  lacks would be random, so it refuses the load (except a body's own pooler, which what is
  served never goes through: :data:`UNUSED_POOLER`); a checkpoint tensor the class does not
  read refuses it too, unless it is one of the few every family leaves unread
  (:data:`GENERIC_IGNORED`: pretraining heads, a decoder when the encoder embeds, ...).
* **One device**: the module is transformers' whole model, which cannot be split across
  tensor-parallel ranks; ``tensor_parallel_size > 1`` is refused with the reason.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from embedding_server.device.dtypes import resolve_dtype
from embedding_server.device.heads import ClassificationHead
from embedding_server.device.models import (
    ARCHITECTURES,
    IMAGE_MODEL_TYPES,
    NAMED,
    REFUSED,
    known_names,
)
from embedding_server.device.models.base import Ignored, PackedBatch
from embedding_server.device.models.names import check_names
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.heads import Classifier, declared_activation, head_kind, reward_kind
from embedding_server.request.pooling import PoolingMethod
from embedding_server.settings import Dtype, ModelBackend

logger = logging.getLogger(__name__)

ServedBackend = Literal["native", "transformers"]

GENERIC_IGNORED: tuple[Ignored, ...] = (
    Ignored(
        r"(.+\.)?position_ids",
        "a buffer of position indices some checkpoints save; the model computes positions",
    ),
    Ignored(
        r"(lm_head|cls\.predictions|cls\.seq_relationship|generator_lm_head|"
        r"discriminator_predictions|vocab_transform|vocab_layer_norm|vocab_projector)\..+",
        "a pretraining head (masked or causal LM, next sentence, replaced token detection): "
        "the body's hidden states are what is served",
    ),
    Ignored(
        r"(.+\.)?pooler\..+",
        "a pooler the loaded class does not have: pooling is the sentence-transformers "
        "config's, or the architecture's default",
    ),
)
"""Checkpoint tensors that the transformers backend may leave unread, with why."""

UNUSED_POOLER = Ignored(
    r"(.+\.)?pooler\..+",
    "the class's own pooler (BertModel, MPNetModel ...), which an embedder's hidden states do "
    "not go through; a masked-LM checkpoint has no weights for it",
)
"""Weights a body's class may lack in the checkpoint: they would be random, but are unused."""

ENCODER_DECODER_IGNORED = Ignored(
    r"decoder\..+",
    "the decoder of an encoder-decoder checkpoint: the encoder embeds, as sentence-transformers "
    "loads it",
)

FP16_OVERFLOWS = frozenset({"t5", "mt5", "umt5", "longt5"})
"""Model types whose activations overflow float16 (T5's feed-forward outputs): refused in
float16, and float32 where ``dtype=auto`` would pick float16, as the native families declare
it."""

PAD_SLACK = 0.2
PAD_TOKENS = 32
"""How much padding one padded call may carry: a group of sequences (in batch order, which
the runner sorts by length) grows while its padded size stays within ``(1 + PAD_SLACK)`` of
its real tokens plus ``PAD_TOKENS``. Padding costs a matmul row per padded token; a new call
costs transformers' per-call overhead (a few hundred microseconds a layer on a CPU). The
runner's batches are length-sorted and at most ``max_batch_tokens`` long, so this gives a
handful of calls per batch, each nearly free of padding."""

DEFAULT_POSITIONS = 512
"""Input limit of a model whose config declares none (relative positions: T5), when neither
its sentence-transformers config nor its tokenizer does either."""

_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length")
_CUSTOM_CODE_KEYS = ("AutoConfig", "AutoModel")


def native_model_type(config: Mapping[str, Any]) -> bool:
    """Whether the registry has a native implementation of the config's ``model_type``."""
    return str(config.get("model_type", "")) in ARCHITECTURES


def choose_backend(
    config: Mapping[str, Any],
    requested: ModelBackend,
    *,
    model: str,
    trust_remote_code: bool = False,
) -> ServedBackend:
    """The backend that serves ``config`` when ``requested`` (the setting) is asked for, or
    an error naming the model, what was found and what to do."""
    model_type = str(config.get("model_type", ""))
    if model_type in REFUSED:
        raise UnsupportedModelError(REFUSED[model_type])
    native = native_model_type(config)
    if requested == "transformers" and model_type in IMAGE_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model {model!r}: model_type {model_type!r} embeds images, which the "
            "transformers backend cannot carry (it runs text only, so the vision tower would "
            "go unused); serve it with backend native (or auto)"
        )
    if reward_kind(config) is not None and (requested == "transformers" or not native):
        # Reward heads are native only: no transformers class reads them as vLLM does.
        names = ", ".join(config.get("architectures") or [])
        way_out = (
            "serve it with backend native (or auto)"
            if native
            else f"model_type {model_type!r} has no native reward model (those implemented: "
            "Qwen2ForRewardModel and Qwen2ForProcessRewardModel, model_type qwen2; "
            "InternLM2ForRewardModel, internlm2)"
        )
        raise UnsupportedModelError(
            f"model {model!r}: {names} is a reward model, served by the native backend only "
            f"(the transformers backend serves no reward head); {way_out}"
        )
    if requested == "transformers":
        return "transformers"
    if native:
        return "native"
    if requested == "native":
        if custom_code_class(config) is not None:
            raise UnsupportedModelError(
                f"model {model!r}: {custom_code_refusal(config, trust_remote_code)}"
            )
        names = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise UnsupportedModelError(
            f"model {model!r}: backend native has no implementation of model_type {model_type!r} "
            f"({names}); native model types: {', '.join(sorted(ARCHITECTURES))}. Serve it with "
            "backend auto or transformers, which run transformers' own implementation"
        )
    return "transformers"


def custom_code_class(config: Mapping[str, Any]) -> str | None:
    """The class ``config.json``'s ``auto_map`` names for ``AutoModel`` (else its first
    entry), e.g. ``modeling_nvembed.NVEmbedModel``; None without custom code."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, Mapping) or not auto_map:
        return None
    for key in ("AutoModel", *auto_map):
        value = auto_map.get(key)
        if isinstance(value, list | tuple):
            value = next((v for v in value if isinstance(v, str)), None)
        if isinstance(value, str) and value:
            return value
    return None


def custom_code_refusal(config: Mapping[str, Any], trust_remote_code: bool) -> str:
    """Why a custom-code checkpoint whose ``model_type`` the native backend does not
    implement is refused, and how it could be served."""
    model_type = str(config.get("model_type", ""))
    found = (
        f"config.json's auto_map names custom code ({custom_code_class(config)}) for "
        f"model_type {model_type!r}, which the native backend does not implement "
        f"(it implements: {', '.join(sorted(ARCHITECTURES))}) and whose code it never runs"
    )
    if trust_remote_code:
        return (
            f"{found}. Remote code is allowed (--trust-remote-code), but only the generic "
            "transformers backend runs it: serve it with --backend transformers"
        )
    return (
        f"{found}. The generic transformers backend (--backend transformers) can serve it "
        "only if remote code is allowed (--trust-remote-code), which runs the repository's "
        "own Python code in the server: allow it only for a repository you trust"
    )


def tensor_parallel_refusal(model: str, config: Mapping[str, Any], size: int) -> str:
    """Why ``model`` cannot be split over ``size`` tensor-parallel ranks on this backend."""
    return (
        f"tensor_parallel_size {size}: {model} is served by the transformers backend "
        f"({_why_transformers(config)}), which runs transformers' own model whole on one "
        "device and cannot split it across ranks; serve it with tensor_parallel_size 1"
    )


def remote_code_class(config: Mapping[str, Any], auto_class: str) -> str | None:
    """The custom class ``config.json``'s ``auto_map`` names for ``auto_class`` (or for the
    config itself, ``AutoConfig``): code loading this checkpoint would run. None when the
    checkpoint loads with transformers' own classes."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, Mapping):
        return None
    for key in (auto_class, *_CUSTOM_CODE_KEYS):
        entry = auto_map.get(key)
        if isinstance(entry, str) and entry:
            return f"{key}: {entry}"
    return None


def remote_code_refusal(model: str, config: Mapping[str, Any], custom: str) -> str:
    """The message that refuses a custom-code checkpoint when remote code is not allowed."""
    return (
        f"{model} ships its own model code (config.json auto_map {custom}) and "
        f"{_why_transformers(config)}. Running it executes that Python code inside the server; "
        "allow it with --trust-remote-code (EMBEDDING_SERVER_TRUST_REMOTE_CODE, "
        "spec.model.trustRemoteCode in an EmbeddingService) if you trust the repository"
    )


def refuse_before_fetch(config: Mapping[str, Any], *, name: str, trust_remote_code: bool) -> None:
    """Refuse, from config.json alone (before any weight or code is fetched), what this
    backend cannot load: a checkpoint whose loading would run its own code when remote code
    is not allowed, and a model type transformers does not know that ships no code."""
    custom = remote_code_class(config, _AUTO_CLASSES[head_kind(config)])
    if custom is not None and not trust_remote_code:
        raise UnsupportedModelError(remote_code_refusal(name, config, custom))
    _refuse_unknown_type(config, name=name, custom=custom)
    if custom is None:
        _refuse_other_math(config, name=name)


def _refuse_other_math(config: Mapping[str, Any], *, name: str) -> None:
    """transformers builds a checkpoint without code of its own from its ``model_type``
    (``AutoModel``), whatever ``architectures`` names: GritLM, or a name the registry does
    not know for a native model type, would run as that type's plain model."""
    model_type = str(config.get("model_type", ""))
    for architecture in (str(a) for a in config.get("architectures") or []):
        if (model_type, architecture) in NAMED:
            raise UnsupportedModelError(
                f"model {name!r}: {architecture} runs other math on {model_type}'s weights "
                f"than transformers' {model_type} classes, which the transformers backend "
                "would run (it builds the model from model_type, not architectures); it is "
                "served natively: serve it with backend native (or auto)"
            )
    with_name = {**config, "auto_map": None}  # the way out named is not remote code
    try:
        check_names(with_name, model_type, known_names(model_type))
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"model {name!r}: {error.message}") from error


def refuse_task(config: Mapping[str, Any], *, name: str, task: str, splade: bool) -> None:
    """Refuse, from the config files alone, a task this backend does not serve: SPLADE (a
    SparseEncoder's pooling, or task sparse) and task reward are native only."""
    if splade or task == "sparse":
        raise UnsupportedModelError(
            f"model {name!r}: task sparse (SPLADE) is served by the native backend only, and this "
            f"model is on the transformers backend ({_why_transformers(config)})"
        )
    if task == "reward" or reward_kind(config) is not None:
        raise UnsupportedModelError(
            f"model {name!r}: task reward (a classifier's raw outputs at every token, a reward "
            "model's rewards) is served by the native backend only; the transformers backend "
            "serves score, classify and token_classify through transformers' own heads"
        )


def transformers_dtype(
    config: Mapping[str, Any], dtype: Dtype, device: torch.device
) -> torch.dtype:
    """The dtype ``dtype`` resolves to for ``config`` on ``device``, from config.json alone
    (so a refusal, T5 in float16, comes before any weight is fetched)."""
    model_type = str(config.get("model_type", ""))
    overflows = model_type if model_type in FP16_OVERFLOWS else None
    return resolve_dtype(dtype, device, fp16_overflows=overflows)


def _refuse_unknown_type(config: Mapping[str, Any], *, name: str, custom: str | None) -> None:
    from transformers import CONFIG_MAPPING, __version__

    model_type = str(config.get("model_type", ""))
    if custom is None and model_type not in CONFIG_MAPPING:
        names = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise UnsupportedModelError(
            f"model {name!r}: model_type {model_type!r} ({names}) has no native implementation "
            f"(native model types: {', '.join(sorted(ARCHITECTURES))}), transformers "
            f"{__version__} does not know it, and the checkpoint ships no code of its own "
            "(config.json has no auto_map)"
        )


_AUTO_CLASSES = {
    "sequence_classification": "AutoModelForSequenceClassification",
    "token_classification": "AutoModelForTokenClassification",
    None: "AutoModel",
}
"""The auto class a checkpoint loads with, by the head its architecture names."""


def _why_transformers(config: Mapping[str, Any]) -> str:
    """Why a config is served by the transformers backend, for messages."""
    if native_model_type(config):
        return "backend transformers was asked for"
    return f"model_type {str(config.get('model_type', ''))!r} has no native implementation"


class TransformersModel:
    """A transformers module serving packed batches: unpadded in, unpadded out.

    ``output`` says what the module returns: ``hidden`` (a body: its last hidden state),
    ``token_logits`` (a token classifier) or ``sequence_logits`` (a sequence classifier,
    whose logits are repeated at every token of their sequence so any pooling reads them).
    """

    causal = False
    position_offset = 0

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        hidden_size: int,
        max_positions: int,
        pad_token_id: int,
        output: Literal["hidden", "token_logits", "sequence_logits"],
        token_types: bool,
        attention: str,
        sliding_window: int | None = None,
    ) -> None:
        self.module = module
        self.hidden_size = hidden_size
        self.max_positions = max_positions
        self.sliding_window = sliding_window
        self.pad_token_id = pad_token_id
        self.output = output
        self.token_types = token_types
        self.attention = attention

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final states ``[T, hidden]`` (``[T, num_labels]`` for a classifier)."""
        parts = []
        start = 0
        for lengths in padded_groups(batch.seqlens):
            parts.append(self._run(batch, start, lengths))
            start += sum(lengths)
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts)

    def _run(self, batch: PackedBatch, start: int, lengths: Sequence[int]) -> torch.Tensor:
        device = batch.input_ids.device
        lens = torch.tensor(lengths, dtype=torch.int64)
        longest = int(lens.max())
        slot = torch.arange(longest)
        valid_host = slot.unsqueeze(0) < lens.unsqueeze(1)  # [n, L]
        offsets = start + torch.cumsum(lens, 0) - lens
        gather = torch.where(valid_host, offsets.unsqueeze(1) + slot, start).reshape(-1)
        gather_d, valid = gather.to(device), valid_host.to(device)
        ids = batch.input_ids.index_select(0, gather_d).view(valid.shape)
        inputs: dict[str, torch.Tensor] = {
            "input_ids": ids.masked_fill(~valid, self.pad_token_id),
            "attention_mask": valid.long(),
        }
        if self.token_types and batch.token_type_ids is not None:
            types = batch.token_type_ids.index_select(0, gather_d).view(valid.shape)
            inputs["token_type_ids"] = types.masked_fill(~valid, 0)
        result = self.module(**inputs)
        if self.output == "sequence_logits":
            logits = _output_tensor(result, "logits", self.module, rows=valid.shape[:1])
            return logits.repeat_interleave(lens.to(device), dim=0)
        if self.output == "token_logits":
            states = _output_tensor(result, "logits", self.module, rows=valid.shape)
        else:
            states = _output_tensor(result, "last_hidden_state", self.module, rows=valid.shape)
        return states[valid]

    def check_output(self, device: torch.device) -> None:
        """Run one short sequence and refuse the model unless its forward pass returns what
        this backend pools: per-token states (or a classifier's logits), not a vector the
        model has already pooled, nor a dict without them."""
        batch = PackedBatch.build([[self.pad_token_id] * 3], device)
        with torch.inference_mode():
            self._run(batch, 0, batch.seqlens)


def _output_tensor(
    result: Any, field: str, module: torch.nn.Module, *, rows: Sequence[int]
) -> torch.Tensor:
    """``result``'s ``field`` (a transformers ``ModelOutput``'s, a dict's, else the first
    item of a tuple or a bare tensor), checked to lead with the dimensions ``rows`` (batch,
    and tokens where per-token states are meant); else the model is refused, naming what
    its forward pass returned."""
    value: Any = None
    if isinstance(result, torch.Tensor):
        value = result
    elif isinstance(result, Mapping):
        # A ModelOutput is a Mapping of its set fields: the one asked for, or the first
        # (what result[0] is; T5's encoder names its states last_hidden_state too).
        value = result.get(field)
        if value is None and type(result).__name__ != "dict" and result:
            value = next(iter(result.values()))
    elif isinstance(result, tuple) and result:
        value = result[0]
    leading = tuple(rows)
    if (
        isinstance(value, torch.Tensor)
        and value.dim() >= len(leading) + 1
        and tuple(value.shape[: len(leading)]) == leading
    ):
        return value
    expected = "[batch, tokens, hidden]" if len(leading) == 2 else "[batch, labels]"
    raise UnsupportedModelError(
        f"{type(module).__name__}'s forward pass returns {_describe_output(result)}, not the "
        f"{field} {expected} this backend pools, truncates and batches; a model whose code "
        "returns a vector it has already pooled itself (NV-Embed-v2's sentence_embeddings) "
        "or other outputs cannot be served by it, so it is refused"
    )


def _describe_output(result: Any) -> str:
    """What a forward pass returned, for a refusal: its type, with the keys and shapes."""

    def shape(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"a tensor of shape {list(value.shape)}"
        return type(value).__name__

    if isinstance(result, torch.Tensor):
        return shape(result)
    if isinstance(result, Mapping):
        fields = ", ".join(f"{key!r}: {shape(value)}" for key, value in result.items())
        return f"a {type(result).__name__} {{{fields}}}"
    if isinstance(result, tuple):
        return f"a tuple ({', '.join(shape(value) for value in result)})"
    return f"a {type(result).__name__}"


def padded_groups(seqlens: Sequence[int]) -> list[list[int]]:
    """``seqlens`` cut, in order, into runs that are padded to their longest together (see
    :data:`PAD_SLACK`)."""
    groups: list[list[int]] = []
    current: list[int] = []
    real = longest = 0
    for length in seqlens:
        widest = max(longest, length)
        if current and (len(current) + 1) * widest > (real + length) * (1 + PAD_SLACK) + PAD_TOKENS:
            groups.append(current)
            current, real, widest = [], 0, length
        current.append(length)
        real += length
        longest = widest
    if current:
        groups.append(current)
    return groups


@dataclass
class TransformersBuild:
    """What :func:`build_transformers` loads: the model, its dtype, and its classifier."""

    model: TransformersModel
    dtype: torch.dtype
    head_dim: int
    default_pooling: PoolingMethod
    classifier: tuple[Classifier, ClassificationHead] | None


def build_transformers(
    path: Path,
    config: Mapping[str, Any],
    *,
    name: str,
    dtype: Dtype,
    device: torch.device,
    task: str,
    trust_remote_code: bool,
    st_activation: str | None,
    splade: bool,
    declared_max_length: int | None,
) -> TransformersBuild:
    """Load ``path`` with transformers' own class for it, on ``device`` in the dtype ``dtype``
    resolves to, or refuse it saying why (remote code not allowed, weights missing or unread,
    a task this backend does not serve)."""
    model_type = str(config.get("model_type", ""))
    refuse_task(config, name=name, task=task, splade=splade)
    kind = head_kind(config)
    auto_class = _AUTO_CLASSES[kind]
    custom = remote_code_class(config, auto_class)
    if custom is not None and not trust_remote_code:
        raise UnsupportedModelError(remote_code_refusal(name, config, custom))
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    _refuse_unknown_type(config, name=name, custom=custom)
    try:
        hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, StrictDataclassError) as error:
        raise UnsupportedModelError(
            f"model {name!r}: transformers cannot read its config "
            f"(model_type {model_type!r}): {error}"
        ) from error
    loader = _auto_class(auto_class, model_type, custom is not None)
    compute_dtype = transformers_dtype(config, dtype, device)
    hf_module, info, attention = _load_module(
        loader, path, name=name, dtype=compute_dtype, trust_remote_code=trust_remote_code
    )
    ignorable = list(GENERIC_IGNORED)
    if config.get("is_encoder_decoder") or loader.__name__ == "AutoModelForTextEncoding":
        ignorable.append(ENCODER_DECODER_IGNORED)
    # A classifier's pooler feeds its head: there a missing one would change the logits.
    unused = (UNUSED_POOLER,) if kind is None else ()
    _check_weights(info, name=name, ignorable=ignorable, unused=unused)
    hf_module.to(device).eval().requires_grad_(False)
    hidden_size = _hidden_size(hf_config, hf_module)
    classifier = None
    output: Literal["hidden", "token_logits", "sequence_logits"] = "hidden"
    width = hidden_size
    if kind is not None:
        labels = _labels(hf_config)
        per_token = kind == "token_classification"
        output = "token_logits" if per_token else "sequence_logits"
        width = len(labels)
        activation = declared_activation(config, st_activation)
        head = ClassificationHead(weight=torch.eye(width), bias=None)
        # Every token row of a sequence classifier holds its logits: cls reads the first.
        classifier = (Classifier("cls", labels, activation, per_token=per_token), head)
    forward_parameters = _forward_parameters(hf_module)
    body = TransformersModel(
        hf_module,
        hidden_size=width,
        max_positions=_max_positions(config, declared_max_length),
        pad_token_id=_pad_token_id(config),
        output=output,
        token_types="token_type_ids" in forward_parameters,
        attention=attention,
        sliding_window=_sliding_window(config),
    )
    body.check_output(device)
    logger.info(
        "transformers backend: %s (%s, attention %s, %s)",
        type(hf_module).__name__,
        "remote code " + custom if custom else "transformers' own code",
        attention,
        str(compute_dtype).removeprefix("torch."),
    )
    return TransformersBuild(
        model=body,
        dtype=compute_dtype,
        head_dim=_head_dim(hf_config, hidden_size),
        default_pooling=_default_pooling(config),
        classifier=classifier,
    )


def _auto_class(auto_class: str, model_type: str, custom: bool) -> Any:
    """transformers' auto class that loads the checkpoint: its encoder-only class where it
    has one and the checkpoint ships no code of its own (T5 -> T5EncoderModel)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES

    if (
        auto_class == "AutoModel"
        and not custom
        and model_type in MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES
    ):
        return transformers.AutoModelForTextEncoding
    return getattr(transformers, auto_class)


def _load_module(
    loader: Any, path: Path, *, name: str, dtype: torch.dtype, trust_remote_code: bool
) -> tuple[torch.nn.Module, Mapping[str, Any], str]:
    """The module, its loading report, and the attention it runs: SDPA where its class
    supports it, else eager."""
    for attention in ("sdpa", "eager"):
        try:
            model, info = loader.from_pretrained(
                str(path),
                dtype=dtype,
                attn_implementation=attention,
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
            )
        except ValueError as error:
            if attention == "sdpa" and "scaled_dot_product_attention" in str(error):
                logger.info("transformers backend: %s: eager attention", str(error).split(".")[0])
                continue
            raise UnsupportedModelError(
                f"model {name!r}: transformers cannot load it: {error}"
            ) from error
        except (OSError, KeyError, ImportError, RuntimeError) as error:
            # RuntimeError: a weight whose shape is not the config's (a vocab_size or a
            # position table that config.json overstates), which transformers refuses.
            raise UnsupportedModelError(
                f"model {name!r}: transformers cannot load it: {error}"
            ) from error
        chosen = getattr(model.config, "_attn_implementation", None) or attention
        return model, info, str(chosen)
    raise AssertionError("unreachable: eager attention is always accepted")


def _check_weights(
    info: Mapping[str, Any],
    *,
    name: str,
    ignorable: Sequence[Ignored],
    unused: Sequence[Ignored] = (),
) -> None:
    """Refuse a load that would run with random weights or drop checkpoint tensors;
    ``ignorable``: checkpoint tensors it may leave unread; ``unused``: weights of the class
    the checkpoint may lack, since they never touch what is served."""
    missing = sorted(
        str(k)
        for k in info.get("missing_keys") or ()
        if not any(re.fullmatch(u.pattern, str(k)) for u in unused)
    )
    mismatched = sorted(
        str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ()
    )
    if missing or mismatched:
        what = missing or mismatched
        kind = "lacks" if missing else "has tensors of the wrong shape for"
        raise UnsupportedModelError(
            f"{name} {kind} {len(what)} weight(s) its transformers class expects "
            f"({_listing(what)}); transformers would initialise them at random. Is it a "
            "complete checkpoint of its architecture?"
        )
    unread = []
    for key in sorted(str(k) for k in info.get("unexpected_keys") or ()):
        known = next((i for i in ignorable if re.fullmatch(i.pattern, key)), None)
        if known is None:
            unread.append(key)
        else:
            logger.debug("transformers backend: not reading %s: %s", key, known.reason)
    if unread:
        raise UnsupportedModelError(
            f"{name} holds {len(unread)} tensor(s) its transformers class does not read "
            f"({_listing(unread)}); serving it would drop them silently (a head this server "
            "does not know?). Serve a checkpoint without them, or one whose architecture "
            "names that head"
        )


def _listing(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", and {len(names) - limit} more" if len(names) > limit else "")


def _forward_parameters(module: torch.nn.Module) -> frozenset[str]:
    return frozenset(inspect.signature(module.forward).parameters)


def _hidden_size(hf_config: Any, module: torch.nn.Module) -> int:
    size = getattr(hf_config, "hidden_size", None)
    if isinstance(size, int) and size > 0:
        return size
    getter = getattr(module, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    width = getattr(embeddings, "embedding_dim", None)
    if isinstance(width, int):
        return width
    raise UnsupportedModelError(f"{type(module).__name__}: cannot tell its hidden size")


def _head_dim(hf_config: Any, hidden_size: int) -> int:
    for key in ("head_dim", "d_kv"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    heads = getattr(hf_config, "num_attention_heads", None)
    return hidden_size // heads if isinstance(heads, int) and heads > 0 else 0


def _labels(hf_config: Any) -> tuple[str, ...]:
    id2label = getattr(hf_config, "id2label", None) or {}
    count = int(getattr(hf_config, "num_labels", len(id2label)))
    return tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(count))


def _max_positions(config: Mapping[str, Any], declared: int | None) -> int:
    for key in _POSITION_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return declared or DEFAULT_POSITIONS


def _pad_token_id(config: Mapping[str, Any]) -> int:
    pad = config.get("pad_token_id")
    return pad if isinstance(pad, int) and pad >= 0 else 0


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if not isinstance(window, int) or config.get("use_sliding_window") is False:
        return None
    return window


def _default_pooling(config: Mapping[str, Any]) -> PoolingMethod:
    """Pooling without a sentence-transformers config: the last token of a decoder (only it
    has seen the whole input), the mean for an encoder-decoder's encoder (T5 has no CLS
    token), else CLS, as the native encoders default."""
    architectures = [str(a) for a in config.get("architectures") or []]
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "last"
    if config.get("is_encoder_decoder") or str(config.get("model_type")) in FP16_OVERFLOWS:
        return "mean"
    return "cls"

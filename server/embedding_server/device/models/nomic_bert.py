"""NomicBERT on packed tokens: nomic-embed-text-v1 / v1.5 and snowflake-arctic-embed-m-long.

A post-LayerNorm BERT without position embeddings: word + segment embeddings and a
LayerNorm (``emb_ln``), then per layer a fused bias-free ``Wqkv`` with non-interleaved rotary
embeddings over the whole head (base ``rotary_emb_base``, 1000 by default), ``out_proj``,
``norm1`` over the residual sum, a SwiGLU MLP and ``norm2``. The MLP is
``fc2(fc11(x) * silu(fc12(x)))``: fc11 is the up projection, fc12 the gate, as the
remote code computes it (``y = fc11(x); y * act(fc12(x))``) and transformers' weight
conversion maps them (fc11 -> up_proj, fc12 -> gate_proj).

Hub configs are GPT-2-style (``n_embd``, ``n_layer``, ``n_head``, ``n_inner``,
``n_positions``, ``layer_norm_epsilon``, ``rotary_emb_base``, ``activation_function``,
``rotary_scaling_factor``, ``max_trained_positions``); transformers' native configs use
``hidden_size`` ... and ``rope_parameters``. Both are read (``CONFIG_KEYS`` maps the common
ones; the rotary keys are read here).

Dynamic NTK: with ``rotary_scaling_factor`` set, a sequence of ``L`` tokens beyond
``max_trained_positions`` (``M``) gets the rotary base
``base * (factor * L / M - (factor - 1)) ** (d / (d - 2))`` (:func:`ntk_base`), the formula of
the remote code's ``NomicBertDynamicNTKRotaryEmbedding`` and of transformers' ``dynamic``
rope. Both compute it from the *padded* batch length, so there a short text's vector depends
on the longest text batched with it (and the remote code's cache keeps the scaled base for
later, shorter batches). Here each sequence is scaled by its own length: a text's vector is
what the reference gives for it alone, whatever it is batched with.

What the reference cannot check, or we do not implement, is refused by name: pre-LN
(``prenorm``), partial or interleaved rotary, xPos (``rotary_emb_scale_base``), biases, RMSNorm,
parallel blocks, causal attention, other MLP activations, and the MoE layers of
nomic-embed-text-v2-moe (served by the generic transformers path with
``--trust-remote-code``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.errors import UnsupportedModelError

from ..heads import ClassifierNames
from .base import Checkpoint, Ignored, PackedBatch, config_get
from .layers import ACT_FUNCS, HeadSplit, RotaryTable, apply_rotary, rope_inv_freq, row_linear

MODEL_TYPE = "nomic_bert"
DEFAULT_BASE = 1000.0
"""NomicBertConfig's ``rotary_emb_base`` (and transformers' ``default_theta``)."""
DEFAULT_TRAINED = 2048
"""The remote code's default ``max_trained_positions``."""

CONFIG_KEYS = (
    ("hidden_size", "n_embd"),
    ("num_hidden_layers", "n_layer"),
    ("num_attention_heads", "n_head"),
    ("intermediate_size", "n_inner"),
    ("max_position_embeddings", "n_positions"),
    ("layer_norm_eps", "layer_norm_epsilon"),
)
"""The Hub's GPT-2-style keys beside transformers' native ones."""

_PREFIX = r"(?:nomic_bert\.|bert\.)?"
IGNORED = (
    Ignored(
        _PREFIX + r"pooler\.dense\.(?:weight|bias)",
        "the BERT-style pooler (dense + tanh over the first token): embeddings mean-pool "
        "the final hidden states; only a *ForSequenceClassification head reads it",
    ),
    Ignored(
        _PREFIX + r"embeddings\.(?:position_ids|token_type_ids)",
        "index buffers (0, 1, 2 ... and all zeros); positions and segment ids come from "
        "the packed batch",
    ),
    Ignored(
        r"cls\.predictions\..+",
        "the masked-LM head of NomicBertForMaskedLM / ForPreTraining: no task serves it",
    ),
)

CLASSIFIER = ClassifierNames(out="classifier.", dense="nomic_bert.pooler.dense.")
"""BERT's head: the pooler (dense + tanh on the first token), then ``classifier``; token
classifiers have ``classifier`` alone."""

_ACTIVATIONS = {"swiglu": "silu"}
"""The Hub's gated ``activation_function`` names -> the gate's activation."""


def _refusals(config: Mapping[str, Any]) -> list[str]:
    """What the config asks for that this implementation cannot serve exactly."""
    out = []
    if int(config.get("moe_every_n_layers") or 0) > 0 or int(config.get("num_experts") or 0) > 0:
        out.append(
            f"mixture-of-experts layers (moe_every_n_layers={config.get('moe_every_n_layers')}, "
            f"num_experts={config.get('num_experts')}, nomic-embed-text-v2-moe) are not served "
            "natively yet; serve the model with the generic transformers backend and its own "
            "code: --backend transformers --trust-remote-code"
        )
    if config.get("prenorm"):
        out.append("prenorm: true (pre-LayerNorm blocks); NomicBERT is served post-LN only")
    fraction = float(config.get("rotary_emb_fraction", 1.0) or 0.0)
    if fraction != 1.0:
        out.append(
            f"rotary_emb_fraction={config.get('rotary_emb_fraction')} (rotary on part of "
            "each head); only 1.0 is served"
        )
    if config.get("rotary_emb_interleaved"):
        out.append("rotary_emb_interleaved: true (GPT-J pairing); only the non-interleaved")
    if config.get("rotary_emb_scale_base") is not None:
        out.append(f"rotary_emb_scale_base={config['rotary_emb_scale_base']} (xPos)")
    for key in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias"):
        if config.get(key):
            out.append(f"{key}: true (biases the published checkpoints do not have)")
    for key, what in (
        ("use_rms_norm", "RMSNorm"),
        ("parallel_block", "parallel attention and MLP blocks"),
        ("causal", "causal attention"),
        ("scale_attn_by_inverse_layer_idx", "attention scaled by the layer index"),
    ):
        if config.get(key):
            out.append(f"{key}: true ({what})")
    if config.get("scale_attn_weights") is False:
        out.append("scale_attn_weights: false (unscaled attention logits)")
    return out


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, naming each, the config values this implementation cannot serve exactly (the
    registry runs it on config.json alone, before any weight is fetched)."""
    refused = _refusals(config)
    if refused:
        raise UnsupportedModelError(
            f"{MODEL_TYPE} config.json asks for what is not served natively: " + "; ".join(refused)
        )
    _gate_activation(config)
    RotaryConfig.of(config)


def _gate_activation(config: Mapping[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP gate's activation: the Hub's ``activation_function`` (swiglu) or the native
    ``hidden_act`` (silu)."""
    hub = config.get("activation_function")
    if hub is not None:
        if hub not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"{MODEL_TYPE} activation_function {hub!r} is not supported; supported: "
                f"{', '.join(sorted(_ACTIVATIONS))}"
            )
        return ACT_FUNCS[_ACTIVATIONS[hub]]
    name = str(config.get("hidden_act") or "silu")
    if name not in ACT_FUNCS:
        raise UnsupportedModelError(
            f"{MODEL_TYPE} hidden_act {name!r} is not supported; supported: {sorted(ACT_FUNCS)}"
        )
    return ACT_FUNCS[name]


@dataclass(frozen=True)
class RotaryConfig:
    """The rotary embedding of a NomicBERT config: its base, and the dynamic-NTK scaling
    (``factor`` None: none) that applies beyond ``trained`` positions."""

    base: float
    factor: float | None
    trained: int

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> RotaryConfig:
        """From the Hub's ``rotary_emb_base`` / ``rotary_scaling_factor`` /
        ``max_trained_positions``, else the native ``rope_parameters`` (``rope_type``
        default or dynamic, whose trained length is ``original_max_position_embeddings``
        or ``max_position_embeddings``, as transformers reads it)."""
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        base = float(
            config_get(config, "rotary_emb_base", "rope_theta", default=None)
            or params.get("rope_theta")
            or DEFAULT_BASE
        )
        if "rotary_scaling_factor" in config or "max_trained_positions" in config:
            factor = config.get("rotary_scaling_factor")
            trained = int(config.get("max_trained_positions") or DEFAULT_TRAINED)
            return cls(base, None if factor is None else float(factor), trained)
        kind = params.get("rope_type", params.get("type", "default"))
        trained = int(
            params.get("original_max_position_embeddings")
            or config.get("max_position_embeddings")
            or DEFAULT_TRAINED
        )
        if kind == "default":
            return cls(base, None, trained)
        if kind == "dynamic":
            return cls(base, float(params["factor"]), trained)
        raise UnsupportedModelError(
            f"{MODEL_TYPE} rope_type {kind!r} is not supported; supported: default, dynamic "
            "(NomicBERT's dynamic NTK)"
        )


def ntk_base(base: float, factor: float, trained: int, length: int, head_dim: int) -> float:
    """The dynamic-NTK rotary base of a sequence of ``length`` tokens: ``base`` up to
    ``trained`` tokens, beyond it ``base * (factor * length / trained - (factor - 1)) **
    (head_dim / (head_dim - 2))``."""
    if length <= trained:
        return base
    stretch = factor * length / trained - (factor - 1)
    return base * float(stretch ** (head_dim / (head_dim - 2)))


@dataclass
class _Layer:
    qkv_w: torch.Tensor
    out_w: torch.Tensor
    norm1_w: torch.Tensor
    norm1_b: torch.Tensor
    up_gate_w: torch.Tensor  # this rank's fc11 rows, then its fc12 rows
    down_w: torch.Tensor
    norm2_w: torch.Tensor
    norm2_b: torch.Tensor


class NomicBertModel:
    """A NomicBERT encoder body for packed batches (bidirectional)."""

    causal = False
    position_offset = 0
    sliding_window: int | None = None

    def __init__(self, checkpoint: Checkpoint) -> None:
        config, dtype, device = checkpoint.config, checkpoint.dtype, checkpoint.device
        check_config(config)
        self._act = _gate_activation(config)
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        intermediate = config.get("intermediate_size")
        if intermediate is None:
            raise UnsupportedModelError(
                f"{MODEL_TYPE} config.json gives no n_inner / intermediate_size; the MLP "
                "width must be stated"
            )
        if self.hidden_size % self.num_heads:
            raise UnsupportedModelError(
                f"{MODEL_TYPE} hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_heads}"
            )
        self.head_dim = self.hidden_size // self.num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.max_positions = int(config.get("max_position_embeddings", 2048))
        self.shard = checkpoint.shard
        self.split = split = HeadSplit.of(
            checkpoint.shard,
            MODEL_TYPE,
            heads=self.num_heads,
            kv_heads=self.num_heads,
            head_dim=self.head_dim,
            intermediate=int(intermediate),
        )
        self.rope = RotaryConfig.of(config)
        self.rotary = RotaryTable.of(
            {"rope_theta": self.rope.base}, self.head_dim, dtype=dtype, device=device
        )
        self.dtype, self.device = dtype, device

        # NomicBertModel checkpoints (the Hub's) are bare; transformers' task models nest the
        # body under ``nomic_bert.``, the remote code's pre-training model under ``bert.``.
        w = checkpoint.reader(
            prefixes=("nomic_bert.", "bert."), marker="embeddings.", architecture=MODEL_TYPE
        )
        get = w.get
        self.word_emb = w.embedding("embeddings.word_embeddings.weight")
        self.type_emb: torch.Tensor | None = None
        if "embeddings.token_type_embeddings.weight" in w:
            self.type_emb = get("embeddings.token_type_embeddings.weight")
        self.emb_ln_w, self.emb_ln_b = get("emb_ln.weight"), get("emb_ln.bias")
        self.layers: list[_Layer] = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layers.{i}."
            self.layers.append(
                _Layer(
                    qkv_w=w.rows(p + "attn.Wqkv.weight", split.q, blocks=3),
                    out_w=w.columns(p + "attn.out_proj.weight", split.q),
                    norm1_w=get(p + "norm1.weight"),
                    norm1_b=get(p + "norm1.bias"),
                    up_gate_w=w.cat(
                        (p + "mlp.fc11.weight", p + "mlp.fc12.weight"), (split.mlp, split.mlp)
                    ),
                    down_w=w.columns(p + "mlp.fc2.weight", split.mlp),
                    norm2_w=get(p + "norm2.weight"),
                    norm2_b=get(p + "norm2.bias"),
                )
            )

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), weight, bias, self.eps)

    def rotary_embedding(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin per token ``[T, 1, head_dim]``; a sequence longer than the trained length
        (with dynamic NTK) gets the tables of its own scaled base."""
        cos, sin = self.rotary.lookup(batch.position_ids, batch.max_seqlen)
        factor, trained = self.rope.factor, self.rope.trained
        if factor is None or batch.max_seqlen <= trained:
            return cos, sin
        cos, sin = cos.clone(), sin.clone()
        start = 0
        for length in batch.seqlens:
            if length > trained:
                base = ntk_base(self.rope.base, factor, trained, length, self.head_dim)
                inv_freq = rope_inv_freq({"rope_theta": base}, self.head_dim).to(self.device)
                positions = batch.position_ids[start : start + length].float()
                freqs = torch.outer(positions, inv_freq)
                emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
                cos[start : start + length] = emb.cos().to(self.dtype)
                sin[start : start + length] = emb.sin().to(self.dtype)
            start += length
        return cos, sin

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        t = batch.input_ids.shape[0]
        heads, d, shard = self.split.heads, self.head_dim, self.shard
        rope = self.rotary_embedding(batch)
        x = self.word_emb(batch.input_ids)
        if self.type_emb is not None:
            if batch.token_type_ids is not None:
                x = x + self.type_emb.index_select(0, batch.token_type_ids)
            else:
                x = x + self.type_emb[0]
        x = self._norm(x, self.emb_ln_w, self.emb_ln_b)
        for layer in self.layers:
            q, k, v = F.linear(x, layer.qkv_w).view(t, 3, heads, d).unbind(1)
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            attn = batch.attention(q, k, v, causal=False, scale=self.scale)
            x = self._norm(
                x + row_linear(attn.reshape(t, heads * d), layer.out_w, None, shard),
                layer.norm1_w,
                layer.norm1_b,
            )
            up, gate = F.linear(x, layer.up_gate_w).chunk(2, dim=-1)
            x = self._norm(
                x + row_linear(up * self._act(gate), layer.down_w, None, shard),
                layer.norm2_w,
                layer.norm2_b,
            )
        return x

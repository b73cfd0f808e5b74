"""NomicBERT on packed tokens: nomic-embed-text-v1 / v1.5 / v2-moe and
snowflake-arctic-embed-m-long.

A post-LayerNorm BERT without position embeddings: word + segment embeddings and a
LayerNorm (``emb_ln``), then per layer a fused ``Wqkv`` with non-interleaved rotary
embeddings over the whole head (base ``rotary_emb_base``, 1000 by default), ``out_proj``,
``norm1`` over the residual sum, the MLP and ``norm2``. v1's MLP is SwiGLU,
``fc2(fc11(x) * silu(fc12(x)))``: fc11 is the up projection, fc12 the gate, as the
remote code computes it (``y = fc11(x); y * act(fc12(x))``) and transformers' weight
conversion maps them (fc11 -> up_proj, fc12 -> gate_proj).

nomic-embed-text-v2-moe (``activation_function: gelu``) has biases on ``Wqkv`` and
``out_proj`` (``qkv_proj_bias``) and a plain ``fc2(gelu(fc1(x)))`` MLP with biases
(``mlp_fc1_bias``, ``mlp_fc2_bias``), and every ``moe_every_n_layers``-th layer (those with
``i % n == 1``, as the remote code picks them) replaces it with a mixture of experts: a
bias-free router (``mlp.router.layer``) whose float32 softmax picks the top ``moe_top_k`` of
``num_experts`` experts per token, their probabilities used as they are (not renormalized);
expert ``e`` computes ``gelu(x @ w1[e].T) @ w2[e]`` from ``mlp.experts.mlp.w1`` / ``w2``
(``[E * I, H]`` each, expert-major), and ``mlp.experts.bias`` is added to the weighted sum.
The tokens are grouped by expert, so each expert runs once per batch over all its tokens
(:meth:`NomicBertModel._moe`); under tensor parallelism each rank holds every expert's share
of the intermediate features, like a dense MLP's.

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
(``prenorm``), partial or interleaved rotary, xPos (``rotary_emb_scale_base``), biases on the
gated MLP, RMSNorm, parallel blocks, causal attention, other MLP activations, and experts
routed otherwise than v2-moe's (renormalized weights, shared experts, expert-choice routing).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.heads import ClassifierNames
from embedding_server.device.models.base import (
    Checkpoint,
    Ignored,
    PackedBatch,
    WeightReader,
    config_get,
)
from embedding_server.device.models.layers import (
    ACT_FUNCS,
    HeadSplit,
    RotaryTable,
    apply_rotary,
    attention_shape,
    rope_inv_freq,
    row_linear,
)
from embedding_server.errors import UnsupportedModelError

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
_PLAIN_ACTIVATIONS = {"gelu": "gelu"}
"""The Hub's ungated ``activation_function`` names (the remote code's exact GELU for
``gelu``; nomic-embed-text-v2-moe) -> the activation."""


def _refusals(config: Mapping[str, Any]) -> list[str]:
    """What the config asks for that this implementation cannot serve exactly."""
    out = []
    every = int(config.get("moe_every_n_layers") or 0)
    if every <= 0 and int(config.get("num_experts") or 0) > 0:
        out.append(
            f"num_experts={config.get('num_experts')} without moe_every_n_layers: which "
            "layers hold the mixture-of-experts is not stated"
        )
    if every > 0:
        if int(config.get("num_experts") or 0) <= 0 or int(config.get("moe_top_k") or 0) <= 0:
            out.append(
                f"mixture-of-experts layers (moe_every_n_layers={every}) without num_experts "
                "and moe_top_k"
            )
        elif int(config["moe_top_k"]) > int(config["num_experts"]):
            out.append(f"moe_top_k={config['moe_top_k']} > num_experts={config['num_experts']}")
        if config.get("moe_normalize_expert_weights"):
            out.append(
                "moe_normalize_expert_weights (renormalized expert weights; "
                "nomic-embed-text-v2-moe uses the router's probabilities as they are)"
            )
        if int(config.get("num_shared_experts") or 0) > 0:
            out.append(f"num_shared_experts={config['num_shared_experts']} (shared experts)")
        if config.get("expert_choice_router"):
            out.append("expert_choice_router: true (experts choosing tokens)")
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
    gated = config.get("activation_function", "swiglu") in _ACTIVATIONS
    for key in ("mlp_fc1_bias", "mlp_fc2_bias"):
        if config.get(key) and gated:
            out.append(f"{key}: true on the gated MLP (biases no published checkpoint has)")
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
    _activation(config)
    RotaryConfig.of(config)


def _activation(config: Mapping[str, Any]) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool]:
    """The MLP's activation and whether the MLP is gated: the Hub's ``activation_function``
    (swiglu: gated, silu on fc12; gelu: nomic-embed-text-v2-moe's plain fc1 -> gelu -> fc2,
    the experts' too) or the native ``hidden_act`` (silu, gated)."""
    hub = config.get("activation_function")
    if hub is not None:
        if hub in _ACTIVATIONS:
            return ACT_FUNCS[_ACTIVATIONS[hub]], True
        if hub in _PLAIN_ACTIVATIONS:
            return ACT_FUNCS[_PLAIN_ACTIVATIONS[hub]], False
        raise UnsupportedModelError(
            f"{MODEL_TYPE} activation_function {hub!r} is not supported; supported: "
            f"{', '.join(sorted([*_ACTIVATIONS, *_PLAIN_ACTIVATIONS]))}"
        )
    name = str(config.get("hidden_act") or "silu")
    if name not in ACT_FUNCS:
        raise UnsupportedModelError(
            f"{MODEL_TYPE} hidden_act {name!r} is not supported; supported: {sorted(ACT_FUNCS)}"
        )
    return ACT_FUNCS[name], True


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
class _Experts:
    """One mixture-of-experts MLP (nomic-embed-text-v2-moe): a bias-free router, ``E``
    experts of ``fc -> act -> fc`` stored as two ``[E * I, H]`` blocks (expert-major; the
    second applied untransposed), this rank's ``I`` columns of each, and one output bias
    added after the weighted sum."""

    router_w: torch.Tensor  # [E, H], replicated
    w1: torch.Tensor  # [E, I_rank, H]
    w2: torch.Tensor  # [E, I_rank, H]
    bias: torch.Tensor  # [H]


@dataclass
class _Layer:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    out_w: torch.Tensor
    out_b: torch.Tensor | None
    norm1_w: torch.Tensor
    norm1_b: torch.Tensor
    up_gate_w: torch.Tensor | None  # gated: this rank's fc11 rows, then its fc12 rows
    up_w: torch.Tensor | None  # ungated: this rank's fc1 rows
    up_b: torch.Tensor | None
    down_w: torch.Tensor | None
    down_b: torch.Tensor | None
    norm2_w: torch.Tensor
    norm2_b: torch.Tensor
    experts: _Experts | None = None


class NomicBertModel:
    """A NomicBERT encoder body for packed batches (bidirectional)."""

    causal = False
    position_offset = 0
    sliding_window: int | None = None

    def __init__(self, checkpoint: Checkpoint) -> None:
        config, dtype, device = checkpoint.config, checkpoint.dtype, checkpoint.device
        check_config(config)
        self._act, self.gated = _activation(config)
        self.moe_every = int(config.get("moe_every_n_layers") or 0)
        self.num_experts = int(config.get("num_experts") or 0)
        self.top_k = int(config.get("moe_top_k") or 0)
        intermediate = config.get("intermediate_size")
        if intermediate is None:
            raise UnsupportedModelError(
                f"{MODEL_TYPE} config.json gives no n_inner / intermediate_size; the MLP "
                "width must be stated"
            )
        self.hidden_size, self.num_heads, self.head_dim, self.scale = attention_shape(
            config, MODEL_TYPE
        )
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.max_positions = int(config.get("max_position_embeddings", 2048))
        self.shard = checkpoint.shard
        self.split = HeadSplit.of(
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
        self.layers = [
            self._read_layer(w, i, bool(config.get("qkv_proj_bias")), config)
            for i in range(int(config["num_hidden_layers"]))
        ]

    def _read_layer(
        self, w: WeightReader, i: int, qkv_bias: bool, config: Mapping[str, Any]
    ) -> _Layer:
        """Layer ``i``'s weights, this rank's share. Layers ``i % moe_every_n_layers == 1``
        hold the mixture of experts, as the remote code builds them."""
        get, split = w.get, self.split
        p = f"encoder.layers.{i}."
        experts = up_gate = up = up_b = down = down_b = None
        if self.moe_every > 0 and i % self.moe_every == 1:
            e, m = self.num_experts, p + "mlp."
            experts = _Experts(
                router_w=get(m + "router.layer.weight"),
                w1=w.rows(m + "experts.mlp.w1", split.mlp, blocks=e).view(e, -1, self.hidden_size),
                w2=w.rows(m + "experts.mlp.w2", split.mlp, blocks=e).view(e, -1, self.hidden_size),
                bias=get(m + "experts.bias"),
            )
        elif self.gated:
            up_gate = w.cat((p + "mlp.fc11.weight", p + "mlp.fc12.weight"), (split.mlp, split.mlp))
            down = w.columns(p + "mlp.fc2.weight", split.mlp)
        else:
            up = w.rows(p + "mlp.fc1.weight", split.mlp)
            if config.get("mlp_fc1_bias"):
                up_b = w.rows(p + "mlp.fc1.bias", split.mlp)
            down = w.columns(p + "mlp.fc2.weight", split.mlp)
            down_b = w.maybe(p + "mlp.fc2.bias", bool(config.get("mlp_fc2_bias")))
        return _Layer(
            qkv_w=w.rows(p + "attn.Wqkv.weight", split.q, blocks=3),
            qkv_b=w.rows(p + "attn.Wqkv.bias", split.q, blocks=3) if qkv_bias else None,
            out_w=w.columns(p + "attn.out_proj.weight", split.q),
            out_b=w.maybe(p + "attn.out_proj.bias", qkv_bias),
            norm1_w=get(p + "norm1.weight"),
            norm1_b=get(p + "norm1.bias"),
            up_gate_w=up_gate,
            up_w=up,
            up_b=up_b,
            down_w=down,
            down_b=down_b,
            norm2_w=get(p + "norm2.weight"),
            norm2_b=get(p + "norm2.bias"),
            experts=experts,
        )

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """The layer's MLP output (before the residual sum), whole on every rank."""
        if layer.experts is not None:
            return self._moe(x, layer.experts)
        assert layer.down_w is not None
        if layer.up_gate_w is not None:
            up, gate = F.linear(x, layer.up_gate_w).chunk(2, dim=-1)
            return row_linear(up * self._act(gate), layer.down_w, None, self.shard)
        assert layer.up_w is not None
        hidden = self._act(F.linear(x, layer.up_w, layer.up_b))
        return row_linear(hidden, layer.down_w, layer.down_b, self.shard)

    def _moe(self, x: torch.Tensor, experts: _Experts) -> torch.Tensor:
        """Top-k routing as the remote code computes it (softmax over the router's logits in
        float32, the top k probabilities cast back and not renormalized), each expert run
        once over all the tokens routed to it: the (token, choice) pairs are sorted by
        expert, so every expert gets one contiguous group and two matmuls."""
        probs = torch.softmax(F.linear(x, experts.router_w), dim=-1, dtype=torch.float32)
        top_w, top_e = torch.topk(probs, self.top_k, dim=-1)
        chosen = top_e.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        tokens = torch.div(order, self.top_k, rounding_mode="floor")
        weights = top_w.to(x.dtype).reshape(-1).index_select(0, order).unsqueeze(1)
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                group = tokens[start : start + count]
                hidden = self._act(F.linear(x.index_select(0, group), experts.w1[expert]))
                part = torch.matmul(hidden, experts.w2[expert]) * weights[start : start + count]
                out.index_add_(0, group, part)
                start += count
        if self.shard.parallel:
            out = self.shard.all_reduce(out)
        return out + experts.bias

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
            q, k, v = F.linear(x, layer.qkv_w, layer.qkv_b).view(t, 3, heads, d).unbind(1)
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            attn = batch.attention(q, k, v, causal=False, scale=self.scale)
            x = self._norm(
                x + row_linear(attn.reshape(t, heads * d), layer.out_w, layer.out_b, shard),
                layer.norm1_w,
                layer.norm1_b,
            )
            x = self._norm(x + self._mlp(x, layer), layer.norm2_w, layer.norm2_b)
        return x

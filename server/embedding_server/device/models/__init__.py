"""Model registry: ``config.json``'s ``model_type`` -> our packed implementation.

Capabilities are declared here, not guessed at run time: each entry says which family module
builds it, how the family's checkpoints name their task heads (a classification head, a
masked-LM head for SPLADE; none: the family serves embeddings only), and what pooling the
architecture implies when the checkpoint has no
sentence-transformers config (CLS for encoders, last token for decoders; Gemma 3 too, since
only its last token has seen the whole input when it runs causally: EmbeddingGemma declares
mean pooling in its sentence-transformers config, which wins). Model types we recognise but
refuse say why and what to serve instead (``REFUSED``). The Llama-family decoders differ only
in data (:class:`~.llama.DecoderVariant`: biases, q/k norm, which layers slide), declared
here per ``model_type``; shared building blocks live in ``layers.py`` and ``base.py``, so a
new architecture is a registry line plus, at most, one family module of its own math.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from embedding_server.device.distributed import SINGLE, Shard
from embedding_server.device.heads import ClassifierReader, MaskedLmReader, RewardReader, score_head
from embedding_server.device.instructions import GRITLM as GRITLM_INSTRUCTION
from embedding_server.device.instructions import InstructionFormat
from embedding_server.device.models import (
    bert,
    clip,
    deberta_v2,
    distilbert,
    electra,
    ernie,
    gemma,
    gemma2,
    gte,
    internlm2,
    jina_bert,
    jina_v3,
    jina_v5,
    llama_bidirec,
    modernbert,
    mpnet,
    nomic_bert,
    reward,
    siglip,
)
from embedding_server.device.models.base import Checkpoint, EmbeddingModel, Ignored, PackedBatch
from embedding_server.device.models.bert import BertModel, BertVariant
from embedding_server.device.models.deberta_v2 import DebertaV2Model
from embedding_server.device.models.gemma import GemmaModel
from embedding_server.device.models.gemma2 import Gemma2Model
from embedding_server.device.models.gemma3 import MULTIMODAL_REFUSAL, Gemma3TextModel
from embedding_server.device.models.gte import GteModel
from embedding_server.device.models.jina_v3 import JinaV3Model
from embedding_server.device.models.llama import DECODER_IGNORED, DecoderVariant, LlamaModel
from embedding_server.device.models.modernbert import ModernBertModel
from embedding_server.device.models.mpnet import MPNetModel
from embedding_server.device.models.names import KNOWN_NAMES, check_names
from embedding_server.device.models.nomic_bert import NomicBertModel
from embedding_server.device.models.vision import VisionModel, flatten_text
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.heads import (
    BGE_RERANKER_GEMMA,
    MXBAI_RERANK_V2,
    NEMOTRON_RERANK,
    QWEN3_RERANKER,
    PairPrompt,
    PairTemplate,
    SegmentedPairTemplate,
)
from embedding_server.request.pooling import PoolingMethod

ModelBuilder = Callable[[Checkpoint], EmbeddingModel]


@dataclass(frozen=True)
class Architecture:
    """How to build one ``model_type``."""

    model_type: str
    builder: ModelBuilder
    default_pooling: PoolingMethod
    classifier: ClassifierReader | None = None
    """How the family's ``*ForSequenceClassification`` / ``*ForTokenClassification``
    checkpoints name their head (tasks score, classify, token_classify, reward)."""
    masked_lm: MaskedLmReader | None = None
    """How its ``*ForMaskedLM`` checkpoints name the LM head (task sparse, SPLADE)."""
    reward: RewardReader | None = None
    """How its dedicated reward models (``*ForRewardModel``, ``*ForProcessRewardModel``)
    name their head (task reward); None: refused."""
    pair_prompt: PairPrompt | None = None
    """The one text its cross-encoders' authors make of a (query, document) pair
    (nemotron-rerank's); None: a pair is tokenized as a sentence pair."""
    ignored: tuple[Ignored, ...] = ()
    """Tensors its checkpoints may hold that it does not read, each with the reason."""
    float16_overflows: bool = False
    """Activations exceed float16's range (inf/NaN vectors): refuse float16."""
    config_keys: tuple[tuple[str, str], ...] = ()
    """``(common key, the family's own name for it)`` pairs, for families whose configs name
    ``hidden_size`` ... differently (DistilBERT's ``dim``, ``n_layers`` ...)."""
    check_config: Callable[[Mapping[str, Any]], None] | None = None
    """Refuses config values the family cannot serve exactly (UnsupportedModelError), run on
    config.json alone so that such a model is refused before its weights are fetched."""
    yes_no: PairTemplate | SegmentedPairTemplate | None = None
    """The prompt its generative (``*ForCausalLM``) rerankers are trained with: with task
    score, such a checkpoint is served as a yes/no reranker (``device.heads.read_yes_no``).
    None: refused with task score."""
    attention_bias: str | None = None
    """What the family adds to its attention logits (a relative-position bias), which
    flash_attn and torch_varlen cannot take: then an SDPA kernel serves it, and the start-up
    log and ``/info`` say why the varlen kernels were passed over. None: plain attention."""
    attention_softcap: Callable[[Mapping[str, Any]], float | None] | None = None
    """The cap ``c`` of the family's attention logit soft-capping (``c * tanh(logits / c)``,
    Gemma 2) a config sets, None where it sets none. torch_varlen cannot cap (and flash-attn
    only from 2.6): a capping model is served by flash_attn or an (eager) SDPA path, and the
    start-up log and ``/info`` say why torch_varlen was passed over."""

    attention_alibi: Callable[[Mapping[str, Any]], bool] | None = None
    """Whether a config's attention adds ALiBi position biases (JinaBERT's
    ``position_embedding_type: alibi``). flash-attn takes them (``alibi_slopes``), the SDPA
    kernels as a float mask, torch_varlen not at all: it is passed over, and the start-up log
    and ``/info`` say why."""
    declared_pooling: Callable[[Mapping[str, Any]], PoolingMethod | None] | None = None
    """The pooling a config itself declares (JinaBERT's ``emb_pooler: mean``), which its
    authors' own ``encode`` applies; it replaces :attr:`default_pooling` for such a config
    (a sentence-transformers pooling config still wins over both)."""
    flatten: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    """Lifts a nested config's text-body keys to top level (CLIP's and SigLIP's
    ``text_config``), where the loader and the tokenizer stage read a body's shape."""
    check_tokenizer: Callable[[Mapping[str, Any], Tokenizer], None] | None = None
    """Refuses a tokenizer whose texts would not be pooled where the model pools them
    (CLIP: pooling ``last`` must be the end-of-text token transformers pools at)."""
    companion: (
        Callable[
            [Path, Mapping[str, Any], Mapping[str, torch.Tensor]],
            tuple[dict[str, Any], Mapping[str, torch.Tensor]],
        ]
        | None
    ) = None
    """Reads what the family keeps beside its checkpoint (jina-embeddings-v5's task adapters
    under ``adapters/<task>/``) into its config and tensors, once the weights are fetched,
    so that the builder reads them and the tensor audit covers them; None: nothing."""
    images: bool = False
    """The family has a vision tower (:class:`~.vision.VisionModel`): it embeds images, on
    the native backend only, on one device, with task embed."""
    instruction: InstructionFormat | None = None
    """The instruction its texts carry in front, which pooling leaves out (GritLM's
    ``<|user|>\\n...\\n<|embed|>\\n``, found in each sequence's ids:
    ``device.instructions``); None: every token is pooled."""

    def alibi(self, config: Mapping[str, Any]) -> bool:
        """Whether a model of this config adds ALiBi biases to its attention logits."""
        return self.attention_alibi is not None and self.attention_alibi(config)

    def pooling_of(self, config: Mapping[str, Any]) -> PoolingMethod:
        """The pooling a model of this config gets without a sentence-transformers config."""
        declared = None if self.declared_pooling is None else self.declared_pooling(config)
        return declared or self.default_pooling

    def softcaps(self, config: Mapping[str, Any]) -> bool:
        """Whether a model of this config soft-caps its attention logits."""
        return self.attention_softcap is not None and self.attention_softcap(config) is not None

    def read_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with the common keys set from :attr:`config_keys`, as every reader of the
        config (models, heads, the loader) expects them. The family's own key wins over a
        common one beside it: it is the one transformers reads."""
        out = self.flatten(config) if self.flatten is not None else dict(config)
        for common, own in self.config_keys:
            if own in config:
                out[common] = config[own]
        return out


def decoder(variant: DecoderVariant) -> ModelBuilder:
    """The builder of one Llama-family ``model_type``."""
    return partial(LlamaModel, variant=variant)


def encoder(variant: BertVariant) -> ModelBuilder:
    """The builder of one BERT-family ``model_type`` whose math is BERT's as it is."""
    return partial(BertModel, variant=variant)


# As transformers builds each model type: Llama and Qwen3 read attention_bias (q/k/v/o), Llama
# also mlp_bias; Qwen2 always has q/k/v biases; Mistral has none and ignores both flags.
LLAMA = DecoderVariant(attention_bias=True, mlp_bias=True)
MISTRAL = DecoderVariant(window="every_layer")
QWEN2 = DecoderVariant(qkv_bias=True, window="opt_in")
QWEN3 = DecoderVariant(attention_bias=True, qk_norm=True, window="opt_in")
# NVIDIA's LlamaBidirectionalModel (custom code, not run): a LlamaModel whose layers attend
# both ways, whatever config.json's flags say.
LLAMA_BIDIREC = llama_bidirec.LLAMA_BIDIREC
# GritLM in embedding mode (as its authors' GritLM.encode and vLLM's gritlm.py run it): the
# Mistral body attending both ways, with no sliding window, whatever config.json says.
GRITLM = DecoderVariant(bidirectional=True)

# CamemBERT is RoBERTa's math, names and heads (prefix ``roberta.``, positions after
# padding_idx) under its own model_type.

ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        # ``bert`` also names JinaBERT (jina-embeddings-v2): ALiBi positions and a gated MLP,
        # routed by its config's position_embedding_type (jina_bert.py), mean-pooled as its
        # config's emb_pooler says.
        Architecture(
            "bert",
            jina_bert.build,
            "cls",
            bert.classification_head,
            bert.masked_lm_head,
            ignored=bert.IGNORED,
            check_config=jina_bert.check_config,
            attention_alibi=jina_bert.uses_alibi,
            declared_pooling=jina_bert.declared_pooling,
        ),
        *(
            Architecture(
                name,
                encoder(variant),
                "cls",
                bert.classification_head,
                bert.masked_lm_head,
                ignored=bert.IGNORED,
            )
            for name, variant in (
                ("roberta", bert.ROBERTA),
                ("xlm-roberta", bert.XLM_ROBERTA),
                ("camembert", bert.ROBERTA),
            )
        ),
        Architecture(
            "distilbert",
            distilbert.build,
            "cls",
            distilbert.CLASSIFIER,
            distilbert.MASKED_LM,
            ignored=distilbert.IGNORED,
            config_keys=distilbert.CONFIG_KEYS,
        ),
        Architecture(
            "ernie", ernie.build, "cls", ernie.CLASSIFIER, ernie.MASKED_LM, ignored=ernie.IGNORED
        ),
        Architecture(
            "electra",
            electra.build,
            "cls",
            electra.CLASSIFIER,
            electra.MASKED_LM,
            ignored=electra.IGNORED,
        ),
        Architecture(
            "modernbert",
            ModernBertModel,
            "cls",
            modernbert.classification_head,
            ignored=modernbert.IGNORED,
        ),
        # Alibaba GTE: ``new`` on the Hub (new-impl code), ``gte`` in transformers >= 5 and in
        # Snowflake's arctic-embed-m-v2.0 config; one implementation reads both.
        *(
            Architecture(name, GteModel, "cls", gte.classification_head, ignored=gte.IGNORED)
            for name in ("new", "gte")
        ),
        Architecture("llama", decoder(LLAMA), "last", score_head, ignored=DECODER_IGNORED),
        # llama-nemotron-embed-1b-v2 averages its token states ("pooling": "avg" in its
        # config); its reranker sibling (llama-nemotron-rerank-1b-v2, a
        # LlamaBidirectionalForSequenceClassification) scores that average, each pair one
        # text of its prompt.
        Architecture(
            "llama_bidirec",
            decoder(LLAMA_BIDIREC),
            "mean",
            llama_bidirec.classification_head,
            ignored=DECODER_IGNORED,
            check_config=llama_bidirec.check_config,
            declared_pooling=llama_bidirec.declared_pooling,
            pair_prompt=NEMOTRON_RERANK,
        ),
        Architecture("mistral", decoder(MISTRAL), "last", score_head, ignored=DECODER_IGNORED),
        # InternLM2: Llama's math under its own names, q/k/v interleaved in one wqkv; served
        # for its reward models (internlm2-*-reward), whose v_head is read, and its body.
        Architecture(
            "internlm2",
            internlm2.build,
            "last",
            ignored=internlm2.IGNORED,
            check_config=internlm2.check_config,
            reward=internlm2.REWARD,
        ),
        Architecture(
            "qwen2",
            decoder(QWEN2),
            "last",
            score_head,
            ignored=DECODER_IGNORED,
            yes_no=MXBAI_RERANK_V2,  # mxbai-rerank-base-v2 / -large-v2
            reward=reward.QWEN2_REWARD,  # Qwen2.5-Math-RM / -PRM
        ),
        Architecture(
            "qwen3",
            decoder(QWEN3),
            "last",
            score_head,
            ignored=DECODER_IGNORED,
            yes_no=QWEN3_RERANKER,  # Qwen3-Reranker-0.6B/4B/8B
        ),
        Architecture(
            "gemma3_text",
            Gemma3TextModel,
            "last",
            score_head,
            ignored=DECODER_IGNORED,
            float16_overflows=True,
        ),
        Architecture(
            "gemma",
            GemmaModel,
            "last",
            score_head,
            ignored=DECODER_IGNORED,
            float16_overflows=True,
            check_config=gemma.check_config,
            yes_no=BGE_RERANKER_GEMMA,  # BAAI/bge-reranker-v2-gemma
        ),
        Architecture(
            "gemma2",
            Gemma2Model,
            "last",  # bge-multilingual-gemma2's sentence-transformers pooling too
            score_head,
            ignored=DECODER_IGNORED,
            float16_overflows=True,
            check_config=gemma2.check_config,
            attention_softcap=gemma2.attention_softcap,
        ),
        Architecture(
            "mpnet",
            MPNetModel,
            "cls",
            bert.classification_head,  # RoBERTa's: classifier.dense + tanh, out_proj
            mpnet.masked_lm_head,
            ignored=mpnet.IGNORED,
            attention_bias="MPNet's relative-position bias",
        ),
        Architecture(
            "nomic_bert",
            NomicBertModel,
            "mean",  # nomic-embed's and arctic-embed-m-long's sentence-transformers pooling
            nomic_bert.CLASSIFIER,
            ignored=nomic_bert.IGNORED,
            config_keys=nomic_bert.CONFIG_KEYS,
            check_config=nomic_bert.check_config,
        ),
        # jina-embeddings-v3: transformers' name for its body; the Hub's config says
        # xlm-roberta with rotary positions, which lookup() routes here too.
        Architecture(
            jina_v3.NATIVE_MODEL_TYPE,
            JinaV3Model,
            "mean",  # jina-embeddings-v3's sentence-transformers pooling
            ignored=jina_v3.IGNORED,
            check_config=jina_v3.check_config,
        ),
        # jina-embeddings-v5-text-small: Qwen3 with a LoRA adapter per task, chosen per
        # request; its EuroBERT sibling (-nano) is refused by check_config.
        Architecture(
            jina_v5.MODEL_TYPE,
            jina_v5.JinaV5Model,
            "last",  # its authors' encode() pools the last token
            ignored=DECODER_IGNORED,
            check_config=jina_v5.check_config,
            declared_pooling=jina_v5.declared_pooling,
            companion=jina_v5.read_adapters,
        ),
        Architecture(
            "deberta-v2",
            DebertaV2Model,
            "cls",
            deberta_v2.classification_head,
            ignored=deberta_v2.IGNORED,
            attention_bias="DeBERTa's disentangled position terms",
        ),
        # Two towers, one vector space: texts through the packed path, images through the
        # model's own encode_images (the runner routes sequences that carry pixels).
        Architecture(
            clip.MODEL_TYPE,
            clip.build,
            "last",  # the end-of-text token, which CLIP's tokenizer puts last
            ignored=clip.IGNORED,
            check_config=clip.check_config,
            flatten=flatten_text,
            check_tokenizer=clip.check_tokenizer,
            images=True,
        ),
        Architecture(
            siglip.MODEL_TYPE,
            siglip.build,
            "last",  # the tower puts its pooled vector on every row; last is what it means
            ignored=siglip.IGNORED,
            check_config=siglip.check_config,
            flatten=flatten_text,
            images=True,
        ),
        # SigLIP 2 NaFlex: variable-resolution images, packed by their patch counts.
        Architecture(
            siglip.NAFLEX_MODEL_TYPE,
            siglip.build_naflex,
            "last",
            ignored=siglip.IGNORED,
            check_config=siglip.check_config,
            flatten=flatten_text,
            images=True,
        ),
    )
}

GRITLM_POOLING: PoolingMethod = "mean"
"""GritLM's pooling, which its architecture declares (not a default that may be wrong)."""

NAMED: dict[tuple[str, str], Architecture] = {
    # parasail-ai/GritLM-7B-vllm (model_type mistral, architectures ["GritLM"]): mean over
    # the tokens after its instruction; no classifier, no yes/no prompt (embed only).
    ("mistral", "GritLM"): Architecture(
        "mistral",
        decoder(GRITLM),
        "mean",
        ignored=DECODER_IGNORED,
        declared_pooling=lambda config: GRITLM_POOLING,
        instruction=GRITLM_INSTRUCTION,
    ),
}
"""Entries chosen by ``(model_type, architectures[0])``: an architecture that runs other math
on a family's weights. Every other name is checked against ``names.KNOWN_NAMES``."""

IMAGE_MODEL_TYPES = frozenset(a.model_type for a in ARCHITECTURES.values() if a.images)
"""The model types that embed images (natively): what ``EngineInfo.modalities`` reports."""

VLM_REFUSAL = (
    "model_type {model_type!r} is a vision-language model (a language model reading images "
    "through its chat template); as an embedder (Qwen3-VL-Embedding, DSE-Qwen2, VLM2Vec, "
    "GME) its image vectors need an image path through the generic transformers backend, "
    "which carries text only: its vision tower would go unused. It is refused rather than "
    "served text-only. For image and text search in one vector space serve CLIP or SigLIP "
    "(model_type clip or siglip), which are native"
)

VISION_LANGUAGE_TYPES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "phi3_v",
    "llava",
    "llava_next",
    "idefics2",
    "idefics3",
    "paligemma",
    "mllama",
    "llama_nemotron_vl",
)
"""Vision-language model types (chat models with a vision tower) whose embedders the
transformers backend cannot feed images. Refused before the backend is chosen, so a
custom-code one (``llama_nemotron_vl``: nemotron-embed-vl) is refused as what it is, not
run text-only through its remote class with --trust-remote-code."""

REFUSED: dict[str, str] = {
    "gemma3": MULTIMODAL_REFUSAL,
    **{name: VLM_REFUSAL.format(model_type=name) for name in VISION_LANGUAGE_TYPES},
}


def lookup(config: Mapping[str, Any]) -> Architecture:
    """The registry entry for a config, or UnsupportedModelError naming what we support.
    Mostly by ``model_type``; jina-embeddings-v3's Hub config says ``xlm-roberta`` and
    selects its rotary body with ``position_embedding_type: rotary``. The config's
    ``architectures`` name picks an entry of :data:`NAMED`, else must be one the
    ``model_type`` declares (``names.KNOWN_NAMES``): an unknown one is refused, naming it."""
    model_type = str(config.get("model_type", ""))
    if jina_v3.is_jina_v3(config):
        return _checked(config, ARCHITECTURES[jina_v3.NATIVE_MODEL_TYPE])
    arch = ARCHITECTURES.get(model_type)
    if arch is None and model_type in REFUSED:
        raise UnsupportedModelError(REFUSED[model_type])
    if arch is None:
        names = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise UnsupportedModelError(
            f"model_type {model_type!r} ({names}) is not supported; supported model types: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return _checked(config, arch)


def known_names(model_type: str) -> tuple[str, ...] | None:
    """The ``architectures`` names the registry serves for ``model_type`` (those of
    :data:`NAMED` included); None where it declares none."""
    known = KNOWN_NAMES.get(model_type)
    if known is None:
        return None
    return (*known, *(name for kind, name in NAMED if kind == model_type))


def _checked(config: Mapping[str, Any], arch: Architecture) -> Architecture:
    """``arch``, or the :data:`NAMED` entry the config's architecture picks; refuses an
    architecture name the model type does not declare, and a :data:`NAMED` one beside
    another (which math the model runs would be a guess)."""
    model_type = arch.model_type
    names = [str(name) for name in config.get("architectures") or []]
    check_names(config, model_type, known_names(model_type))
    special = [name for name in names if (model_type, name) in NAMED]
    if special and len(set(names)) > 1:
        raise UnsupportedModelError(
            f"config.json's architectures name {', '.join(names)}: {special[0]} runs other "
            f"math on {model_type}'s weights than the others, so which one the model runs is "
            "ambiguous; name one"
        )
    return NAMED[(model_type, special[0])] if special else arch


def build_model(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard = SINGLE,
) -> EmbeddingModel:
    """Instantiate the packed implementation for ``config`` from HF-named weights; with a
    ``shard`` of a tensor-parallel group, that rank's share of the weights."""
    arch = lookup(config)
    return arch.builder(Checkpoint(arch.read_config(config), weights, dtype, device, shard))


__all__ = [
    "ARCHITECTURES",
    "IMAGE_MODEL_TYPES",
    "Architecture",
    "EmbeddingModel",
    "Ignored",
    "PackedBatch",
    "VisionModel",
    "build_model",
    "lookup",
]

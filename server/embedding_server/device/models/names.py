"""Which ``architectures`` names (config.json) each registry entry serves.

``model_type`` says which body a checkpoint's weights fit; ``architectures`` names the class
its authors run them with, and that class may do other math on the same weights. GritLM
ships ``model_type: mistral`` with ``architectures: ["GritLM"]``: Mistral's weights, run
bidirectionally with no sliding window and mean-pooled after the instruction. Served as a
plain Mistral its vectors would be another model's, without a word. So every registry entry
declares the names it serves, and a name the entry does not declare is refused, naming it,
before any weight is fetched.

The names are data: transformers' own classes of the family (:func:`transformers_names`),
whose math is the family's as it is, plus the names of Hub checkpoints known to run that math
(custom code the native family reimplements: ``NewModel``, ``JinaBertForMaskedLM`` ...).
An encoder's ``*ForCausalLM`` / ``*LMHeadModel`` is not among them: those run the encoder
causally, as a language model, which the encoder bodies here never do. Task heads a name
implies (``*ForQuestionAnswering``, ``*ForRewardModel`` ...) are declared too: they are
served or refused afterwards by the head checks (``heads.head_kind``, the reward heads),
which say why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from embedding_server.errors import UnsupportedModelError

DECODER_CLASSES = (
    "Model",
    "ForCausalLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForRewardModel",
    "ForProcessRewardModel",
)
"""The classes transformers builds over a decoder family's body, and the reward models
vLLM serves over it (Qwen2.5-Math-RM / -PRM's custom code), which the reward heads serve
or refuse (``device.heads``)."""

ENCODER_CLASSES = (
    "Model",
    "ForMaskedLM",
    "ForPreTraining",
    "ForNextSentencePrediction",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
)
"""The classes transformers builds over an encoder family's body, its causal-LM ones left
out (they attend causally)."""


def transformers_names(prefix: str, classes: Sequence[str], *extra: str) -> tuple[str, ...]:
    """``prefix`` + each of ``classes`` (transformers' naming), then ``extra`` names."""
    return (*(prefix + suffix for suffix in classes), *extra)


def decoder_names(prefix: str, *extra: str) -> tuple[str, ...]:
    """A decoder family's names: transformers' classes of ``prefix``, then ``extra``."""
    return transformers_names(prefix, DECODER_CLASSES, *extra)


def encoder_names(prefix: str, *extra: str) -> tuple[str, ...]:
    """An encoder family's names: transformers' classes of ``prefix``, then ``extra``."""
    return transformers_names(prefix, ENCODER_CLASSES, *extra)


def check_names(config: Mapping[str, Any], model_type: str, known: Sequence[str] | None) -> None:
    """Refuse a config whose ``architectures`` holds a name not in ``known`` (None: the entry
    declares none and any name is served). A config without ``architectures`` is served by
    its ``model_type`` alone."""
    if known is None:
        return
    names = [str(name) for name in config.get("architectures") or []]
    unknown = [name for name in names if name not in known]
    if not unknown:
        return
    raise UnsupportedModelError(
        f"architecture {unknown[0]!r} (config.json's architectures) is not one this server "
        f"knows for model_type {model_type!r}. A checkpoint that names another class may run "
        "other math on the same weights (attention, pooling, heads), so it is refused "
        f"rather than served as a plain {model_type}, whose vectors would not be the model's. "
        f"Known {model_type} architectures: {', '.join(known)}. {_way_out(config, model_type)}"
    )


def _way_out(config: Mapping[str, Any], model_type: str) -> str:
    auto_map = config.get("auto_map")
    if isinstance(auto_map, Mapping) and auto_map:
        return (
            "The checkpoint ships its own code (config.json auto_map), which only the generic "
            "backend runs: serve it with --backend transformers --trust-remote-code if you "
            "trust the repository (that runs its Python code in the server)"
        )
    return (
        "It ships no code of its own, and transformers' backend would run it as a plain "
        f"{model_type} too; it is not supported yet. If it is in fact a plain {model_type} "
        "checkpoint, name one of the known architectures in its config.json"
    )


KNOWN_NAMES: dict[str, tuple[str, ...]] = {
    # Encoders. JinaBERT (jina-embeddings-v2, its rerankers) is a ``bert`` config whose flags
    # route it; ColBERT's HF_ColBERT is a BERT or XLM-R body with its projection.
    "bert": encoder_names(
        "Bert",
        "JinaBertModel",
        "JinaBertForMaskedLM",
        "JinaBertForSequenceClassification",
        "HF_ColBERT",
    ),
    "roberta": encoder_names("Roberta", "HF_ColBERT"),
    "xlm-roberta": encoder_names("XLMRoberta", "HF_ColBERT"),
    "camembert": encoder_names("Camembert"),
    "distilbert": encoder_names("DistilBert"),
    "ernie": encoder_names("Ernie"),
    "electra": encoder_names("Electra"),
    "modernbert": encoder_names("ModernBert", "HF_ColBERT"),
    "new": encoder_names("New"),  # Alibaba's new-impl code (gte-multilingual)
    "gte": encoder_names("Gte"),
    "mpnet": encoder_names("MPNet"),
    "nomic_bert": encoder_names("NomicBert"),
    "deberta-v2": encoder_names("DebertaV2"),
    # jina-embeddings-v3: its Hub config (xlm-roberta, rotary) names XLMRobertaModel, its
    # code's class XLMRobertaLoRA; transformers' own class JinaEmbeddingsV3Model.
    # jina-colbert-v2 is that body as HF_ColBERT.
    "jina_embeddings_v3": encoder_names(
        "JinaEmbeddingsV3", "XLMRobertaModel", "XLMRobertaLoRA", "HF_ColBERT"
    ),
    # jina-embeddings-v5-text: one name for both bodies (is_decoder false: EuroBERT).
    "jina_embeddings_v5": ("JinaEmbeddingsV5Model",),
    # Decoders.
    "llama": decoder_names("Llama"),
    # NVIDIA's bidirectional Llama: the embedder, and its reranker (nemotron-rerank, served
    # by the family's classifier reader: llama_bidirec.py).
    "llama_bidirec": (
        "LlamaBidirectionalModel",
        "LlamaBidirectionalForSequenceClassification",
    ),
    "mistral": decoder_names("Mistral"),
    "internlm2": decoder_names("InternLM2"),
    "qwen2": decoder_names("Qwen2"),
    # voyage-4-nano: a Qwen3 body (bidirectional by its config's flag) and a projection.
    # jina-reranker-v3 (JinaForRanking): the causal body and a projector, served as a
    # listwise reranker (device/listwise.py).
    "qwen3": decoder_names("Qwen3", "VoyageQwen3BidirectionalEmbedModel", "JinaForRanking"),
    "gemma": decoder_names("Gemma"),
    "gemma2": decoder_names("Gemma2"),
    # EmbeddingGemma saves Gemma3TextModel; transformers names the causal LM Gemma3ForCausalLM.
    "gemma3_text": (
        "Gemma3TextModel",
        "Gemma3ForCausalLM",
        "Gemma3TextForSequenceClassification",
    ),
    # Dual encoders: the whole model only (a tower alone or an image classifier is another
    # checkpoint).
    "clip": ("CLIPModel",),
    "siglip": ("SiglipModel",),
    "siglip2": ("Siglip2Model",),
}
"""The ``architectures`` names each ``model_type`` of the registry serves."""

"""Task heads: what turns a body's pooled hidden state into class logits, and which task a
checkpoint serves.

The models stay bodies (final hidden states, see ``models/base.py``) and pooling stays in
``pooling.py``; a sequence-classification checkpoint adds, after pooling, an optional
*pooler* and a *classifier* (vLLM's ``ClassifierPooler``). They are read here by their
Hugging Face names straight from the checkpoint's weights:

==========================  ===========  ====================================================
architecture                pooling      head
==========================  ===========  ====================================================
BERT                        cls          ``bert.pooler.dense`` + tanh, ``classifier``
RoBERTa, XLM-R              cls          ``classifier.dense`` + tanh, ``classifier.out_proj``
ModernBERT                  cls / mean   ``head.dense`` + act + ``head.norm``, ``classifier``
Llama-family, Gemma 3       last         ``score`` (no pooler)
==========================  ===========  ====================================================

ModernBERT pools as its config's ``classifier_pooling`` says. The head runs in float32 like
the embedding head. Activations follow sentence-transformers' ``CrossEncoder``: the one its
config declares (``activation_fn`` in ``config_sentence_transformers.json``, v6; in
``config.json``'s ``sentence_transformers`` block, v4-5; ``sbert_ce_default_activation_function``
before v4), else sigmoid for one label, applies to scores; ``classify`` gives softmax
probabilities over several labels (sigmoid for one), as vLLM does.

A checkpoint whose architecture names a head we do not serve (token classification,
question answering, multiple choice) is refused with the reason, rather than being served
as an embedder by its body.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .errors import UnsupportedModelError
from .pooling import ACTIVATIONS, FloatArray, PoolingMethod, activation

if TYPE_CHECKING:
    import torch

Task = Literal["embed", "score", "classify", "token_classify", "reward", "sparse"]
"""What a served model does: embed (vectors; /score is cosine), score (a one-label
cross-encoder: /score and /rerank; /classify gives its sigmoid probability), classify
(labels with probabilities), token_classify (label probabilities of every token), reward
(a classifier's raw outputs at every token, as vLLM's reward task: no activation; only when
asked for, since a reward model's checkpoint is a plain ``*ForSequenceClassification``),
sparse (SPLADE: a vocabulary-sized sparse vector from the masked-LM head)."""

TASKS: tuple[Task, ...] = ("embed", "score", "classify", "token_classify", "reward", "sparse")

HeadKind = Literal["sequence_classification", "token_classification"]

_REFUSED_HEADS = {
    "ForQuestionAnswering": "extractive question answering (span start/end logits)",
    "ForMultipleChoice": "multiple choice",
}

# sentence-transformers writes activations as import paths of torch modules.
_ST_ACTIVATIONS = {
    "Sigmoid": "sigmoid",
    "Identity": "identity",
    "Tanh": "tanh",
    "ReLU": "relu",
    "GELU": "gelu",
    "SiLU": "silu",
}


@dataclass(frozen=True)
class ClassificationHead:
    """Pooled vector -> optional pooler (dense, activation, optional LayerNorm) -> logits."""

    weight: torch.Tensor  # [num_labels, hidden] float32
    bias: torch.Tensor | None
    pooler_weight: torch.Tensor | None = None
    pooler_bias: torch.Tensor | None = None
    pooler_activation: str = "tanh"
    norm_weight: torch.Tensor | None = None
    norm_bias: torch.Tensor | None = None
    norm_eps: float = 1e-5

    @property
    def num_labels(self) -> int:
        return int(self.weight.shape[0])

    def to(self, device: torch.device) -> ClassificationHead:
        # Imported here, not at the top: front-end processes (``--api-workers``) unpickle this
        # module's types and never load torch.
        import torch

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=torch.float32)

        return ClassificationHead(
            weight=self.weight.to(device=device, dtype=torch.float32),
            bias=move(self.bias),
            pooler_weight=move(self.pooler_weight),
            pooler_bias=move(self.pooler_bias),
            pooler_activation=self.pooler_activation,
            norm_weight=move(self.norm_weight),
            norm_bias=move(self.norm_bias),
            norm_eps=self.norm_eps,
        )

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        """Class logits ``[B, num_labels]`` (float32) of pooled vectors ``[B, hidden]``."""
        import torch.nn.functional as F  # see to()

        x = pooled.float()
        if self.pooler_weight is not None:
            x = activation(self.pooler_activation)(
                F.linear(x, self.pooler_weight, self.pooler_bias)
            )
        if self.norm_weight is not None:
            x = F.layer_norm(x, (x.shape[-1],), self.norm_weight, self.norm_bias, self.norm_eps)
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class Classifier:
    """A checkpoint's classification head and how to read its logits."""

    head: ClassificationHead | None
    """The weights, on the engine's device; None in a front-end process's copy
    (``--api-workers``): heads run in the engine, only activations run per request."""
    pooling: PoolingMethod
    labels: tuple[str, ...]
    """``id2label`` in label order."""
    activation: str | None
    """The activation the checkpoint declares (sentence-transformers), else None."""
    per_token: bool = False
    """A token classifier: the head runs on every token's hidden state, not a pooled one."""

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def score_activation(self) -> str:
        """Applied to the one logit of a cross-encoder score (CrossEncoder.predict's)."""
        return self.activation or ("sigmoid" if self.num_labels == 1 else "identity")

    def weights(self) -> ClassificationHead:
        if self.head is None:
            raise RuntimeError("this copy of the classifier has no weights (a front-end's)")
        return self.head

    def to(self, device: torch.device) -> Classifier:
        return replace(self, head=self.weights().to(device))

    def probabilities(self, logits: FloatArray) -> FloatArray:
        """``/classify``'s probs, as vLLM's classify task computes them whatever activation a
        CrossEncoder config declares (that one is for scores): softmax over the labels,
        sigmoid for a single label. Per request, in numpy (front-ends have no torch)."""
        if self.num_labels == 1:
            return apply_activation("sigmoid", logits)
        return softmax(logits)

    def scores(self, logits: FloatArray) -> FloatArray:
        """One relevance score per pair (``[B]``) from one-label logits."""
        return apply_activation(self.score_activation, logits[:, 0])

    def token_head(self, *, raw: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        """The head over token states ``[tokens, hidden]``, which the runner applies on the
        device before copying them back: label probabilities (softmax, sigmoid for one
        label), or the raw outputs (``raw``: the reward task)."""
        head = self.weights()
        single = self.num_labels == 1

        def outputs(states: torch.Tensor) -> torch.Tensor:
            import torch  # see ClassificationHead.to()

            logits = head.project(states)
            if raw:
                return logits
            return torch.sigmoid(logits) if single else torch.softmax(logits, dim=-1)

        return outputs


def apply_activation(name: str, x: FloatArray) -> FloatArray:
    """The activation :func:`~.pooling.activation` names, in numpy (float64 inside): for the
    per-request part of a classifier, which front-end processes run without torch."""
    v = np.asarray(x, dtype=np.float64)
    if name == "identity":
        out = v
    elif name == "tanh":
        out = np.tanh(v)
    elif name == "relu":
        out = np.maximum(v, 0.0)
    elif name in ("sigmoid", "silu"):
        sigmoid = np.exp(-np.logaddexp(0.0, -v))
        out = sigmoid if name == "sigmoid" else v * sigmoid
    elif name == "gelu":
        out = 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)))
    else:
        raise ValueError(f"unknown activation {name!r}")
    return out.astype(np.float32)


def softmax(logits: FloatArray) -> FloatArray:
    """Softmax over the last axis (float64 inside, float32 out)."""
    v = np.asarray(logits, dtype=np.float64)
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    out: FloatArray = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    return out


_erf = np.vectorize(math.erf, otypes=[np.float64])


def head_kind(config: Mapping[str, Any]) -> HeadKind | None:
    """The classification head a ``*ForSequenceClassification`` or ``*ForTokenClassification``
    checkpoint has, None for a body (embedders, masked/causal LMs served by their body);
    refuses task heads we do not serve."""
    for name in config.get("architectures") or []:
        name = str(name)
        if name.endswith("ForSequenceClassification"):
            return "sequence_classification"
        if name.endswith("ForTokenClassification"):
            return "token_classification"
        for suffix, what in _REFUSED_HEADS.items():
            if name.endswith(suffix):
                raise UnsupportedModelError(
                    f"{name} is a {what} head, which is not served (supported heads: "
                    "*ForSequenceClassification for score/classify, *ForTokenClassification "
                    "for token_classify; bodies for embed)"
                )
    return None


def declared_activation(config: Mapping[str, Any], st_activation: str | None) -> str | None:
    """The CrossEncoder activation a checkpoint declares, as an ``ACTIVATIONS`` name."""
    block = config.get("sentence_transformers")
    path = (
        st_activation
        or (block.get("activation_fn") if isinstance(block, Mapping) else None)
        or config.get("sbert_ce_default_activation_function")
    )
    if not path:
        return None
    name = _ST_ACTIVATIONS.get(str(path).rsplit(".", 1)[-1])
    if name is None:
        raise UnsupportedModelError(
            f"cross-encoder activation {path!r} is not supported "
            f"(supported: {', '.join(f'torch.nn.{n}' for n in _ST_ACTIVATIONS)})"
        )
    return name


def read_classifier(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    family: str,
    st_activation: str | None = None,
) -> Classifier | None:
    """The classification head of a ``*ForSequenceClassification`` or
    ``*ForTokenClassification`` checkpoint (None for a body), from its Hugging Face weight
    names; ``family`` is the registry's family. Token classifiers have no pooler (BERT,
    RoBERTa: a plain ``classifier``; ModernBERT keeps its ``head``)."""
    kind = head_kind(config)
    if kind is None:
        return None
    per_token = kind == "token_classification"
    arch = str((config.get("architectures") or ["?"])[0])

    def get(name: str) -> torch.Tensor:
        if name not in weights:
            raise UnsupportedModelError(
                f"{arch} checkpoint lacks the classifier weight {name!r}; is it complete?"
            )
        return weights[name].float()

    def maybe(name: str) -> torch.Tensor | None:
        return weights[name].float() if name in weights else None

    pooling: PoolingMethod
    if family == "bert" and per_token:
        head = ClassificationHead(weight=get("classifier.weight"), bias=maybe("classifier.bias"))
        pooling = "cls"
    elif family == "bert" and "classifier.out_proj.weight" in weights:  # RoBERTa, XLM-R
        head = ClassificationHead(
            weight=get("classifier.out_proj.weight"),
            bias=maybe("classifier.out_proj.bias"),
            pooler_weight=get("classifier.dense.weight"),
            pooler_bias=maybe("classifier.dense.bias"),
        )
        pooling = "cls"
    elif family == "bert":
        pooler = next(
            (p for p in ("bert.pooler.", "pooler.") if p + "dense.weight" in weights), None
        )
        head = ClassificationHead(
            weight=get("classifier.weight"),
            bias=maybe("classifier.bias"),
            pooler_weight=get(pooler + "dense.weight") if pooler else None,
            pooler_bias=maybe(pooler + "dense.bias") if pooler else None,
        )
        pooling = "cls"
    elif family == "modernbert":
        act = str(config.get("classifier_activation") or config.get("hidden_activation") or "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"ModernBERT classifier_activation {act!r} is not supported"
            )
        head = ClassificationHead(
            weight=get("classifier.weight"),
            bias=maybe("classifier.bias"),
            pooler_weight=get("head.dense.weight"),
            pooler_bias=maybe("head.dense.bias"),
            pooler_activation=act,
            norm_weight=get("head.norm.weight"),
            norm_bias=maybe("head.norm.bias"),
            norm_eps=float(config.get("norm_eps", 1e-5)),
        )
        pooled = str(config.get("classifier_pooling", "cls"))
        if pooled not in ("cls", "mean"):
            raise UnsupportedModelError(
                f"ModernBERT classifier_pooling {pooled!r} is not supported (cls or mean)"
            )
        pooling = "cls" if pooled == "cls" else "mean"
    elif family in ("llama", "gemma3"):
        head = ClassificationHead(weight=get("score.weight"), bias=maybe("score.bias"))
        pooling = "last"
    else:
        raise UnsupportedModelError(f"{arch}: sequence classification is not supported")
    id2label = config.get("id2label") or {}
    labels = tuple(
        str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(head.num_labels)
    )
    activation = declared_activation(config, st_activation)
    return Classifier(head, pooling, labels, activation, per_token=per_token)


def resolve_task(
    requested: str, classifier: Classifier | None, architecture: str, *, splade: bool = False
) -> Task:
    """The task to serve: ``requested`` (``auto`` decides from the checkpoint; ``splade``: its
    sentence-transformers config is a SPLADE SparseEncoder), or an error saying why the
    checkpoint cannot serve it."""
    natural: Task = "embed"
    if splade and classifier is None:
        natural = "sparse"
    elif classifier is not None and classifier.per_token:
        natural = "token_classify"
    elif classifier is not None:
        natural = "score" if classifier.num_labels == 1 else "classify"
    if requested == "auto" or requested == natural:
        return natural
    if requested not in TASKS:
        raise UnsupportedModelError(f"task {requested!r} is not one of auto, {', '.join(TASKS)}")
    if requested == "sparse" and classifier is None:
        return "sparse"  # a masked-LM checkpoint's head, read (or refused) by read_sparse_head
    if classifier is None and natural == "sparse":
        raise UnsupportedModelError(
            f"{architecture} is a SPLADE sparse encoder; serve it with task sparse (or auto)"
        )
    if classifier is None:
        head = "Token" if requested == "token_classify" else "Sequence"
        raise UnsupportedModelError(
            f"task {requested} needs a *For{head}Classification checkpoint and {architecture} "
            "has no classification head; serve it with task embed (its /score is then the "
            "cosine similarity of embeddings)"
        )
    what = (
        f"a token classifier with {classifier.num_labels} label(s)"
        if classifier.per_token
        else f"a sequence classifier with {classifier.num_labels} label(s)"
    )
    if requested == "classify" and natural == "score":
        return "classify"  # a cross-encoder's one probability
    if requested == "reward":
        return "reward"  # any classifier's raw head outputs, token by token
    if requested == "score" and natural == "classify":
        raise UnsupportedModelError(
            f"task score needs a cross-encoder with one label; {architecture} has "
            f"{classifier.num_labels} labels: serve it with task classify"
        )
    raise UnsupportedModelError(
        f"{architecture} is {what}, not served by task {requested}; serve it with task "
        f"{natural} (or auto)"
    )


SparseStrategy = Literal["max", "sum"]


@dataclass(frozen=True)
class SparseHead:
    """SPLADE over a masked-LM head: per token, logits over the vocabulary (dense ->
    activation -> LayerNorm -> decoder tied to the word embeddings, + bias); then
    ``log(1 + relu(logits))`` reduced over each sequence's tokens by max (SPLADE v2/v3) or
    sum, as sentence-transformers' ``SpladePooling`` computes it. Runs in the forward worker
    on the packed states, a few hundred tokens at a time so the ``[tokens, vocab]`` logits
    stay small."""

    dense_weight: torch.Tensor
    dense_bias: torch.Tensor | None
    activation: str
    norm_weight: torch.Tensor
    norm_bias: torch.Tensor | None
    norm_eps: float
    decoder_weight: torch.Tensor  # [vocab, hidden]
    decoder_bias: torch.Tensor | None
    strategy: SparseStrategy = "max"
    chunk_tokens: int = 512

    @property
    def vocab_size(self) -> int:
        return int(self.decoder_weight.shape[0])

    def to(self, device: torch.device) -> SparseHead:
        import torch  # see ClassificationHead.to()

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=torch.float32)

        return SparseHead(
            dense_weight=self.dense_weight.to(device=device, dtype=torch.float32),
            dense_bias=move(self.dense_bias),
            activation=self.activation,
            norm_weight=self.norm_weight.to(device=device, dtype=torch.float32),
            norm_bias=move(self.norm_bias),
            norm_eps=self.norm_eps,
            decoder_weight=self.decoder_weight.to(device=device, dtype=torch.float32),
            decoder_bias=move(self.decoder_bias),
            strategy=self.strategy,
            chunk_tokens=self.chunk_tokens,
        )

    def __call__(self, hidden: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
        """One ``[vocab]`` float32 weight vector per packed sequence of ``hidden``."""
        import torch  # see ClassificationHead.to()
        import torch.nn.functional as F

        device = hidden.device
        lens = torch.tensor(seqlens, dtype=torch.int64)
        segments = torch.repeat_interleave(torch.arange(len(seqlens)), lens).to(device)
        out = torch.zeros(len(seqlens), self.vocab_size, dtype=torch.float32, device=device)
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            x = hidden[start : start + self.chunk_tokens].float()
            x = activation(self.activation)(F.linear(x, self.dense_weight, self.dense_bias))
            x = F.layer_norm(x, (x.shape[-1],), self.norm_weight, self.norm_bias, self.norm_eps)
            weights = torch.log1p(torch.relu(F.linear(x, self.decoder_weight, self.decoder_bias)))
            index = segments[start : start + x.shape[0]].unsqueeze(1).expand_as(weights)
            # log1p(relu(.)) >= 0, so a zero start is the identity of both reductions.
            out.scatter_reduce_(
                0, index, weights, reduce="amax" if self.strategy == "max" else "sum"
            )
        return out


def read_sparse_head(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    family: str,
    strategy: SparseStrategy,
) -> SparseHead:
    """The masked-LM head of a BERT or RoBERTa/XLM-R ``*ForMaskedLM`` checkpoint, by Hugging
    Face names (the decoder is usually tied to the word embeddings and not saved)."""
    arch = str((config.get("architectures") or ["?"])[0])
    names = {
        "bert": (
            "cls.predictions.transform.dense.",
            "cls.predictions.transform.LayerNorm.",
            "cls.predictions.decoder.",
            "cls.predictions.bias",
        ),
        "roberta": ("lm_head.dense.", "lm_head.layer_norm.", "lm_head.decoder.", "lm_head.bias"),
    }
    key = "roberta" if "lm_head.dense.weight" in weights else "bert"
    if family != "bert" or names[key][0] + "weight" not in weights:
        raise UnsupportedModelError(
            f"task sparse (SPLADE) needs a BERT, RoBERTa or XLM-R masked-LM checkpoint with its "
            f"head (cls.predictions.* or lm_head.*); {arch} has none"
        )
    dense, norm, decoder, bias = names[key]
    act = str(config.get("hidden_act", "gelu"))
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{arch}: masked-LM head activation {act!r} is not supported")
    tied = next(
        (
            weights[n]
            for n in (
                decoder + "weight",
                "bert.embeddings.word_embeddings.weight",
                "roberta.embeddings.word_embeddings.weight",
            )
            if n in weights
        ),
        None,
    )
    if tied is None:
        raise UnsupportedModelError(f"{arch} checkpoint has neither a decoder nor word embeddings")
    decoder_bias = weights.get(bias, weights.get(decoder + "bias"))
    return SparseHead(
        dense_weight=weights[dense + "weight"].float(),
        dense_bias=weights[dense + "bias"].float() if dense + "bias" in weights else None,
        activation=act,
        norm_weight=weights[norm + "weight"].float(),
        norm_bias=weights[norm + "bias"].float() if norm + "bias" in weights else None,
        norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        decoder_weight=tied.float(),
        decoder_bias=None if decoder_bias is None else decoder_bias.float(),
        strategy=strategy,
    )

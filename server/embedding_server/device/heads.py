"""Task heads on the device: the weights that turn pooled (or per-token) hidden states into
class logits, and SPLADE's masked-LM head.

Each model family declares how its checkpoints name these weights (a
:data:`ClassifierReader` and a :data:`MaskedLmReader` in its registry entry,
``device/models/__init__.py``), as vLLM's model classes declare their pooling heads; this
module reads the parts every family shares (labels, activations, which task the
architecture names) and runs the heads. What is done per request (activations over the
logits, label names) is the request plane's ``embedding_server/request/heads.py``. The head runs in
float32 like the embedding head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedding_server.device.pooling import activation
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.heads import (
    Classifier,
    PairPrompt,
    PairTemplate,
    RewardKind,
    SegmentedPairTemplate,
    SparseStrategy,
    declared_activation,
    head_kind,
    reward_kind,
)
from embedding_server.request.pooling import ACTIVATIONS, PoolingMethod


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

    @classmethod
    def read(
        cls,
        w: HeadWeights,
        out: str,
        dense: str | None = None,
        norm: str | None = None,
        *,
        pooler_activation: str = "tanh",
        norm_eps: float = 1e-5,
    ) -> ClassificationHead:
        """The head whose projection to the labels is ``out`` (a prefix of ``weight`` and an
        optional ``bias``), after the pooler ``dense`` and its LayerNorm ``norm`` where the
        family has them, read in that order."""
        return cls(
            weight=w.get(out + "weight"),
            bias=w.maybe(out + "bias"),
            pooler_weight=None if dense is None else w.get(dense + "weight"),
            pooler_bias=None if dense is None else w.maybe(dense + "bias"),
            pooler_activation=pooler_activation,
            norm_weight=None if norm is None else w.get(norm + "weight"),
            norm_bias=None if norm is None else w.maybe(norm + "bias"),
            norm_eps=norm_eps,
        )

    @property
    def num_labels(self) -> int:
        return int(self.weight.shape[0])

    def to(self, device: torch.device) -> ClassificationHead:
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
        x = pooled.float()
        if self.pooler_weight is not None:
            x = activation(self.pooler_activation)(
                F.linear(x, self.pooler_weight, self.pooler_bias)
            )
        if self.norm_weight is not None:
            x = F.layer_norm(x, (x.shape[-1],), self.norm_weight, self.norm_bias, self.norm_eps)
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class HeadWeights:
    """A checkpoint's tensors as a head reader sees them: float32, and a missing one named."""

    config: Mapping[str, Any]
    weights: Mapping[str, torch.Tensor]
    architecture: str

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in float32; refuses the checkpoint when it lacks it."""
        if name not in self.weights:
            raise UnsupportedModelError(
                f"{self.architecture} checkpoint lacks the classifier weight {name!r}; "
                "is it complete?"
            )
        return self.weights[name].float()

    def maybe(self, name: str) -> torch.Tensor | None:
        """The tensor ``name`` in float32, or None when the checkpoint has none (a bias)."""
        return self.weights[name].float() if name in self.weights else None


ClassifierReader = Callable[[HeadWeights, bool], tuple[ClassificationHead, PoolingMethod]]
"""A family's classification head, read from its checkpoint's names: the head and the pooling
it reads (``per_token``: a token classifier, whose head runs on every token's state)."""


def score_head(w: HeadWeights, per_token: bool) -> tuple[ClassificationHead, PoolingMethod]:
    """A decoder's ``score`` projection (no pooler), over the last token, as transformers'
    ``*ForSequenceClassification`` decoders read it; token classifiers apply it to every
    token."""
    return ClassificationHead.read(w, "score."), "last"


@dataclass(frozen=True)
class ClassifierNames:
    """A :data:`ClassifierReader` declared by the names of a family's classification heads,
    for the encoders whose heads read the first token: a sequence classifier's ``dense``
    layer (its pooler, None where it has none) with ``activation``, then ``out``, the
    projection to the labels; a token classifier's ``token_out`` alone."""

    out: str
    """The prefix of the projection to the labels (``classifier.``, ``classifier.out_proj.``)."""
    dense: str | None = None
    """The prefix of the dense layer before it (``classifier.dense.``, ``bert.pooler.dense.``)."""
    activation: str = "tanh"
    """Applied after ``dense``, a name in ``embedding_server.request.pooling.ACTIVATIONS``."""
    token_out: str = "classifier."

    def __call__(self, w: HeadWeights, per_token: bool) -> tuple[ClassificationHead, PoolingMethod]:
        if per_token:
            return ClassificationHead.read(w, self.token_out), "cls"
        return ClassificationHead.read(
            w, self.out, self.dense, pooler_activation=self.activation
        ), "cls"


def read_classifier(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    reader: ClassifierReader | None,
    st_activation: str | None = None,
    pair_prompt: PairPrompt | None = None,
) -> tuple[Classifier, ClassificationHead] | None:
    """The classification head of a ``*ForSequenceClassification`` or
    ``*ForTokenClassification`` checkpoint (None for a body), read by its family's
    ``reader`` (None: the family has no classification head we serve); ``pair_prompt``:
    the one text the family's cross-encoders make of a pair."""
    kind = head_kind(config)
    if kind is None:
        return None
    per_token = kind == "token_classification"
    arch = str((config.get("architectures") or ["?"])[0])
    if reader is None:
        what = "token" if per_token else "sequence"
        raise UnsupportedModelError(f"{arch}: {what} classification is not supported")
    head, pooling = reader(HeadWeights(config, weights, arch), per_token)
    id2label = config.get("id2label") or {}
    labels = tuple(
        str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(head.num_labels)
    )
    activation_name = declared_activation(config, st_activation)
    template = None if per_token else pair_prompt
    return Classifier(
        pooling, labels, activation_name, per_token=per_token, template=template
    ), head


@dataclass(frozen=True)
class RewardReader:
    """How a family's dedicated reward models (``*ForRewardModel``,
    ``*ForProcessRewardModel``) name their head, how many outputs each kind's head has (its
    authors' code and vLLM fix them, whatever ``num_labels`` says), and the step separator a
    process reward model is read at (a vocabulary entry of its tokenizer)."""

    head: ClassifierReader
    outputs: Mapping[RewardKind, int]
    step_token: str | None = None


def check_reward(config: Mapping[str, Any], reader: RewardReader | None) -> RewardKind | None:
    """The reward kind ``config``'s architecture names (None: not a reward model), or its
    refusal when the family has no reward head we implement (from config.json alone)."""
    kind = reward_kind(config)
    if kind is None:
        return None
    if reader is None or kind not in reader.outputs:
        arch = next(iter(config.get("architectures") or []), "?")
        raise UnsupportedModelError(
            f"{arch}: {kind} reward models of model_type {config.get('model_type')!r} are not "
            "supported (implemented: Qwen2ForRewardModel, Qwen2ForProcessRewardModel, "
            "InternLM2ForRewardModel)"
        )
    return kind


def read_reward(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    reader: RewardReader | None,
    token_id: Callable[[str], int | None],
) -> tuple[Classifier, ClassificationHead] | None:
    """The head of a dedicated reward model (None for any other checkpoint), read by its
    family's ``reader``; a process reward model's step separator is looked up with
    ``token_id`` (its tokenizer's)."""
    kind = check_reward(config, reader)
    if kind is None or reader is None:
        return None
    arch = str((config.get("architectures") or ["?"])[0])
    head, pooling = reader.head(HeadWeights(config, weights, arch), True)
    want = reader.outputs[kind]
    if head.num_labels != want:
        raise UnsupportedModelError(
            f"{arch} checkpoint's reward head has {head.num_labels} output(s); its authors' "
            f"code (and vLLM) define {want}: is it a {arch} checkpoint?"
        )
    step = None
    if kind == "process":
        marker = reader.step_token
        step = None if marker is None else token_id(marker)
        if step is None:
            raise UnsupportedModelError(
                f"{arch}: its tokenizer has no token {marker!r}, the step separator a process "
                "reward model is read at; is it the model's tokenizer?"
            )
    labels = tuple(f"LABEL_{i}" for i in range(want))
    id2label = config.get("id2label") or {}
    if len(id2label) == want:
        labels = tuple(str(id2label.get(str(i), id2label.get(i, labels[i]))) for i in range(want))
    classifier = Classifier(pooling, labels, None, per_token=True, reward=kind, step_token=step)
    return classifier, head


def generative(config: Mapping[str, Any]) -> str | None:
    """The ``*ForCausalLM`` architecture ``config`` names, None for any other."""
    return next(
        (str(n) for n in config.get("architectures") or [] if str(n).endswith("ForCausalLM")),
        None,
    )


YesNoTemplate = PairTemplate | SegmentedPairTemplate


def yes_no_template(config: Mapping[str, Any], template: YesNoTemplate | None) -> YesNoTemplate:
    """``template``, or the refusal of a generative checkpoint served with task score whose
    family has no yes/no reranker prompt we implement (from config.json alone, so that it
    comes before any weight is fetched)."""
    if template is not None:
        return template
    arch = generative(config) or "?"
    raise UnsupportedModelError(
        f"task score on {arch} serves it as a yes/no reranker, which needs the prompt its "
        "authors trained it with; those implemented are Qwen3-Reranker's (model_type qwen3), "
        "mxbai-rerank-v2's (qwen2) and bge-reranker-v2-gemma's (gemma), none for model_type "
        f"{config.get('model_type')!r}. Serve its hidden states with --task embed, or a "
        "*ForSequenceClassification conversion of it"
    )


def read_yes_no(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    template: YesNoTemplate | None,
    token_id: Callable[[str], int | None],
) -> tuple[Classifier, ClassificationHead]:
    """A generative checkpoint served with task score as a yes/no reranker: its last token's
    state through the language-model head's rows for ``template``'s "yes" and "no" tokens
    (``lm_head.weight``, or the embeddings when tied), P(yes) = softmax([no, yes])[yes].
    That is ``sigmoid(logit_yes - logit_no)``, so the head is one row, ``W[yes] - W[no]``,
    read as a one-label cross-encoder (sigmoid, in float32); no other row of the LM head is
    used. A template with no "no" token (bge-reranker-v2-gemma) scores ``sigmoid(logit_yes)``:
    the head is ``W[yes]`` alone. ``template`` None: the family has no reranker prompt we
    implement (refused)."""
    arch = generative(config) or "?"
    template = yes_no_template(config, template)
    if isinstance(template, SegmentedPairTemplate):
        for marker in template.tokens:
            if token_id(marker) is None:
                raise UnsupportedModelError(
                    f"{arch} served as a {template.name} yes/no reranker: its tokenizer has "
                    f"no token {marker!r}, which the prompt needs; is it a {template.name} "
                    "checkpoint?"
                )
    answers = (template.yes,) if template.no is None else (template.yes, template.no)
    ids: dict[str, int] = {}
    for answer in answers:
        found = token_id(answer)
        if found is None:
            raise UnsupportedModelError(
                f"{arch} served as a {template.name} yes/no reranker: its tokenizer has no "
                f"token {answer!r} whose logit is the answer; is it a {template.name} "
                "checkpoint?"
            )
        ids[answer] = found
    tied = "lm_head.weight" not in weights and bool(config.get("tie_word_embeddings", False))
    name = next(
        (
            n
            for n in (("model.embed_tokens.weight", "embed_tokens.weight") if tied else ())
            + ("lm_head.weight",)
            if n in weights
        ),
        None,
    )
    if name is None:
        raise UnsupportedModelError(
            f"{arch} checkpoint lacks lm_head.weight (and does not tie it to its embeddings): "
            "a yes/no reranker scores with its rows for the answer tokens; is it complete?"
        )
    rows = _rows(weights, name)
    for answer, row in ids.items():
        if not 0 <= row < rows:
            raise UnsupportedModelError(
                f"{arch}: the tokenizer's {answer!r} token id {row} is not a row of {name} "
                f"({rows} rows); the tokenizer and the checkpoint disagree"
            )
    direction = _row(weights, name, ids[template.yes]).float()
    if template.no is not None:
        direction = direction - _row(weights, name, ids[template.no]).float()
    head = ClassificationHead(weight=direction.unsqueeze(0), bias=None)
    return Classifier("last", (template.yes,), "sigmoid", template=template), head


def _rows(weights: Mapping[str, torch.Tensor], name: str) -> int:
    """The row count of ``name``, from its shape where the mapping knows shapes unread."""
    shapes = getattr(weights, "shape_of", None)
    return int(shapes(name)[0]) if shapes is not None else int(weights[name].shape[0])


def _row(weights: Mapping[str, torch.Tensor], name: str, index: int) -> torch.Tensor:
    """One row of ``name``, read alone where the mapping can (``TrackedWeights.row``)."""
    reader = getattr(weights, "row", None)
    if reader is not None:
        row: torch.Tensor = reader(name, index)
        return row
    return weights[name][index]


def token_head(head: ClassificationHead, *, raw: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A classifier's head over token states ``[tokens, hidden]``, which the runner applies
    on the device before copying them back: label probabilities (softmax, sigmoid for one
    label), or the raw outputs (``raw``: the reward task)."""
    single = head.num_labels == 1

    def outputs(states: torch.Tensor) -> torch.Tensor:
        logits = head.project(states)
        if raw:
            return logits
        return torch.sigmoid(logits) if single else torch.softmax(logits, dim=-1)

    return outputs


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


MaskedLmReader = Callable[[HeadWeights, SparseStrategy], SparseHead]
"""A family's masked-LM head as a SPLADE head, read from its checkpoint's names."""


@dataclass(frozen=True)
class MaskedLmNames:
    """A :data:`MaskedLmReader` declared by the names of a family's masked-LM head: ``dense``
    -> activation -> ``norm`` -> ``decoder`` (+ ``bias``), the decoder's weight tied to the
    word embeddings ``tied`` when the checkpoint does not save it."""

    dense: str
    norm: str
    decoder: str
    bias: str
    """The decoder's bias, saved apart from it (``cls.predictions.bias``) or within it."""
    tied: str
    activation: str | None = None
    """The head's activation; None: the config's ``hidden_act``, as BERT's head reads it."""

    def __call__(self, w: HeadWeights, strategy: SparseStrategy) -> SparseHead:
        if self.dense + "weight" not in w:
            raise UnsupportedModelError(
                f"task sparse (SPLADE) needs a *ForMaskedLM checkpoint with its head "
                f"({self.dense}*); {w.architecture} has none: serve it with another task"
            )
        act = self.activation or str(w.config.get("hidden_act", "gelu"))
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"{w.architecture}: masked-LM head activation {act!r} is not supported"
            )
        decoder = self.decoder + "weight"
        return SparseHead(
            dense_weight=w.get(self.dense + "weight"),
            dense_bias=w.maybe(self.dense + "bias"),
            activation=act,
            norm_weight=w.get(self.norm + "weight"),
            norm_bias=w.maybe(self.norm + "bias"),
            norm_eps=float(w.config.get("layer_norm_eps", 1e-12)),
            decoder_weight=w.get(decoder if decoder in w else self.tied),
            decoder_bias=w.maybe(self.bias) if self.bias in w else w.maybe(self.decoder + "bias"),
            strategy=strategy,
        )


def read_sparse_head(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    reader: MaskedLmReader | None,
    strategy: SparseStrategy,
) -> SparseHead:
    """The SPLADE head over a masked-LM checkpoint, read by its family's ``reader`` (None:
    the family has no masked-LM head we serve)."""
    arch = str((config.get("architectures") or ["?"])[0])
    if reader is None:
        raise UnsupportedModelError(
            f"task sparse (SPLADE) needs a BERT, RoBERTa or XLM-R masked-LM checkpoint with its "
            f"head (cls.predictions.* or lm_head.*); {arch} has none"
        )
    return reader(HeadWeights(config, weights, arch), strategy)

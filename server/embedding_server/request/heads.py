"""Task heads, the request plane's half: which task a checkpoint serves, and how a
classifier's logits become scores and probabilities.

The models stay bodies (final hidden states) and pooling stays in ``pooling.py``; a
sequence-classification checkpoint adds, after pooling, an optional *pooler* and a
*classifier* (vLLM's ``ClassifierPooler``). Their weights are read and run on the device
(``device/heads.py``), each model family declaring how its checkpoints name them. What is
here runs per request and imports no torch: the task a checkpoint serves
(:func:`resolve_task`), the classifier's labels and declared activation (:class:`Classifier`),
and the activations in numpy, so ``--api-workers`` front-ends apply them.

Activations follow sentence-transformers' ``CrossEncoder``: the one its config declares
(``activation_fn`` in ``config_sentence_transformers.json``, v6; in ``config.json``'s
``sentence_transformers`` block, v4-5; ``sbert_ce_default_activation_function`` before v4),
else sigmoid for one label, applies to scores; ``classify`` gives softmax probabilities over
several labels (sigmoid for one), as vLLM does.

A checkpoint whose architecture names a head we do not serve (question answering, multiple
choice) is refused with the reason, rather than being served as an embedder by its body.
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from embedding_server.errors import UnsupportedModelError
from embedding_server.request.pooling import FloatArray, PoolingMethod

Task = Literal["embed", "score", "classify", "token_classify", "reward", "sparse"]
"""What a served model does: embed (vectors; /score is cosine), score (a one-label
cross-encoder: /score and /rerank; /classify gives its sigmoid probability), classify
(labels with probabilities), token_classify (label probabilities of every token), reward
(a classifier's raw outputs at every token, as vLLM's reward task: no activation; only when
asked for, since a reward model's checkpoint is usually a plain
``*ForSequenceClassification``; chosen by auto for a dedicated ``*ForRewardModel`` /
``*ForProcessRewardModel``, the latter answering at its step separators),
sparse (SPLADE: a vocabulary-sized sparse vector from the masked-LM head)."""

TASKS: tuple[Task, ...] = ("embed", "score", "classify", "token_classify", "reward", "sparse")

HeadKind = Literal["sequence_classification", "token_classification"]

RewardKind = Literal["outcome", "process"]
"""A dedicated reward model's head (vLLM's reward models): ``outcome``
(``*ForRewardModel``: one output at every token, the last token's is the reward) or
``process`` (``*ForProcessRewardModel``: two outputs, read at each step separator)."""

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


Size = tuple[int, bool]
"""A text's length in characters and whether it is all ASCII: what admission reads of a text
(:func:`~.estimates.token_bound`), known of a filled-in template from its parts' sizes,
without building it (:func:`filled_size`)."""


@functools.cache
def _fields(template: str) -> tuple[int, bool, tuple[str, ...]]:
    """``template``'s literal characters, whether they are ASCII, and its fields in order (one
    entry per occurrence). Only plain named fields: a conversion or a format spec would make
    the filled-in size other than the sum of the parts'."""
    literal: list[str] = []
    fields: list[str] = []
    for text, name, spec, conversion in string.Formatter().parse(template):
        literal.append(text)
        if name is None:
            continue
        if spec or conversion or not name.isidentifier():
            raise ValueError(f"template field {name!r} must be a plain name: {template!r}")
        fields.append(name)
    joined = "".join(literal)
    return len(joined), joined.isascii(), tuple(fields)


def filled_size(template: str, **values: str) -> Size:
    """The :data:`Size` of ``template.format(**values)``, from the values' sizes alone:
    ``len`` and ``isascii`` of a ``str`` are known without reading it, so this costs the same
    for a megabyte of query as for a word."""
    chars, ascii, fields = _fields(template)
    for name in fields:
        value = values[name]
        chars += len(value)
        ascii = ascii and value.isascii()
    return chars, ascii


@dataclass(frozen=True)
class PairTemplate:
    """How a yes/no reranker (a ``*ForCausalLM`` scored by its language-model head's logits
    for a "yes" and a "no" token) reads a (query, document) pair: one text, ``prefix`` +
    ``body`` (``{instruction}``, ``{query}``, ``{document}`` filled in) + ``suffix``, its
    last token's logits giving P(yes). Truncation cuts the body's end only: the suffix (the
    assistant turn whose next token is the answer) is always kept, as the model card's code
    truncates the pair text between its fixed prefix and suffix token ids."""

    name: str
    prefix: str
    body: str
    suffix: str
    instruction: str
    """The default instruction; a request's ``prompt`` replaces it."""
    yes: str
    no: str
    """The answer tokens (vocabulary entries) whose logits are compared."""

    def text(self, query: str, document: str, instruction: str | None = None) -> str:
        """The pair's text up to (not including) the suffix. ``str.format`` fills the
        placeholders of ``body`` only: braces in the query or document are left as they are."""
        given = self.instruction if instruction is None else instruction
        return self.prefix + self.body.format(instruction=given, query=query, document=document)

    def size(self, query: str, document: str, instruction: str | None = None) -> Size:
        """The :data:`Size` of :meth:`text`, which is not built."""
        given = self.instruction if instruction is None else instruction
        chars, ascii = filled_size(self.body, instruction=given, query=query, document=document)
        return len(self.prefix) + chars, ascii and self.prefix.isascii()


# Qwen3-Reranker's prompt, as its model card (Qwen/Qwen3-Reranker-0.6B on the Hub) and vLLM's
# examples/offline_inference/qwen3_reranker.py format it: the system turn, the user turn
# "<Instruct>: ...\n<Query>: ...\n<Document>: ...", then the assistant turn opened with an
# empty think block; P(yes) = softmax over the logits of the tokens "no" and "yes".
QWEN3_RERANKER = PairTemplate(
    name="Qwen3-Reranker",
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
        'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
        "<|im_end|>\n<|im_start|>user\n"
    ),
    body="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    instruction="Given a web search query, retrieve relevant passages that answer the query",
    yes="yes",
    no="no",
)


@dataclass(frozen=True)
class SegmentedPairTemplate:
    """A yes/no reranker's prompt whose pieces are tokenized each alone and cut to their own
    budgets, as mxbai-rerank-v2's and FlagEmbedding's LLM-reranker code build a pair: ids of
    ``head``, the query segment (cut to 3/4 of the budget), ``separator``, the document
    segment (cut to what is left), then ``tail``'s pieces (``separator``, the task prompt,
    any chat suffix), which are never cut. Tokenizing the pieces apart (not the joined
    text) is what those references do, so a boundary merge cannot differ from them.

    ``budget`` names whose arithmetic turns the limit into the two cuts
    (:meth:`query_room`, :meth:`document_room`); each keeps the whole within the limit."""

    name: str
    head: tuple[str, ...]
    """Texts before the query, each tokenized alone (a chat prefix; a BOS token)."""
    query: str
    """The query segment, ``{query}`` filled in."""
    instructed_query: str | None
    """The query segment when the request gives an instruction (``{instruction}`` too);
    None: the instruction replaces ``{instruction}`` in ``tail`` instead."""
    document: str
    separator: str
    tail: tuple[str, ...]
    instruction: str | None
    """The default instruction (None: none unless the request's ``prompt`` gives one)."""
    yes: str
    no: str | None
    """The answer tokens; ``no`` None: the "yes" logit alone is the score."""
    budget: Literal["mxbai", "flag_embedding"]
    tokens: tuple[str, ...] = ()
    """Vocabulary entries the fixed pieces need as single tokens (chat markers, BOS): a
    tokenizer without them is not the model's, and is refused at start."""

    def query_text(self, query: str, instruction: str | None) -> str:
        """The query segment's text (``str.format`` fills the template's placeholders only)."""
        given = instruction if instruction is not None else self.instruction
        if self.instructed_query is not None and given:
            return self.instructed_query.format(instruction=given, query=query)
        return self.query.format(query=query)

    def query_size(self, query: str, instruction: str | None) -> Size:
        """The :data:`Size` of :meth:`query_text`, which is not built."""
        given = instruction if instruction is not None else self.instruction
        if self.instructed_query is not None and given:
            return filled_size(self.instructed_query, instruction=given, query=query)
        return filled_size(self.query, query=query)

    def document_text(self, document: str) -> str:
        return self.document.format(document=document)

    def document_size(self, document: str) -> Size:
        """The :data:`Size` of :meth:`document_text`, which is not built."""
        return filled_size(self.document, document=document)

    def tail_texts(self, instruction: str | None) -> tuple[str, ...]:
        """``tail`` with the instruction in it where the query does not take it."""
        given = instruction if instruction is not None else self.instruction
        if self.instructed_query is not None:
            return self.tail
        return tuple(t.format(instruction=given or "") for t in self.tail)

    def budget_of(self, limit: int, head: int, tail: int) -> int:
        """The tokens the query and document segments (and the separator between them) may
        share under ``limit``: mxbai keeps the limit less the fixed pieces
        (``predefined_length``); FlagEmbedding's ``max_length`` is what leaves room for its
        separator and prompt twice (its ``encode_max_length`` counts them once more than it
        adds), so the whole sequence fits the limit in both."""
        if self.budget == "mxbai":
            return limit - head - tail
        return limit - 2 * tail

    def query_room(self, limit: int, head: int, tail: int) -> int:
        """The most tokens the query segment keeps: 3/4 of the budget, in both references."""
        return self.budget_of(limit, head, tail) * 3 // 4

    def document_room(self, limit: int, head: int, sep: int, tail: int, query: int) -> int:
        """The most tokens the document segment keeps after a query segment of ``query``."""
        budget = self.budget_of(limit, head, tail)
        if self.budget == "mxbai":  # query + sep + document <= budget
            return budget - query - sep
        # FlagEmbedding: the passage alone at most max_length, then [bos] + query + sep +
        # passage at most max_length + len(sep) + len(prompt) (= tail), cutting the passage.
        return min(budget, budget + tail - head - query - sep)


# mixedbread-ai/mxbai-rerank-base-v2 and -large-v2 (Qwen2ForCausalLM), as the mxbai-rerank
# package's MxbaiRerankV2 builds a pair: Qwen's chat turns around "query: ..." (after
# "instruction: ...\n" when one is given), "\n", "document: ...", "\n" and its task prompt;
# the score is logit("1") - logit("0") at the last position (sigmoid of it here).
MXBAI_RERANK_V2 = SegmentedPairTemplate(
    name="mxbai-rerank-v2",
    head=(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\n",
    ),
    query="query: {query}",
    instructed_query="instruction: {instruction}\nquery: {query}",
    document="document: {document}",
    separator="\n",
    tail=(
        "\n",
        "You are a search relevance expert who evaluates how well documents match search "
        "queries. For each query-document pair, carefully analyze the semantic relationship "
        "between them, then provide your binary relevance judgment (0 for not relevant, 1 for "
        "relevant).\nRelevance:",
        "<|im_end|>\n<|im_start|>assistant\n",
    ),
    instruction=None,
    yes="1",
    no="0",
    budget="mxbai",
    tokens=("<|im_start|>", "<|im_end|>"),
)

# BAAI/bge-reranker-v2-gemma (GemmaForCausalLM), as FlagEmbedding's LLM reranker
# (inference/reranker/decoder_only/base.py) builds a pair: <bos>, "A: {query}", "\n",
# "B: {passage}", "\n", its prompt (a request's ``prompt`` replaces it); the score is the
# "Yes" logit at the last position (FlagEmbedding's normalize=True: its sigmoid).
BGE_RERANKER_GEMMA = SegmentedPairTemplate(
    name="bge-reranker-v2-gemma",
    head=("<bos>",),
    query="A: {query}",
    instructed_query=None,
    document="B: {document}",
    separator="\n",
    tail=("\n", "{instruction}"),
    instruction=(
        "Given a query A and a passage B, determine whether the passage contains an answer "
        "to the query by providing a prediction of either 'Yes' or 'No'."
    ),
    yes="Yes",
    no=None,
    budget="flag_embedding",
    tokens=("<bos>",),
)


@dataclass(frozen=True)
class PairPrompt:
    """How a cross-encoder whose authors format a (query, document) pair as one text reads
    it: ``text`` with ``{query}`` and ``{document}`` filled in, tokenized like any single
    text (the tokenizer's special tokens around it) and truncated at its end, the
    document's, as the model card's code tokenizes it."""

    name: str
    text: str

    def format(self, query: str, document: str) -> str:
        """The pair's text (``str.format`` fills the template's placeholders only: braces in
        the query or document are left as they are)."""
        return self.text.format(query=query, document=document)

    def size(self, query: str, document: str) -> Size:
        """The :data:`Size` of :meth:`format`, which is not built."""
        return filled_size(self.text, query=query, document=document)


# nvidia/llama-nemotron-rerank-1b-v2 (LlamaBidirectionalForSequenceClassification), as its
# model card's prompt_template and vLLM's examples/pooling/score/template/nemotron-rerank.jinja
# write a pair.
NEMOTRON_RERANK = PairPrompt(
    name="llama-nemotron-rerank", text="question:{query} \n \n passage:{document}"
)


@dataclass(frozen=True)
class Classifier:
    """What a checkpoint's classification head means: how it pools, its labels, and how to
    read its logits (the weights are ``device.heads.ClassificationHead``)."""

    pooling: PoolingMethod
    labels: tuple[str, ...]
    """``id2label`` in label order."""
    activation: str | None
    """The activation the checkpoint declares (sentence-transformers), else None."""
    per_token: bool = False
    """A token classifier: the head runs on every token's hidden state, not a pooled one."""
    template: PairTemplate | SegmentedPairTemplate | PairPrompt | None = None
    """A yes/no reranker's prompt (a generative checkpoint served with task score), or the
    one text a cross-encoder's authors make of a pair (:class:`PairPrompt`): each pair is
    formatted with it rather than tokenized as a sentence pair."""
    reward: RewardKind | None = None
    """A dedicated reward model's head: task reward is what it serves (also under auto)."""
    step_token: int | None = None
    """A process reward model's step separator (``<extra_0>`` for Qwen2.5-Math-PRM): task
    reward answers with the rows at this token only, as probabilities (:meth:`rewards`)."""

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def score_activation(self) -> str:
        """Applied to the one logit of a cross-encoder score (CrossEncoder.predict's)."""
        return self.activation or ("sigmoid" if self.num_labels == 1 else "identity")

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

    def rewards(self, outputs: FloatArray, token_ids: Sequence[int]) -> FloatArray:
        """Task reward's answer for one input from the head's raw outputs at its tokens
        (``[len, num_labels]``): those outputs as they are (vLLM's ALL pooling, no
        activation), or, for a process reward model, the softmax of the rows at its step
        separator, one row per step (vLLM's STEP pooling, and the model card's
        ``make_step_rewards``, whose step reward is column 1): ``[steps, num_labels]``,
        no rows for a text with no step."""
        if self.step_token is None:
            return outputs
        steps = np.asarray(token_ids) == self.step_token
        return softmax(outputs[steps]).reshape(-1, outputs.shape[-1])


def apply_activation(name: str, x: FloatArray) -> FloatArray:
    """The activation ``device.pooling.activation`` names, in numpy (float64 inside): for the
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


def reward_kind(config: Mapping[str, Any]) -> RewardKind | None:
    """The reward-model head a ``*ForRewardModel`` or ``*ForProcessRewardModel`` checkpoint
    has (Qwen2.5-Math-RM / -PRM), None for any other."""
    for name in config.get("architectures") or []:
        if str(name).endswith("ForProcessRewardModel"):
            return "process"
        if str(name).endswith("ForRewardModel"):
            return "outcome"
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


def resolve_task(
    requested: str, classifier: Classifier | None, architecture: str, *, splade: bool = False
) -> Task:
    """The task to serve: ``requested`` (``auto`` decides from the checkpoint; ``splade``: its
    sentence-transformers config is a SPLADE SparseEncoder), or an error saying why the
    checkpoint cannot serve it."""
    natural: Task = "embed"
    if splade and classifier is None:
        natural = "sparse"
    elif classifier is not None and classifier.reward is not None:
        natural = "reward"
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
        else f"a {classifier.reward} reward model"
        if classifier.reward is not None
        else f"a sequence classifier with {classifier.num_labels} label(s)"
    )
    if classifier.reward is not None:
        raise UnsupportedModelError(
            f"{architecture} is {what}: its head's outputs are rewards, served by task reward "
            f"(or auto) on /pooling, not by task {requested}"
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

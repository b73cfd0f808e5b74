"""Classification (tasks classify and score), as vLLM's ``LLM.classify``: the class
probabilities of each single input (a cross-encoder gives its one sigmoid probability)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Unpack

from embedding_server.errors import InvalidRequestError
from embedding_server.request.heads import PairPrompt
from embedding_server.request.jobs import Job, ScoreOptions
from embedding_server.request.pooling import FloatArray
from embedding_server.request.results import Usage, usage_of
from embedding_server.request.tasks.context import Inputs, TaskContext, check_options


@dataclass(frozen=True, kw_only=True)
class ClassifyResult(Usage):
    """Class probabilities of each input (``[n, num_labels]`` float32) and the labels."""

    probs: FloatArray
    labels: tuple[str, ...]
    """The model's labels, in ``probs`` column order."""

    @property
    def predicted(self) -> list[str]:
        """The most probable label of each input."""
        return [self.labels[int(i)] for i in self.probs.argmax(axis=1)]


async def classify(
    ctx: TaskContext, /, inputs: Inputs, **options: Unpack[ScoreOptions]
) -> ClassifyResult:
    """Class probabilities ``[n, num_labels]`` of each input, and the labels."""
    check_options("classify", dict(options), ScoreOptions)
    ctx.require("classification", "classify", "score")
    if ctx.config.listwise is not None:
        raise InvalidRequestError(
            f"classification of single texts is not served by a listwise reranker "
            f"({ctx.info.architecture}, {ctx.config.listwise.name}): it scores "
            "documents against a query; use /score or /rerank",
            param="model",
        )
    classifier = ctx.config.classifier
    assert classifier is not None  # task classify and score have one
    if classifier.template is not None:
        # Its score means something only for a pair inside its prompt.
        kind = (
            "a cross-encoder that reads each pair inside its prompt"
            if isinstance(classifier.template, PairPrompt)
            else "a yes/no reranker"
        )
        raise InvalidRequestError(
            f"classification of single texts is not served by {kind} "
            f"({ctx.info.architecture}, {classifier.template.name}'s prompt); use "
            "/score or /rerank with query and document pairs",
            param="model",
        )
    items = await ctx.texts(inputs)
    out = await ctx.run(Job.prepare(items, options, ctx.config.prompts))
    probs = classifier.probabilities(out.pooled)
    return ClassifyResult(probs=probs, labels=classifier.labels, **usage_of(out))

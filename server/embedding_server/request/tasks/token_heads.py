"""The classifier's head on every token (tasks token_classify and reward): one job shape,
two readings of its rows. Label probabilities for token_classify (softmax, sigmoid for one
label), raw outputs for reward (a process reward model's steps picked out); the head itself
runs in the runner's batch (:attr:`~.configuration.EngineConfig.token_head`)."""

from __future__ import annotations

from typing import Unpack

from embedding_server.errors import InvalidRequestError
from embedding_server.request.heads import Task
from embedding_server.request.jobs import Job, TokenOptions
from embedding_server.request.tasks.context import Inputs, TaskContext, check_options
from embedding_server.request.tasks.token_embed import TokenEmbedResult, token_result


async def token_classify(
    ctx: TaskContext, /, inputs: Inputs, **options: Unpack[TokenOptions]
) -> TokenEmbedResult:
    """Label probabilities of every token (float32 ``[len_i, num_labels]`` per input), as
    vLLM's ``LLM.encode(..., pooling_task="token_classify")``."""
    return await _per_token(ctx, inputs, options, "token_classify")


async def reward(
    ctx: TaskContext, /, inputs: Inputs, **options: Unpack[TokenOptions]
) -> TokenEmbedResult:
    """A reward model's outputs at every token (float32 ``[len_i, num_labels]`` per input),
    as vLLM's reward task (all tokens, no activation): for a decoder
    ``*ForSequenceClassification`` reward model the last row is its score."""
    return await _per_token(ctx, inputs, options, "reward")


async def _per_token(
    ctx: TaskContext, inputs: Inputs, options: TokenOptions, task: Task
) -> TokenEmbedResult:
    check_options(task, dict(options), TokenOptions)
    if options.get("normalize"):
        raise InvalidRequestError(f"normalize does not apply to task {task}", param="normalize")
    ctx.require(task.replace("_", " "), task)
    items = await ctx.texts(inputs)
    special = options.get("add_special_tokens", True)
    job = Job.prepare(
        items, options, ctx.config.prompts, add_special_tokens=special, want_tokens=True
    )
    out = await ctx.run(job)
    outputs = [t for t in out.tokens if t is not None]
    classifier = ctx.config.classifier
    if task == "reward" and classifier is not None:  # a process reward model's steps
        outputs = [
            classifier.rewards(o, t.ids) for o, t in zip(outputs, out.tokenized, strict=True)
        ]
    return token_result(out, outputs)

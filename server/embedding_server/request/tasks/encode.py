"""vLLM's ``LLM.encode``: one array per input for a pooling task, each served by its own
task's module with that task's options."""

from __future__ import annotations

from typing import Any, Literal

from embedding_server.errors import InvalidRequestError
from embedding_server.request.pooling import FloatArray
from embedding_server.request.tasks.classify import classify
from embedding_server.request.tasks.context import Inputs, TaskContext
from embedding_server.request.tasks.embed import embed
from embedding_server.request.tasks.token_embed import embed_tokens
from embedding_server.request.tasks.token_heads import reward, token_classify

EncodeTask = Literal["embed", "token_embed", "classify", "token_classify", "reward"]
ENCODE_TASKS: tuple[EncodeTask, ...] = (
    "embed",
    "token_embed",
    "classify",
    "token_classify",
    "reward",
)


def check_task(task: object) -> None:
    """A 400 for a ``task`` that is not one of :data:`ENCODE_TASKS`."""
    if task not in ENCODE_TASKS:
        raise InvalidRequestError(
            f"task must be one of {', '.join(ENCODE_TASKS)}; got {task!r}", param="task"
        )


async def encode(
    ctx: TaskContext, /, inputs: Inputs, *, task: EncodeTask = "embed", **options: Any
) -> list[FloatArray]:
    """One array per input for ``task`` (:data:`ENCODE_TASKS`): ``embed`` (the pooled
    vector), ``token_embed`` (per-token hidden states ``[len_i, hidden]``), ``classify``
    (class probabilities), ``token_classify`` (per-token probabilities) or ``reward``
    (per-token raw outputs). ``options`` are those of the task's own method; one that does
    not apply is a TypeError, as there."""
    check_task(task)
    if task == "embed":
        return list((await embed(ctx, inputs, **options)).embeddings)
    if task == "token_embed":
        return (await embed_tokens(ctx, inputs, **options)).embeddings
    if task == "classify":
        return list((await classify(ctx, inputs, **options)).probs)
    if task == "token_classify":
        return (await token_classify(ctx, inputs, **options)).embeddings
    return (await reward(ctx, inputs, **options)).embeddings

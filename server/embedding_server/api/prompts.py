"""Mapping task hints (Cohere's ``input_type``) onto the model's own prompts.

Clients of Cohere-style APIs always send ``input_type``; a model whose sentence-transformers
config has no matching prompt simply embeds the text as is (refusing would break every such
client on models without prompts). An explicit ``prompt_name`` is different: the client
asked for a specific prompt, so an unknown name is an error (raised by the engine).

``input_type`` may also be any prompt name the checkpoint declares (``s2p_query``;
jina-embeddings-v3's ``retrieval.query``, the task-key form vLLM's docs describe), which
selects that prompt. Any other value is a 400 naming the field and what it accepts: a
typo'd task would otherwise embed queries as documents without a word.
"""

from __future__ import annotations

from collections.abc import Mapping

from embedding_server.errors import InvalidRequestError
from embedding_server.request.serving import ServingEngine

INPUT_TYPE_PROMPTS: Mapping[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query", "retrieval.query"),
    "query": ("query", "search_query", "retrieval.query"),
    "search_document": ("search_document", "document", "passage", "retrieval.passage"),
    "document": ("document", "passage", "search_document", "retrieval.passage"),
    "passage": ("passage", "document", "search_document", "retrieval.passage"),
    "classification": ("classification",),
    "clustering": ("clustering", "separation"),
}
"""Prompt names tried, in order, for each input_type. jina-embeddings-v3's names come last
(``retrieval.query``, ``retrieval.passage``, ``classification``, ``separation``): there the
prompt name also chooses the task adapter of that name (:meth:`Prompts.adapter`)."""


def prompt_name_for(
    engine: ServingEngine, prompt_name: str | None, input_type: str | None
) -> str | None:
    """The prompt to apply: an explicit ``prompt_name`` wins, else the model's prompt that
    matches ``input_type``, else none (the engine's default prompt, if configured). On a
    model with task adapters the prompt's name picks the adapter too."""
    candidates = input_type_prompts(engine, input_type)
    if prompt_name is not None:
        return prompt_name
    prompts = engine.info().prompts
    return next((c for c in candidates if c in prompts), None)


def input_type_prompts(engine: ServingEngine, input_type: str | None) -> tuple[str, ...]:
    """The prompt names ``input_type`` may select, in order (none for None); a 400 naming
    the field and the accepted values when it is neither a hint nor one of the model's
    prompt names."""
    if input_type is None:
        return ()
    prompts = engine.info().prompts
    if input_type in prompts:  # the checkpoint's own name first
        return (input_type,)
    if input_type in INPUT_TYPE_PROMPTS:
        return INPUT_TYPE_PROMPTS[input_type]
    declared = ", ".join(sorted(prompts)) if prompts else "none"
    raise InvalidRequestError(
        f"unknown input_type {input_type!r}; accepted: {', '.join(INPUT_TYPE_PROMPTS)}, or a "
        f"prompt name this model declares ({declared})",
        param="input_type",
    )


def check_task_adapter(engine: ServingEngine, task: str | None) -> None:
    """A 400 naming the ``task`` field when it names an adapter the model lacks (the engine
    would refuse it too, naming its own ``adapter`` option)."""
    adapters = engine.info().adapters
    if task is not None and task not in adapters:
        available = ", ".join(adapters) or "none (it has no task adapters)"
        raise InvalidRequestError(
            f"unknown task {task!r}; this model's task adapters: {available}", param="task"
        )

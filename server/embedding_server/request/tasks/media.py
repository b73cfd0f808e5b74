"""What a request's media become before its task runs: images fetched and preprocessed, chat
messages rendered through the model's template. Both are CPU work kept off the event loop
(``TaskContext.runner.offload``, the tokenizer threads)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from embedding_server.errors import InvalidRequestError
from embedding_server.request.media import fetching as media
from embedding_server.request.media.fetching import MediaPolicy
from embedding_server.request.media.inputs import ChatMessage, ImageRef
from embedding_server.request.media.preprocessing import ImageInput
from embedding_server.request.tasks.context import TaskContext, check_takes_images


async def render_chat(
    ctx: TaskContext,
    /,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    kwargs: Mapping[str, Any] | None = None,
    max_request_bytes: int | None = None,
) -> str:
    """``messages`` rendered through the model's chat template
    (:meth:`ChatTemplate.render`, within ``max_request_bytes``' bound on the rendered text),
    off the event loop: a long conversation is milliseconds of template work the loop must
    not spend."""
    template = ctx.chat
    if template is None:
        raise InvalidRequestError(
            f"messages need a chat template, and this model ({ctx.info.architecture}) "
            "has none in its tokenizer_config.json; send the text as input",
            param="messages",
        )
    render = functools.partial(
        template.render,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        kwargs=kwargs,
        max_request_bytes=max_request_bytes,
    )
    return await ctx.runner.offload(render)


async def load_images(
    ctx: TaskContext, /, refs: Sequence[ImageRef], policy: MediaPolicy
) -> list[ImageInput]:
    """The images ``refs`` point at, fetched (concurrently, on the loop: network I/O)
    then decoded and preprocessed off the event loop in the tokenizer threads. Every
    refusal (a host not listed, a body too large, a decompression bomb) is a 400 naming
    the image's field."""
    for ref in refs:
        check_takes_images(ctx.info, ctx.images, ref.param)
    processor = ctx.images
    assert processor is not None
    offloader = ctx.runner

    def prepare(raw: bytes, param: str) -> ImageInput:
        with media.decode_image(raw, policy, param=param) as image:
            return processor.preprocess(image)

    async def one(ref: ImageRef) -> ImageInput:
        # Looked up on the module at each call (media's functions are the seam tests
        # replace).
        raw = await media.fetch_image(ref.url, policy, param=ref.param)
        return await offloader.offload(functools.partial(prepare, raw, ref.param))

    # The first refusal cancels the other fetches.
    return await media.gather_all_or_none([one(ref) for ref in refs])

"""What a request's media become before its task runs: images fetched and preprocessed, chat
messages rendered through the model's template. Both are CPU work kept off the event loop
(``TaskContext.runner.offload``, the tokenizer threads)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from embedding_server.errors import InvalidRequestError
from embedding_server.request.media import fetching as media
from embedding_server.request.media.budget import ImageBudget
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
    ctx: TaskContext,
    /,
    refs: Sequence[ImageRef],
    policy: MediaPolicy,
    budget: ImageBudget | None = None,
) -> list[ImageInput]:
    """The images ``refs`` point at: fetched (concurrently, on the loop: network I/O), their
    headers read, then decoded and preprocessed off the event loop. Every refusal (a host
    not listed, a body too large, a decompression bomb) is a 400 naming the image's field.

    With ``budget`` (the server's), the request's image URLs reserve what they may download
    before any is fetched, and its images their pixels before any is decoded (429 when
    either does not fit beside the requests in flight: :class:`~.media.budget.ImageBudget`),
    and images decode on the budget's own thread; without one (the offline API), in the
    tokenizer threads."""
    for ref in refs:
        check_takes_images(ctx.info, ctx.images, ref.param)
    processor = ctx.images
    assert processor is not None
    offload = ctx.runner.offload if budget is None else budget.offload
    urls = sum(1 for ref in refs if ref.url[:5].lower() != "data:")

    def prepare(raw: bytes, param: str) -> ImageInput:
        with media.decode_image(raw, policy, param=param) as image:
            return processor.preprocess(image)

    async def fetch(ref: ImageRef) -> bytes:
        # Looked up on the module at each call (media's functions are the seam tests
        # replace).
        return await media.fetch_image(ref.url, policy, param=ref.param)

    with budget.fetch(urls, policy.max_image_bytes) if budget else contextlib.nullcontext():
        # The first refusal cancels the other fetches.
        raws = await media.gather_all_or_none([fetch(ref) for ref in refs])
        pixels = 0
        for raw, ref in zip(raws, refs, strict=True):
            width, height = media.image_size(raw, policy, param=ref.param)
            pixels += width * height
        with budget.decode(pixels) if budget else contextlib.nullcontext():
            return await media.gather_all_or_none(
                [
                    offload(functools.partial(prepare, raw, ref.param))
                    for raw, ref in zip(raws, refs, strict=True)
                ]
            )

"""What a task sees of the engine serving it: :class:`TaskContext`, and a request's inputs.

Every task module takes a :class:`TaskContext`: the engine's configuration and model info,
its image preprocessing and chat template where the model has them, its metrics, and the
:class:`~embedding_server.request.jobs.JobRunner` the request's jobs run on (the scheduler,
the engine process over the wire, or the calling thread offline). Nothing else of the engine
reaches a task, so a task neither knows nor cares which engine serves it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from PIL import Image

from embedding_server.errors import InvalidRequestError
from embedding_server.metrics import Metrics
from embedding_server.request.configuration import EngineConfig, EngineInfo
from embedding_server.request.heads import Task
from embedding_server.request.jobs import INLINE_TOKENIZE_CHARS, Job, JobItem, JobRunner
from embedding_server.request.media.inputs import IMAGE_TYPES, ChatTemplate, ImagePreprocessor
from embedding_server.request.media.preprocessing import ImageInput
from embedding_server.request.results import JobOutput
from embedding_server.request.texts import TextInput, normalize_inputs

T = TypeVar("T")

Inputs = (
    str
    | Sequence[str]
    | Sequence[int]
    | Sequence[Sequence[int]]
    | Sequence[TextInput]
    | Image.Image
    | ImageInput
    | Sequence[TextInput | Image.Image | ImageInput]
)
"""One string, a list of strings, one token-id list, or a list of token-id lists (mixed ok);
for a model that takes images, PIL images and :class:`~.imaging.ImageInput` too, alone or
mixed with texts."""


def check_options(method: str, options: dict[str, Any], allowed: type) -> None:
    """Refuse unknown keyword arguments, as a plain signature would."""
    unknown = sorted(set(options) - set(allowed.__annotations__))
    if unknown:
        raise TypeError(f"{method}() got an unexpected keyword argument {unknown[0]!r}")


def takes_images(info: EngineInfo, images: ImagePreprocessor | None) -> bool:
    """Whether the model embeds images (a vision tower and its preprocessing)."""
    return "image" in info.modalities and images is not None


def check_takes_images(info: EngineInfo, images: ImagePreprocessor | None, param: str) -> None:
    """A 400 naming ``param`` (the request field holding an image) when the model does not
    embed images: an image is never dropped or guessed at."""
    if not takes_images(info, images):
        raise InvalidRequestError(
            f"{param} is an image, and this model ({info.architecture}) embeds "
            f"{' and '.join(info.modalities)} only",
            param=param,
        )


def _sizeable(value: object) -> bool:
    """Whether checking ``value`` element by element is more than a small job's worth of work
    (:data:`~.jobs.INLINE_TOKENIZE_CHARS` items or token ids)."""
    if not isinstance(value, list):
        return False
    if len(value) > INLINE_TOKENIZE_CHARS:
        return True
    return sum(len(v) for v in value if isinstance(v, list)) > INLINE_TOKENIZE_CHARS


def _holds_pil(inputs: object) -> bool:
    """Whether ``inputs`` hold a PIL image (its preprocessing is CPU work for a thread)."""
    if isinstance(inputs, Image.Image):
        return True
    return isinstance(inputs, list | tuple) and any(isinstance(x, Image.Image) for x in inputs)


@dataclass(frozen=True)
class TaskContext:
    """What a task reads of the engine serving it, and where its jobs run."""

    config: EngineConfig
    info: EngineInfo
    runner: JobRunner
    images: ImagePreprocessor | None = None
    """The model's image preprocessing, where it takes images (``info.modalities``)."""
    chat: ChatTemplate | None = None
    """The tokenizer's chat template, where it has one (``messages`` requests)."""
    metrics: Metrics | None = None

    def require(self, endpoint: str, *tasks: Task) -> None:
        """A 400 naming the model's task when it cannot serve ``endpoint``."""
        if self.config.task not in tasks:
            raise InvalidRequestError(
                f"{endpoint} needs a model with task {' or '.join(tasks)}; this model's task "
                f"is {self.config.task} ({self.info.architecture})",
                param="model",
            )

    async def run(self, job: Job) -> JobOutput:
        """``job`` run on the runner, its tokens, truncations and stage timings counted."""
        out = await self.runner.run(job)
        if self.metrics is not None:
            out.record(self.metrics)
        return out

    async def checked(self, check: Callable[..., T], *inputs: object) -> T:
        """``check(*inputs)``: input validation that walks every element, off the event loop
        (``runner.offload``) when the inputs hold millions of token ids."""
        if any(_sizeable(value) for value in inputs):
            return await self.runner.offload(functools.partial(check, *inputs))
        return check(*inputs)

    async def texts(self, inputs: object, param: str = "input") -> list[TextInput]:
        """A request's texts and token ids (:func:`normalize_inputs`), checked."""
        return await self.checked(normalize_inputs, inputs, param)

    async def items(self, inputs: object, param: str = "input") -> list[JobItem]:
        """:meth:`job_items` of ``inputs``, off the event loop when they are many or hold
        images to preprocess."""
        if _holds_pil(inputs):
            return await self.runner.offload(functools.partial(self.job_items, inputs, param))
        return await self.checked(self.job_items, inputs, param)

    def job_items(self, inputs: object, param: str = "input") -> list[JobItem]:
        """A request's inputs: texts and token ids (:func:`normalize_inputs`), and images
        (PIL images are preprocessed here: call it off the loop for many of them)."""
        if isinstance(inputs, IMAGE_TYPES):
            return [self._image_input(inputs, param)]
        if isinstance(inputs, list | tuple) and any(isinstance(x, IMAGE_TYPES) for x in inputs):
            items: list[JobItem] = []
            for i, item in enumerate(inputs):
                if isinstance(item, IMAGE_TYPES):
                    items.append(self._image_input(item, f"{param}[{i}]"))
                    continue
                try:
                    items.extend(normalize_inputs([item], param))
                except InvalidRequestError as error:
                    raise InvalidRequestError(
                        f"{param}[{i}] must be a string, a list of token ids or an image",
                        param=param,
                    ) from error
            return items
        return list(normalize_inputs(inputs, param))

    def _image_input(self, image: Image.Image | ImageInput, param: str) -> ImageInput:
        """An offline API image input, preprocessed as the model's processor does."""
        check_takes_images(self.info, self.images, param)
        if isinstance(image, ImageInput):
            return image
        assert self.images is not None
        return self.images.preprocess(image.convert("RGB"))

"""What every model route checks first: that the request names the served model and that
the engine is ready (:func:`model_route`, around each handler), that its input count is within
the server's limit, and that the answer it asks for is within the response size limit.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request
from starlette.responses import Response

from embedding_server.api.disconnect import cancel_on_disconnect
from embedding_server.api.encoding import JSON_FLOAT_BYTES
from embedding_server.api.lifecycle import Lifecycle, lifecycle_of
from embedding_server.errors import (
    FingerprintMismatchError,
    InvalidRequestError,
    ModelNotFoundError,
    OutputTooLargeError,
)
from embedding_server.fingerprint import VERSION_MARK, pinned_name
from embedding_server.request.serving import ServingEngine

T = TypeVar("T")


def engine_for(request: Request, model: str | None) -> tuple[ServingEngine, Lifecycle]:
    """The ready engine for a request naming ``model`` (404 for another model, 503 if not
    loaded yet).

    A versioned name, one of the model's names with ``@`` and its fingerprint or a prefix of
    it (``bge-small@3f2a9c01``, what the gateway lists for each version during a model
    change), is accepted by the server with that fingerprint only: any other answers 409
    ``fingerprint_mismatch`` before any work, so a request pinned to a version is never
    answered by another, even through a stale route. A name the server was given literally
    (an alias with an ``@``) is that name first."""
    lifecycle = lifecycle_of(request)
    if model is None or model in lifecycle.accepted_model_names:
        return lifecycle.require_engine(), lifecycle
    pinned = pinned_name(model)
    if pinned is None or pinned[0] not in lifecycle.accepted_model_names:
        raise ModelNotFoundError(
            f"The model {_shown(model)} does not exist; this server serves "
            f"'{lifecycle.served_model_name}' (or '{lifecycle.served_model_name}"
            f"{VERSION_MARK}<fingerprint>').",
            param="model",
        )
    engine = lifecycle.require_engine()
    ours = engine.info().fingerprint
    if not ours.startswith(pinned[1]):
        raise FingerprintMismatchError(
            f"The model {_shown(model)} names the version with embedding fingerprint "
            f"{pinned[1]}; this server's is {ours}: its vectors come from another computation, "
            "so the request was not run. The gateway lists the versions being served in "
            "/v1/models.",
            param="model",
        )
    return engine, lifecycle


def _shown(model: str) -> str:
    """``model`` quoted for an error message, cut to 200 characters."""
    return repr(model if len(model) <= 200 else model[:200] + "...")


class NamesModel(Protocol):
    """A model route's body: the model it asks for (None: the served one)."""

    @property
    def model(self) -> str | None: ...


BodyT = TypeVar("BodyT", bound=NamesModel)


@dataclass(frozen=True)
class Served:
    """A model route's request once :func:`model_route` has admitted it: the engine (ready,
    the model the one asked for) and the server's lifecycle."""

    request: Request
    engine: ServingEngine
    lifecycle: Lifecycle

    @property
    def model_name(self) -> str:
        """The name answers carry (``served_model_name``, whichever alias was asked for)."""
        return self.lifecycle.served_model_name

    @property
    def auto_truncate(self) -> bool:
        """The server's default for a request that leaves truncation unset."""
        return self.lifecycle.settings.auto_truncate

    async def run(self, work: Awaitable[T]) -> T:
        """``work`` (an engine call), cancelled if the client disconnects first."""
        return await cancel_on_disconnect(self.request, work)

    async def run_bounded(
        self,
        call: Callable[[int], Awaitable[T]],
        *,
        width: int,
        bytes_per_value: float,
        encoding: str,
    ) -> T:
        """``call(max_output_values)`` as :meth:`run`: an engine call whose output grows with
        its inputs' tokens (per-token vectors of ``width`` numbers), bounded by the values
        ``max_response_bytes`` holds at ``bytes_per_value``. An answer past the bound, known
        once the inputs are tokenized, is refused (400) naming its size as
        :func:`check_response_size` does, as ``encoding``."""
        try:
            return await self.run(call(max_response_values(self.lifecycle, bytes_per_value)))
        except OutputTooLargeError as error:
            check_response_size(self.lifecycle, error.vectors, width, bytes_per_value, encoding)
            raise


def model_route(
    handler: Callable[[BodyT, Served], Awaitable[Response]],
) -> Callable[[BodyT, Request], Awaitable[Response]]:
    """The endpoint of a model route: ``(body, request)``, as FastAPI and the direct routes
    (``direct.py``) call every POST route, admitting the request (:func:`engine_for`: 404 for
    another model, 503 before the engine is ready) and then running ``handler(body, served)``.

    The endpoint carries the handler's name and docstring (the OpenAPI operation's) and the
    signature ``(body: <the handler's body type>, request: Request) -> Response``, so both
    callers read the body's type from it as from a plain endpoint."""
    body_type = typing.get_type_hints(handler)["body"]

    async def endpoint(body: BodyT, request: Request) -> Response:
        engine, lifecycle = engine_for(request, body.model)
        return await handler(body, Served(request, engine, lifecycle))

    functools.update_wrapper(endpoint, handler)
    endpoint.__annotations__ = {"body": body_type, "request": Request, "return": Response}
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=kind)
            for name, kind in (("body", body_type), ("request", Request))
        ],
        return_annotation=Response,
    )
    return endpoint


def check_input_count(lifecycle: Lifecycle, count: int, param: str) -> None:
    if count == 0:
        raise InvalidRequestError(f"'{param}' must not be empty.", param=param)
    limit = lifecycle.settings.max_inputs_per_request
    if count > limit:
        raise InvalidRequestError(
            f"'{param}' has {count} inputs; this server accepts at most {limit} per request.",
            param=param,
        )


def as_input_list(
    value: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
) -> list[Any]:
    """OpenAI's four input shapes -> a list of texts or token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        # The validated list itself: copying millions of ids would be loop time for nothing.
        return [value]
    return list(value)


def check_response_size(
    lifecycle: Lifecycle, vectors: int, dimensions: int, bytes_per_value: float, encoding: str
) -> None:
    """Refuse (400) a request whose answer of ``vectors`` x ``dimensions`` numbers would be
    larger than ``max_response_bytes``, before any work is done for it."""
    size = int(vectors * dimensions * bytes_per_value)
    limit = lifecycle.settings.max_response_bytes
    if size > limit:
        raise OutputTooLargeError(
            f"The response would be about {size} bytes ({vectors} vectors of {dimensions} "
            f"numbers as {encoding}), more than this server sends (max_response_bytes "
            f"{limit}); send fewer inputs, ask for fewer dimensions or a binary "
            "encoding_format.",
            param="input",
            vectors=vectors,
        )


def check_sparse_request(
    engine: ServingEngine,
    lifecycle: Lifecycle,
    vectors: int,
    max_active_dims: int | None,
    *,
    what: str,
    input_param: str,
) -> int:
    """Refuse (400), before any work, sparse output asked of a model without a sparse head,
    or a response that could exceed ``max_response_bytes``: a SPLADE vector may weight every
    vocabulary entry, so each of ``vectors`` is bounded by the vocabulary size, or by
    ``max_active_dims`` when the request caps it (bge-m3's lexical weights, one per distinct
    token, also by the input length). Returns the bytes one entry may take."""
    info = engine.info()
    lexical = "sparse" in info.outputs  # bge-m3's: one weight per distinct input token
    if info.task != "sparse" and not lexical:
        raise InvalidRequestError(
            f"{what} needs a model with task sparse, or one with a sparse output (bge-m3); "
            f"this model's task is {info.task} ({info.architecture})",
            param="model",
        )
    entries = min(info.vocab_size, max_active_dims or info.vocab_size)
    if lexical:
        entries = min(entries, info.max_input_tokens)
    # A value, its token id (at most as many digits as the vocabulary size) and separators.
    entry_bytes = JSON_FLOAT_BYTES + len(str(info.vocab_size)) + 1
    size = vectors * entries * entry_bytes
    limit = lifecycle.settings.max_response_bytes
    if size > limit:
        raise OutputTooLargeError(
            f"The response could be about {size} bytes ({vectors} sparse vectors of up to "
            f"{entries} entries each: the vocabulary has {info.vocab_size}), more than this "
            f"server sends (max_response_bytes {limit}); send fewer inputs or set "
            "max_active_dims to keep only the largest weights of each vector.",
            param="max_active_dims" if max_active_dims else input_param,
            vectors=vectors,
        )
    return entry_bytes


def require_outputs(engine: ServingEngine, outputs: Sequence[str], what: str) -> None:
    """Refuse (400) ``outputs`` of a model that does not serve them all (``info().outputs``:
    dense for an embedder; sparse and multi_vector for a bge-m3-shaped one)."""
    info = engine.info()
    missing = [o for o in outputs if o not in info.outputs]
    if missing:
        raise InvalidRequestError(
            f"{what} needs a model with {' and '.join(missing)} output; this model "
            f"({info.architecture}, task {info.task}) serves "
            f"{', '.join(info.outputs) or 'none of dense, sparse and multi_vector'} (sparse "
            "and multi_vector come from bge-m3's sparse_linear.pt and colbert_linear.pt)",
            param="model",
        )


def max_response_values(lifecycle: Lifecycle, bytes_per_value: float) -> int:
    """How many output numbers fit in ``max_response_bytes`` at ``bytes_per_value``."""
    return int(lifecycle.settings.max_response_bytes // bytes_per_value)


def pooled_dimensions(engine: ServingEngine, requested: int | None) -> int:
    """The size of each pooled vector a request gets (the engine checks the value itself)."""
    info = engine.info()
    return min(requested, info.full_dimensions) if requested else info.dimensions

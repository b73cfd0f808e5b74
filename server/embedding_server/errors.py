"""One error taxonomy for the whole server.

Every failure a client can cause or observe is one of these types. The engine raises them,
the HTTP layer maps them to status codes in a single table (``api/errors.py``) and renders the
OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}``. Anything else that
escapes is a bug: it is logged with the request id and answered with a generic 500.
"""

from __future__ import annotations


class EmbeddingServerError(Exception):
    """Base class. ``param`` names the offending request field when there is one."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None
    close_connection: bool = False
    """Answer with ``Connection: close``: the request's body may still be arriving, and the
    connection is not worth keeping (a stalled or refused upload)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(EmbeddingServerError):
    """The request is well-formed JSON but asks for something invalid (bad value, empty input)."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_value"


class InputTooLongError(InvalidRequestError):
    """An input exceeds the model's maximum length and the request refused truncation."""

    code = "context_length_exceeded"

    def __init__(
        self, message: str, *, param: str | None = None, token_count: int = 0, max_tokens: int = 0
    ) -> None:
        super().__init__(message, param=param)
        self.token_count = token_count
        self.max_tokens = max_tokens


class UnsettledInputError(InvalidRequestError):
    """An input whose truncation the widest window the server reads of it cannot decide: a
    word of thousands of characters runs across the window's edge, so the tokens to keep
    depend on text the server does not tokenize (``tokenization.py``). Shorter texts are
    tokenized whole; this one is refused rather than tokenized in full or guessed at."""

    code = "input_unsettled"


class AuthenticationError(EmbeddingServerError):
    """Missing or wrong API key."""

    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class UnsupportedMediaTypeError(InvalidRequestError):
    """A POST body that is not labelled JSON (a browser sends text/plain and form bodies
    cross-site without asking first)."""

    status_code = 415
    code = "unsupported_media_type"


class HostNotAllowedError(InvalidRequestError):
    """The ``Host`` header names a host the server does not answer for (``--allowed-hosts``):
    what a web page using DNS rebinding sends to reach a server on the visitor's machine."""

    code = "host_not_allowed"


class RequestTimeoutError(EmbeddingServerError):
    """The client did not send its whole request body within ``--body-timeout``."""

    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"
    close_connection = True


class ServerBusyError(EmbeddingServerError):
    """The process holds as many request bodies still arriving as it may
    (``--max-receiving-bytes``); ``retry_after`` seconds is the client's wait."""

    status_code = 503
    error_type = "server_error"
    code = "server_busy"
    close_connection = True

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ModelNotFoundError(EmbeddingServerError):
    """The request names a model this server does not serve."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLargeError(EmbeddingServerError):
    """The request body is larger than the configured limit."""

    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class TooManyTokensError(PayloadTooLargeError):
    """A request holds more tokens than one request may (``max_request_tokens``); it is
    refused before it is queued, whatever the queue holds."""

    code = "too_many_tokens"


class OutputTooLargeError(InvalidRequestError):
    """A request's answer would be larger than the server sends (``max_response_bytes``).

    ``vectors`` is how many vectors the output would hold, so the HTTP layer can say what
    that costs in the encoding the client asked for.
    """

    code = "response_too_large"

    def __init__(self, message: str, *, param: str | None = None, vectors: int = 0) -> None:
        super().__init__(message, param=param)
        self.vectors = vectors


class QueueFullError(EmbeddingServerError):
    """Admission control refused the request: the queue holds its token budget already.

    ``retry_after`` is the number of seconds the client should wait (``Retry-After``).
    """

    status_code = 429
    error_type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class AnswersWaitingError(QueueFullError):
    """The process holds as many answers waiting for their clients to take them as it may
    (``--max-sending-bytes``); refused before any work, ``retry_after`` seconds to wait."""

    code = "answers_waiting"


class ImagesBusyError(QueueFullError):
    """The images of the requests in flight hold what the process allows them
    (``--max-fetching-bytes``, ``--max-decoding-pixels``); refused before the request's
    images are fetched or decoded, ``retry_after`` seconds to wait."""

    code = "images_busy"


class NotReadyError(EmbeddingServerError):
    """The model is still loading or the server is shutting down."""

    status_code = 503
    error_type = "server_error"
    code = "not_ready"


class VectorsChangedError(NotReadyError):
    """The server's vectors of the golden probe set differ from those ``--golden-vectors``
    recorded (a cosine below ``--golden-min-cosine``): it is not served until a file it
    matches is given."""

    code = "vectors_changed"


class FingerprintMismatchError(EmbeddingServerError):
    """The request's ``X-Expect-Embedding-Fingerprint`` is not this server's fingerprint: its
    answer would hold vectors of another computation than the client's index. Refused before
    any work."""

    status_code = 409
    error_type = "invalid_request_error"
    code = "fingerprint_mismatch"


class EngineFailedError(NotReadyError):
    """The engine can no longer run forward passes (the accelerator hit an error that poisons
    the process, such as a device-side assert); the server is on its way out."""

    code = "engine_failed"


class UnsupportedModelError(EmbeddingServerError):
    """The model directory holds an architecture we have no packed implementation for."""

    status_code = 500
    error_type = "server_error"
    code = "unsupported_model"

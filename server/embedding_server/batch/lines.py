"""The batch file format, line by line: what an input line asks, what an output line says.

An input line is a JSON object ``{"custom_id": str, "method": "POST", "url": path, "body":
object}``. Blank lines are not requests and get no answer. Every other line gets exactly one
output line: the server's answer (``response``, with ``error`` set from the answer's error
body when its status is 4xx or 5xx), or, for a line that is not a request this server could
be sent, ``response: null`` and an ``error`` that names the field and the line.

A successful answer's ``response`` also carries the server's embedding ``fingerprint`` (its
``X-Embedding-Fingerprint`` header), so every vector in the file says what computed it.

An output line's ``id`` is ``batch_req_<line number>`` (the request id the server logs too), so
a line without a ``custom_id`` is still recognised when a run resumes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import orjson

ID_PREFIX = "batch_req_"

Key = str | int
"""What identifies a line across runs: its ``custom_id``, else its line number."""

LINE_ERROR_CODE = "invalid_batch_line"


class BatchFileError(ValueError):
    """An input or output file that cannot be run at all (not one bad line): a repeated
    ``custom_id``, an output line that is not this format."""


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One input line that is a request: where it goes and its body, as JSON bytes."""

    line: int
    custom_id: str | None
    url: str
    body: bytes

    @property
    def key(self) -> Key:
        return line_key(self.custom_id, self.line)

    @property
    def request_id(self) -> str:
        return request_id(self.line)


@dataclass(frozen=True, slots=True)
class LineRefusal:
    """One input line that is not a request this server could be sent, and why."""

    line: int
    custom_id: str | None
    message: str

    @property
    def key(self) -> Key:
        return line_key(self.custom_id, self.line)


def line_key(custom_id: str | None, line: int) -> Key:
    """A line's :data:`Key`: its ``custom_id``, else its number."""
    return custom_id if custom_id is not None else line


def request_id(line: int) -> str:
    return f"{ID_PREFIX}{line}"


def parse_line(number: int, raw: bytes, urls: Collection[str]) -> BatchRequest | LineRefusal:
    """Line ``number`` (1-based) of the input, which is not blank, as a request for one of
    ``urls``, or the reason it is not one."""
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        return LineRefusal(number, None, f"line {number} is not JSON: {error}")
    if not isinstance(item, dict):
        return LineRefusal(
            number,
            None,
            f"line {number}: a batch line is a JSON object with custom_id, method, url and "
            f"body, not {_json_type(item)}",
        )
    custom_id = item.get("custom_id")
    if custom_id is not None and not isinstance(custom_id, str):
        return LineRefusal(
            number, None, f"line {number}: custom_id must be a string, not {_json_type(custom_id)}"
        )
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        return LineRefusal(
            number,
            custom_id,
            f"line {number}: unknown field {unknown[0]!r} (a batch line has "
            "custom_id, method, url and body)",
        )
    method = item.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        return LineRefusal(number, custom_id, f"line {number}: method must be POST, not {method!r}")
    url = item.get("url")
    if not isinstance(url, str) or url not in urls:
        return LineRefusal(
            number,
            custom_id,
            f"line {number}: url {url!r} is not a route of this server; one of: "
            + ", ".join(sorted(urls)),
        )
    body = item.get("body")
    if not isinstance(body, dict):
        return LineRefusal(
            number, custom_id, f"line {number}: body must be a JSON object, not {_json_type(body)}"
        )
    return BatchRequest(number, custom_id, url, orjson.dumps(body))


def answer_line(
    request: BatchRequest,
    status: int,
    request_id: str,
    body: bytes,
    *,
    json_body: bool = True,
    fingerprint: str | None = None,
) -> bytes:
    """The output line for ``request``'s answer: ``body`` as the server sent it, spliced in
    without being decoded and encoded again (vectors stay the server's floats) when it is
    JSON (``json_body``: its content type says so), else as a string. ``fingerprint``: the
    answer's ``X-Embedding-Fingerprint``, kept as the response's ``fingerprint`` (what
    computed its vectors), where the answer had one."""
    return response_line(
        request.request_id,
        request.custom_id,
        status,
        request_id,
        body,
        json_body=json_body,
        fingerprint=fingerprint,
    )


def response_line(
    line_id: str,
    custom_id: str | None,
    status: int,
    request_id: str,
    body: bytes,
    *,
    json_body: bool = True,
    fingerprint: str | None = None,
) -> bytes:
    """An output line with the id ``line_id`` for an answer, as :func:`answer_line` says:
    also the line of each row of an EmbeddingJob's JSONL part (``job work``), which is why
    the id is given rather than made from an input line's number."""
    error = _error_of(body, status) if status >= 400 else None
    shown: object = orjson.Fragment(body) if json_body else body.decode("utf-8", "replace")
    response: dict[str, Any] = {"status_code": status, "request_id": request_id}
    if fingerprint:
        response["fingerprint"] = fingerprint
    response["body"] = shown
    return _line(line_id, custom_id, response, error)


def refusal_line(refusal: LineRefusal) -> bytes:
    """The output line for an input line that was never sent."""
    return _line(
        request_id(refusal.line),
        refusal.custom_id,
        None,
        {"code": LINE_ERROR_CODE, "message": refusal.message, "line": refusal.line},
    )


def failure_line(request: BatchRequest, code: str, message: str) -> bytes:
    """The output line for a request that got no answer at all (an unreachable server)."""
    return _line(
        request_id(request.line),
        request.custom_id,
        None,
        {"code": code, "message": message, "line": request.line},
    )


def answered_key(raw: bytes) -> Key:
    """The key of an output line written by an earlier run (:class:`BatchFileError` when the
    line is not one of ours)."""
    try:
        item = orjson.loads(raw)
        custom_id = item["custom_id"]
        if custom_id is not None:
            if not isinstance(custom_id, str):
                raise TypeError(custom_id)
            return custom_id
        line_id = item["id"]
        if not isinstance(line_id, str) or not line_id.startswith(ID_PREFIX):
            raise ValueError(line_id)
        return int(line_id.removeprefix(ID_PREFIX))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise BatchFileError(f"not a batch output line ({type(error).__name__}: {error})") from None


def custom_id_of(raw: bytes) -> str | None:
    """An input line's ``custom_id``, if it is a JSON object that has a string one."""
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    custom_id = item.get("custom_id") if isinstance(item, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _line(
    line_id: str, custom_id: str | None, response: dict[str, Any] | None, error: object
) -> bytes:
    return (
        orjson.dumps({"id": line_id, "custom_id": custom_id, "response": response, "error": error})
        + b"\n"
    )


def _error_of(body: bytes, status: int) -> dict[str, Any]:
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        return {"code": error.get("code") or str(status), "message": str(error.get("message"))}
    return {"code": str(status), "message": body[:500].decode("utf-8", errors="replace")}


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number"
    )

"""Structured logging for the server process: one line per record, JSON or text.

Log collectors in a cluster want one JSON object per line; people at a terminal want text.
Both carry the request id of the HTTP request being handled (set by the API middleware in a
context variable), so an error line can be matched with the ``X-Request-Id`` a client saw.
uvicorn's own loggers are routed through the same handler so the output is uniform.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from typing import Literal

import orjson

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "embedding_server_request_id", default=None
)
"""The id of the request being handled in this task (None outside a request)."""

LogFormat = Literal["json", "text"]

_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "request_id",
    "taskName",
}


class RequestIdFilter(logging.Filter):
    """Stamp every record with the current request id (or ``-``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "-")
        if request_id != "-":
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


_TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s [%(request_id)s] %(message)s"


def configure_logging(level: str = "info", fmt: LogFormat = "text") -> None:
    """Install one stderr handler on the root logger and route uvicorn's loggers to it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv_logger = logging.getLogger(name)
        uv_logger.handlers.clear()
        uv_logger.propagate = True

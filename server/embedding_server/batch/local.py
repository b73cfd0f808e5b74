"""``job work --local``: the engine loaded in the worker's own process, as run-batch loads it.

An EmbeddingJob with ``spec.model`` has no service to call: each worker pod loads the model
itself, for a one-off corpus on machines that serve nothing else. The worker does not get a
second code path for it. :func:`embedding_server.inprocess.local_service` starts the server's
own application in this process (``create_app`` with the engine, as ``embedding-server
run-batch`` does; no port is opened) and hands back a client that reaches it through
``httpx2.ASGITransport``. The shard is then embedded by the same
:class:`~embedding_server.batch.embedder.Embedder` as through a service, so every row gets
what the HTTP API would answer it: the same vectors, the same error object for a row the API
refuses (an empty text, one past the model's length), the model's served name, and the
engine's fingerprint from the answers' ``X-Embedding-Fingerprint``, which the part's metadata
records.

This module holds what the request plane may know of it (the errors, the service's handle,
:class:`LocalHooks`); the program's root hands the hooks to ``job work``, since this package
never imports the engine.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Protocol

import httpx2
from pydantic import ValidationError
from pydantic_settings import SettingsError

from embedding_server.settings import ServerSettings

logger = logging.getLogger(__name__)

LOCAL_BASE_URL = "http://127.0.0.1"
"""The in-process application's base URL (an address, which its host check always admits)."""
READY_POLL_S = 0.05


class EngineFailedError(Exception):
    """The model could not be loaded (the server log says why): the shard may be retried."""


class EngineRefusedError(Exception):
    """The model loaded but is not the one the job asked for (``--expect-fingerprint``, the
    golden vectors): every shard would be refused alike."""


@dataclass(frozen=True)
class LocalService:
    """The in-process server: ``client`` reaches it, ``fingerprint`` is its engine's."""

    client: httpx2.AsyncClient
    fingerprint: str
    model: str


class LocalServiceFactory(Protocol):
    """What starts the in-process server: :func:`embedding_server.inprocess.local_service`.
    The request plane (this package) must not import the engine, so ``cli`` hands it over."""

    def __call__(
        self, settings: ServerSettings, *, expect: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[LocalService]: ...


@dataclass(frozen=True)
class LocalHooks:
    """What ``job work --local`` needs from the program's root (``embedding_server.cli``),
    which may load a model: the in-process server, the settings errors as serve words them,
    and the process environment serve and run-batch set before torch loads."""

    local_service: LocalServiceFactory
    format_settings_error: Callable[[ValidationError | SettingsError], str]
    apply_process_env_defaults: Callable[[MutableMapping[str, str]], object]

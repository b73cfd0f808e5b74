"""``job work --local``: the engine loaded in the worker's own process, as run-batch loads it.

An EmbeddingJob with ``spec.model`` has no service to call: each worker pod loads the model
itself, for a one-off corpus on machines that serve nothing else. The worker does not get a
second code path for it. :func:`local_service` starts the server's own application in this
process (``create_app`` with the engine, as ``embedding-server run-batch`` does; no port is
opened) and hands back a client that reaches it through ``httpx2.ASGITransport``. The shard is
then embedded by the same :class:`~embedding_server.batch.embedder.Embedder` as through a
service, so every row gets what the HTTP API would answer it: the same vectors, the same
error object for a row the API refuses (an empty text, one past the model's length), the
model's served name, and the engine's fingerprint from the answers'
``X-Embedding-Fingerprint``, which the part's metadata records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx2

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


@contextlib.asynccontextmanager
async def local_service(
    settings: ServerSettings, *, expect: str | None = None
) -> AsyncIterator[LocalService]:
    """The server's application for ``settings``, its engine loaded and warmed in this
    process; stopped (the engine unloaded) on exit. ``expect``: the fingerprint, or a prefix
    of 8 or more of its digits, the engine must have (:class:`EngineRefusedError` if not,
    before any row is sent)."""
    from embedding_server.api.app import create_app
    from embedding_server.engine import load_engine
    from embedding_server.fingerprint import expected_prefix

    prefix = expected_prefix(expect) if expect is not None else None

    # No key in front of our own calls: the app is reached from this process only.
    app = create_app(settings.model_copy(update={"api_key": None}), connect=load_engine)
    lifecycle = app.state.lifecycle
    async with app.router.lifespan_context(app):
        while not lifecycle.is_ready():
            # A server stays up, not ready, for a refused fingerprint or changed golden
            # vectors (so that a rollout stops at that pod); a worker must end instead.
            engine, golden = lifecycle.engine, lifecycle.golden
            if lifecycle.failure is not None:
                raise EngineFailedError(f"--model {settings.model}: {lifecycle.failure}")
            refusal = lifecycle.refusal
            if refusal is None and engine is not None and golden is not None and golden.changed:
                refusal = golden.check.message(engine.info().fingerprint)
            if refusal is not None:
                raise EngineRefusedError(f"--model {settings.model}: {refusal}")
            await asyncio.sleep(READY_POLL_S)
        engine = lifecycle.engine
        fingerprint = engine.info().fingerprint if engine is not None else ""
        if prefix is not None and not fingerprint.startswith(prefix):
            raise EngineRefusedError(
                f"--model {settings.model}: the embedding fingerprint is {fingerprint!r}, "
                f"not the expected {prefix} (--expect-fingerprint): another computation"
            )
        logger.info(
            "job work: %s loaded in this process (fingerprint %s)",
            lifecycle.served_model_name,
            fingerprint,
        )
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(
            transport=transport, base_url=LOCAL_BASE_URL, timeout=None
        ) as client:
            yield LocalService(client, fingerprint, lifecycle.served_model_name)

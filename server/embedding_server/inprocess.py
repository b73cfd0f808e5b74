"""The server's application run in this process, its engine loaded here, for ``job work --local``.

A root of the program, beside ``cli``: it loads a model (``embedding_server.engine``), which
the request plane, ``embedding_server.batch`` included, never imports. ``cli`` hands
:func:`local_service` to the job worker (:class:`embedding_server.batch.local.LocalHooks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx2

from embedding_server.api.app import create_app
from embedding_server.batch.local import (
    LOCAL_BASE_URL,
    READY_POLL_S,
    EngineFailedError,
    EngineRefusedError,
    LocalService,
)
from embedding_server.engine import load_engine
from embedding_server.fingerprint import expected_prefix
from embedding_server.settings import ServerSettings

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def local_service(
    settings: ServerSettings, *, expect: str | None = None
) -> AsyncIterator[LocalService]:
    """The server's application for ``settings``, its engine loaded and warmed in this
    process; stopped (the engine unloaded) on exit. ``expect``: the fingerprint, or a prefix
    of 8 or more of its digits, the engine must have (:class:`EngineRefusedError` if not,
    before any row is sent)."""
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

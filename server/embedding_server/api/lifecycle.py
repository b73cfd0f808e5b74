"""Where the server is in its life: loading, ready, draining, failed.

Shared by the probes (``/ready``), the routes (which need a loaded engine) and the CLI
(whose signal hook starts the drain and whose exit status reports a failed load). Kept apart
from the app factory so routes can depend on it without importing the factory.
"""

from __future__ import annotations

import atexit
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from embedding_server.api.golden import GoldenVectors
from embedding_server.errors import NotReadyError, VectorsChangedError
from embedding_server.metrics import Metrics
from embedding_server.request.media.budget import ImageBudget
from embedding_server.request.serving import ServingEngine
from embedding_server.settings import DEFAULT_MODEL, ServerSettings

logger = logging.getLogger(__name__)


@dataclass
class Lifecycle:
    """Where the server is in its life, shared by the probes, the routes and the CLI."""

    settings: ServerSettings
    metrics: Metrics
    engine: ServingEngine | None = None
    draining: bool = False
    exit_code: int = 0
    on_fatal: Callable[[], None] | None = None
    failure: str | None = None
    refusal: str | None = None
    """Why the loaded model is not served (``--expect-fingerprint`` differs): the process
    stays up, not ready, so a rollout stops at this pod and the old ones keep serving."""
    golden: GoldenVectors | None = None
    """The golden vectors and their check (``api/golden.py``): readiness waits until they
    are embedded, and while they differ from ``--golden-vectors``."""
    served_model_name: str = ""
    accepted_model_names: frozenset[str] = frozenset()
    images: ImageBudget = field(init=False)
    """What the images of the requests in flight may hold (``--max-fetching-bytes``,
    ``--max-decoding-pixels``), and their decoding thread."""

    def __post_init__(self) -> None:
        self.images = ImageBudget.from_settings(self.settings)
        self.served_model_name = served_model_name(self.settings)
        self.accepted_model_names = frozenset(
            {
                self.served_model_name,
                self.settings.model,
                *_DEFAULT_ALIASES.get(self.settings.model, ()),
                *self.settings.served_model_aliases,
            }
        )

    def require_engine(self) -> ServingEngine:
        """The engine, or 503 while it is still loading (or once it has stopped)."""
        engine = self.engine
        golden = self.golden
        if engine is not None and golden is not None and golden.changed and engine.ready:
            raise VectorsChangedError(golden.check.message(engine.info().fingerprint))
        if engine is None or not engine.ready or self.refusal is not None:
            if self.refusal is not None:
                message = REFUSED
            elif self.failure is not None:
                message = "The model could not be loaded; the server log says why."
            else:
                message = "The model is still loading; retry shortly."
            raise NotReadyError(message)
        return engine

    def is_ready(self) -> bool:
        """Ready for new traffic: the engine is warmed up (``Engine.ready``, the one source of
        truth) and no drain has begun."""
        return (
            not self.draining
            and self.refusal is None
            and self.engine is not None
            and self.engine.ready
            and (self.golden is None or not self.golden.holds_ready())
        )

    def refuse(self, message: str) -> None:
        """Never become ready: the loaded model is not the one expected (``message`` says
        how it differs; logged, and the fingerprints only on ``/ready``)."""
        self.refusal = message
        logger.error("not serving: %s", message)

    def begin_drain(self, reason: str) -> None:
        if not self.draining:
            self.draining = True
            logger.info("draining (%s): /ready now answers 503, in-flight work continues", reason)

    def fail(self, message: str) -> None:
        """The server cannot serve: say why in one line and ask the process to exit 1."""
        self.failure = message
        self.exit_code = 1
        logger.error("cannot serve: %s", message)
        if self.on_fatal is not None:
            self.on_fatal()


REFUSED = (
    "The model's embedding fingerprint differs from --expect-fingerprint, so it is not "
    "served; /info and the server log say which inputs differ."
)

_heap_frozen = False


def freeze_heap() -> None:
    """Move what the process holds once it is ready (the model, torch, transformers, our
    modules: hundreds of thousands of objects) out of the garbage collector's sight.

    Without it every full collection walks all of them again with the event loop stopped, a
    few times a minute under load, which was most of the request latency's p99
    (docs/performance-log.md, "Full garbage collections").
    Collected first, so only live objects are frozen; once per process, so a process that
    builds many apps (the tests) freezes only what its first one held. Unfrozen at exit, so
    the interpreter's last collection still frees them (native extensions such as triton's
    nanobind otherwise print leak reports into the log at shutdown).
    """
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)


_DEFAULT_ALIASES = {DEFAULT_MODEL: ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2")}
"""Names clients use for the packaged default model, all accepted in ``model``."""


def served_model_name(settings: ServerSettings) -> str:
    """The name /v1/models lists: the setting, else the hub id of the packaged default, else
    the model argument's last path component (without a fake model's ``?options``)."""
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model in _DEFAULT_ALIASES:
        return _DEFAULT_ALIASES[settings.model][0]
    # "fake?delay_ms=5" serves as "fake": the options are configuration, not a name.
    model = settings.model.split("?", 1)[0]
    return model.rstrip("/").rsplit("/", 1)[-1] or model


def lifecycle_of(request: Request) -> Lifecycle:
    lifecycle: Lifecycle = request.app.state.lifecycle
    return lifecycle

"""Golden vectors at start-up and after (``GET /golden``, ``--golden-vectors``).

Once the model is loaded and before the server reports ready, :meth:`GoldenVectors.prepare`
embeds the probe set (:data:`~embedding_server.request.golden.PROBES`) through the engine's
embed task, on its scheduler, with exactly the defaults a ``/v1/embeddings`` request gets
(no ``input_type`` or prompt name, full dimensions, normalized as served; not counted in the
request metrics), and keeps the result: ``GET /golden``
serves it, and the first ready pod's answer is what an operator records.

Given ``--golden-vectors PATH`` (a saved ``/golden`` answer), the server compares its own
vectors with the file's, probe by probe, and while any cosine is below
``--golden-min-cosine`` (or the dimensions differ) it is *changed*: ``/ready`` answers 503
``vectors_changed`` naming the lowest cosine, its probe, the threshold and the fingerprint
inputs that differ, the model routes answer the same 503, and one WARNING line says it with
the same facts as fields. The process stays up: a later file it matches makes it ready.

The file may be missing at start (a first pod, whose own answer is about to be recorded):
the check is then *unchecked* and readiness is not held. The file is read again every
:data:`POLL_S` seconds and re-checked when its content changes (the kubelet replaces a
ConfigMap volume's files by swapping a symlink, so each read follows the link anew). A file
that is not a saved ``/golden`` answer leaves the check unchecked, with the reason, and a
WARNING: it holds no vectors to compare with.

A model that serves no pooled vectors (task score, classify, reward, token_classify, sparse,
ColBERT multi-vectors) has nothing to compare: *unsupported*, with the reason, and
readiness is never held for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from embedding_server.api.prompts import prompt_name_for
from embedding_server.api.protocol import EmbeddingRequest
from embedding_server.errors import EmbeddingServerError
from embedding_server.fingerprint import differing
from embedding_server.request.configuration import EngineInfo
from embedding_server.request.golden import (
    PROBE_SET,
    PROBES,
    FloatMatrix,
    GoldenFile,
    compare,
    encode_vector,
)
from embedding_server.request.serving import ServingEngine
from embedding_server.request.tasks.embed import embed

logger = logging.getLogger(__name__)

POLL_S = 2.0
"""How often ``--golden-vectors`` is read again (a ConfigMap update reaches a pod's volume
within the kubelet's sync period, a minute or so; a read of a few kB every 2 s costs nothing)."""

GoldenState = Literal["unchecked", "passed", "changed", "unsupported"]


@dataclass(frozen=True)
class GoldenCheck:
    """Where the comparison with ``--golden-vectors`` stands (``/golden``'s ``check``)."""

    state: GoldenState
    min_cosine: float | None = None
    """The lowest cosine over the probes (None: not compared, or the dimensions differ)."""
    probe: int | None = None
    """The index, in the file's probes, of the one with the lowest cosine."""
    expected_fingerprint: str | None = None
    """The fingerprint the file's vectors were recorded with."""
    differs: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """The fingerprint inputs that differ: (the file's, this server's), by input name."""
    source: str | None = None
    """The file compared with (``--golden-vectors``)."""
    reason: str | None = None
    """Why it is changed, unchecked or unsupported, in one line."""

    def to_dict(self) -> dict[str, Any]:
        cosine = self.min_cosine
        return {
            "state": self.state,
            "min_cosine": cosine if cosine is None or math.isfinite(cosine) else None,
            "probe": self.probe,
            "expected_fingerprint": self.expected_fingerprint,
            "differs": {name: list(pair) for name, pair in self.differs.items()},
            "source": self.source,
            "reason": self.reason,
        }

    def differs_text(self, fingerprint: str) -> str:
        """The fingerprint inputs that differ, as ``name: expected -> actual`` parts."""
        if self.differs:
            parts = [
                f"{name}: {_json(expected)} -> {_json(actual)}"
                for name, (expected, actual) in self.differs.items()
            ]
            return "fingerprint inputs that differ (expected -> actual): " + "; ".join(parts)
        if self.expected_fingerprint == fingerprint:
            return (
                f"no fingerprint input differs (both are {fingerprint}): the same computation "
                "on other hardware, kernels or libraries"
            )
        return (
            f"fingerprint {self.expected_fingerprint or 'unknown'} -> {fingerprint} (the file "
            "gives no fingerprint_inputs to say which inputs differ)"
        )

    def message(self, fingerprint: str) -> str:
        """What ``/ready`` and the model routes say while the vectors are changed."""
        return (
            f"The model's vectors differ from the golden vectors in {self.source}: "
            f"{self.reason}; {self.differs_text(fingerprint)}. The server is not ready until "
            "a --golden-vectors file its vectors match is given."
        )


def unsupported_reason(info: EngineInfo) -> str | None:
    """Why a model has no golden vectors (None: it serves pooled embeddings)."""
    if info.task != "embed":
        return (
            f"the model's task is {info.task} ({info.architecture}): it serves no embeddings "
            "to compare"
        )
    if "dense" not in info.outputs:
        return (
            f"the model ({info.architecture}) serves no pooled vector, only "
            f"{', '.join(info.outputs) or 'other outputs'}: /v1/embeddings is refused for it"
        )
    if "text" not in info.modalities:
        return f"the model ({info.architecture}) embeds no text"
    return None


async def embed_as_served(
    engine: ServingEngine, texts: Sequence[str], *, auto_truncate: bool
) -> FloatMatrix:
    """``texts`` embedded as a ``/v1/embeddings`` request of them, with no other field,
    would be (the route's defaults: ``routes_openai.create_embeddings``), on the engine's
    scheduler, but not counted in the request metrics."""
    body = EmbeddingRequest.model_validate({"input": list(texts)})
    result = await engine.serve_unrecorded(
        embed,
        list(texts),
        dimensions=body.dimensions,
        normalize=body.normalize,
        prompt_name=prompt_name_for(engine, body.prompt_name, body.input_type),
        adapter=body.task,
        truncate=body.truncation(auto=auto_truncate),
        add_special_tokens=body.add_special_tokens,
    )
    return result.embeddings


class GoldenVectors:
    """The server's golden vectors and their check against ``--golden-vectors``."""

    def __init__(
        self,
        path: Path | None,
        min_cosine: float,
        *,
        auto_truncate: bool = False,
        poll_s: float = POLL_S,
    ) -> None:
        self.path = path
        self.min_cosine = min_cosine
        self.auto_truncate = auto_truncate
        self.poll_s = poll_s
        self.probes: tuple[str, ...] = PROBES
        self.vectors: FloatMatrix | None = None
        self.check = GoldenCheck("unchecked", source=self._source())
        self.prepared = False
        """The probe set is embedded (or known to be unsupported) and the file, if any,
        read once: until then readiness waits."""
        self._read_once = False
        self._key = ""
        """What the file held at the last read: its content's sha256, absent or unreadable."""
        self._other: tuple[tuple[str, ...], FloatMatrix] | None = None
        self._watching: asyncio.Task[None] | None = None

    def _source(self) -> str | None:
        return str(self.path) if self.path is not None else None

    def holds_ready(self) -> bool:
        """Whether readiness waits for the golden vectors: until they are prepared, and
        while they differ from the file's."""
        return not self.prepared or self.check.state == "changed"

    @property
    def changed(self) -> bool:
        return self.check.state == "changed"

    async def prepare(self, engine: ServingEngine) -> None:
        """Embed the probe set (the served model's, before it reports ready) and compare
        it with the file's, if there is one."""
        why = unsupported_reason(engine.info())
        if why is None:
            try:
                self.vectors = await embed_as_served(
                    engine, self.probes, auto_truncate=self.auto_truncate
                )
            except EmbeddingServerError as error:
                why = f"the probe set could not be embedded: {error.message}"
        if why is not None:
            self.check = GoldenCheck("unsupported", source=self._source(), reason=why)
            logger.info("golden vectors: unsupported: %s", why)
        elif self.path is not None:
            await self.refresh(engine)
        self.prepared = True

    def start_watching(self, engine: ServingEngine) -> None:
        """Read the file every :data:`POLL_S` seconds from now on, re-checking on change."""
        if self.path is None or self.vectors is None or self._watching is not None:
            return
        self._watching = asyncio.create_task(self._watch(engine), name="golden-vectors")

    async def stop(self) -> None:
        task, self._watching = self._watching, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self, engine: ServingEngine) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh(engine)

    async def refresh(self, engine: ServingEngine) -> None:
        """Read the file; when what it holds is new, compare it with this server's vectors."""
        assert self.path is not None and self.vectors is not None
        path = self.path
        content: bytes | None = None
        try:
            content = await asyncio.to_thread(path.read_bytes)
            key = hashlib.sha256(content).hexdigest()
        except FileNotFoundError:
            key = "absent"
        except OSError as error:
            key = f"unreadable: {error}"
        if self._read_once and key == self._key:
            return
        self._read_once, self._key = True, key
        self._keep(engine, await self._checked(engine, path, content, key), warn=key != "absent")

    async def _checked(
        self, engine: ServingEngine, path: Path, content: bytes | None, key: str
    ) -> GoldenCheck:
        """The check of the file ``path`` holding ``content`` (None: absent or unreadable,
        ``key`` says which)."""
        if content is None:
            if key == "absent":
                why = f"--golden-vectors {path} does not exist (yet): nothing to compare with"
            else:
                why = f"--golden-vectors {path} cannot be read ({key.removeprefix('unreadable: ')})"
            return GoldenCheck("unchecked", source=str(path), reason=why)
        try:
            golden = GoldenFile.parse(json.loads(content))
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return GoldenCheck(
                "unchecked",
                source=str(path),
                reason=f"--golden-vectors {path} is not a saved GET /golden answer: {error}",
            )
        try:
            ours = await self._vectors_for(engine, golden.probes)
        except EmbeddingServerError as error:
            return GoldenCheck(
                "unchecked",
                source=str(path),
                reason=f"the probes of --golden-vectors {path} could not be embedded: "
                f"{error.message}",
            )
        comparison = compare(golden.vectors, ours, self.min_cosine)
        inputs = golden.fingerprint_inputs
        return GoldenCheck(
            "passed" if comparison.passed else "changed",
            min_cosine=comparison.min_cosine,
            probe=comparison.probe,
            expected_fingerprint=golden.fingerprint,
            differs=differing(engine.info().fingerprint_inputs, inputs) if inputs else {},
            source=str(path),
            reason=comparison.reason,
        )

    async def _vectors_for(self, engine: ServingEngine, probes: tuple[str, ...]) -> FloatMatrix:
        """This server's vectors of ``probes``: the probe set's, or a file's other probes
        (embedded once per set of them)."""
        assert self.vectors is not None
        if probes == self.probes:
            return self.vectors
        if self._other is None or self._other[0] != probes:
            vectors = await embed_as_served(engine, probes, auto_truncate=self.auto_truncate)
            self._other = (probes, vectors)
        return self._other[1]

    def _keep(self, engine: ServingEngine, check: GoldenCheck, *, warn: bool) -> None:
        """Keep ``check`` as the file's and log what it says (once per content of the file);
        ``warn``: an unchecked file is there but holds no golden vectors."""
        self.check = check
        fingerprint = engine.info().fingerprint
        fields = {
            "golden_state": check.state,
            "golden_source": check.source,
            "golden_min_cosine": check.min_cosine,
            "golden_probe": check.probe,
            "golden_threshold": self.min_cosine,
            "expected_fingerprint": check.expected_fingerprint,
            "fingerprint": fingerprint,
            "fingerprint_differs": {name: list(pair) for name, pair in check.differs.items()},
        }
        if check.state == "changed":
            logger.warning("not serving: %s", check.message(fingerprint), extra=fields)
        elif check.state == "passed":
            logger.info(
                "golden vectors match %s: lowest cosine %.6f (probe %s), at least %g",
                check.source,
                check.min_cosine,
                check.probe,
                self.min_cosine,
                extra=fields,
            )
        elif warn:
            logger.warning("golden vectors unchecked: %s", check.reason, extra=fields)
        else:
            logger.info("golden vectors unchecked: %s", check.reason, extra=fields)

    def answer(self, info: EngineInfo, model: str) -> dict[str, Any]:
        """``GET /golden``'s answer: what an operator saves and gives later pods as
        ``--golden-vectors``."""
        vectors = self.vectors if self.vectors is not None else np.zeros((0, 0), np.float32)
        return {
            "probe_set": PROBE_SET,
            "fingerprint": info.fingerprint,
            "fingerprint_inputs": info.fingerprint_inputs,
            "model": model,
            "dimensions": int(vectors.shape[1]) if self.vectors is not None else info.dimensions,
            "probes": list(self.probes) if self.vectors is not None else [],
            "vectors": [encode_vector(row) for row in vectors],
            "check": self.check.to_dict(),
        }

    def min_cosine_metric(self) -> float | None:
        """``embedding_server_golden_min_cosine``: the lowest cosine of the last comparison
        (NaN when the dimensions differ); None (absent) when nothing was compared."""
        if self.check.state not in ("passed", "changed"):
            return None
        return self.check.min_cosine if self.check.min_cosine is not None else math.nan


def _json(value: object) -> str:
    return "absent" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)

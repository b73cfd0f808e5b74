"""A shard's texts (or images) embedded by a server's ``/v1/embeddings`` (or ``/v2/embed``),
at bulk priority.

Texts go out ``batch_size`` to a request, base64-encoded float32 back, at most
``max_in_flight`` requests at once. Images (``images=True``: http(s) or ``data:`` URLs, for a
service that takes them, such as CLIP or SigLIP) go out one to a request, in the API's
``messages`` form (``[{"role": "user", "content": [{"type": "image_url", "image_url":
{"url"}}]}]``), which embeds one input per request; ``max_in_flight`` of them at once, and
the server batches those in flight together. A 429 or 503 waits its ``Retry-After`` (bounded
backoff when there is none), a transport error or another 5xx is retried with backoff, for
up to ``retry_for`` seconds per request; past that the service counts as unreachable
(:class:`ServiceUnavailableError`) and the shard is left for another attempt.

A batch the API refuses with a 4xx is sent again one text per request, so that the refusal
lands on the rows that caused it: those rows get the API's error, the others their vectors.

Every answer's ``X-Embedding-Fingerprint`` (the hash of everything that decides a vector)
is compared with the first one's: vectors of two computations (a rollout halfway through the
shard) are never mixed in one part (:class:`MixedFingerprintsError`). A server that sends no
fingerprint counts as one computation, ``None``.

``vectors`` says which of the model's outputs the job keeps: ``dense`` (the pooled vector),
``sparse`` (a SPLADE model's, or bge-m3's lexical weights) and ``multi_vector`` (bge-m3's or
a ColBERT checkpoint's per-token vectors). ``dense`` alone goes to ``/v1/embeddings`` as
above; anything else goes to Cohere's ``/v2/embed`` with those ``embedding_types`` (dense as
``base64``, little-endian float32), which answers every requested output of a text from one
forward pass. A ColBERT checkpoint tokenizes queries and documents differently, so a
multi-vector job sends an ``input_type`` always: ``search_document`` unless told otherwise
(a job indexes documents). Before any row is sent, :meth:`Embedder.check_outputs` reads the
service's ``/info`` and refuses (:class:`NoSuchOutputError`) a job asking for an output its
model does not give, which every row would otherwise be refused for alike.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import httpx2
import numpy as np
import orjson

from embedding_server.batch.retries import (
    FIRST_BACKOFF_S,
    PRIORITY_HEADERS,
    RETRY_STATUSES,
    next_backoff,
    retry_after,
)
from embedding_server.fingerprint import EXPECT_HEADER
from embedding_server.fingerprint import HEADER as FINGERPRINT_HEADER

logger = logging.getLogger(__name__)

EMBEDDINGS_PATH = "/v1/embeddings"
COHERE_PATH = "/v2/embed"
MODELS_PATH = "/v1/models"
INFO_PATH = "/info"
PROGRESS_LOG_INTERVAL_S = 10.0
PROBE_TEXT = "dimensions"
"""Embedded for a shard none of whose rows could be, so that its empty part still says the
vector size (and its part has the schema of the others)."""


Vector = Literal["dense", "sparse", "multi_vector"]
VECTORS: tuple[Vector, ...] = get_args(Vector)
"""The outputs a job may keep, in the order a part's columns hold them."""
DENSE_ONLY: tuple[Vector, ...] = ("dense",)
MULTI_VECTOR_INPUT_TYPE = "search_document"
"""The ``input_type`` a multi-vector job sends when it is not told one: a ColBERT checkpoint
needs one (queries and documents are tokenized differently), and a job indexes documents."""
_EMBEDDING_TYPES: dict[Vector, str] = {
    "dense": "base64",
    "sparse": "sparse",
    "multi_vector": "multi_vector",
}
"""Each output as ``/v2/embed``'s ``embedding_types`` names it (dense: base64 float32)."""


class ServiceUnavailableError(Exception):
    """The service did not answer usably within the retry budget."""


class MixedFingerprintsError(Exception):
    """Two answers of one shard came from two computations, or the service no longer serves
    the computation the job is pinned to (``expect_fingerprint``: its 409)."""


class TakesNoImagesError(Exception):
    """The service's model takes no images, and the job embeds images: every row would be
    refused alike, so the job is refused instead (exit 2)."""


class NoSuchOutputError(Exception):
    """The service's model does not give an output the job asks for (sparse of a plain
    embedder, dense of a SPLADE or ColBERT model): every row would be refused alike, so the
    job is refused instead (exit 2)."""


class InputTypeRefusedError(Exception):
    """The service refused the job's ``input_type`` (a 400 naming it): every row would be
    refused alike, so the job is refused instead (exit 2)."""


@dataclass(frozen=True)
class SparseVector:
    """A sparse vector as the API answers it: token ids ascending, and their weights."""

    indices: np.ndarray
    """int32."""
    values: np.ndarray
    """float32, one per index."""


@dataclass
class Embedded:
    """A shard's answers, by position: its outputs, or the API's error for that row.

    ``vectors`` holds the dense vectors; ``sparse`` and ``multi_vectors`` the other outputs,
    each as long as ``vectors`` when the job asks for it, empty when it does not. A row is
    embedded when its requested outputs are there (:meth:`embedded`)."""

    vectors: list[np.ndarray | None]
    errors: dict[int, dict[str, Any]] = field(default_factory=dict)
    model: str | None = None
    fingerprint: str | None = None
    request_ids: list[str | None] = field(default_factory=list)
    """By position, the service's ``X-Request-ID`` of the request that embedded the row."""
    sparse: list[SparseVector | None] = field(default_factory=list)
    multi_vectors: list[np.ndarray | None] = field(default_factory=list)
    """By position, a ``[tokens, width]`` float32 matrix."""
    outputs: tuple[Vector, ...] = DENSE_ONLY
    """What each embedded row holds."""

    def embedded(self) -> list[bool]:
        """By position, whether the row was embedded (its outputs are there)."""
        columns: list[list[Any]] = []
        if "dense" in self.outputs:
            columns.append(list(self.vectors))
        if "sparse" in self.outputs:
            columns.append(list(self.sparse))
        if "multi_vector" in self.outputs:
            columns.append(list(self.multi_vectors))
        return [all(value is not None for value in row) for row in zip(*columns, strict=True)]

    def widths(self) -> tuple[int | None, int | None]:
        """The dense vectors' size and the multi-vectors' width, from the first embedded row
        that has them (None: no such row, or not asked for)."""
        dense = next((int(v.shape[0]) for v in self.vectors if v is not None), None)
        multi = next((int(m.shape[1]) for m in self.multi_vectors if m is not None), None)
        return dense, multi


@dataclass(frozen=True)
class _Answer:
    """One text's outputs in an answer (None: not asked for)."""

    dense: np.ndarray | None = None
    sparse: SparseVector | None = None
    multi_vector: np.ndarray | None = None


@dataclass
class _Progress:
    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    logged: float = field(default_factory=time.monotonic)

    def advance(self, rows: int) -> None:
        self.done += rows
        now = time.monotonic()
        if now - self.logged >= PROGRESS_LOG_INTERVAL_S:
            self.logged = now
            rate = self.done / max(now - self.started, 1e-9)
            logger.info("job: %d of %d rows embedded, %.1f rows/s", self.done, self.total, rate)


class Embedder:
    """Sends texts to one service through ``client`` (its base URL is the service's)."""

    def __init__(
        self,
        client: httpx2.AsyncClient,
        *,
        model: str | None = None,
        batch_size: int = 64,
        max_in_flight: int = 8,
        retry_for: float = 600.0,
        expect_fingerprint: str | None = None,
        api_key: str | None = None,
        images: bool = False,
        vectors: tuple[Vector, ...] = DENSE_ONLY,
        input_type: str | None = None,
    ) -> None:
        if batch_size < 1 or max_in_flight < 1:
            raise ValueError("batch_size and max_in_flight must be at least 1")
        if not vectors or len(set(vectors)) != len(vectors) or set(vectors) - set(VECTORS):
            raise ValueError(f"vectors must be distinct ones of {', '.join(VECTORS)}")
        if images and tuple(vectors) != DENSE_ONLY:
            raise ValueError("images have dense vectors only: sparse and multi_vector are texts'")
        self._client = client
        self._model = model
        self._images = images
        self._outputs = tuple(v for v in VECTORS if v in vectors)
        self._cohere = self._outputs != DENSE_ONLY
        if input_type is None and "multi_vector" in self._outputs:
            input_type = MULTI_VECTOR_INPUT_TYPE
        self._input_type = input_type
        self._path = COHERE_PATH if self._cohere else EMBEDDINGS_PATH
        self._multi_vector_width: int | None = None
        self._batch_size = batch_size
        self._slots = asyncio.Semaphore(max_in_flight)
        self._retry_for = retry_for
        self._fingerprints: list[str | None] = []
        self._model_seen: str | None = None
        self._headers = {"Content-Type": "application/json", **PRIORITY_HEADERS}
        if expect_fingerprint is not None:
            self._headers[EXPECT_HEADER] = expect_fingerprint
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    async def check_takes_images(self) -> None:
        """:class:`TakesNoImagesError` when the service's ``/v1/models`` says its model takes
        no images. One request, not retried: a service that does not answer, or does not say
        (no ``modalities``: an older server, a stub), is left to the requests to judge."""
        try:
            response = await self._client.get(MODELS_PATH, headers=self._headers)
            entries = orjson.loads(response.content)["data"] if response.status_code == 200 else []
        except (httpx2.TransportError, orjson.JSONDecodeError, KeyError, TypeError) as error:
            logger.debug("job: %s did not say what its model takes: %r", MODELS_PATH, error)
            return
        if not isinstance(entries, list):
            return
        named = [e for e in entries if isinstance(e, dict) and e.get("id") == self._model]
        entry = named[0] if named else (entries[0] if len(entries) == 1 else None)
        if not isinstance(entry, dict):
            return
        modalities = entry.get("modalities")
        if isinstance(modalities, list) and "image" not in modalities:
            raise TakesNoImagesError(
                f"{self._client.base_url}: the model {entry.get('id')!r} takes no images "
                f"(its modalities: {', '.join(map(str, modalities))}); an image field needs a "
                "service of a model that does, such as CLIP or SigLIP"
            )

    async def check_outputs(self) -> None:
        """:class:`NoSuchOutputError` when the service's ``/info`` says its model does not
        give an output the job asks for: task embed gives its ``outputs`` (``dense``; bge-m3's
        ``sparse`` and ``multi_vector`` too; a ColBERT checkpoint's ``multi_vector`` alone),
        task sparse (SPLADE) ``sparse`` alone, any other task none. One request, not retried:
        a service that does not answer, or does not say (an older server, a stub), is left to
        the requests to judge. Its ``served_model_name`` names the model of the parts when
        the answers do not (``/v2/embed``'s have no model)."""
        try:
            response = await self._client.get(INFO_PATH, headers=self._headers)
            info = orjson.loads(response.content) if response.status_code == 200 else {}
        except (httpx2.TransportError, orjson.JSONDecodeError) as error:
            logger.debug("job: %s did not say what its model gives: %r", INFO_PATH, error)
            return
        if not isinstance(info, dict):
            return
        name, task, outputs = info.get("served_model_name"), info.get("task"), info.get("outputs")
        if isinstance(name, str):
            self._model_seen = name
        if isinstance(info.get("multi_vector_dim"), int):
            self._multi_vector_width = info["multi_vector_dim"]
        if not isinstance(task, str) or not isinstance(outputs, list):
            return
        given = (
            [str(o) for o in outputs] if task == "embed" else ["sparse"] if task == "sparse" else []
        )
        missing = [v for v in self._outputs if v not in given]
        if not missing:
            return
        gives = ", ".join(given) if given else "no vectors"
        raise NoSuchOutputError(
            f"{self._client.base_url}: the model {name!r} (task {task}) gives {gives}, not "
            f"{', '.join(missing)} (its {INFO_PATH} outputs); sparse needs a SPLADE model (task "
            "sparse) or a bge-m3-shaped one, multi_vector a bge-m3-shaped or ColBERT one, and "
            "only a bge-m3-shaped model gives dense with either"
        )

    async def embed(self, texts: list[str | None], *, images: bool | None = None) -> Embedded:
        """The outputs of the texts (or images) that are not None (those stay None, with no
        error); ``images``: this call's kind of input, when not the embedder's."""
        count = len(texts)
        result = Embedded(
            vectors=[None] * count,
            request_ids=[None] * count,
            sparse=[None] * count if "sparse" in self._outputs else [],
            multi_vectors=[None] * count if "multi_vector" in self._outputs else [],
            outputs=self._outputs,
        )
        kind = self._images if images is None else images
        positions = [i for i, text in enumerate(texts) if text is not None]
        progress = _Progress(len(positions))
        size = 1 if kind else self._batch_size
        batches = [positions[start : start + size] for start in range(0, len(positions), size)]
        try:
            async with asyncio.TaskGroup() as group:
                for batch in batches:
                    group.create_task(self._embed_batch(batch, texts, result, progress, kind))
        except ExceptionGroup as failed:
            # One request's failure stops the shard (the others are cancelled with it): it
            # is what the caller sees, not the group.
            raise failed.exceptions[0] from None
        result.model = self._model or self._model_seen
        result.fingerprint = self._fingerprints[0] if self._fingerprints else None
        return result

    async def _embed_batch(
        self,
        batch: list[int],
        texts: list[str | None],
        result: Embedded,
        progress: _Progress,
        images: bool,
    ) -> None:
        inputs = [str(texts[i]) for i in batch]
        response = await self._post(inputs, images)
        if response.status_code == 200:
            request_id = response.headers.get("x-request-id")
            for position, answer in zip(batch, self._answers(response, len(batch)), strict=True):
                result.vectors[position] = answer.dense
                if answer.sparse is not None:
                    result.sparse[position] = answer.sparse
                if answer.multi_vector is not None:
                    result.multi_vectors[position] = answer.multi_vector
                result.request_ids[position] = request_id
            progress.advance(len(batch))
            return
        refusal = _api_error(response)
        if refusal.get("param") == "input_type" and self._input_type is not None:
            raise InputTypeRefusedError(
                f"{self._client.base_url}{self._path} refused input_type "
                f"{self._input_type!r}: {str(refusal.get('message', ''))[:500]}"
            )
        if len(batch) > 1:
            # Which row was refused? Ask for each alone; the others get their vectors.
            for position in batch:
                await self._embed_batch([position], texts, result, progress, images)
            return
        result.errors[batch[0]] = refusal
        progress.advance(1)

    async def _post(self, inputs: list[str], images: bool = False) -> httpx2.Response:
        """The service's answer that is not worth waiting out: a 200 or a refusal (4xx but
        429). :class:`ServiceUnavailableError` past the retry budget. ``images``: ``inputs``
        is one image URL, sent as the one image part of a user message."""
        body: dict[str, Any]
        if self._cohere:
            body = {
                "texts": inputs,
                "embedding_types": [_EMBEDDING_TYPES[v] for v in self._outputs],
            }
        elif images:
            (url,) = inputs
            part = {"type": "image_url", "image_url": {"url": url}}
            body = {"messages": [{"role": "user", "content": [part]}], "encoding_format": "base64"}
        else:
            body = {"input": inputs, "encoding_format": "base64"}
        if self._input_type is not None and not images:
            body["input_type"] = self._input_type
        if self._model is not None:
            body["model"] = self._model
        content = orjson.dumps(body)
        headers = self._headers
        deadline = time.monotonic() + self._retry_for
        backoff = FIRST_BACKOFF_S
        async with self._slots:
            while True:
                wait: float | None
                try:
                    response = await self._client.post(self._path, content=content, headers=headers)
                except httpx2.TransportError as error:
                    problem, wait = f"no answer ({error!r})", None
                else:
                    status = response.status_code
                    if status == 409 and EXPECT_HEADER in headers:
                        # Not a row's fault: the service moved on from the pinned computation.
                        raise MixedFingerprintsError(
                            f"{self._client.base_url}{self._path} no longer serves "
                            f"fingerprint {headers[EXPECT_HEADER]}: "
                            f"{_api_error(response).get('message', '')[:300]}"
                        )
                    if status < 500 and status not in RETRY_STATUSES:
                        return response
                    problem = f"answered {status}: {response.text[:200]}"
                    wait = retry_after(response) if status in RETRY_STATUSES else None
                wait = wait or backoff
                backoff = next_backoff(backoff)
                if time.monotonic() + wait > deadline:
                    raise ServiceUnavailableError(
                        f"{self._client.base_url}{self._path}: {problem}; still so after "
                        f"{self._retry_for:.0f} s"
                    )
                logger.debug("job: service %s; again in %.1f s", problem, wait)
                await asyncio.sleep(wait)

    def _answers(self, response: httpx2.Response, count: int) -> list[_Answer]:
        fingerprint = response.headers.get(FINGERPRINT_HEADER)
        if not self._fingerprints:
            self._fingerprints.append(fingerprint)
        elif fingerprint != self._fingerprints[0]:
            raise MixedFingerprintsError(
                f"the service answered with fingerprint {fingerprint!r} after "
                f"{self._fingerprints[0]!r}: two computations in one shard, which is not "
                "committed (is a rollout under way?)"
            )
        try:
            body = orjson.loads(response.content)
            answers = self._cohere_answers(body) if self._cohere else _openai_answers(body)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ServiceUnavailableError(
                f"{self._path} answered 200 with a body that is not embeddings: {error!r}"
            ) from None
        if len(answers) != count:
            raise ServiceUnavailableError(
                f"{self._path} answered {len(answers)} embeddings for {count} inputs"
            )
        if isinstance(body.get("model"), str):
            self._model_seen = body["model"]
        return answers

    def _cohere_answers(self, body: dict[str, Any]) -> list[_Answer]:
        """``/v2/embed``'s ``embeddings_by_type``, each requested type a list by text."""
        embeddings = body["embeddings"]
        columns: dict[Vector, list[Any]] = {}
        if "dense" in self._outputs:
            columns["dense"] = [
                np.frombuffer(base64.b64decode(item), dtype="<f4") for item in embeddings["base64"]
            ]
        if "sparse" in self._outputs:
            columns["sparse"] = [
                SparseVector(
                    np.asarray(item["indices"], dtype=np.int32),
                    np.asarray(item["values"], dtype=np.float32),
                )
                for item in embeddings["sparse"]
            ]
        if "multi_vector" in self._outputs:
            columns["multi_vector"] = [self._matrix(item) for item in embeddings["multi_vector"]]
        lengths = {len(column) for column in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"embedding types of different lengths: {sorted(lengths)}")
        (length,) = lengths
        return [
            _Answer(**{name: column[i] for name, column in columns.items()}) for i in range(length)
        ]

    def _matrix(self, rows: list[list[float]]) -> np.ndarray:
        """A text's multi-vectors as a ``[tokens, width]`` float32 matrix (no tokens: zero
        rows of the width ``/info`` said, else of the first one seen)."""
        if rows:
            matrix = np.asarray(rows, dtype=np.float32)
            if matrix.ndim != 2:
                raise ValueError(f"a multi-vector of shape {matrix.shape}")
            self._multi_vector_width = self._multi_vector_width or int(matrix.shape[1])
            return matrix
        return np.zeros((0, self._multi_vector_width or 0), dtype=np.float32)


def _openai_answers(body: dict[str, Any]) -> list[_Answer]:
    """``/v1/embeddings``' data, in input order, each a base64 float32 vector."""
    data = sorted(body["data"], key=lambda item: item["index"])
    return [
        _Answer(dense=np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4"))
        for item in data
    ]


def _api_error(response: httpx2.Response) -> dict[str, Any]:
    """The API's error object (OpenAI's shape), with the status."""
    try:
        body = orjson.loads(response.content)
        error = (
            body["error"]
            if isinstance(body, dict) and isinstance(body.get("error"), dict)
            else None
        )
    except orjson.JSONDecodeError:
        error = None
    if error is None:
        error = {"message": response.text[:1000]}
    return {"status": response.status_code, **error}

"""Evaluate a served model with mteb: its encoder and cross-encoder protocols over either an
offline :class:`~embedding_server.engine.Engine` or a running server's URL.

mteb is not a server dependency: nothing in the server imports this module, which needs
``pip install 'mteb>=2'`` (and ``httpx`` for a URL). ::

    import mteb
    from embedding_server.evaluation import MtebEncoder

    model = MtebEncoder(Engine.from_pretrained())             # or MtebEncoder("http://host:8000")
    results = mteb.evaluate(model, mteb.get_tasks(tasks=["STSBenchmark"]))

``MtebEncoder`` embeds (``Engine.embed`` or ``/v1/embeddings``), choosing the model's own
sentence-transformers prompt for mteb's task and prompt type (query or document) the way
mteb's SentenceTransformer wrapper does; ``MtebCrossEncoder`` scores query-document pairs
(``Engine.score`` or ``/score``) of a cross-encoder; ``MtebMultiVectorEncoder`` gives a
multi-vector model's (bge-m3's) per-token vectors for mteb's MaxSim. Inputs longer than the
model's maximum are truncated, as sentence-transformers does, rather than refused. Sparse
output (SPLADE, bge-m3's lexical weights) has no wrapper here yet: mteb's sparse support
wraps a sentence-transformers ``SparseEncoder`` object itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import numpy as np
import numpy.typing as npt
from mteb.models import ModelMeta
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ScoringFunction
from mteb.types import PromptType

if TYPE_CHECKING:
    import httpx
    from mteb.abstasks.task_metadata import TaskMetadata
    from mteb.types import Array, BatchedInput
    from torch.utils.data import DataLoader

    from embedding_server.engine import Engine

__all__ = ["MtebCrossEncoder", "MtebEncoder", "MtebMultiVectorEncoder"]

FloatArray = npt.NDArray[np.float32]


class _Backend(Protocol):
    """Where the wrappers' texts go: the offline Engine or a server's HTTP API."""

    info: dict[str, Any]
    """The model's configuration (``Engine.info()``, or the server's ``/info``)."""

    def embed(self, texts: list[str], prompt_name: str | None) -> FloatArray: ...

    def score(self, a: list[str], b: list[str]) -> FloatArray: ...

    def embed_tokens(
        self, texts: list[str], prompt_name: str | None, side: str | None = None
    ) -> list[FloatArray]: ...


class _EngineBackend:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.info = engine.info().to_dict()

    def embed(self, texts: list[str], prompt_name: str | None) -> FloatArray:
        return self._engine.embed(texts, prompt_name=prompt_name, truncate=True)

    def score(self, a: list[str], b: list[str]) -> FloatArray:
        return self._engine.score(a, b, truncate=True)

    def embed_tokens(
        self, texts: list[str], prompt_name: str | None, side: str | None = None
    ) -> list[FloatArray]:
        if side is not None:  # a ColBERT model: its texts' side, no prompt
            return self._engine.embed_tokens(texts, input_type=side, truncate=True)
        return self._engine.embed_tokens(texts, prompt_name=prompt_name, truncate=True)


class _HttpBackend:
    """The server's ``/info``, ``/v1/embeddings`` and ``/score``, in requests of at most the
    server's ``max_inputs_per_request`` inputs."""

    def __init__(self, url: str, *, timeout: float, client: httpx.Client | None) -> None:
        import httpx

        self._client = client or httpx.Client(base_url=url.rstrip("/"), timeout=timeout)
        self.info = self._call("GET", "/info")
        self._model = str(self.info["served_model_name"])
        self._chunk = max(1, int(self.info.get("max_inputs_per_request") or 256))

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self._client.request(method, path, json=body)
        if response.is_error:
            raise RuntimeError(
                f"{method} {path} answered {response.status_code}: {response.text[:500]}"
            )
        return response.json()

    def _chunks(self, texts: list[str]) -> Iterable[tuple[int, list[str]]]:
        for start in range(0, len(texts), self._chunk):
            yield start, texts[start : start + self._chunk]

    def embed(self, texts: list[str], prompt_name: str | None) -> FloatArray:
        rows: list[list[float]] = []
        for _, chunk in self._chunks(texts):
            body = {
                "model": self._model,
                "input": chunk,
                "prompt_name": prompt_name,
                "truncate_prompt_tokens": -1,
            }
            data = self._call("POST", "/v1/embeddings", body)["data"]
            rows.extend(item["embedding"] for item in sorted(data, key=lambda d: d["index"]))
        return np.asarray(rows, dtype=np.float32)

    def score(self, a: list[str], b: list[str]) -> FloatArray:
        scores: list[float] = []
        for start, chunk in self._chunks(a):
            body = {
                "model": self._model,
                "text_1": chunk,
                "text_2": b[start : start + len(chunk)],
                "truncate_prompt_tokens": -1,
            }
            data = self._call("POST", "/score", body)["data"]
            scores.extend(item["score"] for item in sorted(data, key=lambda d: d["index"]))
        return np.asarray(scores, dtype=np.float32)

    def embed_tokens(
        self, texts: list[str], prompt_name: str | None, side: str | None = None
    ) -> list[FloatArray]:
        out: list[FloatArray] = []
        if side is not None:  # a ColBERT model: Cohere's /v2/embed takes the side
            for _, chunk in self._chunks(texts):
                request: dict[str, Any] = {
                    "model": self._model,
                    "texts": chunk,
                    "input_type": f"search_{side}",
                    "embedding_types": ["multi_vector"],
                }
                answer = self._call("POST", "/v2/embed", request)
                vectors = answer["embeddings"]["multi_vector"]
                out.extend(np.asarray(v, dtype=np.float32) for v in vectors)
            return out
        for _, chunk in self._chunks(texts):
            body = {
                "model": self._model,
                "input": chunk,
                "task": "token_embed",
                "prompt_name": prompt_name,
                "truncate_prompt_tokens": -1,
            }
            data = self._call("POST", "/pooling", body)["data"]
            out.extend(
                np.asarray(item["data"], dtype=np.float32)
                for item in sorted(data, key=lambda d: d["index"])
            )
        return out


def _backend(model: Engine | str, timeout: float, client: httpx.Client | None) -> _Backend:
    if isinstance(model, str):
        return _HttpBackend(model, timeout=timeout, client=client)
    return _EngineBackend(model)


def _meta(
    info: dict[str, Any], name: str | None, revision: str | None, similarity: ScoringFunction
) -> ModelMeta:
    return ModelMeta.create_empty(
        overwrites={
            "name": name or str(info.get("served_model_name") or info["model"]),
            "revision": revision,
            "embed_dim": info.get("dimensions"),
            "max_tokens": info.get("max_input_tokens"),
            "similarity_fn_name": similarity,
            "framework": ["API"],
        }
    )


def _texts(inputs: DataLoader[BatchedInput]) -> list[str]:
    return [text for batch in inputs for text in batch["text"]]


class _Served:
    """What both wrappers share: the backend, the check that the model serves the task the
    wrapper needs, and mteb's ModelMeta.

    ``model``: an :class:`Engine`, or a server's base URL (``http://host:8000``).
    ``name`` / ``revision`` label mteb's results (default: the served model's name).
    ``similarity``: how mteb compares two embeddings (sentence-transformers' default, cosine).
    ``timeout`` (seconds) and ``client`` apply to a URL.
    """

    _task: ClassVar[str]
    mteb_model_meta: ModelMeta | None = None

    def __init__(
        self,
        model: Engine | str,
        *,
        name: str | None = None,
        revision: str | None = None,
        similarity: ScoringFunction | str = ScoringFunction.COSINE,
        timeout: float = 600.0,
        client: httpx.Client | None = None,
    ) -> None:
        self._backend = _backend(model, timeout, client)
        info = self._backend.info
        if info.get("task") != self._task:
            raise ValueError(
                f"{type(self).__name__} needs a model served with task {self._task}; "
                f"this model's task is {info.get('task')}"
            )
        self.mteb_model_meta = _meta(info, name, revision, ScoringFunction(similarity))


class MtebEncoder(_Served, AbsEncoder):
    """mteb's encoder protocol (``encode``, ``similarity``) over an Engine or a server URL
    serving an embedding model (task embed); arguments as :class:`_Served`."""

    _task = "embed"

    def __init__(self, model: Engine | str, **options: Any) -> None:
        super().__init__(model, **options)
        # The model's prompts whose names mteb understands (a task, task type or prompt
        # type), as mteb's SentenceTransformer wrapper keeps them.
        prompts: dict[str, str] = dict(self._backend.info.get("prompts") or {})
        valid = self.validate_task_to_prompt_name(prompts, raise_for_invalid_keys=False)
        self.model_prompts = valid[0] if isinstance(valid, tuple) else valid

    def encode(
        self,
        inputs: DataLoader[BatchedInput],
        *,
        task_metadata: TaskMetadata,
        hf_split: str,
        hf_subset: str,
        prompt_type: PromptType | None = None,
        **kwargs: Any,
    ) -> Array:
        """Embeddings ``[n, d]`` of every text of ``inputs``, with the model's prompt for
        this task and prompt type (the one mteb's SentenceTransformer wrapper picks)."""
        prompt_name = self.get_prompt_name(task_metadata, prompt_type)
        return self._backend.embed(_texts(inputs), prompt_name)


class MtebMultiVectorEncoder(MtebEncoder):
    """mteb's encoder protocol with MaxSim (``ScoringFunction.MAX_SIM``, mteb's ColBERT
    models' protocol) over a model with multi-vector outputs (bge-m3's ColBERT head):
    ``encode`` gives each text's normalized per-token vectors (``Engine.embed_tokens`` or
    ``/pooling`` task token_embed), which mteb's ``max_sim`` compares. Arguments as
    :class:`_Served`, whose ``similarity`` is MaxSim here."""

    def __init__(self, model: Engine | str, **options: Any) -> None:
        options.setdefault("similarity", ScoringFunction.MAX_SIM)
        super().__init__(model, **options)
        if "multi_vector" not in (self._backend.info.get("outputs") or []):
            raise ValueError(
                "MtebMultiVectorEncoder needs a model with multi-vector outputs (bge-m3's "
                f"colbert_linear.pt); this model serves {self._backend.info.get('outputs')}"
            )

    def encode(
        self,
        inputs: DataLoader[BatchedInput],
        *,
        task_metadata: TaskMetadata,
        hf_split: str,
        hf_subset: str,
        prompt_type: PromptType | None = None,
        **kwargs: Any,
    ) -> Array:
        """Each text's multi-vectors (``[tokens - 1, width]``), as mteb's ragged MaxSim
        input, with the prompt :class:`MtebEncoder` would choose; a ColBERT checkpoint's
        (``outputs`` multi_vector alone) as queries or documents by ``prompt_type``."""
        if self._backend.info.get("outputs") == ["multi_vector"]:
            side = "query" if prompt_type == PromptType.query else "document"
            vectors: Any = self._backend.embed_tokens(_texts(inputs), None, side)
            return cast("Array", vectors)
        prompt_name = self.get_prompt_name(task_metadata, prompt_type)
        vectors = self._backend.embed_tokens(_texts(inputs), prompt_name)
        return cast("Array", vectors)


class MtebCrossEncoder(_Served):
    """mteb's cross-encoder protocol (``predict``) over an Engine or a server URL serving a
    cross-encoder (task score): relevance of each (query, document) pair, after the model's
    activation, as sentence-transformers' ``CrossEncoder.predict`` returns it; arguments as
    :class:`_Served`."""

    _task = "score"

    def predict(
        self,
        inputs1: DataLoader[BatchedInput],
        inputs2: DataLoader[BatchedInput],
        *,
        task_metadata: TaskMetadata,
        hf_split: str,
        hf_subset: str,
        prompt_type: PromptType | None = None,
        **kwargs: Any,
    ) -> Array:
        """Scores ``[n]`` of the pairs (``inputs1[i]``, ``inputs2[i]``)."""
        queries, documents = _texts(inputs1), _texts(inputs2)
        if len(queries) != len(documents):
            raise ValueError(
                f"predict needs as many queries as documents; got {len(queries)} and "
                f"{len(documents)}"
            )
        return self._backend.score(queries, documents)

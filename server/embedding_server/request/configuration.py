"""An engine's configuration, as decided once at load: what every process serving it needs.

:class:`EngineConfig` holds the decisions the request plane acts on (input length, batch and
queue budgets, pooling, the per-request head, prompts, the task and its classifier's labels),
and :class:`EngineInfo` what ``/info`` and the start-up log line report. Neither holds a
tensor, so the engine process hands both to ``--api-workers`` front-ends as they are.

They are decided in the device plane (``device/configuration.py``), from the settings and
what the loaded model declares; the weights of the heads stay there too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from embedding_server.request.colbert import ColbertFormat
from embedding_server.request.heads import Classifier, Task
from embedding_server.request.hybrid import HybridHeads
from embedding_server.request.listwise import ListwiseFormat
from embedding_server.request.pooling import PoolingHead, PoolingMethod
from embedding_server.request.prompts import Prompts
from embedding_server.request.special_tokens import SpecialTokens


@dataclass(frozen=True)
class EngineConfig:
    """The decisions an engine is built from."""

    max_input_tokens: int
    max_batch_tokens: int
    max_batch_size: int
    max_queue_tokens: int
    max_request_tokens: int
    pooling: PoolingMethod
    include_prompt: bool
    """Whether prompt tokens take part in pooling (sentence-transformers' include_prompt)."""
    head: PoolingHead
    """The per-request part of the pooling head (Matryoshka truncation, normalization)."""
    prompts: Prompts
    cpu_threads: int
    tensor_parallel_size: int
    bulk_batch_seconds: float | None = None
    """The longest a batch holding bulk items may run (``--bulk-batch-ms``); None: no cap."""
    task: Task = "embed"
    classifier: Classifier | None = None
    """What the classification head means (task score, classify, token_classify or
    reward); its weights are on the device."""
    hybrid: HybridHeads | None = None
    """bge-m3's sparse and multi-vector heads (task embed), where the model has them: its
    token outputs are then their rows (``hybrid.py``), and /score is MaxSim."""
    colbert: ColbertFormat | None = None
    """A ColBERT checkpoint's tokenization per side (task embed): its outputs are
    multi-vectors only, each request says whether its texts are queries or documents, and
    /score is ColBERT's MaxSim (``colbert.py``)."""
    listwise: ListwiseFormat | None = None
    """A listwise reranker's prompt (task score, jina-reranker-v3): /score and /rerank put a
    query and its documents in one prompt and score them at its markers (``listwise.py``)."""


@dataclass(frozen=True)
class EngineInfo:
    """The resolved configuration: logged once at load and served by /info."""

    model: str
    model_path: str | None
    architecture: str
    model_type: str
    task: Task
    """embed, score (a cross-encoder) or classify; decided at load from the checkpoint."""
    labels: list[str] | None
    """The classifier's labels in order (task score or classify), else None."""
    score_activation: str | None
    """The activation over a cross-encoder's logit in /score and /rerank (task score)."""
    hidden_size: int
    dimensions: int
    """Default output dimensions (after Dense layers and any configured truncation)."""
    max_input_tokens: int
    pooling: PoolingMethod
    normalize: bool
    dtype: str
    device: str
    attention: str
    """The attention kernel (flash_attn, torch_varlen, sdpa_padded or sdpa_bucketed); on the
    transformers backend, the attention transformers' model class runs (sdpa or eager)."""
    attention_passed_over: list[str]
    """Why each faster attention kernel was not used (empty when none was passed over)."""
    sliding_window: int | None
    """Attention window (tokens, transformers' ``sliding_window``) of the layers that slide;
    None when every layer sees the whole input."""
    prompts: dict[str, str]
    default_prompt_name: str | None
    adapters: list[str]
    """The task LoRA adapters a request may choose (jina-embeddings-v3); empty for none."""
    matryoshka: bool
    matryoshka_dimensions: list[int] | None
    """Allowed truncation sizes; None with ``matryoshka`` true means any size up to full."""
    full_dimensions: int
    vocab_size: int
    cpu_threads: int
    """torch intra-op threads for CPU forward passes (per rank)."""
    tensor_parallel_size: int
    """Ranks the model is split over (``--tensor-parallel-size``)."""
    max_batch_tokens: int
    max_batch_size: int
    max_queue_tokens: int
    max_request_tokens: int
    backend: str = "native"
    """What runs the model: native (our packed implementation of its family), transformers
    (transformers' own model class, ``--backend``) or fake."""
    prefix_cache_bytes: int = 0
    """The prompt-prefix cache's byte budget (``--prefix-cache-bytes``); 0: off. Its use is
    in ``/metrics`` (``embedding_server_prefix_cache_*``)."""
    quantization: str = "none"
    """How the body's weights are held (``--quantization``): none, or int8 (per-channel int8
    linear weights in the transformer blocks, activations quantized per token, CPU)."""
    outputs: list[str] = field(default_factory=list)
    """What task embed serves: ``dense``, and ``sparse`` and ``multi_vector`` for a
    bge-m3-shaped model (its ``sparse_linear.pt`` and ``colbert_linear.pt`` were found);
    empty for the other tasks."""
    multi_vector_dim: int | None = None
    """Width of one multi-vector (ColBERT) vector, where the model has them."""
    score_method: str | None = None
    """How /score and /rerank score a pair: cross_encoder (task score), listwise (a query
    and its documents in one prompt, jina-reranker-v3), cosine (dense embeddings) or maxsim
    (late interaction over multi-vectors); None: not served."""

    modalities: list[str] = field(default_factory=lambda: ["text"])
    """What the model embeds: ``text``, and ``image`` for a model with a vision tower
    (CLIP, SigLIP); an image sent to a text-only model is refused with 400."""
    image_tokens: int | None = None
    """The vision tower's sequence length for one image (what an image costs in admission
    and batching), where the model takes images."""
    special_tokens: SpecialTokens = field(default_factory=SpecialTokens)
    """The special tokens around one text input and where they come from: tokenizer.json,
    tokenizer_config.json's switches, or the checkpoint's own tokenizer code
    (``special_tokens.py``)."""

    fingerprint: str = ""
    """The embedding fingerprint (``embedding_server.fingerprint``): 16 hex digits of the
    sha256 of :attr:`fingerprint_inputs`; empty where it is not known (``inspect`` of a Hub
    model, whose weights it does not download)."""
    fingerprint_inputs: dict[str, Any] = field(default_factory=dict)
    """What the fingerprint hashes: the model files' sha256 and the decisions that change a
    vector (``embedding_server.device.fingerprint``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

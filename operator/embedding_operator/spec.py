"""The EmbeddingService spec as typed, validated Python values.

The CRD schema (``crds/embeddingservices.yaml``) is the API's single source of truth and the
API server enforces it before the operator sees an object. This model mirrors it field for
field, with the same defaults, for two reasons: builders get typed values instead of digging in
dicts, and the few rules a schema cannot state (rollout that can never progress) still fail
with a field path. ``tests/operator/test_crd_schema.py`` fails when the two drift apart.

Parsing never talks to the cluster: what only the cluster knows (does the GPU profile exist)
is checked during reconciliation, and a missing Secret is reported from the pods' status
(the operator never reads Secrets).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from embedding_operator.profiles import BUILTIN_PROFILES

Pooling = Literal["auto", "cls", "mean", "last", "max", "weightedmean", "mean_sqrt_len"]
Task = Literal["embed", "score", "classify", "token_classify", "reward", "sparse"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
ModelBackend = Literal["auto", "native", "transformers"]
Quantization = Literal["none", "int8"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
ScalingMetric = Literal["backlogSeconds", "queueRequests", "queueTokens"]
Autoscaler = Literal["hpa", "keda"]
QUEUE_METRICS = ("queueRequests", "queueTokens")
CacheMode = Literal["none", "pvc", "existing"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]
AccessMode = Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]
IntOrString = int | str

HF_PREFIX = "hf://"
SERVER_QUEUE_TOKENS = 262144
"""The bundled server's default ``--max-queue-tokens`` (the CRD's rules assume it too; a
contract test keeps them equal)."""


def _read_write_once() -> list[AccessMode]:
    return ["ReadWriteOnce"]


def _is_zero(value: IntOrString) -> bool:
    return value == 0 or (isinstance(value, str) and value.strip() in {"0", "0%"})


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are an error."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        protected_namespaces=(),
    )


class SecretKeyRef(_Model):
    name: str = Field(min_length=1)
    key: str = Field(min_length=1)


class HubTokenSecretRef(SecretKeyRef):
    key: str = Field(default="token", min_length=1)


class ApiKeySecretRef(SecretKeyRef):
    key: str = Field(default="api-key", min_length=1)


class ModelSource(_Model):
    name: str = Field(min_length=1, max_length=512)
    revision: str | None = None
    trust_remote_code: bool = False
    hub_token_secret_ref: HubTokenSecretRef | None = None

    @property
    def server_model(self) -> str:
        """What ``embedding-server --model`` takes: a hub id or a local path."""
        return self.name.removeprefix(HF_PREFIX)


class Prompts(_Model):
    default_name: str | None = None


class Embedding(_Model):
    pooling: Pooling = "auto"
    normalize: bool | None = None
    dimensions: int | None = Field(default=None, ge=1, le=65536)
    matryoshka_dimensions: list[int] | None = None
    max_input_tokens: int | None = Field(default=None, ge=1, le=1048576)
    auto_truncate: bool = False
    prompts: Prompts | None = None

    @model_validator(mode="after")
    def _dimensions_supported(self) -> Embedding:
        if (
            self.dimensions is not None
            and self.matryoshka_dimensions is not None
            and self.dimensions not in self.matryoshka_dimensions
        ):
            raise ValueError("dimensions must be one of matryoshkaDimensions")
        return self


CODE_LOADING_ENV_PREFIXES = ("LD_", "PYTHON")
CODE_LOADING_ENV = (
    "GCONV_PATH",
    "OPENSSL_CONF",
    "OPENSSL_ENGINES",
    "OPENSSL_MODULES",
    "CUDA_INJECTION64_PATH",
    "NCCL_NET_PLUGIN",
    "NCCL_TUNER_PLUGIN",
    "NCCL_PROFILER_PLUGIN",
    "HF_MODULES_CACHE",
    "BASH_ENV",
)
"""``server.env`` names no policy allows: each makes the dynamic loader, the interpreter or a
library load code from a path (``LD_PRELOAD``, ``PYTHONPATH``, ``PYTHONSTARTUP``, an OpenSSL
engine, a CUDA injection library, an NCCL plugin, where transformers imports remote code
from), so with a file planted on a volume they run code in the server. The CRD's CEL rule on
``server.env[]`` states the same list; ``test_crd_schema.py`` keeps the two equal."""


def code_loading_env(name: str) -> bool:
    """Whether ``name`` is one of :data:`CODE_LOADING_ENV` (or starts with a prefix of it)."""
    return name.startswith(CODE_LOADING_ENV_PREFIXES) or name in CODE_LOADING_ENV


class EnvVar(_Model):
    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def _loads_no_code(cls, name: str) -> str:
        if code_loading_env(name):
            raise ValueError(
                f"{name} makes the server load code from a path and is never allowed "
                "(LD_*, PYTHON*, and the plugin and module paths the CRD lists)"
            )
        return name


BUILTIN_GPU_TYPES = tuple(name for name, p in BUILTIN_PROFILES.items() if p.resource_name)
"""The built-in profiles that request an accelerator: the CRD's CEL rule refuses int8 on these
by name (it cannot read the operator's profile file; ``plan`` refuses the others)."""
INT8_REFUSED_DTYPES = ("bfloat16", "float16")
INT8_DTYPE_MESSAGE = (
    "quantization int8 computes in float32 (int8 weights, activations quantized per token); "
    "dtype must be auto or float32"
)
INT8_BACKEND_MESSAGE = (
    "quantization int8 quantizes the native backend's layers; backend transformers is not "
    "served quantized"
)
INT8_PARALLEL_MESSAGE = (
    "server.quantization int8 is not served with tensor parallelism; "
    "parallelism.tensorParallelSize must be 1"
)
INT8_GPU_MESSAGE = (
    "server.quantization int8 runs on the CPU only (torch's int8 kernels); gpu.type must be "
    "cpu or another profile without an accelerator"
)


PREFIX_CACHE_BACKEND_MESSAGE = (
    "prefixCache caches the native backend's decoder states; backend transformers runs the "
    "model's own forward pass, which takes no cached prefix"
)


class Server(_Model):
    image: str | None = None
    image_pull_policy: PullPolicy | None = None
    dtype: Dtype = "auto"
    backend: ModelBackend = "auto"
    quantization: Quantization = "none"
    max_batch_tokens: int | None = Field(default=None, ge=1)
    max_batch_size: int | None = Field(default=None, ge=1)
    max_queue_tokens: int | None = Field(default=None, ge=1)
    max_request_tokens: int | None = Field(default=None, ge=1)
    bulk_batch_ms: int | None = Field(default=None, ge=0, le=60000)
    prefix_cache: IntOrString | None = None
    api_workers: int | None = Field(default=None, ge=1, le=32)
    shm_size: IntOrString | None = None
    startup_timeout_seconds: int = Field(default=1800, ge=30, le=86400)
    extra_args: list[str] = Field(default_factory=list)
    env: list[EnvVar] = Field(default_factory=list)

    @model_validator(mode="after")
    def _int8_runs_what_it_can(self) -> Server:
        # As the CRD's CEL rules on spec.server, with their words: the server refuses the same
        # at start (a crash-looping pod), so neither gets that far.
        if self.quantization != "int8":
            return self
        if self.dtype in INT8_REFUSED_DTYPES:
            raise ValueError(INT8_DTYPE_MESSAGE)
        if self.backend == "transformers":
            raise ValueError(INT8_BACKEND_MESSAGE)
        return self

    @field_validator("prefix_cache")
    @classmethod
    def _prefix_cache_is_bytes(cls, value: IntOrString | None) -> IntOrString | None:
        if value is not None:
            quantity_bytes(value)
        return value

    @property
    def prefix_cache_bytes(self) -> int | None:
        """``prefixCache`` in bytes, as the server's ``--prefix-cache-bytes`` takes it."""
        return None if self.prefix_cache is None else quantity_bytes(self.prefix_cache)

    @model_validator(mode="after")
    def _prefix_cache_on_the_native_backend(self) -> Server:
        # As the CRD's CEL rule on spec.server: the server refuses the same at start.
        if self.prefix_cache is not None and self.backend == "transformers":
            raise ValueError(PREFIX_CACHE_BACKEND_MESSAGE)
        return self

    @model_validator(mode="after")
    def _limits_nest(self) -> Server:
        if (
            self.max_queue_tokens is not None
            and self.max_batch_tokens is not None
            and self.max_queue_tokens < self.max_batch_tokens
        ):
            raise ValueError("maxQueueTokens must be greater than or equal to maxBatchTokens")
        queue = self.max_queue_tokens or SERVER_QUEUE_TOKENS
        if self.max_request_tokens is not None and self.max_request_tokens > queue:
            raise ValueError(
                "maxRequestTokens must be at most maxQueueTokens "
                f"({SERVER_QUEUE_TOKENS} when unset)"
            )
        return self


class Parallelism(_Model):
    tensor_parallel_size: Literal[1, 2, 4, 8] = 1


class Gpu(_Model):
    type: str = Field(default="cpu", min_length=1, max_length=63)


class Resources(_Model):
    requests: dict[str, IntOrString] = Field(default_factory=dict)
    limits: dict[str, IntOrString] = Field(default_factory=dict)


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Scheduling(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None


class Autoscaling(_Model):
    enabled: bool = False
    autoscaler: Autoscaler | None = None
    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int = Field(default=4, ge=1, le=1000)
    metric: ScalingMetric = "backlogSeconds"
    target_per_pod: int | None = Field(default=None, ge=1)
    target_backlog_seconds: float | None = Field(default=None, ge=0.1, le=3600)
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=3600)
    behavior: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _min_le_max(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must be less than or equal to maxReplicas")
        return self

    @model_validator(mode="after")
    def _zero_needs_keda(self) -> Autoscaling:
        # A service at zero replicas exports no metric: only KEDA scales from zero, and only
        # when asked for by name (the operator's default autoscaler may change under it).
        if self.min_replicas == 0 and self.autoscaler != "keda":
            raise ValueError(
                "minReplicas 0 needs autoscaler keda (an HPA cannot scale up from zero pods "
                "on their own metrics)"
            )
        return self

    @model_validator(mode="after")
    def _target_fits_the_metric(self) -> Autoscaling:
        if self.target_per_pod is not None and self.metric not in QUEUE_METRICS:
            raise ValueError(
                "targetPerPod applies to metric queueRequests or queueTokens; backlogSeconds "
                "(the default metric) takes targetBacklogSeconds"
            )
        if self.target_backlog_seconds is not None and self.metric != "backlogSeconds":
            raise ValueError("targetBacklogSeconds applies to metric backlogSeconds only")
        return self


RolloutStrategy = Literal["blueGreen", "manual", "rolling"]


class Rollout(_Model):
    strategy: RolloutStrategy = "blueGreen"
    active_fingerprint: str | None = Field(default=None, pattern=r"^[0-9a-f]{8,16}$")
    max_surge: IntOrString = 0
    max_unavailable: IntOrString = 1

    @model_validator(mode="after")
    def _cut_over_needs_manual(self) -> Rollout:
        if self.active_fingerprint is not None and self.strategy != "manual":
            raise ValueError("activeFingerprint needs strategy manual")
        return self

    @model_validator(mode="after")
    def _can_progress(self) -> Rollout:
        # The schema cannot compare two int-or-string values; a Deployment with both at zero
        # is refused by the API server, so say it here with the field names the user wrote.
        if _is_zero(self.max_surge) and _is_zero(self.max_unavailable):
            raise ValueError("maxSurge and maxUnavailable cannot both be 0")
        return self


ContractPolicy = Literal["strict", "allowDrift", "disabled"]
STRICT_MIN_COSINE = 0.9999
"""What ``strict`` asks of every probe: vLLM's CI counts a model as unchanged when its STS
score moves by less than 1e-4, and a different model moves it by more than 1e-3."""
DRIFT_MIN_COSINE = 0.999


class Contract(_Model):
    """What a pod's vectors must match: the golden vectors the service's first ready pod
    recorded (``golden.py``)."""

    policy: ContractPolicy = "strict"
    min_cosine: float | None = Field(default=None, ge=0, le=1)

    @model_validator(mode="after")
    def _tolerance_needs_drift(self) -> Contract:
        if self.min_cosine is not None and self.policy != "allowDrift":
            raise ValueError("minCosine needs policy allowDrift (strict asks 0.9999)")
        return self

    @property
    def threshold(self) -> float:
        """The lowest cosine a probe may reach before the pod is kept out of the Service."""
        if self.policy == "strict":
            return STRICT_MIN_COSINE
        return DRIFT_MIN_COSINE if self.min_cosine is None else self.min_cosine


class ModelCache(_Model):
    mode: CacheMode = "none"
    size: IntOrString | None = None
    storage_class_name: str | None = None
    access_modes: list[AccessMode] = Field(default_factory=lambda: _read_write_once())
    claim_name: str | None = None
    read_only: bool = False

    @model_validator(mode="after")
    def _mode_fields(self) -> ModelCache:
        if self.mode == "pvc" and self.size is None:
            raise ValueError("size is required when mode is pvc")
        if self.mode == "existing" and not self.claim_name:
            raise ValueError("claimName is required when mode is existing")
        if self.read_only and self.mode != "existing":
            raise ValueError("readOnly needs mode existing (a claim filled beforehand)")
        return self


class ServiceSpec(_Model):
    type: ServiceType = "ClusterIP"
    port: int = Field(default=80, ge=1, le=65535)
    annotations: dict[str, str] = Field(default_factory=dict)


class NetworkPolicySpec(_Model):
    enabled: bool = False
    allowed_namespaces: list[str] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _needs_enabled(self) -> NetworkPolicySpec:
        if self.allowed_namespaces and not self.enabled:
            raise ValueError("allowedNamespaces needs enabled to be true")
        return self


class Tracing(_Model):
    """OpenTelemetry traces of the server's model routes (the server's
    ``--otlp-traces-endpoint``)."""

    otlp_endpoint: str = Field(min_length=1, max_length=2048, pattern=r"^https?://[^/\s]+(/\S*)?$")
    sampling_ratio: float | None = Field(default=None, ge=0, le=1)


MEDIA_DOMAIN_PATTERN = re.compile(
    r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
"""A host name, optionally ``*.``-prefixed: the CRD's pattern on ``media.allowedDomains[]``."""


def media_domain_problem(domain: str) -> str | None:
    """Why ``domain`` is not a host name ``media.allowedDomains`` may list, or None.

    The CRD's CEL rules on ``media.allowedDomains[]`` say the same, in the same order and
    words: the server matches the list against a URL's host name only, so a scheme, a path or
    a port would silently never match, and an IP literal would bypass the point of the list
    (the server refuses internal addresses unless their *name* is listed)."""
    if "://" in domain:
        return "media.allowedDomains lists host names, not URLs (no scheme such as https://)"
    if "/" in domain:
        return "media.allowedDomains lists host names; a path is not allowed"
    if ":" in domain:
        return "media.allowedDomains lists host names; a port or an IPv6 address is not allowed"
    if re.search(r"(^|[.])[0-9]+$", domain):
        return "media.allowedDomains lists host names; an IP address is not allowed"
    if len(domain) > 253 or not MEDIA_DOMAIN_PATTERN.match(domain):
        return (
            "media.allowedDomains lists lowercase host names "
            "(such as images.example.com or *.example.com)"
        )
    return None


def quantity_bytes(value: IntOrString) -> int:
    """A Kubernetes quantity (``8Mi``, ``500k``, ``1048576``) as a whole number of bytes."""
    from kubernetes.utils.quantity import parse_quantity

    try:
        amount = Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]
    except (ValueError, InvalidOperation, TypeError):
        raise ValueError(f"{value!r} is not a quantity (such as 8Mi or 8388608)") from None
    if amount != amount.to_integral_value() or amount < 1:
        raise ValueError(f"{value!r} is not a whole number of bytes of at least 1")
    return int(amount)


class Media(_Model):
    """Image inputs: the server's media policy (``--allowed-media-domains`` and limits)."""

    allowed_domains: list[str] = Field(default_factory=list, max_length=64)
    max_images_per_request: int | None = Field(default=None, ge=1, le=1024)
    max_image_bytes: IntOrString | None = None
    max_image_pixels: int | None = Field(default=None, ge=1, le=1_000_000_000)
    fetch_timeout_seconds: float | None = Field(default=None, ge=0.1, le=300)

    @field_validator("allowed_domains")
    @classmethod
    def _host_names(cls, domains: list[str]) -> list[str]:
        for domain in domains:
            problem = media_domain_problem(domain)
            if problem is not None:
                raise ValueError(f"{problem} (got {domain!r})")
        return domains

    @field_validator("max_image_bytes")
    @classmethod
    def _a_byte_count(cls, value: IntOrString | None) -> IntOrString | None:
        if value is not None:
            quantity_bytes(value)
        return value

    @property
    def image_bytes(self) -> int | None:
        """``maxImageBytes`` in bytes, as the server's ``--max-image-bytes`` takes it."""
        return None if self.max_image_bytes is None else quantity_bytes(self.max_image_bytes)


MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9._:/@+]*$")
"""A name ``servedModelAliases[]`` may hold: the CRD's pattern. No spaces or commas, because
the server's ``--served-model-aliases`` and the deprecated annotation are comma-separated."""

MAX_ALIASES = 16
"""The CRD's ``maxItems`` on ``servedModelAliases``."""

ALIASES_ANNOTATION = "embedding-operator.dev/aliases"
"""Deprecated: extra model names, comma-separated, from before ``spec.servedModelAliases``.
Its names are added to the field's (:func:`with_annotation_aliases`); the gateway reads both
(``embedding_server/gateway/kubernetes.py`` names the same annotation)."""


VERSIONED_NAME = re.compile(r"@[0-9A-Fa-f]{8,16}$")
"""What a name may not end in: ``@`` and 8 to 16 hex digits spell a versioned name
(``name@fingerprint``), which the gateway gives each version of a model (the CRD's CEL rule
on servedModelName and on each alias, with the same words)."""

VERSIONED_NAME_PROBLEM = (
    "must not end in @ and 8 to 16 hex digits: that spells a versioned name "
    "(name@fingerprint), which the gateway gives each version of a model"
)


def model_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a model alias, or None."""
    if len(name) > 256 or not MODEL_NAME_PATTERN.match(name):
        return (
            f"{name!r} is not a model name (a letter or digit, then letters, digits and "
            "- . _ : / @ +; at most 256 characters)"
        )
    if VERSIONED_NAME.search(name):
        return f"{name!r} {VERSIONED_NAME_PROBLEM}"
    return None


# Embedding fields that mean nothing for a cross-encoder or classifier, by their wire names.
EMBED_ONLY_FIELDS = ("pooling", "normalize", "dimensions", "matryoshkaDimensions")


class EmbeddingServiceSpec(_Model):
    model: ModelSource
    served_model_name: str | None = None
    served_model_aliases: list[str] = Field(default_factory=list, max_length=MAX_ALIASES)
    task: Task = "embed"
    embedding: Embedding = Embedding()
    server: Server = Server()
    parallelism: Parallelism = Parallelism()
    gpu: Gpu = Gpu()
    resources: Resources = Resources()
    scheduling: Scheduling = Scheduling()
    replicas: int = Field(default=1, ge=0, le=1000)
    autoscaling: Autoscaling = Autoscaling()
    rollout: Rollout = Rollout()
    contract: Contract = Contract()
    model_cache: ModelCache = ModelCache()
    service: ServiceSpec = ServiceSpec()
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    tracing: Tracing | None = None
    media: Media | None = None
    api_key_secret_ref: ApiKeySecretRef | None = None

    @field_validator("served_model_name")
    @classmethod
    def _served_name_is_no_version(cls, name: str | None) -> str | None:
        if name is not None and VERSIONED_NAME.search(name):
            raise ValueError(f"{name!r} {VERSIONED_NAME_PROBLEM}")
        return name

    @field_validator("served_model_aliases")
    @classmethod
    def _aliases_are_names(cls, aliases: list[str]) -> list[str]:
        for alias in aliases:
            problem = model_name_problem(alias)
            if problem is not None:
                raise ValueError(problem)
        if len(set(aliases)) != len(aliases):
            raise ValueError("servedModelAliases lists a name twice")
        return aliases

    @model_validator(mode="after")
    def _aliases_are_other_names(self) -> EmbeddingServiceSpec:
        # As the CRD's CEL rule: only an explicit servedModelName is compared (the default
        # name, a path component of model.name, is more than a rule should compute).
        if self.served_model_name and self.served_model_name in self.served_model_aliases:
            raise ValueError("servedModelAliases must not repeat servedModelName")
        return self

    @model_validator(mode="after")
    def _transformers_backend_on_one_device(self) -> EmbeddingServiceSpec:
        if self.server.backend == "transformers" and self.parallelism.tensor_parallel_size != 1:
            raise ValueError(
                "server.backend transformers runs the whole model on one device; "
                "parallelism.tensorParallelSize must be 1"
            )
        return self

    @model_validator(mode="after")
    def _int8_on_one_cpu_process(self) -> EmbeddingServiceSpec:
        # As the CRD's CEL rules on spec. The CRD knows the built-in GPU profiles only; plan()
        # also refuses int8 on an admin's own profile that requests an accelerator.
        if self.server.quantization != "int8":
            return self
        if self.parallelism.tensor_parallel_size != 1:
            raise ValueError(INT8_PARALLEL_MESSAGE)
        if self.gpu.type in BUILTIN_GPU_TYPES:
            raise ValueError(INT8_GPU_MESSAGE)
        return self

    @model_validator(mode="after")
    def _request_holds_an_input(self) -> EmbeddingServiceSpec:
        limit, longest = self.server.max_request_tokens, self.embedding.max_input_tokens
        if limit is not None and longest is not None and limit < longest:
            raise ValueError(
                "server.maxRequestTokens must be at least embedding.maxInputTokens "
                "(one request holds at least one whole input)"
            )
        return self

    @model_validator(mode="after")
    def _embed_only_fields(self) -> EmbeddingServiceSpec:
        if self.task == "embed":
            return self
        emb = self.embedding
        given = {
            "pooling": emb.pooling != "auto",
            "normalize": emb.normalize is not None,
            "dimensions": emb.dimensions is not None,
            "matryoshkaDimensions": emb.matryoshka_dimensions is not None,
        }
        for name in EMBED_ONLY_FIELDS:
            if given[name]:
                raise ValueError(f"embedding.{name} applies to task embed only")
        return self

    @model_validator(mode="after")
    def _media_needs_embed(self) -> EmbeddingServiceSpec:
        if self.media is not None and self.task != "embed":
            raise ValueError(
                "media applies to task embed only (score, classify, token_classify, reward "
                "and sparse models take no images)"
            )
        return self

    @property
    def served_name(self) -> str:
        """The name clients send; the server's own default, made explicit."""
        if self.served_model_name:
            return self.served_model_name
        return self.model.server_model.rstrip("/").rsplit("/", 1)[-1]


class InvalidSpecError(ValueError):
    """The spec cannot be rendered; ``message`` names the field paths (spec.x.y)."""


def with_annotation_aliases(
    spec: EmbeddingServiceSpec, annotations: Mapping[str, str] | None
) -> EmbeddingServiceSpec:
    """``spec`` with the deprecated :data:`ALIASES_ANNOTATION`'s names added to
    ``servedModelAliases`` (the union: the field's first, then the annotation's new ones;
    the served name itself is left out), so that the pods answer to every name the gateway
    routes to them. A name that is not a model name refuses the spec, naming the annotation,
    rather than being dropped: the gateway would route it to pods that 404 it."""
    raw = (annotations or {}).get(ALIASES_ANNOTATION)
    if not raw:
        return spec
    aliases = list(spec.served_model_aliases)
    for name in (n.strip() for n in raw.split(",")):
        if not name or name == spec.served_name or name in aliases:
            continue
        problem = model_name_problem(name)
        if problem is not None:
            raise InvalidSpecError(f"metadata.annotations[{ALIASES_ANNOTATION}]: {problem}")
        aliases.append(name)
    if len(aliases) > MAX_ALIASES:
        raise InvalidSpecError(
            f"metadata.annotations[{ALIASES_ANNOTATION}]: with spec.servedModelAliases, more "
            f"than {MAX_ALIASES} aliases"
        )
    return spec.model_copy(update={"served_model_aliases": aliases})


def parse_spec(raw: Mapping[str, Any]) -> EmbeddingServiceSpec:
    """Parse ``.spec`` of an EmbeddingService; raise InvalidSpecError naming the fields."""
    try:
        return EmbeddingServiceSpec.model_validate(dict(raw))
    except ValidationError as exc:
        raise InvalidSpecError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError) -> str:
    """``spec.autoscaling.minReplicas: minReplicas must be ...; spec.x: ...`` (stable order)."""
    parts = []
    for error in exc.errors(include_url=False):
        path = ".".join(["spec", *(str(p) for p in error["loc"])])
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{path}: {message}")
    return "; ".join(parts)

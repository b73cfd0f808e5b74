"""The EmbeddingJob spec as typed, validated Python values.

``crds/embeddingjobs.yaml`` is the API's source of truth and the API server enforces it (types,
bounds, the CEL rules) before the operator sees an object. As for EmbeddingService
(``embedding_operator.spec``) this model mirrors it field for field with the same defaults,
restates the CEL rules with the same words, and ``tests/operator/test_job_crd.py`` fails
when the two drift apart.

What the schema leaves to the planner and the workers stays theirs: ``shardRows``,
``maxInFlight`` and ``batchSize`` have no default here, so an unset field is not passed and
the worker's own default applies (one place).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from embedding_operator.profiles import NVIDIA_GPU
from embedding_operator.spec import (
    Dtype,
    InvalidSpecError,
    ModelSource,
    Pooling,
    Resources,
    Scheduling,
    _Model,
    format_validation_error,
)

InputFormat = Literal["parquet", "jsonl", "csv"]
OutputFormat = Literal["parquet", "jsonl"]
Vector = Literal["dense", "sparse", "multi_vector"]
"""An output the parts keep (``spec.output.vectors``), as the server's ``/info`` names them."""
DEFAULT_TEXT_FIELD = "text"

PVC_MOUNT_PATH = "/data"
"""Where ``storage.pvc`` is mounted in the job's pods: path URLs start here."""

S3_PREFIX = "s3://"
URL_PATTERN = re.compile(r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/\S*)?|/data(/\S*)?)$")
"""An input or output URL: ``s3://bucket[/key]`` or a path under :data:`PVC_MOUNT_PATH`
(the CRD's pattern on ``input.urls[]`` and ``output.url``; globs are the workers' to expand)."""

MAX_INPUT_URLS = 1000

NAME_PATTERN = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
"""A DNS-1035 label: the CRD's pattern on ``service`` (an EmbeddingService's name)."""

S3_NEEDS_STORAGE = "storage.s3 is required when input.urls or output.url are s3:// URLs"
PATH_NEEDS_STORAGE = (
    "storage.pvc is required when input.urls or output.url are paths (under /data, where the "
    "claim is mounted)"
)
STORAGE_NEEDS_ONE = "storage names s3, pvc or both"
UNUSED_S3 = "storage.s3 is set but no input or output URL is an s3:// URL"
UNUSED_PVC = "storage.pvc is set but no input or output URL is a path under /data"
SERVICE_OR_MODEL = (
    "one of service and model is required: service sends the rows to an EmbeddingService's "
    "pods, model loads a model in the job's own pods"
)
NOT_BOTH = (
    "service and model are exclusive: the rows go to an EmbeddingService's pods or to a model "
    "loaded in the job's own pods, not both"
)
CACHE_NEEDS_MODEL = "modelCache applies with model only (a service's pods load its model)"
CACHE_NEEDS_CLAIM = "claimName is required when mode is existing"
READ_ONLY_NEEDS_CLAIM = "readOnly needs mode existing (a claim filled beforehand)"
TEXT_OR_IMAGE = (
    "input.imageField and input.textField are exclusive: a job embeds either a text or an image "
    "per row (textField is text when neither is set)"
)


IMAGES_ARE_DENSE = (
    "output.vectors must be [dense] when input.imageField is set: sparse and multi_vector are "
    "outputs of texts"
)
VECTORS_TWICE = "output.vectors names an output twice"


def _dense_only() -> list[Vector]:
    return ["dense"]


INPUT_TYPE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class JobInput(_Model):
    urls: list[str] = Field(min_length=1, max_length=MAX_INPUT_URLS)
    format: InputFormat
    id_field: str = Field(default="id", min_length=1, max_length=256)
    text_field: str | None = Field(default=None, min_length=1, max_length=256)
    """No default in the schema (so that a job of images can leave it out, and the CEL rule
    can tell it was given): :attr:`text_column` is the text embedded, ``text`` unset."""
    image_field: str | None = Field(default=None, min_length=1, max_length=256)
    input_type: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=INPUT_TYPE_PATTERN
    )
    """The API's ``input_type`` for the texts (``job work --input-type``); unset, none, or
    ``search_document`` when the output keeps multi-vectors (the workers' default)."""

    @field_validator("urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            _check_url(url)
        return urls

    @field_validator("image_field")
    @classmethod
    def _text_or_image(cls, image_field: str | None, info: ValidationInfo) -> str | None:
        # As the CRD's CEL rule on spec.input (fieldPath .imageField), with its words.
        if image_field is not None and info.data.get("text_field") is not None:
            raise ValueError(TEXT_OR_IMAGE)
        return image_field

    @property
    def text_column(self) -> str | None:
        """The text column the workers embed; None for a job of images."""
        if self.image_field is not None:
            return None
        return self.text_field or DEFAULT_TEXT_FIELD


class JobOutput(_Model):
    url: str = Field(min_length=1, max_length=2048)
    format: OutputFormat = "parquet"
    vectors: list[Vector] = Field(default_factory=_dense_only, min_length=1, max_length=3)

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _check_url(url)

    @field_validator("vectors")
    @classmethod
    def _vectors_once(cls, vectors: list[Vector]) -> list[Vector]:
        # The CRD's x-kubernetes-list-type: set (the API server's "Duplicate value").
        if len(set(vectors)) != len(vectors):
            raise ValueError(VECTORS_TWICE)
        return vectors


def _check_url(url: str) -> str:
    if len(url) > 2048 or not URL_PATTERN.match(url):
        raise ValueError(
            f"{url!r} is neither an s3://bucket/key URL nor a path under {PVC_MOUNT_PATH}"
        )
    return url


class S3CredentialsSecret(_Model):
    """A Secret with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."""

    name: str = Field(min_length=1, max_length=253)


class S3Storage(_Model):
    endpoint: str | None = Field(
        default=None, min_length=1, max_length=2048, pattern=r"^https?://[^/\s]+(/\S*)?$"
    )
    region: str | None = Field(default=None, min_length=1, max_length=64)
    credentials_secret: S3CredentialsSecret | None = None


class PvcStorage(_Model):
    claim_name: str = Field(min_length=1, max_length=253)


class Storage(_Model):
    s3: S3Storage | None = None
    pvc: PvcStorage | None = None

    @model_validator(mode="after")
    def _one_at_least(self) -> Storage:
        if self.s3 is None and self.pvc is None:
            raise ValueError(STORAGE_NEEDS_ONE)
        return self


class JobModel(ModelSource):
    """``spec.model``: EmbeddingService's ``model`` (name, revision, trustRemoteCode,
    hubTokenSecretRef) with the few engine settings a corpus may need to pin."""

    dtype: Dtype = "auto"
    pooling: Pooling = "auto"
    normalize: bool | None = None


class JobModelCache(_Model):
    """``spec.modelCache``: EmbeddingService's ``modelCache`` without ``pvc`` (a claim the
    job would own and delete with it, downloading the model again for each job)."""

    mode: Literal["none", "existing"] = "none"
    claim_name: str | None = Field(default=None, min_length=1, max_length=253)
    read_only: bool = False

    @model_validator(mode="after")
    def _mode_fields(self) -> JobModelCache:
        # As the CRD's CEL rules on spec.modelCache, with their words (EmbeddingService's).
        if self.mode == "existing" and not self.claim_name:
            raise ValueError(CACHE_NEEDS_CLAIM)
        if self.read_only and self.mode != "existing":
            raise ValueError(READ_ONLY_NEEDS_CLAIM)
        return self


class EmbeddingJobSpec(_Model):
    model: JobModel | None = None
    """Before ``service``, whose validator reads it (as the CRD's rules on spec)."""
    service: str | None = Field(default=None, min_length=1, max_length=52, validate_default=True)
    model_cache: JobModelCache | None = None
    fingerprint: str | None = Field(default=None, pattern=r"^[0-9a-f]{8,16}$")
    input: JobInput
    output: JobOutput
    storage: Storage | None = None
    shard_rows: int | None = Field(default=None, ge=1, le=10_000_000)
    parallelism: int = Field(default=1, ge=1, le=1000)
    backoff_limit_per_index: int = Field(default=3, ge=0, le=100)
    max_in_flight: int | None = Field(default=None, ge=1, le=1024)
    batch_size: int | None = Field(default=None, ge=1, le=65536)
    suspend: bool = False
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=31_536_000)
    resources: Resources = Resources()
    scheduling: Scheduling = Scheduling()

    @field_validator("service")
    @classmethod
    def _service_name(cls, name: str | None, info: ValidationInfo) -> str | None:
        if name is not None and not NAME_PATTERN.match(name):
            raise ValueError(f"{name!r} is not an EmbeddingService name (a DNS-1035 label)")
        # As the CRD's two CEL rules on spec (fieldPath .service), with their words; a model
        # that was refused itself is not in info.data, and is reported alone.
        if "model" in info.data:
            given = info.data["model"] is not None
            if name is None and not given:
                raise ValueError(SERVICE_OR_MODEL)
            if name is not None and given:
                raise ValueError(NOT_BOTH)
        return name

    @field_validator("model_cache")
    @classmethod
    def _cache_needs_model(
        cls, cache: JobModelCache | None, info: ValidationInfo
    ) -> JobModelCache | None:
        # As the CRD's CEL rule on spec (fieldPath .modelCache), with its words.
        if cache is not None and info.data.get("model") is None and "model" in info.data:
            raise ValueError(CACHE_NEEDS_MODEL)
        return cache

    @property
    def gpu(self) -> bool:
        """Whether the pods ask for an NVIDIA GPU (``resources``): ``spec.model`` then runs
        on it (``--device cuda``), else on the CPU."""
        return NVIDIA_GPU in self.resources.limits or NVIDIA_GPU in self.resources.requests

    @property
    def urls(self) -> list[str]:
        return [*self.input.urls, self.output.url]

    @property
    def uses_s3(self) -> bool:
        return any(url.startswith(S3_PREFIX) for url in self.urls)

    @property
    def uses_pvc(self) -> bool:
        return any(not url.startswith(S3_PREFIX) for url in self.urls)

    @model_validator(mode="after")
    def _images_are_dense(self) -> EmbeddingJobSpec:
        # As the CRD's CEL rule on spec (fieldPath .output.vectors), with its words.
        if self.input.image_field is not None and self.output.vectors != ["dense"]:
            raise ValueError(IMAGES_ARE_DENSE)
        return self

    @model_validator(mode="after")
    def _storage_fits_the_urls(self) -> EmbeddingJobSpec:
        # As the CRD's CEL rules on spec, with their words, on spec.storage.
        storage = self.storage or Storage.model_construct(s3=None, pvc=None)
        if self.uses_s3 and storage.s3 is None:
            raise ValueError(S3_NEEDS_STORAGE)
        if self.uses_pvc and storage.pvc is None:
            raise ValueError(PATH_NEEDS_STORAGE)
        if storage.s3 is not None and not self.uses_s3:
            raise ValueError(UNUSED_S3)
        if storage.pvc is not None and not self.uses_pvc:
            raise ValueError(UNUSED_PVC)
        return self


def parse_job_spec(raw: Mapping[str, Any]) -> EmbeddingJobSpec:
    """Parse ``.spec`` of an EmbeddingJob; raise InvalidSpecError naming the fields."""
    try:
        return EmbeddingJobSpec.model_validate(dict(raw))
    except ValidationError as exc:
        raise InvalidSpecError(format_validation_error(exc)) from None


__all__ = [
    "PVC_MOUNT_PATH",
    "EmbeddingJobSpec",
    "InvalidSpecError",
    "JobInput",
    "JobModel",
    "JobModelCache",
    "JobOutput",
    "Storage",
    "parse_job_spec",
]

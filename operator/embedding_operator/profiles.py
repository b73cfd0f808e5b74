"""GPU profiles: what ``spec.gpu.type`` means on this cluster.

Users name a GPU (``h100``, ``l4``); cluster admins decide what that takes: which extended
resource to request (``nvidia.com/gpu``, or a MIG slice), which node labels select it and which
taints it must tolerate. Keeping that mapping in operator configuration (a YAML file, mounted
from a ConfigMap by the Helm chart) instead of in every EmbeddingService is what lets one
manifest move between clusters (the KubeAI ``resourceProfiles`` idea, with GPU count derived
from tensor parallelism instead of written twice).

Built-in profiles follow the NVIDIA GPU feature discovery label ``nvidia.com/gpu.product``. A
profile file adds new profiles and overlays built-ins of the same name field by field (what it
does not set keeps the built-in's value; ``resourceName: ""`` means no accelerator)::

    profiles:
      h100:
        resourceName: nvidia.com/gpu
        nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
        tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

CPU = "cpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
NVIDIA_GPU = "nvidia.com/gpu"


class GpuProfile(BaseModel):
    """One accelerator type. ``resource_name`` None means no accelerator (the cpu profile)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    resource_name: str | None = Field(
        NVIDIA_GPU,
        description="Extended resource requested "
        "per pod, tensorParallelSize of them; null for cpu.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods require."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="Tolerations added to the pods."
    )
    api_workers: int = Field(
        default=1,
        ge=1,
        le=32,
        description="Front-end processes per server pod (--api-workers) unless "
        "spec.server.apiWorkers says otherwise: how many CPU cores of HTTP, tokenization and "
        "encoding it takes to keep this GPU busy with a small embedder.",
    )

    @field_validator("resource_name", mode="before")
    @classmethod
    def _empty_means_none(cls, value: object) -> object:
        # Helm drops null values from values files, so `resourceName: ""` is how a chart
        # user says "no accelerator".
        return None if value == "" else value


_GPU_TOLERATION: dict[str, Any] = {"key": NVIDIA_GPU, "operator": "Exists", "effect": "NoSchedule"}


def _nvidia(product: str, api_workers: int) -> GpuProfile:
    return GpuProfile(
        resource_name=NVIDIA_GPU,
        node_selector={GPU_PRODUCT_LABEL: product},
        tolerations=[_GPU_TOLERATION],
        api_workers=api_workers,
    )


# Front-end processes per pod. One Python process tops out at a few thousand short requests
# per second (HTTP, JSON, tokenization); a small embedder on an H100 computes several times
# that, on an L4 about as much, on a T4 less. So the biggest GPUs get four, the middle ones
# two, and a T4 or a CPU pod one (there the model is the bottleneck and a second process only
# takes cores from it).


BUILTIN_PROFILES: Mapping[str, GpuProfile] = {
    CPU: GpuProfile(resource_name=None),
    "h100": _nvidia("NVIDIA-H100-80GB-HBM3", 4),
    "h200": _nvidia("NVIDIA-H200", 4),
    "a100-80gb": _nvidia("NVIDIA-A100-SXM4-80GB", 4),
    "a100-40gb": _nvidia("NVIDIA-A100-SXM4-40GB", 4),
    "l40s": _nvidia("NVIDIA-L40S", 2),
    "l4": _nvidia("NVIDIA-L4", 2),
    "a10g": _nvidia("NVIDIA-A10G", 2),
    "t4": _nvidia("Tesla-T4", 1),
}


class ProfileConfigError(ValueError):
    """The profile file is unreadable or malformed; the operator refuses to start."""


class UnknownGpuTypeError(LookupError):
    """``spec.gpu.type`` names no profile."""

    def __init__(self, gpu_type: str, known: list[str]) -> None:
        super().__init__(
            f"spec.gpu.type: unknown GPU type {gpu_type!r}; known types: {', '.join(known)}"
        )
        self.gpu_type = gpu_type


class GpuProfiles:
    """The profiles in effect: built-ins overlaid with the operator's profile file."""

    def __init__(self, profiles: Mapping[str, GpuProfile]) -> None:
        self._profiles = dict(profiles)

    @classmethod
    def builtin(cls) -> GpuProfiles:
        return cls(BUILTIN_PROFILES)

    @classmethod
    def load(cls, path: Path | None) -> GpuProfiles:
        """Built-ins, overlaid with ``path`` when given; malformed files fail loudly."""
        if path is None:
            return cls.builtin()
        try:
            document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ProfileConfigError(f"cannot read GPU profiles from {path}: {exc}") from exc
        return cls.from_document(document, source=str(path))

    @classmethod
    def from_document(cls, document: object, source: str = "<profiles>") -> GpuProfiles:
        if not isinstance(document, dict) or not isinstance(document.get("profiles", {}), dict):
            raise ProfileConfigError(f"{source}: expected a mapping with a 'profiles' mapping")
        merged = dict(BUILTIN_PROFILES)
        for name, raw in document.get("profiles", {}).items():
            try:
                given = GpuProfile.model_validate(raw or {})
                # A built-in keeps what the overlay does not set: `cpu: {nodeSelector: ...}`
                # stays a CPU profile instead of asking for a GPU.
                base = BUILTIN_PROFILES.get(str(name))
                merged[str(name)] = (
                    base.model_copy(update={f: getattr(given, f) for f in given.model_fields_set})
                    if base is not None
                    else given
                )
            except ValidationError as exc:
                raise ProfileConfigError(f"{source}: profile {name!r}: {exc}") from exc
        return cls(merged)

    def names(self) -> list[str]:
        return sorted(self._profiles)

    def resolve(self, gpu_type: str) -> GpuProfile:
        try:
            return self._profiles[gpu_type]
        except KeyError:
            raise UnknownGpuTypeError(gpu_type, self.names()) from None

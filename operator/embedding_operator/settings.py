"""Operator configuration: one pydantic-settings model, read from flags and environment.

Every knob is declared once here; ``embedding-operator run --help`` and the
``EMBEDDING_OPERATOR_*`` environment variables are derived from these fields (flags win over
environment, environment over defaults), so the Helm chart can use either.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from pathlib import Path
from typing import Annotated, Literal, get_args, get_origin

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from embedding_operator.builders.common import DEFAULT_IMAGE, AutoscalingDefaults
from embedding_operator.policy import WorkloadPolicy
from embedding_operator.spec import Autoscaler, ServiceType

_SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def own_namespace() -> str:
    """The operator pod's namespace (``POD_NAMESPACE``, else its service account's), else
    'default'."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return _SA_NAMESPACE_FILE.read_text(encoding="utf-8").strip() or "default"
    except OSError:
        return "default"


class OperatorSettings(BaseSettings):
    """How ``embedding-operator run`` behaves."""

    model_config = SettingsConfigDict(env_prefix="EMBEDDING_OPERATOR_", extra="forbid")

    namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Namespaces to watch, comma-separated (kopf globs "
        "such as 'team-*' allowed); empty watches all namespaces.",
    )
    gpu_profiles: Path | None = Field(
        None,
        description="YAML file of GPU profiles that "
        "overlay the built-in ones (h100, l4, ... and cpu).",
    )
    default_image: str = Field(
        DEFAULT_IMAGE,
        description="embedding-server image for "
        "EmbeddingServices that do not set spec.server.image.",
    )
    allowed_images: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Images EmbeddingServices may set in spec.server.image, comma-separated "
        "shell patterns matched against the whole reference (e.g. "
        "'registry.example/embedding-server:*'); empty allows any. The default image is "
        "always allowed. A CR outside the list is Degraded (ImageNotAllowed) and nothing "
        "is applied.",
    )
    allowed_priority_classes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="PriorityClass names EmbeddingServices may set in "
        "spec.scheduling.priorityClassName, comma-separated; empty allows any. A CR "
        "outside the list is Degraded (PriorityClassNotAllowed) and nothing is applied.",
    )
    allowed_env: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Names EmbeddingServices may set in spec.server.env beyond the built-in "
        "list (EMBEDDING_SERVER_*, the Hugging Face, tokenizers, OpenMP and NCCL tuning "
        "variables), comma-separated shell patterns (e.g. 'HF_ENDPOINT,HTTPS_PROXY'). Names "
        "that load code (LD_*, PYTHON*, ...) are refused whatever this says. A CR outside "
        "the list is Degraded (EnvNotAllowed) and nothing is applied.",
    )
    allow_control_plane: bool = Field(
        True,
        description="Let EmbeddingServices select control-plane nodes, tolerate their taints "
        "(or every taint) or follow other namespaces' pods there. Off, such a CR is Degraded "
        "(PlacementNotAllowed) and nothing is applied.",
    )
    allowed_extended_resources: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Extended resources EmbeddingServices may request in spec.resources, "
        "comma-separated shell patterns (e.g. 'example.com/*'); cpu, memory, "
        "ephemeral-storage and hugepages-* are always allowed, GPUs come from the GPU "
        "profile. A CR outside the list is Degraded (ResourceNotAllowed) and nothing is "
        "applied.",
    )
    allowed_service_types: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Service types EmbeddingServices may set in spec.service.type, "
        "comma-separated (ClusterIP, NodePort, LoadBalancer); empty allows any. A CR outside "
        "the list is Degraded (ServiceNotAllowed) and nothing is applied.",
    )
    allowed_service_annotations: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Annotation keys EmbeddingServices may set in spec.service.annotations, "
        "comma-separated shell patterns (e.g. 'prometheus.io/*'); empty allows any. A CR "
        "outside the list is Degraded (ServiceNotAllowed) and nothing is applied.",
    )
    reserved_model_names: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Model names only some namespaces may claim, comma-separated "
        "PATTERN=NAMESPACE[|NAMESPACE...] items (shell patterns; the first that matches a "
        "name decides), e.g. 'text-embedding-*=search|ml'. A claim from another namespace is "
        "refused (NamesOwned False, NameReserved) however old; any other name is owned by "
        "its oldest claimant (NameTaken for the others). The gateway's "
        "--reserved-model-names must say the same (the chart sets both).",
    )
    default_autoscaler: Autoscaler = Field(
        "hpa",
        description="The autoscaler of EmbeddingServices that enable autoscaling without "
        "naming one in spec.autoscaling.autoscaler: hpa (a HorizontalPodAutoscaler on a "
        "custom metrics API such as prometheus-adapter) or keda (a KEDA ScaledObject; needs "
        "--keda-prometheus-address).",
    )
    keda_prometheus_address: str = Field(
        "",
        description="The Prometheus URL KEDA's Prometheus trigger queries for the server "
        "metrics (e.g. http://prometheus-operated.monitoring.svc:9090); KEDA's operator and "
        "metrics server must reach it. Empty: an EmbeddingService asking for keda is Degraded "
        "(AutoscalerNotConfigured) and nothing is applied for it.",
    )
    keda_gateway_namespace: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="The namespace the gateway runs in, as Prometheus labels its series "
        "(namespace): the KEDA trigger that wakes a service from zero counts only the held "
        "requests scraped from there, so a pod elsewhere that exports the gateway's gauge "
        "cannot wake another team's service. Default: the operator's own namespace (the chart "
        "sets its release namespace, where it deploys the gateway).",
    )
    keda_gateway_job: str = Field(
        "",
        max_length=256,
        description="The job label Prometheus gives the gateway's series, matched too by the "
        "wake-from-zero trigger when set (e.g. a PodMonitor's <namespace>/<name>). Empty: "
        "any job.",
    )
    liveness: str | None = Field(
        "http://0.0.0.0:8080/healthz",
        description="Liveness endpoint URL (kopf's --liveness); empty disables it.",
    )
    metrics_port: int = Field(
        8081,
        ge=0,
        le=65535,
        description="Port of the operator's Prometheus /metrics (reconciles, work queue, "
        "children written, conditions per EmbeddingService), on every address; 0 disables it.",
    )
    log_format: Literal["json", "text"] = Field(
        "text", description="Log format: json for log collectors, text for people."
    )
    log_level: Literal["debug", "info", "warning"] = Field("info", description="Log level.")
    resync_seconds: float = Field(
        60.0,
        gt=0,
        description="Interval of the periodic "
        "re-reconcile that corrects drift missed by watches and "
        "retries what failed.",
    )
    full_resync_seconds: float = Field(
        3600.0,
        gt=0,
        description="A resync skips an EmbeddingService that is settled (ready, no problem) "
        "and whose watched resourceVersions, and its children's, have not changed since it "
        "was last read; this is how often it is re-read from the API anyway.",
    )
    workers: int = Field(16, gt=0, description="Threads that run reconciles concurrently.")
    leader_elect: bool = Field(
        False,
        description="Run only while holding a "
        "coordination.k8s.io Lease, so several replicas are safe.",
    )
    lease_name: str = Field("embedding-operator", description="Name of the leader Lease.")
    lease_namespace: str | None = Field(
        None,
        description="Namespace of the leader Lease (default: the pod's namespace, else 'default').",
    )
    identity: str | None = Field(
        None,
        description="This replica's leader-election identity "
        "(default: hostname plus a random suffix).",
    )
    lease_duration_seconds: float = Field(
        15.0,
        gt=0,
        description="How long a Lease is valid without renewal; a standby takes over after it.",
    )
    renew_deadline_seconds: float = Field(
        10.0, gt=0, description="The leader stops working if it could not renew for this long."
    )
    retry_period_seconds: float = Field(
        2.0, gt=0, description="Interval between Lease acquire and renew attempts."
    )

    @field_validator(
        "namespaces",
        "allowed_images",
        "allowed_priority_classes",
        "allowed_env",
        "allowed_extended_resources",
        "allowed_service_types",
        "allowed_service_annotations",
        mode="before",
    )
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("reserved_model_names", mode="before")
    @classmethod
    def _split_reservations(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("reserved_model_names")
    @classmethod
    def _reservations(cls, value: list[str]) -> list[str]:
        from embedding_operator.names import ReservedNames

        ReservedNames(value)  # a malformed item is a settings error, named, at start
        return value

    @field_validator("allowed_service_types")
    @classmethod
    def _service_types(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(get_args(ServiceType)))
        if unknown:
            raise ValueError(f"unknown Service types {unknown}; use {list(get_args(ServiceType))}")
        return value

    @field_validator("liveness", mode="before")
    @classmethod
    def _empty_disables(cls, value: object) -> object:
        return None if value == "" else value

    @model_validator(mode="after")
    def _lease_timing(self) -> OperatorSettings:
        if not (
            self.retry_period_seconds < self.renew_deadline_seconds < self.lease_duration_seconds
        ):
            raise ValueError(
                "need retry_period_seconds < renew_deadline_seconds < lease_duration_seconds"
            )
        return self

    @property
    def policy(self) -> WorkloadPolicy:
        return WorkloadPolicy(
            allowed_images=tuple(self.allowed_images),
            allowed_priority_classes=tuple(self.allowed_priority_classes),
            allowed_env=tuple(self.allowed_env),
            allow_control_plane=self.allow_control_plane,
            allowed_extended_resources=tuple(self.allowed_extended_resources),
            allowed_service_types=tuple(self.allowed_service_types),
            allowed_service_annotations=tuple(self.allowed_service_annotations),
        )

    @property
    def autoscaling(self) -> AutoscalingDefaults:
        return AutoscalingDefaults(
            autoscaler=self.default_autoscaler,
            prometheus_address=self.keda_prometheus_address,
            gateway_namespace=self.keda_gateway_namespace or own_namespace(),
            gateway_job=self.keda_gateway_job,
        )

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    def resolved_lease_namespace(self) -> str:
        return self.lease_namespace or own_namespace()

    def resolved_identity(self) -> str:
        return self.identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--kebab-case`` flag per field, its description as the help.

    Not pydantic-settings' own CLI (``CliSettingsSource``): it would change ``--help``, with
    type names as metavars (``--namespaces list[str]``) and a ``(default: ...)`` suffix on every
    flag. Flags default to None so that only flags given on the command line override the
    environment (``settings_from_args``).
    """
    for name, field in OperatorSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = field.description or ""
        annotation = field.annotation
        if annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        choices = None
        if get_origin(annotation) is not None and all(
            isinstance(a, str) for a in get_args(annotation)
        ):
            choices = list(get_args(annotation))
        parser.add_argument(
            flag,
            dest=name,
            default=None,
            choices=choices,
            help=help_text,
            metavar=None if choices else name.upper(),
        )


def settings_from_args(args: argparse.Namespace) -> OperatorSettings:
    """Flags given win; the rest come from ``EMBEDDING_OPERATOR_*`` variables, then defaults."""
    given = {
        name: getattr(args, name)
        for name in OperatorSettings.model_fields
        if getattr(args, name, None) is not None
    }
    return OperatorSettings(**given)

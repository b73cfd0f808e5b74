"""What one EmbeddingService should become, or why it cannot: parse, profile, refuse, build.

The operator and ``embedding-operator render`` must agree on every spec: render the same
children from the same spec, and refuse the same specs with the same message. Both therefore
call ``plan`` and nothing else between the raw ``.spec`` and the manifests: parse and validate
the spec, resolve ``spec.gpu.type`` to a GPU profile (int8 is refused on one with an
accelerator), refuse what the admins' allowlist does not admit (``policy.py``) and a KEDA
autoscaler the operator was given no Prometheus for, then run the pure builders.

Pure like the builders: no cluster, no clock. What only the cluster knows (does a referenced
pod start, is a child's name taken) is the reconciler's to check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from embedding_operator.builders import DesiredChildren, desired_children
from embedding_operator.builders.common import (
    DEFAULT_AUTOSCALING,
    DEFAULT_GATEWAY_NAMESPACE,
    DEFAULT_IMAGE,
    AutoscalingDefaults,
    Owner,
    RenderInput,
)
from embedding_operator.policy import DEFAULT_POLICY, WorkloadPolicy
from embedding_operator.profiles import GpuProfiles, UnknownGpuTypeError
from embedding_operator.spec import InvalidSpecError, parse_spec, with_annotation_aliases
from embedding_operator.status import (
    AUTOSCALER_NOT_CONFIGURED,
    INVALID_SPEC,
    UNKNOWN_GPU_TYPE,
    Problem,
)


@dataclass(frozen=True)
class Planned:
    """The spec is good: these are the children it asks for."""

    render: RenderInput
    children: DesiredChildren


@dataclass(frozen=True)
class Refused:
    """Nothing may be applied for this spec; ``problem`` names the field and why."""

    problem: Problem


def plan(
    owner: Owner,
    raw_spec: Mapping[str, Any],
    profiles: GpuProfiles,
    default_image: str = DEFAULT_IMAGE,
    policy: WorkloadPolicy = DEFAULT_POLICY,
    autoscaling: AutoscalingDefaults = DEFAULT_AUTOSCALING,
    annotations: Mapping[str, str] | None = None,
    operator_namespace: str = DEFAULT_GATEWAY_NAMESPACE,
) -> Planned | Refused:
    """Parse ``raw_spec``, resolve its GPU profile, build the children (or say why not).
    ``annotations`` are the object's: the deprecated aliases annotation still adds names."""
    try:
        spec = with_annotation_aliases(parse_spec(raw_spec), annotations)
        profile = profiles.resolve(spec.gpu.type)
    except InvalidSpecError as exc:
        return Refused(Problem(INVALID_SPEC, str(exc)))
    except UnknownGpuTypeError as exc:
        return Refused(Problem(UNKNOWN_GPU_TYPE, str(exc)))
    if spec.server.quantization == "int8" and profile.resource_name:
        # The CRD refuses the built-in GPU profiles by name; an admin's own is known here only.
        return Refused(
            Problem(
                INVALID_SPEC,
                f"spec.server.quantization: int8 runs on the CPU only (torch's int8 kernels), "
                f"and gpu.type {spec.gpu.type} is a GPU profile (it requests "
                f"{profile.resource_name}); use a profile without an accelerator, or "
                "quantization none",
            )
        )
    render = RenderInput(
        owner=owner,
        spec=spec,
        profile=profile,
        default_image=default_image,
        autoscaling=autoscaling,
        operator_namespace=operator_namespace,
    )
    not_allowed = policy.refusal(render)
    if not_allowed is not None:
        return Refused(not_allowed)
    if render.autoscaler == "keda" and not autoscaling.prometheus_address:
        chosen = "spec.autoscaling.autoscaler" if spec.autoscaling.autoscaler else "the default"
        return Refused(
            Problem(
                AUTOSCALER_NOT_CONFIGURED,
                f"spec.autoscaling: autoscaler keda ({chosen}) needs the Prometheus that "
                "KEDA's trigger queries, and the operator was given none (its "
                "--keda-prometheus-address, the chart's autoscaling.keda.prometheusAddress); "
                "ask your platform team, or set autoscaler hpa",
            )
        )
    return Planned(render, desired_children(render))

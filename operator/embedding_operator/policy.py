"""What the cluster's admins allow EmbeddingServices to run.

Creating an EmbeddingService is creating pods: the operator runs them with the image, env
(``valueFrom`` any Secret in the namespace), placement (node selector, affinity, tolerations),
resources, priority class and Service the CR asks for. In a cluster where CR authors are not
trusted with all of that, admins narrow it here, once, for every namespace the operator
watches (``--allowed-*`` and ``--allow-control-plane`` flags; Helm ``policy.*``):

* ``spec.server.image``: an allowlist of image patterns (empty: any);
* ``spec.scheduling.priorityClassName``: an allowlist of names (empty: any);
* ``spec.server.env``: names matching :data:`BUILTIN_ALLOWED_ENV` (the server's own
  ``EMBEDDING_SERVER_*`` knobs and the libraries' tuning variables), plus the patterns the
  admins add. Names that make the loader or the interpreter run code from a path
  (``LD_PRELOAD``, ``PYTHONPATH`` ...) are refused by the CRD itself (``spec.py`` states the
  same rule); the rest outside the list (``HF_ENDPOINT``, proxies, CA bundles: where the model
  comes from and whom the pod trusts) wait for an admin to allow them;
* placement on control-plane nodes (``allow_control_plane``, on by default): off, a CR may not
  select them (node selector or node affinity on their role labels), tolerate their taints
  (or every taint), or follow other namespaces' pods there (pod affinity across namespaces);
* ``spec.resources``: CPU, memory, ephemeral storage and huge pages; an extended resource only
  where an admin's pattern names it (accelerators come from the GPU profile);
* ``spec.service``: an allowlist of types and of annotation-key patterns (empty: any).

A CR outside them is refused before anything is applied, like any other refusal: Degraded
with ``ImageNotAllowed``, ``PriorityClassNotAllowed``, ``EnvNotAllowed``,
``PlacementNotAllowed``, ``ResourceNotAllowed`` or ``ServiceNotAllowed``, the field named,
and no child created or changed.

Pure, like the builders: ``plan`` (and so ``embedding-operator render``) applies it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from embedding_operator.builders.common import RenderInput
from embedding_operator.spec import EmbeddingServiceSpec
from embedding_operator.status import (
    ENV_NOT_ALLOWED,
    IMAGE_NOT_ALLOWED,
    PLACEMENT_NOT_ALLOWED,
    PRIORITY_CLASS_NOT_ALLOWED,
    RESOURCE_NOT_ALLOWED,
    SERVICE_NOT_ALLOWED,
    Problem,
)

BUILTIN_ALLOWED_ENV = (
    "EMBEDDING_SERVER_*",
    "HF_HUB_OFFLINE",
    "HF_HUB_DISABLE_*",
    "HF_HUB_DOWNLOAD_TIMEOUT",
    "HF_HUB_ETAG_TIMEOUT",
    "TRANSFORMERS_OFFLINE",
    "TRANSFORMERS_VERBOSITY",
    "TOKENIZERS_PARALLELISM",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_SOCKET_IFNAME",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_BSP_*",
    "OTEL_SDK_DISABLED",
    "TZ",
)
"""``spec.server.env`` names every policy allows: the server's settings and the libraries'
tuning knobs, the traces' naming, sampling and batching included (``spec.tracing``). Not
here, so an admin's to allow: where models come from (``HF_ENDPOINT``, proxies, CA bundles),
where traces go and with what credentials (``OTEL_EXPORTER_*``), the cache layout
(``HF_HOME``), the variables the operator sets itself (``HF_TOKEN``), and anything else."""

STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage", "hugepages-*")
"""What ``spec.resources`` may always name; anything else is an extended resource."""

CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
"""The role labels of control-plane nodes, which are also the keys of their taints."""

_SELECTING = ("In", "Exists", "Gt", "Lt")
"""Node-selector operators that draw a pod towards the nodes with the key (NotIn and
DoesNotExist keep it away)."""


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in patterns)


@dataclass(frozen=True)
class WorkloadPolicy:
    """The admins' limits; the defaults restrict only env names and extended resources.

    ``allowed_images`` are shell-style patterns matched against the whole image reference
    (``registry.example/embedding-server:*``, ``ghcr.io/embedding-operator/*``; ``*`` also
    matches ``/``, so end a registry prefix with ``/``). The operator's own ``--default-image``
    is always allowed: an admin configured it. ``allowed_priority_classes`` are exact names;
    a CR that sets no priority class is always allowed. Empty tuples allow any.

    ``allowed_env`` and ``allowed_extended_resources`` are patterns added to what is always
    allowed (:data:`BUILTIN_ALLOWED_ENV`, :data:`STANDARD_RESOURCES`): empty adds nothing.
    ``allowed_service_types`` (exact) and ``allowed_service_annotations`` (key patterns):
    empty allows any.
    """

    allowed_images: tuple[str, ...] = ()
    allowed_priority_classes: tuple[str, ...] = ()
    allowed_env: tuple[str, ...] = ()
    allow_control_plane: bool = True
    allowed_extended_resources: tuple[str, ...] = ()
    allowed_service_types: tuple[str, ...] = ()
    allowed_service_annotations: tuple[str, ...] = ()

    def refusal(self, render: RenderInput) -> Problem | None:
        """Why this spec may not run on this cluster, naming the field; None if it may."""
        spec = render.spec
        return (
            self._image(spec, render.default_image)
            or self._priority_class(spec)
            or self._env(spec)
            or self._placement(spec)
            or self._resources(spec)
            or self._service(spec)
        )

    def _image(self, spec: EmbeddingServiceSpec, default_image: str) -> Problem | None:
        image = spec.server.image
        if (
            image is None
            or image == default_image
            or not self.allowed_images
            or _matches(image, self.allowed_images)
        ):
            return None
        return Problem(
            IMAGE_NOT_ALLOWED,
            f"spec.server.image: {image!r} is not in the operator's image allowlist "
            f"({', '.join(self.allowed_images)}); use an allowed image, or unset "
            f"spec.server.image for the default {default_image!r}; nothing is applied "
            "until then",
        )

    def _priority_class(self, spec: EmbeddingServiceSpec) -> Problem | None:
        priority = spec.scheduling.priority_class_name
        if not priority or not self.allowed_priority_classes:
            return None
        if priority in self.allowed_priority_classes:
            return None
        return Problem(
            PRIORITY_CLASS_NOT_ALLOWED,
            f"spec.scheduling.priorityClassName: {priority!r} is not in the operator's "
            f"priority-class allowlist ({', '.join(self.allowed_priority_classes)}); use "
            "one of them or unset it; nothing is applied until then",
        )

    def _env(self, spec: EmbeddingServiceSpec) -> Problem | None:
        allowed = (*BUILTIN_ALLOWED_ENV, *self.allowed_env)
        for i, var in enumerate(spec.server.env):
            if not _matches(var.name, allowed):
                return Problem(
                    ENV_NOT_ALLOWED,
                    f"spec.server.env[{i}].name: {var.name!r} is not in the operator's "
                    f"environment allowlist ({', '.join(allowed)}); remove it, or ask the "
                    "cluster's admins to allow it (Helm policy.allowedEnv); nothing is "
                    "applied until then",
                )
        return None

    def _placement(self, spec: EmbeddingServiceSpec) -> Problem | None:
        field = None if self.allow_control_plane else next(_control_plane_placement(spec), None)
        if field is not None:
            return Problem(
                PLACEMENT_NOT_ALLOWED,
                f"{field}: the operator's policy keeps EmbeddingService pods off "
                f"control-plane nodes ({', '.join(CONTROL_PLANE_LABELS)}: selecting them, "
                "tolerating their taints or every taint, or following other namespaces' "
                "pods there); remove it; nothing is applied until then",
            )
        return None

    def _resources(self, spec: EmbeddingServiceSpec) -> Problem | None:
        allowed = (*STANDARD_RESOURCES, *self.allowed_extended_resources)
        for kind, amounts in (
            ("requests", spec.resources.requests),
            ("limits", spec.resources.limits),
        ):
            for name in amounts:
                if not _matches(name, allowed):
                    listed = ", ".join(self.allowed_extended_resources) or "none"
                    return Problem(
                        RESOURCE_NOT_ALLOWED,
                        f"spec.resources.{kind}[{name!r}]: extended resources need the "
                        f"operator's allowlist (allowed: {listed}); GPUs come from gpu.type "
                        "and its profile; remove it; nothing is applied until then",
                    )
        return None

    def _service(self, spec: EmbeddingServiceSpec) -> Problem | None:
        service = spec.service
        types = self.allowed_service_types
        if types and service.type not in types:
            return Problem(
                SERVICE_NOT_ALLOWED,
                f"spec.service.type: {service.type!r} is not among the Service types the "
                f"operator allows ({', '.join(types)}); nothing is applied until then",
            )
        keys = self.allowed_service_annotations
        for key in service.annotations:
            if keys and not _matches(key, keys):
                return Problem(
                    SERVICE_NOT_ALLOWED,
                    f"spec.service.annotations[{key!r}]: not in the operator's Service "
                    f"annotation allowlist ({', '.join(keys)}); nothing is applied until then",
                )
        return None


def _control_plane_placement(spec: EmbeddingServiceSpec) -> Iterator[str]:
    """The fields of ``spec`` that would put its pods on control-plane nodes."""
    scheduling = spec.scheduling
    for key in scheduling.node_selector:
        if key in CONTROL_PLANE_LABELS:
            yield f"spec.scheduling.nodeSelector[{key!r}]"
    for i, toleration in enumerate(scheduling.tolerations):
        blanket = not toleration.key and toleration.operator == "Exists"
        if blanket or toleration.key in CONTROL_PLANE_LABELS:
            yield f"spec.scheduling.tolerations[{i}]"
    affinity: Mapping[str, Any] = scheduling.affinity or {}
    node = affinity.get("nodeAffinity") or {}
    required = (node.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get(
        "nodeSelectorTerms"
    ) or []
    preferred = [
        p.get("preference") or {}
        for p in node.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    ]
    for term in [*required, *preferred]:
        for expression in [*(term.get("matchExpressions") or []), *(term.get("matchFields") or [])]:
            if (
                expression.get("key") in CONTROL_PLANE_LABELS
                and expression.get("operator") in _SELECTING
            ):
                yield "spec.scheduling.affinity.nodeAffinity"
    pod = affinity.get("podAffinity") or {}
    terms = [
        *(pod.get("requiredDuringSchedulingIgnoredDuringExecution") or []),
        *(
            p.get("podAffinityTerm") or {}
            for p in pod.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        ),
    ]
    for term in terms:
        if term.get("namespaces") or "namespaceSelector" in term:
            yield "spec.scheduling.affinity.podAffinity"


DEFAULT_POLICY = WorkloadPolicy()
"""No allowlists configured: what every cluster gets (env names and extended resources are
still limited to the built-in lists)."""

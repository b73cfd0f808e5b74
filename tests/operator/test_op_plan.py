"""plan(): the one path from a raw spec to children, shared by reconcile and render."""

from __future__ import annotations

from typing import Any

import pytest
from embedding_operator.builders import desired_children
from embedding_operator.builders.common import Owner
from embedding_operator.plan import Planned, Refused, plan
from embedding_operator.policy import WorkloadPolicy
from embedding_operator.profiles import GpuProfiles

from tests.support.operator import render_input

M = {"name": "m"}
OWNER = Owner(name="emb", namespace="ns", uid="uid-1", generation=1)


def test_a_good_spec_plans_the_builders_children() -> None:
    spec = {"model": {"name": "m"}, "gpu": {"type": "l4"}}
    planned = plan(OWNER, spec, GpuProfiles.builtin(), "img:1")
    assert isinstance(planned, Planned)
    assert planned.render.default_image == "img:1"
    expected = desired_children(render_input(spec))
    assert [m["kind"] for m in planned.children.present] == [m["kind"] for m in expected.present]
    assert planned.children.absent == expected.absent


@pytest.mark.parametrize(
    ("spec", "reason", "field"),
    [
        ({"model": {"name": ""}}, "InvalidSpec", "spec.model.name"),
        ({"model": M, "gpu": {"type": "tpu"}}, "UnknownGPUType", "spec.gpu.type"),
    ],
)
def test_refusals_name_the_field(spec: dict[str, Any], reason: str, field: str) -> None:
    refused = plan(OWNER, spec, GpuProfiles.builtin())
    assert isinstance(refused, Refused)
    assert refused.problem.reason == reason and refused.problem.message.startswith(field)
    assert not refused.problem.retryable


@pytest.mark.parametrize("gpu", ["h100", "cpu"])
def test_tensor_parallelism_on_the_bundled_server_is_planned(gpu: str) -> None:
    spec = {"model": M, "gpu": {"type": gpu}, "parallelism": {"tensorParallelSize": 2}}
    planned = plan(OWNER, spec, GpuProfiles.builtin(), "img:1")
    assert isinstance(planned, Planned)
    (deployment,) = [m for m in planned.children.present if m["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "img:1"
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "2"


# --- int8 and the admins' own profiles -----------------------------------------------------------

ADMIN_PROFILES = GpuProfiles.from_document(
    {
        "profiles": {
            "cpu-amx": {"resourceName": "", "nodeSelector": {"cpu.example/amx": "true"}},
            "mi300x": {"resourceName": "amd.com/gpu"},
        }
    }
)
INT8 = {"model": M, "server": {"quantization": "int8"}}


def test_int8_on_an_admins_gpu_profile_is_refused_naming_the_field() -> None:
    """The CRD refuses int8 on the built-in GPU profiles by name; one the admins added is
    known to the operator only, which refuses it with the same field before any pod would
    crash-loop on the server's own refusal."""
    refused = plan(OWNER, {**INT8, "gpu": {"type": "mi300x"}}, ADMIN_PROFILES)
    assert isinstance(refused, Refused)
    assert refused.problem.reason == "InvalidSpec" and not refused.problem.retryable
    assert refused.problem.message.startswith("spec.server.quantization: int8 runs on the CPU")
    assert "mi300x" in refused.problem.message and "amd.com/gpu" in refused.problem.message


def test_int8_on_a_cpu_profile_is_planned_with_the_flag() -> None:
    for gpu in ("cpu", "cpu-amx"):
        planned = plan(OWNER, {**INT8, "gpu": {"type": gpu}}, ADMIN_PROFILES, "img:1")
        assert isinstance(planned, Planned), gpu
        (deployment,) = [m for m in planned.children.present if m["kind"] == "Deployment"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert args[args.index("--quantization") + 1] == "int8"
        assert args[args.index("--device") + 1] == "cpu"


# --- the admins' allowlist (policy.py) ---------------------------------------------------------

POLICY = WorkloadPolicy(
    allowed_images=("registry.example/embedding-server:*",),
    allowed_priority_classes=("inference",),
)


@pytest.mark.parametrize(
    ("server", "scheduling", "reason", "field"),
    [
        ({"image": "evil.example/miner:1"}, {}, "ImageNotAllowed", "spec.server.image"),
        # A glob is matched against the whole reference, not a prefix of it.
        (
            {"image": "registry.example/embedding-server-x:1"},
            {},
            "ImageNotAllowed",
            "spec.server.image",
        ),
        (
            {},
            {"priorityClassName": "system-node-critical"},
            "PriorityClassNotAllowed",
            "spec.scheduling.priorityClassName",
        ),
    ],
)
def test_allowlist_refuses_with_the_field(
    server: dict[str, Any], scheduling: dict[str, Any], reason: str, field: str
) -> None:
    spec = {"model": M, "server": server, "scheduling": scheduling}
    refused = plan(OWNER, spec, GpuProfiles.builtin(), "img:1", POLICY)
    assert isinstance(refused, Refused)
    assert refused.problem.reason == reason and not refused.problem.retryable
    assert refused.problem.message.startswith(f"{field}: ")
    assert "nothing is applied" in refused.problem.message
    # No allowlist configured: the same spec plans.
    assert isinstance(plan(OWNER, spec, GpuProfiles.builtin(), "img:1"), Planned)


@pytest.mark.parametrize(
    ("server", "scheduling"),
    [
        ({}, {}),  # the default image, no priority class
        ({"image": "img:1"}, {}),  # the default image, named explicitly
        ({"image": "registry.example/embedding-server:2.0"}, {"priorityClassName": "inference"}),
    ],
)
def test_allowlist_admits(server: dict[str, Any], scheduling: dict[str, Any]) -> None:
    spec = {"model": M, "server": server, "scheduling": scheduling}
    assert isinstance(plan(OWNER, spec, GpuProfiles.builtin(), "img:1", POLICY), Planned)


# --- server.env: an allowlist of names (M5) ----------------------------------------------------


@pytest.mark.parametrize(
    "name", ["PYTHONPATH", "PYTHONSTARTUP", "LD_PRELOAD", "LD_LIBRARY_PATH", "OPENSSL_CONF"]
)
def test_env_that_loads_code_is_refused_whatever_the_policy(name: str) -> None:
    """Names that make the loader or the interpreter run code from a path: the CRD's CEL
    rule refuses them at kubectl apply, and the spec model states the same rule."""
    env = [{"name": "OMP_NUM_THREADS", "value": "4"}, {"name": name, "value": "/cache/x"}]
    spec = {"model": M, "server": {"env": env}}
    wide_open = WorkloadPolicy(allowed_env=("*",))
    refused = plan(OWNER, spec, GpuProfiles.builtin(), "img:1", wide_open)
    assert isinstance(refused, Refused)
    assert refused.problem.reason == "InvalidSpec"
    assert refused.problem.message.startswith("spec.server.env.1.name: "), refused.problem.message
    assert name in refused.problem.message


@pytest.mark.parametrize(
    "name",
    ["HF_ENDPOINT", "HTTPS_PROXY", "SSL_CERT_FILE", "OTEL_EXPORTER_OTLP_HEADERS", "MY_SETTING"],
)
def test_env_outside_the_allowlist_is_refused_unless_the_policy_widens_it(name: str) -> None:
    env = [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": name, "value": "x"}]
    spec = {"model": M, "server": {"env": env}}
    refused = plan(OWNER, spec, GpuProfiles.builtin(), "img:1")
    assert isinstance(refused, Refused)
    assert refused.problem.reason == "EnvNotAllowed" and not refused.problem.retryable
    assert refused.problem.message.startswith("spec.server.env[1].name: "), refused.problem.message
    assert repr(name) in refused.problem.message and "nothing is applied" in refused.problem.message
    widened = WorkloadPolicy(allowed_env=(name,))
    assert isinstance(plan(OWNER, spec, GpuProfiles.builtin(), "img:1", widened), Planned)


def test_the_default_env_allowlist_admits_the_servers_own_knobs() -> None:
    env = [
        {"name": "EMBEDDING_SERVER_MAX_BATCH_TOKENS", "value": "8192"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "OMP_NUM_THREADS", "value": "4"},
        {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
        {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": "0.05"},
        {"name": "OTEL_BSP_MAX_QUEUE_SIZE", "value": "8192"},
    ]
    planned = plan(OWNER, {"model": M, "server": {"env": env}}, GpuProfiles.builtin(), "img:1")
    assert isinstance(planned, Planned)


# --- placement, extended resources and the Service (L3) ----------------------------------------

CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
NO_CONTROL_PLANE = WorkloadPolicy(allow_control_plane=False)


@pytest.mark.parametrize(
    ("scheduling", "field"),
    [
        ({"nodeSelector": {CONTROL_PLANE: ""}}, f"spec.scheduling.nodeSelector['{CONTROL_PLANE}']"),
        (
            {"nodeSelector": {"node-role.kubernetes.io/master": ""}},
            "spec.scheduling.nodeSelector['node-role.kubernetes.io/master']",
        ),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": CONTROL_PLANE, "operator": "Exists"}]}
                            ]
                        }
                    }
                }
            },
            "spec.scheduling.affinity.nodeAffinity",
        ),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 1,
                                "preference": {
                                    "matchExpressions": [
                                        {"key": CONTROL_PLANE, "operator": "In", "values": [""]}
                                    ]
                                },
                            }
                        ]
                    }
                }
            },
            "spec.scheduling.affinity.nodeAffinity",
        ),
        (
            {"tolerations": [{"key": CONTROL_PLANE, "operator": "Exists"}]},
            "spec.scheduling.tolerations[0]",
        ),
        ({"tolerations": [{"operator": "Exists"}]}, "spec.scheduling.tolerations[0]"),
        (
            {
                "affinity": {
                    "podAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "labelSelector": {"matchLabels": {"component": "kube-apiserver"}},
                                "namespaces": ["kube-system"],
                                "topologyKey": "kubernetes.io/hostname",
                            }
                        ]
                    }
                }
            },
            "spec.scheduling.affinity.podAffinity",
        ),
    ],
)
def test_policy_keeps_pods_off_control_plane_nodes(scheduling: dict[str, Any], field: str) -> None:
    spec = {"model": M, "scheduling": scheduling}
    refused = plan(OWNER, spec, GpuProfiles.builtin(), "img:1", NO_CONTROL_PLANE)
    assert isinstance(refused, Refused)
    assert refused.problem.reason == "PlacementNotAllowed"
    assert refused.problem.message.startswith(f"{field}"), refused.problem.message
    assert "nothing is applied" in refused.problem.message
    # The default policy leaves placement to the CR (as before).
    assert isinstance(plan(OWNER, spec, GpuProfiles.builtin(), "img:1"), Planned)


def test_policy_without_control_plane_still_admits_ordinary_placement() -> None:
    scheduling = {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": CONTROL_PLANE, "operator": "DoesNotExist"}]}
                    ]
                }
            },
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 1,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": {"app": "x"}},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            },
        },
    }
    spec = {"model": M, "gpu": {"type": "h100"}, "scheduling": scheduling}
    assert isinstance(plan(OWNER, spec, GpuProfiles.builtin(), "img:1", NO_CONTROL_PLANE), Planned)


@pytest.mark.parametrize("kind", ["requests", "limits"])
def test_extended_resources_need_the_policy(kind: str) -> None:
    """spec.resources is for CPU and memory: accelerators come from the GPU profile, and an
    extended resource the admins did not list (another vendor's GPUs, MIG slices, FPGAs) is
    refused, naming it."""
    spec = {"model": M, "resources": {kind: {"cpu": "2", "memory": "4Gi", "amd.com/gpu": 1}}}
    refused = plan(OWNER, spec, GpuProfiles.builtin(), "img:1")
    assert isinstance(refused, Refused)
    assert refused.problem.reason == "ResourceNotAllowed"
    assert refused.problem.message.startswith(f"spec.resources.{kind}['amd.com/gpu']: ")
    allowed = WorkloadPolicy(allowed_extended_resources=("amd.com/*",))
    assert isinstance(plan(OWNER, spec, GpuProfiles.builtin(), "img:1", allowed), Planned)
    plain = {"model": M, "resources": {kind: {"cpu": "2", "ephemeral-storage": "1Gi"}}}
    assert isinstance(plan(OWNER, plain, GpuProfiles.builtin(), "img:1"), Planned)


SERVICE_POLICY = WorkloadPolicy(
    allowed_service_types=("ClusterIP",),
    allowed_service_annotations=("prometheus.io/*",),
)


@pytest.mark.parametrize(
    ("service", "field"),
    [
        ({"type": "LoadBalancer"}, "spec.service.type"),
        (
            {"annotations": {"service.beta.kubernetes.io/aws-load-balancer-scheme": "x"}},
            "spec.service.annotations['service.beta.kubernetes.io/aws-load-balancer-scheme']",
        ),
    ],
)
def test_policy_restricts_the_service_type_and_annotations(
    service: dict[str, Any], field: str
) -> None:
    spec = {"model": M, "service": service}
    refused = plan(OWNER, spec, GpuProfiles.builtin(), "img:1", SERVICE_POLICY)
    assert isinstance(refused, Refused)
    assert refused.problem.reason == "ServiceNotAllowed"
    assert refused.problem.message.startswith(f"{field}: "), refused.problem.message
    assert isinstance(plan(OWNER, spec, GpuProfiles.builtin(), "img:1"), Planned)
    ok = {"model": M, "service": {"annotations": {"prometheus.io/scrape": "true"}}}
    assert isinstance(plan(OWNER, ok, GpuProfiles.builtin(), "img:1", SERVICE_POLICY), Planned)


ALIASES = "embedding-operator.dev/aliases"


def test_the_deprecated_aliases_annotation_adds_its_names_to_the_fields() -> None:
    """The annotation's names reach the server too (the gateway routes them to its pods),
    after the field's, without repeats or the served name."""
    spec = {"model": {"name": "BAAI/bge-small-en-v1.5"}, "servedModelAliases": ["a", "b"]}
    annotations = {ALIASES: " b, c ,bge-small-en-v1.5,,d"}
    planned = plan(OWNER, spec, GpuProfiles.builtin(), annotations=annotations)
    assert isinstance(planned, Planned)
    assert planned.render.spec.served_model_aliases == ["a", "b", "c", "d"]
    (deployment,) = [m for m in planned.children.present if m["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--served-model-aliases") + 1] == "a,b,c,d"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("good, has space", "is not a model name"),
        (",".join(f"n{i}" for i in range(17)), "more than 16 aliases"),
    ],
)
def test_an_annotation_alias_the_server_could_not_take_refuses_the_spec(
    value: str, expected: str
) -> None:
    refused = plan(OWNER, {"model": M}, GpuProfiles.builtin(), annotations={ALIASES: value})
    assert isinstance(refused, Refused)
    assert refused.problem.reason == "InvalidSpec"
    assert refused.problem.message.startswith(f"metadata.annotations[{ALIASES}]: ")
    assert expected in refused.problem.message

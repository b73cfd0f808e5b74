"""Builders: the child manifests a user gets for a spec (pure, no cluster)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
from embedding_operator.builders import desired_children
from embedding_operator.builders.common import AutoscalingDefaults, Owner, pod_name_regex
from embedding_operator.builders.deployment import build_deployment, server_args
from embedding_operator.builders.hpa import build_hpa
from embedding_operator.builders.keda import build_scaled_object
from embedding_operator.builders.pdb import build_pdb, wants_pdb
from embedding_operator.builders.pvc import build_pvc
from embedding_operator.builders.service import build_service
from embedding_operator.profiles import GpuProfiles

from tests.support.operator import render_input

MODEL = {"name": "BAAI/bge-small-en-v1.5"}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_server_contract_flags() -> None:
    render = render_input(
        {
            "model": {
                "name": "hf://BAAI/bge-small-en-v1.5",
                "revision": "abc123",
                "trustRemoteCode": True,
            },
            "embedding": {
                "pooling": "cls",
                "normalize": False,
                "dimensions": 256,
                "matryoshkaDimensions": [128, 256],
                "maxInputTokens": 512,
                "prompts": {"defaultName": "query"},
            },
            "server": {
                "dtype": "float16",
                "backend": "transformers",
                "maxBatchTokens": 8192,
                "maxBatchSize": 64,
                "maxQueueTokens": 65536,
                "maxRequestTokens": 16384,
                "bulkBatchMs": 25,
                "extraArgs": ["--log-level", "debug"],
            },
        }
    )
    args = server_args(render)
    assert args[0] == "serve"
    assert _flag(args, "--model") == "BAAI/bge-small-en-v1.5"  # hf:// stripped
    assert _flag(args, "--revision") == "abc123"
    assert _flag(args, "--served-model-name") == "bge-small-en-v1.5"
    assert _flag(args, "--host") == "0.0.0.0" and _flag(args, "--port") == "8000"
    assert _flag(args, "--log-format") == "json"
    assert _flag(args, "--dtype") == "float16"
    assert _flag(args, "--device") == "cpu"  # named, so the server never guesses
    assert _flag(args, "--pooling") == "cls"
    assert "--no-normalize" in args and "--normalize" not in args
    assert "--trust-remote-code" in args
    assert _flag(args, "--backend") == "transformers"
    assert _flag(args, "--dimensions") == "256"
    assert _flag(args, "--matryoshka-dimensions") == "128,256"
    assert _flag(args, "--max-model-len") == "512"
    assert _flag(args, "--default-prompt-name") == "query"
    assert _flag(args, "--max-batch-tokens") == "8192"
    assert _flag(args, "--max-batch-size") == "64"
    assert _flag(args, "--max-queue-tokens") == "65536"
    assert _flag(args, "--max-request-tokens") == "16384"
    assert _flag(args, "--bulk-batch-ms") == "25"
    assert _flag(args, "--tensor-parallel-size") == "1"
    assert _flag(args, "--cache-dir") == "/cache"
    assert args[-2:] == ["--log-level", "debug"]


def test_prefix_cache_renders_as_bytes_and_is_absent_unless_set() -> None:
    args = server_args(render_input({"model": MODEL, "server": {"prefixCache": "256Mi"}}))
    assert _flag(args, "--prefix-cache-bytes") == str(256 * 1024 * 1024)
    assert "--prefix-cache-bytes" not in server_args(render_input({"model": MODEL}))


def test_a_clusterip_service_renders_its_names_as_the_allowed_hosts() -> None:
    args = server_args(render_input({"model": MODEL}, name="emb", namespace="team-a"))
    # And those of <name>-next, the Service a model change serves the new model by.
    assert _flag(args, "--allowed-hosts").split(",") == [
        "emb",
        "emb.team-a",
        "emb.team-a.svc",
        "emb.team-a.svc.cluster.local",
        "emb-next",
        "emb-next.team-a",
        "emb-next.team-a.svc",
        "emb-next.team-a.svc.cluster.local",
        "localhost",
    ]
    # An Ingress's own name is the user's to add: extra args come last, and the last wins.
    spec = {"model": MODEL, "server": {"extraArgs": ["--allowed-hosts=*"]}}
    assert server_args(render_input(spec))[-1] == "--allowed-hosts=*"


def test_aliases_become_the_servers_flag_beside_the_served_name() -> None:
    spec = {"model": MODEL, "servedModelName": "bge", "servedModelAliases": ["small", "b/s:1"]}
    args = server_args(render_input(spec))
    assert _flag(args, "--served-model-name") == "bge"
    assert _flag(args, "--served-model-aliases") == "small,b/s:1"


@pytest.mark.parametrize("service_type", ["NodePort", "LoadBalancer"])
def test_a_service_reached_from_outside_leaves_host_checking_off(service_type: str) -> None:
    args = server_args(render_input({"model": MODEL, "service": {"type": service_type}}))
    assert "--allowed-hosts" not in args


def test_unset_knobs_leave_server_defaults() -> None:
    args = server_args(render_input({"model": MODEL}))
    for flag in (
        "--served-model-aliases",
        "--revision",
        "--normalize",
        "--no-normalize",
        "--dimensions",
        "--max-batch-tokens",
        "--max-model-len",
        "--trust-remote-code",
        "--backend",  # auto, the server's own default
        "--quantization",  # none, the server's own default
    ):
        assert flag not in args


def test_media_renders_the_servers_image_flags() -> None:
    """spec.media reaches the server's media policy; maxImageBytes as a quantity becomes the
    bytes --max-image-bytes takes, and the user's extraArgs still come last."""
    media = {
        "allowedDomains": ["images.example.com", "*.cdn.example.org"],
        "maxImagesPerRequest": 4,
        "maxImageBytes": "2Mi",
        "maxImagePixels": 4_000_000,
        "fetchTimeoutSeconds": 2.5,
    }
    spec = {"model": MODEL, "media": media, "server": {"extraArgs": ["--log-level", "debug"]}}
    args = server_args(render_input(spec))
    assert _flag(args, "--allowed-media-domains") == "images.example.com,*.cdn.example.org"
    assert _flag(args, "--max-images-per-request") == "4"
    assert _flag(args, "--max-image-bytes") == str(2 * 1024 * 1024)
    assert _flag(args, "--max-image-pixels") == "4000000"
    assert _flag(args, "--media-fetch-timeout") == "2.5"
    assert args[-2:] == ["--log-level", "debug"]


@pytest.mark.parametrize("media", [None, {}, {"allowedDomains": []}])
def test_without_media_settings_the_server_keeps_data_uris_only(media: Any) -> None:
    spec: dict[str, Any] = {"model": MODEL}
    if media is not None:
        spec["media"] = media
    args = server_args(render_input(spec))
    for flag in (
        "--allowed-media-domains",
        "--max-images-per-request",
        "--max-image-bytes",
        "--max-image-pixels",
        "--media-fetch-timeout",
    ):
        assert flag not in args


@pytest.mark.parametrize(("quantity", "expected"), [(8388608, 8388608), ("500k", 500000)])
def test_max_image_bytes_takes_an_integer_or_a_quantity(quantity: Any, expected: int) -> None:
    args = server_args(render_input({"model": MODEL, "media": {"maxImageBytes": quantity}}))
    assert _flag(args, "--max-image-bytes") == str(expected)


def test_int8_renders_the_servers_flag_beside_the_dtype() -> None:
    spec = {"model": MODEL, "server": {"quantization": "int8", "dtype": "float32"}}
    args = server_args(render_input(spec))
    assert _flag(args, "--quantization") == "int8"
    assert _flag(args, "--dtype") == "float32" and _flag(args, "--device") == "cpu"
    # none is left out: an operator upgrade does not touch the pods of existing services.
    spec["server"]["quantization"] = "none"
    assert "--quantization" not in server_args(render_input(spec))


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_backend_renders_its_flag(backend: str) -> None:
    args = server_args(render_input({"model": MODEL, "server": {"backend": backend}}))
    assert _flag(args, "--backend") == backend


def test_deployment_for_gpu_profile() -> None:
    deployment = build_deployment(
        render_input(
            {
                "model": MODEL,
                "gpu": {"type": "l4"},
                "parallelism": {"tensorParallelSize": 2},
                "scheduling": {
                    "nodeSelector": {"pool": "embed"},
                    "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                    "priorityClassName": "high",
                },
                "resources": {"requests": {"cpu": 4, "memory": "16Gi"}},
            }
        )
    )
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4", "pool": "embed"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert {"key": "dedicated", "operator": "Exists"} in pod["tolerations"]
    assert pod["priorityClassName"] == "high"
    assert _flag(container["args"], "--tensor-parallel-size") == "2"
    # A GPU pod names its device: without usable CUDA the server fails at start, loudly.
    assert _flag(container["args"], "--device") == "cuda"


H100 = {"model": MODEL, "gpu": {"type": "h100"}}


@pytest.mark.parametrize(
    ("spec", "workers"),
    [
        ({"model": MODEL}, "1"),
        (H100, "4"),
        ({"model": MODEL, "gpu": {"type": "l4"}}, "2"),
        ({"model": MODEL, "gpu": {"type": "t4"}}, "1"),
        ({**H100, "server": {"apiWorkers": 2}}, "2"),
        ({"model": MODEL, "server": {"apiWorkers": 3}}, "3"),
    ],
    ids=["cpu-default", "h100-default", "l4-default", "t4-default", "h100-own", "cpu-own"],
)
def test_front_end_workers_follow_the_spec_else_the_gpu_profile(
    spec: dict[str, Any], workers: str
) -> None:
    """A fast GPU needs several front-end processes to stay busy; a CPU pod does not."""
    assert _flag(server_args(render_input(spec)), "--api-workers") == workers
    # Several front-ends drain in two stages; the kubelet must not kill the second.
    pod = build_deployment(render_input(spec))["spec"]["template"]["spec"]
    pre_stop = _container(build_deployment(render_input(spec)))["lifecycle"]["preStop"]
    drain = pod["terminationGracePeriodSeconds"] - pre_stop["sleep"]["seconds"]
    assert drain > (60 if workers != "1" else 30)


def test_a_profile_overlay_sets_front_end_workers_and_keeps_the_rest() -> None:
    profiles = GpuProfiles.from_document({"profiles": {"h100": {"apiWorkers": 8}}})
    h100 = profiles.resolve("h100")
    assert h100.api_workers == 8
    assert h100.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert profiles.resolve("l4").api_workers == 2


@pytest.mark.parametrize(
    ("spec", "gpus", "shm"),
    [
        (H100, "1", "1Gi"),
        ({**H100, "parallelism": {"tensorParallelSize": 4}}, "4", "4Gi"),
        (
            {**H100, "parallelism": {"tensorParallelSize": 4}, "server": {"shmSize": "6Gi"}},
            "4",
            "6Gi",
        ),
        ({"model": MODEL, "parallelism": {"tensorParallelSize": 2}}, None, "2Gi"),
    ],
    ids=["tp1", "tp4-bundled", "tp4-own-shm", "tp2-cpu"],
)
def test_tensor_parallel_pod_asks_for_a_gpu_and_shm_per_rank(
    spec: dict[str, Any], gpus: str | None, shm: str
) -> None:
    render = render_input(spec)
    deployment = build_deployment(render)
    container = _container(deployment)
    size = str(render.spec.parallelism.tensor_parallel_size)
    assert container["image"] == render.default_image  # the bundled server
    assert _flag(container["args"], "--tensor-parallel-size") == size
    assert container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") == gpus
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_deployment_for_cpu_has_no_gpu() -> None:
    deployment = build_deployment(render_input({"model": MODEL}))
    pod = deployment["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(_container(deployment).get("resources"))
    assert "nodeSelector" not in pod and "tolerations" not in pod


def test_deployment_probes_security_volumes_labels() -> None:
    render = render_input(
        {"model": MODEL, "server": {"startupTimeoutSeconds": 600, "shmSize": "2Gi"}}
    )
    deployment = build_deployment(render)
    container = _container(deployment)
    pod = deployment["spec"]["template"]["spec"]
    # The probes go to the probe port, outside the client port's connection cap.
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "probe"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "probe"}
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/ready", "port": "probe"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "probe", "containerPort": 8001, "protocol": "TCP"},
    ]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # Read-only root; every path the server writes is a volume.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    # Every path the server writes, and the golden record it reads (read-only).
    assert mounts == {
        "/cache": "model-cache",
        "/dev/shm": "dshm",
        "/tmp": "tmp",
        "/etc/embedding-server/golden": "golden",
    }
    golden_mount = next(m for m in container["volumeMounts"] if m["name"] == "golden")
    assert golden_mount["readOnly"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HOME"].startswith("/cache/")
    # Endpoints go first (preStop), then the server drains; the kubelet waits for both.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 5
    assert pod["terminationGracePeriodSeconds"] > pre_stop + 30
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {}}
    # Optional: the first pod of a model starts before anything is recorded.
    assert volumes["golden"]["configMap"]["optional"] is True
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }
    labels = deployment["metadata"]["labels"]
    assert labels["app.kubernetes.io/instance"] == "emb"
    assert labels["app.kubernetes.io/managed-by"] == "embedding-operator"
    assert {"app.kubernetes.io/name", "app.kubernetes.io/component"} <= set(labels)
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize(
    ("resources", "limits"),
    [
        # A memory request is what the pod may count on: it becomes the limit.
        ({"requests": {"cpu": "1", "memory": "4Gi"}}, {"memory": "4Gi"}),
        # An explicit limit wins.
        ({"requests": {"memory": "4Gi"}, "limits": {"memory": "6Gi"}}, {"memory": "6Gi"}),
        # Nothing known about the model's footprint: no guessed limit (see the module doc).
        ({}, None),
        ({"requests": {"cpu": "1"}}, None),
    ],
)
def test_memory_limit_defaults_to_the_request(
    resources: dict[str, Any], limits: dict[str, str] | None
) -> None:
    spec = {"model": MODEL, "gpu": {"type": "cpu"}, "resources": resources}
    got = _container(build_deployment(render_input(spec)))["resources"].get("limits")
    assert got == limits


def test_network_policy_admits_only_chosen_namespaces() -> None:
    from embedding_operator.builders.networkpolicy import build_network_policy

    spec = {
        "model": MODEL,
        "networkPolicy": {"enabled": True, "allowedNamespaces": ["apps", "monitoring"]},
    }
    render = render_input(spec)
    policy = build_network_policy(render)
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["name"] == "emb"
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {
            "app.kubernetes.io/name": "embedding-server",
            "app.kubernetes.io/instance": "emb",
        }
    }
    assert policy["spec"]["policyTypes"] == ["Ingress"], "egress (Hub downloads) is untouched"
    # Clients get the client port only: the kubelet reaches the probe port as node traffic,
    # which a NetworkPolicy never blocks, and client namespaces cannot crowd it. The probe
    # port admits the operator's namespace, which reads the pods' golden vectors there.
    rule, operator_rule = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert operator_rule["ports"] == [{"protocol": "TCP", "port": 8001}]
    assert operator_rule["from"] == [
        {
            "namespaceSelector": {
                "matchExpressions": [
                    {
                        "key": "kubernetes.io/metadata.name",
                        "operator": "In",
                        "values": ["embedding-operator"],
                    }
                ]
            }
        }
    ]
    (peer,) = rule["from"]
    assert peer == {
        "namespaceSelector": {
            "matchExpressions": [
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "In",
                    "values": ["apps", "monitoring", "ns"],
                }
            ]
        }
    }
    # The selector is the Deployment's own pod selector.
    deployment = build_deployment(render)
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]

    off = desired_children(render_input({"model": MODEL}))
    assert "NetworkPolicy" not in [m["kind"] for m in off.present]
    assert "NetworkPolicy" in [r.kind for r in off.absent]


def test_network_policy_leaves_image_fetches_to_listed_hosts_open() -> None:
    """With media.allowedDomains the server fetches image URLs: the operator's NetworkPolicy
    restricts ingress only, so it never blocks that egress (docs/security.md)."""
    from embedding_operator.builders.networkpolicy import build_network_policy

    spec = {
        "model": MODEL,
        "networkPolicy": {"enabled": True},
        "media": {"allowedDomains": ["images.example.com"]},
    }
    policy = build_network_policy(render_input(spec))["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert "egress" not in policy


def test_network_policy_namespaces_need_enabled() -> None:
    from embedding_operator.spec import InvalidSpecError, parse_spec

    with pytest.raises(InvalidSpecError, match=r"spec\.networkPolicy: .*needs enabled"):
        parse_spec({"model": MODEL, "networkPolicy": {"allowedNamespaces": ["apps"]}})


def test_owner_reference_on_every_child() -> None:
    render = render_input(
        {
            "model": MODEL,
            "replicas": 3,
            "autoscaling": {"enabled": True},
            "modelCache": {"mode": "pvc", "size": "10Gi"},
            "networkPolicy": {"enabled": True},
        }
    )
    children = desired_children(render).present
    assert [c["kind"] for c in children] == [
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
    ]
    for child in children:
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingService",
            "name": "emb",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "ns"


def test_gpu_safe_rollout_by_default() -> None:
    strategy = build_deployment(render_input({"model": MODEL}))["spec"]["strategy"]
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


def test_replicas_left_to_the_hpa_when_autoscaling() -> None:
    fixed = build_deployment(render_input({"model": MODEL, "replicas": 3}))
    assert fixed["spec"]["replicas"] == 3
    auto = build_deployment(
        render_input({"model": MODEL, "replicas": 3, "autoscaling": {"enabled": True}})
    )
    assert "replicas" not in auto["spec"]


@pytest.mark.parametrize(
    ("metric", "target", "name", "value"),
    [
        (None, None, "embedding_server_backlog_seconds", "2"),  # the default for a new spec
        ("backlogSeconds", 0.5, "embedding_server_backlog_seconds", "500m"),
        ("queueRequests", None, "embedding_server_queue_requests", "8"),
        ("queueTokens", None, "embedding_server_queue_tokens", "4096"),
        ("queueTokens", 9000, "embedding_server_queue_tokens", "9000"),
    ],
)
def test_hpa_on_the_servers_load(
    metric: str | None, target: float | None, name: str, value: str
) -> None:
    auto: dict[str, Any] = {
        "enabled": True,
        "minReplicas": 2,
        "maxReplicas": 6,
        "scaleDownStabilizationSeconds": 120,
    }
    if metric is not None:
        auto["metric"] = metric
    if target:
        auto["targetBacklogSeconds" if metric == "backlogSeconds" else "targetPerPod"] = target
    hpa = build_hpa(render_input({"model": MODEL, "autoscaling": auto}))
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "emb"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    assert spec["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": name},
                "target": {"type": "AverageValue", "averageValue": value},
            },
        }
    ]
    assert spec["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 120}}


@pytest.mark.parametrize(
    ("extra", "value"),
    [
        ({"gpu": {"type": "h100"}}, "32768"),  # two of the server's 16384-token GPU batches
        ({"server": {"maxBatchTokens": 3000}}, "6000"),  # two of the pod's own batches
        ({"embedding": {"maxInputTokens": 8192}}, "16384"),  # a batch holds one maximal input
    ],
)
def test_hpa_queue_tokens_default_follows_the_batch_budget(
    extra: dict[str, Any], value: str
) -> None:
    auto = {"enabled": True, "maxReplicas": 4, "metric": "queueTokens"}
    hpa = build_hpa(render_input({"model": MODEL, "autoscaling": auto, **extra}))
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == value


def test_hpa_behavior_passthrough() -> None:
    behavior = {"scaleUp": {"policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}}
    hpa = build_hpa(
        render_input({"model": MODEL, "autoscaling": {"enabled": True, "behavior": behavior}})
    )
    assert hpa["spec"]["behavior"] == behavior


def test_pdb_only_with_more_than_one_replica() -> None:
    assert not wants_pdb(render_input({"model": MODEL, "replicas": 1}))
    assert wants_pdb(render_input({"model": MODEL, "replicas": 2}))
    assert wants_pdb(
        render_input({"model": MODEL, "autoscaling": {"enabled": True, "maxReplicas": 3}})
    )
    desired = desired_children(render_input({"model": MODEL}))
    assert {r.kind for r in desired.absent} == {
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ScaledObject",
        "PersistentVolumeClaim",
        "NetworkPolicy",
    }


def test_pdb_never_protects_a_pod_that_is_not_ready() -> None:
    """A service whose pods never become ready (a model that will not load, a bad image)
    must not block node drains: its unready pods may always be evicted, and the budget
    counts only healthy ones."""
    pdb = build_pdb(render_input({"model": MODEL, "replicas": 3}))
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_service() -> None:
    svc = build_service(
        render_input(
            {
                "model": MODEL,
                "service": {"type": "LoadBalancer", "port": 8080, "annotations": {"a": "b"}},
            }
        )
    )
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    assert svc["metadata"]["annotations"] == {"a": "b"}
    default = build_service(render_input({"model": MODEL}))
    assert default["spec"]["type"] == "ClusterIP"
    assert default["spec"]["ports"][0]["port"] == 80


def test_model_cache_modes() -> None:
    pvc_render = render_input(
        {
            "model": MODEL,
            "modelCache": {
                "mode": "pvc",
                "size": "50Gi",
                "storageClassName": "fast",
                "accessModes": ["ReadWriteMany"],
            },
        }
    )
    pvc = build_pvc(pvc_render)
    assert pvc["metadata"]["name"] == "emb-model-cache"
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "fast",
        "resources": {"requests": {"storage": "50Gi"}},
    }
    volumes = {
        v["name"]: v for v in build_deployment(pvc_render)["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "emb-model-cache"}
    existing = build_deployment(
        render_input(
            {"model": MODEL, "modelCache": {"mode": "existing", "claimName": "shared-hf-cache"}}
        )
    )
    volumes = {v["name"]: v for v in existing["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "shared-hf-cache"}
    container = existing["spec"]["template"]["spec"]["containers"][0]
    cache_mount = next(m for m in container["volumeMounts"] if m["name"] == "model-cache")
    assert not cache_mount.get("readOnly")
    assert "HF_HUB_OFFLINE" not in {e["name"] for e in container["env"]}


def test_read_only_model_cache_is_mounted_read_only_with_the_hub_off() -> None:
    """A cache filled beforehand: the claim and the mount read-only, HF_HUB_OFFLINE=1 (a
    user's own value of it wins, without a duplicate name)."""
    cache = {"mode": "existing", "claimName": "hub-cache", "readOnly": True}
    pod = build_deployment(render_input({"model": MODEL, "modelCache": cache}))["spec"]["template"][
        "spec"
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {
        "claimName": "hub-cache",
        "readOnly": True,
    }
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model-cache"] == {"name": "model-cache", "mountPath": "/cache", "readOnly": True}
    assert not mounts["tmp"].get("readOnly")
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    own = {"env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]}
    pod = build_deployment(render_input({"model": MODEL, "modelCache": cache, "server": own}))[
        "spec"
    ]["template"]["spec"]
    offline = [e for e in pod["containers"][0]["env"] if e["name"] == "HF_HUB_OFFLINE"]
    assert offline == [{"name": "HF_HUB_OFFLINE", "value": "0"}]


def test_secrets_become_env() -> None:
    deployment = build_deployment(
        render_input(
            {
                "model": {**MODEL, "hubTokenSecretRef": {"name": "hf"}},
                "apiKeySecretRef": {"name": "auth", "key": "k"},
                "server": {"env": [{"name": "X", "value": "1"}]},
            }
        )
    )
    env = {e["name"]: e for e in _container(deployment)["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["EMBEDDING_SERVER_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "auth", "key": "k"}
    }
    assert env["X"] == {"name": "X", "value": "1"}


def test_tracing_passes_the_endpoint_and_names_the_service() -> None:
    tracing = {"otlpEndpoint": "http://otel.observability:4318", "samplingRatio": 0.25}
    render = render_input({"model": MODEL, "tracing": tracing}, name="minilm", namespace="search")
    container = _container(build_deployment(render))
    assert _flag(container["args"], "--otlp-traces-endpoint") == "http://otel.observability:4318"
    env = {e["name"]: e for e in container["env"]}
    assert env["OTEL_SERVICE_NAME"]["value"] == "minilm"
    assert env["OTEL_RESOURCE_ATTRIBUTES_POD_NAME"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.name"}
    }
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == (
        "k8s.namespace.name=search,k8s.pod.name=$(OTEL_RESOURCE_ATTRIBUTES_POD_NAME)"
    )
    # $(...) only expands a variable defined earlier in the list.
    names = [e["name"] for e in container["env"]]
    assert names.index("OTEL_RESOURCE_ATTRIBUTES_POD_NAME") < names.index(
        "OTEL_RESOURCE_ATTRIBUTES"
    )
    assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
    assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.25"


def test_without_tracing_nothing_of_it_is_rendered_and_user_env_wins() -> None:
    container = _container(build_deployment(render_input({"model": MODEL})))
    assert "--otlp-traces-endpoint" not in container["args"]
    assert not [e for e in container["env"] if e["name"].startswith("OTEL_")]
    # No samplingRatio: every request is traced (the SDK's default sampler), no variable set.
    own = {"env": [{"name": "OTEL_SERVICE_NAME", "value": "search-embedder"}]}
    tracing = {"otlpEndpoint": "http://otel:4318"}
    render = render_input({"model": MODEL, "tracing": tracing, "server": own})
    env = [e for e in _container(build_deployment(render))["env"] if e["name"].startswith("OTEL_")]
    assert [e for e in env if e["name"] == "OTEL_SERVICE_NAME"] == own["env"]
    assert "OTEL_TRACES_SAMPLER" not in {e["name"] for e in env}


def test_the_wake_from_zero_query_counts_only_the_gateways_own_series() -> None:
    """Issue 48, L7. The held-request trigger matched ``embedding_service`` alone, a label
    any scraped pod writes: a pod in any namespace exporting
    ``embedding_gateway_held_requests{embedding_service="team-a/emb"} 1`` woke team-a's
    service from zero and kept it up. It now also matches the ``namespace`` Prometheus gives
    the gateway's target (a label a pod cannot write over unless its job honors labels), and
    the job when the operator is told it, quoted as PromQL strings."""
    auto = {"enabled": True, "autoscaler": "keda", "minReplicas": 0, "maxReplicas": 2}
    spec = {"model": MODEL, "autoscaling": auto}
    gateway = replace(KEDA, gateway_namespace="ops", gateway_job="ops/eo-gateway")
    held = build_scaled_object(_keda(spec, gateway))["spec"]["triggers"][2]
    assert held["metadata"]["query"] == (
        "clamp_max(sum(embedding_gateway_held_requests"
        '{embedding_service="ns/emb",namespace="ops",job="ops/eo-gateway"}), 1)'
    )
    odd = replace(KEDA, gateway_namespace="ops", gateway_job='a"b\\c')
    query = build_scaled_object(_keda(spec, odd))["spec"]["triggers"][2]["metadata"]["query"]
    assert 'job="a\\"b\\\\c"' in query


def test_the_operator_tells_the_query_its_gateways_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run`` matches its own namespace unless told the gateway's (the chart sets it)."""
    from embedding_operator.settings import OperatorSettings

    monkeypatch.setenv("POD_NAMESPACE", "platform")
    assert OperatorSettings().autoscaling.gateway_namespace == "platform"
    assert OperatorSettings().autoscaling.gateway_job == ""
    monkeypatch.setenv("EMBEDDING_OPERATOR_KEDA_GATEWAY_NAMESPACE", "edge")
    monkeypatch.setenv("EMBEDDING_OPERATOR_KEDA_GATEWAY_JOB", "edge/gateway")
    told = OperatorSettings().autoscaling
    assert (told.gateway_namespace, told.gateway_job) == ("edge", "edge/gateway")
    with pytest.raises(ValueError, match="keda_gateway_namespace"):
        OperatorSettings(keda_gateway_namespace='ops"}')


def test_builders_are_deterministic() -> None:
    spec = {"model": MODEL, "autoscaling": {"enabled": True}}
    assert desired_children(render_input(spec)) == desired_children(render_input(spec))


PROMETHEUS = "http://prometheus.monitoring.svc:9090"
KEDA = AutoscalingDefaults(autoscaler="keda", prometheus_address=PROMETHEUS)


def _keda(spec: dict[str, Any], defaults: AutoscalingDefaults = KEDA) -> Any:
    return replace(render_input(spec), autoscaling=defaults)


def test_scaled_object_sums_the_metric_over_this_services_pods() -> None:
    auto = {
        "enabled": True,
        "autoscaler": "keda",
        "minReplicas": 1,
        "maxReplicas": 5,
        "targetBacklogSeconds": 1.5,
        "scaleDownStabilizationSeconds": 90,
    }
    render = _keda({"model": MODEL, "autoscaling": auto})
    so = build_scaled_object(render)
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert so["metadata"]["ownerReferences"][0]["kind"] == "EmbeddingService"
    spec = so["spec"]
    # The Deployment, as the HPA's: the operator leaves its replicas to the autoscaler.
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "emb"}
    assert "replicas" not in build_deployment(render)["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 5)
    assert spec["cooldownPeriod"] == 90
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
        "scaleDown": {"stabilizationWindowSeconds": 90}
    }
    (trigger,) = spec["triggers"]  # no loading guard above zero
    assert trigger["type"] == "prometheus"
    # A sum with an AverageValue target: KEDA's HPA asks for ceil(sum / 1.5) replicas, and a
    # replica that exports nothing (not ready) neither adds work nor lowers anyone's share.
    assert trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == PROMETHEUS
    assert meta["query"] == (
        'sum(embedding_server_backlog_seconds{namespace="ns",pod=~"emb-[a-z0-9]+-[a-z0-9]+"})'
    )
    assert meta["threshold"] == "1.5"
    assert meta["ignoreNullValues"] == "true"
    # One autoscaler at a time: the operator's own HPA must go.
    desired = desired_children(render)
    assert "ScaledObject" in {m["kind"] for m in desired.present}
    assert "HorizontalPodAutoscaler" in {r.kind for r in desired.absent}
    assert "HorizontalPodAutoscaler" not in {m["kind"] for m in desired.present}


def test_the_autoscaler_is_the_specs_else_the_operators_default() -> None:
    auto = {"enabled": True, "maxReplicas": 3}
    assert _keda({"model": MODEL, "autoscaling": auto}).autoscaler == "keda"
    chosen = _keda({"model": MODEL, "autoscaling": {**auto, "autoscaler": "hpa"}})
    assert chosen.autoscaler == "hpa"
    kinds = {m["kind"] for m in desired_children(chosen).present}
    assert "HorizontalPodAutoscaler" in kinds and "ScaledObject" not in kinds
    assert render_input({"model": MODEL, "autoscaling": auto}).autoscaler == "hpa"
    assert _keda({"model": MODEL}).autoscaler is None  # autoscaling off: none at all


def test_queue_metrics_through_keda_keep_their_targets() -> None:
    auto = {"enabled": True, "autoscaler": "keda", "metric": "queueTokens", "targetPerPod": 9000}
    (trigger,) = build_scaled_object(_keda({"model": MODEL, "autoscaling": auto}))["spec"][
        "triggers"
    ]
    assert trigger["metadata"]["query"].startswith("sum(embedding_server_queue_tokens{")
    assert trigger["metadata"]["threshold"] == "9000"


def test_scale_to_zero_keeps_a_loading_replica() -> None:
    """With minReplicas 0, KEDA takes the last replica away once its triggers are inactive.
    A replica loading its model has no work yet, so the second trigger keeps the service
    active while one loads (superlinked/sie#293), and asks for at most one replica."""
    auto = {"enabled": True, "autoscaler": "keda", "minReplicas": 0, "maxReplicas": 2}
    so = build_scaled_object(_keda({"model": MODEL, "autoscaling": auto}))
    assert so["spec"]["minReplicaCount"] == 0
    # KEDA asks the triggers every 5 s whether to wake it (its 30 s default would be most of
    # a cold start); services that never go to zero keep KEDA's default.
    assert so["spec"]["pollingInterval"] == 5
    above_zero = {**auto, "minReplicas": 1}
    assert (
        "pollingInterval"
        not in build_scaled_object(_keda({"model": MODEL, "autoscaling": above_zero}))["spec"]
    )
    work, loading, held = so["spec"]["triggers"]
    assert work["name"] == "backlogSeconds" and loading["name"] == "loading"
    assert loading["metadata"]["query"] == (
        'clamp_max(sum(embedding_server_loading{namespace="ns",pod=~"emb-[a-z0-9]+-[a-z0-9]+"}), 1)'
    )
    assert (loading["metricType"], loading["metadata"]["threshold"]) == ("AverageValue", "1")
    # From zero: the requests the gateway holds for this service, one replica's worth, as
    # scraped from the gateway's namespace (the chart's documented one by default).
    assert held["name"] == "held"
    assert held["metadata"]["query"] == (
        "clamp_max(sum(embedding_gateway_held_requests"
        '{embedding_service="ns/emb",namespace="embedding-operator"}), 1)'
    )
    assert (held["metricType"], held["metadata"]["threshold"]) == ("AverageValue", "1")
    # The gateway labels its gauge with exactly that name.
    from embedding_server.gateway.metrics import HELD_REQUESTS_METRIC, GatewayMetrics

    assert HELD_REQUESTS_METRIC == "embedding_gateway_held_requests"
    assert GatewayMetrics().held_requests._labelnames == ("model", "embedding_service")


@pytest.mark.parametrize("length", [3, 46, 47, 52])
def test_the_pod_regex_matches_this_services_pods_and_no_namesakes(length: int) -> None:
    name = "e" * length
    pattern = re.compile(pod_name_regex(Owner(name=name, namespace="ns", uid="u")))

    def pod(service: str, template_hash: str = "7d4b9c8f5b") -> str:
        # As the API server names them: <deployment>-<hash>- cut at 58, then 5 random.
        return (f"{service}-{template_hash}-")[:58] + "x2x9q"

    assert pattern.fullmatch(pod(name))
    assert pattern.fullmatch(pod(name, "5d8f9"))
    assert not pattern.fullmatch(pod(name + "x"))  # a longer name sharing the prefix
    if length + 3 <= 46:  # "<name>-b": a namesake whose pods are never cut short
        assert not pattern.fullmatch(pod(f"{name}-b"))

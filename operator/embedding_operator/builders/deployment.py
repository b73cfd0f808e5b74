"""The Deployment running embedding-server: the one child where the product's choices live.

Choices made here, and why:

* Container contract: ``embedding-server serve`` with flags that are the kebab-case of the
  server's settings fields; only values the user set are passed, so the server's own defaults
  stay defined in one place. ``--served-model-name`` is always passed so status can name it.
* GPUs: ``<profile resource> = tensorParallelSize`` in limits (requests default to limits for
  extended resources), node selector and tolerations from the profile, then the user's.
* Tensor parallelism: the bundled embedding-server refuses ``--tensor-parallel-size`` above 1
  at start, so a pod running it with more would only crash-loop. ``tensor_parallel_refusal``
  says so (the reconciler then renders nothing, ``render`` refuses); a spec that names its own
  ``server.image`` gets the flag and the GPUs as asked, since that server may support it.
* Probes: readiness on ``/ready`` (503 until loaded and warmed), liveness on ``/health``, and a
  startup probe on ``/ready`` with a failure budget of ``startupTimeoutSeconds`` so a slow model
  download is not killed by liveness, while a download that hangs forever is restarted.
* Rollout: ``maxSurge 0`` by default, because a surge pod needs a free GPU that usually is not
  there and would sit Pending, stalling the rollout.
* Security: non-root uid 1000, no privilege escalation, all capabilities dropped, seccomp
  RuntimeDefault, no service-account token (the server never calls the API).
* When autoscaling is on, ``spec.replicas`` is omitted: the HPA owns it, and server-side apply
  then never fights the HPA over the field.
"""

from __future__ import annotations

import math
from typing import Any

from embedding_operator.builders.common import (
    CACHE_MOUNT_PATH,
    PORT_NAME,
    SERVER_PORT,
    Manifest,
    RenderInput,
    child_metadata,
    common_labels,
    pvc_name,
    selector_labels,
)

CONTAINER_NAME = "embedding-server"
# The largest --tensor-parallel-size the bundled embedding-server (the default image) starts with.
BUNDLED_SERVER_MAX_TENSOR_PARALLEL_SIZE = 1
RUN_AS_USER = 1000
STARTUP_PERIOD_SECONDS = 10
API_KEY_ENV = "EMBEDDING_SERVER_API_KEY"
HUB_TOKEN_ENV = "HF_TOKEN"


def server_args(render: RenderInput) -> list[str]:
    """``embedding-server serve`` flags for this spec (the pod contract, unit-tested)."""
    spec = render.spec
    args = [
        "serve",
        "--model",
        spec.model.server_model,
        "--served-model-name",
        spec.served_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(SERVER_PORT),
        "--log-format",
        "json",
        "--cache-dir",
        CACHE_MOUNT_PATH,
        # Named, never auto: a GPU pod whose CUDA is unusable must fail at start, not serve
        # on its CPU with CPU batch sizes.
        "--device",
        "cuda" if render.profile.resource_name else "cpu",
        "--dtype",
        spec.server.dtype,
        "--task",
        spec.task,
        "--pooling",
        spec.embedding.pooling,
        "--tensor-parallel-size",
        str(spec.parallelism.tensor_parallel_size),
    ]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if spec.model.trust_remote_code:
        args.append("--trust-remote-code")
    emb = spec.embedding
    if emb.normalize is not None:
        args.append("--normalize" if emb.normalize else "--no-normalize")
    if emb.dimensions is not None:
        args += ["--dimensions", str(emb.dimensions)]
    if emb.matryoshka_dimensions:
        args += ["--matryoshka-dimensions", ",".join(str(d) for d in emb.matryoshka_dimensions)]
    if emb.max_input_tokens is not None:
        args += ["--max-model-len", str(emb.max_input_tokens)]
    if emb.auto_truncate:
        args.append("--auto-truncate")
    if emb.prompts is not None and emb.prompts.default_name:
        args += ["--default-prompt-name", emb.prompts.default_name]
    srv = spec.server
    for flag, value in (
        ("--max-batch-tokens", srv.max_batch_tokens),
        ("--max-batch-size", srv.max_batch_size),
        ("--max-queue-tokens", srv.max_queue_tokens),
    ):
        if value is not None:
            args += [flag, str(value)]
    return [*args, *srv.extra_args]


def tensor_parallel_refusal(render: RenderInput) -> str | None:
    """Why pods of this spec could not start, naming the field and the fix; None if they can.

    Only the bundled server (``server.image`` unset, so the operator's default image runs) is
    known to refuse tensor parallelism; a custom image is trusted to support what it is asked.
    """
    spec = render.spec
    size = spec.parallelism.tensor_parallel_size
    if spec.server.image is not None or size <= BUNDLED_SERVER_MAX_TENSOR_PARALLEL_SIZE:
        return None
    limit = BUNDLED_SERVER_MAX_TENSOR_PARALLEL_SIZE
    return (
        f"spec.parallelism.tensorParallelSize: {size} is not supported by the bundled "
        f"embedding-server image {render.default_image!r}, which does not implement tensor "
        f"parallelism and refuses to start with more than {limit}; set "
        f"spec.parallelism.tensorParallelSize to {limit} (scale out with replicas instead), "
        "or set spec.server.image to a server image that supports tensor parallelism"
    )


def _env(render: RenderInput) -> list[dict[str, Any]]:
    spec = render.spec
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{CACHE_MOUNT_PATH}/huggingface"}]
    for var_name, ref in (
        (HUB_TOKEN_ENV, spec.model.hub_token_secret_ref),
        (API_KEY_ENV, spec.api_key_secret_ref),
    ):
        if ref is not None:
            env.append(
                {
                    "name": var_name,
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
                }
            )
    for var in spec.server.env:
        env.append(var.model_dump(by_alias=True, exclude_none=True))
    return env


# The preStop delay, then the server's drain (its --shutdown-timeout default of 30 s), then a
# margin for the process to exit: the kubelet must never SIGKILL a server mid-drain.
PRE_STOP_SECONDS = 10
SERVER_DRAIN_SECONDS = 30
TERMINATION_GRACE_SECONDS = PRE_STOP_SECONDS + SERVER_DRAIN_SECONDS + 15


def _resources(render: RenderInput) -> dict[str, Any]:
    requests = {k: str(v) for k, v in render.spec.resources.requests.items()}
    limits = {k: str(v) for k, v in render.spec.resources.limits.items()}
    if render.profile.resource_name:
        limits[render.profile.resource_name] = str(render.gpu_count)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _volumes(render: RenderInput) -> list[dict[str, Any]]:
    cache = render.spec.model_cache
    if cache.mode == "pvc":
        cache_source: dict[str, Any] = {
            "persistentVolumeClaim": {"claimName": pvc_name(render.owner)}
        }
    elif cache.mode == "existing":
        cache_source = {"persistentVolumeClaim": {"claimName": cache.claim_name}}
    else:
        cache_source = {"emptyDir": {}}
    return [
        {"name": "model-cache", **cache_source},
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": str(render.spec.server.shm_size)},
        },
        {"name": "tmp", "emptyDir": {}},
    ]


def _pod_spec(render: RenderInput) -> dict[str, Any]:
    spec = render.spec
    startup_failures = max(
        1, math.ceil(spec.server.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)
    )
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.server.image or render.default_image,
        "command": ["embedding-server"],
        "args": server_args(render),
        "ports": [{"name": PORT_NAME, "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "env": _env(render),
        "resources": _resources(render),
        "startupProbe": _probe("/ready", STARTUP_PERIOD_SECONDS, startup_failures),
        "readinessProbe": _probe("/ready", 5, 3),
        # Keep serving while the endpoint removal reaches every kube-proxy and ingress; only
        # then does SIGTERM start the server's drain (readiness 503, in-flight work finished).
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "livenessProbe": _probe("/health", 10, 3),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_MOUNT_PATH},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if spec.server.image_pull_policy:
        container["imagePullPolicy"] = spec.server.image_pull_policy

    node_selector = {**render.profile.node_selector, **spec.scheduling.node_selector}
    tolerations = [
        *render.profile.tolerations,
        *(t.model_dump(by_alias=True, exclude_none=True) for t in spec.scheduling.tolerations),
    ]
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": _volumes(render),
    }
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    if spec.scheduling.affinity:
        pod["affinity"] = spec.scheduling.affinity
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    return pod


def build_deployment(render: RenderInput) -> Manifest:
    spec = render.spec
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(render.owner)},
        "revisionHistoryLimit": 3,
        # Give a rollout the startup budget plus slack before Kubernetes (and our Progressing
        # condition) calls it stuck.
        "progressDeadlineSeconds": spec.server.startup_timeout_seconds + 600,
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable,
            },
        },
        "template": {
            "metadata": {
                "labels": common_labels(render.owner),
                "annotations": {
                    "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(SERVER_PORT),
                    "prometheus.io/path": "/metrics",
                },
            },
            "spec": _pod_spec(render),
        },
    }
    if not spec.autoscaling.enabled:
        deployment_spec = {"replicas": spec.replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(render.owner),
        "spec": deployment_spec,
    }

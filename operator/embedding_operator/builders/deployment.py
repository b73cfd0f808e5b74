"""The Deployment running embedding-server: the one child where the product's choices live.

Choices made here, and why:

* Container contract: ``embedding-server serve`` with flags that are the kebab-case of the
  server's settings fields; only values the user set are passed, so the server's own defaults
  stay defined in one place. ``--served-model-name`` is always passed so status can name it;
  ``--served-model-aliases`` when ``servedModelAliases`` (or the deprecated annotation) has
  names, so the pod answers to every name the gateway routes to it.
* GPUs: ``<profile resource> = tensorParallelSize`` in limits (requests default to limits for
  extended resources), node selector and tolerations from the profile, then the user's.
* Tensor parallelism: one pod runs all ``tensorParallelSize`` ranks (embedding-server starts
  ranks 1..N-1 itself as child processes), so the pod asks for N GPUs of the profile and the
  flag, and the memory-backed ``/dev/shm`` the ranks' collectives go through is sized per
  rank (``shm_size``) unless the spec sets it. On the cpu profile the ranks are CPU processes.
* Host checking: behind a ClusterIP Service the server answers only for the Service's DNS
  names and ``localhost`` (``--allowed-hosts``; IP addresses always pass, which is what the
  kubelet's probes and Prometheus send), so a browser on a machine that can reach the pod
  cannot be walked into it by DNS rebinding. A NodePort or LoadBalancer Service is reached
  by names the operator does not know, so there the server answers any host. An Ingress in
  front of a ClusterIP Service sends its own host name: ``server.extraArgs`` can replace the
  list (``--allowed-hosts=*`` turns the check off).
* Probes: readiness on ``/ready`` (503 until loaded and warmed), liveness on ``/health``, and a
  startup probe on ``/ready`` with a failure budget of ``startupTimeoutSeconds`` so a slow model
  download is not killed by liveness, while a download that hangs forever is restarted. They
  go to the server's probe port (``--probe-port``, the container port ``probe``), whose
  connections do not count against the client port's cap: a client holding every client
  connection cannot get a healthy pod restarted. Prometheus still scrapes ``/metrics`` on the
  client port (the NetworkPolicy admits its namespace there; the kubelet reaches the probe
  port as node traffic, which a NetworkPolicy never blocks).
* Rollout: ``maxSurge 0`` by default, because a surge pod needs a free GPU that usually is not
  there and would sit Pending, stalling the rollout.
* Model cache: ``modelCache.readOnly`` mounts a claim filled beforehand read-only (the volume
  source too, which ReadOnlyMany volumes of several CSI drivers require) and sets
  ``HF_HUB_OFFLINE=1``: a cache that cannot be written can only be read, and an offline
  cluster must not wait on the Hub.
* Security: non-root uid 1000, no privilege escalation, all capabilities dropped, seccomp
  RuntimeDefault, no service-account token (the server never calls the API), and a read-only
  root filesystem. The server writes only the Hugging Face cache (``/cache``, the model-cache
  volume) and, through libraries, ``/tmp`` and ``/dev/shm`` (emptyDirs); traced with strace
  while loading a model and serving (no other path is opened for writing).
* Memory: a memory request without a limit gets the request as its limit (memory is not
  compressible: a pod above its request is the first the kubelet evicts under pressure, so
  the request is what the pod may count on). With no memory request the operator sets no limit:
  the footprint depends on the model (90 MB for MiniLM, 30 GB for an 8B model on CPU) and a
  guessed limit would OOM-kill a model at load; a namespace LimitRange is the Kubernetes way to
  give defaults there.
* Tracing: ``spec.tracing`` passes ``--otlp-traces-endpoint`` and the standard OTEL_*
  variables the server's OpenTelemetry SDK reads (the EmbeddingService as the service, its
  namespace and the pod's name as resource attributes, the sampler for ``samplingRatio``),
  each only where the user's ``server.env`` does not set it.
* Images: ``spec.media`` passes the server's media flags (``--allowed-media-domains`` and
  the image limits), each only when set. The pods need egress to the listed hosts; the
  operator's NetworkPolicy restricts ingress only, so it never stands in the way.
* Golden vectors: the pod template carries its contract key (a label) and mounts the optional
  ConfigMap ``<name>-golden``; ``--golden-vectors`` names the record its vectors must match and
  ``--golden-min-cosine`` the bar of ``spec.contract`` (``builders/golden.py``). The flags come
  before ``server.extraArgs``, which may override them.
* When autoscaling is on, ``spec.replicas`` is omitted: the HPA owns it, and server-side apply
  then never fights the HPA over the field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from embedding_operator.builders import golden
from embedding_operator.builders.common import (
    CACHE_MOUNT_PATH,
    PORT_NAME,
    PROBE_PORT,
    PROBE_PORT_NAME,
    SERVER_PORT,
    Manifest,
    RenderInput,
    child_metadata,
    common_labels,
    container_security_context,
    pod_security_context,
    pvc_name,
    selector_labels,
)
from embedding_operator.spec import SecretKeyRef

CONTAINER_NAME = "embedding-server"
SHM_GIB_PER_RANK = 1
"""Default ``/dev/shm`` per tensor-parallel rank: NCCL's shared-memory transport keeps a few
buffers of 4 MiB per channel and peer there, far below this even at 8 ranks."""
STARTUP_PERIOD_SECONDS = 10
API_KEY_ENV = "EMBEDDING_SERVER_API_KEY"
NEXT_SERVICE_SUFFIX = "-next"
"""``bluegreen.NEXT_SUFFIX`` (builders import nothing above them)."""
HUB_TOKEN_ENV = "HF_TOKEN"
HUB_OFFLINE_ENV = "HF_HUB_OFFLINE"
MODEL_CACHE_VOLUME = "model-cache"


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
        "--probe-port",
        str(PROBE_PORT),
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
        "--api-workers",
        str(api_workers(render)),
    ]
    if spec.served_model_aliases:
        args += ["--served-model-aliases", ",".join(spec.served_model_aliases)]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if spec.model.trust_remote_code:
        args.append("--trust-remote-code")
    if spec.server.backend != "auto":  # auto is the server's own default
        args += ["--backend", spec.server.backend]
    # none is the server's default: existing services' pod templates stay as they were.
    if spec.server.quantization != "none":
        args += ["--quantization", spec.server.quantization]
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
    if spec.service.type == "ClusterIP":
        args += ["--allowed-hosts", ",".join(allowed_hosts(render))]
    srv = spec.server
    if spec.tracing is not None:
        args += ["--otlp-traces-endpoint", spec.tracing.otlp_endpoint]
    args += media_args(render)
    args += golden.server_args(spec)
    args += _set_flags(
        ("--max-batch-tokens", srv.max_batch_tokens),
        ("--max-batch-size", srv.max_batch_size),
        ("--max-queue-tokens", srv.max_queue_tokens),
        ("--max-request-tokens", srv.max_request_tokens),
        ("--bulk-batch-ms", srv.bulk_batch_ms),
        ("--prefix-cache-bytes", srv.prefix_cache_bytes),
    )
    return [*args, *srv.extra_args]


def _set_flags(*flags: tuple[str, object]) -> list[str]:
    """``flag value`` for each of ``flags`` whose value the spec sets (not None), in order."""
    return [arg for flag, value in flags if value is not None for arg in (flag, str(value))]


def media_args(render: RenderInput) -> list[str]:
    """The server's media flags for ``spec.media``: only what the spec sets, so the server's
    defaults (data: URIs only, its limits) stay defined in one place."""
    media = render.spec.media
    if media is None:
        return []
    args: list[str] = []
    if media.allowed_domains:
        args += ["--allowed-media-domains", ",".join(media.allowed_domains)]
    return args + _set_flags(
        ("--max-images-per-request", media.max_images_per_request),
        ("--max-image-bytes", media.image_bytes),
        ("--max-image-pixels", media.max_image_pixels),
        ("--media-fetch-timeout", media.fetch_timeout_seconds),
    )


def allowed_hosts(render: RenderInput) -> list[str]:
    """The names in-cluster clients reach a ClusterIP Service by, and ``localhost`` (a port
    forward, an exec in the pod). The cluster domain is the default, as in ``endpoint``."""
    namespace = render.owner.namespace
    hosts = []
    # The Service, and the one a model change serves the new model by (bluegreen.py): the pod
    # template is the same in both Deployments.
    for name in (render.owner.name, f"{render.owner.name}{NEXT_SERVICE_SUFFIX}"):
        hosts += [
            name,
            f"{name}.{namespace}",
            f"{name}.{namespace}.svc",
            f"{name}.{namespace}.svc.cluster.local",
        ]
    return [*hosts, "localhost"]


def shm_size(render: RenderInput) -> str:
    """The ``/dev/shm`` size limit: the spec's, else :data:`SHM_GIB_PER_RANK` per rank."""
    size = render.spec.server.shm_size
    if size is not None:
        return str(size)
    return f"{SHM_GIB_PER_RANK * render.spec.parallelism.tensor_parallel_size}Gi"


def hub_env(
    hub_token: SecretKeyRef | None, read_only_cache: bool, user_env: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """How a pod obtains its model from the Hub: ``HF_HOME`` on the model-cache volume,
    ``HF_HUB_OFFLINE=1`` for a read-only cache (unless ``user_env`` names it) and ``HF_TOKEN``
    from the token's Secret (the kubelet resolves it). EmbeddingJob workers that load a model
    use it too."""
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{CACHE_MOUNT_PATH}/huggingface"}]
    # A read-only cache was filled beforehand: read it only, never try the Hub (unless the
    # user's own env says otherwise).
    if read_only_cache and HUB_OFFLINE_ENV not in set(user_env):
        env.append({"name": HUB_OFFLINE_ENV, "value": "1"})
    return env + _secret_env(HUB_TOKEN_ENV, hub_token)


def _secret_env(name: str, ref: SecretKeyRef | None) -> list[dict[str, Any]]:
    if ref is None:
        return []
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _env(render: RenderInput) -> list[dict[str, Any]]:
    spec = render.spec
    env = hub_env(
        spec.model.hub_token_secret_ref,
        spec.model_cache.read_only,
        (v.name for v in spec.server.env),
    )
    env += _secret_env(API_KEY_ENV, spec.api_key_secret_ref)
    env += _tracing_env(render)
    for var in spec.server.env:
        env.append(var.model_dump(by_alias=True, exclude_none=True))
    return env


TRACING_POD_NAME_ENV = "OTEL_RESOURCE_ATTRIBUTES_POD_NAME"
"""The downward-API variable ``OTEL_RESOURCE_ATTRIBUTES`` takes the pod name from (the
OpenTelemetry operator's name for it)."""


def _tracing_env(render: RenderInput) -> list[dict[str, Any]]:
    """The standard OTEL_* variables for ``spec.tracing``: the service is the
    EmbeddingService, the resource names its namespace and pod, and ``samplingRatio`` picks
    the sampler. A variable the user's ``server.env`` sets is left to it."""
    tracing = render.spec.tracing
    if tracing is None:
        return []
    owner = render.owner
    attributes = f"k8s.namespace.name={owner.namespace},k8s.pod.name=$({TRACING_POD_NAME_ENV})"
    wanted: list[dict[str, Any]] = [
        {"name": "OTEL_SERVICE_NAME", "value": owner.name},
        {
            "name": TRACING_POD_NAME_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
        },
        # $(...) expands a variable defined above it in the same container.
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": attributes},
    ]
    if tracing.sampling_ratio is not None:
        wanted += [
            {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
            {"name": "OTEL_TRACES_SAMPLER_ARG", "value": f"{tracing.sampling_ratio:g}"},
        ]
    given = {var.name for var in render.spec.server.env}
    return [var for var in wanted if var["name"] not in given]


# The preStop delay, then the server's drain (its --shutdown-timeout default of 30 s), then a
# margin for the process to exit: the kubelet must never SIGKILL a server mid-drain.
PRE_STOP_SECONDS = 10
SERVER_DRAIN_SECONDS = 30


def api_workers(render: RenderInput) -> int:
    """Front-end processes per pod: the spec's, else the GPU profile's default."""
    return render.spec.server.api_workers or render.profile.api_workers


def termination_grace_seconds(render: RenderInput) -> int:
    """With several front-ends the drain has two stages (the front-ends' in-flight requests,
    then what the engine still holds), each with the server's drain budget."""
    stages = 2 if api_workers(render) > 1 else 1
    return PRE_STOP_SECONDS + stages * SERVER_DRAIN_SECONDS + 15


def _resources(render: RenderInput) -> dict[str, Any]:
    requests = {k: str(v) for k, v in render.spec.resources.requests.items()}
    limits = {k: str(v) for k, v in render.spec.resources.limits.items()}
    if "memory" in requests and "memory" not in limits:
        limits["memory"] = requests["memory"]
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
        "httpGet": {"path": path, "port": PROBE_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def model_cache_volume(claim_name: str | None, read_only: bool) -> dict[str, Any]:
    """The ``model-cache`` volume: the claim (read-only as the mount, which ReadOnlyMany
    volumes of several CSI drivers require), or an emptyDir without one."""
    if claim_name is None:
        return {"name": MODEL_CACHE_VOLUME, "emptyDir": {}}
    claim: dict[str, Any] = {"claimName": claim_name}
    if read_only:
        claim["readOnly"] = True
    return {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": claim}


def model_cache_mount(read_only: bool) -> dict[str, Any]:
    """The ``model-cache`` volume at :data:`CACHE_MOUNT_PATH` (``--cache-dir``, ``HF_HOME``)."""
    return {
        "name": MODEL_CACHE_VOLUME,
        "mountPath": CACHE_MOUNT_PATH,
        **({"readOnly": True} if read_only else {}),
    }


def _volumes(render: RenderInput) -> list[dict[str, Any]]:
    cache = render.spec.model_cache
    claim = {"pvc": pvc_name(render.owner), "existing": cache.claim_name}.get(cache.mode)
    return [
        model_cache_volume(claim, cache.read_only),
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(render)},
        },
        {"name": "tmp", "emptyDir": {}},
        golden.volume(render.owner),
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
        "ports": [
            {"name": PORT_NAME, "containerPort": SERVER_PORT, "protocol": "TCP"},
            {"name": PROBE_PORT_NAME, "containerPort": PROBE_PORT, "protocol": "TCP"},
        ],
        "env": _env(render),
        "resources": _resources(render),
        "startupProbe": _probe("/ready", STARTUP_PERIOD_SECONDS, startup_failures),
        "readinessProbe": _probe("/ready", 5, 3),
        # Keep serving while the endpoint removal reaches every kube-proxy and ingress; only
        # then does SIGTERM start the server's drain (readiness 503, in-flight work finished).
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "livenessProbe": _probe("/health", 10, 3),
        "securityContext": container_security_context(),
        "volumeMounts": [
            model_cache_mount(spec.model_cache.read_only),
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            golden.volume_mount(),
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
        "terminationGracePeriodSeconds": termination_grace_seconds(render),
        "securityContext": pod_security_context(),
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
                "labels": {
                    **common_labels(render.owner),
                    golden.CONTRACT_LABEL: golden.contract_key(spec),
                },
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

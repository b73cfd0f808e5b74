"""Pure builders of an EmbeddingJob's children: its ServiceAccount and its two Jobs.

An EmbeddingJob runs in two phases, each a ``batch/v1`` Job of the server image:

* the planner (``<name>-plan``, one pod): ``embedding-server job plan`` lists the input,
  writes ``OUTPUT/_plan.json`` and says in its termination message how many shards and rows
  there are (``{"shards": S, "rows": R}``);
* the workers (``<name>-work``): an Indexed Job of ``S`` completions, ``parallelism`` pods at
  a time, each pod ``embedding-server job work`` for the shard ``JOB_COMPLETION_INDEX`` (the
  Job controller sets it), which commits ``OUTPUT/parts/part-<index>.parquet`` (``.jsonl``
  with ``spec.output.format: jsonl``) once. A shard retries ``backoffLimitPerIndex`` times
  on its own, without failing the others;
  ``maxFailedIndexes`` is left unset, so every shard that can be done is done before the Job
  reports the failed ones (a second EmbeddingJob with the same output skips the committed
  shards and redoes only those). The pod failure policy fails the whole Job at once on the
  worker's exit code 2 (bad arguments: every shard would fail alike) and does not count a
  disruption (an eviction, a preemption, a node drain) against a shard's retries.

With ``spec.model`` there is no service: the workers run ``job work --local`` with the
model's engine flags and load it themselves, getting it as an EmbeddingService's pods do
(``builders.deployment``'s model-cache volume at ``/cache``, ``HF_HOME``, ``HF_HUB_OFFLINE``
for a read-only cache, ``HF_TOKEN`` by reference); on the GPU when ``resources`` asks for
``nvidia.com/gpu``, which the planner never gets. ``spec.scheduling`` places both pods.

``S`` and ``R`` travel on the worker Job itself (``spec.completions`` and the
:data:`ROWS_ANNOTATION`), so the planner Job may be deleted once the workers exist.

Pods: the EmbeddingJob's own ServiceAccount (bound to no Role: the pods call no Kubernetes
API, and the kubelet, not the pod, resolves the credentials Secret into env), no
service-account token, non-root, no privilege escalation, every capability dropped, seccomp
RuntimeDefault and a read-only root filesystem with an emptyDir ``/tmp``, as the server's
Deployment has. The operator never reads the Secret and never touches the store.

Job pod templates are immutable: the reconciler creates each Job once from these manifests
and afterwards patches only ``spec.suspend`` and ``spec.parallelism``
(:func:`mutable_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embedding_operator.builders.common import (
    CACHE_MOUNT_PATH,
    GROUP,
    MANAGED_BY,
    VERSION,
    Manifest,
    Owner,
    container_security_context,
    endpoint,
    pod_security_context,
)
from embedding_operator.builders.deployment import hub_env, model_cache_mount, model_cache_volume
from embedding_operator.jobs.spec import PVC_MOUNT_PATH, EmbeddingJobSpec, JobModel
from embedding_operator.profiles import NVIDIA_GPU
from embedding_operator.spec import EmbeddingServiceSpec, SecretKeyRef

JOB_KIND = "EmbeddingJob"
JOB_PLURAL = "embeddingjobs"
JOB_API_VERSION = f"{GROUP}/{VERSION}"
APP_NAME = "embedding-job"
PLANNER = "planner"
WORKER = "worker"
CONTAINER_NAME = "job"
TERMINATION_LOG = "/dev/termination-log"
ROWS_ANNOTATION = f"{GROUP}/rows"
"""On the worker Job: the rows the planner counted (``R``)."""
EXIT_BAD_ARGS = 2
PLANNER_BACKOFF_LIMIT = 2
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
REGION_ENV = "AWS_REGION"
API_KEY_ENV = "EMBEDDING_JOB_API_KEY"
"""The bearer token ``job work`` sends (``embedding_server.batch.job``), from the service's
``apiKeySecretRef``."""


@dataclass(frozen=True)
class ServiceTarget:
    """What the job takes from its EmbeddingService: the image its pods run (the service's,
    so the workers speak the same version of the API), the URL the workers call (the
    Service's cluster DNS name, one the server's host check admits) and the model name."""

    image: str
    pull_policy: str | None
    url: str | None
    """None for a job whose own pods load the model (``spec.model``)."""
    model: str | None
    api_key: SecretKeyRef | None = None
    """The service's ``apiKeySecretRef``: the workers send it as the bearer token (the
    kubelet resolves the Secret; the operator never reads it)."""

    @classmethod
    def own_pods(cls, default_image: str) -> ServiceTarget:
        """``spec.model``: no service; the pods run the operator's image (the engine's)."""
        return cls(image=default_image, pull_policy=None, url=None, model=None)

    @classmethod
    def of(
        cls,
        namespace: str,
        name: str,
        spec: EmbeddingServiceSpec,
        default_image: str,
        service: str | None = None,
    ) -> ServiceTarget:
        """``service``: the Service to call, when not the EmbeddingService's own (its
        ``<name>-next`` during a model change)."""
        url = endpoint(Owner(service or name, namespace, ""), spec.service.port).removesuffix("/v1")
        return cls(
            image=spec.server.image or default_image,
            pull_policy=spec.server.image_pull_policy,
            url=url,
            model=spec.served_name,
            api_key=spec.api_key_secret_ref,
        )


def planner_name(owner: Owner) -> str:
    return f"{owner.name}-plan"


def worker_name(owner: Owner) -> str:
    return f"{owner.name}-work"


def service_account_name(owner: Owner) -> str:
    return f"{owner.name}-embedding-job"


def job_labels(owner: Owner, component: str | None = None) -> dict[str, str]:
    """Labels of the children and their pods; ``component`` is planner or worker."""
    labels = {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    if component is not None:
        labels["app.kubernetes.io/component"] = component
    return labels


def pod_selector(owner: Owner, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(job_labels(owner, component).items()))


def job_owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": JOB_API_VERSION,
        "kind": JOB_KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(
    owner: Owner, name: str, component: str | None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": job_labels(owner, component),
        "ownerReferences": [job_owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def build_service_account(owner: Owner) -> Manifest:
    """The pods' identity: bound to nothing, and no token is mounted from it."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(owner, service_account_name(owner), None),
        "automountServiceAccountToken": False,
    }


def _s3_flags(spec: EmbeddingJobSpec) -> list[str]:
    s3 = spec.storage.s3 if spec.storage is not None else None
    if s3 is None or s3.endpoint is None:
        return []
    return ["--s3-endpoint", s3.endpoint]


def planner_args(spec: EmbeddingJobSpec) -> list[str]:
    """``embedding-server job plan`` flags (the pod contract with the server image). The
    column embedded (``--text-field`` or ``--image-field``) and the output format are the
    plan's: the workers read them from ``_plan.json``, so they are passed here only."""
    args = ["job", "plan"]
    for url in spec.input.urls:
        args += ["--input", url]
    text = spec.input.text_column
    content = ["--text-field", text] if text is not None else []
    if spec.input.image_field is not None:
        content = ["--image-field", spec.input.image_field]
    args += [
        "--format",
        spec.input.format,
        "--id-field",
        spec.input.id_field,
        *content,
        "--output",
        spec.output.url,
    ]
    if spec.output.format != "parquet":
        # Only when not the default: a server image older than the flag still plans Parquet.
        args += ["--output-format", spec.output.format]
    if spec.shard_rows is not None:
        args += ["--shard-rows", str(spec.shard_rows)]
    return [*args, *_s3_flags(spec), "--termination-log", TERMINATION_LOG]


def local_model_args(spec: EmbeddingJobSpec, model: JobModel) -> list[str]:
    """``job work --local`` and the engine flags of ``spec.model``, spelled as the
    Deployment's ``serve`` flags (``builders.deployment.server_args``): the model, the cache
    on the model-cache volume, the device named, never auto (a GPU pod whose CUDA is unusable
    must fail, not embed the corpus on its CPU), dtype and pooling always, the rest only set."""
    args = ["--local", "--model", model.server_model, "--cache-dir", CACHE_MOUNT_PATH]
    if model.revision is not None:
        args += ["--revision", model.revision]
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    args += ["--device", "cuda" if spec.gpu else "cpu", "--dtype", model.dtype]
    args += ["--pooling", model.pooling]
    if model.normalize is not None:
        args.append("--normalize" if model.normalize else "--no-normalize")
    return args


def worker_args(spec: EmbeddingJobSpec, service_url: str | None, model: str | None) -> list[str]:
    """``embedding-server job work`` flags; the shard index comes from the Job controller's
    ``JOB_COMPLETION_INDEX``. With ``spec.model``, the model is loaded in the pod (no
    service, ``service_url`` unused)."""
    args = ["job", "work", "--output", spec.output.url]
    if spec.model is not None:
        args += local_model_args(spec, spec.model)
    elif service_url is not None:
        args += ["--service", service_url]
        if model:
            args += ["--model", model]
    else:
        raise ValueError("a worker of a job without spec.model needs its service's URL")
    if spec.fingerprint is not None:
        args += ["--expect-fingerprint", spec.fingerprint]
    if spec.max_in_flight is not None:
        args += ["--max-in-flight", str(spec.max_in_flight)]
    if spec.batch_size is not None:
        args += ["--batch-size", str(spec.batch_size)]
    if spec.output.vectors != ["dense"]:
        # Only when not the default: a server image older than the flag still embeds dense.
        args += ["--vectors", ",".join(spec.output.vectors)]
    if spec.input.input_type is not None:
        args += ["--input-type", spec.input.input_type]
    return [*args, *_s3_flags(spec), "--termination-log", TERMINATION_LOG]


def _env(spec: EmbeddingJobSpec) -> list[dict[str, Any]]:
    """S3 credentials as secretKeyRefs (the kubelet reads the Secret), and the region."""
    s3 = spec.storage.s3 if spec.storage is not None else None
    if s3 is None:
        return []
    env: list[dict[str, Any]] = []
    if s3.credentials_secret is not None:
        for key in (ACCESS_KEY_ENV, SECRET_KEY_ENV):
            env.append(
                {
                    "name": key,
                    "valueFrom": {"secretKeyRef": {"name": s3.credentials_secret.name, "key": key}},
                }
            )
    if s3.region is not None:
        env.append({"name": REGION_ENV, "value": s3.region})
    return env


def _api_key_env(ref: SecretKeyRef | None) -> list[dict[str, Any]]:
    if ref is None:
        return []
    source = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
    return [{"name": API_KEY_ENV, "valueFrom": source}]


def _resources(spec: EmbeddingJobSpec, component: str) -> dict[str, Any]:
    """``spec.resources``; the planner (which only lists the input) never holds a GPU."""
    requests = {k: str(v) for k, v in spec.resources.requests.items()}
    limits = {k: str(v) for k, v in spec.resources.limits.items()}
    if component == PLANNER:
        requests.pop(NVIDIA_GPU, None)
        limits.pop(NVIDIA_GPU, None)
    if "memory" in requests and "memory" not in limits:
        limits["memory"] = requests["memory"]  # as the Deployment's: see builders.deployment
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _pod_template(
    owner: Owner,
    spec: EmbeddingJobSpec,
    component: str,
    image: str,
    args: list[str],
    pull_policy: str | None,
    api_key: SecretKeyRef | None = None,
) -> dict[str, Any]:
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    if spec.storage is not None and spec.storage.pvc is not None:
        mounts.append({"name": "data", "mountPath": PVC_MOUNT_PATH})
        volumes.append(
            {"name": "data", "persistentVolumeClaim": {"claimName": spec.storage.pvc.claim_name}}
        )
    env = _env(spec) + _api_key_env(api_key)
    if component == WORKER and spec.model is not None:
        # The worker loads the model as an EmbeddingService's pods do: the model-cache
        # volume at /cache, HF_HOME on it, offline for a read-only cache, the Hub token.
        cache = spec.model_cache
        claim = cache.claim_name if cache is not None and cache.mode == "existing" else None
        read_only = cache is not None and cache.read_only
        mounts.append(model_cache_mount(read_only))
        volumes.append(model_cache_volume(claim, read_only))
        env = hub_env(spec.model.hub_token_secret_ref, read_only) + env
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "command": ["embedding-server"],
        "args": args,
        "env": env,
        "resources": _resources(spec, component),
        # A worker that dies before writing its message leaves its last log lines instead:
        # what the operator reports for a failed planner.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # the Job controller retries; required by the policy
        "serviceAccountName": service_account_name(owner),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    pod.update(_placement(spec))
    return {"metadata": {"labels": job_labels(owner, component)}, "spec": pod}


def _placement(spec: EmbeddingJobSpec) -> dict[str, Any]:
    """``spec.scheduling``, in both pods, each field only when set (as the Deployment's)."""
    scheduling = spec.scheduling
    placement: dict[str, Any] = {}
    if scheduling.node_selector:
        placement["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        placement["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in scheduling.tolerations
        ]
    if scheduling.affinity:
        placement["affinity"] = scheduling.affinity
    if scheduling.priority_class_name:
        placement["priorityClassName"] = scheduling.priority_class_name
    return placement


def _pod_failure_policy() -> dict[str, Any]:
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER_NAME,
                    "operator": "In",
                    "values": [EXIT_BAD_ARGS],
                },
            },
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        ]
    }


def build_planner_job(
    owner: Owner, spec: EmbeddingJobSpec, image: str, pull_policy: str | None = None
) -> Manifest:
    """The planner: one pod, a couple of retries (a store that hiccups)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(owner, planner_name(owner), PLANNER),
        "spec": {
            "completions": 1,
            "parallelism": 1,
            "backoffLimit": PLANNER_BACKOFF_LIMIT,
            "suspend": spec.suspend,
            "podFailurePolicy": _pod_failure_policy(),
            "template": _pod_template(owner, spec, PLANNER, image, planner_args(spec), pull_policy),
        },
    }


def build_worker_job(
    owner: Owner,
    spec: EmbeddingJobSpec,
    *,
    shards: int,
    rows: int,
    image: str,
    service_url: str | None,
    model: str | None = None,
    pull_policy: str | None = None,
    api_key: SecretKeyRef | None = None,
) -> Manifest:
    """The Indexed Job of ``shards`` completions (``shards`` >= 1)."""
    if shards < 1:
        raise ValueError("a worker Job needs at least one shard")
    args = worker_args(spec, service_url, model)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(
            owner, worker_name(owner), WORKER, annotations={ROWS_ANNOTATION: str(rows)}
        ),
        "spec": {
            "completionMode": "Indexed",
            "completions": shards,
            **mutable_fields(spec, shards),
            "backoffLimitPerIndex": spec.backoff_limit_per_index,
            "podFailurePolicy": _pod_failure_policy(),
            "template": _pod_template(owner, spec, WORKER, image, args, pull_policy, api_key),
        },
    }


def mutable_fields(spec: EmbeddingJobSpec, shards: int | None) -> dict[str, Any]:
    """The fields of a Job's spec the reconciler keeps in step after creating it: ``suspend``
    (the Job controller stops the pods and keeps the completed indexes) and, for the workers,
    ``parallelism`` (never more pods than shards)."""
    if shards is None:
        return {"suspend": spec.suspend}
    return {"parallelism": min(spec.parallelism, shards), "suspend": spec.suspend}

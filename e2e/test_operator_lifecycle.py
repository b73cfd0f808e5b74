"""An EmbeddingService's life on the real control plane: change, drift, scale, delete, refuse.

What a user notices: a spec edit rolls out and Ready follows the new generation; a hand-edited
or deleted child comes back as specified; ``kubectl scale`` works through the scale
subresource; deleting the EmbeddingService garbage-collects every child; a bad manifest is
refused by ``kubectl apply`` with the offending field path; what only the operator can judge
(unknown GPU type, a child's name taken by an object we do not own) becomes a Degraded
condition plus an Event; tensor parallelism on the bundled server asks for a GPU per rank.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from e2e.harness.cluster import Cluster
from e2e.harness.operator import (
    OperatorProcess,
    apply_expect_refusal,
    embedding_service,
    get_json,
    wait_condition,
    wait_gone,
)
from e2e.harness.proc import poll_until

# The server pods here only need to be Running and Ready: kwok's fake nodes make them so.
pytestmark = pytest.mark.kwok

MODEL = {"name": "sentence-transformers/all-MiniLM-L6-v2"}
# A server image of the user's own: the operator trusts it with tensor parallelism (kwok runs
# no containers, so it never has to exist).
TP_IMAGE = "registry.example/embedding-server-tp:1"


def _create(cluster: Cluster, namespace: str, name: str, spec: dict[str, Any]) -> None:
    cluster.apply(embedding_service(name, spec), namespace=namespace)


def _deployment(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    obj = get_json(cluster, "deployment", name, "-n", namespace)
    assert obj is not None
    return obj


def _args(deployment: dict[str, Any]) -> list[str]:
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def _patch(
    cluster: Cluster,
    namespace: str,
    kind: str,
    name: str,
    patch: dict[str, Any] | list[dict[str, Any]],
    patch_type: str = "merge",
) -> None:
    cluster.kubectl(
        "patch", kind, name, "-n", namespace, "--type", patch_type, "-p", json.dumps(patch)
    )


def test_spec_change_rolls_out(cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    """A change of the model (dtype) rolls out blue/green (<name>-next, then the switch, then
    <name> updated) to the end. kwok's pods serve nothing, so there are no golden vectors to
    record: the contract is disabled and the switch waits on readiness alone (the real node's
    tests run it with golden vectors)."""
    off = {"contract": {"policy": "disabled"}}
    _create(cluster, namespace, "roll", {"model": MODEL, "gpu": {"type": "l4"}, **off})
    first = wait_condition(cluster, namespace, "roll", "Ready", "True")
    before = _deployment(cluster, namespace, "roll")

    _patch(
        cluster,
        namespace,
        "embsvc",
        "roll",
        {
            "spec": {
                "server": {"dtype": "float16", "image": TP_IMAGE},
                "parallelism": {"tensorParallelSize": 2},
                "replicas": 2,
            }
        },
    )
    # Ready turns True once one replica serves the new spec; the rollout is over (every
    # replica ready) only when Progressing turns False.
    wait_condition(cluster, namespace, "roll", "Progressing", "False", reason="RolloutComplete")
    after_es = wait_condition(cluster, namespace, "roll", "Ready", "True")
    assert after_es["status"]["rollout"]["phase"] == "Stable"
    assert get_json(cluster, "deployment", "roll-next", "-n", namespace) is None
    assert after_es["metadata"]["generation"] > first["metadata"]["generation"]
    after = _deployment(cluster, namespace, "roll")
    args = _args(after)
    assert args[args.index("--dtype") + 1] == "float16"
    container = after["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == TP_IMAGE
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert after["spec"]["replicas"] == 2
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    assert after_es["status"]["readyReplicas"] == 2
    # More than one replica now: a PodDisruptionBudget protects them.
    pdb = get_json(cluster, "pdb", "roll", "-n", namespace)
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1


def test_drift_is_corrected(cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    _create(
        cluster,
        namespace,
        "drift",
        {"model": MODEL, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3}},
    )
    wait_condition(cluster, namespace, "drift", "Ready", "True")

    # Someone edits the container image and the Service port by hand.
    _patch(
        cluster,
        namespace,
        "deployment",
        "drift",
        {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [{"name": "embedding-server", "image": "evil/image:latest"}]
                    }
                }
            }
        },
        patch_type="strategic",
    )
    _patch(
        cluster,
        namespace,
        "service",
        "drift",
        [{"op": "replace", "path": "/spec/ports/0/port", "value": 9999}],
        patch_type="json",
    )
    poll_until(
        lambda: (
            _deployment(cluster, namespace, "drift")["spec"]["template"]["spec"]["containers"][0][
                "image"
            ]
            != "evil/image:latest"
        ),
        timeout=60,
        what="the Deployment's image restored",
    )
    poll_until(
        lambda: (
            (get_json(cluster, "service", "drift", "-n", namespace) or {})
            .get("spec", {})
            .get("ports", [{}])[0]
            .get("port")
            == 80
        ),
        timeout=60,
        what="the Service port restored",
    )

    # ... and deletes children outright.
    for kind in ("service", "hpa", "deployment"):
        uid = (get_json(cluster, kind, "drift", "-n", namespace) or {})["metadata"]["uid"]
        cluster.kubectl("delete", kind, "drift", "-n", namespace, "--wait=false")
        poll_until(
            lambda k=kind, u=uid: (
                (get_json(cluster, k, "drift", "-n", namespace) or {"metadata": {"uid": u}})[
                    "metadata"
                ]["uid"]
                != u
            ),
            timeout=60,
            what=f"the {kind} recreated",
        )
    wait_condition(cluster, namespace, "drift", "Ready", "True")


def test_scale_subresource(cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    _create(cluster, namespace, "scaled", {"model": MODEL})
    wait_condition(cluster, namespace, "scaled", "Ready", "True")
    cluster.kubectl("scale", "embsvc", "scaled", "-n", namespace, "--replicas=3")
    es = poll_until(
        lambda: (lambda o: o if o and o["status"].get("readyReplicas") == 3 else None)(
            get_json(cluster, "embsvc", "scaled", "-n", namespace)
        ),
        timeout=90,
        what="3 ready replicas",
    )
    assert _deployment(cluster, namespace, "scaled")["spec"]["replicas"] == 3
    scale = json.loads(
        cluster.kubectl(
            "get",
            "--raw",
            f"/apis/embedding-operator.dev/v1alpha1/namespaces/"
            f"{namespace}/embeddingservices/scaled/scale",
        ).stdout
    )
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == es["status"]["selector"]


def test_delete_garbage_collects_children(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    _create(
        cluster,
        namespace,
        "doomed",
        {
            "model": MODEL,
            "replicas": 2,
            "autoscaling": {"enabled": True, "maxReplicas": 2},
            "modelCache": {"mode": "pvc", "size": "1Gi"},
        },
    )
    poll_until(
        lambda: get_json(cluster, "pdb", "doomed", "-n", namespace),
        timeout=60,
        what="children created",
    )
    cluster.kubectl("delete", "embsvc", "doomed", "-n", namespace)
    for kind, name in (
        ("deployment", "doomed"),
        ("service", "doomed"),
        ("hpa", "doomed"),
        ("pdb", "doomed"),
        ("pvc", "doomed-model-cache"),
    ):
        wait_gone(cluster, kind, name, "-n", namespace, timeout=90)
    pods = get_json(cluster, "pods", "-n", namespace, "-l", "app.kubernetes.io/instance=doomed")
    poll_until(
        lambda: (
            not (
                get_json(
                    cluster, "pods", "-n", namespace, "-l", "app.kubernetes.io/instance=doomed"
                )
                or {}
            ).get("items")
        ),
        timeout=90,
        what="pods deleted",
    )
    assert pods is not None


def test_namesake_is_never_adopted(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """A team's own Service named like the EmbeddingService: reported, never written, and not
    garbage-collected when the EmbeddingService goes (it never gets our ownerReference)."""
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "postgres", "labels": {"team": "db"}},
        "spec": {"selector": {"app": "postgres"}, "ports": [{"name": "pg", "port": 5432}]},
    }
    cluster.apply(theirs, namespace=namespace)
    before = get_json(cluster, "service", "postgres", "-n", namespace)
    assert before is not None
    _create(cluster, namespace, "postgres", {"model": MODEL})
    # A sibling with no conflict: the positive control for garbage collection below.
    _create(cluster, namespace, "sibling", {"model": MODEL})

    message = _degraded_without_deployment(cluster, namespace, "postgres", "ChildConflict")
    assert f"Service {namespace}/postgres already exists" in message, message
    event = _events(cluster, namespace, "postgres", "ChildConflict")[0]
    assert f"Service {namespace}/postgres" in event["message"], event
    wait_condition(cluster, namespace, "sibling", "Ready", "True")

    cluster.kubectl("delete", "embsvc", "postgres", "sibling", "-n", namespace)
    wait_gone(cluster, "deployment", "sibling", "-n", namespace, timeout=90)
    wait_gone(cluster, "service", "sibling", "-n", namespace, timeout=90)
    after = get_json(cluster, "service", "postgres", "-n", namespace)
    assert after is not None, "the team's Service was garbage-collected with the CR"
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert not after["metadata"].get("ownerReferences")
    assert [f["manager"] for f in after["metadata"].get("managedFields") or []] == [
        f["manager"] for f in before["metadata"].get("managedFields") or []
    ]
    assert operator.alive()


def test_network_policy_follows_the_spec(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    spec = {"model": MODEL, "networkPolicy": {"enabled": True, "allowedNamespaces": ["apps"]}}
    _create(cluster, namespace, "fenced", spec)
    wait_condition(cluster, namespace, "fenced", "Ready", "True")
    policy = get_json(cluster, "networkpolicy", "fenced", "-n", namespace)
    assert policy is not None
    # Clients get the client port; the operator's namespace the probe port (golden vectors).
    rule, operator_rule = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == sorted(["apps", namespace])
    assert operator_rule["ports"] == [{"protocol": "TCP", "port": 8001}]
    (operator_peer,) = operator_rule["from"]
    assert len(operator_peer["namespaceSelector"]["matchExpressions"][0]["values"]) == 1
    deployment = _deployment(cluster, namespace, "fenced")
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    _patch(cluster, namespace, "embsvc", "fenced", {"spec": {"networkPolicy": None}})
    wait_gone(cluster, "networkpolicy", "fenced", "-n", namespace, timeout=60)


BAD = [
    (
        "spec.parallelism.tensorParallelSize",
        {"model": MODEL, "gpu": {"type": "h100"}, "parallelism": {"tensorParallelSize": 3}},
    ),
    ("spec.replicas", {"model": MODEL, "replicas": -1}),
    (
        "spec.autoscaling.minReplicas",
        {"model": MODEL, "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
    ),
    ("spec.embedding.dimensions", {"model": MODEL, "embedding": {"dimensions": 0}}),
    ("spec.embedding.pooling", {"model": MODEL, "embedding": {"pooling": "median"}}),
    ("spec.modelCache.size", {"model": MODEL, "modelCache": {"mode": "pvc"}}),
    (
        "spec.modelCache.readOnly",
        {"model": MODEL, "modelCache": {"mode": "pvc", "size": "1Gi", "readOnly": True}},
    ),
    ("spec.model", {"embedding": {}}),
    ("spec.bogusField", {"model": MODEL, "bogusField": 1}),
    (
        "spec.networkPolicy.enabled",
        {"model": MODEL, "networkPolicy": {"allowedNamespaces": ["apps"]}},
    ),
    (
        "spec.networkPolicy.allowedNamespaces[0]",
        {"model": MODEL, "networkPolicy": {"enabled": True, "allowedNamespaces": ["Not_A_Name"]}},
    ),
    ("spec.resources.limits", {"model": MODEL, "resources": {"limits": {"nvidia.com/gpu": 1}}}),
    (
        "spec.server.maxRequestTokens",
        {"model": MODEL, "server": {"maxQueueTokens": 1000, "maxRequestTokens": 1001}},
    ),
    (
        "spec.server.maxRequestTokens",
        {"model": MODEL, "embedding": {"maxInputTokens": 512}, "server": {"maxRequestTokens": 8}},
    ),
    # A name that spells a version of a model (name@fingerprint) is the gateway's to give.
    ("spec.servedModelName", {"model": MODEL, "servedModelName": "bge@0123abcd"}),
    (
        "spec.servedModelAliases[1]",
        {"model": MODEL, "servedModelAliases": ["fine", "bge@0123456789ABCDEF"]},
    ),
    # int8 where the server would refuse it at start: a GPU, bfloat16, tensor parallelism.
    (
        "spec.server.quantization",
        {"model": MODEL, "server": {"quantization": "int8"}, "gpu": {"type": "h100"}},
    ),
    (
        "spec.server.quantization",
        {"model": MODEL, "server": {"quantization": "int8", "dtype": "bfloat16"}},
    ),
    (
        "spec.server.quantization",
        {
            "model": MODEL,
            "server": {"quantization": "int8"},
            "parallelism": {"tensorParallelSize": 2},
        },
    ),
    # The prefix cache where the server would refuse it at start.
    (
        "spec.server.prefixCache",
        {"model": MODEL, "server": {"prefixCache": "64Mi", "backend": "transformers"}},
    ),
]


@pytest.mark.parametrize(("path", "spec"), BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_invalid_manifests_refused_with_field_path(
    cluster: Cluster, namespace: str, path: str, spec: dict[str, Any]
) -> None:
    result = apply_expect_refusal(cluster, embedding_service("bad", spec), namespace)
    assert path in result.stderr, result.stderr
    assert get_json(cluster, "embsvc", "bad", "-n", namespace) is None


def test_kubectl_explain_reads_well(cluster: Cluster) -> None:
    out = cluster.kubectl("explain", "embsvc.spec.autoscaling.metric").stdout
    assert "queueTokens" in out and "embedding_server_queue_tokens" in out
    out = cluster.kubectl("explain", "embeddingservices.spec.parallelism").stdout
    assert "tensorParallelSize" in out and "GPUs per replica" in out


def _events(cluster: Cluster, namespace: str, name: str, reason: str) -> list[dict[str, Any]]:
    listing = get_json(
        cluster,
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={name},reason={reason}",
    )
    return list((listing or {}).get("items") or [])


def _degraded_without_deployment(cluster: Cluster, namespace: str, name: str, reason: str) -> str:
    """Wait for Degraded with ``reason``; check Ready=False, a Warning Event and no
    Deployment; return the Degraded message."""
    es = wait_condition(cluster, namespace, name, "Degraded", "True", reason=reason)
    degraded = next(c for c in es["status"]["conditions"] if c["type"] == "Degraded")
    ready = next(c for c in es["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    events = poll_until(
        lambda: _events(cluster, namespace, name, reason) or None,
        timeout=30,
        what=f"a {reason} event",
    )
    assert events[0]["type"] == "Warning"
    assert get_json(cluster, "deployment", name, "-n", namespace) is None
    return str(degraded["message"])


def test_unknown_gpu_type_is_degraded_with_event(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    _create(cluster, namespace, "tpu", {"model": MODEL, "gpu": {"type": "tpu-v5"}})
    message = _degraded_without_deployment(cluster, namespace, "tpu", "UnknownGPUType")
    assert "spec.gpu.type" in message and "tpu-v5" in message

    # The fix is an edit: the operator picks it up without a restart.
    _patch(cluster, namespace, "embsvc", "tpu", {"spec": {"gpu": {"type": "h100"}}})
    es = wait_condition(cluster, namespace, "tpu", "Ready", "True")
    degraded = next(c for c in es["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"
    assert operator.alive()


def test_tensor_parallel_on_the_bundled_server_asks_for_a_gpu_per_rank(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    spec = {"model": MODEL, "gpu": {"type": "h100"}, "parallelism": {"tensorParallelSize": 2}}
    _create(cluster, namespace, "tp", spec)
    es = wait_condition(cluster, namespace, "tp", "Ready", "True")
    degraded = next(c for c in es["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"
    deployment = _deployment(cluster, namespace, "tp")
    args = _args(deployment)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert operator.alive()


def test_secret_reference_reaches_the_pod_without_secret_access(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """The operator never reads Secrets (the chart grants it none): a Secret reference goes into
    the pod as it is, and a missing one is the kubelet's to report. kwok runs no kubelet, so the
    ``SecretNotFound`` condition from the pod's own failure is checked on the real node
    (``test_real_node.py``); here: no access, and the Deployment is created regardless."""
    for verb in ("get", "list", "watch"):
        answer = cluster.kubectl(
            "auth",
            "can-i",
            verb,
            "secrets",
            "-n",
            namespace,
            kubeconfig=operator.kubeconfig,
            check=False,
        )
        assert answer.stdout.strip() == "no", (verb, answer.stdout, answer.stderr)
    _create(
        cluster, namespace, "locked", {"model": MODEL, "apiKeySecretRef": {"name": "locked-key"}}
    )
    poll_until(
        lambda: get_json(cluster, "deployment", "locked", "-n", namespace),
        timeout=60,
        what="the Deployment of an EmbeddingService whose Secret does not exist yet",
    )
    env = _deployment(cluster, namespace, "locked")["spec"]["template"]["spec"]["containers"][0][
        "env"
    ]
    assert {
        "name": "EMBEDDING_SERVER_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "locked-key", "key": "api-key"}},
    } in env
    assert not [line for line in operator.log_text().splitlines() if "forbidden: User" in line]


def test_operator_writes_no_bookkeeping_annotations(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    _create(cluster, namespace, "tidy", {"model": MODEL})
    es = wait_condition(cluster, namespace, "tidy", "Ready", "True")
    annotations = es["metadata"].get("annotations") or {}
    # No bookkeeping annotation at all (the operator writes nothing on the object but its
    # status: kopf's create/update handlers and their last-handled-configuration PATCH are
    # gone), and never under kopf.zalando.org.
    assert not [k for k in annotations if k.startswith(("kopf.", "embedding-operator.dev/"))], (
        annotations
    )
    assert not es["metadata"].get("finalizers")
    assert "kopf" not in es["status"] and "phase" not in es["status"]
    # Least privilege is enough: no RBAC denial anywhere in the operator's log.
    assert not [line for line in operator.log_text().splitlines() if "forbidden: User" in line]

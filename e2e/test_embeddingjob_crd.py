"""The EmbeddingJob CRD on the real API server: its CEL rules refuse, with the field path, what
the unit tests say they refuse, the fields that shape the shards are immutable, and suspend
and parallelism stay editable. No operator is needed: the API server alone judges these.
"""

from __future__ import annotations

from typing import Any

import pytest

from e2e.harness.cluster import Cluster
from e2e.harness.operator import apply_expect_refusal, get_json

pytestmark = pytest.mark.kwok

GOOD: dict[str, Any] = {
    "service": "minilm",
    "input": {"urls": ["s3://corpus/docs/*.parquet"], "format": "parquet"},
    "output": {"url": "s3://corpus/out/"},
    "storage": {"s3": {"credentialsSecret": {"name": "corpus-s3"}}},
}


def embedding_job(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingJob",
        "metadata": {"name": name},
        "spec": spec,
    }


BAD: list[tuple[str, dict[str, Any]]] = [
    ("storage.s3 is required", {k: v for k, v in GOOD.items() if k != "storage"}),
    ("storage.pvc is required", {**GOOD, "output": {"url": "/data/out"}}),
    ("storage.pvc is set but", {**GOOD, "storage": {"s3": {}, "pvc": {"claimName": "c"}}}),
    ("storage names s3, pvc or both", {**GOOD, "storage": {}}),
    ("spec.parallelism", {**GOOD, "parallelism": 0}),
    ("spec.input.format", {**GOOD, "input": {"urls": ["s3://corpus/a"], "format": "xml"}}),
    ("spec.output.url", {**GOOD, "output": {"url": "https://corpus/out"}}),
    ("spec.service: Forbidden: service and model are exclusive", {**GOOD, "model": {"name": "m"}}),
    (
        "spec.service: Required value: one of service and model is required",
        {k: v for k, v in GOOD.items() if k != "service"},
    ),
    (
        "spec.modelCache: Forbidden: modelCache applies with model only",
        {**GOOD, "modelCache": {"mode": "none"}},
    ),
    ("spec.output.vectors", {**GOOD, "output": {"url": "s3://corpus/out/", "vectors": []}}),
    (
        'spec.output.vectors[1]: Unsupported value: "colbert"',
        {**GOOD, "output": {"url": "s3://corpus/out/", "vectors": ["dense", "colbert"]}},
    ),
    (
        'spec.output.vectors[1]: Duplicate value: "dense"',
        {**GOOD, "output": {"url": "s3://corpus/out/", "vectors": ["dense", "dense"]}},
    ),
    (
        "output.vectors must be [dense] when input.imageField is set",
        {
            **GOOD,
            "input": {**GOOD["input"], "imageField": "url"},
            "output": {"url": "s3://corpus/out/", "vectors": ["dense", "sparse"]},
        },
    ),
    (
        "input.imageField and input.textField are exclusive",
        {**GOOD, "input": {**GOOD["input"], "textField": "caption", "imageField": "url"}},
    ),
    ("spec.output.format", {**GOOD, "output": {"url": "s3://corpus/out/", "format": "csv"}}),
]


@pytest.mark.parametrize(("said", "spec"), BAD, ids=[f"{s}-{i}" for i, (s, _) in enumerate(BAD)])
def test_bad_embedding_jobs_are_refused_with_the_reason(
    cluster: Cluster, namespace: str, said: str, spec: dict[str, Any]
) -> None:
    result = apply_expect_refusal(cluster, embedding_job("bad", spec), namespace)
    assert said in result.stderr, result.stderr
    assert get_json(cluster, "embeddingjob", "bad", "-n", namespace) is None


def test_the_shards_are_fixed_but_suspend_and_parallelism_are_not(
    cluster: Cluster, namespace: str
) -> None:
    cluster.apply(embedding_job("corpus", GOOD), namespace=namespace)
    changed = {**GOOD, "input": {"urls": ["s3://corpus/other/*.parquet"], "format": "parquet"}}
    result = apply_expect_refusal(cluster, embedding_job("corpus", changed), namespace)
    assert "input cannot be changed once the job exists" in result.stderr, result.stderr
    cluster.apply(
        embedding_job("corpus", {**GOOD, "suspend": True, "parallelism": 3}), namespace=namespace
    )
    job = get_json(cluster, "embeddingjob", "corpus", "-n", namespace)
    assert job is not None
    assert job["spec"]["suspend"] is True and job["spec"]["parallelism"] == 3
    assert job["spec"]["input"]["idField"] == "id"  # the schema's default
    assert job["spec"]["output"]["format"] == "parquet"
